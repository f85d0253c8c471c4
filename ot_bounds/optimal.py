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
  :func:`ot_bounds.draft_laws.wor_prob_all_in_prefixes`).  By (*) the
  marginal gains along the order never decrease, so ``Q`` is convex in the
  prefix mass and every exact value bounds its neighbours through chords.  The
  result is exact; the run time depends on how many prefixes survive.
* ``"greedy_draft"``: ``alpha* = p(T) + sum_{y not in T} min(p(y), q'(y))`` in ``O(V)``.
* ``"spechub"``: same unordered law as greedy_draft with ``n = 2``.
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
from ._workspace import workspace
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
_BB_BATCH = 64  # prefixes evaluated exactly per round of the branch and bound


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


def _ratio_order(p: NDArray[np.float64], q: NDArray[np.float64], cap: float,
                 find: NDArray[np.int64] | None = None) -> tuple[NDArray[np.int64], float, NDArray[np.int64] | None]:
    """Tokens with q > 0 and p/q <= cap, sorted by p/q ascending, and the draft mass of the others.

    One sort of 64-bit integer keys instead of an argsort (several times faster on large
    vocabularies): a non-negative float's bit pattern orders like the float, so the ratio's bits
    with their ``b`` lowest mantissa bits replaced by the token's index (``2^b >= V``) sort into
    ratio order, and the low bits of the sorted keys are the order itself (no gather). Tokens
    left out (ratio above ``cap``, ``q = 0``) sort last. Ratios that agree to a relative
    ``2^-(52-b)`` (``~6e-11`` for ``V = 262,144``) are treated as ties; making them exact ties
    moves ``p`` by at most that fraction in L1, and ``alpha*`` is 1-Lipschitz in ``p`` (L1), so
    the optimum over these prefixes is within ``2^-(51-b)`` of the exact one (tie order is
    irrelevant: module docs).

    Returns
    -------
    order : ndarray of int64, shape (m,)
        A view of this thread's workspace (valid until the next call).
    outside : float
        ``q`` summed over the tokens not in ``order`` (directly, not as ``1 - q(order)``, which
        would lose every digit of a mass ~1e-12).
    found : ndarray of int64 or None
        With ``find`` (token ids): the position of each in ``order``, -1 where it is not there
        (a binary search of its key in the sorted keys).
    """
    v = q.size
    ws = workspace()
    bits = max(int(v - 1).bit_length(), 1)
    ratio = ws.take("ratio", v)  # shape (V,); becomes the keys, then the order
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):  # subnormal q: ratio inf
        np.divide(p, q, out=ratio)
    ratio += 0.0  # -0.0 (p = -0.0) -> +0.0
    if bits > 24 or not np.isfinite(cap):  # rare: a plain argsort over the tokens kept
        keep = (ratio <= cap) & (q > 0)
        pos = np.flatnonzero(keep)
        order = pos[np.argsort(ratio[pos], kind="stable")]
        found = None
        if find is not None:
            inverse = np.full(v, -1, dtype=np.int64)
            inverse[order] = np.arange(order.size)
            found = inverse[find]
        return order, float(q[~keep].sum()), found
    m = int(np.count_nonzero(np.less_equal(ratio, cap, out=ws.take("keep", v, bool))))
    # as unsigned integers, non-negative floats order by value and every NaN (0/0, whatever its
    # sign bit) after +inf: the tokens left out (ratio > cap, q = 0) sort after the m kept ones
    key = ratio.view(np.uint64)
    key >>= np.uint64(bits)
    key <<= np.uint64(bits)
    key |= ws.arange(v).view(np.uint64)
    key.sort()
    found = None
    if find is not None:  # the same key, rebuilt for these tokens only, located by binary search
        with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
            k_find = (p[find] / q[find] + 0.0).view(np.uint64) >> np.uint64(bits) << np.uint64(bits)
        k_find |= find.astype(np.uint64)
        at = np.searchsorted(key[:m], k_find)
        hit = (at < m) & (key[np.minimum(at, m - 1)] == k_find) if m else np.zeros(find.size, bool)
        found = np.where(hit, at, -1).astype(np.int64)
    key &= np.uint64((1 << bits) - 1)
    order = key.view(np.int64)
    outside = float(q[order[m:]].sum()) if m < v else 0.0
    return order[:m], outside, found


