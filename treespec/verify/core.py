"""The shared machinery of every tree verifier.

A verifier is a pure function ``(tree, target_probs, draft_probs, generator) -> VerifyResult``.
Each scheme is written as a *node rule*: given, for every internal node at once, the target
distribution p, the draft distribution q and the ordered child tokens, it returns

* ``choice_probs`` ``[M, K + 1]``: the exact probability that the node's output token is child k
  (``k < K``), or that every child is rejected (column ``K``);
* ``residual`` ``[M, V]``: the distribution the output token is drawn from when every child is
  rejected (the *recovered* token). A rule may return it as a :class:`FactoredResidual` instead
  (the rejection rules do, on a draft's support): only the row of the node where the path stops is
  ever drawn from, so :func:`verify_tree` forms that one row; :func:`dense_residual` forms them all.

The marginal law of the output token, ``sum_k choice_probs[k] * onehot(x_k) + choice_probs[K] *
residual``, must equal p exactly: that is what the exact-law tests enumerate. Because every node
draws with its own independent randomness, all internal nodes are decided at once and the accepted
path is then read off by walking from the root, which has the same law as deciding them top-down
(a node below a rejection is never consulted). The walk runs on the device with a fixed number of
gathers (the tree depth); the result is read back with a single host sync.

At the final node of the path the emitted token is the *recovered* token (drawn from the residual)
if that node has children, else the *bonus* token (drawn from p).

``target_probs`` has a row per node, or a row per node of ``tree.verified_nodes`` only (the root and
every node with children, in that order): a target that pays for each row it outputs (llama.cpp's LM
head) can skip the leaves. A path accepted down to a leaf without a row then ends without a bonus
token; the accepted path's law is unchanged, since the bonus token is drawn after it and from the
leaf's row alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..sampling import draw, first_argmax
from ..tree import TokenTree

@dataclass(frozen=True)
class FactoredResidual:
    """Residual rows ``r = c_off * p`` off the columns ``cols`` and ``r_s`` on them.

    What the rejection rules keep on a draft's support: where q is zero, ``(r - q)+ = r``, so the
    residual there stays a multiple of p. Rows are formed on demand (:meth:`rows`), each at the
    cost of one row of p, instead of ``[M, V]`` at once.
    """

    p: torch.Tensor  # [M, V]
    c_off: torch.Tensor  # [M, 1] in p's dtype
    cols: torch.Tensor  # [S] ascending column ids
    r_s: torch.Tensor  # [M, S]

    @property
    def shape(self) -> torch.Size:
        return self.p.shape

    def rows(self, idx: torch.Tensor) -> torch.Tensor:
        """The residual rows ``idx`` ``[R]`` -> ``[R, V]``."""
        out = self.p.index_select(0, idx) * self.c_off.index_select(0, idx)  # [R, V]
        return out.index_copy_(1, self.cols, self.r_s.index_select(0, idx))

    def dense(self) -> torch.Tensor:
        """Every row: ``[M, V]``."""
        return (self.p * self.c_off).index_copy_(1, self.cols, self.r_s)


# (p [M, V], q [M, V] | None, child_tokens [M, K], child_valid [M, K]) -> (choice_probs, residual)
NodeRule = Callable[
    [torch.Tensor, "torch.Tensor | None", torch.Tensor, torch.Tensor],
    "tuple[torch.Tensor, torch.Tensor | FactoredResidual]",
]


def dense_residual(residual: torch.Tensor | FactoredResidual) -> torch.Tensor:
    """A rule's residual as the full ``[M, V]`` tensor."""
    return residual.dense() if isinstance(residual, FactoredResidual) else residual


def residual_rows(residual: torch.Tensor | FactoredResidual, idx: torch.Tensor) -> torch.Tensor:
    """Rows ``idx`` ``[R]`` of a rule's residual -> ``[R, V]``, forming only those rows."""
    return residual.rows(idx) if isinstance(residual, FactoredResidual) else residual.index_select(0, idx)


@dataclass(frozen=True)
class VerifyResult:
    """Outcome of verifying one tree.

    Attributes
    ----------
    accepted_nodes : list[int]
        Node indices of the accepted drafts, root excluded, in path order.
    accepted_tokens : list[int]
        Their tokens.
    next_token : int | None
        The token emitted after them: recovered (from the residual) or bonus (from p); None when the
        path ends at a leaf that has no target row (``target_probs`` over ``tree.verified_nodes``).
    is_bonus : bool
        True if every draft on the path was accepted down to a leaf.
    """

    accepted_nodes: list[int]
    accepted_tokens: list[int]
    next_token: int | None
    is_bonus: bool

    @property
    def num_accepted(self) -> int:
        return len(self.accepted_nodes)

    @property
    def tokens(self) -> list[int]:
        """Every token this step emits: the accepted drafts, then the recovered / bonus token (if any)."""
        return [*self.accepted_tokens, *([] if self.next_token is None else [self.next_token])]


