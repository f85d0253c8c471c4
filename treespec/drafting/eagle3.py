"""A draft head in EAGLE-3's layout: the one vLLM, SGLang and vllm-project's ``speculators`` load.

Architecture (Li et al., "EAGLE-3: Scaling up Inference Acceleration of Large Language Models via
Training-Time Test", arXiv 2503.01840; own code, parameter names as the serving engines read them):

* ``fc`` projects the target's residual stream at three (or more) layers, concatenated, to the hidden
  size: ``g = fc([r_a, r_b, r_c])`` ``[..., H]``. EAGLE-3 names a layer by the index of the decoder
  layer whose *input* it is (``eagle_aux_hidden_state_layer_ids``, default ``[2, L // 2, L - 3]``);
  treespec's feature layers (:mod:`treespec.models.features`) name the layer whose *output* it is, so
  id ``i`` is treespec's feature layer ``i - 1``.
* one Llama-style decoder layer whose attention reads ``2H`` wide:
  ``z = [input_layernorm(e), hidden_norm(g)]`` with ``e`` the target's (unscaled) input embedding of
  the entry's token; q, k, v = projections of ``z`` with rotary positions; the residual is ``g``
  itself; then ``post_attention_layernorm`` and a SwiGLU MLP. Its output ``o`` (before any norm) is
  what a child reads in place of ``g`` (``FEEDS_PRE_NORM``).
* ``norm`` and the LM head on a reduced vocabulary: logits ``= norm(o) @ W[S].T``, ``W`` the target's
  own LM-head rows on the head's subset ``S`` (frozen, as ``speculators`` 0.9.0 keeps them in training).
  The engines store ``S`` as ``d2t`` (``S[i] - i``) and ``t2d`` (a mask over the target vocabulary).

The head drafts through :class:`~treespec.drafting.head_runner.HeadRunner` like the EAGLE head
(:mod:`.head`) and trains with the same distillation loop (``python -m treespec.distill train
--layout eagle3``). :mod:`.eagle3_export` writes it in the ``speculators`` layout and reads such a
checkpoint back.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .head import HeadConfig, LayerHead, RMSNorm, _rope, head_config_for


def aux_layer_ids(feature_layers: tuple[int, ...]) -> list[int]:
    """EAGLE-3's ``eagle_aux_hidden_state_layer_ids`` (each the input of a layer) of treespec feature layers
    (each the output of a layer)."""
    return [int(i) + 1 for i in feature_layers]


def default_feature_layers(num_layers: int) -> tuple[int, ...]:
    """The engines' default layers ``[2, L // 2, L - 3]`` as treespec feature layers ((1, 8, 14) for 18 layers)."""
    ids = sorted({2, num_layers // 2, num_layers - 3})
    if num_layers < 5 or len(ids) < 3:
        raise ValueError(f"a target with {num_layers} decoder layers has no EAGLE-3 default layers; name them")
    return tuple(i - 1 for i in ids)


class Eagle3Attention(nn.Module):
    """Multi-head attention reading ``[embedding, hidden]`` ``2H`` wide (q, k, v), writing ``H``."""

    def __init__(self, cfg: HeadConfig) -> None:
        super().__init__()
        a = cfg.num_heads * cfg.head_dim
        self.q_proj = nn.Linear(2 * cfg.hidden_size, a, bias=False)
        self.k_proj = nn.Linear(2 * cfg.hidden_size, a, bias=False)
        self.v_proj = nn.Linear(2 * cfg.hidden_size, a, bias=False)
        self.o_proj = nn.Linear(a, cfg.hidden_size, bias=False)


class Eagle3MLP(nn.Module):
    def __init__(self, cfg: HeadConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Eagle3Layer(nn.Module):
    """EAGLE-3's decoder layer, in the two halves :class:`~treespec.drafting.head_runner.HeadRunner` calls."""

    def __init__(self, cfg: HeadConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.self_attn = Eagle3Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.mlp = Eagle3MLP(cfg)

    def qkv_heads(self, x: torch.Tensor, positions: torch.Tensor):
        """``x`` ``[B, T, 2H]`` (embedding, hidden) -> q, k, v ``[B, heads, T, head_dim]`` (rotary on q and k)."""
        b, t, _ = x.shape
        e, g = x.split(self.cfg.hidden_size, dim=-1)
        z = torch.cat([self.input_layernorm(e), self.hidden_norm(g)], dim=-1)  # [B, T, 2H]
        att = self.self_attn
        heads = (b, t, self.cfg.num_heads, self.cfg.head_dim)
        q, k, v = (p(z).view(heads).transpose(1, 2) for p in (att.q_proj, att.k_proj, att.v_proj))
        pos = positions[:, None, :]  # [B, 1, T]
        return _rope(q, pos, self.cfg.rope_theta), _rope(k, pos, self.cfg.rope_theta), v

    def finish(self, x: torch.Tensor, att: torch.Tensor) -> torch.Tensor:
        """The layer's output ``[B, T, H]`` (before the head's final norm) from its input ``x`` ``[B, T, 2H]``
        and the attention ``att`` ``[B, heads, T, head_dim]``; the residual is the hidden half of ``x``."""
        b, _, t, _ = att.shape
        h = x[..., self.cfg.hidden_size:] + self.self_attn.o_proj(att.transpose(1, 2).reshape(b, t, -1))
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Head(LayerHead):
    """A head in EAGLE-3's layout (module docstring); ``cfg.feature_layers`` are the fused target layers
    (treespec's numbering), and the target's last hidden state, which every feature row ends with, is
    not read."""

    FORMAT = "treespec-eagle3-head"
    FILE_WHAT = "EAGLE-3 head"
    CONFIG = HeadConfig
    FEEDS_PRE_NORM = True

    def __init__(self, cfg: HeadConfig, vocab_ids: torch.Tensor) -> None:
        if not cfg.feature_layers:
            raise ValueError("an EAGLE-3 head reads at least one target layer (feature_layers is empty)")
        if cfg.softcap:
            raise ValueError("EAGLE-3's layout has no logit soft-capping (softcap is set)")
        super().__init__(cfg, vocab_ids)
        self.fc = nn.Linear(len(cfg.feature_layers) * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.layers = nn.ModuleList([Eagle3Layer(cfg)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)

    @property
    def layer(self) -> Eagle3Layer:
        return self.layers[0]

    @property
    def hidden_norm(self) -> RMSNorm:
        return self.layers[0].hidden_norm

    @property
    def out_norm(self) -> RMSNorm:
        return self.norm

    @property
    def aux_layer_ids(self) -> list[int]:
        return aux_layer_ids(self.cfg.feature_layers)

    @property
    def embedding_table(self) -> torch.Tensor:
        """``[V, H]`` the target's input embedding table (frozen, not owned)."""
        if self._embed is None:
            raise RuntimeError("attach the head to its target first")
        return self._embed.weight

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """The rows of the target's input embedding table (no model-specific scale: the engines read the
        table itself, and ``input_layernorm`` makes a constant scale irrelevant but for its epsilon)."""
        with torch.no_grad():
            return self.embedding_table[tokens].float()

    def target_input(self, features: torch.Tensor) -> torch.Tensor:
        """``fc`` of the fused layers' slices of the target's features ``[..., feature_width]`` -> ``[..., H]``."""
        features = self.own_features(features)
        fused = features[..., : len(self.cfg.feature_layers) * self.cfg.hidden_size]
        return self.fc(fused.to(self.norm.weight.dtype))  # the head's dtype (its linear layers may be packed)

    def inputs(self, hidden: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """``[e, g]`` ``[..., 2H]``: the tokens' embedding beside the hidden input (the layer normalises each)."""
        dtype = self.norm.weight.dtype  # the head's dtype (its linear layers may be packed)
        return torch.cat([self.embed(tokens).to(dtype), hidden.to(dtype)], dim=-1)


def new_eagle3_head(target, vocab_ids: torch.Tensor, *, feature_layers: tuple[int, ...] | None = None,
                    num_heads: int = 8, head_dim: int | None = None, intermediate_size: int | None = None,
                    seed: int = 0) -> Eagle3Head:
    """A freshly initialised EAGLE-3 head for ``target`` (a HF causal LM) over the subset ``vocab_ids``,
    reading ``feature_layers`` (treespec's numbering; default the engines' ``[2, L // 2, L - 3]``)."""
    from ..models.features import num_decoder_layers

    layers = default_feature_layers(num_decoder_layers(target)) if feature_layers is None else tuple(feature_layers)
    cfg = head_config_for(target, num_heads=num_heads, head_dim=head_dim, intermediate_size=intermediate_size,
                          feature_layers=layers)
    if cfg.softcap:
        raise ValueError("EAGLE-3's layout has no logit soft-capping, which this target applies")
    torch.manual_seed(seed)
    head = Eagle3Head(cfg, torch.sort(torch.as_tensor(vocab_ids).long().unique()).values)
    with torch.no_grad():
        for mod in head.modules():
            if isinstance(mod, nn.Linear):
                nn.init.normal_(mod.weight, std=0.02)
        head.layer.self_attn.o_proj.weight.mul_(0.1)
        head.layer.mlp.down_proj.weight.mul_(0.1)
    return head.to(next(target.parameters()).device).attach(target)
