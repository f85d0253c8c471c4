"""The training loop's learning-rate schedule (:func:`treespec.distill.loop.cosine_lr`) and how the
library schedule of the same shape differs from it (why the loop keeps its own: a swap would change
the factors of every run, resumed ones included)."""

from __future__ import annotations

import math

import pytest
import torch

from treespec.distill.loop import cosine_lr

# (warmup, steps, floor): the head recipe's defaults (recipes/head_v2_train.sh: WARMUP=200, STEPS=4000,
# floor 0.1 in train.train), its continued runs (WARMUP=50, STEPS=1600), Medusa's defaults (floor 0),
# no warmup, and a tiny run
CONFIGS = [(200, 4000, 0.1), (50, 1600, 0.1), (30, 500, 0.0), (0, 10, 0.1), (3, 7, 0.0)]


@pytest.mark.parametrize("warmup,steps,floor", CONFIGS)
def test_cosine_lr_warms_up_linearly_then_decays_to_the_floor(warmup, steps, floor):
    for step in range(warmup):
        assert cosine_lr(step, warmup, steps, floor) == pytest.approx((step + 1) / warmup, abs=1e-12)
    assert cosine_lr(warmup, warmup, steps, floor) == pytest.approx(1.0, abs=1e-12)
    for step in range(warmup, steps + 3):
        frac = min((step - warmup) / max(steps - warmup, 1), 1.0)
        expected = floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * frac))
        assert cosine_lr(step, warmup, steps, floor) == pytest.approx(expected, abs=1e-12)
    assert cosine_lr(steps, warmup, steps, floor) == pytest.approx(floor, abs=1e-12)


@pytest.mark.parametrize("warmup,steps,floor", CONFIGS)
def test_library_cosine_schedule_differs_only_as_cosine_lr_documents(warmup, steps, floor):
    """transformers' cosine-with-min-lr schedule: warmup one step behind (``step / warmup``), the same
    decay from ``warmup`` to ``steps``, rising again past ``steps`` (where ``cosine_lr`` stays at the floor)."""
    transformers = pytest.importorskip("transformers")
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    library = transformers.get_cosine_with_min_lr_schedule_with_warmup(opt, warmup, steps, min_lr_rate=floor)
    factor = library.lr_lambdas[0]
    for step in range(warmup):
        assert factor(step) == pytest.approx(step / warmup, abs=1e-12)
        assert cosine_lr(step, warmup, steps, floor) - factor(step) == pytest.approx(1 / warmup, abs=1e-12)
    for step in range(warmup, steps + 1):
        assert factor(step) == pytest.approx(cosine_lr(step, warmup, steps, floor), abs=1e-12)
    if floor < 1:
        assert factor(steps + 1) > cosine_lr(steps + 1, warmup, steps, floor)