def _finish(
    p: NDArray[np.float64], q: NDArray[np.float64], n: int, sampling: str,
    subset: NDArray[np.int64], evals: int = 0, q_all_in: float | None = None, p_mass: float | None = None,
) -> OptimalAcceptance:
    mask = workspace().take("finish_mask", p.size, bool)
    mask.fill(False)
    mask[subset] = True
    subset = np.flatnonzero(mask).astype(np.int64, copy=False)  # sorted without a sort (fresh: returned)
    if p_mass is None:
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
    order, _, _ = _ratio_order(p, q, float(n))
    ws = workspace()
    m = order.size
    big_p = np.cumsum(np.take(p, order, out=ws.take("tmp", m)), out=ws.take("big_p", m))  # shape (m,)
    big_q = np.cumsum(np.take(q, order, out=ws.take("tmp", m)), out=ws.take("big_q", m))
    np.minimum(big_q, 1.0, out=big_q)
    g = np.power(big_q, n, out=ws.take("tmp", m))
    np.subtract(big_p, g, out=g)
    k = _best_prefix(g)
    return _finish(p, q, n, "iid", order[:k], q_all_in=float(big_q[k - 1] ** n) if k else None,
                   p_mass=float(big_p[k - 1]) if k else None)


def _wor_q2(qs: NDArray[np.float64], outside: float) -> tuple[NDArray[np.float64], tuple]:
    """Exact ``Q_2`` of every prefix of ``qs`` and the prefix pieces the sharper bound reuses.

    All returned arrays are views of this thread's workspace (valid until the next call).

    Returns ``q2`` (shape (m,)) and ``(w, s_raw, s, c, s1)``: ``w = q / (1 - q)``, the prefix masses
    (``s_raw`` and ``s`` are one array, clipped to 1 against rounding), the mass ``c`` after each prefix (summed from the small end: ``1 - s``
    would lose every digit of ``c ~ 1e-12``) and the prefix sums of ``w``.
    """
    m = qs.size
    ws = workspace()  # full-length intermediates, in place: few passes, no fresh pages
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        w = one_minus(qs, outside=outside, out=ws.take("w", m))
        np.divide(qs, w, out=w)
    s_raw = np.cumsum(qs, out=ws.take("s_raw", m))
    s = s_raw  # clipped to 1 (only rounding can exceed it); non-decreasing, so only a tail
    s[np.searchsorted(s_raw, 1.0, side="right"):] = 1.0
    after = ws.take("c", m + 1)  # after[k] = sum of qs[k:], summed from the small end
    after[m] = 0.0
    np.cumsum(qs[::-1], out=after[m - 1 :: -1] if m else after[:0])
    c = after[1:]  # c[k] = sum of qs[k + 1:] + outside (non-increasing)
    c += outside
    s1 = np.cumsum(w, out=ws.take("s1", m))
    q2 = ws.take("q2", m)
    with np.errstate(over="ignore", invalid="ignore"):
        np.multiply(c, s1, out=q2)
    np.subtract(s, q2, out=q2)
    np.maximum(q2, 0.0, out=q2)
    zero = m - int(np.searchsorted(c[::-1], 0.0, side="right"))  # c == 0 from here on
    q2[zero:] = s[zero:]
    return q2, (w, s_raw, s, c, s1)


def _wor_sharp_bound(qs: NDArray[np.float64], n: int, pieces: tuple, q2: NDArray[np.float64],
                     idx: NDArray[np.int64], m2: float, sums: tuple | None = None) -> NDArray[np.float64]:
    """A valid upper bound on ``Q_n`` (n >= 3) at the prefixes of sorted indices ``idx`` (0-based).

    ``Q_2`` times the chance that each later draw stays in ``H``: a draw made when ``m`` is drafted
    stays with probability ``f(m) = (s - m) / (1 - m)``, decreasing in ``m``; Jensen's inequality at
    the conditional mean ``mu`` of the mass drafted by the first two draws (closed form from three
    prefix sums) applies where ``f^(n-2)`` is concave on ``[0, M_2]`` (``(n-3) c <= 2 (s - M_2)``,
    ``M_2`` the two largest masses), else ``f(mu) s^(n-3)``. ``sums``: the three prefix sums
    ``sum w q``, ``sum w q^2``, ``sum q^2`` at ``idx`` if already known (:class:`_BlockPrefix`).
    """
    w, _, s, c, s1 = pieces
    if sums is None:
        sums = _BlockPrefix(_sharp_terms(qs, w, int(idx[-1]) + 1)).at(idx)
    s2, s3, w2 = sums
    si, ci, q2i, s1i = s[idx], c[idx], q2[idx], s1[idx]
    # E[m_2 ; first two draws in H] with m_2 the drafted mass after two draws
    em2 = si * s2 - 2.0 * s3 + s1i * w2
    # rounding of the k-term prefix sums: at most ~k eps times the terms' magnitude (the three
    # terms of em2 reach 1 / (1 - max q) and cancel); mu is lowered by that much, which can only
    # raise the bound, and the bound gets the same allowance for the prefix mass inside Q_2
    k_eps = (idx + 1.0) * np.finfo(np.float64).eps
    with np.errstate(divide="ignore", invalid="ignore"):
        mu = np.divide(em2 - 4.0 * k_eps * (si * s2 + 2.0 * s3 + s1i * w2), q2i, out=np.zeros_like(em2),
                       where=q2i > 0)
        # (s - mu) / (1 - mu) as 1 - c / (1 - mu): the prefix sum s is off by far more than a tiny c
        third = np.subtract(1.0, np.divide(ci, 1.0 - mu, out=np.zeros_like(mu), where=mu < 1.0),
                            out=np.ones_like(mu), where=mu < 1.0)
    third = np.clip(np.nan_to_num(third, nan=1.0), 0.0, 1.0)
    concave = (n - 3) * ci <= 2.0 * (si - m2)
    ub = np.where(concave, q2i * third ** (n - 2), q2i * third * si ** (n - 3))
    return np.minimum(ub + 1e-12 + 2.0 * k_eps, 1.0)


