"""Node rules of the rejection-sampling family, vectorised over nodes (loop over sibling rank only).

Every rule maps ``(p [M, V], q [M, V] | None, child_tokens [M, K], child_valid [M, K])`` to
``(choice_probs [M, K + 1], residual [M, V])`` (the rejection rules return the residual factored,
:class:`~treespec.verify.core.FactoredResidual`, when q lives on a small support); see
:mod:`treespec.verify.core`.

References
----------
- Leviathan, Kalman, Matias. "Fast Inference from Transformers via Speculative Decoding", arXiv 2211.17192.
- Chen et al. "Accelerating Large Language Model Decoding with Speculative Sampling", arXiv 2302.01318.
- Miao et al. "SpecInfer: Accelerating Generative LLM Serving with Tree-based Speculative Inference and
  Verification", arXiv 2305.09781 (recursive rejection sampling, i.i.d. drafts).
- Jeon et al. "Recursive Speculative Decoding: Accelerating LLM Inference via Sampling Without
  Replacement", arXiv 2402.14160 (drafts without replacement).
"""

from __future__ import annotations

import torch

from ..sampling import row_mass
from .core import FactoredResidual


def _normalise(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of ``x`` ``[M, V]`` divided by their sums; also returns which rows had positive mass."""
    total = x.sum(dim=1, keepdim=True)
    ok = total > 0
    return torch.where(ok, x / torch.where(ok, total, torch.ones_like(total)), x), ok


def _ratio(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    """``min(1, num / den)``, with ``den == 0`` read as an impossible draft (accept iff num > 0)."""
    safe = torch.where(den > 0, den, torch.ones_like(den))
    return torch.where(den > 0, (num / safe).clamp(max=1.0), (num > 0).to(num.dtype))


def rejection_rule(p: torch.Tensor, q: torch.Tensor | None, child_tokens: torch.Tensor,
                   child_valid: torch.Tensor, *, without_replacement: bool,
                   dense: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Recursive rejection sampling over ordered children drawn from q.

    With replacement (SpecInfer): child i is accepted with probability ``min(1, r(x_i) / q(x_i))``
    where r is the current residual (initially p); on rejection ``r <- norm((r - q)+)``.
    Without replacement (Jeon et al.): the same test with ``q_i``, the law child i was drawn from;
    on rejection ``r <- norm((r - q_i)+)`` and ``q_{i+1} = norm(q_i with x_i removed)``.

    Where q is zero (a draft head's q lives on its vocabulary subset), ``(r - q)+ = r``: there the
    residual stays the same multiple ``c`` of p at every rank. So the recursion runs on the columns
    where some row of q is positive, plus one scale ``c`` per row (:func:`_rejection_on_support`),
    and the full ``[M, V]`` residual is formed once at the end; ``dense=True`` (or a support above
    half the vocabulary) runs every rank over all ``V`` columns, the reference it is tested against.

    p ``[M, V]``, q ``[M, V]`` (required), child_tokens ``[M, K]``, child_valid ``[M, K]`` bool ->
    choice_probs ``[M, K + 1]`` and the residual ``[M, V]`` (a :class:`FactoredResidual` on the support path).
    """
    assert q is not None
    if not dense and q.shape[0] > 0:
        support = q.amax(dim=0) > 0  # [V] columns where some row of q has mass (q >= 0)
        cols = torch.nonzero(support).flatten()  # [S] ascending
        if 0 < 2 * cols.numel() <= q.shape[1]:
            return _rejection_on_support(p, q, child_tokens, child_valid, cols, support, without_replacement)
    m, k = child_tokens.shape
    r = p  # [M, V]
    qi = q  # [M, V]
    alive = torch.ones(m, 1, dtype=p.dtype, device=p.device)  # P(all earlier children rejected)
    choice = torch.zeros(m, k + 1, dtype=p.dtype, device=p.device)
    for i in range(k):
        x = child_tokens[:, i:i + 1]  # [M, 1]
        valid = child_valid[:, i:i + 1]
        a = _ratio(r.gather(1, x), qi.gather(1, x)) * valid  # [M, 1]
        choice[:, i:i + 1] = alive * a
        alive = alive * (1 - a)
        r_next, ok = _normalise((r - qi).clamp(min=0))
        r = torch.where(valid & ok, r_next, r)
        if without_replacement:
            q_next, ok_q = _normalise(qi.scatter(1, x, 0.0))
            qi = torch.where(valid & ok_q, q_next, qi)
    choice[:, k:] = alive
    return choice, r


def _rejection_on_support(p: torch.Tensor, q: torch.Tensor, child_tokens: torch.Tensor, child_valid: torch.Tensor,
                          cols: torch.Tensor, support: torch.Tensor,
                          without_replacement: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`rejection_rule` with the residual kept as ``r = r_s`` on the support columns ``cols`` ``[S]``
    and ``r = c * p`` elsewhere (``c`` ``[M, 1]``): the same arithmetic per rank on ``[M, S]`` instead of
    ``[M, V]``. Row totals add ``c`` times p's mass off the support (one matrix-vector product)."""
    m, k = child_tokens.shape
    r_s = p.index_select(1, cols)  # [M, S]
    q_s = q.index_select(1, cols).to(p.dtype)  # [M, S] (the dense loop would promote a q of another dtype)
    wide = torch.promote_types(p.dtype, torch.float32)  # a bf16 / fp16 p is summed in float32
    off = (~support).to(wide)  # [V] 1 where every q row is zero
    p_off = torch.mv(p.to(wide), off).double()[:, None]  # [M, 1] p's mass there: non-negative terms, one read of p
    c = torch.ones(m, 1, dtype=torch.float64, device=p.device)  # the residual off the support is c * p
    # each child's column in the support, and whether it is there (a valid child may have q = 0 everywhere)
    pos = torch.searchsorted(cols, child_tokens).clamp(max=cols.numel() - 1)  # [M, K]
    on = cols[pos] == child_tokens  # [M, K]
    p_x = p.gather(1, child_tokens)  # [M, K] p at each child (the residual off the support is c * p_x)
    alive = torch.ones(m, 1, dtype=p.dtype, device=p.device)
    choice = torch.zeros(m, k + 1, dtype=p.dtype, device=p.device)
    for i in range(k):
        x, on_i = pos[:, i:i + 1], on[:, i:i + 1]
        valid = child_valid[:, i:i + 1]
        zero = torch.zeros(m, 1, dtype=p.dtype, device=p.device)
        r_x = torch.where(on_i, r_s.gather(1, x), (c * p_x[:, i:i + 1]).to(p.dtype))
        q_x = torch.where(on_i, q_s.gather(1, x), zero)
        a = _ratio(r_x, q_x) * valid  # [M, 1]
        choice[:, i:i + 1] = alive * a
        alive = alive * (1 - a)
        diff = (r_s - q_s).clamp(min=0)  # [M, S]; off the support (r - q)+ = r = c * p
        total = diff.sum(dim=1, keepdim=True) + (c * p_off).to(p.dtype)  # [M, 1]
        ok = total > 0
        safe = torch.where(ok, total, torch.ones_like(total))
        take = valid & ok
        r_s = torch.where(take, diff / safe, r_s)
        c = torch.where(take, c / safe.double(), c)
        if without_replacement:
            q_next = q_s.scatter(1, x, torch.where(on_i, zero, q_s.gather(1, x)))  # x off the support: q(x) is 0
            q_next, ok_q = _normalise(q_next)
            q_s = torch.where(valid & ok_q, q_next, q_s)
    choice[:, k:] = alive
    # off the support: c * p, where c <= 1 / p_off (each total includes c * p_off); a row with no mass there
    # keeps 0 (its c may have grown past the dtype's range, and 0 * inf would be NaN)
    c_off = torch.where(p_off > 0, c, torch.zeros_like(c)).clamp(max=torch.finfo(p.dtype).max).to(p.dtype)
    return choice, FactoredResidual(p, c_off, cols, r_s)  # rows formed only where a path stops


def rrs_rule(p, q, child_tokens, child_valid):
    return rejection_rule(p, q, child_tokens, child_valid, without_replacement=False)


def rrs_without_replacement_rule(p, q, child_tokens, child_valid):
    return rejection_rule(p, q, child_tokens, child_valid, without_replacement=True)


def dense_rrs_rule(p, q, child_tokens, child_valid):
    """:func:`rrs_rule` over every column at every rank (the reference of the support path)."""
    return rejection_rule(p, q, child_tokens, child_valid, without_replacement=False, dense=True)


def dense_rrs_without_replacement_rule(p, q, child_tokens, child_valid):
    """:func:`rrs_without_replacement_rule` over every column at every rank (the reference)."""
    return rejection_rule(p, q, child_tokens, child_valid, without_replacement=True, dense=True)


def deterministic_rule(p: torch.Tensor, q: torch.Tensor | None, child_tokens: torch.Tensor,
                       child_valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Candidates chosen without looking at the target: q is a point mass on each candidate.

    Child i is accepted with probability ``r_i(x_i)``, where ``r_i`` is p with the earlier
    candidates removed and renormalised: ``r_i(x_i) = p(x_i) / (1 - sum_{j < i} p(x_j))`` over
    distinct earlier candidates (a repeated candidate has ``r_i(x_i) = 0``). Lossless whatever rule
    picked the candidates. Only the candidates' probabilities are read per rank (remaining masses in
    float64 from one row sum); the residual, p without every candidate, is formed once.

    p ``[M, V]``, q ignored (None), child_tokens ``[M, K]``, child_valid ``[M, K]`` bool -> choice_probs
    ``[M, K + 1]``, residual ``[M, V]``.
    """
    m, k = child_tokens.shape
    total = row_mass(p)  # [M, 1] float64
    px = p.gather(1, child_tokens).double() * child_valid  # [M, K]
    earlier = torch.ones(k, k, dtype=torch.bool, device=p.device).tril(-1)  # [i, j]: j < i
    same = (child_tokens[:, :, None] == child_tokens[:, None, :]) & child_valid[:, None, :] & earlier  # [M, K, K]
    repeat = same.any(dim=2)  # [M, K] x_i already offered by an earlier valid child
    px = torch.where(repeat, torch.zeros_like(px), px)  # each distinct candidate's mass counted once
    removed = px.cumsum(dim=1) - px  # [M, K] mass of the distinct earlier candidates
    remaining = total - removed  # [M, K]
    a = torch.where(remaining > 0, px / remaining.clamp(min=torch.finfo(torch.float64).tiny), 0.0).clamp(max=1.0)
    alive = torch.cumprod(torch.cat([torch.ones_like(a[:, :1]), 1 - a], dim=1), dim=1)  # [M, K + 1]
    choice = torch.cat([alive[:, :k] * a, alive[:, k:]], dim=1).to(p.dtype)  # [M, K + 1]
    # p without the valid candidates: multiply each candidate's entry by 0 (valid) or 1 (invalid slot)
    r = p.scatter_reduce(1, child_tokens, (~child_valid).to(p.dtype), reduce="prod")  # [M, V]
    left = row_mass(r)  # [M, 1] mass outside the candidates
    r = torch.where(left > 0, r / left.clamp(min=torch.finfo(torch.float64).tiny).to(p.dtype), p)
    return choice, r


def greedy_rule(p: torch.Tensor, q: torch.Tensor | None, child_tokens: torch.Tensor,
                child_valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Temperature 0: accept the first child equal to argmax p, else emit argmax p.

    p ``[M, V]``, q ignored (None), child_tokens ``[M, K]``, child_valid ``[M, K]`` bool."""
    onehot = torch.zeros_like(p).scatter_(1, p.argmax(dim=1, keepdim=True), 1.0)
    return deterministic_rule(onehot, None, child_tokens, child_valid)
