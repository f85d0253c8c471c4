"""SpecTr's K-SEQ node rule for children drawn i.i.d. from q (draft law ``"iid"``).

Reference: Sun, Suresh, Ro, Beirami, Jain, Yu. "SpecTr: Fast Speculative Decoding via Optimal
Transport", arXiv 2310.15141 (the K-SEQ algorithm; the paper writes p and q the other way round).

For a node with n children x_1..x_n drawn i.i.d. from q and a scale rho >= 1, let

    beta(rho) = sum_y min(q(y), p(y) / rho)

be the probability that one draft passes the test ``U < p(x) / (rho q(x))``. Drafts are tested in
order and the first one that passes is emitted, so the emitted-draft mass on token y is
``min(q, p/rho)(y) * c`` with ``c = (1 - (1 - beta)^n) / beta``. Whatever rho, that leaves exactly
``(1 - beta)^n`` = P(all rejected) of p unaccounted for, so the rule is lossless as soon as the
leftover ``p - c * min(q, p/rho)`` is non-negative, i.e. as soon as ``1 - (1 - beta)^n <= rho * beta``.
The best (smallest) such rho is the root rho* in [1, n] of ``1 - (1 - beta)^n = rho * beta``: the left
side falls and the right side rises with rho, it holds with ">=" at rho = 1 and "<=" at rho = n.

rho* is found per node by bisection with a fixed number of halvings, on the device, with no host
sync. We keep the *upper* end of the bracket, where the inequality holds, so the rule is exactly
lossless whatever the number of halvings; only the acceptance rate depends on it (the bracket
shrinks to ``(n - 1) * 2**-BISECTION_STEPS``). Each node uses its own n (the number of valid
children in its row), so a batch may mix nodes with different child counts.
"""

from __future__ import annotations

import torch

from .rules import _normalise, _ratio

#: halvings of the bracket [1, n] (width (n - 1) * 2**-40 after them). Exactness does not depend on
#: it, only the acceptance rate, by a relative O(2**-40). Each halving is a handful of [M, V] ops.
BISECTION_STEPS = 40


def _beta(p: torch.Tensor, q: torch.Tensor, rho: torch.Tensor) -> torch.Tensor:
    """``sum_y min(q, p / rho)`` for ``p, q`` ``[M, V]``, ``rho`` ``[M, 1]`` -> ``[M, 1]``."""
    return torch.minimum(q, p / rho).sum(dim=1, keepdim=True)


def _hit(beta: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """``1 - (1 - beta)^n``, accurate for small beta; ``[M, 1]``."""
    return -torch.expm1(n * torch.log1p(-beta.clamp(max=1.0)))


def solve_rho(p: torch.Tensor, q: torch.Tensor, n: torch.Tensor,
              steps: int = BISECTION_STEPS) -> torch.Tensor:
    """Upper end of the bisection bracket for rho* of each row.

    ``p, q`` ``[M, V]``; ``n`` ``[M, 1]`` float number of children per row (>= 1). Returns ``[M, 1]``
    with ``1 - (1 - beta(rho))^n <= rho * beta(rho)`` up to rounding.
    """
    lo = torch.ones_like(n)
    hi = n.clamp(min=1.0).clone()
    for _ in range(steps):
        mid = 0.5 * (lo + hi)
        beta = _beta(p, q, mid)
        too_small = _hit(beta, n) > mid * beta  # [M, 1]: the inequality fails, rho* > mid
        lo = torch.where(too_small, mid, lo)
        hi = torch.where(too_small, hi, mid)
    return hi


def kseq_rule(p: torch.Tensor, q: torch.Tensor | None, child_tokens: torch.Tensor,
              child_valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K-SEQ: accept the first child with ``U < p(x) / (rho* q(x))``, else sample the leftover.

    p ``[M, V]``, q ``[M, V]`` (required), child_tokens ``[M, K]``, child_valid ``[M, K]`` bool -> choice_probs
    ``[M, K + 1]``, residual ``[M, V]``."""
    if q is None:
        raise ValueError("kseq needs draft_probs (the law the children were drawn from)")
    m, k = child_tokens.shape
    n = child_valid.sum(dim=1, keepdim=True).to(p.dtype)  # [M, 1] children of each node
    rho = solve_rho(p, q, n)  # [M, 1]
    accepted_part = torch.minimum(q, p / rho)  # [M, V] per-draft pass mass on each token
    beta = accepted_part.sum(dim=1, keepdim=True)  # [M, 1]
    hit = _hit(beta, n)  # [M, 1] P(some child passes)
    scale = torch.where(beta > 0, hit / torch.where(beta > 0, beta, torch.ones_like(beta)), n)
    leftover = (p - accepted_part * scale).clamp(min=0)  # [M, V], mass (1 - beta)^n
    residual, ok = _normalise(leftover)
    residual = torch.where(ok, residual, p)  # beta == 1: every child passes, residual unused

    alive = torch.ones(m, 1, dtype=p.dtype, device=p.device)
    choice = torch.zeros(m, k + 1, dtype=p.dtype, device=p.device)  # [M, K+1]
    for i in range(k):
        x = child_tokens[:, i:i + 1]  # [M, 1]
        a = _ratio(p.gather(1, x) / rho, q.gather(1, x)) * child_valid[:, i:i + 1]  # [M, 1]
        choice[:, i:i + 1] = alive * a
        alive = alive * (1 - a)
    choice[:, k:] = alive
    return choice, residual
