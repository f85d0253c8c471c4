"""The fixed-shape passes of :class:`~treespec.models.fast.graphs.GraphedGemmaRunner` (what a CUDA graph records)
compute the lean runner's function: logits of trees padded to budgets against
:class:`~treespec.models.fast.FastGemmaRunner` (float32, atol 1e-5, sliding window crossed, a prefill longer than
the largest budget, the cache growing mid-run), the caches after 40 random commits against the lean runner's
(which ``test_fast_runner.py`` checks against a fresh eager prefill), greedy identity with a tree drafter and
n-gram lookup, no host synchronisation inside the fixed-shape pass (a capture would fail on one) and no tensor made
there off the runner's device. A broken twin
(each pass writes its keys and values one slot too far) must fail the logits comparison. The capture itself runs
on CUDA only (``benchmarks/device_check.py``); here it is refused by name.
"""

import pytest
import torch

from sync_helpers import SyncCounter
from trees_common import random_tree
from treespec.drafting.ngram import NgramConfig, NgramDrafter
from treespec.generate import GenerationConfig, generate
from treespec.models.fast import FastGemmaRunner
from treespec.models.fast.graphs import GraphedGemmaRunner, _StaticPass
from treespec.models.tiny import tiny_model
from treespec.sampling import SamplingConfig
from treespec.trees.grow import ShapeDrafter
from treespec.trees.shape import TreeShape

ATOL = 1e-5
V = 64
BUDGETS = (1, 2, 4, 8)


class SlotsOffByOne(GraphedGemmaRunner):
    """Broken twin: the pass writes its keys and values one slot too far (over the next pass's first slot)."""

    def _fill(self, step, ids, q_pos, visible, past, total):
        super()._fill(step, ids, q_pos, visible, past, total)
        step.slots.add_(1)


def _run_steps(runner, model, steps: int, seed: int) -> list[torch.Tensor]:
    """A 21-token prefill (longer than the largest budget), then ``steps`` random trees of 1..8 nodes, each
    committed along a random path; the logits of every pass."""
    gen = torch.Generator().manual_seed(seed)
    seq = torch.randint(0, V, (21,), generator=gen).tolist()
    out = [runner.forward(None, None, torch.tensor(seq[:-1]))["logits"]]
    for _ in range(steps):
        tree = random_tree(int(torch.randint(1, 9, (1,), generator=gen)), seq[-1], V, gen)
        out.append(runner.forward(tree, torch.arange(tree.num_nodes))["logits"])
        path = tree.root_path(int(torch.randint(0, tree.num_nodes, (1,), generator=gen)))
        runner.commit(path)
        seq.extend(tree.tokens[path[1:]].tolist())
        seq.append(int(torch.randint(0, V, (1,), generator=gen)))
    return out


@pytest.mark.parametrize("capacity", [16, 256])  # 16: the 20-token prefill and later passes grow the cache mid-run
def test_fixed_shape_passes_equal_the_lean_runner(capacity):
    model = tiny_model("gemma3", V, seed=0, num_layers=4)
    graphed = GraphedGemmaRunner(model, capacity=capacity, budgets=BUDGETS, capture=False)
    lean = FastGemmaRunner(model)
    for mine, ref in zip(_run_steps(graphed, model, 40, seed=3), _run_steps(lean, model, 40, seed=3)):
        torch.testing.assert_close(mine, ref, atol=ATOL, rtol=0)
    assert graphed.length == lean.length and graphed.cache_length == lean.cache_length
    for i in range(graphed.kv.k.shape[0]):
        used = graphed.cache_length
        torch.testing.assert_close(graphed.kv.k[i, :, :used], lean.kv.k[i, :, :used], atol=ATOL, rtol=0)
        torch.testing.assert_close(graphed.kv.v[i, :, :used], lean.kv.v[i, :, :used], atol=ATOL, rtol=0)


def test_broken_slots_twin_fails():
    model = tiny_model("gemma3", V, seed=0, num_layers=4)
    broken = SlotsOffByOne(model, budgets=BUDGETS, capture=False)
    lean = FastGemmaRunner(model)
    diffs = [float((a - b).abs().max()) for a, b in zip(_run_steps(broken, model, 20, seed=3),
                                                        _run_steps(lean, model, 20, seed=3))]
    assert max(diffs) > 1e-2


@pytest.mark.parametrize("draft", ["tree", "ngram"])
def test_greedy_identity(draft):
    model = tiny_model("gemma3", V, seed=0, logit_scale=8)
    drafter = (ShapeDrafter(tiny_model("gemma3", V, seed=1, logit_scale=8), TreeShape.widths((2, 2, 1)), "iid")
               if draft == "tree" else NgramDrafter(NgramConfig(depth=5, branches=3)))
    cfg = GenerationConfig(max_new_tokens=40, sampling=SamplingConfig(0.0), stop_on_eos=False)
    prompt = [3, 4, 5, 6, 7, 3, 4, 5]
    runner = GraphedGemmaRunner(model, budgets=BUDGETS, capture=False)
    assert generate(runner, prompt, drafter, cfg).token_ids == generate(model, prompt, None, cfg).token_ids


def test_no_host_sync_inside_the_fixed_shape_pass():
    """What a CUDA graph records must not read a device value back (the capture would fail there)."""
    model = tiny_model("gemma3", V, seed=0, num_layers=2)
    runner = GraphedGemmaRunner(model, budgets=BUDGETS, capture=False)
    runner.forward(None, None, torch.arange(1, 12))
    step = _StaticPass(runner, 8)
    with SyncCounter() as count:
        hidden = runner._static_body(step)
    assert hidden.shape == (8, model.config.hidden_size)
    assert count.total == 0, dict(count.kinds)


def test_capture_needs_cuda_and_budgets_are_checked():
    model = tiny_model("gemma3", V, seed=0, num_layers=2)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
            GraphedGemmaRunner(model, capture=True)
    assert GraphedGemmaRunner(model).capture is False  # a CPU model: fixed shapes, no graphs
    for budgets in ((4, 2), (0, 1), (2, 2)):
        with pytest.raises(ValueError, match="budgets must be"):
            GraphedGemmaRunner(model, budgets=budgets)


def test_every_tensor_made_inside_the_pass_is_made_on_the_runners_device():
    """A CUDA graph records only device work: a tensor made inside the pass without the runner's device (a CPU
    tensor on a GPU run) would break the capture. Under a default device of ``meta`` such a tensor is a meta
    tensor, which cannot meet the runner's (CPU) tensors; the pass must still give the same output. A twin that
    makes one tensor without a device fails."""
    model = tiny_model("gemma3", V, seed=0, num_layers=2)
    runner = GraphedGemmaRunner(model, budgets=BUDGETS, capture=False)
    runner.forward(None, None, torch.arange(1, 12))
    step = _StaticPass(runner, 8)
    expected = runner._static_body(step)
    with torch.device("meta"):
        got = runner._static_body(step)
    assert got.device == runner.device and torch.equal(got, expected)

    masks = runner._masks

    def careless(visible, q_pos, k_pos):  # adds a zero made on the default device
        return {k: m + torch.zeros(()) for k, m in masks(visible, q_pos, k_pos).items()}

    runner._masks = careless
    with pytest.raises(RuntimeError, match="meta"), torch.device("meta"):
        runner._static_body(step)
