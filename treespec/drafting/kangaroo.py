"""Kangaroo's self-speculative draft: the target's first layers, a small trained adapter, the target's LM head.

Architecture (Liu et al., "Kangaroo: Lossless Self-Speculative Decoding via Double Early Exiting",
arXiv 2404.18911; own code):

* the target's first ``L`` decoder layers (an early exit,
  :func:`~treespec.models.early_exit.early_exit_model`, without the final norm) give, for every token,
  the residual stream ``r`` ``[H]`` after layer ``L - 1`` (0-based);
* the adapter, one attention block with its own KV cache and two norms:
  ``a = r + o(attn(attn_norm(r)))`` (rotary multi-head self-attention, causal along the sequence and
  along each tree path; no MLP), then ``out_norm(a)``;
* logits ``= out_norm(a) @ W[S].T``, ``W`` the target's own LM-head rows on a vocabulary subset ``S``
  (:class:`~treespec.drafting.subset_head.SubsetHead`: q is exactly 0 outside ``S``).

``o`` starts at zero, so an untrained block passes ``r`` through, and ``out_norm``'s gain starts at 1. With the
target's final-norm gains instead, the untrained adapter would be the early exit itself; on Gemma-3-270M those
gains (up to 300) are tuned to the last layer, made the logits on the second layer's stream far too sharp, and
training from them swung widely, so the gain starts at 1 and trains with larger steps
(:func:`treespec.distill.kangaroo.train_adapter`). Training: ``python -m treespec.distill kangaroo``.

Unlike an EAGLE head, the adapter never reads its own outputs: a drafted token's ``r`` comes from
running the early layers on the token itself, so a node at depth ``k`` sees exactly the states the
target's first layers would give its path. The draft's quality does not decay with depth beyond the
product of acceptances, and the adapter trains teacher-forced, at depth 1 only.

Shared caches (:class:`KangarooRunner`): the early layers read the committed keys and values of the
target's own first ``L`` layers (:class:`~treespec.models.early_exit.SharedCacheRunner`: same weights,
tokens and positions, so the same numbers) and write only the tree's nodes; the adapter's committed
entries are built from the target's features at layer ``L - 1``, which the engine hands every
proposal (``feature_layers``), so neither part ever re-reads the prompt or the accepted tokens.
Kangaroo's stopping rule (stop a path once the draft's top-1 probability falls below a threshold)
is the drafters' confidence rule (``--min-confidence``, :class:`~treespec.drafting.stopping.ConfidenceStop`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..models.runner import CacheBook, DraftObservation, HoldsCacheBook
from ..tree import TokenTree
from .head import RMSNorm, rotary_qkv
from .head_runner import reserve_kv, subset_logits
from .subset_head import SubsetHead


@dataclass(frozen=True)
class AdapterConfig:
    hidden_size: int  # the target's hidden size H
    target_vocab_size: int
    exit_layers: int  # L: the target's first L decoder layers feed the adapter
    num_heads: int = 8
    head_dim: int = 64
    rope_theta: float = 10000.0
    rms_eps: float = 1e-6
    softcap: float | None = None  # the target's final logit soft-capping, if any

    def __post_init__(self) -> None:
        for name in ("hidden_size", "target_vocab_size", "exit_layers", "num_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

    @property
    def feature_layer(self) -> int:
        """The target layer (0-based, its output) whose residual stream the adapter reads: ``exit_layers - 1``."""
        return self.exit_layers - 1


class KangarooAdapter(SubsetHead):
    """The trained part of a Kangaroo draft (see the module docs); attached to its target, it drafts
    through :class:`KangarooRunner`."""

    FORMAT = "treespec-kangaroo-adapter"
    FILE_WHAT = "Kangaroo adapter"
    CONFIG = AdapterConfig

    def __init__(self, cfg: AdapterConfig, vocab_ids: torch.Tensor) -> None:
        super().__init__(cfg, vocab_ids)
        a = cfg.num_heads * cfg.head_dim
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.qkv = nn.Linear(cfg.hidden_size, 3 * a, bias=False)
        self.o = nn.Linear(a, cfg.hidden_size, bias=False)
        nn.init.zeros_(self.o.weight)  # the block starts as the identity
        self.out_norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.feature_layers = (cfg.feature_layer,)
        self._early = None  # the early-exit model without a final norm: not a submodule, never saved

    # ------------------------------------------------------------------ target coupling
    def _attach_inputs(self, model) -> None:
        from ..models.early_exit import early_exit_model
        from ..models.features import num_decoder_layers

        total = num_decoder_layers(model)
        if not 1 <= self.cfg.exit_layers < total:
            raise ValueError(f"{self.FILE_WHAT}: an exit after {self.cfg.exit_layers} layers needs a target of more "
                             f"than {self.cfg.exit_layers} decoder layers; this one has {total} (another target?)")
        early = early_exit_model(model, self.cfg.exit_layers)
        early.base_model.norm = nn.Identity()  # its "last hidden state" is the residual stream r (the target's
        object.__setattr__(self, "_early", early)  # own norm stays in place: only the draft's slot is replaced)

    @property
    def early_model(self):
        """The early-exit causal LM the adapter reads: the target's first layers (shared weights), no final norm,
        so its last hidden state is the residual stream ``r``."""
        if self._early is None:
            raise RuntimeError("attach the adapter to its target first")
        return self._early

    # ------------------------------------------------------------------ the attention block
    def qkv_heads(self, x: torch.Tensor, positions: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x`` ``[B, T, H]`` at ``positions`` ``[B, T]`` -> rotated q, k and v ``[B, heads, T, head_dim]``."""
        return rotary_qkv(self.qkv(self.attn_norm(x)), positions, self.cfg)

    def finish(self, x: torch.Tensor, att: torch.Tensor) -> torch.Tensor:
        """The feature the logits read ``[B, T, H]``, from the block's input ``x`` and the attention ``att``
        ``[B, heads, T, hd]``."""
        b, _, t, _ = att.shape
        return self.out_norm(x + self.o(att.transpose(1, 2).reshape(b, t, -1)))

    def forward(self, states: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None = None
                ) -> torch.Tensor:
        """Teacher-forced pass: residual streams ``r`` ``[B, T, H]`` at ``positions`` ``[B, T]`` -> features
        ``[B, T, H]`` (causal; ``mask`` ``[B, T]`` marks real entries, padding after them)."""
        q, k, v = self.qkv_heads(states, positions)
        t = states.shape[1]
        allowed = torch.ones(t, t, dtype=torch.bool, device=states.device).tril()  # [T, T]
        if mask is not None:
            allowed = allowed[None] & mask[:, None, :]  # [B, T, T]
            allowed = allowed | torch.eye(t, dtype=torch.bool, device=states.device)  # padding rows see themselves
            allowed = allowed[:, None]
        att = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
        return self.finish(states, att)

    # ------------------------------------------------------------------ drafting
    def as_runner(self) -> "KangarooRunner":
        return KangarooRunner(self)

    def depth_logits(self, target, ids: torch.Tensor, depths: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Target logits ``[L - 1, V]`` and the draft's logits at tree depths ``1..depths`` along ``ids`` ``[1, L]``,
        row ``i`` at position ``i + 1`` (predicting position ``i + 2``), as for the other heads. Along a path that
        follows the sequence the draft sees the same states at every depth, so every depth's logits are depth 1's,
        with the first ``k - 1`` rows NaN (no root before position 1)."""
        if depths < 1:
            raise ValueError("depths must be >= 1")
        from ..models.features import model_features

        with torch.no_grad():
            feats = model_features(target, ids, layers=self.feature_layers).float()[0]  # [L, 2H]
            t_logits = target(ids).logits[0, 1:].float()  # [L - 1, V]
            states = feats[None, :, : self.cfg.hidden_size]  # [1, L, H] the residual streams r
            positions = torch.arange(states.shape[1], device=ids.device)[None]
            out = self(states.to(self.attn_norm.weight.dtype), positions)[0, 1:]  # [L - 1, H] (position 0 attended)
            d = torch.full_like(t_logits, float("-inf"))
            d[:, self.vocab_ids] = self.logits(out)
        d_all = []
        for k in range(1, depths + 1):
            dk = d.clone()
            dk[: k - 1] = float("nan")
            d_all.append(dk)
        return t_logits, d_all


def new_adapter(target, vocab_ids: torch.Tensor, exit_layers: int, *, num_heads: int = 8, head_dim: int = 64,
                seed: int = 0) -> KangarooAdapter:
    """An untrained adapter for ``target`` (a HF causal LM) after its first ``exit_layers`` layers, over the subset
    ``vocab_ids``, attached: it drafts exactly as the early exit does on the subset until it is trained."""
    from .head import head_config_for

    shape = head_config_for(target)
    cfg = AdapterConfig(hidden_size=shape.hidden_size, target_vocab_size=shape.target_vocab_size,
                        exit_layers=exit_layers, num_heads=num_heads, head_dim=head_dim, rms_eps=shape.rms_eps,
                        softcap=shape.softcap)
    torch.manual_seed(seed)
    adapter = KangarooAdapter(cfg, torch.sort(torch.as_tensor(vocab_ids).long().unique()).values)
    with torch.no_grad():
        nn.init.normal_(adapter.qkv.weight, std=0.02)  # o stays zero: the block starts as the identity
        adapter.out_norm.weight.fill_(1.0)
    return adapter.to(next(target.parameters()).device).attach(target)


def final_norm_gain(target) -> torch.Tensor:
    """``[H]`` float32: the per-channel gain of ``target``'s final RMS norm (whatever its convention: a norm of a
    vector of RMS 1 is its gain)."""
    norm = target.base_model.norm
    eps = float(getattr(norm, "eps", getattr(norm, "variance_epsilon", 1e-6)))
    with torch.no_grad():
        ones = torch.ones(1, norm.weight.shape[0], device=norm.weight.device, dtype=norm.weight.dtype)
        return (norm(ones).float() * (1 + eps) ** 0.5)[0]


class KangarooRunner(HoldsCacheBook):
    """The draft runner over an attached :class:`KangarooAdapter` (``reset``, ``observe``, ``forward``,
    ``commit``), so every tree builder grows trees with it.

    Two caches move together: the early exit's (a :class:`~treespec.models.early_exit.SharedCacheRunner`,
    on the target's own first layers whenever the engine's target runner is a
    :class:`~treespec.models.runner.ModelRunner` of the same model) and the adapter's, one entry per
    position (``_kv`` ``[2, heads, capacity, head_dim]`` float32, bookkept by ``book``). Committed
    adapter entries come from the target's features (:meth:`observe`) or, for a chain the early exit
    runs itself (no shared cache), from its states; tree nodes are fed level by level and dropped at
    :meth:`commit`: the accepted ones return as target features at the next proposal.
    """

    def __init__(self, adapter: KangarooAdapter) -> None:
        if not adapter.attached:
            raise ValueError("attach the adapter to the target before drafting")
        self.adapter = adapter.eval()
        self.early = adapter.early_model.as_runner()
        self.model = None  # no causal LM behind this runner (the early exit is internal)
        self.device = adapter.attn_norm.weight.device
        self.vocab_size = adapter.cfg.target_vocab_size
        self.feature_layers = adapter.feature_layers  # the target layer the engine must hand over
        self.reset()

    def as_runner(self) -> "KangarooRunner":
        return self

    def reset(self) -> None:
        cfg = self.adapter.cfg
        self.early.reset()
        self._kv = torch.zeros(2, cfg.num_heads, 0, cfg.head_dim, device=self.device)  # [2, heads, capacity, hd]
        self.book = CacheBook()  # the adapter's entries: length committed positions, then tree slots

    @property
    def length(self) -> int:
        """Committed tokens both caches cover."""
        return min(self.book.length, self.early.length)

    def _append(self, states: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the keys and values of ``states`` ``[k, H]`` at ``positions`` ``[k]`` after the cached entries;
        returns the block's input ``[1, k, H]`` and its queries ``[1, heads, k, hd]``."""
        x = states.to(self.adapter.attn_norm.weight.dtype)[None]  # [1, k, H]
        q, k, v = self.adapter.qkv_heads(x, positions[None])
        used = self.book.length + len(self.book.slots)
        self._kv = reserve_kv(self._kv, used + states.shape[0])
        self._kv[0, :, used:used + states.shape[0]] = k[0].float()
        self._kv[1, :, used:used + states.shape[0]] = v[0].float()
        return x, q

    def observe(self, state: DraftObservation) -> None:
        """Let the early exit adopt the target's cache, and add the adapter's entries of the newly committed
        positions from the target's features at layer ``L - 1`` (``state.target_hidden``). Without features for
        every position the adapter lacks (an engine that hands none), the early exit keeps a cache of its own and
        both caches catch up from its states on the next chain."""
        if self.book.slots:
            raise RuntimeError("uncommitted tree nodes are in the adapter's cache: commit before the next proposal")
        hid = state.target_hidden
        have, committed = self.book.length, len(state.tokens) - 1
        rows = 0 if hid is None else hid.shape[0]
        if committed - rows > have:  # features missing for some position the adapter lacks: no sharing
            from .base import DraftState

            self.early.observe(DraftState(list(state.tokens), state.max_depth, None, None))
            return
        width = 2 * self.adapter.cfg.hidden_size
        if rows and hid.shape[-1] != width:  # checked before either cache moves
            raise ValueError(f"DraftState.target_hidden: the adapter reads target features of width {width} (layer "
                             f"{self.adapter.cfg.feature_layer} + the last hidden state), got {hid.shape[-1]}")
        self.early.observe(state)
        new = hid[have - (committed - rows):] if rows else None  # [k, 2H] the positions not held yet
        if new is not None and new.shape[0]:
            with torch.no_grad():
                self._append(new[:, : self.adapter.cfg.hidden_size].to(self.device).float(),
                             torch.arange(have, have + new.shape[0], device=self.device))
            self.book.length += new.shape[0]

    @torch.no_grad()
    def forward(self, tree: TokenTree | None, nodes: torch.Tensor | None, chain: torch.Tensor | None = None,
                *, need_logits: bool | str = True, need_hidden: bool = False) -> dict[str, torch.Tensor]:
        """Append ``chain`` (committed) then tree ``nodes``; ``logits`` ``[n, V]`` of the nodes (``[n, |S|]`` and
        ``vocab_ids`` with ``need_logits="subset"``), ``hidden`` ``[n, H]`` the adapter's features."""
        base = self.early.length  # where the chain starts
        m = 0 if chain is None else chain.numel()
        n = 0 if nodes is None else nodes.numel()
        book = self.book
        if m and book.slots:
            raise RuntimeError("a committed chain cannot follow uncommitted tree nodes")
        if not base <= book.length <= base + m:  # checked before either cache moves
            raise RuntimeError(f"the adapter holds {book.length} committed entries, the early exit {base} and "
                               f"{m} more in this chain: feed both the same committed tokens")
        early = self.early.forward(tree, nodes, chain, need_logits=False, need_hidden=True)["hidden"]  # [m + n, H]
        if m:  # the chain's positions the adapter does not hold yet (the target's features gave the others)
            skip = book.length - base
            if skip < m:
                self._append(early[skip:m].float(), torch.arange(base + skip, base + m, device=self.device))
                book.length = base + m
        result: dict[str, torch.Tensor] = {}
        if not n:
            return result
        used = book.length + len(book.slots)
        _, _, _, q_pos = book.inputs(tree, nodes, None, self.device)
        x, q = self._append(early[m:].float(), q_pos)  # [1, n, H], [1, heads, n, hd]
        total = used + n
        visible = book.visible_keys(nodes, 0, n, book.length, total, self.device)  # [n, total]
        att = F.scaled_dot_product_attention(q.float(), self._kv[0:1, :, :total], self._kv[1:2, :, :total],
                                             attn_mask=visible[None, None])  # [1, heads, n, hd]
        out = self.adapter.finish(x, att.to(x.dtype))[0]  # [n, H]
        book.finish(book.length, 0, nodes.tolist())
        result.update(subset_logits(self.adapter, out, need_logits, self.vocab_size))
        if need_hidden:
            result["hidden"] = out.float()
        return result

    def commit(self, nodes: list[int]) -> None:
        """Drop every tree entry of both caches (the target committed the accepted path; its features come
        back at the next proposal)."""
        self.early.commit([])
        self.book.committed(0)
