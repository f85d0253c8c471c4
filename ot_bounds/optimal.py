"""Optimal acceptance rate of multi-draft speculative decoding (fast, exact).

For a fixed draft law ``Q`` of the ordered ``n``-tuple of children, every
lossless verifier is a coupling of (drafts, output token) with marginals ``Q``
and ``p``.  The best probability that the output is one of the drafts is the
optimal-transport value (cost ``1[y not in drafts]``), whose dual collapses to
a minimum over token sets ``H`` (the constraint matrix is totally unimodular)::

    alpha* = 1 + min_H [ p(H) - Q(all drafts in H) ].

Search over ``H``
-----------------
Write ``D(x | G) = [Q(G + x) - Q(G)] / q_x`` for the marginal gain per unit
draft mass of adding token ``x`` to ``G``.  If an optimal ``H`` contains ``a``
and not ``b`` then ``p_a / q_a <= D(a | H - a)`` and ``D(b | H) <= p_b / q_b``.
Whenever the *exchange inequality*

    D(a | G) <= D(b | G + a)        for all G and a, b not in G        (*)

holds, it follows that ``p_a / q_a <= p_b / q_b``: some optimal ``H`` is a
prefix of the tokens sorted by ``p / q`` (ties can be resolved inside an
optimum, tokens with ``q = 0`` are never useful), so ``V + 1`` prefixes
suffice.

* i.i.d.: ``Q(H) = q(H)^n`` with ``f(s) = s^n`` convex gives (*) directly
  (``D(a|G) <= f'(q(G + a)) <= D(b|G + a)``).
* without replacement: (*) holds as well.  Proof via the exponential race
  (clock ``E_i ~ Exp(q_i)``): ``q_x D(x|G)`` is the probability that ``x`` is
  among the first ``n`` arrivals and the other ``n - 1`` are in ``G``, hence
  ``D(x|G) = int_0^inf P(A_x(s)) ds`` where ``A_x(s)`` = "``x`` has not
  arrived by ``s``, at most ``n-1`` other tokens arrived by ``s``, and the
  first ``n-1`` arrivals among the other tokens are in ``G``".  With
  ``R = V - {a, b}``: on ``A_a(s)`` token ``b`` cannot have arrived by ``s``
  (it would be among the first ``n-1`` others and ``b`` is not in ``G``) and
  the first ``n-1`` arrivals of ``R`` are in ``G``; these facts imply
  ``A_b(s)`` for the set ``G + a``.  So ``P(A_a(s)) <= P(A_b(s))`` for all
  ``s`` and (*) follows.  The implementation is also checked against brute
  force over all ``2^V`` subsets and against the LP in the tests.

Exact per-law algorithms
------------------------
* ``"iid"``: prefix minimum of ``P_k - Q_k^n``; only tokens with
  ``p/q <= n`` can be in an optimal set (``f'(s) <= n``), so only those are
  sorted: ``O(V + m log m)``.
* ``"without_replacement"``: ``n = 1`` is ``sum min(p, q)``; ``n = 2`` uses the
  closed form ``Q(H) = s - (1 - s) sum_H q/(1-q)`` on all prefixes
  (``O(V log V)``).  For ``n >= 3`` a branch and bound over prefixes: a cheap
  valid upper bound on ``Q_n(H_k)`` for every prefix (exact ``n = 2`` value
  times ``f(mu)^(n-2)``, where ``f(m) = (s - m)/(1 - m)`` bounds the chance that
  each later draw stays in ``H`` and Jensen's inequality is applied at the
  conditional mean ``mu`` of the mass drafted by the first two draws, which has
  a closed form; ``f^(n-2)`` must be concave there, otherwise a cruder bound
  is used) gives a
  lower bound on the objective; the prefixes whose bound is below the best
  exact value found so far are then evaluated exactly (1-D exponential-race
  integral, batched over prefixes:
  :func:`ot_bounds.draft_laws.wor_prob_all_in_prefixes`).  The
  result is exact; the run time depends on how many prefixes survive.
* ``"greedy"``: ``alpha* = p(T) + sum_{y not in T} min(p(y), q'(y))`` in ``O(V)``.
* ``"spechub"``: same unordered law as greedy with ``n = 2``.
* ``"deterministic"``: ``alpha* = p(top-n of q)``.

References
----------
Hu et al., "Towards Optimal Multi-draft Speculative Decoding", ICLR 2025, arXiv:2502.18779.
Khisti et al., "Multi-Draft Speculative Sampling: Canonical Architectures and
Theoretical Limits", arXiv:2410.18234.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike, NDArray

from ._validation import check_distributions, check_n
from .draft_laws import (
    WorPrefixQuadrature,
    _prob_all_in,
    check_law,
    effective_n,
    greedy_parts,
    one_minus,
    top_indices,
)

_TOL = 1e-13


@dataclass(frozen=True)
class OptimalAcceptance:
    """Optimal acceptance and an optimal dual set ``H``.

    Attributes
    ----------
    value : float
        ``alpha* = 1 + p(H) - Q(all drafts in H)``.
    subset : ndarray of int64, shape (|H|,)
        Sorted token indices of an optimal ``H`` (empty: ``alpha* = 1``).
    p_mass : float
        ``p(H)``.
    q_all_in : float
        ``Q(all drafts in H)``.
    n : int
        Number of drafted children requested.
    sampling : str
        Draft law.
    exact_evaluations : int
        Number of exact ``Q(H)`` evaluations used (branch and bound, ``n >= 3``
        without replacement; 0 elsewhere).
    """

    value: float
    subset: NDArray[np.int64]
    p_mass: float
    q_all_in: float
    n: int
    sampling: str
    exact_evaluations: int = 0


def _ratio_order(p: NDArray[np.float64], q: NDArray[np.float64], cap: float) -> NDArray[np.int64]:
    """Tokens with q > 0 and p/q <= cap, sorted by p/q ascending.

    One sort of 64-bit integer keys instead of an argsort (several times faster on large
    vocabularies): a non-negative float's bit pattern orders like the float, so the ratio's bits
    with their ``b`` lowest mantissa bits replaced by the token's rank in ``pos`` (``2^b >= m``)
    sort into ratio order. Ratios that agree to a relative ``2^-(52-b)`` (``~6e-11`` for
    ``m = 262,144``) are treated as ties; making them exact ties moves ``p`` by at most that
    fraction in L1, and ``alpha*`` is 1-Lipschitz in ``p`` (L1), so the optimum over these
    prefixes is within ``2^-(51-b)`` of the exact one (tie order is irrelevant: module docs).
    """
    pos = np.flatnonzero(q > 0)
    with np.errstate(over="ignore"):  # subnormal q: ratio inf, sorted last
        ratio = p[pos] / q[pos]
    keep = ratio <= cap
    pos, ratio = pos[keep], ratio[keep]
    bits = max(int(pos.size - 1).bit_length(), 1)
    if bits > 24:  # too many tokens to give up that many mantissa bits: a plain argsort
        return pos[np.argsort(ratio)]
    key = ratio.view(np.int64) >> bits << bits  # ratio >= 0: the int64 view is monotone in it
    key |= np.arange(pos.size, dtype=np.int64)
    key.sort()
    return pos[key & ((1 << bits) - 1)]


def _finish(
    p: NDArray[np.float64], q: NDArray[np.float64], n: int, sampling: str,
    subset: NDArray[np.int64], evals: int = 0, q_all_in: float | None = None,
) -> OptimalAcceptance:
    mask = np.zeros(p.size, dtype=bool)
    mask[subset] = True
    subset = np.flatnonzero(mask).astype(np.int64)  # sorted without a sort
    p_mass = float(p[mask].sum())
    if q_all_in is None:
        q_all_in = _prob_all_in(q, mask, n, sampling)
    value = 1.0 + p_mass - q_all_in
    if value >= 1.0:  # the empty set is optimal
        return OptimalAcceptance(1.0, np.zeros(0, np.int64), 0.0, 0.0, n, sampling, evals)
    return OptimalAcceptance(float(min(max(value, 0.0), 1.0)), subset, p_mass, float(q_all_in), n, sampling, evals)


def _best_prefix(g: NDArray[np.float64]) -> int:
    """Length of the best prefix given objective values for prefixes 1..m."""
    if g.size == 0:
        return 0
    k = int(np.argmin(g))
    return k + 1 if g[k] < 0.0 else 0


def _iid(p: NDArray[np.float64], q: NDArray[np.float64], n: int) -> OptimalAcceptance:
    order = _ratio_order(p, q, float(n))
    big_p = np.cumsum(p[order])  # shape (m,)
    big_q = np.minimum(np.cumsum(q[order]), 1.0)
    k = _best_prefix(big_p - big_q**n)
    return _finish(p, q, n, "iid", order[:k], q_all_in=float(big_q[k - 1] ** n) if k else None)


def _wor_q2(qs: NDArray[np.float64], outside: float) -> tuple[NDArray[np.float64], tuple]:
    """Exact ``Q_2`` of every prefix of ``qs`` and the prefix pieces the sharper bound reuses.

    Returns ``q2`` (shape (m,)) and ``(w, s_raw, s, c, s1)``: ``w = q / (1 - q)``, the prefix masses
    (raw and clipped to 1), the mass ``c`` after each prefix (summed from the small end: ``1 - s``
    would lose every digit of ``c ~ 1e-12``) and the prefix sums of ``w``.
    """
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        w = qs / one_minus(qs, outside=outside)
        s_raw = np.cumsum(qs)
        s = np.minimum(s_raw, 1.0)
        c = np.empty_like(qs)  # c[k] = sum of qs[k + 1:] + outside
        c[:-1] = np.cumsum(qs[:0:-1])[::-1]
        c[-1:] = 0.0
        c += outside
        s1 = np.cumsum(w)
        q2 = np.where(c > 0, np.maximum(s - c * s1, 0.0), s)
    return q2, (w, s_raw, s, c, s1)


def _wor_sharp_bound(qs: NDArray[np.float64], n: int, pieces: tuple, q2: NDArray[np.float64],
                     idx: NDArray[np.int64], m2: float) -> NDArray[np.float64]:
    """A valid upper bound on ``Q_n`` (n >= 3) at the prefixes of sorted indices ``idx`` (0-based).

    ``Q_2`` times the chance that each later draw stays in ``H``: a draw made when ``m`` is drafted
    stays with probability ``f(m) = (s - m) / (1 - m)``, decreasing in ``m``; Jensen's inequality at
    the conditional mean ``mu`` of the mass drafted by the first two draws (closed form from three
    prefix sums) applies where ``f^(n-2)`` is concave on ``[0, M_2]`` (``(n-3) c <= 2 (s - M_2)``,
    ``M_2`` the two largest masses), else ``f(mu) s^(n-3)``. Prefix sums are taken over
    ``[idx[0], idx[-1]]`` only (plus one fused reduction for everything before).
    """
    w, _, s, c, s1 = pieces
    lo, hi = int(idx[0]), int(idx[-1]) + 1
    at = idx - lo
    qseg, wq = qs[lo:hi], w[lo:hi] * qs[lo:hi]
    # einsum, not np.dot: a BLAS dot may start threads for one short reduction
    s2 = float(np.einsum("i,i->", w[:lo], qs[:lo])) + np.cumsum(wq)[at]
    s3 = float(np.einsum("i,i,i->", w[:lo], qs[:lo], qs[:lo])) + np.cumsum(wq * qseg)[at]
    w2 = float(np.einsum("i,i->", qs[:lo], qs[:lo])) + np.cumsum(qseg * qseg)[at]
    si, ci, q2i, s1i = s[idx], c[idx], q2[idx], s1[idx]
    # E[m_2 ; first two draws in H] with m_2 the drafted mass after two draws
    em2 = si * s2 - 2.0 * s3 + s1i * w2
    with np.errstate(divide="ignore", invalid="ignore"):
        mu = np.divide(em2, q2i, out=np.zeros_like(em2), where=q2i > 0)
        third = np.divide(si - mu, 1.0 - mu, out=np.ones_like(mu), where=mu < 1.0)
    third = np.clip(np.nan_to_num(third, nan=1.0), 0.0, 1.0)
    concave = (n - 3) * ci <= 2.0 * (si - m2)
    ub = np.where(concave, q2i * third ** (n - 2), q2i * third * si ** (n - 3))
    return np.minimum(ub + 1e-12, 1.0)


def _wor_upper_bound(qs: NDArray[np.float64], n: int, outside: float = 0.0,
                     big_p: NDArray[np.float64] | None = None) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    """Exact Q_2 and a valid upper bound on Q_n for all prefixes of qs.

    Parameters
    ----------
    qs : ndarray, shape (m,)
        Draft masses in prefix order (all positive, all < 1).
    outside : float
        Draft mass of the tokens not in ``qs``.
    big_p : ndarray, shape (m,), optional
        Target mass of each prefix: the sharper bound is computed only where ``big_p < Q_2``.

    Returns
    -------
    q2, ub : ndarrays, shape (m,)
    """
    q2, pieces = _wor_q2(qs, outside)
    if n == 2:
        return q2, q2
    # Q_n <= Q_2 everywhere; the sharper bound is only worth computing where big_p - Q_2 < 0 (elsewhere
    # the prefix cannot beat the empty set); ``ub`` falls back to ``q2`` on the other prefixes
    ub = np.minimum(q2 + 1e-12, 1.0)
    idx = np.flatnonzero(big_p < q2) if big_p is not None else np.arange(qs.size)
    if idx.size:
        ub[idx] = _wor_sharp_bound(qs, n, pieces, q2, idx, float(qs[top_indices(qs, 2)].sum()))
    return q2, ub


def _without_replacement(p: NDArray[np.float64], q: NDArray[np.float64], n: int) -> OptimalAcceptance:
    n_eff = effective_n(q, n, "without_replacement")
    if n_eff == 1:  # a single draft (or a point-mass q): sum min(p, q)
        return _finish(p, q, n, "without_replacement", np.flatnonzero(p < q))
    # P(a in first n) <= n q_a / (1 - mass of the n-1 largest other tokens)
    m_top = float(q[top_indices(q, n_eff - 1)].sum())
    cap = n_eff / (1.0 - m_top) if m_top < 1.0 else np.inf
    order = _ratio_order(p, q, cap)
    qs = q[order]
    big_p = np.cumsum(p[order])
    rest = np.ones(q.size, dtype=bool)
    rest[order] = False
    outside = float(q[rest].sum())  # mass of tokens left out of the order, summed directly
    if n_eff == 2:
        q2, _ = _wor_q2(qs, outside)
        k = _best_prefix(big_p - q2)
        return _finish(p, q, n, "without_replacement", order[:k], q_all_in=float(q2[k - 1]) if k else None)
    return _wor_branch_and_bound(p, q, n, n_eff, order, qs, big_p, outside)


def _smallest(values: NDArray[np.float64], k: int) -> NDArray[np.int64]:
    """Positions of the ``k`` smallest values, sorted by position (argpartition: O(len))."""
    if values.size <= k:
        return np.arange(values.size)
    return np.sort(np.argpartition(values, k - 1)[:k])


def _wor_branch_and_bound(
    p: NDArray[np.float64], q: NDArray[np.float64], n: int, n_eff: int, order: NDArray[np.int64],
    qs: NDArray[np.float64], big_p: NDArray[np.float64], outside: float, batch: int = 64,
) -> OptimalAcceptance:
    """Exact minimum of ``P_k - Q_k`` over prefixes ``k`` (``n >= 3`` without replacement).

    Valid upper bounds on ``Q_k`` give a lower bound on the objective of every unevaluated prefix:
    first the cheap ``Q_2 s^(n-2)`` (each later draw stays in ``H`` with probability at most
    ``s``); after the first exact round, on the prefixes that survive it, the sharper Jensen bound
    (:func:`_wor_sharp_bound`); and, because prefixes are nested and ``Q`` is monotone under
    inclusion, the exact ``Q`` of the nearest evaluated prefix at or after ``k``. The first round
    evaluates (one batched quadrature) the ``batch`` prefixes with the lowest cheap bound; each
    later round up to ``batch`` survivors spread evenly over the ones still able to beat the best
    exact value. It stops when no prefix can.  Index ``j`` is the prefix of length ``j + 1``.
    """
    q2, pieces = _wor_q2(qs, outside)
    _, s_raw, s, c, _ = pieces
    ub = np.minimum(q2 * s ** (n_eff - 2) + 1e-12, 1.0)  # cheap bound, shape (m,)
    best_val, best_k, best_q, evals = 0.0, 0, 0.0, 0
    cand = np.flatnonzero(big_p - ub < best_val - _TOL)
    top = np.sort(top_indices(qs, 256))  # the 256 largest, by position (shared with the quadrature)
    cache: dict = {"base": (s_raw, c, top)}
    m2 = float(np.sort(qs[top])[::-1][:2].sum())
    ev_idx = np.zeros(0, dtype=np.int64)  # evaluated prefixes, sorted
    ev_q = np.zeros(0)
    quad, first = None, True
    while cand.size:
        if first:  # the most promising by the cheap bound, on their own grid
            pick = cand[_smallest(big_p[cand] - ub[cand], batch)]
            q_all_in = WorPrefixQuadrature(qs, outside, n_eff, int(pick[0]) + 1, int(pick[-1]) + 1, cache)(pick + 1)
        else:  # an even spread over the survivors, on one grid sized for all of them
            pick = cand[np.unique(np.linspace(0, cand.size - 1, batch).round().astype(np.int64))]
            q_all_in = quad(pick + 1)
        evals += pick.size
        vals = big_p[pick] - q_all_in
        i = int(np.argmin(vals))
        if vals[i] < best_val:
            best_val, best_k, best_q = float(vals[i]), int(pick[i]) + 1, float(q_all_in[i])
        merged = np.concatenate((ev_idx, pick))
        keep = np.argsort(merged, kind="stable")
        ev_idx, ev_q = merged[keep], np.concatenate((ev_q, q_all_in))[keep]
        ev_q = np.minimum.accumulate(ev_q[::-1])[::-1]  # Q_k <= Q_j for every evaluated j >= k: keep the least
        nxt = np.searchsorted(ev_idx, cand)  # first evaluated prefix at or after each candidate
        at = np.minimum(nxt, ev_idx.size - 1)
        succ_q = np.where(nxt < ev_idx.size, ev_q[at], 1.0)
        done = (nxt < ev_idx.size) & (ev_idx[at] == cand)
        bound = big_p[cand] - np.minimum(ub[cand], succ_q)
        cand = cand[~done & (bound < best_val - _TOL)]
        if first and cand.size:  # sharpen the bound where it still matters, then prune again
            ub[cand] = np.minimum(ub[cand], _wor_sharp_bound(qs, n_eff, pieces, q2, cand, m2))
            nxt = np.searchsorted(ev_idx, cand)
            at = np.minimum(nxt, ev_idx.size - 1)
            succ_q = np.where(nxt < ev_idx.size, ev_q[at], 1.0)
            cand = cand[big_p[cand] - np.minimum(ub[cand], succ_q) < best_val - _TOL]
            if cand.size:
                quad = WorPrefixQuadrature(qs, outside, n_eff, int(cand[0]) + 1, int(cand[-1]) + 1, cache)
        first = False
    return _finish(p, q, n, "without_replacement", order[:best_k], evals, best_q if best_k else None)


def _greedy(p: NDArray[np.float64], q: NDArray[np.float64], n: int, sampling: str) -> OptimalAcceptance:
    fixed, rest = greedy_parts(q, n)
    mask = rest > p
    mask[fixed] = True
    return _finish(p, q, n, sampling, np.flatnonzero(mask))


def optimal_subset(p: ArrayLike, q: ArrayLike, n: int, sampling: str = "iid") -> OptimalAcceptance:
    """Optimal acceptance rate together with an optimal dual token set ``H``.

    Parameters
    ----------
    p : array_like, shape (V,)
        Target distribution.
    q : array_like, shape (V,)
        Draft distribution.
    n : int
        Number of drafted children.
    sampling : {"iid", "without_replacement", "greedy", "spechub", "deterministic"}
        Draft law (see :mod:`ot_bounds.draft_laws`).

    Returns
    -------
    OptimalAcceptance

    Examples
    --------
    >>> res = optimal_subset([0.1, 0.9], [0.6, 0.4], 2, "iid")
    >>> round(res.value, 6), res.subset.tolist()
    (0.74, [0])
    """
    pa, qa = check_distributions(p, q)
    n = check_n(n)
    sampling = check_law(sampling, n)
    if sampling == "iid":
        return _iid(pa, qa, n)
    if sampling == "without_replacement":
        return _without_replacement(pa, qa, n)
    if sampling in ("greedy", "spechub"):
        return _greedy(pa, qa, n, sampling)
    top = top_indices(qa, n)
    return _finish(pa, qa, n, sampling, top)


def optimal_acceptance(p: ArrayLike, q: ArrayLike, n: int, sampling: str = "iid") -> float:
    """Optimal acceptance rate ``alpha*`` of ``n``-draft speculative decoding.

    ``alpha* = max P(output in drafts)`` over all lossless verifiers for the
    draft law ``sampling``; computed exactly through the dual/subset form
    ``alpha* = 1 + min_H [p(H) - Q(all drafts in H)]`` (see module docs for the
    algorithm per law and the proof that sorted prefixes suffice).

    Parameters
    ----------
    p : array_like, shape (V,)
        Target distribution (nonnegative, sums to 1 within 1e-6).
    q : array_like, shape (V,)
        Draft distribution.
    n : int
        Number of drafted children (>= 1).
    sampling : {"iid", "without_replacement", "greedy", "spechub", "deterministic"}
        Draft law; the first three are the main ones.

    Returns
    -------
    float
        ``alpha*`` in [0, 1].

    Examples
    --------
    >>> optimal_acceptance([0.5, 0.5], [0.9, 0.1], 1)
    0.6
    >>> round(optimal_acceptance([0.5, 0.5], [0.9, 0.1], 2, "without_replacement"), 6)
    1.0
    """
    return optimal_subset(p, q, n, sampling).value
