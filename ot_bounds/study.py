"""Batched exact acceptance rates for many (p, q) pairs on a full vocabulary.

The real-model study (``benchmarks/study_real_model.py``) evaluates, at thousands
of positions and for several temperatures, the optimal acceptance of each draft
law and the exact acceptance of each verifier on the full Gemma vocabulary
(262,144 tokens).  Calling :func:`ot_bounds.optimal_acceptance` /
:func:`ot_bounds.verifier_acceptance` once per position would take tens of
minutes, so this module evaluates the same closed forms on a batch ``[B, V]``
of rows at once with torch (float64), sorting each row by ``p / q`` once and
reusing the order for every ``n``:

* optimal, ``"iid"``: ``1 + min_k [P_k - Q_k^n]`` over ratio-sorted prefixes;
* optimal, ``"without_replacement"``: ``n = 1``: ``sum min(p, q)``; ``n = 2``:
  the closed form ``Q_2(H) = s - (1 - s) sum_H q / (1 - q)`` on the same
  prefixes; ``n >= 3``: :func:`ot_bounds.optimal_acceptance` on a truncated
  vocabulary with a rigorous error bound (:func:`truncated_wor_optimal`);
* optimal, ``"greedy_draft"``: ``p(T) + sum_{y not in T} min(p, q')``;
* verifiers ``single``, ``rrs``, ``kseq``, ``spechub``, ``greedy_draft``,
  ``deterministic``: the closed forms of :mod:`ot_bounds.verifiers`
  (``kseq``'s ``rho*`` by bisection on the sorted ratios: ``beta(rho)`` is a
  prefix sum).  ``rrs_without_replacement`` has no closed form (its exact
  value is a recursion over rejected tokens, ``O(V^n)``) and is skipped at
  full vocabulary.

Every function here is checked against the per-pair reference implementations
in ``tests/ot_bounds/test_study.py``.

Truncation bound (``n >= 3`` without replacement)
-------------------------------------------------
Let ``S`` be a token set, ``p' = p|_S / p(S)``, ``q' = q|_S / q(S)``.  For every
``H``, ``|p(H) - p'(H)| <= TV(p, p') = p(V - S)`` and ``|Q(H) - Q'(H)| <=
TV(Q, Q')``; the exponential race couples ``Q`` and ``Q'`` so that they differ
only if one of the first ``n`` arrivals lies outside ``S``, whose probability is
at most ``q(V - S) * sum_{j<n} 1 / (1 - M_j)`` (``M_j`` = mass of the ``j``
largest entries of ``q``).  Since ``alpha* = 1 + min_H [p(H) - Q(all in H)]``,

    |alpha*(p, q) - alpha*(p', q')| <= p(V - S) + q(V - S) sum_{j<n} 1/(1 - M_j).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .optimal import optimal_acceptance


def _normalise(x: torch.Tensor) -> torch.Tensor:
    total = x.sum(dim=1, keepdim=True)
    return torch.where(total > 0, x / torch.where(total > 0, total, torch.ones_like(total)), x)


def _one_minus(q: torch.Tensor) -> torch.Tensor:
    """``1 - q`` row-wise, with the largest entry's complement summed directly (accurate near 1)."""
    imax = q.argmax(dim=1, keepdim=True)
    qmax = q.gather(1, imax)
    rest = q.scatter(1, imax, 0.0).sum(dim=1, keepdim=True)
    return (1.0 - q).scatter(1, imax, torch.where(qmax > 0.5, rest, 1.0 - qmax))


@dataclass
class SortedPairs:
    """Rows sorted by ``p / q`` ascending (``q = 0`` tokens last)."""

    p: torch.Tensor  # [B, V] sorted target
    q: torch.Tensor  # [B, V] sorted draft
    ratio: torch.Tensor  # [B, V] sorted p / q (inf where q = 0)
    big_p: torch.Tensor  # [B, V] prefix sums of p
    big_q: torch.Tensor  # [B, V] prefix sums of q
    after_q: torch.Tensor  # [B, V] q mass after each prefix, summed from the small end (1 - big_q
    #                        loses the digits of a remainder ~1e-14 next to a near-1 prefix)