def check_inputs(tree: TokenTree, target_probs: torch.Tensor, draft_probs: torch.Tensor | None,
                 needs_draft_probs: bool, name: str) -> None:
    """Raise ``ValueError`` (naming verifier ``name``) unless target_probs is ``[num_nodes, V]`` (or
    ``[verified nodes, V]``) and, when ``needs_draft_probs`` and the tree has a child, draft_probs is
    ``[num_nodes, V]`` with the target's V."""
    n = tree.num_nodes
    # every row (the common case) needs no look at the tree: verified_nodes costs a host sync
    if target_probs.ndim != 2 or (target_probs.shape[0] != n
                                  and target_probs.shape[0] != tree.verified_nodes.numel()):
        raise ValueError(
            f"{name}: target_probs must be [num_nodes={n}, vocab] or [verified nodes="
            f"{tree.verified_nodes.numel()}, vocab], got {tuple(target_probs.shape)}"
        )
    if needs_draft_probs and n > 1:
        if draft_probs is None:
            raise ValueError(f"{name}: this verifier needs draft_probs (the law the children were drawn from)")
        if tuple(draft_probs.shape) != (n, target_probs.shape[1]):
            raise ValueError(
                f"{name}: draft_probs {tuple(draft_probs.shape)} must be [num_nodes={n}, "
                f"vocab={target_probs.shape[1]}] (the target's vocabulary, one row per node)"
            )


def check_law(tree: TokenTree, allowed: tuple[str, ...], name: str) -> None:
    if tree.law not in allowed:
        raise ValueError(
            f"verifier {name!r} needs a tree drafted under {' or '.join(map(repr, allowed))}, "
            f"but this tree's children were drawn under {tree.law!r}; pick the verifier that matches "
            f"the draft law (see treespec.verify.VERIFIER_LAWS)"
        )


