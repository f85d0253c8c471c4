"""Exact acceptance probabilities of multi-draft verification schemes.

Acceptance is defined as ``P(output token in drafts)`` (the optimal-transport
objective: the tree can continue below the emitted child whenever it was
drafted).  ``event="accepted"`` gives instead ``P(some draft passes its
test)``; the two differ only when the residual can emit a drafted token:
for ``"kseq"`` and ``"greedy_draft"`` (its residual ``(p - q')^+`` keeps the
mass ``p(T)`` on the fixed tokens ``T``, so ``P(output in drafts) =
P(accepted) + p(T)``).  For all others rejected drafts get zero residual mass.

Verifiers (``verifier``) and their draft laws
--------------------------------------------
=========================  =====================  ====================================
name                       draft law              exact method (``method="auto"``)
=========================  =====================  ====================================
``"single"`` (n = 1)       iid                    ``sum min(p, q)``
``"rrs"``                  iid                    ``1 - prod_i (1 - beta_i)``, O(nV)
``"rrs_without_replacement"`` without_replacement recursion over rejected tokens, O(V^n)
``"kseq"`` (SpecTr)        iid                    ``1 - (1 - beta)^n`` (+ residual term), O(V)
``"spechub"`` (n = 2)      spechub pair law       closed-form transport plan, O(V)
``"greedy_draft"``         greedy                 ``p(T) + sum_{y not in T} min(p, q')``, O(V)
``"deterministic"``        deterministic top-n    ``p(top-n of q)``, O(V)
=========================  =====================  ====================================

``method="enumerate"`` instead enumerates every ordered draft tuple and runs
the verifier's sequential tests exactly (small ``V`` only); it also returns
the full output distribution, which the tests compare with ``p``
(losslessness).

References
----------
Leviathan et al., "Fast Inference from Transformers via Speculative Decoding", arXiv:2211.17192.
Miao et al., "SpecInfer", arXiv:2305.09781 (recursive rejection sampling).
Jeon et al., "Recursive Speculative Decoding", arXiv:2402.14160 (without replacement).
Sun et al., "SpecTr: Fast Speculative Decoding via Optimal Transport", arXiv:2310.15141 (K-SEQ).
Sun et al., "SpecHub: Provable Acceleration to Multi-Draft Speculative Decoding", arXiv:2411.05289.
Hu et al., "Towards Optimal Multi-draft Speculative Decoding", ICLR 2025, arXiv:2502.18779 (greedy drafting).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
from numpy.typing import ArrayLike, NDArray
from scipy import optimize

from ._validation import check_distributions, check_n, check_small_vocab
from .draft_laws import draft_tuple_law, greedy_parts, top_indices

VERIFIERS: tuple[str, ...] = (
    "single",
    "rrs",
    "rrs_without_replacement",
    "kseq",
    "spechub",
    "greedy_draft",
    "deterministic",
)

#: Draft law (``sampling``) of each verifier, for comparison with ``optimal_acceptance``.
VERIFIER_LAW: dict[str, str] = {
    "single": "iid",
    "rrs": "iid",
    "rrs_without_replacement": "without_replacement",
    "kseq": "iid",
    "spechub": "spechub",
    "greedy_draft": "greedy_draft",
    "deterministic": "deterministic",
}

_EPS = 1e-15


@dataclass(frozen=True)
class VerifierOutcome:
    """Exact outcome of one verifier at one node (from full enumeration).

    Attributes
    ----------
    in_drafts : float
        ``P(output in drafts)``.
    accepted : float
        ``P(some draft accepted)``.
    accepted_at : ndarray, shape (m,)
        ``P(the k-th draft is the accepted one)`` (Sequoia's positional vector).
    output : ndarray, shape (V,)
        Law of the emitted token (equals ``p`` for a lossless verifier).
    """

    in_drafts: float
    accepted: float
    accepted_at: NDArray[np.float64]
    output: NDArray[np.float64]


def _check_verifier(verifier: object, n: int) -> str:
    if verifier not in VERIFIERS:
        raise ValueError(f"unknown verifier {verifier!r}; expected one of {list(VERIFIERS)}")
    if verifier == "single" and n != 1:
        raise ValueError(f"verifier 'single' needs n = 1, got n = {n}")
    if verifier == "spechub" and n != 2:
        raise ValueError(f"verifier 'spechub' is defined for n = 2 only, got n = {n}")
    return str(verifier)


def _normalise(x: NDArray[np.float64]) -> NDArray[np.float64]:
    total = x.sum()
    return x / total if total > 0.0 else np.zeros_like(x)


def _residual(r: NDArray[np.float64], q: NDArray[np.float64]) -> NDArray[np.float64]:
    return _normalise(np.maximum(r - q, 0.0))


def kseq_rho(p: NDArray[np.float64], q: NDArray[np.float64], n: int) -> float:
    """SpecTr's ``rho*`` in ``[1, n]``: smallest root of ``1 - (1 - beta)^n = rho beta``.

    ``beta(rho) = sum min(q, p / rho)``.  Returned slightly above the root if
    needed so that the residual is nonnegative.

    Examples
    --------
    >>> kseq_rho(np.array([0.5, 0.5]), np.array([0.5, 0.5]), 3)
    1.0
    """

    def gap(rho: float) -> float:
        beta = float(np.minimum(q, p / rho).sum())
        # 1 - (1 - beta)^n without cancellation (beta can be ~1e-13)
        return -float(np.expm1(n * np.log1p(-beta))) - rho * beta if beta < 1.0 else 1.0 - rho

    if n == 1 or gap(1.0) <= 0.0:
        return 1.0
    if gap(float(n)) >= 0.0:  # gap(n) <= 0 in exact arithmetic: the root is n up to rounding
        return float(n)
    rho = float(optimize.brentq(gap, 1.0, float(n), xtol=1e-15, rtol=1e-15))
    for _ in range(60):
        if gap(rho) <= 0.0:
            break
        rho = min(rho * (1.0 + 1e-13), float(n))
    return rho


def _kseq_parts(p, q, n):
    rho = kseq_rho(p, q, n)
    accept = np.minimum(q, p / rho)  # shape (V,): q(x) * min(1, p(x) / (rho q(x)))
    beta = float(accept.sum())
    total_accept = 1.0 - (1.0 - beta) ** n
    res = np.maximum(p - accept * (total_accept / beta if beta > 0 else 0.0), 0.0)
    return rho, beta, total_accept, _normalise(res)


def _spechub_plan(p: NDArray[np.float64], q: NDArray[np.float64]):
    """Flows of SpecHub's transport plan (hub a = argmax q)."""
    a = int(np.argmax(q))
    qa = float(q[a])
    others = np.ones(q.size, dtype=bool)
    others[a] = False
    q_ia = np.where(others, q, 0.0)  # pair (i, a): first draft i, second a
    rest = float(q[others].sum())  # = 1 - q_a, summed directly for accuracy
    if rest > 0:
        q_ai = np.where(others, qa * q / rest, 0.0)
    else:  # point-mass q: second draft uniform on the other tokens (engine convention)
        q_ai = np.where(others, qa / max(q.size - 1, 1), 0.0)
    f1 = np.where(others, np.minimum(p, q_ia), 0.0)  # accept i as first draft
    f2 = np.where(others, np.minimum(p - f1, q_ai), 0.0)  # accept i as second draft
    left_ai = q_ai - f2
    left_ia = q_ia - f1
    l1, l2 = float(left_ai.sum()), float(left_ia.sum())
    fa1 = min(float(p[a]), l1)  # hub accepted from (a, i) leftovers first
    fa2 = min(float(p[a]) - fa1, l2)  # then from (i, a) leftovers
    return a, q_ia, q_ai, f1, f2, left_ia, left_ai, fa1, fa2


def _rrs_wor_recursive(r: NDArray[np.float64], qc: NDArray[np.float64], k: int) -> float:
    if k == 0 or qc.sum() <= _EPS:
        return 0.0
    beta = float(np.minimum(r, qc).sum())
    reject = np.maximum(qc - r, 0.0)  # P(draw x and reject it)
    if reject.sum() <= _EPS or k == 1:
        return beta
    r_next = _residual(r, qc)
    total = beta
    for x in np.flatnonzero(reject > _EPS):
        q_next = qc.copy()
        q_next[x] = 0.0
        total += reject[x] * _rrs_wor_recursive(r_next, _normalise(q_next), k - 1)
    return total


def _analytic(p: NDArray[np.float64], q: NDArray[np.float64], n: int, verifier: str, event: str) -> float:
    if verifier == "single":
        return float(np.minimum(p, q).sum())
    if verifier == "rrs":
        r, miss = p, 1.0
        for _ in range(n):
            beta = float(np.minimum(r, q).sum())
            miss *= 1.0 - beta
            r = _residual(r, q)
        return 1.0 - miss
    if verifier == "kseq":
        _rho, beta, total_accept, res = _kseq_parts(p, q, n)
        if event == "accepted" or beta >= 1.0:
            return total_accept
        q_rej = np.maximum(q - np.minimum(q, p / _rho), 0.0) / (1.0 - beta)
        hit = 1.0 - (1.0 - q_rej) ** n  # P(token y among the n rejected iid drafts)
        return total_accept + (1.0 - beta) ** n * float(res @ hit)
    if verifier == "spechub":
        if q.size == 1:  # one token: the single draft argmax q
            return float(p[int(np.argmax(q))])
        _a, *_rest, f1, f2, _l1, _l2, fa1, fa2 = _spechub_plan(p, q)
        return float(f1.sum() + f2.sum() + fa1 + fa2)
    if verifier == "greedy_draft":
        fixed, rest = greedy_parts(q, n)
        accepted = float(np.minimum(p, rest).sum())
        return accepted if event == "accepted" else accepted + float(p[fixed].sum())
    if verifier == "deterministic":
        return float(p[top_indices(q, n)].sum())
    if verifier == "rrs_without_replacement":
        check_small_vocab(p.size, n, "without_replacement", 2_000_000, "rrs_without_replacement acceptance",
                          advice="Use a smaller n (its recursion visits every ordered draft tuple).")
        return _rrs_wor_recursive(p, q, n)
    raise AssertionError(verifier)


class _Tally:
    """What the enumeration accumulates: ``P(the k-th draft is accepted)`` and the law of the emitted token."""

    def __init__(self, m: int, v: int) -> None:
        self.accepted_at = np.zeros(m)  # shape (m,)
        self.output = np.zeros(v)  # shape (V,)

    def accept(self, position: int, token: int, mass: float) -> None:
        self.accepted_at[position] += mass
        self.output[token] += mass


#: one ordered draft tuple through a verifier's tests: (tuple, its probability, tally) -> (P(no draft accepted
#: | tuple), the residual law the output is drawn from then)
_Walk = Callable[[list[int], float, _Tally], tuple[float, NDArray[np.float64]]]


def _sequential_walk(pa: NDArray[np.float64], qa: NDArray[np.float64], without_replacement: bool) -> _Walk:
    """single / rrs / rrs_without_replacement: each draft tested against the residual left by the previous ones."""

    def walk(tup: list[int], prob: float, tally: _Tally) -> tuple[float, NDArray[np.float64]]:
        alive, r, qc = 1.0, pa, qa
        for i, x in enumerate(tup):
            acc = min(1.0, r[x] / qc[x]) if qc[x] > 0 else 0.0
            tally.accept(i, x, prob * alive * acc)
            alive *= 1.0 - acc
            r_new = _residual(r, qc)
            if without_replacement:
                qc = qc.copy()
                qc[x] = 0.0
                qc = _normalise(qc)
            r = r_new if r_new.sum() > 0 else r
        return alive, r

    return walk


def _kseq_walk(pa: NDArray[np.float64], qa: NDArray[np.float64], n: int) -> _Walk:
    rho, _beta, _tot, kseq_res = _kseq_parts(pa, qa, n)

    def walk(tup: list[int], prob: float, tally: _Tally) -> tuple[float, NDArray[np.float64]]:
        alive = 1.0
        for i, x in enumerate(tup):
            acc = min(1.0, pa[x] / (rho * qa[x]))
            tally.accept(i, x, prob * alive * acc)
            alive *= 1.0 - acc
        return alive, kseq_res

    return walk


def _spechub_walk(pa: NDArray[np.float64], qa: NDArray[np.float64]) -> _Walk:
    a, q_ia, q_ai, f1, f2, left_ia, left_ai, fa1, fa2 = _spechub_plan(pa, qa)
    res_hub = pa.copy()
    res_hub -= f1 + f2
    res_hub[a] -= fa1 + fa2
    res_hub = _normalise(np.maximum(res_hub, 0.0))

    def walk(tup: list[int], prob: float, tally: _Tally) -> tuple[float, NDArray[np.float64]]:
        if len(set(tup)) == 1:  # q is a point mass: single draft a
            x = tup[0]
            acc = min(1.0, pa[x])
            tally.accept(0, x, prob * acc)
            return 1.0 - acc, _residual(pa, qa)
        x1, x2 = tup
        if x2 == a:  # pair (i, a)
            i, mass, flow_i, left = x1, q_ia[x1], f1[x1], left_ia[x1]
            flow_a = left * (fa2 / left_ia.sum() if left_ia.sum() > 0 else 0.0)
            pos_i, pos_a = 0, 1
        else:  # pair (a, i)
            i, mass, flow_i, left = x2, q_ai[x2], f2[x2], left_ai[x2]
            flow_a = left * (fa1 / left_ai.sum() if left_ai.sum() > 0 else 0.0)
            pos_i, pos_a = 1, 0
        acc_i, acc_a = flow_i / mass, flow_a / mass
        tally.accept(pos_i, i, prob * acc_i)
        tally.accept(pos_a, a, prob * acc_a)
        return max(1.0 - acc_i - acc_a, 0.0), res_hub

    return walk


def _greedy_draft_walk(pa: NDArray[np.float64], qa: NDArray[np.float64], n: int) -> _Walk:
    _fixed, rest = greedy_parts(qa, n)

    def walk(tup: list[int], prob: float, tally: _Tally) -> tuple[float, NDArray[np.float64]]:
        if not rest.any():
            return 1.0, pa
        x = tup[-1]
        acc = min(1.0, pa[x] / rest[x])
        tally.accept(len(tup) - 1, x, prob * acc)
        return 1.0 - acc, _residual(pa, rest)

    return walk


def _deterministic_walk(pa: NDArray[np.float64]) -> _Walk:
    def walk(tup: list[int], prob: float, tally: _Tally) -> tuple[float, NDArray[np.float64]]:
        alive, r = 1.0, pa
        for i, x in enumerate(tup):
            acc = r[x]
            tally.accept(i, x, prob * alive * acc)
            alive *= 1.0 - acc
            r = r.copy()
            r[x] = 0.0
            r = _normalise(r) if r.sum() > _EPS else r
        return alive, r

    return walk


def _walk(pa: NDArray[np.float64], qa: NDArray[np.float64], n: int, verifier: str) -> _Walk:
    if verifier in ("single", "rrs", "rrs_without_replacement"):
        return _sequential_walk(pa, qa, verifier == "rrs_without_replacement")
    if verifier == "kseq":
        return _kseq_walk(pa, qa, n)
    if verifier == "spechub":
        return _spechub_walk(pa, qa)
    if verifier == "greedy_draft":
        return _greedy_draft_walk(pa, qa, n)
    if verifier == "deterministic":
        return _deterministic_walk(pa)
    raise AssertionError(verifier)


def verifier_outcome(p: ArrayLike, q: ArrayLike, n: int, verifier: str) -> VerifierOutcome:
    """Exact outcome of a verifier by enumerating every ordered draft tuple.

    Small vocabularies only (about ``V^n`` tuples).  Each tuple is pushed
    through the verifier's sequential tests with exact probabilities.

    Examples
    --------
    >>> out = verifier_outcome([0.3, 0.7], [0.6, 0.4], 1, "single")
    >>> round(out.in_drafts, 6), out.output.round(6).tolist()
    (0.7, [0.3, 0.7])
    """
    pa, qa = check_distributions(p, q)
    n = check_n(n)
    verifier = _check_verifier(verifier, n)
    law_name = VERIFIER_LAW[verifier]
    check_small_vocab(pa.size, n, law_name, 200_000, "verifier_outcome")
    law = draft_tuple_law(qa, n, law_name)
    tally = _Tally(law.tuples.shape[1], pa.size)
    walk = _walk(pa, qa, n, verifier)
    in_drafts = 0.0
    for tup, prob in zip(law.tuples.tolist(), law.probs.tolist()):
        alive, residual = walk(tup, prob, tally)  # alive: P(no draft accepted | tuple)
        tally.output += prob * alive * residual
        in_drafts += prob * (1.0 - alive) + prob * alive * float(residual[sorted(set(tup))].sum())
    accepted = float(tally.accepted_at.sum())
    return VerifierOutcome(in_drafts=float(in_drafts), accepted=accepted, accepted_at=tally.accepted_at,
                           output=tally.output)


def verifier_acceptance(
    p: ArrayLike,
    q: ArrayLike,
    n: int,
    verifier: str,
    *,
    event: str = "in_drafts",
    method: str = "auto",
) -> float:
    """Exact acceptance probability of a multi-draft verifier at one node.

    Parameters
    ----------
    p, q : array_like, shape (V,)
        Target and draft distributions.
    n : int
        Number of drafted children.
    verifier : str
        One of :data:`VERIFIERS`.
    event : {"in_drafts", "accepted"}
        ``P(output in drafts)`` (default, bounded by ``optimal_acceptance`` of
        the verifier's draft law :data:`VERIFIER_LAW`) or ``P(a draft passes
        its test)``.
    method : {"auto", "analytic", "enumerate"}
        Closed forms / recursion (``"auto"`` = ``"analytic"``) or full
        enumeration of draft tuples (small ``V``).

    Returns
    -------
    float

    Examples
    --------
    >>> round(verifier_acceptance([0.3, 0.7], [0.6, 0.4], 2, "rrs"), 6)
    0.82
    >>> round(verifier_acceptance([0.3, 0.7], [0.6, 0.4], 2, "kseq", event="accepted"), 6)
    0.853238
    """
    pa, qa = check_distributions(p, q)
    n = check_n(n)
    verifier = _check_verifier(verifier, n)
    if event not in ("in_drafts", "accepted"):
        raise ValueError(f"unknown event {event!r}; expected 'in_drafts' or 'accepted'")
    if method not in ("auto", "analytic", "enumerate"):
        raise ValueError(f"unknown method {method!r}; expected 'auto', 'analytic' or 'enumerate'")
    if method == "enumerate":
        out = verifier_outcome(pa, qa, n, verifier)
        return out.in_drafts if event == "in_drafts" else out.accepted
    return float(min(max(_analytic(pa, qa, n, verifier, event), 0.0), 1.0))


def positional_acceptance(p: ArrayLike, q: ArrayLike, n: int, verifier: str) -> NDArray[np.float64]:
    """Sequoia's positional vector: ``P(the k-th child is the accepted one)``.

    Analytic for ``"rrs"`` (``prod_{j<k}(1 - beta_j) beta_k``) and ``"kseq"``
    (``(1 - beta)^k beta``), enumeration otherwise.

    Examples
    --------
    >>> positional_acceptance([0.3, 0.7], [0.6, 0.4], 2, "rrs").round(6).tolist()
    [0.7, 0.12]
    """
    pa, qa = check_distributions(p, q)
    n = check_n(n)
    verifier = _check_verifier(verifier, n)
    if verifier == "rrs":
        out, r, alive = np.zeros(n), pa, 1.0
        for k in range(n):
            beta = float(np.minimum(r, qa).sum())
            out[k] = alive * beta
            alive *= 1.0 - beta
            r = _residual(r, qa)
        return out
    if verifier == "kseq":
        _rho, beta, _tot, _res = _kseq_parts(pa, qa, n)
        return np.array([(1.0 - beta) ** k * beta for k in range(n)])
    return verifier_outcome(pa, qa, n, verifier).accepted_at
