"""The opt-in 4-bit target (``FastGemmaRunner(quantize="int4")``, ``treespec generate --quantize int4``).

- The int4 product equals a float32 product with the de-quantised weight (the slow reference), in
  float32 (atol 1e-4) and bf16 (the bf16 product's own rounding) activations.
- Weights already on a 16-level affine grid per group of 32 (as Q4_K tensors of a GGUF are) come
  back exactly; other weights within half a step of the grid.
- The quantised runner computes the function of an eager HF model holding the de-quantised weights
  (chains, trees across the sliding window, 40 random commits: logits within 1e-4 in float32); a
  broken twin (codes off by one in one layer) fails that comparison.
- Losslessness with respect to the quantised model: greedy speculative output (n-gram and model
  drafts) equals the quantised runner's own plain decoding (float32 activations).
- Refusals name the problem: an unknown mode, shapes the kernel does not take, a model the fast path
  does not cover.
"""

from __future__ import annotations

import copy

import pytest
import torch

from treespec.drafting.ngram import NgramConfig, NgramDrafter
from treespec.generate import GenerationConfig, generate
from treespec.models.fast import FastGemmaRunner, make_runner
from treespec.models.fast.quant import dequantize, int4_linear, quantize_codes, quantize_int4
from treespec.models.runner import ModelRunner
from treespec.models.tiny import tiny_model
from treespec.sampling import SamplingConfig
from treespec.tree import TokenTree
from treespec.trees.grow import ShapeDrafter
from treespec.trees.shape import TreeShape

V = 64
GREEDY = GenerationConfig(max_new_tokens=40, sampling=SamplingConfig(0.0), stop_on_eos=False)


def gemma(seed=0, dtype=torch.float32, logit_scale=1.0):
    return tiny_model("gemma3", V, seed=seed, num_layers=4, dtype=dtype, logit_scale=logit_scale)


def dequantised_copy(model):
    """The slow reference: an eager model whose linear weights are the int4 grid's values (the LM head
    quantised, the tied input embedding kept: the runner reads one embedding row per token as loaded)."""
    ref = copy.deepcopy(model)
    ref.lm_head.weight = torch.nn.Parameter(ref.lm_head.weight.detach().clone())
    with torch.no_grad():
        for mod in ref.modules():
            if isinstance(mod, torch.nn.Linear):
                codes, sz = quantize_codes(mod.weight)
                mod.weight.copy_(dequantize(codes, sz).to(mod.weight.dtype))
    return ref


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-4), (torch.bfloat16, 0.06)])
def test_int4_product_equals_the_dequantised_weight(dtype, atol):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 96, generator=g) * 0.05
    x = torch.randn(5, 96, generator=g).to(dtype)
    q = quantize_int4(w.to(dtype))
    codes, sz = quantize_codes(w.to(dtype))
    ref = x.float() @ dequantize(codes, sz.to(dtype)).T
    out = int4_linear(x, q)
    assert out.dtype == dtype and out.shape == (5, 48)
    torch.testing.assert_close(out.float(), ref, atol=atol, rtol=0)
    assert float((out.float() - ref).abs().max()) < float(ref.abs().max()) * 0.02
    assert q.nbytes <= w.numel() * 0.75  # 4 bits + a (scale, offset) pair per 32 weights: <= 3/8 of bf16


def test_a_grid_weight_comes_back_exactly():
    g = torch.Generator().manual_seed(1)
    out, inp = 32, 64
    a = torch.rand(out, inp // 32, 1, generator=g) * 0.01 + 1e-3  # per-group step and offset
    b = torch.randn(out, inp // 32, 1, generator=g) * 0.02
    c = torch.randint(0, 16, (out, inp // 32, 32), generator=g)
    c[..., 0], c[..., 1] = 0, 15  # every group uses its lowest and highest level, as min/max grids do
    w = (a * c + b).reshape(out, inp)
    codes, sz = quantize_codes(w)
    torch.testing.assert_close(dequantize(codes, sz), w, atol=1e-7, rtol=1e-6)
    other = torch.randn(out, inp, generator=g)
    codes, sz = quantize_codes(other)
    step = sz[..., 0].transpose(0, 1).repeat_interleave(32, dim=1)  # [out, in]
    assert bool(((dequantize(codes, sz) - other).abs() <= step / 2 + 1e-6).all())


def tree_outputs(runner, prefix_len, seed):
    gen = torch.Generator().manual_seed(seed)
    seq = torch.randint(0, V, (prefix_len,), generator=gen)
    outs = [runner.forward(None, None, seq[:-1])["logits"]]
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, 12)]
    tree = TokenTree.from_lists(parents, [int(seq[-1])] + torch.randint(0, V, (11,), generator=gen).tolist())
    outs.append(runner.forward(tree, torch.arange(tree.num_nodes))["logits"])
    return outs


class OffByOneCodes(FastGemmaRunner):
    """Broken twin: the gate projection of layer 1 is quantised with every code one step up."""

    def refresh(self):
        super().refresh()
        mlp = self.model.model.layers[1].mlp
        codes, sz = quantize_codes(mlp.gate_proj.weight)
        gate = dequantize((codes + 1).clamp(max=15), sz).to(mlp.gate_proj.weight.dtype)
        self.layers[1] = self.layers[1]._replace(gate_up=quantize_int4(torch.cat([gate, mlp.up_proj.weight])))


@pytest.mark.parametrize("prefix_len", [2, 21])  # 21 > the sliding window of 8
def test_quantised_runner_is_the_dequantised_model(prefix_len):
    model = gemma(seed=prefix_len)
    ref = ModelRunner(dequantised_copy(model))
    mine = FastGemmaRunner(model, quantize="int4")
    for a, b in zip(tree_outputs(mine, prefix_len, 3), tree_outputs(ref, prefix_len, 3)):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)
    broken = OffByOneCodes(model, quantize="int4")
    with pytest.raises(AssertionError):
        for a, b in zip(tree_outputs(broken, prefix_len, 3), tree_outputs(ModelRunner(dequantised_copy(model)),
                                                                          prefix_len, 3)):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=0)


