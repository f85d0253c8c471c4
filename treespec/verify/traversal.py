"""Traversal verification of a drafted tree: paths judged from the leaves back towards the root.

Glossary: ``target_probs`` (p) is the target's next-token law after a node, ``draft_probs`` (q) the law a
node's children were drawn from (law ``iid``: siblings drawn independently, with replacement). The *accepted*
tokens are the drafts on the kept path; the token emitted after them is the *recovered* token (from a residual,
when the path stops at a node whose children were all rejected) or the *bonus* token (from p, when it stops at a
leaf).

Token-level verification walks down from the root and drops a whole subtree once its top token is rejected.
Traversal verification instead tests whole root-to-node sequences, visiting the nodes in post-order (every
child's subtree before the node itself, siblings in draft order), and keeps the first sequence whose test
passes. Each node ``v`` carries a sub-probability vector ``m_v`` ``[V]`` whose mass ``alpha_v`` is the chance
that the sequence ending at ``v`` is kept (given that nothing below it was):

* the root starts with ``m = p(. | root)`` (mass 1); a child with token ``x`` starts with
  ``m = alpha_c p(. | child)``, where ``alpha_c = min(1, m_parent(x) / q_parent(x))`` is read from its parent's
  ``m`` *after* the subtrees of the earlier siblings were rejected;
* once a child's subtree is rejected the parent moves to ``m <- (m - q)_+ / (1 - sum(min(m, q)))`` (the
  denominator is the chance of that rejection), which keeps ``m``'s direction the residual of the sequence-level
  test and its mass the sequence's new acceptance probability;
* a node whose subtree is exhausted is kept with probability ``h_v = sum(m_v)`` (the root with probability 1) and
  then emits from ``m_v`` normalised: p itself at a leaf (the bonus token), a residual otherwise (recovered).

Why it is lossless (by induction over the subtree): a node in state ``m`` whose remaining children are i.i.d.
from q keeps its sequence (or one below it) with total probability ``sum(m)``, and then the continuation is
distributed as ``m`` normalised followed by the target. One child contributes ``min(m, q)`` (the
child's subtree keeps its sequence with probability ``alpha_c``, then continues as the target), and its rejection
leaves exactly ``(m - q)_+``, the mass the remaining children must account for. On one-level trees this is
recursive rejection sampling; on a chain it is block verification (``treespec.verify.block``).

No state depends on a test's outcome (a node's states are reached only when every earlier test failed), so
every ``h_v`` is computed up front and the path is the first node in post-order whose independent test
``u_v < h_v`` passes: ``P(stop at v) = h_v prod_{w before v} (1 - h_w)``. :func:`traversal_outcome_law` gives
that law exactly, from the same code the sampler uses.

``target_probs`` may hold a row per node or only the rows of ``tree.verified_nodes`` (the root and the nodes
with children): the tests read the parents' rows only, so the path's law is unchanged, and a path kept down to a
leaf without a row ends without a bonus token.

References
----------
- Weng, Hu, Chen, Liu, Mei, Qiu, Tian, Shi. "Traversal Verification for Speculative Tree Decoding",
  arXiv 2505.12398.
- Sun, Mendlovic, Leviathan, Aharoni, Ro, Beirami, Suresh. "Block Verification Accelerates Speculative
  Decoding", arXiv 2403.10444 (the chain case).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..tree import TokenTree
from .core import VerifyResult, _result, at, sample_categorical, target_rows


@dataclass(frozen=True)
class _Layout:
    """The tree's structure on the host (one host sync): children in draft order, depths, post-order ranks."""

    children: list[list[int]]
    depth: list[int]
    rank: list[int]  # position of each node in post-order (the root last)
    tokens: list[int]


def _layout(tree: TokenTree) -> _Layout:
    parents, tokens = torch.stack([tree.parents, tree.tokens]).tolist()  # the structure's one host sync
    n = len(parents)
    children: list[list[int]] = [[] for _ in range(n)]
    depth = [0] * n
    for i in range(1, n):  # parents[i] < i: index order is draft order among siblings
        children[parents[i]].append(i)
        depth[i] = depth[parents[i]] + 1
    rank, order, stack = [0] * n, [], [(0, False)]
    while stack:  # iterative post-order: children's subtrees in draft order, then the node
        node, done = stack.pop()
        if done:
            rank[node] = len(order)
            order.append(node)
            continue
        stack.append((node, True))
        stack.extend((c, False) for c in reversed(children[node]))
    return _Layout(children, depth, rank, tokens)


