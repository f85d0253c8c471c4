"""The opt-in 8-bit LM head (``FastGemmaRunner(quantize="int8-head")``, ``treespec generate --quantize int8-head``).

- oneDNN's int8 product equals the float64 formula of :func:`int8_head_reference` (relative 1e-5); broken twins
  (the outlier columns' float32 term dropped; full-range activation codes on a kernel whose pair sums saturate)
  fail the same comparison.
- The kernel probe agrees with the CPU's flags, and a plan the kernel cannot sum exactly is refused.
- A row's logits do not depend on the other rows of its pass (per-row activation scales), within float32
  rounding: a tree pass and per-path passes see the same head.
- The plan keeps the largest activation ranges out of the 8-bit product and smooths the rest as documented.
- The runner with the 8-bit head is the bf16/float32 runner's body with that head: its logits equal the formula
  applied to the plain runner's hidden states; tree passes equal per-path passes; after random commits the
  cache equals a fresh prefill's.
- Losslessness with respect to that model: greedy speculative output equals its own plain decoding.
- Refusals name the problem.
"""

from __future__ import annotations

import pytest
import torch

from treespec.drafting.ngram import NgramConfig, NgramDrafter
from treespec.generate import GenerationConfig, generate
from treespec.models.fast import FastGemmaRunner, make_runner
from treespec.models.fast.int8_head import (FULL_LEVELS, SATURATING_LEVELS, Int8Head, Int8HeadPlan,
                                            activation_codes, activation_levels, calibration_ids, int8_head_logits,
                                            int8_head_reference, int8_kernel_missing, int8_pairs_saturate,
                                            plan_int8_head, quantize_int8_head, weight_codes)
from treespec.models.loading import cpu_has_vnni
from treespec.models.tiny import tiny_model
from treespec.sampling import SamplingConfig
from treespec.tree import TokenTree

pytestmark = pytest.mark.skipif(int8_kernel_missing() is not None, reason=str(int8_kernel_missing()))

V = 64
GREEDY = GenerationConfig(max_new_tokens=40, sampling=SamplingConfig(0.0), stop_on_eos=False)


def gemma(seed=0, dtype=torch.float32):
    return tiny_model("gemma3", V, seed=seed, num_layers=4, dtype=dtype)


