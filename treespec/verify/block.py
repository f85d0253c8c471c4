"""Block verification of a drafted chain: the whole block judged at once, not token by token.

A chain ``X_1 .. X_g`` drawn from the draft (``X_i ~ q(. | X_<i)``, law ``iid``, one child per node) is
verified jointly. With ``p_0 = 1`` and, for ``i = 1 .. g``,

.. math::

    w_i = \\min\\Big(1,\\; w_{i-1}\\, \\frac{p(X_i \\mid X_{<i})}{q(X_i \\mid X_{<i})}\\Big),

the residual after the first ``i`` drafts is ``r_i(x) = (w_i p(x | X_{\\le i}) - q(x | X_{\\le i}))_+`` with
mass ``s_i`` (``w_0 = 1``: ``r_0 = (p - q)_+``, the token-level residual), and the chance of stopping after
draft ``i`` given that no later draft was kept is

.. math::

    h_i = \\frac{s_i}{s_i + 1 - w_i} \\quad (i < g), \\qquad h_g = w_g .

The block keeps the first ``tau`` drafts, where ``tau`` is the last ``i`` whose test ``u_i <= h_i`` passes
(0 when none does), so ``P(tau = i) = h_i \\prod_{j > i} (1 - h_j)``; then it emits the bonus token from
``p(. | X_{\\le g})`` (``tau = g``) or the recovered token from ``r_tau`` normalised. The output follows the
target's law exactly, and the expected number of kept drafts is never below token-level verification's (it is
the largest of any verification that reads only the drafted path's probabilities).

:func:`block_outcome_law` gives the exact law of ``(tau, next token)`` from the same code that
:func:`verify_block` samples from; the exact-law tests compose it with the target's continuation.

References
----------
- Sun, Mendlovic, Leviathan, Aharoni, Ro, Beirami, Suresh. "Block Verification Accelerates Speculative
  Decoding", arXiv 2403.10444.
"""

from __future__ import annotations

import torch

from ..tree import TokenTree
from .core import VerifyResult, _result, at, sample_categorical, target_rows