def _after_rejection(m: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """A node's state once a child's subtree was rejected: ``(m - q)_+ / (1 - sum(min(m, q)))``.

    m ``[B, V]`` (mass ``alpha`` per row), q ``[B, V]`` -> ``[B, V]``; a row whose rejection has no chance
    (``m = q``) gets zeros (that state is never reached)."""
    residual = (m - q).clamp(min=0)  # [B, V]
    reject = (1 - torch.minimum(m, q).sum(dim=1, keepdim=True)).clamp(min=0)  # [B, 1] P(child's subtree rejected)
    ok = (reject > 0) & (residual.sum(dim=1, keepdim=True) > 0)
    return torch.where(ok, residual / torch.where(ok, reject, torch.ones_like(reject)), torch.zeros_like(residual))


def _states(tree: TokenTree, layout: _Layout, target_probs: torch.Tensor,
            draft_probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Every node's keep probability and every internal node's final state.

    Returns ``hold`` ``[n]`` (``h_v``; 1 at the root), ``final`` ``[M, V]`` (``m_v`` once all children of
    internal node v were rejected, mass ``h_v``) and ``internal`` (the M nodes with children, ascending)."""
    device = target_probs.device
    dt = torch.promote_types(target_probs.dtype, torch.float32)
    internal = [v for v, kids in enumerate(layout.children) if kids]
    pos = {v: i for i, v in enumerate(internal)}
    row_of = target_rows(tree, target_probs)  # [n]
    idx = torch.tensor(internal, dtype=torch.long, device=device)  # [M]
    p = target_probs.index_select(0, row_of.index_select(0, idx)).to(dt)  # [M, V]
    p = p / p.sum(dim=1, keepdim=True)
    q = draft_probs.index_select(0, idx).to(dt)  # [M, V]
    q = q / q.sum(dim=1, keepdim=True)
    alpha = torch.ones(tree.num_nodes, dtype=dt, device=device)  # [n] alpha_v as each node starts
    final = torch.empty_like(p)  # [M, V]
    for d in range(max(layout.depth) + 1):  # a level's alphas are set by the level above
        level = [v for v in internal if layout.depth[v] == d]
        if not level:
            continue
        rows = torch.tensor([pos[v] for v in level], dtype=torch.long, device=device)  # [B]
        m = alpha.index_select(0, torch.tensor(level, device=device))[:, None] * p.index_select(0, rows)  # [B, V]
        qb = q.index_select(0, rows)  # [B, V]
        for j in range(max(len(layout.children[v]) for v in level)):  # sibling rank: sequential
            sub = [b for b, v in enumerate(level) if len(layout.children[v]) > j]
            sel = torch.tensor(sub, dtype=torch.long, device=device)  # [S] rows of the batch with a j-th child
            kids = torch.tensor([layout.children[level[b]][j] for b in sub], dtype=torch.long, device=device)  # [S]
            x = torch.tensor([layout.tokens[layout.children[level[b]][j]] for b in sub], device=device)[:, None]
            m_x, q_x = m.index_select(0, sel).gather(1, x)[:, 0], qb.index_select(0, sel).gather(1, x)[:, 0]  # [S]
            safe = torch.where(q_x > 0, q_x, torch.ones_like(q_x))
            alpha[kids] = torch.where(q_x > 0, (m_x / safe).clamp(max=1.0), (m_x > 0).to(dt))
            m = m.index_copy(0, sel, _after_rejection(m.index_select(0, sel), qb.index_select(0, sel)))
        final[rows] = m
    hold = alpha.clone()  # leaves: kept with their starting alpha
    if internal:
        hold[idx] = final.sum(dim=1).clamp(0.0, 1.0)
    hold[0] = 1.0  # the root's sequence (nothing drafted) is always kept
    return hold, final, internal


def _check(tree: TokenTree, draft_probs: torch.Tensor | None) -> None:
    if tree.law != "iid":
        raise ValueError(f"verifier 'traversal' needs a tree whose siblings were drawn i.i.d. from q (law 'iid'), "
                         f"this one was drawn under {tree.law!r}; its losslessness is proven for i.i.d. drafts only")
    if tree.num_nodes > 1 and draft_probs is None:
        raise ValueError("traversal: this verifier needs draft_probs (the law the children were drawn from)")


def verify_traversal(tree: TokenTree, target_probs: torch.Tensor, draft_probs: torch.Tensor | None = None,
                     generator: torch.Generator | None = None) -> VerifyResult:
    """Traversal verification of ``tree`` (see the module docstring).

    ``target_probs`` ``[num_nodes, V]`` or ``[verified nodes, V]`` (no rows for leaves: a path kept down to a
    leaf then emits no bonus token); ``draft_probs`` ``[num_nodes, V]``, row i the law node i's children were
    drawn from (rows of leaves unused). One uniform per node, then one draw of the emitted token.
    """
    _check(tree, draft_probs)
    device = target_probs.device
    layout = _layout(tree)
    row_of = target_rows(tree, target_probs)  # [n]
    if tree.num_nodes == 1:
        dt = torch.promote_types(target_probs.dtype, torch.float32)
        hold, final, internal = torch.ones(1, dtype=dt, device=device), None, []
    else:
        hold, final, internal = _states(tree, layout, target_probs, draft_probs)  # [n], [M, V]
    rank = torch.tensor(layout.rank, dtype=torch.long, device=device)  # [n]
    u = torch.rand(tree.num_nodes, generator=generator, device=device, dtype=hold.dtype)  # [n]
    passing = u < hold  # the root always passes (u < 1)
    cur = torch.where(passing, rank, torch.full_like(rank, tree.num_nodes)).argmin()  # [] first pass in post-order
    pos_of = torch.full((tree.num_nodes,), -1, dtype=torch.long, device=device)  # [n] node -> row of final
    if internal:
        pos_of[torch.tensor(internal, device=device)] = torch.arange(len(internal), device=device)
    is_bonus = at(pos_of, cur) < 0  # stopped at a leaf (or a root without children)
    own = at(target_probs, at(row_of, cur).clamp(min=0)).to(hold.dtype)  # [V] (a row-less leaf: never emitted)
    if final is not None:  # a residual with no mass (the root, reached by rounding alone when p = q): p instead
        residual = at(final, at(pos_of, cur).clamp(min=0))  # [V]
        dist = torch.where(is_bonus | (residual.sum() <= 0), own, residual)  # [V]
    else:
        dist = own
    mass = dist.sum()
    mass_ok = torch.isfinite(hold).all() & torch.isfinite(mass) & (mass > 0)
    return _result(tree, cur, sample_categorical(dist, generator), is_bonus, at(row_of, cur) >= 0, mass_ok,
                   target_probs.shape[1])


def traversal_outcome_law(tree: TokenTree, target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """Exact law of (stopping node, next token) for the drafted tree ``tree``: ``[num_nodes, V]``, row v the
    probability that the kept path ends at node v and the next token is each token; rows sum to P(stop at v) and
    the whole to 1. Every row of ``target_probs`` is needed (the leaves' bonus rows included).

    target_probs ``[num_nodes, V]``; draft_probs ``[num_nodes, V]`` (rows of leaves unused)."""
    _check(tree, draft_probs)
    if tree.num_nodes == 1:
        return target_probs[:1] / target_probs[0].sum()
    layout = _layout(tree)
    hold, final, internal = _states(tree, layout, target_probs, draft_probs)  # [n], [M, V]
    order = torch.tensor(sorted(range(tree.num_nodes), key=layout.rank.__getitem__), device=hold.device)  # [n]
    fail = torch.cumprod(1 - hold.index_select(0, order), 0)  # [n] every test up to this one failed
    before = torch.cat([fail.new_ones(1), fail[:-1]])  # [n] every earlier test failed
    stop = torch.empty_like(hold).index_copy_(0, order, before * hold.index_select(0, order))  # [n] P(stop at v)
    dist = target_probs.to(hold.dtype)
    dist = dist / dist.sum(dim=1, keepdim=True)  # [n, V] the bonus rows
    idx = torch.tensor(internal, device=hold.device)
    mass = final.sum(dim=1, keepdim=True)  # [M, 1]
    residual = torch.where(mass > 0, final / torch.where(mass > 0, mass, torch.ones_like(mass)),
                           dist.index_select(0, idx))  # [M, V] (no mass: p, as the sampler does)
    dist = dist.index_copy(0, idx, residual)  # recovered rows at the internal nodes (the root's too)
    return stop[:, None] * dist