def random_head(vocab=96, hidden=48, outliers=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(vocab, hidden, generator=g) * 0.05
    act = torch.rand(hidden, generator=g) * 5 + 1
    act[:outliers] *= 20  # a few dimensions with large ranges, as in real final hidden states
    hidden_states = torch.randn(7, hidden, generator=g) * act / 3
    return weight, act, hidden_states


@pytest.mark.parametrize("outliers,act_levels", [(0, None), (4, None), (4, 31)])
def test_int8_product_equals_the_formula(outliers, act_levels):
    weight, act, h = random_head()
    plan = plan_int8_head(weight, act, outliers=outliers, act_levels=act_levels)
    assert plan.act_levels == (act_levels or activation_levels())
    head = quantize_int8_head(weight, plan)
    fast, ref = int8_head_logits(h, head).double(), int8_head_reference(h, weight, plan)
    assert fast.shape == (7, 96)
    torch.testing.assert_close(fast, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


def test_a_head_without_its_outlier_term_fails_the_comparison():
    weight, act, h = random_head()
    plan = plan_int8_head(weight, act, outliers=4)
    head = quantize_int8_head(weight, plan)
    broken = Int8Head(head.packed, head.scales, head.zero_points, head.outlier_weight[:0], head.plan, head.vocab)
    ref = int8_head_reference(h, weight, plan)
    assert not torch.allclose(int8_head_logits(h, broken).double(), ref, rtol=1e-5,
                              atol=1e-5 * ref.abs().max().item())


def test_the_kernel_probe_agrees_with_the_cpu_flags():
    """Without a VNNI flag oneDNN's AVX2 product adds pairs of products in 16 saturating bits; with one (and no
    ``ONEDNN_MAX_CPU_ISA`` capping the kernel) it sums in 32 bits and activations keep all 8 bits."""
    import os

    vnni = cpu_has_vnni()
    if vnni is False:
        assert int8_pairs_saturate() and activation_levels() == SATURATING_LEVELS
    elif vnni and "ONEDNN_MAX_CPU_ISA" not in os.environ:
        assert not int8_pairs_saturate() and activation_levels() == FULL_LEVELS
    else:
        pytest.skip(f"cpu_has_vnni() is {vnni}, ONEDNN_MAX_CPU_ISA={os.environ.get('ONEDNN_MAX_CPU_ISA')}")


@pytest.mark.skipif(int8_kernel_missing() is not None or not int8_pairs_saturate(),
                    reason="no int8 kernel, or it sums products in 32 bits")
def test_full_range_activations_on_a_saturating_kernel_break_the_formula_and_are_refused():
    """The twin of the probe: codes up to 127 (stored up to 255) through AVX2's 16-bit pair sums are not the
    formula, and :func:`quantize_int8_head` refuses to build such a head."""
    weight, act, h = random_head()
    plan = plan_int8_head(weight, act, outliers=4, act_levels=FULL_LEVELS)
    with pytest.raises(ValueError, match="sums pairs of products in 16 bits"):
        quantize_int8_head(weight, plan)
    safe = quantize_int8_head(weight, Int8HeadPlan(plan.outliers, plan.kept, plan.smooth, SATURATING_LEVELS))
    codes, _ = weight_codes(weight, plan)  # the same weight codes whatever the activation levels
    broken = Int8Head(torch.ops.onednn.qlinear_prepack(codes, [1, codes.shape[1]]), safe.scales, safe.zero_points,
                      safe.outlier_weight, plan, safe.vocab)
    ref = int8_head_reference(h, weight, plan)
    assert not torch.allclose(int8_head_logits(h, broken).double(), ref, rtol=1e-5,
                              atol=1e-5 * ref.abs().max().item())


def test_the_8_bit_head_is_close_to_the_float_head():
    """Not exact (another model), but near: the quantisation error is a small fraction of the logits' spread."""
    weight, act, h = random_head()
    logits = int8_head_logits(h, quantize_int8_head(weight, plan_int8_head(weight, act)))
    exact = h @ weight.t()
    assert (logits - exact).abs().max() < 0.05 * exact.std()


def test_a_row_does_not_depend_on_the_other_rows():
    """Bit for bit (per-row activation scales, integer sums, outlier products of one fixed shape): a row's logits in
    a tree pass are those of the same row alone, whatever the other rows are and wherever it sits."""
    weight, act, h = random_head()
    head = quantize_int8_head(weight, plan_int8_head(weight, act))
    h = torch.cat([h, h * 3, h[:3]])  # 17 rows: more than one outlier block
    together = int8_head_logits(h, head)
    alone = torch.cat([int8_head_logits(h[i:i + 1], head) for i in range(h.shape[0])])
    assert torch.equal(alone, together)
    order = torch.randperm(h.shape[0], generator=torch.Generator().manual_seed(0))
    assert torch.equal(int8_head_logits(h[order], head), together[order])


def test_codes_rebuild_the_smoothed_weights_and_activations_within_half_a_step():
    """The codes on their own: weights within -127..127 and activations within -L..L (the plan's
    ``act_levels``), each row using its full range, and codes x scale / smoothing
    giving back ``W[:, K]`` and ``h[:, K]`` to half a step (so the smoothing is undone on the side it was put on)."""
    weight, act, h = random_head()
    plan = plan_int8_head(weight, act)
    codes, c = weight_codes(weight, plan)
    assert codes.dtype == torch.int8 and codes.abs().max() <= 127
    assert torch.equal(codes.abs().amax(1), torch.full((weight.shape[0],), 127, dtype=torch.int8))
    back = codes.float() * c[:, None] / plan.smooth
    assert ((back - weight[:, plan.kept]).abs() <= (c[:, None] / plan.smooth) * 0.5 + 1e-7).all()
    xcodes, row_range = activation_codes(h, plan)
    step = row_range / plan.act_levels * plan.smooth  # [R, H - k]
    assert ((xcodes * step - h[:, plan.kept]).abs() <= step * 0.5 + 1e-6).all()
    assert torch.equal(xcodes.abs().amax(1), torch.full((h.shape[0],), float(plan.act_levels)))


def test_an_all_zero_row_gives_zero_logits_not_nan():
    weight, act, _ = random_head()
    head = quantize_int8_head(weight, plan_int8_head(weight, act))
    assert torch.equal(int8_head_logits(torch.zeros(2, 48), head), torch.zeros(2, 96))


def test_the_plan_keeps_the_largest_ranges_in_float32_and_smooths_the_rest():
    weight, act, _ = random_head(outliers=4)
    plan = plan_int8_head(weight, act, outliers=4, alpha=0.5)
    assert plan.outliers.tolist() == [0, 1, 2, 3]
    assert plan.kept.tolist() == list(range(4, 48))
    expected = (act[4:] / weight.abs().amax(0)[4:]) ** 0.5
    torch.testing.assert_close(plan.smooth, expected)
    with pytest.raises(ValueError, match="act_range has shape"):
        plan_int8_head(weight, act[:5])
    with pytest.raises(ValueError, match="outliers must be in"):
        plan_int8_head(weight, act, outliers=48)
    for levels in (0, 128):
        with pytest.raises(ValueError, match=f"act_levels must be in 1..127, got {levels}"):
            plan_int8_head(weight, act, act_levels=levels)


def test_calibration_ids_are_seeded():
    assert torch.equal(calibration_ids(1000), calibration_ids(1000))
    assert calibration_ids(1000).max() < 1000


# ------------------------------------------------------------------ the runner

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_runner_logits_are_the_formula_on_the_plain_runners_hidden_states(dtype):
    model = gemma(dtype=dtype)
    quant, plain = make_runner(model, quantize="int8-head"), FastGemmaRunner(model)
    ids = torch.randint(0, V, (12,), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        got = quant.forward(None, None, chain=ids)["logits"]
        hidden = plain.forward(None, None, chain=ids, need_logits=False, need_hidden=True)["hidden"]
    ref = int8_head_reference(hidden, model.lm_head.weight, quant.head8.plan)
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-4)


def tree_and_paths(runner, prefix):
    """Logits of a branching tree in one pass, and of each root-to-leaf path as a causal chain."""
    parents, tokens = [-1, 0, 0, 1, 1, 2], [5, 7, 9, 11, 13, 2]
    tree = TokenTree.from_lists(parents, tokens)
    with torch.inference_mode():
        runner.reset()
        runner.forward(None, None, chain=prefix)
        in_tree = runner.forward(tree, torch.arange(tree.num_nodes))["logits"]
        out = {}
        for leaf in (3, 4, 5):
            path = [leaf]
            while parents[path[0]] >= 0:
                path.insert(0, parents[path[0]])
            runner.reset()
            runner.forward(None, None, chain=prefix)
            out[leaf] = (path, runner.forward(None, None, chain=torch.tensor([tokens[i] for i in path]))["logits"])
    return in_tree, out


@pytest.mark.parametrize("prefix_len", [2, 21])  # 21 > the tiny model's sliding window
def test_a_tree_pass_equals_per_path_passes(prefix_len):
    runner = make_runner(gemma(), quantize="int8-head")
    prefix = torch.randint(0, V, (prefix_len,), generator=torch.Generator().manual_seed(2))
    in_tree, paths = tree_and_paths(runner, prefix)
    for path, logits in paths.values():
        torch.testing.assert_close(in_tree[path], logits, rtol=1e-4, atol=1e-4)


def test_commits_keep_the_cache_exact():
    runner = make_runner(gemma(), quantize="int8-head")
    g = torch.Generator().manual_seed(3)
    tree = TokenTree.from_lists([-1, 0, 0, 1], [5, 7, 9, 11])
    prefix = torch.randint(0, V, (6,), generator=g)
    with torch.inference_mode():
        runner.forward(None, None, chain=prefix)
        runner.forward(tree, torch.arange(4))
        runner.commit([0, 1, 3])
        nxt = runner.forward(None, None, chain=torch.tensor([4]))["logits"]
        runner.reset()
        fresh = runner.forward(None, None, chain=torch.cat([prefix, torch.tensor([5, 7, 11, 4])]))["logits"][-1:]
    torch.testing.assert_close(nxt, fresh, rtol=1e-4, atol=1e-4)


def test_speculation_reproduces_its_own_plain_decoding():
    runner = make_runner(gemma(), quantize="int8-head")
    prompt = torch.randint(0, V, (10,), generator=torch.Generator().manual_seed(4)).tolist() * 2
    plain = generate(runner, prompt, None, GREEDY)
    spec = generate(runner, prompt, NgramDrafter(NgramConfig(depth=4, branches=2)), GREEDY)
    assert spec.token_ids == plain.token_ids


def test_a_small_cache_grows_for_the_calibration_and_serves_generation_after():
    """The calibration pass (256 tokens) outgrows a 16-slot cache; the grown cache still takes a generation."""
    runner = FastGemmaRunner(gemma(), capacity=16, quantize="int8-head")
    with torch.no_grad():
        out = generate(runner, [1, 2, 3, 4], None, GREEDY)
    assert len(out.token_ids) == GREEDY.max_new_tokens


def test_weight_streaming_counts_the_8_bit_head():
    from treespec.calibration import measure_weight_stream, runner_weights

    model = gemma(dtype=torch.bfloat16)
    runner = FastGemmaRunner(model, quantize="int8-head")
    _, q_bytes = measure_weight_stream(runner_weights(runner), repeats=1)
    vocab, hidden = model.lm_head.weight.shape
    head_bytes = vocab * (hidden - 16) + 4 * vocab + 4 * 16 * vocab  # codes, scales, float32 outlier columns
    body = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear)) - vocab * hidden
    assert head_bytes + 2 * body <= q_bytes < head_bytes + 2 * body + 4 * 64 * 1024


def test_refusals_name_the_problem():
    with pytest.raises(ValueError, match="unknown quantisation 'int8'"):
        FastGemmaRunner(gemma(), quantize="int8")
    with pytest.raises(ValueError, match="the weight is on meta"):
        quantize_int8_head(torch.empty(8, 4, device="meta"), plan_int8_head(torch.ones(8, 4), torch.ones(4), 0))