def sample_categorical(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One exact draw from each row of ``probs`` ``[..., V]`` -> ``[...]`` (no host sync; see
    :func:`treespec.sampling.draw`)."""
    return draw(probs, generator)[..., 0]


def verify_tree(tree: TokenTree, target_probs: torch.Tensor, draft_probs: torch.Tensor | None,
                generator: torch.Generator | None, rule: NodeRule) -> VerifyResult:
    """Verify ``tree`` with a node rule; see the module docstring.

    target_probs ``[num_nodes, V]`` (or ``[verified nodes, V]``); draft_probs ``[num_nodes, V]`` (row i: the
    law node i's children were drawn from; only rows of nodes with children are read) or None for a rule
    that ignores q. ``rule`` is called (once, if a node has children) on p ``[M, V]``, q ``[M, V]`` (or
    None), child_tokens ``[M, K]`` and child_valid ``[M, K]`` bool.
    """
    device = target_probs.device
    n = tree.num_nodes
    children = tree.children  # [n, K]
    k = children.shape[1]
    internal = torch.nonzero(tree.num_children > 0).flatten()  # [M]
    row_of = target_rows(tree, target_probs)  # [n] node -> row of target_probs, -1 where none
    next_node = torch.full((n,), -1, dtype=torch.long, device=device)
    residual_row = torch.full((n,), -1, dtype=torch.long, device=device)
    residual = target_probs[:0]
    mass_ok = torch.ones((), dtype=torch.bool, device=device)
    if internal.numel() > 0:
        kids = children[internal]  # [M, K]
        valid = kids >= 0
        child_tokens = torch.where(valid, tree.tokens[kids.clamp(min=0)], torch.zeros_like(kids))
        # index_select: a plain copy of whole rows (advanced indexing takes the general gather kernel)
        p = target_probs.index_select(0, row_of[internal])  # [M, V]
        q = draft_probs.index_select(0, internal) if draft_probs is not None else None  # [M, V]
        choice_probs, residual = rule(p, q, child_tokens, valid)  # [M, K+1], [M, V]
        choice_probs = choice_probs.clamp(min=0)
        cum = choice_probs.cumsum(dim=1)
        mass_ok = torch.isfinite(cum[:, -1]).all()
        u = torch.rand(internal.numel(), 1, generator=generator, device=device, dtype=cum.dtype)
        choice = (u * cum[:, -1:] >= cum).sum(dim=1).clamp(max=k)  # [M], K = none accepted
        picked = kids.gather(1, choice.clamp(max=k - 1)[:, None]).squeeze(1)
        next_node[internal] = torch.where(choice < k, picked, torch.full_like(picked, -1))
        residual_row[internal] = torch.arange(internal.numel(), device=device)
    cur = _walk(tree, next_node)
    row = at(residual_row, cur)
    is_bonus = row < 0
    own = at(target_probs, at(row_of, cur).clamp(min=0))  # [V] (a leaf without a row: drawn from, never emitted)
    dist = own if residual.shape[0] == 0 else torch.where(
        is_bonus, own, residual_rows(residual, row.clamp(min=0).view(1))[0]
    )  # [V]
    mass = dist.sum()
    mass_ok = mass_ok & torch.isfinite(mass) & (mass > 0)
    return _result(tree, cur, sample_categorical(dist, generator), is_bonus, at(row_of, cur) >= 0, mass_ok,
                   target_probs.shape[1])


def verify_tree_greedy(tree: TokenTree, scores: torch.Tensor) -> VerifyResult:
    """Temperature-0 verification straight from row-wise argmaxes (probabilities or logits alike).

    The fast path of :func:`verify_tree` with :func:`treespec.verify.rules.greedy_rule`: no
    ``[M, V]`` work beyond one argmax, no sampling. Tested against the rule-based path.

    scores ``[num_nodes, V]`` (or ``[verified nodes, V]``).
    """
    row_of = target_rows(tree, scores)  # [n]
    best = first_argmax(scores).index_select(0, row_of.clamp(min=0))  # [n] the target's greedy token after each node
    kids = tree.children  # [n, K]
    match = (kids >= 0) & (tree.tokens[kids.clamp(min=0)] == best[:, None])  # [n, K]
    first = match.to(torch.int8).argmax(dim=1, keepdim=True)  # first matching child
    next_node = torch.where(match.any(dim=1), kids.gather(1, first).squeeze(1), torch.full_like(best, -1))
    cur = _walk(tree, next_node)
    return _result(tree, cur, at(best, cur), at(tree.num_children, cur) == 0, at(row_of, cur) >= 0)


def target_rows(tree: TokenTree, target_probs: torch.Tensor) -> torch.Tensor:
    """``[num_nodes]``: the row of ``target_probs`` holding each node's target distribution, -1 for a
    leaf without one (``target_probs`` over ``tree.verified_nodes``).

    target_probs ``[num_nodes, V]`` (or ``[verified nodes, V]``); only its row count is read."""
    n = tree.num_nodes
    if target_probs.shape[0] == n:
        return torch.arange(n, device=tree.device)
    row_of = torch.full((n,), -1, dtype=torch.long, device=tree.device)
    verified = tree.verified_nodes
    return row_of.index_copy_(0, verified, torch.arange(verified.numel(), device=tree.device))


def at(values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``values[index]`` for a 0-d index tensor, without the host sync of ``values[index]`` (which reads a 0-d
    index back as a Python int): ``values`` ``[n, ...]`` -> ``[...]``."""
    return values.index_select(0, index.reshape(1).to(values.device)).squeeze(0)


def _walk(tree: TokenTree, next_node: torch.Tensor) -> torch.Tensor:
    """Follow ``next_node`` ``[n]`` (-1 = stop) from the root: depth-many gathers, no host sync. Returns ``[]``."""
    cur = torch.zeros((), dtype=torch.long, device=next_node.device)
    for _ in range(tree.max_depth):
        nxt = at(next_node, cur)
        cur = torch.where(nxt >= 0, nxt, cur)
    return cur


def _result(tree: TokenTree, cur: torch.Tensor, token: torch.Tensor, is_bonus: torch.Tensor,
            has_row: torch.Tensor, mass_ok: torch.Tensor | None = None, vocab: int | None = None) -> VerifyResult:
    """Read the path to ``cur`` and the emitted token back with one host sync; ``mass_ok`` False (a
    row of the path with no finite positive mass) raises."""
    n = tree.num_nodes
    ok = torch.ones((), dtype=torch.bool, device=cur.device) if mass_ok is None else mass_ok
    packed = torch.cat([torch.stack([cur, token, is_bonus.long(), has_row.long(), ok.long()]),
                        at(tree.ancestor_mask, cur).long(), tree.tokens])
    host = packed.tolist()  # the one host sync of a verification
    node, tok, bonus, has, good = host[:5]
    if not good or (vocab is not None and not 0 <= tok < vocab):
        raise ValueError(f"target_probs has a row without finite positive mass among those the verification read "
                         f"(its path stopped at node {node}): verifiers take probabilities (logits_to_probs), every "
                         f"row summing to a positive number")
    on_path, tokens = host[5:5 + n], host[5 + n:]
    path = [i for i in range(1, n) if on_path[i]]
    return VerifyResult(path, [tokens[i] for i in path], int(tok) if has else None, bool(bonus))


def output_law(p: torch.Tensor, q: torch.Tensor | None, child_tokens: torch.Tensor,
               child_valid: torch.Tensor, rule: NodeRule) -> torch.Tensor:
    """Exact law of one node's output token given its drafts: ``[M, V]``.

    p ``[M, V]``, q ``[M, V]`` (or None for a rule that ignores it), child_tokens ``[M, K]`` int64 (any id
    in ``[0, V)`` where invalid), child_valid ``[M, K]`` bool.

    Used by the exact-law tests and the acceptance analysis: it runs the very rule that
    :func:`verify_tree` samples from.
    """
    choice_probs, residual = rule(p, q, child_tokens, child_valid)
    k = child_tokens.shape[1]
    law = dense_residual(residual) * choice_probs[:, k:k + 1]
    law = law.scatter_add(1, child_tokens, choice_probs[:, :k] * child_valid)
    return law
