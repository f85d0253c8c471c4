"""Prepacked bf16 products (:mod:`treespec.models.fast.packed`): the same values as ``F.linear``,
whatever the number of rows (products of fewer than ``MIN_ROWS`` rows run padded)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from treespec.models.fast import packed
from treespec.models.fast.packed import MIN_ROWS, PackedLinear, pack_weight, packed_linear

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN")


@pytest.mark.parametrize("rows", [1, 2, 3, MIN_ROWS, 7, 33])
def test_packed_linear_equals_linear(rows):
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 64, generator=gen).bfloat16()
    x = torch.randn(rows, 64, generator=gen).bfloat16()
    out = packed_linear(x, pack_weight(w))
    assert out.shape == (rows, 96)
    assert torch.equal(out, F.linear(x, w))
    layer = torch.nn.Linear(64, 96, bias=False).bfloat16()
    layer.weight.data.copy_(w)
    assert torch.equal(PackedLinear(layer)(x[None]), F.linear(x, w)[None])  # [1, rows, 96]


def test_padding_twin_fails(monkeypatch):
    """Broken twin: padding rows taken from the wrong end of the padded product."""

    def last_rows(x, p):
        rows = x.shape[0]
        padded = torch.cat([x.new_zeros(MIN_ROWS - rows, x.shape[1]), x]) if rows < MIN_ROWS else x
        return torch.ops.mkldnn._linear_pointwise(padded, p, None, "none", [], "")[:rows]

    monkeypatch.setattr(packed, "packed_linear", last_rows)
    w = torch.randn(32, 64).bfloat16()
    x = torch.randn(1, 64).bfloat16()
    assert not torch.equal(packed.packed_linear(x, pack_weight(w)), F.linear(x, w))
