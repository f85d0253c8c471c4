"""Sequoia: the DP equals brute force over all trees of <= 7 nodes, predicted tau, the measured
acceptance vector, the hardware profile's JSON form and the (n, d) choice."""

import json
import math
import os
from pathlib import Path


import numpy as np
import pytest
import torch

from treespec.calibration import measure_acceptance_vector, measure_profile
from treespec.distill.inputs import read_prompt_texts
from treespec.models.tiny import tiny_model
from treespec.sampling import SamplingConfig
from treespec.trees.sequoia import (
    AcceptanceVector,
    HardwareProfile,
    SequoiaDP,
    brute_force_best,
    choose_tree,
    enumerate_shapes,
    predicted_tau,
)
from treespec.trees.shape import TreeShape

ACC_VECTORS = [
    [0.6, 0.2, 0.1],
    [0.3, 0.3, 0.2, 0.1, 0.05],
    [0.9],
    [0.5, 0.05, 0.3],  # not monotone
    [0.0, 0.4],
    [0.25, 0.25, 0.25, 0.25],
]


def test_enumerator_counts_plane_trees():
    # ordered trees with n nodes: Catalan(n - 1)
    assert [len(enumerate_shapes(n)) for n in range(1, 8)] == [math.comb(2 * k, k) // (k + 1) for k in range(7)]
    assert len(set(enumerate_shapes(7))) == 132


DEPTH_ROWS = [
    [[0.7, 0.1], [0.5, 0.15], [0.3, 0.2]],  # acceptance falling with depth (a draft head)
    [[0.2, 0.1, 0.1], [0.6], [0.05, 0.5]],  # rising, ragged widths, not monotone in rank
]


@pytest.mark.parametrize("acc", ACC_VECTORS + DEPTH_ROWS)
def test_dp_equals_brute_force(acc):
    """One vector for every depth, or rows per depth (row d-1 for children at depth d, the last
    row beyond): the DP's value and shape equal brute force over all trees of <= 7 nodes."""
    for n in range(0, 7):  # drafted nodes: trees of up to 7 nodes
        dp = SequoiaDP(acc, n, 6)
        for d in range(0, 7):
            best = brute_force_best(acc, n, d)
            assert dp.value(n, d) == pytest.approx(best, abs=1e-12), (n, d)
            shape = dp.shape(n, d)
            assert shape.num_drafted <= n and shape.max_depth <= d
            assert predicted_tau(shape, acc) == pytest.approx(best, abs=1e-12)


def test_dp_takes_depth_rows_from_an_acceptance_vector():
    rows = DEPTH_ROWS[0]
    vec = AcceptanceVector(rows[0], by_depth=rows)
    assert SequoiaDP(vec, 5, 3).value(5, 3) == pytest.approx(brute_force_best(rows, 5, 3), abs=1e-12)


def test_predicted_tau_with_depth_rows():
    rows = [[0.8], [0.5]]
    assert predicted_tau(TreeShape.chain(3), rows) == pytest.approx(1 + 0.8 + 0.8 * 0.5 + 0.8 * 0.5 * 0.5)


def test_predicted_tau_of_simple_shapes():
    a = 0.7
    assert predicted_tau(TreeShape.chain(3), [a]) == pytest.approx(1 + a + a * a + a ** 3)
    assert predicted_tau(TreeShape.widths((2,)), [0.5, 0.2]) == pytest.approx(1.7)
    assert predicted_tau(TreeShape.chain(2), [0.0]) == 1.0


def test_dp_large_is_monotone():
    dp = SequoiaDP([0.6, 0.15, 0.08, 0.04], 128, 10)
    vals = [dp.value(n, 10) for n in range(129)]
    assert all(b >= a - 1e-12 for a, b in zip(vals, vals[1:]))
    assert dp.value(128, 10) > dp.value(128, 3)
    assert dp.shape(64, 8).num_drafted == 64


def test_acceptance_vector_measurement(tmp_path):
    target = tiny_model("llama", 16, seed=0, logit_scale=4)
    draft = tiny_model("llama", 16, seed=3, logit_scale=4)
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8], [9, 3, 5, 2, 11, 12]]
    gen = torch.Generator().manual_seed(0)
    # the target drafting for itself: the first child is always accepted
    same = measure_acceptance_vector(target, target, prompts, SamplingConfig(1.0), width=3, generator=gen)
    assert same.acc[0] == pytest.approx(1.0, abs=1e-5) and sum(same.acc[1:]) < 1e-5
    for temp in (0.0, 1.0):
        vec = measure_acceptance_vector(target, draft, prompts, SamplingConfig(temp), width=4, generator=gen)
        assert len(vec.acc) == 4 and all(a >= 0 for a in vec.acc) and sum(vec.acc) <= 1 + 1e-9
        assert vec.meta["positions"] == 14
        left = 1.0
        for a, c in zip(vec.acc, vec.conditional):
            assert c == pytest.approx(a / left)
            left -= a
    vec.save(tmp_path / "acc.json")
    assert AcceptanceVector.load(tmp_path / "acc.json") == vec


