"""The draft runner interface over an :class:`~treespec.drafting.head.EagleHead`.

Every tree builder of :mod:`treespec.trees` (static shapes, Sequoia, DySpec, EAGLE-2, merged)
drafts through a runner: ``forward(tree, nodes, chain)`` appends committed tokens and tree nodes to
a KV cache and returns their draft logits, ``commit(path)`` keeps the accepted root path.
:class:`HeadRunner` offers the same interface for the trained head, so the head grows any tree
shape.

How the head's inputs are formed (EAGLE, arXiv 2401.15077): the cache entry of the token at
position ``j`` is built from ``(h_{j-1}, x_j)``, where ``h`` is the target's last hidden state (for a
head with fused features, the target's features at ``j - 1``: earlier layers' outputs and the last
hidden state, :mod:`treespec.models.features`).

* committed tokens (the chain) and the root of each tree use the target's true hidden states,
  handed to the runner at the start of every proposal (:meth:`HeadRunner.observe`);
* a drafted node at depth >= 1 uses the output feature of its parent's entry in place of the
  target's hidden state (the target has not seen the node yet).

Only entries built from true hidden states are kept: :meth:`commit` keeps the root's entry and
drops the drafted path, which comes back at the next proposal as a chain with the target's
hidden states. Position 0 has no entry (there is no hidden state before it; a tree rooted there,
after a one-token prompt, is drafted from a zero vector and its root entry is not kept).

Costs: one head forward per call (one decoder layer over the new entries plus the
``|S|``-row output projection for the node rows only); logits are returned on the full
vocabulary (-inf outside the head's subset: q = 0 there).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..models.runner import start_forward
from ..tree import TokenTree
from .base import DraftState
from .head import EagleHead


class HeadRunner:
    """Runner interface (``reset``, ``forward``, ``commit``, ``length``) over an attached head.

    Parameters
    ----------
    head : EagleHead
        A head attached to its target (:meth:`EagleHead.attach`).
    """

    def __init__(self, head: EagleHead) -> None:
        if not head.attached:
            raise ValueError("attach the head to the target before drafting")
        self.head = head.eval()
        self.model = None  # no causal LM behind this runner
        self.device = head.hidden_norm.weight.device
        self.vocab_size = head.cfg.target_vocab_size
        self.feature_layers = head.cfg.feature_layers  # the target layers the engine must hand over
        self.reset()

    def as_runner(self) -> "HeadRunner":
        return self

    # ------------------------------------------------------------------ state
    def reset(self) -> None:
        self.keys: torch.Tensor | None = None  # [1, heads, entries, head_dim]
        self.values: torch.Tensor | None = None
        self.entries = 0  # committed cache entries
        self.length = 0  # committed tokens covered (position 0 has no entry)
        self.slots: list[int] = []  # tree node of each uncommitted entry, in order
        self.features: torch.Tensor | None = None  # [nodes, H] output feature of each fed tree node
        self.fed: torch.Tensor | None = None  # [nodes] bool
        self.tree: TokenTree | None = None
        self.root_position = 0
        self.hidden: torch.Tensor | None = None  # [rows, F] target features (F = head.cfg.feature_width)
        self.hidden_first = 0  # position of hidden row 0

    def observe(self, state: DraftState) -> None:
        """Take the target's hidden states of the newly committed positions (start of a proposal).

        ``state.target_hidden`` row ``i`` is the state at position ``root - rows + i``. The last row
        of the previous proposal is kept in front, so a chain that starts one position earlier
        (after a proposal without a tree forward) can still be fed.
        """
        hid = state.target_hidden
        if len(state.tokens) == 1 and (hid is None or hid.shape[0] == 0):
            self.hidden, self.hidden_first = None, 0  # a one-token prompt: nothing precedes the root
            return
        if hid is None:
            raise ValueError("the head drafts from the target's hidden states: DraftState.target_hidden is None")
        try:
            hid = self.head.own_features(hid)
        except ValueError as err:
            raise ValueError(f"DraftState.target_hidden: {err} (the engine asks the target for the drafter's "
                             "feature_layers)") from None
        first = len(state.tokens) - 1 - hid.shape[0]
        hid = hid.to(self.device)
        if self.hidden is not None and self.hidden_first + self.hidden.shape[0] == first:
            hid, first = torch.cat([self.hidden[-1:], hid]), first - 1
        self.hidden, self.hidden_first = hid, first

    def _hidden_at(self, positions: torch.Tensor) -> torch.Tensor:
        rows = positions - self.hidden_first
        if self.hidden is None or bool((rows < 0).any()) or bool((rows >= self.hidden.shape[0]).any()):
            raise RuntimeError("the target hidden state of a fed position is missing (call observe() first)")
        return self.hidden[rows]

    def _fed_at(self, nodes: torch.Tensor) -> torch.Tensor:
        inside = nodes < self.fed.shape[0]
        return inside & self.fed[nodes.clamp(max=max(self.fed.shape[0] - 1, 0))] if self.fed.shape[0] \
            else torch.zeros_like(inside)

    # ------------------------------------------------------------------ forward
    @torch.no_grad()
    def forward(self, tree: TokenTree | None, nodes: torch.Tensor | None, chain: torch.Tensor | None = None,
                *, need_logits: bool | str = True, need_hidden: bool = False) -> dict[str, torch.Tensor]:
        """Append ``chain`` (committed, causal) then tree ``nodes``; returns ``logits`` ``[n, V]`` of the nodes.

        ``need_logits="subset"``: ``logits`` ``[n, |S|]`` on the head's vocabulary subset and
        ``vocab_ids`` ``[|S|]`` (what the tree builders ask for: no full-vocabulary rows per level).
        A node's parent must have been fed by an earlier call (the head reads its output feature).
        """
        device, head = self.device, self.head
        base = self.length
        m, n = start_forward(self, tree, nodes, chain)
        inputs, toks, pos = [], [], []
        # chain: entries for positions >= 1, each from the true hidden state one position back
        chain_pos = torch.arange(base, base + m, device=device)
        keep = chain_pos >= 1
        m_entries = int(keep.sum())
        if m_entries:
            cpos = chain_pos[keep]
            inputs.append(head.target_input(self._hidden_at(cpos - 1)))
            toks.append(chain.to(device)[keep])
            pos.append(cpos)
        if n:
            node_list = nodes.tolist()
            parents = tree.parents[nodes]  # [n]
            is_root = parents < 0
            par = parents.clamp(min=0)
            if self.features is None:
                self.features = torch.zeros(0, head.cfg.hidden_size, device=device)
                self.fed = torch.zeros(0, dtype=torch.bool, device=device)
            if bool((~is_root & ~self._fed_at(par)).any()):
                raise RuntimeError("the head drafts level by level: a node's parent must be fed by an earlier call")
            if self.root_position == 0:  # no hidden state precedes position 0: zeros stand in (a guess;
                root_hidden = torch.zeros(1, head.cfg.hidden_size, device=device)  # never committed)
            else:
                root_hidden = head.target_input(self._hidden_at(torch.tensor([self.root_position - 1],
                                                                             device=device)))  # [1, H]
            known = self.features[par.clamp(max=max(self.features.shape[0] - 1, 0))] if self.features.shape[0] \
                else root_hidden.expand(n, -1)
            inputs.append(torch.where(is_root[:, None], root_hidden.float(), known.float()))
            toks.append(tree.tokens[nodes])
            pos.append(tree.depths[nodes] + self.root_position)
        new = m_entries + n
        if new:
            hidden = torch.cat(inputs).float()  # [new, H]
            x = head.inputs(hidden, torch.cat(toks))[None]  # [1, new, H]
            q, k, v = head.layer.qkv_heads(x, torch.cat(pos)[None])
            keys = k if self.keys is None else torch.cat([self.keys, k], dim=2)
            values = v if self.values is None else torch.cat([self.values, v], dim=2)
            visible = torch.zeros(new, keys.shape[2], dtype=torch.bool, device=device)
            visible[:, : self.entries] = True
            if m_entries:
                visible[:m_entries, self.entries: self.entries + m_entries] = torch.ones(
                    m_entries, m_entries, dtype=torch.bool, device=device).tril()
                visible[m_entries:, self.entries: self.entries + m_entries] = True
            if n:
                key_nodes = torch.tensor(self.slots + node_list, dtype=torch.long, device=device)
                visible[m_entries:, self.entries + m_entries:] = self.tree.ancestor_mask[nodes][:, key_nodes]
            att = F.scaled_dot_product_attention(q, keys, values, attn_mask=visible[None, None])
            out = head.out_norm(head.layer.finish(x, att))[0]  # [new, H]
            self.keys, self.values = keys, values
        self.entries += m_entries
        self.length = base + m
        result: dict[str, torch.Tensor] = {}
        if n:
            node_out = out[m_entries:]  # [n, H]
            size = max(tree.num_nodes, self.features.shape[0])
            if size > self.features.shape[0]:  # grow the per-node tables to the tree
                grow = size - self.features.shape[0]
                self.features = torch.cat([self.features, self.features.new_zeros(grow, self.features.shape[1])])
                self.fed = torch.cat([self.fed, self.fed.new_zeros(grow)])
            self.features[nodes] = node_out.float()
            self.fed[nodes] = True
            self.slots.extend(node_list)
            if need_logits == "subset":
                result["logits"] = head.logits(node_out)  # [n, |S|]
                result["vocab_ids"] = head.vocab_ids
            elif need_logits:
                logits = torch.full((n, self.vocab_size), float("-inf"), device=device)
                logits[:, head.vocab_ids] = head.logits(node_out)
                result["logits"] = logits
            if need_hidden:
                result["hidden"] = node_out
        return result

    @torch.no_grad()
    def rebuild(self, hidden: torch.Tensor, tokens: torch.Tensor) -> None:
        """Recompute the committed entries with the head's current weights (after it was trained).

        Parameters
        ----------
        hidden : torch.Tensor
            ``[>= entries, F]`` the target's features at positions ``0, 1, ...``.
        tokens : torch.Tensor
            ``[>= entries + 1]`` the committed tokens at positions ``0, 1, ...``.
        """
        n = self.entries  # committed entries are those of positions 1..n, in order
        if n == 0:
            return
        positions = torch.arange(1, n + 1, device=self.device)
        x = self.head.inputs(self.head.target_input(hidden[:n].to(self.device)),
                             tokens[1:n + 1].to(self.device))[None]  # [1, n, H]
        _, self.keys, self.values = self.head.layer.qkv_heads(x, positions[None])  # [1, nh, n, hd] each

    # ------------------------------------------------------------------ cache commit
    def commit(self, nodes: list[int]) -> None:
        """Keep the root's entry (built from a true hidden state) and drop every drafted node.

        The accepted drafted tokens are fed again at the next proposal, as a committed chain with
        the target's hidden states.
        """
        keep_root = bool(nodes) and nodes[0] == 0 and 0 in self.slots and self.root_position >= 1
        if keep_root and self.slots[0] != 0:
            raise RuntimeError("the root must be the first tree entry")
        kept = self.entries + int(keep_root)
        if self.keys is not None:
            self.keys, self.values = self.keys[:, :, :kept], self.values[:, :, :kept]
        self.entries = kept
        self.length += int(keep_root)
        self.slots, self.features, self.fed, self.tree = [], None, None, None


def head_depth_logits(head: EagleHead, target, ids: torch.Tensor, depths: int
                      ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Target logits and the head's logits at tree depths ``1..depths`` along one sequence (measurement).

    Emulates, in one parallel pass per depth (:meth:`EagleHead.unroll`), what :class:`HeadRunner`
    computes inside a tree whose path follows the sequence: the depth-``k`` distribution at position
    ``j`` comes from the node at position ``j`` whose root sits at ``r = j - k + 1``.
    Returns ``t_logits`` ``[L - 1, V]`` (row ``i`` = position ``i + 1``) and, per depth ``k``, the head's
    logits ``[L - 1, V]`` whose first ``k - 1`` rows are undefined (NaN: no root before position 1).
    """
    if depths < 1:
        raise ValueError("depths must be >= 1")
    from ..models.features import model_features

    with torch.no_grad():
        hidden = model_features(target, ids, layers=head.cfg.feature_layers).float()[0]  # [L, F]
        t_logits = target(ids).logits[0, 1:].float()  # [L - 1, V]
        n = ids.shape[1] - 1  # entries at positions 1..L-1
        positions = torch.arange(1, n + 1, device=ids.device)
        outs = [f[0] for f in head.unroll(hidden[None, :-1], ids[:, 1:], positions[None], depths)]  # [n, H] each
        d_all = []
        for k, f in enumerate(outs, start=1):
            d = torch.full_like(t_logits, float("-inf"))
            d[:, head.vocab_ids] = head.logits(f)
            d[: k - 1] = float("nan")
            d_all.append(d)
    return t_logits, d_all
