"""Weight-only 4-bit linear layers (CPU): the quantised target of ``--quantize int4``.

Every ``[out, in]`` weight is cut into groups of ``group`` consecutive input columns; a group stores
4-bit codes ``c`` in 0..15 and a scale ``s`` and offset ``z`` per output row, and stands for

    W[n, k] = (c[n, k] - 8) * s[k // group, n] + z[k // group, n]

with ``s = (max - min) / 15`` and ``z = min + 8 s`` over the group (asymmetric min/max rounding to
the nearest code). The product runs in torch's packed int4 CPU kernel
(``torch._weight_int4pack_mm_for_cpu``), which reads a quarter of the bf16 bytes.

Why 4 bits here: the embedded Gemma-3-270M is de-quantised from a Q4_K_M GGUF, whose 4-bit
tensors already hold, in every group of 32 input columns, values on a 16-level affine grid
``a * c + b``; min/max codes over the same groups give that grid back (exactly, when a group uses
its lowest and highest levels, up to the bf16 rounding of ``s`` and ``z``), so most of the model
is the GGUF's own numbers at about the GGUF's size. Tensors the GGUF stores with more bits (Q6_K /
Q8_0, e.g. the embedding / LM head) lose precision: a quantised target is its own model, and
speculative decoding is lossless with respect to it (its own plain decoding is the baseline).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

#: the quantisation modes of a draft head and of a target (``None``: the weights as loaded)
QUANTIZE_MODES = ("int4",)
#: a target's modes: those, and an 8-bit LM head alone (:mod:`.int8_head`)
TARGET_QUANTIZE_MODES = (*QUANTIZE_MODES, "int8-head")
#: input columns per (scale, offset) pair; the kernel also wants ``out`` divisible by 16
GROUP = 32


@dataclass(frozen=True)
class Int4Weight:
    """A ``[out, in]`` weight in the packed int4 layout of :func:`int4_linear`."""

    packed: torch.Tensor  # [out, in / 2] uint8, kernel layout
    scales_zeros: torch.Tensor  # [in / group, out, 2] (scale, offset) in the activation dtype
    out_features: int
    in_features: int
    group: int

    @property
    def nbytes(self) -> int:
        return self.packed.numel() * self.packed.element_size() + \
            self.scales_zeros.numel() * self.scales_zeros.element_size()


def quantize_codes(w: torch.Tensor, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """``[out, in]`` weight -> (codes ``[out, in]`` int32 in 0..15, scales_zeros ``[in / group, out, 2]``
    float32): the min/max 4-bit grid of each group (see the module docs)."""
    out, inp = w.shape
    groups = w.detach().float().reshape(out, inp // group, group)  # [out, G, group]
    lo, hi = groups.amin(-1), groups.amax(-1)  # [out, G]
    scale = (hi - lo) / 15
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.round((groups - lo[..., None]) / safe[..., None]).clamp_(0, 15).to(torch.int32)
    zero = lo + 8 * scale
    return codes.reshape(out, inp), torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous()


def dequantize(codes: torch.Tensor, scales_zeros: torch.Tensor, group: int = GROUP) -> torch.Tensor:
    """The float32 ``[out, in]`` weight that codes and (scale, offset) pairs stand for (the reference
    :func:`int4_linear` is tested against)."""
    out, inp = codes.shape
    sz = scales_zeros.float().transpose(0, 1)  # [out, G, 2]
    grouped = (codes.reshape(out, inp // group, group).float() - 8) * sz[..., :1] + sz[..., 1:]
    return grouped.reshape(out, inp)


def check_int4_shape(out: int, inp: int, group: int = GROUP) -> str | None:
    """None if the int4 kernel takes a ``[out, in]`` weight, else why not."""
    if inp % group:
        return f"input size {inp} is not a multiple of the group size {group}"
    if out % 16:
        return f"output size {out} is not a multiple of 16"
    return None


#: torch's private int4 CPU ops that :func:`quantize_int4` and :func:`int4_linear` call
INT4_OPS = ("_convert_weight_to_int4pack_for_cpu", "_weight_int4pack_mm_for_cpu")


def int4_kernel_missing() -> str | None:
    """None where this torch has the int4 CPU kernel (:data:`INT4_OPS`), else why not, in words. The ops are
    private and may move between torch releases; treespec's torch range is wider than one release."""
    missing = [op for op in INT4_OPS if not hasattr(torch.ops.aten, op)]
    if missing:
        return f"torch {torch.__version__} has no {', '.join(missing)} (the int4 CPU kernel)"
    return None


def quantize_int4(w: torch.Tensor, dtype: torch.dtype | None = None, group: int = GROUP) -> Int4Weight:
    """Quantise a ``[out, in]`` weight for :func:`int4_linear` (activations in ``dtype``, default the
    weight's). Raises ValueError for shapes the kernel does not take, or where this torch lacks it."""
    missing = int4_kernel_missing()
    if missing:
        raise ValueError(f"cannot quantise to int4: {missing}")
    if w.device.type != "cpu":
        raise ValueError(f"int4 weights use torch's CPU kernel; the weight is on {w.device}")
    reason = check_int4_shape(*w.shape, group)
    if reason:
        raise ValueError(f"cannot quantise a {tuple(w.shape)} weight to int4: {reason}")
    codes, sz = quantize_codes(w, group)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    return Int4Weight(packed, sz.to(dtype or w.dtype), w.shape[0], w.shape[1], group)


def int4_linear(x: torch.Tensor, weight: Int4Weight) -> torch.Tensor:
    """``x @ W.T`` for an :class:`Int4Weight`; ``x`` ``[..., in]`` in the weight's activation dtype."""
    lead = x.shape[:-1]
    out = torch.ops.aten._weight_int4pack_mm_for_cpu(x.reshape(-1, weight.in_features), weight.packed,
                                                     weight.group, weight.scales_zeros)  # [rows, out]
    return out.view(*lead, weight.out_features)


class Int4Linear(nn.Module):
    """A bias-free :class:`torch.nn.Linear` for inference only, on 4-bit weights (:func:`quantize_int4`)."""

    def __init__(self, linear: nn.Linear, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        if linear.bias is not None:
            raise ValueError("Int4Linear covers bias-free linear layers only")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight4 = quantize_int4(linear.weight, dtype)
        self.dtype = self.weight4.scales_zeros.dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return int4_linear(x.to(self.dtype), self.weight4)
