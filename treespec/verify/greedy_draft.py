"""Node rule for greedy drafting (draft law ``"greedy_draft"``).

Reference: Hu, Zheng, Liu, Li, Huang, Xu, Chen, Zhou, Huang. "Towards Optimal Multi-draft
Speculative Decoding", ICLR 2025, arXiv 2502.18779.

Draft law at a node with n children: the first n - 1 children are fixed tokens T (the n - 1 most
likely tokens of q; the rule only needs T to have been chosen without looking at the target). The
last child x is drawn from ``q' = norm(q restricted to the complement of T)``; if q puts no mass
outside T, q' is uniform on the complement of T (the drafter in :mod:`treespec.drafting.laws` does
the same, so the law is defined for every q).

Verification: the random child is tested by single-draft speculative sampling against p with q':
accept x with probability ``a = min(1, p(x) / q'(x))``; otherwise sample ``res = norm((p - q')+)``,
which puts mass ``p(T) / Z`` on T since q' vanishes there. Written as a node rule (choice_probs over
the children in tree order):

* fixed child t in T: ``(1 - a) * res(t)`` (the residual landing on t continues into t's subtree);
* random child x: ``a``;
* none: ``(1 - a) * res(outside T)``, and the residual row is ``res`` restricted to the complement of
  T, renormalised.

The output law is ``min(p, q')`` + ``(1 - TV(p, q')) * res`` = p exactly, and the acceptance rate
``p(T) + sum_{y not in T} min(p(y), q'(y))`` is the optimum for this draft law (the paper's result).
With one child T is empty and this is plain single-draft speculative sampling.
"""

from __future__ import annotations

import torch

from .rules import _normalise, _ratio


def restricted_draft(q: torch.Tensor, fixed_mask: torch.Tensor) -> torch.Tensor:
    """``q'``: q restricted to ``~fixed_mask`` and renormalised; uniform there if q has no mass left.

    ``q`` ``[M, V]``, ``fixed_mask`` ``[M, V]`` bool -> ``[M, V]``. Shared with the drafter so that the
    law sampled from and the law verified against are the same function.
    """
    free = ~fixed_mask
    rest, ok = _normalise(q * free)
    uniform, _ = _normalise(free.to(q.dtype))
    return torch.where(ok, rest, uniform)


def greedy_draft_rule(p: torch.Tensor, q: torch.Tensor | None, child_tokens: torch.Tensor,
                      child_valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The greedy-draft node rule (see the module docstring).

    p ``[M, V]``, q ``[M, V]`` (required), child_tokens ``[M, K]`` (each row's valid children in its first
    columns, the random child the last of them), child_valid ``[M, K]`` bool -> choice_probs ``[M, K + 1]``,
    residual ``[M, V]``."""
    if q is None:
        raise ValueError("greedy_draft needs draft_probs (the law the random child was drawn from)")
    m, k = child_tokens.shape
    cols = torch.arange(k, device=p.device)
    n = child_valid.sum(dim=1, keepdim=True)  # [M, 1]
    last = (n - 1).clamp(min=0)  # [M, 1] index of the random child
    is_last = child_valid & (cols[None, :] == last)  # [M, K]
    is_fixed = child_valid & (cols[None, :] < last)  # [M, K]
    # A fixed token repeated among the fixed children counts once (not produced by the drafter).
    same = child_tokens[:, :, None] == child_tokens[:, None, :]  # [M, K, K]
    earlier = torch.tril(torch.ones(k, k, dtype=torch.bool, device=p.device), diagonal=-1)
    repeat = (same & earlier[None] & is_fixed[:, None, :]).any(dim=2)  # [M, K]
    first_fixed = is_fixed & ~repeat

    fixed_mask = torch.zeros_like(p).scatter_add_(1, child_tokens, is_fixed.to(p.dtype)) > 0  # [M, V]
    q_rest = restricted_draft(q, fixed_mask)  # [M, V]
    x = child_tokens.gather(1, last)  # [M, 1]
    a = _ratio(p.gather(1, x), q_rest.gather(1, x))  # [M, 1]
    a = torch.where(fixed_mask.gather(1, x), torch.zeros_like(a), a)  # x in T: impossible draw
    res, ok = _normalise((p - q_rest).clamp(min=0))  # [M, V]
    res = torch.where(ok, res, p)  # p == q': a == 1, residual unused

    choice = torch.zeros(m, k + 1, dtype=p.dtype, device=p.device)  # [M, K+1]
    choice[:, :k] = torch.where(first_fixed, (1 - a) * res.gather(1, child_tokens), choice[:, :k])
    choice[:, :k] = torch.where(is_last, a.expand(m, k), choice[:, :k])
    outside = res * ~fixed_mask  # [M, V]
    choice[:, k:] = (1 - a) * outside.sum(dim=1, keepdim=True)
    residual, ok_out = _normalise(outside)
    residual = torch.where(ok_out, residual, p)  # never used when it has no mass
    return choice, residual
