"""A lean forward for Gemma-3 text models over a static KV cache: the same function as HF's.

:class:`FastGemmaRunner` is a :class:`~treespec.models.runner.ModelRunner` (same interface, same
cache bookkeeping: committed prefix, then the uncommitted tree nodes in ``slots``) whose forward is
written out layer by layer on the HF module's own parameters, instead of calling
``model.base_model``: no per-call mask/cache/output objects, one mask per layer type built once per
call, GQA folded into the query rows (one attention matmul per KV head), keys and values written
in place into a preallocated :class:`~.static_cache.StaticKVCache`.

Weights: the q/k/v projections are stacked into one ``[(heads + 2 kv_heads) * head_dim, H]`` weight and
gate/up into one ``[2 intermediate, H]`` weight (fewer, larger products per layer; the same values,
tested bit for bit in bf16). The stacked weights are copies in every dtype (+65M parameters for
Gemma-3-270M) made by :meth:`FastGemmaRunner.refresh`; they carry no gradient (the runner is for
inference). The other float32 weights are the module's parameters (no copy). In bf16 on a CPU
with oneDNN it keeps, by default (``prepack``), a oneDNN-blocked copy of every linear weight
(LM head included: +536 MB for Gemma-3-270M, made once in about 0.5 s): a plain bf16 ``F.linear``
reorders the whole weight on every call, which made the 262k-row LM head cost about 3x the time
to read it; the prepacked product gives the same bits (tested against the eager runner). With
``quantize="int4"`` every linear weight is replaced by a 4-bit copy (:mod:`~.quant`): another model,
tested against an eager model holding the de-quantised weights. With ``quantize="int8-head"`` the LM head
alone runs on 8-bit integers (:mod:`~.int8_head`), another model too, tested against its float64 formula.
After changing weights in place call :meth:`FastGemmaRunner.refresh`.

Every formula and dtype cast follows ``transformers.models.gemma3.modeling_gemma3`` (5.x):

* embedding x ``embed_scale`` cast to the weight dtype (sqrt(hidden), rounded in bf16 as HF does);
* RMSNorm in float32 ``x * rsqrt(mean(x^2) + eps) * (1 + w)``, cast back to the model dtype
  (input, post-attention, pre/post-feedforward, q/k norms and the final norm);
* RoPE with the layer type's own base (``rope_parameters[layer_type]``: 10k local, 1M global),
  cos/sin computed in float32 from ``position * inv_freq`` and cast to the model dtype;
* scaled-dot-product attention with ``query_pre_attn_scalar ** -0.5``, an additive mask per layer
  type (tree ancestry + committed prefix; sliding layers also hide keys ``window`` or more
  positions back, so decoding stays exact past the window);
* the MLP's own activation module (GELU-tanh), residual adds in the model dtype;
* LM head, float32 logits, final soft-capping if configured (as :meth:`ModelRunner.logits`).

The eager runner stays the reference: ``tests/treespec/test_fast_runner.py`` checks logits
(float32, 1e-5), caches after commits (equal to a fresh prefill) and greedy identity against it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from ...sampling import check_finite
from ...tree import TokenTree
from ..features import join_features
from ..runner import CacheBook, ModelRunner
from .allocator import keep_large_allocations
from .packed import pack_weight, packed_linear, prepack_default
from .int8_head import (CALIBRATION_TOKENS, OUTLIERS, calibration_ids, int8_head_logits, plan_int8_head,
                        quantize_int8_head)
from .quant import TARGET_QUANTIZE_MODES, int4_linear, quantize_int4
from .static_cache import StaticKVCache


def fast_supported(model) -> str | None:
    """None if :class:`FastGemmaRunner` computes exactly ``model``'s function, else the reason why not."""
    cfg = getattr(model, "config", None)
    if cfg is None or getattr(cfg, "model_type", None) not in ("gemma3_text",):
        return f"no fast path for model type {getattr(cfg, 'model_type', None)!r} (fast path: gemma3_text)"
    base = getattr(model, "model", None)
    if base is None or not hasattr(base, "layers") or not hasattr(model, "lm_head"):
        return "unexpected Gemma-3 module layout"
    if getattr(cfg, "attn_logit_softcapping", None) is not None:
        return "attention logit soft-capping is not covered"
    if getattr(cfg, "use_bidirectional_attention", False):
        return "bidirectional attention is not covered"
    if getattr(cfg, "attention_bias", False):
        return "attention biases are not covered"
    rope = getattr(cfg, "rope_parameters", None) or {}
    for kind in set(cfg.layer_types):
        params = rope.get(kind) if isinstance(rope, dict) else None
        if params is None or params.get("rope_type", "default") != "default":
            return f"rope type of {kind} layers is not 'default'"
    if set(cfg.layer_types) - {"full_attention", "sliding_attention"}:
        return "unknown attention layer types"
    return None


