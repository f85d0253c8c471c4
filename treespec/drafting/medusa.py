"""Medusa-style decoding heads on the target's last hidden state, and their draft runner.

Architecture (after Medusa, Cai et al. arXiv 2401.10774; own code): head ``k`` (``k = 1..K``) maps
the target's last hidden state ``h_j`` (post final norm) through ``num_layers`` residual blocks
``z <- z + SiLU(W z + b)`` (``W`` initialised to zero, so an untrained head repeats the target's
own next-token guess) and scores the result with the target's own LM-head rows restricted to a
vocabulary subset ``S``: ``logits_k = z_k @ W_lm[S].T``. Head ``k`` predicts the token ``k + 1``
places after ``h_j``'s position, i.e. ``x_{j+1+k}``. Tokens outside ``S`` have probability 0 and
rows are padded back to the target vocabulary, so verification stays lossless.

In the engine the newest committed token (the tree root, position ``r``) has not been seen by the
target yet; the last row of :attr:`DraftState.target_hidden` is ``h_{r-1}``. Head ``k`` applied to
it proposes the tokens of tree depth ``k``. Every node at depth ``d`` therefore has the same draft
distribution (head ``d + 1``), whatever its ancestors: the heads are independent of the drafted
path, which is what makes them cheap (one call per step, no draft KV cache) and what limits their
acceptance deeper in the tree.

:class:`MedusaRunner` gives the heads the runner interface of :mod:`treespec.trees`, so any tree
builder drafts with them: :class:`~treespec.trees.grow.ShapeDrafter` with law ``"deterministic"``
grows the classic Medusa tree (the top-``c`` candidates of each head along given index paths;
:meth:`~treespec.trees.shape.TreeShape.from_paths`), Sequoia picks the shape from measured
per-depth acceptance, and sampled laws (``"iid"``, ``"without_replacement"``) draw from the heads'
distributions with the exact ``q`` recorded. Only the trained blocks and ``S`` are saved; the LM-head
rows come from the target at :meth:`MedusaHeads.attach`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..models.runner import DraftObservation
from ..tree import TokenTree
from .subset_head import SubsetHead


@dataclass(frozen=True)
class MedusaConfig:
    """Shape of a set of Medusa heads (validated on construction)."""

    hidden_size: int  # the target's hidden size H
    target_vocab_size: int
    num_heads: int = 3  # K: tokens predicted beyond the next one
    num_layers: int = 1  # residual blocks per head
    softcap: float | None = None  # the target's final logit soft-capping, if any

    def __post_init__(self) -> None:
        for name in ("hidden_size", "target_vocab_size", "num_heads", "num_layers"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"MedusaConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.softcap is not None and not self.softcap > 0:
            raise ValueError(f"MedusaConfig.softcap must be > 0 or None, got {self.softcap}")


class ResBlock(nn.Module):
    """``z + SiLU(W z + b)`` with ``W``, ``b`` initialised to zero (the block starts as the identity)."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(size, size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return z + nn.functional.silu(self.linear(z))


