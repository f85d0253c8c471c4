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
  target's hidden state (the target has not seen the node yet): after the head's final norm, or
  before it for a head in EAGLE-3's layout (``FEEDS_PRE_NORM``).

Only entries built from true hidden states are kept: :meth:`commit` keeps the root's entry and
drops the drafted path, which comes back at the next proposal as a chain with the target's
hidden states. Position 0 has no entry (there is no hidden state before it; a tree rooted there,
after a one-token prompt, is drafted from a zero vector and its root entry is not kept).

Costs: one head forward per call (one decoder layer over the new entries plus the
``|S|``-row output projection for the node rows only); logits are returned on the full
vocabulary (-inf outside the head's subset: q = 0 there), or on the subset alone when the builder
asks (``need_logits="subset"``). A call reads every head weight once; the rest is kept small (the KV
cache and the node features live in float32 buffers that grow by doubling, no mask is built where
every new entry sees every cached one, bookkeeping runs on host integers). Tested node by node
against the per-path reference (:func:`head_depth_logits` on the node's own root path).
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from ..models.runner import CacheBook, DraftObservation, HoldsCacheBook
from ..tree import TokenTree


class DraftHeadShape(Protocol):
    """The sizes a :class:`HeadRunner` reads of its head's config (:class:`~treespec.drafting.head.HeadConfig`)."""

    @property
    def hidden_size(self) -> int: ...

    @property
    def target_vocab_size(self) -> int: ...

    @property
    def num_heads(self) -> int: ...

    @property
    def head_dim(self) -> int: ...

    @property
    def feature_layers(self) -> tuple[int, ...]: ...


class DraftHeadLayer(Protocol):
    """The head's one decoder layer, in the two halves the runner calls around its own attention."""

    def qkv_heads(self, x: torch.Tensor, positions: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x`` ``[B, T, H]`` at ``positions`` ``[B, T]`` -> rotated q, k, v ``[B, heads, T, head_dim]``."""

    def finish(self, x: torch.Tensor, att: torch.Tensor) -> torch.Tensor:
        """The layer's output ``[B, T, H]`` from its input ``x`` and the attention ``att``."""


class DraftHead(Protocol):
    """What :class:`HeadRunner` and :func:`head_depth_logits` read of a head: the surface of
    :class:`~treespec.drafting.head.EagleHead`, named here so that this module builds on the head's
    interface and not on its module (``head`` imports this one to make its runner)."""

    vocab_ids: torch.Tensor  # [|S|] the head's vocabulary subset
    FEEDS_PRE_NORM: bool  # a child reads its parent's output before the final norm (else after it)

    @property
    def cfg(self) -> DraftHeadShape: ...

    @property
    def attached(self) -> bool: ...

    @property
    def hidden_norm(self) -> torch.nn.Module: ...

    @property
    def layer(self) -> DraftHeadLayer: ...

    def eval(self) -> "DraftHead": ...

    def own_features(self, features: torch.Tensor) -> torch.Tensor: ...

    def target_input(self, features: torch.Tensor) -> torch.Tensor: ...

    def inputs(self, hidden: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor: ...

    def out_norm(self, x: torch.Tensor) -> torch.Tensor: ...

    def logits(self, feature: torch.Tensor, float32: bool = True) -> torch.Tensor: ...

    def unroll(self, hidden: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, depths: int
               ) -> list[torch.Tensor]: ...


def reserve_kv(kv: torch.Tensor, total: int) -> torch.Tensor:
    """A one-layer KV cache ``[2, heads, capacity, head_dim]`` with room for ``total`` entries: ``kv`` itself, or a
    copy whose capacity doubles (at least 64), so that a growing sequence allocates rarely."""
    if total <= kv.shape[2]:
        return kv
    grown = kv.new_zeros(2, kv.shape[1], max(total, 2 * kv.shape[2], 64), kv.shape[3])
    grown[:, :, : kv.shape[2]] = kv
    return grown


def subset_logits(head, feature: torch.Tensor, need_logits: bool | str, vocab_size: int) -> dict[str, torch.Tensor]:
    """What a head's runner returns for ``feature`` ``[n, H]``: with ``need_logits="subset"`` the logits on the
    head's subset ``[n, |S|]`` and ``vocab_ids``; with another truthy value the logits over the whole vocabulary
    ``[n, V]`` (-inf outside the subset: q = 0 there); nothing otherwise."""
    if need_logits == "subset":
        return {"logits": head.logits(feature), "vocab_ids": head.vocab_ids}
    if not need_logits:
        return {}
    logits = torch.full((feature.shape[0], vocab_size), float("-inf"), device=feature.device)
    logits[:, head.vocab_ids] = head.logits(feature)
    return {"logits": logits}


class HeadRunner(HoldsCacheBook):
    """Runner interface (``reset``, ``forward``, ``commit``, ``length``) over an attached head.

    Parameters
    ----------
    head : DraftHead
        A head attached to its target (:meth:`~treespec.drafting.head.EagleHead.attach`).
    """

    def __init__(self, head: DraftHead) -> None:
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
        cfg = self.head.cfg
        # the head's KV cache, float32 (measured: one-query attention over a float32 cache is several times
        # cheaper than over bf16 on CPU); entries [0, entries) are committed, then one per uncommitted slot
        self._kv = torch.zeros(2, cfg.num_heads, 0, cfg.head_dim, device=self.device)  # [2, heads, capacity, hd]
        self.entries = 0  # committed cache entries
        # length: committed tokens covered (position 0 has no entry); slots: tree node of each uncommitted entry
        self.book = CacheBook()
        self._slot_nodes = torch.zeros(0, dtype=torch.long)  # the same nodes as a tensor (where the tree's are)
        self._features = torch.zeros(0, cfg.hidden_size, device=self.device)  # [capacity, H] fed nodes' outputs
        self._fed: set[int] = set()  # tree nodes fed so far (their rows of _features are valid)
        self.hidden: torch.Tensor | None = None  # [rows, F] target features (F = head.cfg.feature_width)
        self.hidden_first = 0  # position of hidden row 0

    @property
    def keys(self) -> torch.Tensor:
        """``[1, heads, entries + len(slots), head_dim]`` the cached keys (a view)."""
        return self._kv[0:1, :, : self.entries + len(self.slots)]

    @property
    def values(self) -> torch.Tensor:
        return self._kv[1:2, :, : self.entries + len(self.slots)]

    def _reserve(self, total: int) -> None:
        """Room for ``total`` cache entries (capacity doubles: no per-step allocation)."""
        self._kv = reserve_kv(self._kv, total)

    def observe(self, state: DraftObservation) -> None:
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

    def _hidden_rows(self, start: int, stop: int) -> torch.Tensor:
        """The target features at positions ``start .. stop - 1`` (bounds checked on host integers)."""
        lo, hi = start - self.hidden_first, stop - self.hidden_first
        if self.hidden is None or lo < 0 or hi > self.hidden.shape[0]:
            raise RuntimeError("the target hidden state of a fed position is missing (call observe() first)")
        return self.hidden[lo:hi]

    # ------------------------------------------------------------------ forward
    @torch.no_grad()
    def forward(self, tree: TokenTree | None, nodes: torch.Tensor | None, chain: torch.Tensor | None = None,
                *, need_logits: bool | str = True, need_hidden: bool = False) -> dict[str, torch.Tensor]:
        """Append ``chain`` (committed, causal) then tree ``nodes``; returns ``logits`` ``[n, V]`` of the nodes.

        ``need_logits="subset"``: ``logits`` ``[n, |S|]`` on the head's vocabulary subset and
        ``vocab_ids`` ``[|S|]`` (what the tree builders ask for: no full-vocabulary rows per level).
        A node's parent must have been fed by an earlier call (the head reads its output feature).

        One step reads every head weight once; the rest is kept small: the cache and the node
        features live in buffers that grow by doubling, attention runs for the node rows only (the
        head has one layer: a chain entry is only kept, for its key and value), its mask is built only
        where a node must not see some entry, and the bookkeeping runs on host integers (one transfer
        of the nodes' indices and parents to the host per call).
        """
        device, head = self.device, self.head
        book = self.book
        base, used = book.length, self.entries + len(book.slots)
        m, n = book.begin(tree, nodes, chain)
        m_entries = m - int(base == 0) if m else 0  # the chain's entries: positions >= 1 only
        inputs, toks, pos = [], [], []
        if m_entries:  # each from the true hidden state one position back
            first = base + m - m_entries
            inputs.append(head.target_input(self._hidden_rows(first - 1, base + m - 1)).float())
            toks.append(chain.to(device)[m - m_entries:])
            pos.append(torch.arange(first, base + m, device=device))
        if n:
            node_list, parent_list = torch.stack([nodes.to(tree.parents.device), tree.parents[nodes]]).tolist()
            roots = [p < 0 for p in parent_list]
            if any(not r and p not in self._fed for r, p in zip(roots, parent_list)):
                raise RuntimeError("the head drafts level by level: a node's parent must be fed by an earlier call")
            if any(roots):
                if self.root_position == 0:  # no hidden state precedes position 0: zeros stand in (a guess;
                    root_hidden = torch.zeros(1, head.cfg.hidden_size, device=device)  # never committed)
                else:
                    root_hidden = head.target_input(self._hidden_rows(self.root_position - 1,
                                                                      self.root_position)).float()  # [1, H]
            if all(roots):
                inputs.append(root_hidden.expand(n, -1))
            else:
                parents = tree.parents[nodes].to(device)  # [n] (on the device: no copy from the host)
                known = self._features[parents.clamp(min=0)]  # [n, H]
                inputs.append(torch.where((parents < 0)[:, None], root_hidden, known) if any(roots) else known)
            toks.append(tree.tokens[nodes].to(device))
            pos.append(tree.depths[nodes].to(device) + self.root_position)
        new = m_entries + n
        if new:
            hidden = inputs[0] if len(inputs) == 1 else torch.cat(inputs)  # [new, H]
            x = head.inputs(hidden, toks[0] if len(toks) == 1 else torch.cat(toks))[None]  # [1, new, H]
            q, k, v = head.layer.qkv_heads(x, (pos[0] if len(pos) == 1 else torch.cat(pos))[None])
            total = used + new
            self._reserve(total)
            self._kv[0, :, used:total] = k[0]
            self._kv[1, :, used:total] = v[0]
        if n:  # one layer: only the nodes' outputs are read (a chain entry is kept for its key and value)
            mask = self._mask(tree, nodes, node_list, total)
            att = F.scaled_dot_product_attention(q[:, :, m_entries:].float(), self._kv[0:1, :, :total],
                                                 self._kv[1:2, :, :total], attn_mask=mask)  # [1, heads, n, hd]
            pre = head.layer.finish(x[:, m_entries:], att.to(x.dtype))[0]  # [n, H] before the final norm
            node_out = head.out_norm(pre)  # [n, H] what the logits read
        self.entries += m_entries
        book.finish(base, m, node_list if n else [])  # the chain is committed, the nodes join the slots
        result: dict[str, torch.Tensor] = {}
        if n:
            if tree.num_nodes > self._features.shape[0]:  # grow the per-node table to the tree
                grown = self._features.new_zeros(max(tree.num_nodes, 2 * self._features.shape[0], 16),
                                                 self._features.shape[1])
                grown[: self._features.shape[0]] = self._features
                self._features = grown
            self._features[nodes.to(device)] = (pre if head.FEEDS_PRE_NORM else node_out).float()  # children read it
            self._fed.update(node_list)
            self._slot_nodes = torch.cat([self._slot_nodes.to(nodes.device), nodes])  # the same nodes, a tensor
            result.update(subset_logits(head, node_out, need_logits, self.vocab_size))
            if need_hidden:
                result["hidden"] = node_out
        return result

    def _mask(self, tree: TokenTree, nodes: torch.Tensor, node_list: list[int], total: int) -> torch.Tensor | None:
        """``[1, 1, n, total]`` bool attention mask of the new nodes, or None where each sees every entry.

        A node sees the committed entries, this call's chain and, among the tree's entries (the earlier
        slots, or after a chain none, then these nodes), itself and its ancestors.
        """
        n = len(node_list)
        if n == 1 and not self.slots:  # a root alone: it sees everything cached
            return None
        visible = torch.ones(n, total, dtype=torch.bool, device=self.device)
        anc = tree.ancestor_mask
        key_nodes = torch.cat([self._slot_nodes.to(anc.device), nodes.to(anc.device)])  # [tree entries]
        visible[:, total - key_nodes.numel():] = anc[nodes.to(anc.device)][:, key_nodes].to(self.device)
        return visible[None, None]

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
        _, k, v = self.head.layer.qkv_heads(x, positions[None])  # [1, nh, n, hd] each
        self._reserve(n)
        self._kv[0, :, :n], self._kv[1, :, :n] = k[0], v[0]

    # ------------------------------------------------------------------ cache commit
    def commit(self, nodes: list[int]) -> None:
        """Keep the root's entry (built from a true hidden state) and drop every drafted node.

        The accepted drafted tokens are fed again at the next proposal, as a committed chain with
        the target's hidden states.
        """
        keep_root = bool(nodes) and nodes[0] == 0 and 0 in self.slots and self.root_position >= 1
        if keep_root and self.slots[0] != 0:
            raise RuntimeError("the root must be the first tree entry")
        self.entries += int(keep_root)  # the dropped entries are overwritten by the next call
        self.book.committed(int(keep_root))
        self._fed = set()
        self._slot_nodes = self._slot_nodes[:0]


def head_depth_logits(head: DraftHead, target, ids: torch.Tensor, depths: int
                      ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Target logits and the head's logits at tree depths ``1..depths`` along one sequence (measurement).

    Emulates, in one parallel pass per depth (:meth:`~treespec.drafting.head.EagleHead.unroll`), what
    :class:`HeadRunner` computes inside a tree whose path follows the sequence: the depth-``k``
    distribution at position ``j`` comes from the node at position ``j`` whose root sits at
    ``r = j - k + 1``.
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
