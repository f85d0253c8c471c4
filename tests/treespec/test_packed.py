"""Prepacked bf16 products (:mod:`treespec.models.fast.packed`): the same values as ``F.linear``,
whatever the number of rows (products of fewer than ``MIN_ROWS`` rows run padded)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from treespec.models.fast.packed import MIN_ROWS, PackedLinear, bf16_packing_supported, pack_weight, packed_linear

pytestmark = pytest.mark.skipif(not bf16_packing_supported(),
                                reason="oneDNN packs no bf16 weights on this CPU (it needs avx512bw/vl/dq or "
                                       "avx_ne_convert)")

# small, and Gemma-3-270M's shapes (stacked q/k/v, stacked gate/up, down, o)
SHAPES = [(96, 64), (1536, 640), (4096, 640), (640, 2048), (640, 1024)]


def mismatches(linear, threads: int) -> list:
    """(shape, rows) where ``linear(x, pack_weight(w))`` differs from ``F.linear(x, w)`` in bf16."""
    bad, old = [], torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for out_f, in_f in SHAPES:
            gen = torch.Generator().manual_seed(out_f + in_f)
            w = (torch.randn(out_f, in_f, generator=gen) * 0.05).bfloat16()
            packed = pack_weight(w)
            for rows in (1, 2, 3, MIN_ROWS, 7, 33):
                x = torch.randn(rows, in_f, generator=gen).bfloat16()
                out = linear(x, packed)
                if out.shape != (rows, out_f) or not torch.equal(out, F.linear(x, w)):
                    bad.append(((out_f, in_f), rows))
    finally:
        torch.set_num_threads(old)
    return bad


@pytest.mark.parametrize("threads", [1, 2])
def test_packed_linear_equals_linear(threads):
    assert mismatches(packed_linear, threads) == []


def test_padding_twin_fails():
    """Broken twin: the padding rows go in front and the first rows of the product are kept."""

    def pad_in_front(x, p):
        rows = x.shape[0]
        padded = torch.cat([x.new_zeros(MIN_ROWS - rows, x.shape[1]), x]) if rows < MIN_ROWS else x
        return torch.ops.mkldnn._linear_pointwise(padded, p, None, "none", [], "")[:rows]

    bad = mismatches(pad_in_front, 1)
    assert {rows for _, rows in bad} == {1, 2, 3}  # exactly the padded products are caught


def test_packed_module_keeps_leading_dims():
    layer = torch.nn.Linear(64, 96, bias=False).bfloat16()
    x = torch.randn(2, 3, 64).bfloat16()
    assert torch.equal(PackedLinear(layer)(x), F.linear(x, layer.weight))
    assert torch.equal(PackedLinear(layer)(x[:, :1]), F.linear(x[:, :1], layer.weight))  # 2 rows, padded