def sort_pairs(p: torch.Tensor, q: torch.Tensor, order: torch.Tensor | None = None) -> SortedPairs:
    """Sort every row by ``p / q`` once (reused by all ``n`` and by ``kseq``).

    ``order`` ``[B, V]``: a ratio order known in advance. For ``p = softmax(a / T)`` and
    ``q = softmax(b / T)`` the ratio is ``exp((a - b) / T)`` times a constant, so
    :func:`logit_order` (the order of ``a - b``) serves every temperature: one sort per position
    instead of one per temperature. Exact ties may come out in another order, which cannot change
    any prefix minimum computed here.
    """
    ratio = torch.where(q > 0, p / q.clamp(min=torch.finfo(q.dtype).tiny), torch.full_like(p, torch.inf))
    if order is None:
        ratio, order = torch.sort(ratio, dim=1)
    else:
        given = ratio.gather(1, order)
        # the given order must sort the ratios up to rounding (a few ulps); else (e.g. underflow to
        # p = q = 0 at a low temperature) sort for real
        if bool((given[:, 1:] < given[:, :-1] * (1.0 - 1e-12)).any()):
            ratio, order = torch.sort(ratio, dim=1)
        else:
            ratio = torch.cummax(given, dim=1).values  # remove the ulp-level inversions
    ps, qs = p.gather(1, order), q.gather(1, order)
    suffix = qs.flip(1).cumsum(dim=1).flip(1)  # [B, V] q mass from each position on
    after = torch.cat((suffix[:, 1:], torch.zeros_like(suffix[:, :1])), dim=1)
    return SortedPairs(ps, qs, ratio, ps.cumsum(dim=1), qs.cumsum(dim=1).clamp(max=1.0), after)


def logit_order(target_logits: torch.Tensor, draft_logits: torch.Tensor) -> torch.Tensor:
    """``[B, V]`` token order by ``target_logit - draft_logit`` (= the ``p / q`` order at every
    temperature); tokens the draft cannot produce (logit ``-inf``) last."""
    diff = target_logits.double() - draft_logits.double()
    diff = torch.where(torch.isinf(draft_logits) & (draft_logits < 0), torch.full_like(diff, torch.inf), diff)
    return torch.argsort(diff, dim=1, stable=True)


def optimal_iid(sp: SortedPairs, n: int) -> torch.Tensor:
    """``alpha*`` for i.i.d. drafts, ``[B]``."""
    g = sp.big_p - sp.big_q**n
    return (1.0 + g.min(dim=1).values.clamp(max=0.0)).clamp(0.0, 1.0)


def optimal_wor2(sp: SortedPairs) -> torch.Tensor:
    """``alpha*`` without replacement, ``n = 2`` (closed form on the prefixes), ``[B]``."""
    qs = sp.q
    w = torch.where(qs > 0, qs / _one_minus(qs).clamp(min=1e-300), torch.zeros_like(qs))
    s = sp.big_q
    c = sp.after_q  # q(V - H_k), not 1 - s: see SortedPairs
    q2 = torch.where(c > 0, (s - c * w.cumsum(dim=1)).clamp(min=0.0), s)
    g = sp.big_p - q2
    return (1.0 + g.min(dim=1).values.clamp(max=0.0)).clamp(0.0, 1.0)


