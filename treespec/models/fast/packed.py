"""Linear products with oneDNN-prepacked bf16 weights (CPU inference).

A plain bf16 ``F.linear`` on a CPU with oneDNN reorders the whole weight into oneDNN's blocked
layout on every call, so a one-row product costs several times the time to read the weight.
Packing once (:func:`pack_weight`) and multiplying with the packed copy (:func:`packed_linear`)
gives the same values (tested against ``F.linear``) at about the weight-streaming cost. Used by
the fast Gemma-3 runner and by draft heads built for inference (:class:`PackedLinear`).
"""

from __future__ import annotations

from functools import lru_cache

import torch
from torch import nn


@lru_cache(maxsize=1)
def bf16_packing_supported() -> bool:
    """Whether oneDNN packs bf16 weights on this CPU: its bf16 path needs avx512bw/vl/dq or avx_ne_convert
    (an AVX2-only AMD EPYC refused with a RuntimeError); found by packing a 16 x 16 weight once. The packing
    ops are private to torch: a torch without them (AttributeError, NotImplementedError) packs nothing, and the
    plain product runs."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        pack_weight(torch.zeros(16, 16, dtype=torch.bfloat16))
    except (RuntimeError, AttributeError, NotImplementedError):
        return False
    return True


def prepack_default(dtype: torch.dtype, device: torch.device | str) -> bool:
    """Pack by default for bf16 on a CPU whose oneDNN packs bf16 (elsewhere the plain product is the one that
    runs)."""
    return dtype == torch.bfloat16 and torch.device(device).type == "cpu" and bf16_packing_supported()


def pack_weight(w: torch.Tensor) -> torch.Tensor:
    """``[out, in]`` weight -> oneDNN's blocked layout for :func:`packed_linear` (made once)."""
    return torch.ops.mkldnn._reorder_linear_weight(w.detach(), 16)


#: products of fewer rows are padded with zero rows up to this many: oneDNN (3.12, avx512_core_bf16)
#: picks slower kernels for 1- and 2-row bf16 products; a 2-token pass of the fast Gemma runner cost
#: 1.19 t(1) before (benchmarks/results/profile/2026-11-24-d66018c-bf16-int4) and 1.01 t(1) after
#: (.../2026-11-25-2baf2b3-bf16-int4). Each row's values do not change (tested bit for bit). The 8-bit LM
#: head pads alike (:func:`~treespec.models.fast.int8_head.int8_head_logits`): on an Intel Xeon with AMX
#: oneDNN's 1- and 2-row int8 products rounded by one ulp differently from products of 3 rows or more, so a
#: row's logits depended on the rows beside it.
MIN_ROWS = 4


def pad_rows(x: torch.Tensor, fill: float = 0) -> torch.Tensor:
    """``x`` ``[rows, in]`` with rows of ``fill`` appended up to :data:`MIN_ROWS` (``x`` itself when it has as many)."""
    rows = x.shape[0]
    return x if rows >= MIN_ROWS else torch.cat([x, x.new_full((MIN_ROWS - rows, x.shape[1]), fill)])


def packed_linear(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """``x @ W.T`` for a weight packed by :func:`pack_weight`; ``x`` ``[rows, in]`` in the weight's dtype."""
    if x.dim() == 2 and x.shape[0] < MIN_ROWS:
        return torch.ops.mkldnn._linear_pointwise(pad_rows(x), packed, None, "none", [], "")[:x.shape[0]]
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


class PackedLinear(nn.Module):
    """A bias-free :class:`torch.nn.Linear` for inference only, its weight packed once (no gradient)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        if linear.bias is not None:
            raise ValueError("PackedLinear covers bias-free linear layers only")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.dtype = linear.weight.dtype
        self.register_buffer("packed", pack_weight(linear.weight), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        out = packed_linear(x.reshape(-1, self.in_features).to(self.dtype), self.packed)  # [rows, out]
        return out.view(*lead, self.out_features)


def pack_linears(module: nn.Module, make=PackedLinear) -> nn.Module:
    """Replace every bias-free ``nn.Linear`` below ``module`` by ``make(linear)`` (in place): a
    :class:`PackedLinear` by default, or another inference-only form (e.g. 4-bit weights,
    :class:`~treespec.models.fast.quant.Int4Linear`)."""
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear) and child.bias is None:
            setattr(module, name, make(child))
        else:
            pack_linears(child, make)
    return module