def _rms(x: torch.Tensor, w1: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma3RMSNorm: float32 normalisation times ``w1 = 1 + weight`` (float32), cast back.

    ``mean`` is spelled ``sum(...).div_(n)``, which is how ATen computes a CPU mean (the same bits,
    tested), without the per-call overhead of ``mean``; the in-place steps only skip allocations."""
    xf = x.float()
    inv = xf.pow(2).sum(-1, keepdim=True).div_(x.shape[-1]).add_(eps).rsqrt_()
    return (xf * inv).mul_(w1).to(x.dtype)


def _swap_halves(x: torch.Tensor) -> torch.Tensor:
    """``[x1, x2] -> [x2, x1]`` on the last dim: HF's ``rotate_half`` without its negation, which moves
    into the sine (``(-x2) * s`` and ``x2 * (-s)`` are the same number in every float format)."""
    half = x.shape[-1] // 2
    return torch.cat((x[..., half:], x[..., :half]), dim=-1)


class LayerWeights(NamedTuple):
    """One decoder layer as the runner reads it: linear weights in the form ``runner.linear`` takes
    (q/k/v projections stacked into one product, gate/up into another: one call each, the same
    values as separate products), RMSNorm gains as ``1 + w`` in float32."""

    sliding: bool
    norm_in: torch.Tensor  # [H]
    qkv: object  # [(heads + 2 kv_heads) * head_dim, H]
    norm_qk: torch.Tensor  # [heads + kv_heads, head_dim]: q_norm per query head, then k_norm per kv head
    o: object  # [H, heads * head_dim]
    norm_post_att: torch.Tensor
    norm_pre_mlp: torch.Tensor
    gate_up: object  # [2 intermediate, H]
    down: object  # [H, intermediate]
    act: torch.nn.Module
    norm_post_mlp: torch.Tensor
    intermediate: int


class FastGemmaRunner(ModelRunner):
    """Gemma-3 runner with a lean layer-by-layer forward over a static KV cache.

    Parameters
    ----------
    model : a ``Gemma3ForCausalLM`` (see :func:`fast_supported`), in eval mode.
    capacity : initial cache slots (the cache doubles when a sequence outgrows it).
    prepack : keep oneDNN-prepacked copies of the linear weights (default: bf16 on CPU, see the
        module docs); False reads the parameters themselves.
    quantize : ``"int4"``: every linear layer (LM head included) runs on a 4-bit copy of its weight
        (:mod:`~.quant`; CPU only): a different, smaller model, whose own plain decoding is the
        baseline that speculative decoding with this runner reproduces. ``"int8-head"``: the LM head alone on
        8-bit integers (:mod:`~.int8_head`; CPU only), another model as well. None: the weights as loaded.
    """

    def __init__(self, model: PreTrainedModel, capacity: int = 1024, prepack: bool | None = None,
                 quantize: str | None = None) -> None:
        reason = fast_supported(model)
        if reason is not None:
            raise ValueError(f"FastGemmaRunner: {reason}; use ModelRunner")
        if quantize is not None and quantize not in TARGET_QUANTIZE_MODES:
            raise ValueError(f"unknown quantisation {quantize!r}; expected one of {TARGET_QUANTIZE_MODES} or None")
        self._capacity = capacity
        self._prepack = prepack
        self.quantize = quantize
        self.kv: StaticKVCache | None = None
        super().__init__(model)  # calls reset()
        if self.device.type == "cpu":
            keep_large_allocations()  # logits of >= 32 nodes are > 32 MiB: no page faults on each pass
        self.refresh()

    # ------------------------------------------------------------------ parameters
    def refresh(self) -> None:
        """(Re)read the module's parameters: call after changing or replacing weights (the norms'
        ``1 + w`` vectors, the stacked q/k/v and gate/up copies and, with ``prepack`` or ``quantize``,
        the packed or 4-bit weights are derived here). With ``quantize="int8-head"`` it also runs the head's
        calibration pass, which clears the cache."""
        model, cfg = self.model, self.model.config
        base = model.model
        self.eps = cfg.rms_norm_eps
        self.num_heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.groups = self.num_heads // self.kv_heads
        self.scaling = cfg.query_pre_attn_scalar ** -0.5
        self.embed = base.embed_tokens.weight
        self.embed_scale = base.embed_tokens.embed_scale.to(self.embed.dtype)
        self.lm_head = model.lm_head.weight
        if self.quantize == "int4":
            if self.device.type != "cpu":
                raise ValueError(f"quantize='int4' runs on torch's int4 CPU kernel; the model is on {self.device}")
            self.prepacked = False
            lin, self.linear = (lambda w: quantize_int4(w, self.dtype)), int4_linear
        else:
            self.prepacked = self._prepack if self._prepack is not None else prepack_default(self.dtype, self.device)
            lin, self.linear = (pack_weight, packed_linear) if self.prepacked else ((lambda w: w), F.linear)
        # the head in the form self.linear takes, or on 8 bits (made at the end, after a calibration pass)
        self.lm_head_weight = None if self.quantize == "int8-head" else lin(self.lm_head)
        self.head8 = None

        def one_plus(norm) -> torch.Tensor:
            return 1.0 + norm.weight.float()

        def joined(*weights: torch.Tensor) -> torch.Tensor:
            return lin(torch.cat([w.detach() for w in weights]))  # [sum of out, in]

        heads, kvh = self.num_heads, self.kv_heads
        self.layers: list[LayerWeights] = []
        for i, layer in enumerate(base.layers[: cfg.num_hidden_layers]):
            att, mlp = layer.self_attn, layer.mlp
            self.layers.append(LayerWeights(
                sliding=cfg.layer_types[i] == "sliding_attention",
                norm_in=one_plus(layer.input_layernorm),
                qkv=joined(att.q_proj.weight, att.k_proj.weight, att.v_proj.weight),
                norm_qk=torch.cat([one_plus(att.q_norm).expand(heads, -1), one_plus(att.k_norm).expand(kvh, -1)]),
                o=lin(att.o_proj.weight),
                norm_post_att=one_plus(layer.post_attention_layernorm),
                norm_pre_mlp=one_plus(layer.pre_feedforward_layernorm),
                gate_up=joined(mlp.gate_proj.weight, mlp.up_proj.weight),
                down=lin(mlp.down_proj.weight),
                act=mlp.act_fn,
                norm_post_mlp=one_plus(layer.post_feedforward_layernorm),
                intermediate=mlp.gate_proj.weight.shape[0],
            ))
        self.final_norm = one_plus(base.norm)
        rot = base.rotary_emb
        self.inv_freq = {kind: getattr(rot, f"{kind}_inv_freq").to(device=self.device, dtype=torch.float)
                         for kind in ("full_attention", "sliding_attention") if hasattr(rot, f"{kind}_inv_freq")}
        self.rope_scaling = {kind: getattr(rot, f"{kind}_attention_scaling") for kind in self.inv_freq}
        if self.quantize == "int8-head":
            self.head8 = self._int8_head()

    def _int8_head(self):
        """The 8-bit LM head, its activation ranges from the final hidden states of seeded random ids."""
        if self.device.type != "cpu":
            raise ValueError(f"quantize='int8-head' runs on oneDNN's int8 CPU kernel; the model is on {self.device}")
        self.reset()
        n = min(CALIBRATION_TOKENS, self.max_positions or CALIBRATION_TOKENS)
        with torch.no_grad():  # not inference_mode: the cache may grow here, and later passes write into it
            ids = calibration_ids(self.lm_head.shape[0], n).to(self.device)
            hidden = self.forward(None, None, chain=ids, need_logits=False, need_hidden=True)["hidden"]  # [n, H]
        self.reset()
        outliers = min(OUTLIERS, self.lm_head.shape[1] // 4)  # a small test model keeps most columns on 8 bits
        return quantize_int8_head(self.lm_head, plan_int8_head(self.lm_head, hidden.float().abs().amax(0), outliers))

    # ------------------------------------------------------------------ state
    def reset(self) -> None:
        if self.kv is None:
            cfg = self.model.config
            self.kv = StaticKVCache(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, self.dtype,
                                    self.device, self._capacity, self.max_positions)
        self.kv.clear()  # the buffers stay allocated for the next request
        self.book = CacheBook()

    @property
    def cache(self):
        """The cache as a :class:`~treespec.models.kv_cache.TreeKVCache` of views (no copy)."""
        return self.kv.as_tree_cache()

    @property
    def key_positions(self) -> torch.Tensor:
        return self.kv.positions[: self.kv.used]

    @property
    def cache_length(self) -> int:
        return self.kv.used

    # ------------------------------------------------------------------ forward
    def _rope(self, q_pos: torch.Tensor) -> dict:
        out = {}
        pos = q_pos.float()[:, None]
        for kind, inv in self.inv_freq.items():
            freqs = pos * inv
            emb = torch.cat((freqs, freqs), dim=-1)
            scale = self.rope_scaling[kind]
            cos, sin = (emb.cos() * scale).to(self.dtype), (emb.sin() * scale).to(self.dtype)  # [Q, head_dim]
            half = sin.shape[-1] // 2
            sin_signed = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)  # pairs with _swap_halves
            out[kind == "sliding_attention"] = (cos[:, None], sin_signed[:, None])
        if False not in out:
            out[False] = out[True]
        if True not in out:
            out[True] = out[False]
        return out  # sliding? -> (cos, sin_signed) [Q, 1, head_dim]

    def _masks(self, visible: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor):
        """``visible`` ``[Q, K]`` -> {sliding?: additive mask ``[1, 1, groups * Q, K]``} (GQA-folded rows)."""
        minus = torch.finfo(self.dtype).min
        g = self.groups

        def additive(v: torch.Tensor) -> torch.Tensor:
            m = torch.zeros(v.shape, dtype=self.dtype, device=self.device).masked_fill_(~v, minus)
            return (m.repeat(g, 1) if g > 1 else m)[None, None]

        full = additive(visible)
        if self.window is None:
            return {False: full, True: full}
        band = visible & ((q_pos[:, None] - k_pos[None, :]) < self.window)
        sliding = additive(band)
        if self.layer_types is None:  # every layer slides
            return {False: sliding, True: sliding}
        return {False: full, True: sliding}

    def _forward_piece(self, tree: TokenTree | None, nodes: torch.Tensor | None, chain: torch.Tensor | None,
                       need_logits: bool, need_hidden: bool, layers: tuple[int, ...],
                       rows: torch.Tensor | None) -> dict[str, torch.Tensor]:
        """One model call of :meth:`ModelRunner.forward` (which cuts long chains into pieces)."""
        kv, book = self.kv, self.book
        base = book.length
        m, n, ids, q_pos = book.inputs(tree, nodes, chain, self.device)
        past = kv.used
        total = past + m + n
        kv.reserve(total)
        kv.positions[past:total] = q_pos
        k_pos = kv.positions[:total]
        masks = self._masks(book.visible_keys(nodes, m, n, base, total, self.device), q_pos, k_pos)
        outputs: dict[int, torch.Tensor] = {}
        hidden = self._body(ids, q_pos, masks, slice(past, total), total, layers, outputs)
        kv.used = total
        features = join_features(outputs, hidden, layers) if layers else None
        return self._finish(hidden, base, m, nodes, need_logits, need_hidden, features, rows)

    def _body(self, ids: torch.Tensor, q_pos: torch.Tensor, masks: dict, slots: slice | torch.Tensor, keys: int,
              layers: tuple[int, ...] = (), outputs: dict | None = None) -> torch.Tensor:
        """Embedding, decoder layers and final norm for ``ids`` at ``q_pos``: writes their keys and values into
        the cache ``slots`` (a slice, or ``[Q]`` slot indices: the fixed-shape pass of :mod:`.graphs`), attends
        over the first ``keys`` slots under ``masks`` (``[1, 1, groups * Q, keys]``), and puts the outputs of the
        decoder ``layers`` into ``outputs`` (layer index -> ``[Q, H]``)."""
        q = ids.numel()
        heads, kvh, dim, g, eps = self.num_heads, self.kv_heads, self.head_dim, self.groups, self.eps
        qk_width = (heads + kvh) * dim
        rope = self._rope(q_pos)
        linear = self.linear
        K, V = self.kv.k, self.kv.v
        h = F.embedding(ids, self.embed) * self.embed_scale  # [Q, H]
        for i, w in enumerate(self.layers):
            x = _rms(h, w.norm_in, eps)
            qkv = linear(x, w.qkv)  # [Q, (heads + 2 kv_heads) * dim]
            # q and k heads side by side: one norm (each head row its own q / k gains), one rotation
            qk = _rms(qkv[:, :qk_width].view(q, heads + kvh, dim), w.norm_qk, eps)
            cos, sin_signed = rope[w.sliding]
            qk = qk * cos + _swap_halves(qk) * sin_signed
            K[i, :, slots] = qk[:, heads:].transpose(0, 1)
            V[i, :, slots] = qkv[:, qk_width:].view(q, kvh, dim).transpose(0, 1)
            # GQA folded: query row j * Q + t is head (kv * groups + j) of token t
            qf = qk[:, :heads].reshape(q, kvh, g, dim).permute(1, 2, 0, 3).reshape(1, kvh, g * q, dim)
            att = F.scaled_dot_product_attention(qf, K[i, :, :keys][None], V[i, :, :keys][None],
                                                 attn_mask=masks[w.sliding], scale=self.scaling)
            att = att.view(kvh, g, q, dim).permute(2, 0, 1, 3).reshape(q, heads * dim)
            h = h + _rms(linear(att, w.o), w.norm_post_att, eps)
            x = _rms(h, w.norm_pre_mlp, eps)
            gate_up = linear(x, w.gate_up)  # [Q, 2 intermediate]
            x = linear(w.act(gate_up[:, : w.intermediate]) * gate_up[:, w.intermediate:], w.down)
            h = h + _rms(x, w.norm_post_mlp, eps)
            if i in layers:
                outputs[i] = h
        return _rms(h, self.final_norm, eps)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """LM head, float32, final soft-capping in place (the same values as :meth:`ModelRunner.logits`)."""
        if self.head8 is not None:
            raw = int8_head_logits(hidden, self.head8)  # float32 already
        else:
            raw = self.linear(hidden, self.lm_head_weight)
        if not self.softcap:  # the check reads the raw logits (model dtype, or float32 from the 8-bit head)
            check_finite(raw, type(self.model).__name__)
        logits = raw.float()
        if self.softcap:
            logits.div_(self.softcap).tanh_().mul_(self.softcap)
            check_finite(logits, type(self.model).__name__)
        return logits

    # ------------------------------------------------------------------ cache commit
    def commit(self, nodes: list[int]) -> None:
        """Same contract as :meth:`ModelRunner.commit`."""
        length = self.book.length
        kept = self.book.kept_entries(nodes)
        if kept == list(range(length, length + len(kept))):  # already in place: truncate
            self.kv.used = length + len(kept)
        else:
            self.kv.keep(length, torch.tensor(kept, dtype=torch.long, device=self.device))
        self.book.committed(len(kept))
