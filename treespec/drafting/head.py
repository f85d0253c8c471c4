"""An EAGLE-style draft head on the target's own features.

Architecture (after EAGLE, Li et al. arXiv 2401.15077, and EAGLE-2, arXiv 2406.16858; own code):
the head reads the target's last hidden state ``h_t`` (post final norm, what
``ModelRunner.forward(..., need_hidden=True)["hidden"]`` returns) and the target's own (frozen,
scaled) input embedding of the next token ``x_{t+1}``; both are RMS-normalised, concatenated and
projected by ``fc`` to the hidden size; ONE pre-norm decoder layer (rotary self-attention with its
own KV cache + SwiGLU MLP) and a final RMSNorm give a feature ``f_{t+1}`` trained to imitate
``h_{t+1}``. Logits are ``f @ W[S].T`` with ``W`` the target's own LM-head rows restricted to a
vocabulary subset ``S`` (the most frequent target tokens of the distillation corpus): the draft's
probability is exactly 0 outside ``S`` and rows are padded back to the target vocabulary, so
verification stays lossless. Deeper tree levels run the head on its own features.

Fused features (``HeadConfig.feature_layers``, after EAGLE-3, arXiv 2503.01840): the head may
also read the outputs of earlier target layers (e.g. a low and a middle one); the target's features
``[r_a, r_b, h_t]`` (:mod:`treespec.models.features`) are RMS-normalised slice by slice and
projected by ``fuse`` to ``H`` where ``h_t`` alone would enter. Deeper tree levels read the head's
own ``H``-wide feature as before, so only the first level and the committed entries see the fusion.
``fuse`` starts as the projection onto ``h_t``: a new fused head starts as the unfused one.

Only the trained weights (fc, norms, the layer) and ``S`` are saved; the embedding and the LM-head
rows are taken from the target when the head is attached (:meth:`EagleHead.attach`).

Sequence convention: the head's entry for token ``x_j`` (position ``j >= 1``) reads ``h_{j-1}``
and its output predicts ``x_{j+1}``. The head drafts through
:class:`~treespec.drafting.head_runner.HeadRunner`, so every tree builder of :mod:`treespec.trees`
grows its trees with it (e.g. ``ShapeDrafter(head, TreeShape.widths((2, 1)), "iid")``).
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from .head_runner import HeadRunner, head_depth_logits
from .subset_head import SubsetHead


@dataclass(frozen=True)
class HeadConfig:
    hidden_size: int  # the target's hidden size H
    target_vocab_size: int
    num_heads: int = 8
    head_dim: int = 64
    intermediate_size: int = 2048
    rope_theta: float = 10000.0
    rms_eps: float = 1e-6
    softcap: float | None = None  # the target's final logit soft-capping, if any
    feature_layers: tuple[int, ...] = ()  # target layers read besides the last hidden state (fused features)

    def __post_init__(self) -> None:
        from ..models.features import normalise_feature_layers

        # a weights file stores a JSON list
        object.__setattr__(self, "feature_layers", normalise_feature_layers(self.feature_layers))

    def record(self) -> dict:
        """The config as a weights file stores it (``feature_layers`` only when set: an unfused head's
        file stays what it was before the option existed)."""
        out = asdict(self)
        if out["feature_layers"]:
            out["feature_layers"] = list(out["feature_layers"])
        else:
            del out["feature_layers"]
        return out

    @property
    def feature_width(self) -> int:
        """Width of the target features the head reads: ``(len(feature_layers) + 1) * hidden_size``."""
        return (len(self.feature_layers) + 1) * self.hidden_size


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


@functools.lru_cache(maxsize=16)
def _inverse_frequencies(d: int, theta: float, device: torch.device) -> torch.Tensor:
    """``[D/2]`` float32 rotary frequencies (made once per size and device: a drafting step is short)."""
    with torch.inference_mode(False), torch.no_grad():  # a plain tensor, whichever mode asked first
        return 1.0 / (theta ** (torch.arange(0, d, 2, device=device, dtype=torch.float32) / d))


def _rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding (half-split convention) on ``x`` ``[..., T, D]`` with ``positions`` ``[..., T]``."""
    d = x.shape[-1]
    inv = _inverse_frequencies(d, theta, x.device)  # [D/2]
    ang = positions.float()[..., None] * inv  # [..., T, D/2]
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