def _block_laws(tree: TokenTree, target_probs: torch.Tensor,
                draft_probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The chain's stop law and residuals.

    Returns ``stop`` ``[g + 1]`` (``stop[i]`` = P(tau = i)), ``residual`` ``[g, V]`` (unnormalised
    ``r_i`` for ``i < g``) and ``row_of`` ``[g + 1]`` (the target row of each node, -1 for a leaf
    without one).
    """
    g = tree.num_nodes - 1  # drafted tokens; node i of a chain is the i-th draft (node 0: the root)
    row_of = target_rows(tree, target_probs)  # [g + 1]
    p = target_probs.index_select(0, row_of[:g])  # [g, V] p(. | X_<=i), i = 0 .. g-1 (these rows always exist)
    q = draft_probs[:g]  # [g, V]
    drafted = tree.tokens[1:, None]  # [g, 1]
    p_x, q_x = p.gather(1, drafted)[:, 0], q.gather(1, drafted)[:, 0]  # [g]
    ratio = torch.where(q_x > 0, p_x / torch.where(q_x > 0, q_x, torch.ones_like(q_x)),
                        torch.where(p_x > 0, torch.full_like(p_x, float("inf")), torch.zeros_like(p_x)))
    weights, w = [], torch.ones((), dtype=p.dtype, device=p.device)
    for i in range(g):  # w_i = min(1, w_{i-1} p/q), with 0 * inf read as 0 (a dead block stays dead)
        w = torch.where(w > 0, torch.clamp(w * ratio[i], max=1.0), w)
        weights.append(w)
    w_kept = torch.stack(weights)  # [g] w_1 .. w_g
    w_node = torch.cat([w_kept.new_ones(1), w_kept[:-1]])  # [g] w_0 .. w_{g-1}
    residual = (w_node[:, None] * p - q).clamp(min=0)  # [g, V]
    mass = residual.sum(dim=1)  # [g] s_0 .. s_{g-1}
    denom = mass[1:] + 1 - w_node[1:]
    h_inner = torch.where(mass[1:] > 0, mass[1:] / torch.where(denom > 0, denom, torch.ones_like(denom)),
                          torch.zeros_like(denom))  # [g - 1] h_1 .. h_{g-1}
    h = torch.cat([h_inner, w_kept[-1:]]).clamp(0.0, 1.0)  # [g] h_1 .. h_g
    # P(tau = i) = h_i prod_{j > i} (1 - h_j); P(tau = 0) = prod_j (1 - h_j)
    later_fail = torch.flip(torch.cumprod(torch.flip(1 - h, [0]), 0), [0])  # [g] prod_{j >= i} (1 - h_j)
    after = torch.cat([later_fail[1:], h.new_ones(1)])  # [g] prod_{j > i} (1 - h_j)
    stop = torch.cat([later_fail[:1], h * after])  # [g + 1]
    return stop, residual, row_of


def _check_chain(tree: TokenTree, draft_probs: torch.Tensor | None) -> None:
    if tree.max_children > 1:
        raise ValueError(f"verifier 'block' verifies a chain (one child per node); this tree has a node with "
                         f"{tree.max_children} children; verify trees with 'rrs' (or another tree verifier)")
    if tree.law != "iid":
        raise ValueError(f"verifier 'block' needs a chain drawn from the draft (law 'iid'), this one was drawn "
                         f"under {tree.law!r}")
    if tree.num_nodes > 1 and draft_probs is None:
        raise ValueError("block: this verifier needs draft_probs (the law the chain was drawn from)")


def verify_block(tree: TokenTree, target_probs: torch.Tensor, draft_probs: torch.Tensor | None = None,
                 generator: torch.Generator | None = None) -> VerifyResult:
    """Block verification of the chain ``tree`` (see the module docstring).

    ``target_probs`` ``[num_nodes, V]`` or ``[verified nodes, V]`` (no row for the leaf: a block kept whole
    then emits no bonus token); ``draft_probs`` ``[num_nodes, V]``, row i the law draft i + 1 was drawn from.
    """
    _check_chain(tree, draft_probs)
    g = tree.num_nodes - 1
    if g == 0:
        token = sample_categorical(target_probs[0], generator)
        return _result(tree, torch.zeros((), dtype=torch.long, device=tree.device), token,
                       torch.ones((), dtype=torch.bool, device=tree.device),
                       torch.ones((), dtype=torch.bool, device=tree.device), None, target_probs.shape[1])
    stop, residual, row_of = _block_laws(tree, target_probs, draft_probs)
    finite = torch.isfinite(stop).all() & (stop.sum() > 0)
    stop = torch.where(finite, stop, torch.ones_like(stop))  # a non-finite law is reported by _result below
    tau = sample_categorical(stop, generator).clamp(0, g)  # [] kept drafts
    kept_all = tau == g
    own = at(target_probs, at(row_of, tau).clamp(min=0))  # [V] the bonus row (a leaf without a row: never emitted)
    dist = torch.where(kept_all, own, at(residual, tau.clamp(max=g - 1)))  # [V]
    mass = dist.sum()
    mass_ok = finite & torch.isfinite(mass) & (mass > 0)
    return _result(tree, tau, sample_categorical(dist, generator), kept_all, at(row_of, tau) >= 0, mass_ok,
                   target_probs.shape[1])


def block_outcome_law(tree: TokenTree, target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """Exact law of (kept drafts ``tau``, next token) for the drafted chain ``tree``: ``[num_nodes, V]``, row
    ``tau`` (node ``tau`` of the chain is the last kept draft); rows sum to P(tau) and the whole to 1. Every row
    of ``target_probs`` is needed (the bonus row of the leaf included).

    target_probs ``[num_nodes, V]``; draft_probs ``[num_nodes, V]``, row i the law draft i + 1 was drawn from
    (the leaf's row unused)."""
    _check_chain(tree, draft_probs)
    g = tree.num_nodes - 1
    if g == 0:
        return target_probs[:1] / target_probs[0].sum()
    stop, residual, _ = _block_laws(tree, target_probs, draft_probs)
    mass = residual.sum(dim=1, keepdim=True)
    recovered = torch.where(mass > 0, residual / torch.where(mass > 0, mass, torch.ones_like(mass)), residual)
    bonus = target_probs[g:g + 1] / target_probs[g].sum()
    return stop[:, None] * torch.cat([recovered, bonus])  # [g + 1, V]