def _sharp_terms(qs: NDArray[np.float64], w: NDArray[np.float64], hi: int,
                 out: NDArray[np.float64] | None = None) -> NDArray[np.float64]:
    """Summands of the sharp bound's prefix sums over ``[0, hi)``: ``w q``, ``w q^2``, ``q^2``,
    shape (3, hi) (in ``out``, shape (3 * hi,), when given)."""
    terms = (np.empty(3 * hi) if out is None else out[: 3 * hi]).reshape(3, hi)
    np.multiply(w[:hi], qs[:hi], out=terms[0])
    np.multiply(terms[0], qs[:hi], out=terms[1])
    np.multiply(qs[:hi], qs[:hi], out=terms[2])
    return terms


class _BlockPrefix:
    """Prefix sums of a few equally long arrays at sorted positions, without a full cumsum.

    Block totals (a vectorised reduction) and their running sum give every block boundary; a
    position inside a block adds a cumsum over its block only, so a sparse set of positions
    costs ``O(len + blocks touched * block)`` and block ends cost ``O(len)`` in all.
    """

    def __init__(self, terms: NDArray[np.float64], block: int = 256) -> None:
        n_terms, size = terms.shape
        nb = size // block
        self.block, self.size, self.terms = block, size, terms  # terms: shape (T, size)
        self.before = np.zeros((n_terms, nb + 1 + (size > nb * block)))  # sums over all blocks before b
        np.add.reduce(terms[:, : nb * block].reshape(n_terms, nb, block), axis=2, out=self.before[:, 1 : nb + 1])
        if size > nb * block:  # a last, shorter block
            self.before[:, -1] = terms[:, nb * block :].sum(axis=1)
        np.cumsum(self.before, axis=1, out=self.before)

    def at(self, idx: NDArray[np.int64]) -> NDArray[np.float64]:
        """``sum(terms[i][: k + 1])`` for each ``k`` in ``idx`` (sorted, < size): shape (T, K)."""
        b, r = np.divmod(idx, self.block)
        new = np.concatenate(([True], b[1:] != b[:-1]))  # idx sorted: each touched block once
        cols = np.minimum(b[new][:, None] * self.block + np.arange(self.block), self.size - 1)  # (U, block)
        inside = np.cumsum(self.terms[:, cols], axis=2)  # shape (T, U, block); past size: unused
        return self.before[:, b] + inside[:, np.cumsum(new) - 1, r]

    def at_block_ends(self) -> tuple[NDArray[np.int64], NDArray[np.float64]]:
        """Last position of every block and the sums there: shapes (nb,), (T, nb)."""
        ends = np.minimum(np.arange(1, self.before.shape[1]) * self.block, self.size) - 1
        return ends, self.before[:, 1:]


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
    ws = workspace()
    # the 512 largest q (one partition) give both the cap and, located in the order, the
    # positions of the 256 largest entries of qs that the branch and bound needs
    top_q = top_indices(q, 512, scratch=ws.take("tmp", q.size))  # sorted by -q
    # 1 - (mass of the n-1 largest) summed from the other entries: subtracting from 1 loses a
    # remainder ~1e-18 entirely, and a cap too small would drop tokens the optimum may need
    rest = ws.take("cap_rest", q.size)
    np.copyto(rest, q)
    rest[top_q[: n_eff - 1]] = 0.0
    tail = float(rest.sum())
    cap = n_eff / tail if tail > 0.0 else np.inf
    order, outside, top_pos = _ratio_order(p, q, cap, find=top_q)
    m = order.size
    qs = np.take(q, order, out=ws.take("qs", m))  # shape (m,)
    big_p = np.cumsum(np.take(p, order, out=ws.take("tmp", m)), out=ws.take("big_p", m))
    if n_eff == 2:
        q2, _ = _wor_q2(qs, outside)
        k = _best_prefix(np.subtract(big_p, q2, out=ws.take("tmp", m)))
        return _finish(p, q, n, "without_replacement", order[:k], q_all_in=float(q2[k - 1]) if k else None,
                       p_mass=float(big_p[k - 1]) if k else None)
    top = top_pos[top_pos >= 0][:256]  # by -q: the largest entries of qs, if 256 (or all m) of them
    if top.size < min(256, m):
        top = top_indices(qs, 256, scratch=ws.take("tmp", m))
    return _wor_branch_and_bound(p, q, n, n_eff, order, qs, big_p, outside, cap, np.sort(top))