class MedusaHeads(SubsetHead):
    """``K`` decoding heads; after :meth:`attach`, ``forward(h)`` scores every head on the subset."""

    FORMAT = "treespec-medusa-heads"
    FILE_WHAT = "Medusa heads file"
    CONFIG = MedusaConfig

    def __init__(self, cfg: MedusaConfig, vocab_ids: torch.Tensor) -> None:
        super().__init__(cfg, vocab_ids)
        self.heads = nn.ModuleList(nn.Sequential(*[ResBlock(cfg.hidden_size) for _ in range(cfg.num_layers)])
                                   for _ in range(cfg.num_heads))

    def features(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[..., H]`` -> ``[..., K, H]``: every head's residual stack applied to the hidden state."""
        x = hidden.to(self.heads[0][0].linear.weight.dtype)
        return torch.stack([head(x) for head in self.heads], dim=-2)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[..., H]`` -> subset logits of every head ``[..., K, |S|]``."""
        return self.logits(self.features(hidden))

    def full_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[N, H]`` -> logits on the target vocabulary ``[N, K, V]`` (-inf outside the subset)."""
        sub = self(hidden)  # [N, K, |S|]
        out = sub.new_full((*sub.shape[:-1], self.cfg.target_vocab_size), float("-inf"))
        out[..., self.vocab_ids] = sub
        return out

    def as_runner(self) -> "MedusaRunner":
        """The heads' draft runner (any tree builder drafts through it)."""
        return MedusaRunner(self)

    def depth_logits(self, target, ids: torch.Tensor, depths: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Per-depth logits along a sequence (:func:`medusa_depth_logits`, calibration)."""
        return medusa_depth_logits(self, target, ids, depths)


def new_medusa_heads(target, vocab_ids: torch.Tensor, *, num_heads: int = 3, num_layers: int = 1) -> MedusaHeads:
    """Fresh (identity-initialised) heads for ``target`` (a HF causal LM) over the subset ``vocab_ids``."""
    text = target.config.get_text_config() if hasattr(target.config, "get_text_config") else target.config
    cfg = MedusaConfig(hidden_size=target.get_output_embeddings().weight.shape[1],
                       target_vocab_size=target.get_output_embeddings().weight.shape[0],
                       num_heads=num_heads, num_layers=num_layers,
                       softcap=getattr(text, "final_logit_softcapping", None))
    heads = MedusaHeads(cfg, torch.sort(torch.as_tensor(vocab_ids).long().unique()).values)
    return heads.attach(target)


class MedusaRunner:
    """Runner interface (``reset``, ``observe``, ``forward``, ``commit``, ``length``) over attached heads.

    At the start of every proposal (:meth:`observe`) all ``K`` heads run once on the hidden state
    before the root; ``forward`` then only gathers, for each node at depth ``d``, the logits of head
    ``d + 1`` (no draft KV cache: the heads never see drafted tokens). A node deeper than ``K - 1``
    has no head to predict its children: asking for its logits is an error (cap the tree depth at
    ``K``).
    """

    def __init__(self, heads: MedusaHeads) -> None:
        if not heads.attached:
            raise ValueError("attach the Medusa heads to the target before drafting")
        self.heads = heads.eval()
        self.model = None  # no causal LM behind this runner
        self.device = heads.lm_rows.device
        self.vocab_size = heads.cfg.target_vocab_size
        self.reset()

    def as_runner(self) -> "MedusaRunner":
        return self

    def reset(self) -> None:
        self.length = 0  # committed tokens the runner has accounted for (all but the pending root)
        self.depth_logits: torch.Tensor | None = None  # [K, |S|] subset logits of depth 1..K for this proposal

    @torch.no_grad()
    def observe(self, state: DraftObservation) -> None:
        """Run every head on the target's hidden state just before the root (start of a proposal)."""
        hid = state.target_hidden
        if hid is None or hid.shape[0] == 0:
            if len(state.tokens) == 1:  # a one-token prompt: no hidden state precedes the root
                hid = torch.zeros(1, self.heads.cfg.hidden_size, device=self.device)
            else:
                raise ValueError("Medusa heads draft from the target's hidden states: "
                                 "DraftState.target_hidden is None")
        h = hid[-1:, -self.heads.cfg.hidden_size:]  # the last hidden state (fused features end with it)
        self.depth_logits = self.heads(h.to(self.device))[0]  # [K, |S|] on the heads' subset
        self.length = len(state.tokens) - 1

    def forward(self, tree: TokenTree | None, nodes: torch.Tensor | None, chain: torch.Tensor | None = None,
                *, need_logits: bool | str = True, need_hidden: bool = False) -> dict[str, torch.Tensor]:
        """Logits ``[n, V]`` of tree ``nodes``: row ``i`` is head ``depth(node_i) + 1``'s logits
        (``need_logits="subset"``: ``[n, |S|]`` on the heads' subset, with ``vocab_ids``)."""
        if need_hidden:
            raise ValueError("Medusa heads have no per-node hidden state to return")
        if chain is not None and chain.numel():
            raise RuntimeError("call observe() before forwarding: the runner is behind the committed sequence")
        if nodes is None or nodes.numel() == 0 or not need_logits:
            return {}
        if self.depth_logits is None:
            raise RuntimeError("call observe() at the start of the proposal")
        depth = tree.depths[nodes.to(tree.depths.device)].to(self.device)  # [n]
        k = self.depth_logits.shape[0]
        if bool((depth >= k).any()):
            raise ValueError(f"these Medusa heads predict {k} tokens past the root: a tree deeper than {k} "
                             "cannot be drafted with them (cap its depth)")
        rows = self.depth_logits[depth]  # [n, |S|]
        if need_logits == "subset":
            return {"logits": rows, "vocab_ids": self.heads.vocab_ids}
        full = rows.new_full((rows.shape[0], self.vocab_size), float("-inf"))
        full[:, self.heads.vocab_ids] = rows
        return {"logits": full}

    def commit(self, nodes: list[int]) -> None:
        """Nothing to keep: the heads hold no cache (the next :meth:`observe` catches up)."""
        self.depth_logits = None


def medusa_depth_logits(heads: MedusaHeads, target, ids: torch.Tensor, depths: int
                        ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Target logits and the heads' logits at tree depths ``1..depths`` along one sequence (measurement).

    Same row convention as :func:`~treespec.drafting.head_runner.head_depth_logits`: row ``i``
    predicts position ``i + 2``; the depth-``k`` node predicting position ``j`` hangs below a root at
    ``j - k`` and is drafted by head ``k`` from ``h_{j-k-1}``. The first ``k - 1`` rows of depth ``k``
    are undefined (NaN).
    """
    if not 1 <= depths <= heads.cfg.num_heads:
        raise ValueError(f"depths must be in 1..{heads.cfg.num_heads} (one per head)")
    with torch.no_grad():
        hidden = target.base_model(input_ids=ids).last_hidden_state.float()[0]  # [L, H]
        t_logits = target(ids).logits[0, 1:].float()  # [L - 1, V]
        every = heads.full_logits(hidden[:-1])  # [L - 1, K, V]: row i from h_i
        d_all = []
        for k in range(1, depths + 1):
            d = torch.full_like(t_logits, float("nan"))
            d[k - 1:] = every[: every.shape[0] - (k - 1), k - 1]  # row i <- h_{i + 1 - k}
            d_all.append(d)
    return t_logits, d_all
