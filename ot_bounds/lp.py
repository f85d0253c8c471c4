"""Primal optimal-transport linear program over all ordered draft tuples.

Variables ``pi[t, y] >= 0`` for every draft tuple ``t`` with ``Q(t) > 0`` and
token ``y``::

    maximise   sum_{t, y in t} pi[t, y]
    subject to sum_y pi[t, y] = Q(t)     (draft marginal)
               sum_t pi[t, y] = p(y)     (target marginal, losslessness)

Its dual is ``min sum_t Q(t) u_t + sum_y p(y) w_y`` subject to
``u_t + w_y >= 1[y in t]``; the 0/1 solution ``w = 1_H``, ``u_t = 1[t not in H]``
gives the subset formula of :mod:`ot_bounds.optimal`.  Only for small
vocabularies (``V^n x V`` variables).

Solved with cvxpy (default solver: HiGHS through cvxpy when available) or
directly with ``scipy.optimize.linprog(method="highs")`` (the fallback).

References
----------
Hu et al., "Towards Optimal Multi-draft Speculative Decoding", ICLR 2025, arXiv:2502.18779.
Sun et al., "Optimal Block-Level Draft Verification" / SpecTr, arXiv:2310.15141 (OT formulation of multi-draft verification).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike, NDArray
from scipy import optimize, sparse

from ._validation import check_distributions, check_n, check_small_vocab
from .draft_laws import check_law, draft_tuple_law

MAX_TUPLES = 20_000


@dataclass(frozen=True)
class LPResult:
    """Solution of the transport LP.

    Attributes
    ----------
    value : float
        Optimal primal value ``alpha*``.
    coupling : ndarray, shape (T, V)
        Optimal plan ``pi[t, y]``.
    tuples : ndarray of int64, shape (T, m)
        Draft tuples (rows of ``coupling``).
    tuple_probs : ndarray, shape (T,)
        ``Q(t)``.
    dual_tuple : ndarray, shape (T,)
        Dual variables ``u_t`` of the draft-marginal constraints.
    dual_token : ndarray, shape (V,)
        Dual variables ``w_y`` of the target-marginal constraints.
    dual_value : float
        ``sum_t Q(t) u_t + sum_y p(y) w_y`` (equals ``value`` at optimality).
    max_dual_violation : float
        ``max(0, max_{t,y} 1[y in t] - u_t - w_y)`` (dual feasibility check).
    solver : str
        ``"cvxpy:<SOLVER>"`` or ``"scipy-highs"``.
    """

    value: float
    coupling: NDArray[np.float64]
    tuples: NDArray[np.int64]
    tuple_probs: NDArray[np.float64]
    dual_tuple: NDArray[np.float64]
    dual_token: NDArray[np.float64]
    dual_value: float
    max_dual_violation: float
    solver: str


def _membership(tuples: NDArray[np.int64], v: int) -> NDArray[np.float64]:
    """member[t, y] = 1[y in tuple t], shape (T, V)."""
    member = np.zeros((tuples.shape[0], v))
    rows = np.repeat(np.arange(tuples.shape[0]), tuples.shape[1])
    member[rows, tuples.ravel()] = 1.0
    return member


def _solve_scipy(member: NDArray[np.float64], qt: NDArray[np.float64], p: NDArray[np.float64]):
    t_count, v = member.shape
    # variable index t * V + y
    a_rows = sparse.kron(sparse.eye(t_count), np.ones((1, v)))  # sum_y pi[t, y]
    a_cols = sparse.kron(np.ones((1, t_count)), sparse.eye(v))  # sum_t pi[t, y]
    a_eq = sparse.vstack([a_rows, a_cols]).tocsc()
    b_eq = np.concatenate([qt, p])
    # presolve off: with tuple probabilities below HiGHS' tolerances (1e-9 and less)
    # presolve can wrongly report infeasibility
    res = optimize.linprog(
        -member.ravel(), A_eq=a_eq, b_eq=b_eq, bounds=(0, None), method="highs", options={"presolve": False}
    )
    if res.status != 0:
        raise RuntimeError(f"linprog failed: {res.message}")
    duals = -np.asarray(res.eqlin.marginals)  # duals of the maximisation
    return float(-res.fun), res.x.reshape(t_count, v), duals[:t_count], duals[t_count:], "scipy-highs"


def _solve_cvxpy(member: NDArray[np.float64], qt: NDArray[np.float64], p: NDArray[np.float64]):
    import cvxpy as cp

    t_count, v = member.shape
    pi = cp.Variable((t_count, v), nonneg=True)
    cons_t = cp.sum(pi, axis=1) == qt
    cons_y = cp.sum(pi, axis=0) == p
    prob = cp.Problem(cp.Maximize(cp.sum(cp.multiply(member, pi))), [cons_t, cons_y])
    solver = "HIGHS" if "HIGHS" in cp.installed_solvers() else None
    prob.solve(solver=solver)
    if prob.status not in ("optimal", "optimal_inaccurate"):
        raise RuntimeError(f"cvxpy status {prob.status}")
    u = np.asarray(cons_t.dual_value, dtype=float).ravel()
    w = np.asarray(cons_y.dual_value, dtype=float).ravel()
    return float(prob.value), np.asarray(pi.value), u, w, f"cvxpy:{prob.solver_stats.solver_name}"


def lp_optimal_acceptance(
    p: ArrayLike, q: ArrayLike, n: int, sampling: str = "iid", solver: str = "auto"
) -> LPResult:
    """Optimal acceptance from the primal transport LP (small vocabularies).

    Parameters
    ----------
    p, q : array_like, shape (V,)
        Target and draft distributions.
    n : int
        Number of drafted children.
    sampling : str
        Any law of :data:`ot_bounds.draft_laws.TUPLE_LAWS`.
    solver : {"auto", "cvxpy", "scipy"}
        ``"auto"`` tries cvxpy and falls back to ``scipy.optimize.linprog``
        (HiGHS) if cvxpy is missing or fails.

    Returns
    -------
    LPResult

    Examples
    --------
    >>> res = lp_optimal_acceptance([0.1, 0.9], [0.6, 0.4], 2, solver="scipy")
    >>> round(res.value, 6), round(res.dual_value, 6)
    (0.74, 0.74)
    """
    pa, qa = check_distributions(p, q)
    n = check_n(n)
    sampling = check_law(sampling, n)
    if solver not in ("auto", "cvxpy", "scipy"):
        raise ValueError(f"unknown solver {solver!r}; expected 'auto', 'cvxpy' or 'scipy'")
    check_small_vocab(pa.size, n, sampling, MAX_TUPLES, "lp_optimal_acceptance")
    law = draft_tuple_law(qa, n, sampling)
    member = _membership(law.tuples, pa.size)  # shape (T, V)
    if solver == "scipy":
        out = _solve_scipy(member, law.probs, pa)
    else:
        try:
            out = _solve_cvxpy(member, law.probs, pa)
        except Exception:  # noqa: BLE001 - any cvxpy failure falls back to HiGHS
            if solver == "cvxpy":
                raise
            out = _solve_scipy(member, law.probs, pa)
    value, plan, u, w, name = out
    dual_value = float(law.probs @ u + pa @ w)
    violation = float(max(0.0, np.max(member - u[:, None] - w[None, :])))
    return LPResult(
        value=float(value),
        coupling=plan,
        tuples=law.tuples,
        tuple_probs=law.probs,
        dual_tuple=u,
        dual_token=w,
        dual_value=dual_value,
        max_dual_violation=violation,
        solver=name,
    )