def rotary_qkv(qkv: torch.Tensor, positions: torch.Tensor, cfg) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A fused q/k/v projection ``[B, T, 3 * heads * head_dim]`` at ``positions`` ``[B, T]`` -> q, k and v
    ``[B, heads, T, head_dim]``, rotary applied to q and k (``cfg``: ``num_heads``, ``head_dim``, ``rope_theta``)."""
    b, t, _ = qkv.shape
    q, k, v = qkv.view(b, t, 3, cfg.num_heads, cfg.head_dim).permute(2, 0, 3, 1, 4)
    pos = positions[:, None, :]  # [B, 1, T]
    return _rope(q, pos, cfg.rope_theta), _rope(k, pos, cfg.rope_theta), v


class HeadLayer(nn.Module):
    """Pre-norm decoder layer: rotary multi-head self-attention + SwiGLU MLP."""

    def __init__(self, cfg: HeadConfig) -> None:
        super().__init__()
        h, a = cfg.hidden_size, cfg.num_heads * cfg.head_dim
        self.cfg = cfg
        self.attn_norm = RMSNorm(h, cfg.rms_eps)
        self.qkv = nn.Linear(h, 3 * a, bias=False)
        self.o = nn.Linear(a, h, bias=False)
        self.mlp_norm = RMSNorm(h, cfg.rms_eps)
        self.gate_up = nn.Linear(h, 2 * cfg.intermediate_size, bias=False)
        self.down = nn.Linear(cfg.intermediate_size, h, bias=False)

    def qkv_heads(self, x: torch.Tensor, positions: torch.Tensor):
        """``x`` ``[B, T, H]`` -> q, k, v ``[B, nh, T, hd]`` (rotary applied to q and k)."""
        return rotary_qkv(self.qkv(self.attn_norm(x)), positions, self.cfg)

    def finish(self, x: torch.Tensor, att: torch.Tensor) -> torch.Tensor:
        b, _, t, _ = att.shape
        x = x + self.o(att.transpose(1, 2).reshape(b, t, -1))
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class LayerHead(SubsetHead):
    """What every one-layer head that drafts through :class:`~treespec.drafting.head_runner.HeadRunner`
    shares: the target coupling (input embedding, feature layers), the features it reads, the unrolled
    training / reference pass and its runner. Subclasses build the layer and say how inputs are formed:
    :meth:`target_input`, :meth:`inputs`, ``layer`` (``qkv_heads`` / ``finish``), ``out_norm`` and
    ``hidden_norm`` (a module on the head's device and dtype), and ``FEEDS_PRE_NORM``: whether a child
    reads its parent's output before the final norm (EAGLE-3's layout) or after it (the EAGLE head)."""

    FEEDS_PRE_NORM: ClassVar[bool] = False

    def __init__(self, cfg: HeadConfig, vocab_ids: torch.Tensor) -> None:
        super().__init__(cfg, vocab_ids)
        self.feature_layers = cfg.feature_layers
        self._embed: nn.Module | None = None  # the target's input embedding (frozen, not owned)

    # ------------------------------------------------------------------ target coupling
    def _attach_inputs(self, model) -> None:
        emb = model.get_input_embeddings()
        if emb.weight.shape[1] != self.cfg.hidden_size:
            raise ValueError(f"{self.FILE_WHAT}: built for another target (hidden size or vocabulary differ)")
        if self.cfg.feature_layers:
            from ..models.features import check_feature_layers, num_decoder_layers

            try:
                check_feature_layers(self.cfg.feature_layers, num_decoder_layers(model))
            except ValueError as err:
                raise ValueError(f"{self.FILE_WHAT} built for another target: {err}") from None
        object.__setattr__(self, "_embed", emb)  # not a submodule: never trained, never saved

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """The target's input embedding of ``tokens`` (as its module computes it), float32."""
        if self._embed is None:
            raise RuntimeError("attach the head to its target first")
        with torch.no_grad():
            return self._embed(tokens).float()

    def target_input(self, features: torch.Tensor) -> torch.Tensor:
        """The target's features ``[..., feature_width]`` -> what the head reads in place of a parent
        feature ``[..., H]``."""
        raise NotImplementedError

    def inputs(self, hidden: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """The layer's input from a hidden state ``[..., H]`` and the entries' tokens."""
        raise NotImplementedError

    def own_features(self, features: torch.Tensor) -> torch.Tensor:
        """The part of the target features ``[..., W]`` this head reads: all of them (``W`` =
        ``feature_width``), or, for a head without fused features beside a drafter that asked the
        engine for more layers, the last hidden state they end with."""
        width = features.shape[-1]
        if width == self.cfg.feature_width:
            return features
        if not self.cfg.feature_layers and width % self.cfg.hidden_size == 0:
            return features[..., -self.cfg.hidden_size:]
        raise ValueError(f"the head reads target features of width {self.cfg.feature_width} (layers "
                         f"{list(self.cfg.feature_layers)} + the last hidden state), got {width}")

    def last_hidden(self, features: torch.Tensor) -> torch.Tensor:
        """The target's last hidden state ``[..., H]`` inside its features ``[..., feature_width]``."""
        return features[..., -self.cfg.hidden_size:]

    # ------------------------------------------------------------------ training forward
    def forward(self, hidden: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Teacher-forced parallel pass (depth 1 of :meth:`unroll`): ``hidden`` ``[B, T, F]`` (the target's
        features at j - 1, ``F = cfg.feature_width``),
        ``tokens`` ``[B, T]`` (x_j), ``positions`` ``[B, T]``; right-padded rows allowed. Returns
        features ``[B, T, H]``."""
        return self.unroll(hidden, tokens, positions, 1)[0]

    def unroll(self, hidden: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, depths: int
               ) -> list[torch.Tensor]:
        """The head's features at tree depths ``1..depths`` along sequences, one parallel pass per depth.

        What :class:`~treespec.drafting.head_runner.HeadRunner` computes inside a tree whose path
        follows the sequence: the depth-``k`` entry at index ``j`` belongs to the tree rooted ``k - 1``
        tokens earlier; it reads its parent's output (depth ``k - 1`` at ``j - 1``; before the final
        norm where ``FEEDS_PRE_NORM``) instead of the target's features and attends to the depth-1
        (true-input) entries ``i <= j - k + 1`` plus its ancestors, the depth-``m`` entries at
        ``j - k + m`` (``m = 2..k``). Depth 1 is :meth:`forward`. Training on depths > 1 is the
        training-time test of EAGLE-3 (Li et al., "EAGLE-3: Scaling up Inference Acceleration of Large
        Language Models via Training-Time Test", arXiv 2503.01840): the head learns from the inputs it
        will see when drafting deep levels.

        Parameters
        ----------
        hidden : torch.Tensor
            ``[B, T, F]`` the target's features at ``j - 1`` of each entry (``F = cfg.feature_width``;
            the last hidden state ``h_{j-1}`` alone for a head without fused features).
        tokens, positions : torch.Tensor
            ``[B, T]`` the entries' tokens ``x_j`` and positions. Windows may be right-padded: an entry
            only sees entries before it, so padding at the end never reaches a real entry.
        depths : int
            Number of depths (>= 1).

        Returns
        -------
        list of torch.Tensor
            ``depths`` tensors ``[B, T, H]``, the features the logits read (after the final norm); at
            depth ``k`` the first ``k - 1`` entries of every row have no root inside the window (their
            values are meaningless; leave them out of any use).
        """
        if depths < 1:
            raise ValueError("depths must be >= 1")
        t, device = tokens.shape[1], tokens.device
        j = torch.arange(t, device=device)[:, None]  # query entry
        i = torch.arange(t, device=device)[None, :]  # key entry
        keys, values, outs, carried = [], [], [], None
        for k in range(1, depths + 1):
            if k == 1:
                inp = self.target_input(hidden)
            else:  # the parent's output: depth k - 1 at j - 1 (zeros where no parent exists)
                inp = torch.cat([torch.zeros_like(carried[:, :1]), carried[:, :-1]], dim=1)
            x = self.inputs(inp, tokens)  # [B, T, layer input]
            q, kk, v = self.layer.qkv_heads(x, positions)
            keys.append(kk)
            values.append(v)
            blocks = [i <= j - k + 1] + [i == j - k + m for m in range(2, k + 1)]
            mask = torch.cat(blocks, dim=1)  # [T, k * T]
            mask[:, 0] |= ~mask.any(dim=1)  # entries without a root attend somewhere (their output is unused)
            att = F.scaled_dot_product_attention(q, torch.cat(keys, dim=2), torch.cat(values, dim=2),
                                                 attn_mask=mask[None, None])
            pre = self.layer.finish(x, att)  # [B, T, H]
            outs.append(self.out_norm(pre))
            carried = pre if self.FEEDS_PRE_NORM else outs[-1]
        return outs

    # ------------------------------------------------------------------ drafting
    def as_runner(self) -> HeadRunner:
        """The head's draft runner (:class:`~treespec.drafting.head_runner.HeadRunner`, which reads the
        head through its :class:`~treespec.drafting.head_runner.DraftHead` interface)."""
        return HeadRunner(self)

    def depth_logits(self, target, ids: torch.Tensor, depths: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Per-depth logits along a sequence (:func:`~treespec.drafting.head_runner.head_depth_logits`)."""
        return head_depth_logits(self, target, ids, depths)


