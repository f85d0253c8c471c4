"""Draft laws: the law ``Q`` of the ordered tuple of children drafted at a node.

For the optimal-transport bounds only one functional of ``Q`` matters (see
:mod:`ot_bounds.optimal`)::

    Q(all drafts in H) = P(every drafted child lies in the token set H).

This module gives that probability *exactly* for every supported law, and the
full law of ordered tuples for small vocabularies (used by the LP, the flow
and brute-force references).

Supported laws (``sampling``)
-----------------------------
``"iid"``
    ``n`` children drawn independently from ``q``: ``Q(all in H) = q(H)**n``.
``"without_replacement"``
    ``n`` distinct children drawn sequentially from ``q`` with the mass of each
    drawn token removed and ``q`` renormalised (equivalently Gumbel-top-n, or
    the first ``n`` arrivals of an exponential race with rates ``q``).  If
    ``q`` has fewer than ``n`` non-zero entries, all of them are drafted
    (``n_eff = min(n, nnz(q))``).
``"greedy_draft"``
    Greedy drafting of Hu et al.: the ``n-1`` most likely draft tokens ``T``
    (ties broken by lower index) are fixed, one more child is drawn from
    ``q' = q|_{V \\ T} / q(V \\ T)``.  ``Q(all in H) = 1[T in H] q'(H)``.
``"spechub"`` (``n = 2`` only)
    SpecHub's sparse pair law with hub ``a = argmax q``: ``(i, a)`` with
    probability ``q_i`` and ``(a, i)`` with probability ``q_a q_i / (1 - q_a)``
    for ``i != a``.  If ``q`` is a point mass on ``a`` the second draft is
    uniform on the other tokens (the engine's convention,
    :func:`treespec.verify.spechub.hub_and_second_law`).  As *unordered* sets
    this is exactly greedy drafting with
    ``n = 2``, so its optimum equals the greedy one.
``"deterministic"``
    The top-``n`` tokens of ``q`` as fixed candidates (a point mass on one
    tuple): ``Q(all in H) = 1[top-n in H]``.

Without replacement, exact formulas
-----------------------------------
With ``s = q(H)`` and ``c = 1 - s``:

* ``n = 1``: ``s``;
* ``n = 2``: ``s - c * sum_{i in H} q_i / (1 - q_i)``
  (equivalently ``s * S1 - S2`` with ``S1 = sum_H q/(1-q)``, ``S2 = sum_H q^2/(1-q)``);
* general ``n``: in the exponential race each token ``i`` has an ``Exp(q_i)``
  clock, the complement of ``H`` fires first at ``T_c ~ Exp(c)``, and all ``n``
  drafts lie in ``H`` iff at least ``n`` clocks of ``H`` fired before ``T_c``::

      Q(all in H) = 1 - int_0^1 P(N_H(t(v)) <= n - 1) dv,   t(v) = -log(1 - v) / c,

  where ``N_H(t)`` is Poisson-binomial with success probabilities
  ``1 - exp(-q_i t)``.  We evaluate the equivalent integral
  ``1 - int_0^inf c exp(-c t) P(N_H(t) <= n-1) dt`` on geometric panels,
  truncated where the integrand is provably below ``exp(-40)`` (vectorised
  Gauss-Legendre panels), and a numerically stable
  Poisson-binomial tail (exact DP for the heaviest tokens, scaled Newton
  identities for the rest).

References
----------
Hu et al., "Towards Optimal Multi-draft Speculative Decoding", ICLR 2025, arXiv:2502.18779.
Sun et al., "SpecHub: Provable Acceleration to Multi-Draft Speculative Decoding", arXiv:2411.05289.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike, NDArray

from ._validation import check_distribution, check_n
from ._workspace import workspace

#: Every tuple law understood by this module (the first three are the public
#: ``sampling`` values of :func:`ot_bounds.optimal_acceptance`).
TUPLE_LAWS: tuple[str, ...] = ("iid", "without_replacement", "greedy_draft", "spechub", "deterministic")


def check_law(sampling: object, n: int) -> str:
    """Validate a tuple-law name (and ``n == 2`` for ``"spechub"``)."""
    if sampling not in TUPLE_LAWS:
        hint = " (greedy drafting is 'greedy_draft', as in treespec)" if sampling == "greedy" else ""
        raise ValueError(f"unknown sampling {sampling!r}; expected one of {list(TUPLE_LAWS)}{hint}")
    if sampling == "spechub" and n != 2:
        raise ValueError(f"sampling 'spechub' is defined for n = 2 only, got n = {n}")
    return str(sampling)


@dataclass(frozen=True)
class TupleLaw:
    """Law of the ordered draft tuple (only tuples with positive probability).

    Attributes
    ----------
    tuples : ndarray of int64, shape (T, m)
        Ordered draft tuples (``m`` = number of drafted children, may be < n
        for ``without_replacement`` when ``q`` has fewer than ``n`` non-zeros).
    probs : ndarray of float64, shape (T,)
        Their probabilities (sum to 1).
    vocab_size : int
        ``V``.
    """

    tuples: NDArray[np.int64]
    probs: NDArray[np.float64]
    vocab_size: int


def top_indices(q: NDArray[np.float64], k: int, scratch: NDArray[np.float64] | None = None) -> NDArray[np.int64]:
    """Indices of the ``k`` largest entries of ``q``, sorted by (-q, index).

    O(V + k log k) through a partition (in ``scratch``, shape like ``q``, when given: no fresh
    full-size array); ties are broken by lower index so the result is deterministic.

    Examples
    --------
    >>> top_indices(np.array([0.2, 0.4, 0.4]), 2)
    array([1, 2])
    """
    v = q.size
    k = int(min(max(k, 0), v))
    if k == 0:
        return np.zeros(0, dtype=np.int64)
    if k < v:
        if scratch is None:
            kth = np.partition(q, v - k)[v - k]  # k-th largest value
        else:
            scratch[:] = q
            scratch.partition(v - k)
            kth = scratch[v - k]
        cand = np.flatnonzero(q >= kth)  # all ties at the boundary included
    else:
        cand = np.arange(v)
    order = np.lexsort((cand, -q[cand]))
    return cand[order[:k]].astype(np.int64)


def one_minus(x: NDArray[np.float64], total: float | None = None, outside: float | None = None,
              out: NDArray[np.float64] | None = None) -> NDArray[np.float64]:
    """``1 - x`` computed as the mass of the *other* entries (accurate when x ~ 1).

    ``x`` is a subset of a probability vector; the mass of the entries not in
    ``x`` is ``outside`` when given (best: summed directly from those entries),
    else ``total - x.sum()`` (default ``total = x.sum()``). At most one entry
    can exceed 1/2 and for it the complement is summed directly instead of
    subtracting from 1 (a difference of two numbers near 1 would lose all
    relative accuracy when the complement is ~1e-12).

    Examples
    --------
    >>> one_minus(np.array([1.0, 1e-300]))
    array([1.e-300, 1.e+000])
    """
    out = np.subtract(1.0, x, out=out)
    if x.size:
        i = int(np.argmax(x))
        if x[i] > 0.5:
            if outside is None:
                outside = 0.0 if total is None else max(float(total) - float(x.sum()), 0.0)
            out[i] = float(x[:i].sum()) + float(x[i + 1 :].sum()) + float(outside)
    return out


def effective_n(q: NDArray[np.float64], n: int, sampling: str) -> int:
    """Number of children actually drafted (``min(n, nnz(q))`` without replacement)."""
    if sampling == "without_replacement":
        return int(min(n, np.count_nonzero(q)))
    return n


def greedy_parts(q: NDArray[np.float64], n: int) -> tuple[NDArray[np.int64], NDArray[np.float64]]:
    """Fixed tokens ``T`` (top ``n-1`` of ``q``) and the renormalised rest ``q'``.

    If ``q(V \\ T) = 0``, ``q'`` is uniform on ``V \\ T`` (the engine's convention,
    :func:`treespec.verify.greedy_draft.restricted_draft`); if ``V \\ T`` is empty
    (``n > V``) there is no random draft and ``q'`` is all zeros.

    Examples
    --------
    >>> T, qr = greedy_parts(np.array([0.5, 0.3, 0.2]), 2)
    >>> T, qr
    (array([0]), array([0. , 0.6, 0.4]))
    """
    fixed = top_indices(q, n - 1)
    rest = q.copy()
    rest[fixed] = 0.0
    mass = rest.sum()
    if mass > 0:
        rest /= mass
    else:  # uniform on the complement of T, as the engine's drafter and verifier
        rest[:] = 1.0
        rest[fixed] = 0.0
        free = rest.sum()
        rest = rest / free if free > 0 else rest
    return fixed, rest


def _as_mask(subset: ArrayLike, v: int) -> NDArray[np.bool_]:
    arr = np.asarray(subset)
    if arr.dtype == bool:
        if arr.shape != (v,):
            raise ValueError(f"boolean subset mask must have shape ({v},), got {arr.shape}")
        return arr
    mask = np.zeros(v, dtype=bool)
    idx = arr.astype(np.int64).ravel()
    if idx.size and (idx.min() < 0 or idx.max() >= v):
        raise ValueError(f"subset indices must lie in [0, {v})")
    mask[idx] = True
    return mask


# ----------------------------------------------------------------------------
# Without replacement: exact Q(all n drafts in H)
# ----------------------------------------------------------------------------


def _elementary_symmetric(power: list, m: int) -> list:
    """Elementary symmetric polynomials ``e_0..e_{m-1}`` from power sums ``power[1..m-1]``
    (Newton's identities ``k e_k = sum_{i=1}^k (-1)^(i-1) e_{k-i} p_i``), clipped at 0 against
    rounding; ``power[0]`` is ignored. Works elementwise on arrays of any shape."""
    e = [np.ones_like(power[1])]
    for k in range(1, m):
        acc = np.zeros_like(power[1])
        for i in range(1, k + 1):
            acc += (-1) ** (i - 1) * e[k - i] * power[i]
        e.append(np.maximum(acc / k, 0.0))
    return e


_LIGHT_TOL = 2.0**-44  # absolute rounding error allowed in each P(N_light = b) on a node (~5.7e-14)


def _newton_count_probs(q_light: NDArray[np.float64], t: NDArray[np.float64], m: int
                        ) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    """Newton's-identities part of :func:`_light_count_probs` on nodes ``t``.

    Returns the probabilities, shape (M, m), and an a-priori bound on their absolute rounding
    error, shape (M,). Newton's identities write ``e_b(z)`` as a signed sum of products of power
    sums whose absolute values add up to the complete homogeneous polynomial ``h_b(z)`` (same
    recursion, every sign +), so the rounding error of ``e_b`` is a small multiple of
    ``eps h_b(z)`` (taken as ``4 m eps h_b(z)``). With ``z = x / max x`` that is relative when the ``z`` are comparable and
    catastrophic when one of them dominates (far nodes of unequal masses), which the bound shows.
    The exponent ``-s t + b log max x`` is off by up to ``d = eps (s t + b |log max x|)``, a
    factor ``e^(+-d)`` on the result: on far nodes the masses of small tokens vanish from it
    (``0.7 t + 1e-18 t`` rounds to ``0.7 t``), so the bound is
    ``exp(scale + d) h_b(z) (4 m eps + expm1(d))``.
    """
    out = np.zeros((t.size, m))  # shape (M, m)
    err = np.zeros(t.size)  # shape (M,)
    s = float(q_light.sum())
    out[:, 0] = np.exp(-s * t)
    if m == 1 or q_light.size == 0:
        return out, err
    chunk = max(1, 2_000_000 // q_light.size)
    for lo in range(0, t.size, chunk):
        tt = t[lo : lo + chunk]  # shape (M',)
        with np.errstate(over="ignore"):
            x = np.expm1(np.outer(tt, q_light))  # shape (M', L)
        xmax = x.max(axis=1)  # shape (M',)
        if np.all(xmax < np.inf):  # z = expm1(a) / expm1(a_max) with a = q t
            safe = np.where(xmax > 0, xmax, 1.0)
            z = x / safe[:, None]  # shape (M', L), entries in [0, 1]
            log_xmax = np.log(safe)
        else:  # far nodes (a > ~709): the same ratio as exp(a - a_max) (1 - e^-a) / (1 - e^-a_max)
            a = np.outer(tt, q_light)  # shape (M', L)
            amax = a.max(axis=1)  # shape (M',)
            safe = np.where(amax > 0, -np.expm1(-amax), 1.0)  # 1 - e^-a_max
            z = np.exp(a - amax[:, None]) * (-np.expm1(-a)) / safe[:, None]  # shape (M', L), in [0, 1]
            log_xmax = np.where(amax > 0, amax + np.log(safe), 0.0)  # log expm1(a_max)
        power = [np.zeros_like(tt)]
        zj = np.ones_like(z)
        for _j in range(1, m):
            zj = zj * z
            power.append(zj.sum(axis=1))
        e = _elementary_symmetric(power, m)
        h = [np.ones_like(tt)]  # complete homogeneous h_b(z), b < m: k h_k = sum_i h_{k-i} p_i
        for k in range(1, m):
            h.append(sum(h[k - i] * power[i] for i in range(1, k + 1)) / k)
        worst = np.full(tt.size, -np.inf)
        eps = np.finfo(float).eps
        for b in range(1, m):
            with np.errstate(divide="ignore", over="ignore"):  # e_b = 0: log -inf, P = 0; inf: redone
                scale = -s * tt + b * log_xmax  # log of exp(-s t) max(x)^b
                val = np.exp(scale + np.log(e[b]))  # one exponent: no inf * 0
                drift = eps * (s * tt + b * np.abs(log_xmax))  # rounding error of the exponent
                log_expm1 = np.where(drift > 0, drift + np.log(-np.expm1(-drift)), -np.inf)  # log expm1(d)
                bound = scale + drift + np.log(h[b]) + np.logaddexp(np.log(4.0 * m * eps), log_expm1)
                worst = np.maximum(worst, np.where(xmax > 0, bound, -np.inf))
            out[lo : lo + chunk, b] = np.where(xmax > 0, val, 0.0)
        err[lo : lo + chunk] = np.exp(np.minimum(worst, 700.0))
    return out, err


def _convolve_counts(a: NDArray[np.float64], b: NDArray[np.float64]) -> NDArray[np.float64]:
    """Law of the sum of two independent counts, truncated to ``m`` values: shape (M, m)."""
    m = a.shape[1]
    out = np.zeros_like(a)
    for i in range(m):
        out[:, i:] += a[:, i : i + 1] * b[:, : m - i]
    return out


def _light_count_probs(q_light: NDArray[np.float64], t: NDArray[np.float64], m: int) -> NDArray[np.float64]:
    """P(N(t) = b) for b < m, N Poisson-binomial with probs 1 - exp(-q_i t).

    Uses ``P(N = b) = exp(-s t) e_b(x)`` with ``x_i = expm1(q_i t)`` and the
    elementary symmetric polynomials from Newton's identities on ``x / max x``
    (scaled to avoid overflow). That is accurate while no ``x_i`` dominates the
    others on a node; on the nodes where the rounding bound of
    :func:`_newton_count_probs` exceeds ``_LIGHT_TOL`` (far nodes with unequal
    masses), the largest tokens move to the exact DP (8, 64, 512, ... of them)
    until the rest pass the bound (at worst every token is in the DP).

    Parameters
    ----------
    q_light : ndarray, shape (L,)
    t : ndarray, shape (M,)
    m : int

    Returns
    -------
    ndarray, shape (M, m)
    """
    if q_light.size == 0:
        out = np.zeros((t.size, m))
        out[:, 0] = 1.0
        return out
    out, err = _newton_count_probs(q_light, t, m)
    redo = np.flatnonzero(err > _LIGHT_TOL)
    if redo.size == 0:
        return out
    order = np.argsort(-q_light, kind="stable")
    dp = np.zeros((redo.size, m))  # shape (R, m): law of the count of the DP tokens
    dp[:, 0] = 1.0
    done, size = 0, 8
    while redo.size:
        size = min(size, q_light.size)
        for qi in q_light[order[done:size]]:  # exact DP over the next largest tokens
            y = -np.expm1(-qi * t[redo])[:, None]  # shape (R, 1)
            new = dp * (1.0 - y)
            new[:, 1:] += dp[:, :-1] * y
            dp = new
        done = size
        if done == q_light.size:
            out[redo] = dp
            break
        rest, rest_err = _newton_count_probs(q_light[order[done:]], t[redo], m)
        ok = rest_err <= _LIGHT_TOL
        out[redo[ok]] = _convolve_counts(dp[ok], rest[ok])
        redo, dp = redo[~ok], dp[~ok]
        size *= 8
    return out


def _stirling2_table(m_max: int) -> NDArray[np.float64]:
    """coef[j, m] = j! S(m, j) / m!  (so that expm1(x)^j = sum_m coef[j, m] x^m)."""
    s2 = np.zeros((m_max + 1, m_max + 1))
    s2[0, 0] = 1.0
    for m in range(1, m_max + 1):
        for j in range(1, m + 1):
            s2[m, j] = j * s2[m - 1, j] + s2[m - 1, j - 1]
    coef = np.zeros((m_max + 1, m_max + 1))
    fact = np.cumprod([1.0] + list(range(1, m_max + 1)))
    for j in range(m_max + 1):
        for m in range(m_max + 1):
            coef[j, m] = fact[j] * s2[m, j] / fact[m]
    return coef


_M_TINY = 16
_TINY_COEF = _stirling2_table(_M_TINY)
_TINY_REACH = 0.25  # tiny tokens satisfy q * t <= 0.25 on every node
# the tiny tokens' moments are summed to a low order over the vocabulary and to a higher one
# over the few tokens with q t above one of these on some node (chosen by a cost model)
_SPLIT_REACHES = (2.0**-16, 2.0**-14, 2.0**-12, 2.0**-10, 2.0**-8, 2.0**-6)


def _moment_order(x_max: float, n: int) -> int:
    """Moments (orders 1..K) that represent tokens with ``q t <= x_max`` to double precision.

    The j-th power sum needs ``expm1(x)^j = x^j ((e^x - 1) / x)^j``, whose series has
    coefficients at most those of ``e^(j x)``, so truncating at total order ``K`` leaves a
    relative error below ``(j x)^R / R! e^(j x)`` with ``R = K - j + 1``; ``j <= n - 1``.
    Returns the least ``K`` that makes this ``<= 2^-56``, at most 16 (the order that
    :data:`_TINY_REACH` was chosen for).
    """
    j = max(n - 1, 1)
    term = 1.0
    for r in range(1, _M_TINY - j + 2):
        term *= j * x_max / r
        if term * math.exp(j * x_max) <= 2.0**-56:
            return j - 1 + r
    return _M_TINY


def _tiny_count_probs(moments: NDArray[np.float64], t: NDArray[np.float64], m: int) -> NDArray[np.float64]:
    """P(N(t) = b), b < m, for many tiny tokens summarised by their moments.

    ``moments[k] = sum_i q_i^k`` (k = 0..16) over tokens with ``q_i t <= 1/4``
    on all nodes, so ``x_i = expm1(q_i t) <= 0.29`` and the power sums
    ``sum_i x_i^j = sum_k j! S(k, j) / k! t^k moments[k]`` converge to double
    precision (truncation below ``0.25^17 / 17!``).  Newton's identities are
    stable here because every ``x_i`` is small.

    Returns
    -------
    ndarray, shape (M, m)
    """
    out = np.zeros((t.size, m))  # shape (M, m)
    out[:, 0] = np.exp(-moments[1] * t)
    if m == 1:
        return out
    tpow = t[:, None] ** np.arange(_M_TINY + 1)[None, :]  # shape (M, K+1)
    power = [np.zeros_like(t)]
    for j in range(1, m):
        power.append(tpow @ (_TINY_COEF[j] * moments))
    e = _elementary_symmetric(power, m)
    for k in range(1, m):
        out[:, k] = out[:, 0] * e[k]
    return out


def _split_heavy(q_h: NDArray[np.float64], cap: int = 64) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    """Split positive masses into heavy (exact DP) and light (Newton) parts.

    Heavy = the largest tokens until the largest remaining one carries at most
    a quarter of the remaining light mass (or ``cap`` tokens).
    """
    k = min(cap + 1, q_h.size)
    top = top_indices(q_h, k)
    top_vals = q_h[top]
    total = float(q_h.sum())
    tail = total - np.concatenate(([0.0], np.cumsum(top_vals)))  # tail[j] = mass outside top-j
    n_heavy = min(cap, q_h.size)
    for j in range(min(cap, q_h.size) + 1):
        if j == q_h.size or (j < top_vals.size and top_vals[j] <= 0.25 * tail[j]):
            n_heavy = j
            break
    mask = np.zeros(q_h.size, dtype=bool)
    mask[top[:n_heavy]] = True
    return q_h[mask], q_h[~mask]


def _wor_count_below(
    heavy: NDArray[np.float64],
    light: NDArray[np.float64],
    t: NDArray[np.float64],
    n: int,
    tiny_moments: NDArray[np.float64] | None = None,
    tiny_scale: float = 1.0,
) -> NDArray[np.float64]:
    """P(N_H(t) <= n - 1) for the exponential race restricted to H, shape (M,).

    ``tiny_moments[k] = sum_i (q_i tiny_scale)^k`` over the tiny tokens (scaled so that neither
    the moments underflow nor the powers of ``t / tiny_scale`` overflow on far nodes)."""
    dist = np.zeros((t.size, n))  # shape (M, n): P(heavy count = a), a < n
    dist[:, 0] = 1.0
    for qh in heavy:
        y = -np.expm1(-qh * t)[:, None]  # shape (M, 1)
        new = dist * (1.0 - y)
        new[:, 1:] += dist[:, :-1] * y
        dist = new
    parts = [_light_count_probs(light, t, n)]  # each shape (M, n)
    if tiny_moments is not None:
        parts.append(_tiny_count_probs(tiny_moments, t / tiny_scale, n))
    for part in parts:  # truncated convolution of count distributions
        new = np.zeros_like(dist)
        for a in range(n):
            new[:, a:] += dist[:, a : a + 1] * part[:, : n - a]
        dist = new
    return np.clip(dist.sum(axis=1), 0.0, 1.0)


_GL_NODES, _GL_WEIGHTS = np.polynomial.legendre.leggauss(16)


def wor_prob_all_in(q_in: NDArray[np.float64], c: float, n: int) -> float:
    """Exact ``Q_wor(all n drafts in H)`` from the masses of ``H``.

    For ``n >= 3`` the integral ``1 - int_0^inf c e^{-ct} P(N_H(t) <= n-1) dt``
    is evaluated with 16-point Gauss-Legendre rules on geometric panels
    (ratio 2) covering ``[0, t_end]``; beyond ``t_end`` the integrand is below
    ``exp(-40)`` (``P(N_H(t) <= n-1) <= (|H|+1)^(n-1) exp(-r t)`` with ``r`` the
    mass of ``H`` outside its ``n-1`` largest tokens).  Agreement with exact
    enumeration is ~1e-13 in the tests.

    Parameters
    ----------
    q_in : ndarray, shape (|H|,)
        Draft probabilities of the tokens of ``H`` (zeros allowed).
    c : float
        ``q(V \\ H)``, the draft mass outside ``H``.
    n : int
        Effective number of drafts (``<=`` number of non-zeros of the full q).

    Examples
    --------
    >>> round(wor_prob_all_in(np.array([0.5, 0.3]), 0.2, 2), 10)
    0.5142857143
    """
    q_pos = q_in[q_in > 0]
    if q_pos.size < n:
        return 0.0
    s = float(q_pos.sum())
    if c <= 0.0:
        return 1.0
    if n == 1:
        return s
    if n == 2:
        return float(max(s - c * np.sum(q_pos / one_minus(q_pos, outside=c)), 0.0))
    top = np.argsort(-q_pos)[: n - 1] if q_pos.size < 4 * n else top_indices(q_pos, n - 1)
    rest = np.ones(q_pos.size, dtype=bool)
    rest[top] = False
    r = max(float(q_pos[rest].sum()), 1e-300)  # summed directly: s - (top mass) loses a tiny r
    t_end = ((n - 1) * np.log(q_pos.size + 1.0) + 40.0) / r
    t_start = 1e-3 / max(s, c)  # below this both scales are resolved by one panel
    n_panels = max(1, int(np.ceil(np.log2(t_end / t_start))))
    edges = np.concatenate(([0.0], t_start * 2.0 ** np.arange(n_panels + 1)))
    edges[-1] = max(edges[-1], t_end)
    # tiny tokens (q t <= 1/4 on every node) enter only through 17 moments
    tiny = q_pos <= _TINY_REACH / edges[-1]
    tiny_moments = None
    if np.count_nonzero(tiny) > 64:
        qt = q_pos[tiny] * edges[-1]  # q t_end <= 1/4: moments of q t_end, powers of t / t_end
        tiny_moments = np.empty(_M_TINY + 1)
        tiny_moments[0] = qt.size
        acc = np.ones_like(qt)
        for k in range(1, _M_TINY + 1):
            acc = acc * qt
            tiny_moments[k] = acc.sum()
        q_pos = q_pos[~tiny]
    heavy, light = _split_heavy(q_pos) if q_pos.size else (q_pos, q_pos)
    lo, hi = edges[:-1, None], edges[1:, None]  # shape (P, 1)
    nodes = (0.5 * (hi - lo) * _GL_NODES[None, :] + 0.5 * (hi + lo)).ravel()  # shape (P*16,)
    weights = (0.5 * (hi - lo) * _GL_WEIGHTS[None, :]).ravel()
    vals = c * np.exp(-c * nodes) * _wor_count_below(heavy, light, nodes, n, tiny_moments, float(edges[-1]))
    return float(min(max(1.0 - float(weights @ vals), 0.0), 1.0))


def _prefix_top_mass(qs: NDArray[np.float64], ks: NDArray[np.int64], r: int, pool: int = 256,
                     top: NDArray[np.int64] | None = None) -> NDArray[np.float64]:
    """Mass of the ``r`` largest entries of each prefix ``qs[:k]``, ``k`` in ``ks``.

    Once a prefix holds ``r`` of the ``pool`` largest entries of ``qs``, its ``r`` largest are among
    them (every other entry is no larger than each of them); shorter prefixes are done directly.
    ``top``: those positions, sorted, if already known.
    """
    out = np.zeros(ks.size)
    if top is None:
        top = np.sort(top_indices(qs, pool))  # positions of the pool largest, in prefix order
    inside = np.searchsorted(top, ks)  # how many of them each prefix holds
    # prefixes holding the same number of pool entries share the answer: one sort per distinct count
    for c in np.unique(inside[(inside >= r) | (inside == top.size)]).tolist():
        vals = qs[top[:c]]
        out[inside == c] = float(np.sort(vals)[::-1][:r].sum()) if c >= r else float(vals.sum())
    for i in np.flatnonzero((inside < r) & (inside < top.size)).tolist():
        out[i] = float(qs[top_indices(qs[: int(ks[i])], r)].sum())
    return out


class WorPrefixQuadrature:
    """Exact ``Q_wor(all n drafts in H_k)`` for prefixes ``H_k = qs[:k]``, one grid for many calls.

    Same integral as :func:`wor_prob_all_in`, ``1 - int_0^inf c_k e^{-c_k t} P(N_k(t) <= n-1) dt``,
    but one set of quadrature nodes serves every prefix with ``k_lo <= k <= k_hi``: it is sized for
    the hardest of them (the smallest ``r_k``, the mass of ``H_k`` outside its ``n-1`` largest
    tokens; ``r_k`` never decreases with ``k``). Everything that depends only on the nodes is
    computed once: the exact Poisson-binomial DP over the non-tiny tokens (its state after each
    of them is kept) and block sums of the 17 moments of the tiny tokens (``q t <= 1/4`` on every
    node). A call then costs ``O(K * (block + nodes * n))`` for ``K`` prefixes, which is what makes
    the rounds of the branch and bound in :func:`ot_bounds.optimal_acceptance` cheap. Prefixes with
    ``r_k < 1e-3`` (a time range too long for one grid) fall back to :func:`wor_prob_all_in`.

    Parameters
    ----------
    qs : ndarray, shape (m,)
        Positive draft masses in prefix order.
    outside : float
        Draft mass not listed in ``qs``.
    n : int
        Effective number of drafts (>= 3).
    k_lo, k_hi : int
        Range of prefix lengths that will be asked for (1 <= k_lo <= k_hi <= m).
    cache : dict, optional
        Shared by several grids over the same ``(qs, outside, n)``: prefix sums and every grid
        (keyed by its number of panels) are computed once.
    """

    block = 128
    # first panel [0, t_start]: every rate in the integrand is <= 1 (masses of a distribution), so
    # 16 Gauss-Legendre nodes resolve it to rounding; the panels then double up to t_end
    t_start = 0.5

    def __init__(self, qs: NDArray[np.float64], outside: float, n: int, k_lo: int, k_hi: int,
                 cache: dict | None = None) -> None:
        cache = {} if cache is None else cache  # shared by grids over the same (qs, outside, n)
        self.qs, self.n = qs, n
        self.k_hi = int(k_hi)
        if "base" not in cache:
            s_all = np.cumsum(qs)  # shape (m,)
            # mass after each prefix, summed from the small end (1 - s_k would lose the digits of c_k ~ 1e-12)
            after = np.concatenate((np.cumsum(qs[::-1])[::-1][1:], [0.0])) + outside  # shape (m,)
            cache["base"] = (s_all, after, np.sort(top_indices(qs, 256)))  # the 256 largest, by position
        self.s_all, self.after, self.top = cache["base"]
        r_lo = float(self.s_all[k_lo - 1] - _prefix_top_mass(qs, np.array([k_lo]), n - 1, top=self.top)[0])
        self.r_min = max(r_lo, 1e-3)
        t_end = ((n - 1) * np.log(self.k_hi + 1.0) + 40.0) / self.r_min
        t_start = self.t_start
        n_panels = max(1, int(np.ceil(np.log2(t_end / t_start))))
        # the grid depends only on n_panels (its end t_start 2^n_panels >= t_end): shared through the cache
        if ("grid", n_panels) not in cache:
            cache[("grid", n_panels)] = self._grid(qs, n, t_start, n_panels)
        self.nodes, self.weights, self.tiny, self.block_cum, self.big_pos, self.hist, self.tpow, self.k_all = \
            cache[("grid", n_panels)]

    @classmethod
    def _grid(cls, qs: NDArray[np.float64], n: int, t_start: float, n_panels: int) -> tuple:
        edges = np.concatenate(([0.0], t_start * 2.0 ** np.arange(n_panels + 1)))
        lo, hi = edges[:-1, None], edges[1:, None]
        nodes = (0.5 * (hi - lo) * _GL_NODES[None, :] + 0.5 * (hi + lo)).ravel()  # shape (M,)
        weights = (0.5 * (hi - lo) * _GL_WEIGHTS[None, :]).ravel()  # shape (M,)
        tiny = qs <= _TINY_REACH / edges[-1]  # shape (m,)
        # block sums of the tiny moments: shape (blocks + 1, 17), cumulative
        b = cls.block
        nb = -(-qs.size // b)
        ws = workspace()
        x = ws.take("grid_x", nb * b)
        x[qs.size :] = 0.0
        np.multiply(qs, tiny, out=x[: qs.size])
        x = x.reshape(nb, b)  # shape (blocks, b)
        sums = np.empty((nb, _M_TINY + 1))
        sums[:, 0] = 0.0  # order 0 (a count) never enters the power sums (coefficient 0)
        # moments up to the order the largest tiny token needs (in place: memory-bound passes over
        # the vocabulary), or to a lower order if only a few tokens need more (their higher
        # moments are then summed on their own)
        t_end = float(edges[-1])
        k_all = _moment_order(float(x.max()) * t_end, n)
        k_low, mid = k_all, None
        # where to split, by a cost model (dense: two passes per order over every token; sparse:
        # ~6x a dense pass per order and token above the split), token counts from a 1-in-32 sample
        sample = x.ravel()[::32]
        best_cost, best_reach = 2.0 * k_all * qs.size, None
        for reach in _SPLIT_REACHES:
            k = _moment_order(reach, n)
            above = 32.0 * np.count_nonzero(sample > reach / t_end)
            cost = 2.0 * k * qs.size + 6.0 * (k_all - k) * above
            if k < k_all and cost < best_cost:
                best_cost, best_reach, k_low = cost, reach, k
        if best_reach is not None:
            mid = np.flatnonzero(x.ravel() > best_reach / t_end)
        sums[:, k_low + 1 :] = 0.0
        acc = ws.take("grid_acc", nb * b).reshape(nb, b)
        acc[:] = x
        for j in range(1, k_low + 1):
            np.add.reduce(acc, axis=1, out=sums[:, j])
            if j < k_low:
                acc *= x
        if k_low < k_all:
            x_mid, blk = qs[mid], mid // b
            acc_mid = x_mid**k_low
            for j in range(k_low + 1, k_all + 1):
                acc_mid *= x_mid
                sums[:, j] = np.bincount(blk, weights=acc_mid, minlength=nb)
        block_cum = np.concatenate((np.zeros((1, _M_TINY + 1)), np.cumsum(sums, axis=0)))
        # exact DP over the non-tiny tokens, state after each of them: shape (big + 1, M, n)
        big_pos = np.flatnonzero(~tiny)
        hist = np.zeros((big_pos.size + 1, nodes.size, n))
        hist[0, :, 0] = 1.0
        arrive = -np.expm1(-np.outer(qs[big_pos], nodes))[:, :, None]  # shape (big, M, 1)
        stay = 1.0 - arrive
        for j in range(big_pos.size):  # one small update per token (few: they are not tiny)
            np.multiply(hist[j], stay[j], out=hist[j + 1])
            hist[j + 1, :, 1:] += hist[j, :, :-1] * arrive[j]
        tpow = nodes[None, :] ** np.arange(_M_TINY + 1)[:, None]  # shape (17, M)
        return nodes, weights, tiny, block_cum, big_pos, hist, tpow, k_all

    def _moments(self, ks: NDArray[np.int64]) -> NDArray[np.float64]:
        """Tiny moments of each prefix, shape (K, 17) (order 0 unused, left 0)."""
        b = self.block
        full = ks // b
        out = self.block_cum[full].copy()
        rem = ks - full * b
        if rem.any():
            idx = (full * b)[:, None] + np.arange(b)[None, :]  # shape (K, b)
            ok = np.arange(b)[None, :] < rem[:, None]
            idx = np.minimum(idx, self.qs.size - 1)
            x = np.where(ok & self.tiny[idx], self.qs[idx], 0.0)  # shape (K, b)
            powers = np.cumprod(np.broadcast_to(x[:, :, None], (*x.shape, self.k_all)), axis=2)  # (K, b, k_all)
            out[:, 1 : self.k_all + 1] += powers.sum(axis=1)  # the orders the block sums carry
        return out

    def __call__(self, ks: ArrayLike) -> NDArray[np.float64]:
        """``Q_wor(all n drafts in H_k)`` for each prefix length ``k`` in ``ks``, shape (K,)."""
        n = self.n
        ks = np.asarray(ks, dtype=np.int64)
        out = np.zeros(ks.size)
        if ks.size == 0:
            return out
        if ks.max() > self.k_hi:
            raise ValueError("prefix longer than the range this grid was built for")
        s_k = self.s_all[ks - 1]
        c_k = np.maximum(self.after[ks - 1], 0.0)
        r_k = s_k - _prefix_top_mass(self.qs, ks, n - 1, top=self.top)
        slow = (r_k < self.r_min * (1 - 1e-12)) | (c_k <= 0.0) | (ks < n)
        for idx in np.flatnonzero(slow):
            k = int(ks[idx])
            out[idx] = wor_prob_all_in(self.qs[:k], float(c_k[idx]), n) if c_k[idx] > 0 else float(k >= n)
        fast = np.flatnonzero(~slow)
        if fast.size == 0:
            return out
        kf, cf = ks[fast], c_k[fast]
        moments = self._moments(kf)  # shape (K, 17)
        base = np.exp(-np.outer(moments[:, 1], self.nodes))  # P(no tiny arrival), shape (K, M)
        coef = moments[:, None, :] * _TINY_COEF[1:n][None, :, :]  # shape (K, n-1, 17)
        power = (coef.reshape(-1, _M_TINY + 1) @ self.tpow).reshape(kf.size, n - 1, -1)  # shape (K, n-1, M)
        e = _elementary_symmetric([None] + [power[:, j - 1] for j in range(1, n)], n)
        big = self.hist[np.searchsorted(self.big_pos, kf)]  # shape (K, M, n)
        # P(N <= n-1) = sum_a P(big = a) P(tiny <= n-1-a), P(tiny <= b) = base (e_0 + ... + e_b)
        below = big[:, :, n - 1].copy()  # shape (K, M)
        e_cum = e[0]
        for a in range(n - 2, -1, -1):
            e_cum = e_cum + e[n - 1 - a]
            below += big[:, :, a] * e_cum
        below *= base
        below = np.clip(below, 0.0, 1.0)
        integral = (cf[:, None] * np.exp(-np.outer(cf, self.nodes)) * below) @ self.weights  # shape (K,)
        out[fast] = np.clip(1.0 - integral, 0.0, 1.0)
        return out


def wor_prob_all_in_prefixes(
    qs: NDArray[np.float64], ks: NDArray[np.int64], outside: float, n: int
) -> NDArray[np.float64]:
    """Exact ``Q_wor(all n drafts in H_k)`` for many prefixes ``H_k`` at once.

    One :class:`WorPrefixQuadrature` grid for the requested range of prefixes.

    Parameters
    ----------
    qs : ndarray, shape (m,)
        Positive draft masses in prefix order.
    ks : ndarray of int, shape (K,)
        Prefix lengths to evaluate (1..m).
    outside : float
        Draft mass not listed in ``qs``.
    n : int
        Effective number of drafts (>= 3).

    Returns
    -------
    ndarray, shape (K,)
    """
    ks = np.asarray(ks, dtype=np.int64)
    if ks.size == 0:
        return np.zeros(0)
    return WorPrefixQuadrature(qs, outside, n, int(ks.min()), int(ks.max()))(ks)


# ----------------------------------------------------------------------------
# Public helpers
# ----------------------------------------------------------------------------


def prob_all_drafts_in(q: ArrayLike, subset: ArrayLike, n: int, sampling: str) -> float:
    """Exact probability that all drafted children lie in a token set ``H``.

    Parameters
    ----------
    q : array_like, shape (V,)
        Draft distribution.
    subset : array_like
        ``H`` as a boolean mask of shape (V,) or an array of token indices.
    n : int
        Number of drafted children.
    sampling : str
        One of :data:`TUPLE_LAWS`.

    Returns
    -------
    float
        ``Q(all drafts in H)``.

    Examples
    --------
    >>> round(prob_all_drafts_in([0.5, 0.3, 0.2], [0, 1], 2, "iid"), 10)
    0.64
    >>> round(prob_all_drafts_in([0.5, 0.3, 0.2], [0, 1], 2, "without_replacement"), 10)
    0.5142857143
    """
    qa = check_distribution(q, "q")
    n = check_n(n)
    sampling = check_law(sampling, n)
    mask = _as_mask(subset, qa.size)
    return _prob_all_in(qa, mask, n, sampling)


def _prob_all_in(q: NDArray[np.float64], mask: NDArray[np.bool_], n: int, sampling: str) -> float:
    if sampling == "iid":
        return float(q[mask].sum() ** n)
    if sampling == "without_replacement":
        n_eff = effective_n(q, n, sampling)
        return wor_prob_all_in(q[mask], float(q[~mask].sum()), n_eff)
    if sampling in ("greedy_draft", "spechub"):
        fixed, rest = greedy_parts(q, n)
        if not mask[fixed].all():
            return 0.0
        return float(rest[mask].sum()) if rest.any() else 1.0
    if sampling == "deterministic":
        return float(mask[top_indices(q, n)].all())
    raise AssertionError(sampling)


def draft_tuple_law(q: ArrayLike, n: int, sampling: str) -> TupleLaw:
    """Enumerate the law of ordered draft tuples (small vocabularies only).

    Only tuples with positive probability are listed.  Sizes: about ``V**n``
    tuples for ``iid`` and ``without_replacement``, ``V`` for ``greedy_draft``,
    ``2V`` for ``spechub`` and 1 for ``deterministic``.

    Examples
    --------
    >>> law = draft_tuple_law([0.5, 0.5], 2, "without_replacement")
    >>> law.tuples.tolist(), law.probs.tolist()
    ([[0, 1], [1, 0]], [0.5, 0.5])
    """
    qa = check_distribution(q, "q")
    n = check_n(n)
    sampling = check_law(sampling, n)
    v = qa.size
    support = np.flatnonzero(qa > 0)
    rows: list[tuple[int, ...]] = []
    probs: list[float] = []
    if sampling == "iid":
        for tup in itertools.product(support.tolist(), repeat=n):
            rows.append(tup)
            probs.append(float(np.prod(qa[list(tup)])))
    elif sampling == "without_replacement":
        m = effective_n(qa, n, sampling)
        for tup in itertools.permutations(support.tolist(), m):
            pr, left = 1.0, qa.copy()
            for x in tup:
                pr *= qa[x] / left.sum()  # renormalise by the mass not yet drafted
                left[x] = 0.0
            rows.append(tup)
            probs.append(pr)
    elif sampling == "greedy_draft":
        fixed, rest = greedy_parts(qa, n)
        head = tuple(int(i) for i in fixed)
        if rest.any():
            for x in np.flatnonzero(rest > 0):
                rows.append(head + (int(x),))
                probs.append(float(rest[x]))
        else:
            rows.append(head)
            probs.append(1.0)
    elif sampling == "spechub":
        a = int(np.argmax(qa))
        qa_hub = qa[a]
        rest_mass = float(qa.sum() - qa_hub) if qa_hub <= 0.5 else float(np.delete(qa, a).sum())
        others = [int(i) for i in support if i != a]
        if not others:  # point mass: second draft uniform on the other tokens
            if v == 1:
                rows.append((a,))
                probs.append(1.0)
            for i in range(v):
                if i != a:
                    rows.append((a, i))
                    probs.append(1.0 / (v - 1))
        for i in others:
            rows.append((i, a))
            probs.append(float(qa[i]))
            rows.append((a, i))
            probs.append(float(qa_hub * qa[i] / rest_mass))
    else:  # deterministic
        rows.append(tuple(int(i) for i in top_indices(qa, n)))
        probs.append(1.0)
    width = max(len(r) for r in rows)
    tuples = np.array([list(r) + [r[-1]] * (width - len(r)) for r in rows], dtype=np.int64)
    prob_arr = np.array(probs, dtype=np.float64)
    keep = prob_arr > 0
    return TupleLaw(tuples=tuples[keep], probs=prob_arr[keep] / prob_arr[keep].sum(), vocab_size=v)