def test_commits_keep_the_quantised_cache_exact():
    model = gemma(seed=5)
    runner, ref = FastGemmaRunner(model, quantize="int4", capacity=16), ModelRunner(dequantised_copy(model))
    gen = torch.Generator().manual_seed(2)
    seq = torch.randint(0, V, (4,), generator=gen).tolist()
    runner.forward(None, None, torch.tensor(seq[:-1]))
    ref.forward(None, None, torch.tensor(seq[:-1]))
    for _ in range(40):
        n = int(torch.randint(1, 7, (1,), generator=gen))
        parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)]
        tree = TokenTree.from_lists(parents, [seq[-1]] + torch.randint(0, V, (n - 1,), generator=gen).tolist())
        a = runner.forward(tree, torch.arange(n))["logits"]
        b = ref.forward(tree, torch.arange(n))["logits"]
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)
        path = tree.root_path(int(torch.randint(0, n, (1,), generator=gen)))
        runner.commit(path)
        ref.commit(path)
        seq += tree.tokens[path[1:]].tolist() + [int(torch.randint(0, V, (1,), generator=gen))]


@pytest.mark.parametrize("draft", ["ngram", "model_tree"])
def test_speculation_reproduces_the_quantised_plain_decoding(draft):
    model = gemma(seed=0, logit_scale=8)
    for prompt in ([3, 4, 5, 6, 7, 3, 4, 5], [9]):
        plain = generate(FastGemmaRunner(model, quantize="int4"), prompt, None, GREEDY).token_ids
        drafter = (NgramDrafter(NgramConfig(depth=5, branches=3)) if draft == "ngram" else
                   ShapeDrafter(gemma(seed=1, logit_scale=8), TreeShape.widths((2, 2, 1)), "iid"))
        spec = generate(FastGemmaRunner(model, quantize="int4"), prompt, drafter, GREEDY).token_ids
        assert spec == plain
    # and the quantised model is a different model: its greedy text differs from the float one somewhere
    float_plain = [generate(model, p, None, GREEDY).token_ids for p in ([3, 4, 5, 6, 7, 3, 4, 5], [9], [17, 2])]
    int4_plain = [generate(FastGemmaRunner(model, quantize="int4"), p, None, GREEDY).token_ids
                  for p in ([3, 4, 5, 6, 7, 3, 4, 5], [9], [17, 2])]
    assert float_plain != int4_plain


def test_refusals_name_the_problem():
    with pytest.raises(ValueError, match="unknown quantisation 'int3'"):
        FastGemmaRunner(gemma(), quantize="int3")
    with pytest.raises(ValueError, match="needs the fast runner"):
        make_runner(tiny_model("llama", V), quantize="int4")
    with pytest.raises(ValueError, match="multiple of the group size"):
        quantize_int4(torch.randn(16, 40))
    with pytest.raises(ValueError, match="multiple of 16"):
        quantize_int4(torch.randn(8, 32))
    # q/k/v are quantised as one stacked weight: one KV head of 8 dims beside 4 query heads gives
    # (4 + 2) * 8 = 48 rows (covered); a single query head gives 24 rows: refused by name
    from transformers import Gemma3ForCausalLM

    config = tiny_model("gemma3", V, num_layers=2).config
    config.num_key_value_heads = 1
    assert FastGemmaRunner(Gemma3ForCausalLM(config).eval(), quantize="int4").quantize == "int4"
    config.num_attention_heads = 1
    with pytest.raises(ValueError, match=r"\(24, 32\) weight.*multiple of 16"):
        FastGemmaRunner(Gemma3ForCausalLM(config).eval(), quantize="int4")
    assert type(make_runner(gemma(), quantize="int4")) is FastGemmaRunner


def test_weight_streaming_counts_the_bytes_a_step_reads():
    from treespec.calibration import measure_weight_stream, runner_weights

    model = gemma(dtype=torch.bfloat16)
    full_s, full_bytes = measure_weight_stream(model, repeats=1)
    params = {p.data_ptr(): p.numel() * p.element_size() for p in [*model.parameters(), *model.buffers()]}
    assert full_bytes == sum(params.values())  # the tied embedding / LM head once
    runner = FastGemmaRunner(model, quantize="int4")
    _, q_bytes = measure_weight_stream(runner_weights(runner), repeats=1)
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    # 4-bit codes (half a byte per weight) + a bf16 (scale, offset) pair per 32 weights + the norms
    assert linear // 2 + linear // 8 <= q_bytes < linear // 2 + linear // 8 + 4 * 32 * 64
    assert full_s > 0