class EagleHead(LayerHead):
    """The trained part of the head plus (after :meth:`attach`) frozen references to the target."""

    FORMAT = "treespec-eagle-head"
    FILE_WHAT = "EAGLE head"
    CONFIG = HeadConfig

    def __init__(self, cfg: HeadConfig, vocab_ids: torch.Tensor) -> None:
        super().__init__(cfg, vocab_ids)
        h = cfg.hidden_size
        self.hidden_norm = RMSNorm(h, cfg.rms_eps)
        self.embed_norm = RMSNorm(h, cfg.rms_eps)
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.layer = HeadLayer(cfg)
        self.out_norm = RMSNorm(h, cfg.rms_eps)
        if cfg.feature_layers:  # fused features: per-slice norm gains and the projection to H
            slices = len(cfg.feature_layers) + 1
            self.fuse_norm = nn.Parameter(torch.ones(slices, h))
            rng = torch.random.get_rng_state()  # no draw from the global RNG: the other layers
            self.fuse = nn.Linear(slices * h, h, bias=False)  # initialise as in an unfused head
            torch.random.set_rng_state(rng)
            with torch.no_grad():  # start as the projection onto the last hidden state
                self.fuse.weight.zero_()[:, -h:].copy_(torch.eye(h, device=self.fuse.weight.device))

    def target_input(self, features: torch.Tensor) -> torch.Tensor:
        """The target's features ``[..., feature_width]`` -> what the head reads in place of a parent
        feature ``[..., H]``: the last hidden state itself, or the fusion of the slices."""
        features = self.own_features(features)
        if not self.cfg.feature_layers:
            return features
        x = features.float().unflatten(-1, (-1, self.cfg.hidden_size))  # [..., slices, H]
        x = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.cfg.rms_eps)).to(self.fuse_norm.dtype)
        return self.fuse((x * self.fuse_norm).flatten(-2))

    def inputs(self, hidden: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """fc(norm(h) ++ norm(emb(x))): ``[..., H]``."""
        dtype = self.hidden_norm.weight.dtype  # the head's dtype (its linear layers may be packed)
        e = self.embed(tokens).to(dtype)
        return self.fc(torch.cat([self.hidden_norm(hidden.to(dtype)), self.embed_norm(e)], dim=-1))


def head_config_for(target, *, num_heads: int = 8, head_dim: int | None = None,
                    intermediate_size: int | None = None, feature_layers: tuple[int, ...] = ()) -> HeadConfig:
    """The config of a new one-layer head for ``target`` (a HF causal LM): its hidden size, vocabulary, norm
    epsilon and final soft-capping; ``head_dim`` defaults to ``H // num_heads``, ``intermediate_size`` to
    about 3.2 H (a multiple of 64)."""
    text = target.config.get_text_config() if hasattr(target.config, "get_text_config") else target.config
    h = target.get_input_embeddings().weight.shape[1]
    return HeadConfig(hidden_size=h, target_vocab_size=target.get_output_embeddings().weight.shape[0],
                      num_heads=num_heads, head_dim=head_dim or max(h // num_heads, 4),
                      intermediate_size=intermediate_size or int(math.ceil(h * 3.2 / 64) * 64),
                      rms_eps=float(getattr(text, "rms_norm_eps", 1e-6) or 1e-6),
                      softcap=getattr(text, "final_logit_softcapping", None), feature_layers=feature_layers)


def new_head(target, vocab_ids: torch.Tensor, *, num_heads: int = 8, head_dim: int | None = None,
             intermediate_size: int | None = None, feature_layers: tuple[int, ...] = (), seed: int = 0
             ) -> EagleHead:
    """A freshly initialised head for ``target`` (a HF causal LM) over the subset ``vocab_ids``, reading
    the target's ``feature_layers`` besides its last hidden state (fused features)."""
    cfg = head_config_for(target, num_heads=num_heads, head_dim=head_dim, intermediate_size=intermediate_size,
                          feature_layers=tuple(feature_layers))
    torch.manual_seed(seed)
    head = EagleHead(cfg, torch.sort(torch.as_tensor(vocab_ids).long().unique()).values)
    with torch.no_grad():
        for name, mod in head.named_modules():
            if isinstance(mod, nn.Linear) and name != "fuse":  # fuse starts as the projection onto h
                nn.init.normal_(mod.weight, std=0.02)
        head.layer.o.weight.mul_(0.1)
        head.layer.down.weight.mul_(0.1)
    return head.to(next(target.parameters()).device).attach(target)