def _chord_bound(dx: NDArray[np.float64], y0: ArrayLike, width: ArrayLike, y1: ArrayLike) -> NDArray[np.float64]:
    """Upper bound at ``x0 + dx`` (``0 <= dx <= width``) on a convex function through ``(x0, y0)``
    and ``(x0 + width, y1)``: the chord, plus a margin for rounding in the coordinates (``inf``
    where ``width <= 0``). Offsets, not coordinates: the caller takes each from the sum that
    resolves it (a mass of 1e-19 next to a prefix of mass ~1 vanishes from prefix sums)."""
    width = np.asarray(width, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        slope = np.where(width > 0, (np.asarray(y1) - y0) / width, np.inf)
        chord = y0 + slope * dx
        chord = chord + 1e-12 * np.abs(chord) + 1e-15 * (2.0 + np.abs(slope))
    return np.where(np.isfinite(chord), chord, np.inf)


def _smallest(values: NDArray[np.float64], k: int) -> NDArray[np.int64]:
    """Positions of the ``k`` smallest values, sorted by position (argpartition: O(len))."""
    if values.size <= k:
        return np.arange(values.size)
    return np.sort(np.argpartition(values, k - 1)[:k])


def _wor_branch_and_bound(
    p: NDArray[np.float64], q: NDArray[np.float64], n: int, n_eff: int, order: NDArray[np.int64],
    qs: NDArray[np.float64], big_p: NDArray[np.float64], outside: float, cap: float, top: NDArray[np.int64],
    batch: int | None = None,
) -> OptimalAcceptance:
    """Exact minimum of ``P_k - Q_k`` over prefixes ``k`` (``n >= 3`` without replacement).

    Valid upper bounds on ``Q_k`` give a lower bound on the objective of every unevaluated prefix:
    first the cheap ``Q_2 s^(n-2)`` (each later draw stays in ``H`` with probability at most
    ``s``); after the first exact round, on the prefixes that survive it, the sharper Jensen bound
    (:func:`_wor_sharp_bound`, first once per block of 256 positions, then per candidate in the
    blocks that survive); and the exact values of the nearest evaluated prefixes on either side
    (``objective_lower_bound``: ``Q`` is monotone under inclusion and convex in the prefix mass,
    so it lies below the chords between evaluated prefixes, with further bounds on how much it
    grows towards the next evaluated prefix and grew since the previous one). The first round evaluates (one batched quadrature) the ``batch`` prefixes with
    the lowest cheap bound; each later round up to ``batch`` survivors spread evenly over the ones
    still able to beat the best exact value. It stops when no prefix can. Index ``j`` is the
    prefix of length ``j + 1``; ``top``: positions of the 256 largest entries of ``qs``, sorted.
    """
    batch = _BB_BATCH if batch is None else batch
    q2, pieces = _wor_q2(qs, outside)
    _, s_raw, s, c, _ = pieces
    ws, m = workspace(), qs.size
    ub = np.multiply(q2, s, out=ws.take("ub", m))  # cheap bound Q_2 s^(n-2) + rounding, shape (m,)
    for _ in range(n_eff - 3):
        ub *= s
    ub += 1e-12
    np.minimum(ub, 1.0, out=ub)
    best_val, best_k, best_q, evals = 0.0, 0, 0.0, 0
    gap = np.subtract(big_p, ub, out=ws.take("gap", m))  # lower bound on the objective, shape (m,)
    cand = np.flatnonzero(np.less(gap, best_val - _TOL, out=ws.take("mask_m", m, bool)))
    cache: dict = {"base": (s_raw, c, top)}
    m2 = float(np.sort(qs[top])[::-1][:2].sum())
    ev_idx = np.zeros(0, dtype=np.int64)  # evaluated prefixes, sorted
    ev_q = np.zeros(0)  # their exact Q_n

    def objective_lower_bound(cand: NDArray[np.int64]) -> NDArray[np.float64]:
        """Lower bound on ``P_k - Q_k`` for sorted, unevaluated candidates.

        Besides ``ub``, bounds from the exact values found so far:

        * convexity: by the exchange inequality (module docs) the marginal gains
          ``(Q_k - Q_{k-1}) / q_k`` never decrease along any order, so ``Q`` is a convex function
          of the prefix mass ``s`` and lies below every chord: between the evaluated prefixes
          ``i < k < j``, ``Q_k <= Q_i + (Q_j - Q_i) (s_k - s_i) / (s_j - s_i)``; before the first
          one the chord starts at the empty set (``s = 0``, ``Q = 0``); after the last one it ends
          at the whole vocabulary (``s = 1``, ``Q = 1``): ``1 - Q_k >= (1 - Q_j) c_k / c_j``.
        * from the nearest evaluated ``j > k``: ``Q_k <= Q_j - q(H_j - H_k) L_k``, since "all
          drafts in ``H_j``" contains "first draw in ``H_j - H_k``, the other ``n - 1`` in
          ``H_k``", of probability at least ``q(H_j - H_k) Q_{n-1}(H_k)`` (after a first draw
          outside ``H_k``, staying in ``H_k`` only gets easier), and ``Q_{n-1}(H_k) >= L_k``:
          ``Q_n`` of the nearest evaluated ``i < k`` (monotone), or ``Q_2(H_k)`` when ``n = 3``.
        * from the nearest evaluated ``i < k``: ``Q_k <= Q_i + cap q(H_k - H_i)``, the chance that
          a draft lands in ``H_k - H_i`` (union bound over the draws).

        Chords get a relative margin for the rounding of the masses and of the exact values.
        """
        def between(a: NDArray[np.int64] | int, b: NDArray[np.int64] | int) -> NDArray[np.float64]:
            """q mass of prefix ``b`` minus prefix ``a`` (``a <= b``), from the sums after the
            prefixes where those are small (prefix sums near 1 lose masses ~1e-19), else from the
            prefix sums."""
            return np.where(c[a] < 0.5, c[a] - c[b], s_raw[b] - s_raw[a])

        q_up = ub[cand]  # a copy, shape (K,)
        q_after = np.minimum.accumulate(ev_q[::-1])[::-1]  # least exact Q at or after each evaluated prefix
        lo, hi = np.searchsorted(cand, (ev_idx[0], ev_idx[-1])).tolist()
        first_i, last_j = int(ev_idx[0]), int(ev_idx[-1])
        if lo:  # before every evaluated prefix: the chord from the empty set, the successor bound
            seg = cand[:lo]
            gain = between(seg, first_i) * q2[seg] * (1.0 - 1e-9) if n_eff == 3 else 0.0
            bound = q_after[0] - gain
            if s_raw[first_i] > 0:
                bound = np.minimum(bound, _chord_bound(s_raw[seg], 0.0, s_raw[first_i], ev_q[0]))
            np.minimum(q_up[:lo], bound, out=q_up[:lo])
        if hi < cand.size:  # after every evaluated prefix: the chord to the whole vocabulary, the predecessor bound
            seg = cand[hi:]
            bound = np.full(seg.size, np.inf)
            if c[last_j] > 0:  # in the mass after the prefix, -c: from (-c_j, Q_j) to (0, 1)
                bound = _chord_bound(c[last_j] - c[seg], ev_q[-1], c[last_j], 1.0)
            if np.isfinite(cap):
                bound = np.minimum(bound, ev_q[-1] + cap * (1.0 + 1e-9) * between(last_j, seg))
            np.minimum(q_up[hi:], bound, out=q_up[hi:])
        if hi > lo:  # between two evaluated prefixes: the chord, the successor and predecessor bounds
            seg = cand[lo:hi]
            nxt = np.searchsorted(ev_idx, seg)  # nearest evaluated after (>= 1: seg is after ev_idx[0])
            j, i = ev_idx[nxt], ev_idx[nxt - 1]
            q_i, q_j = ev_q[nxt - 1], ev_q[nxt]
            low = np.maximum.accumulate(ev_q)[nxt - 1]
            if n_eff == 3:
                low = np.maximum(low, q2[seg])
            bound = q_after[nxt] - between(seg, j) * low * (1.0 - 1e-9)
            if np.isfinite(cap):
                bound = np.minimum(bound, q_i + cap * (1.0 + 1e-9) * between(i, seg))
            np.minimum(bound, _chord_bound(between(i, seg), q_i, between(i, j), q_j), out=bound)
            np.minimum(q_up[lo:hi], bound, out=q_up[lo:hi])
        return big_p[cand] - q_up

    sharp_sums = _BlockPrefix(_sharp_terms(qs, pieces[0], m, out=ws.take("sharp_terms", 3 * m)))

    def screen_blocks(cand: NDArray[np.int64]) -> NDArray[np.int64]:
        """Drop whole blocks of positions whose every candidate is pruned: ``Q`` is monotone, so a
        prefix in the block has ``Q_k <=`` the sharp bound at the block's last position and
        ``P_k >=`` the ``P`` of the block's first candidate (one sharp bound per block)."""
        ends, sums = sharp_sums.at_block_ends()
        blk = cand // sharp_sums.block  # non-decreasing (cand is sorted)
        opens = np.concatenate(([True], blk[1:] != blk[:-1]))  # first candidate of each block
        used = blk[opens]
        e = ends[used]
        ub_end = np.minimum(ub[e], _wor_sharp_bound(qs, n_eff, pieces, q2, e, m2, tuple(sums[:, used])))
        keep_block = big_p[cand[opens]] - ub_end < best_val - _TOL
        return cand[keep_block[np.cumsum(opens) - 1]]

    quad, first = None, True
    while cand.size:
        if first:  # the most promising by the cheap bound, on their own grid
            pick = cand[_smallest(gap[cand], batch)]
            q_all_in = WorPrefixQuadrature(qs, outside, n_eff, int(pick[0]) + 1, int(pick[-1]) + 1, cache)(pick + 1)
        else:  # an even spread over the survivors, on one grid sized for all of them
            pick = cand[np.unique(np.linspace(0, cand.size - 1, batch).round().astype(np.int64))]
            q_all_in = quad(pick + 1)
        evals += pick.size
        if not np.all(np.isfinite(q_all_in)):  # a NaN would be skipped by argmin's comparison and poison the bounds
            raise FloatingPointError(
                f"without replacement, n = {n_eff}: non-finite Q(all drafts in H) for prefixes "
                f"{(pick[~np.isfinite(q_all_in)] + 1)[:5].tolist()} of the ratio order")
        vals = big_p[pick] - q_all_in
        i = int(np.argmin(vals))
        if vals[i] < best_val:
            best_val, best_k, best_q = float(vals[i]), int(pick[i]) + 1, float(q_all_in[i])
        merged = np.concatenate((ev_idx, pick))
        keep = np.argsort(merged, kind="stable")
        ev_idx, ev_q = merged[keep], np.concatenate((ev_q, q_all_in))[keep]
        unevaluated = np.ones(cand.size, dtype=bool)
        unevaluated[np.searchsorted(cand, pick)] = False  # pick is a subset of cand (both sorted)
        cand = cand[unevaluated]
        if first and cand.size:  # sharpen the cheap bound where it still matters, then prune
            cand = screen_blocks(cand)
            if cand.size:
                ub[cand] = np.minimum(ub[cand], _wor_sharp_bound(qs, n_eff, pieces, q2, cand, m2,
                                                                 tuple(sharp_sums.at(cand))))
        cand = cand[objective_lower_bound(cand) < best_val - _TOL]
        if first and cand.size:
            quad = WorPrefixQuadrature(qs, outside, n_eff, int(cand[0]) + 1, int(cand[-1]) + 1, cache)
        first = False
    return _finish(p, q, n, "without_replacement", order[:best_k], evals, best_q if best_k else None,
                   p_mass=float(big_p[best_k - 1]) if best_k else None)


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
    sampling : {"iid", "without_replacement", "greedy_draft", "spechub", "deterministic"}
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
    if sampling in ("greedy_draft", "spechub"):
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
    sampling : {"iid", "without_replacement", "greedy_draft", "spechub", "deterministic"}
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