#: the shared data folder (``$TREESPEC_SHARED`` or ``../shared`` next to the repository)
SHARED = Path(os.environ.get("TREESPEC_SHARED") or Path(__file__).resolve().parents[3] / "shared")
TRAIN_PROMPTS = SHARED / "data" / "train" / "train_prompts.jsonl"
EVAL_PROMPTS = SHARED / "data" / "eval" / "spec_bench.prompts.jsonl"


def _prompt_texts(path):
    return [json.loads(line)["prompt"] for line in path.read_text(encoding="utf-8").split("\n") if line.strip()]


@pytest.mark.skipif(not TRAIN_PROMPTS.exists() or not EVAL_PROMPTS.exists(), reason="shared data not present")
def test_calibration_prompts_are_train_prompts():
    """Calibration reads the train split, row for row, and none of it is an evaluation prompt."""
    prompts = read_prompt_texts(TRAIN_PROMPTS, limit=50)
    assert prompts == _prompt_texts(TRAIN_PROMPTS)[:50]
    assert not set(prompts) & set(_prompt_texts(EVAL_PROMPTS))


def test_profile_round_trip_and_choice(tmp_path):
    target = tiny_model("llama", 16, seed=0)
    prof = measure_profile(target, tiny_model("llama", 16, seed=1), sizes=(1, 2, 4, 8), prefix=8, repeats=1,
                           warmup=1)
    assert prof.sizes == [1, 2, 4, 8] and len(prof.verify_s) == 4 and prof.draft_step_s > 0
    prof.save(tmp_path / "p.json")
    assert HardwareProfile.load(tmp_path / "p.json") == prof
    acc = [0.6, 0.2, 0.1]
    flat = HardwareProfile([1, 129], [1.0, 1.0], 0.0)  # free verification: spend everything
    best = choose_tree(acc, flat, max_depth=12)
    assert best["n"] == 128 and best["shape"].num_drafted == 128
    assert best["speedup"] == pytest.approx(best["tau"])
    steep = HardwareProfile([1, 129], [1.0, 129.0], 0.0)  # t(m) = m: nothing beats plain decoding
    assert choose_tree(acc, steep)["n"] == 0
    mid = HardwareProfile([1, 8, 129], [1.0, 1.2, 20.0], 0.1)
    best = choose_tree(acc, mid, max_depth=6)
    dp = SequoiaDP(acc, 128, 6)
    brute = max(dp.value(n, d) / (mid.t(n + 1) + d * 0.1) for n in range(1, 129) for d in range(1, 7))
    assert best["speedup"] == pytest.approx(brute)
    assert predicted_tau(best["shape"], acc) == pytest.approx(best["tau"])


def test_acceptance_scored_on_generated_positions_only():
    """``score_from`` counts only nodes of trees rooted at or after the last prompt token; the
    reference measures each kept position on its own (depth 1, a causal LM draft, greedy)."""
    target, draft = tiny_model("llama", 16, seed=0), tiny_model("llama", 16, seed=1)
    seqs = [[1, 2, 3, 4, 5, 6, 7, 8], [9, 3, 5, 2, 11, 12]]
    starts = [5, 2]
    vec = measure_acceptance_vector(target, draft, seqs, SamplingConfig(0.0), width=3, score_from=starts)
    assert vec.meta["positions"] == (8 - 5 + 1) + (6 - 2 + 1)  # the last row predicts past the text
    ref = np.zeros(3)
    for ids, g in zip(seqs, starts):
        for j in range(g, len(ids) + 1):  # the node predicting position j, rooted at j - 1 >= g - 1
            x = torch.tensor([ids[:j]])
            top = draft(x).logits[0, -1].topk(3).indices
            hit = (top == target(x).logits[0, -1].argmax()).double()
            ref += hit.numpy()
    assert np.allclose(vec.acc, ref / vec.meta["positions"], atol=1e-9)
    every = measure_acceptance_vector(target, draft, seqs, SamplingConfig(0.0), width=3, score_from=[0, 0])
    assert every.acc == measure_acceptance_vector(target, draft, seqs, SamplingConfig(0.0), width=3).acc
    with pytest.raises(ValueError, match="score_from"):
        measure_acceptance_vector(target, draft, seqs, SamplingConfig(0.0), score_from=[1])