def wor_bracket(sp: SortedPairs, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Certified bracket ``[lo, hi]`` on ``alpha*`` without replacement for ``n >= 3``, ``[B]`` each.

    Over the ratio-sorted prefixes ``H_k`` (some optimal ``H`` is one of them):

    * ``lo = 1 + min_k [P_k - U_k]`` with ``U_k >= Q_n(H_k)`` the valid upper bound of
      :func:`ot_bounds.optimal._wor_upper_bound` (exact ``Q_2`` times a Jensen bound on the chance
      that each later draw stays in ``H``), also ``lo >= alpha*_iid(n)`` (without replacement
      dominates i.i.d.);
    * ``hi = 1 + min_k [P_k - L_k]`` with ``L_k = Q_2(H_k) prod_{j=2}^{n-1} (s_k - M_j)^+ / (1 - M_j)
      <= Q_n(H_k)`` (after ``j`` draws the drafted mass is at most ``M_j``, the mass of the ``j``
      largest entries of ``q``, and ``(s - m) / (1 - m)`` decreases in ``m``); any ``H`` gives an
      upper bound on the minimum.
    """
    return wor_brackets(sp, [n])[n]


def wor_brackets(sp: SortedPairs, ns: list[int], iid: dict[int, torch.Tensor] | None = None
                 ) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """:func:`wor_bracket` for several ``n >= 3`` at once: the ``n``-independent prefix sums
    (``Q_2``, the conditional mean ``mu`` of the drafted mass, the third-draw factor) are computed
    once. ``iid``: already computed :func:`optimal_iid` values per ``n`` (reused as the lower end)."""
    qs = sp.q
    w = torch.where(qs > 0, qs / _one_minus(qs).clamp(min=1e-300), torch.zeros_like(qs))
    s = sp.big_q
    c = sp.after_q  # q(V - H_k), not 1 - s: see SortedPairs
    s1 = w.cumsum(dim=1)
    q2 = torch.where(c > 0, (s - c * s1).clamp(min=0.0), s)
    s2 = (w * qs).cumsum(dim=1)
    s3 = (w * qs * qs).cumsum(dim=1)
    w2 = (qs * qs).cumsum(dim=1)
    em2 = s * s2 - 2.0 * s3 + s1 * w2
    mu = torch.where(q2 > 0, em2 / q2.clamp(min=1e-300), torch.zeros_like(q2))
    # mu cancels terms as large as s1 ~ 1 / (1 - max q): lower it by a bound on the rounding of the
    # k-term prefix sums (k eps times the terms' magnitude), which can only raise the upper bound
    k = torch.arange(1, qs.shape[1] + 1, dtype=qs.dtype)
    size = (s * s2 + 2.0 * s3 + s1 * w2) * k * torch.finfo(qs.dtype).eps * 4.0
    mu = mu - torch.where(q2 > 0, size / q2.clamp(min=1e-300), torch.zeros_like(q2))
    # (s - mu) / (1 - mu) written as 1 - c / (1 - mu): s (a long prefix sum) carries an absolute
    # rounding error far above c when the prefix holds nearly all of q
    third = torch.where(mu < 1.0, 1.0 - c / (1.0 - mu).clamp(min=1e-300), torch.ones_like(mu))
    third = torch.nan_to_num(third, nan=1.0).clamp(0.0, 1.0)
    top, top_idx = torch.topk(qs, max(ns), dim=1)  # [B, max n]
    m2 = top[:, :2].sum(dim=1, keepdim=True)  # M_2
    # 1 - M_j as the mass outside the j largest, summed without subtracting from 1
    rest = qs.scatter(1, top_idx, 0.0).sum(dim=1, keepdim=True)  # [B, 1]
    tail = rest + top.flip(1).cumsum(dim=1).flip(1)  # tail[:, j] = 1 - M_j (j = 0 .. max n - 1)
    margin = 1e-12 + 2.0 * k * torch.finfo(qs.dtype).eps  # rounding of k-term prefix sums, [V]
    out = {}
    for n in ns:
        concave = (n - 3) * c <= 2.0 * (s - m2)
        ub = torch.where(concave, q2 * third ** (n - 2), q2 * third * s ** (n - 3))
        ub = (ub + margin).clamp(max=1.0)
        lbq = q2
        for j in range(2, n):  # (s - M_j)+ / (1 - M_j) = (1 - c / (1 - M_j))+
            lbq = lbq * (1.0 - c / tail[:, j:j + 1].clamp(min=1e-300)).clamp(0.0, 1.0)
        lbq = (lbq - margin).clamp(min=0.0)
        lo = 1.0 + (sp.big_p - ub).min(dim=1).values.clamp(max=0.0)
        hi = 1.0 + (sp.big_p - lbq).min(dim=1).values.clamp(max=0.0)
        lo = torch.maximum(lo, iid[n] if iid is not None and n in iid else optimal_iid(sp, n))
        out[n] = (lo.clamp(0.0, 1.0), torch.maximum(hi, lo).clamp(0.0, 1.0))
    return out


def _topk_fixed(q: torch.Tensor, k: int) -> torch.Tensor:
    """Indices ``[B, k]`` of the k largest q per row (``torch.topk``; exact float ties, which
    softmax outputs practically never have, may be broken differently from the engine's
    smaller-id rule)."""
    if k == 0:
        return torch.zeros(q.shape[0], 0, dtype=torch.long)
    return torch.topk(q, k, dim=1).indices


def greedy_rest(q: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Fixed-token mask ``[B, V]`` (top n-1 of q) and ``q'`` (uniform on the rest if no mass)."""
    fixed = torch.zeros_like(q, dtype=torch.bool).scatter_(1, _topk_fixed(q, n - 1), True)
    rest = q * ~fixed
    total = rest.sum(dim=1, keepdim=True)
    uniform = _normalise((~fixed).to(q.dtype))
    rest = torch.where(total > 0, rest / torch.where(total > 0, total, torch.ones_like(total)), uniform)
    return fixed, rest


def optimal_greedy(p: torch.Tensor, q: torch.Tensor, n: int) -> torch.Tensor:
    """``alpha*`` for greedy drafting (= greedy_draft's acceptance), ``[B]``."""
    fixed, rest = greedy_rest(q, n)
    return ((p * fixed).sum(dim=1) + (torch.minimum(p, rest) * ~fixed).sum(dim=1)).clamp(0.0, 1.0)


def verifier_single(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    return torch.minimum(p, q).sum(dim=1).clamp(0.0, 1.0)


def verifier_rrs(p: torch.Tensor, q: torch.Tensor, ns: list[int]) -> dict[int, torch.Tensor]:
    """Recursive rejection sampling (i.i.d. drafts), ``P(output in drafts)`` for every n in ns."""
    out, r = {}, p
    miss = torch.ones(p.shape[0], dtype=p.dtype)
    for k in range(1, max(ns) + 1):
        beta = torch.minimum(r, q).sum(dim=1)
        miss = miss * (1.0 - beta).clamp(min=0.0)
        if k in ns:
            out[k] = (1.0 - miss).clamp(0.0, 1.0)
        r_next = _normalise((r - q).clamp(min=0.0))
        r = torch.where(r_next.sum(dim=1, keepdim=True) > 0, r_next, r)
    return out


def _kseq_rho(sp: SortedPairs, n: int, steps: int = 48) -> torch.Tensor:
    """Smallest root in [1, n] of ``1 - (1 - beta)^n = rho beta`` (upper bracket end), ``[B, 1]``.

    ``beta(rho) = sum min(q, p / rho) = P(ratio < rho) / rho + (1 - Q(ratio < rho))``, a prefix
    sum at ``searchsorted(ratio, rho)``.
    """
    b = sp.p.shape[0]
    pad_p = torch.cat([torch.zeros(b, 1, dtype=sp.p.dtype), sp.big_p], dim=1)
    pad_q = torch.cat([torch.zeros(b, 1, dtype=sp.q.dtype), sp.big_q], dim=1)
    q_total = sp.big_q[:, -1:]

    def beta(rho):
        k = torch.searchsorted(sp.ratio, rho)  # tokens with ratio < rho  (ratio <= rho: same beta)
        return pad_p.gather(1, k) / rho + (q_total - pad_q.gather(1, k))

    def too_small(rho):
        bt = beta(rho)
        return -torch.expm1(n * torch.log1p(-bt.clamp(max=1.0))) > rho * bt

    lo = torch.ones(b, 1, dtype=sp.p.dtype)
    hi = torch.full((b, 1), float(n), dtype=sp.p.dtype)
    done = ~too_small(lo)  # rho = 1 already satisfies it
    for _ in range(steps):
        mid = 0.5 * (lo + hi)
        ts = too_small(mid)
        lo = torch.where(ts, mid, lo)
        hi = torch.where(ts, hi, mid)
    return torch.where(done, torch.ones_like(hi), hi)


def verifier_kseq(p: torch.Tensor, q: torch.Tensor, sp: SortedPairs, n: int,
                  event: str = "in_drafts") -> torch.Tensor:
    """SpecTr K-SEQ, ``P(output in drafts)`` (or ``P(accepted)``), ``[B]``."""
    if n == 1:
        return verifier_single(p, q)
    rho = _kseq_rho(sp, n)
    accept = torch.minimum(q, p / rho)
    beta = accept.sum(dim=1, keepdim=True)
    total = -torch.expm1(n * torch.log1p(-beta.clamp(max=1.0)))
    if event == "accepted":
        return total.squeeze(1).clamp(0.0, 1.0)
    scale = torch.where(beta > 0, total / beta.clamp(min=1e-300), torch.zeros_like(beta))
    res = _normalise((p - accept * scale).clamp(min=0.0))
    one_m_beta = (1.0 - beta).clamp(min=0.0)
    q_rej = torch.where(one_m_beta > 0, (q - accept).clamp(min=0.0) / one_m_beta.clamp(min=1e-300),
                        torch.zeros_like(q))
    hit = -torch.expm1(n * torch.log1p(-q_rej.clamp(max=1.0)))
    extra = one_m_beta.squeeze(1) ** n * (res * hit).sum(dim=1)
    return torch.where(beta.squeeze(1) >= 1.0, total.squeeze(1), total.squeeze(1) + extra).clamp(0.0, 1.0)


def verifier_spechub(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """SpecHub (n = 2), the engine's transport plan, ``[B]``."""
    a = q.argmax(dim=1, keepdim=True)
    others = torch.ones_like(q, dtype=torch.bool).scatter_(1, a, False)
    qa = q.gather(1, a)
    q_ia = q * others
    rest = q_ia.sum(dim=1, keepdim=True)
    uniform = others.to(q.dtype) / others.sum(dim=1, keepdim=True).clamp(min=1)
    q_ai = torch.where(rest > 0, qa * q_ia / rest.clamp(min=1e-300), qa * uniform)
    f1 = torch.minimum(p, q_ia) * others
    f2 = torch.minimum(p - f1, q_ai) * others
    l1 = (q_ai - f2).sum(dim=1, keepdim=True)
    l2 = (q_ia - f1).sum(dim=1, keepdim=True)
    pa = p.gather(1, a)
    fa1 = torch.minimum(pa, l1)
    fa2 = torch.minimum(pa - fa1, l2)
    return (f1.sum(dim=1) + f2.sum(dim=1) + (fa1 + fa2).squeeze(1)).clamp(0.0, 1.0)


def verifier_deterministic(p: torch.Tensor, q: torch.Tensor, n: int) -> torch.Tensor:
    """Top-n of q as fixed candidates: ``p(top-n of q)``, ``[B]``."""
    return p.gather(1, _topk_fixed(q, n)).sum(dim=1).clamp(0.0, 1.0)


def wor_truncation_bound(p: np.ndarray, q: np.ndarray, keep: np.ndarray, n: int) -> float:
    """Upper bound on ``|alpha*(p, q) - alpha*(p', q')|`` for the truncation to ``keep`` (see module docs)."""
    dp = float(p[~keep].sum())
    dq = float(q[~keep].sum())
    if dq == 0.0:
        return dp
    top = np.sort(np.partition(q, q.size - n)[q.size - n:])[::-1] if q.size > n else np.sort(q)[::-1]
    m = np.concatenate(([0.0], np.cumsum(top)[: n - 1]))
    gaps = 1.0 - m
    if np.any(gaps <= 0):
        return float("inf")
    return dp + dq * float(np.sum(1.0 / gaps))


def truncated_wor_optimal(p: np.ndarray, q: np.ndarray, ns: list[int], tol: float = 1e-6,
                          start: int = 256) -> tuple[dict[int, float], dict[int, float], int]:
    """``alpha*`` without replacement for each ``n`` in ``ns`` on a truncated vocabulary.

    ``S`` = the ``K`` tokens with the largest ``max(p, q)``, ``K`` doubling from ``start`` until the
    bound of :func:`wor_truncation_bound` is ``<= tol`` for the largest ``n`` (or ``S`` is the full
    vocabulary, then the result is exact).

    Returns
    -------
    values : dict n -> alpha*(p', q')
    bounds : dict n -> rigorous bound on the truncation error
    k : int
        ``|S|``.
    """
    v = p.size
    score = np.maximum(p, q)
    k = min(start, v)
    n_max = max(ns)
    while True:
        idx = np.argpartition(-score, k - 1)[:k] if k < v else np.arange(v)
        keep = np.zeros(v, dtype=bool)
        keep[idx] = True
        bound = wor_truncation_bound(p, q, keep, n_max)
        if bound <= tol or k >= v:
            break
        k = min(2 * k, v)
    ps, qs = p[keep], q[keep]
    if qs.sum() <= 0:
        keep[:] = True
        ps, qs, k = p, q, v
    ps, qs = ps / ps.sum(), qs / qs.sum()
    values = {n: optimal_acceptance(ps, qs, n, "without_replacement") for n in ns}
    bounds = {n: (0.0 if k >= v else wor_truncation_bound(p, q, keep, n)) for n in ns}
    return values, bounds, int(k)
