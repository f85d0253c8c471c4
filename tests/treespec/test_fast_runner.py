"""The fast Gemma-3 runner computes the same function as the eager HF reference runner.

Tiny random Gemma-3 models (sliding window 8, so every test crosses it; 4 query heads over 2 KV
heads, or 1 KV head as in Gemma-3-270M): logits and hidden states of chains and trees (fp32,
atol 1e-5), level-by-level tree feeding, 60 random commits (the cache then equals a fresh eager
prefill, also across a cache growth), greedy identity with model and n-gram drafts, bf16 closeness,
the fallback for uncovered models. A broken twin (wrong rope base, a sliding mask off by one) must
fail the same comparison. Plus one ``gemma`` test on the real Gemma-3-270M.
"""

import functools

import pytest
import torch

from treespec.drafting.ngram import NgramConfig, NgramDrafter
from treespec.generate import GenerationConfig, generate
from treespec.models.fast import FastGemmaRunner, fast_supported, make_runner
from treespec.models.fast.packed import bf16_packing_supported
from treespec.models.runner import ModelRunner
from treespec.models.tiny import tiny_model
from treespec.sampling import SamplingConfig
from treespec.tree import TokenTree
from treespec.trees.grow import ShapeDrafter
from treespec.trees.shape import TreeShape
from trees_common import random_tree as shared_random_tree

ATOL = 1e-5
V = 64
GREEDY = GenerationConfig(max_new_tokens=40, sampling=SamplingConfig(0.0), stop_on_eos=False)


def gemma(seed=0, kv_heads=2, num_layers=4, dtype=torch.float32, logit_scale=1.0, softcap=None):
    model = tiny_model("gemma3", V, seed=seed, num_layers=num_layers, dtype=dtype, logit_scale=logit_scale)
    if kv_heads != model.config.num_key_value_heads:  # rebuild with 1 KV head (Gemma-3-270M's layout)
        from transformers import Gemma3ForCausalLM

        cfg = model.config
        cfg.num_key_value_heads = kv_heads
        torch.manual_seed(seed)
        model = Gemma3ForCausalLM(cfg).to(dtype).eval()
    if softcap is not None:
        model.config.final_logit_softcapping = softcap
    return model


def random_tree(num_nodes, root, gen):
    return shared_random_tree(num_nodes, root, V, gen)


class WrongRope(FastGemmaRunner):
    """Broken twin: global layers use the local rope base."""

    def refresh(self):
        super().refresh()
        self.inv_freq["full_attention"] = self.inv_freq["sliding_attention"]


class MaskOffByOne(FastGemmaRunner):
    """Broken twin: the sliding band keeps one key too many."""

    def _masks(self, visible, q_pos, k_pos):
        self.window += 1
        try:
            return super()._masks(visible, q_pos, k_pos)
        finally:
            self.window -= 1


def tree_logits(runner_cls, model, prefix_len, seed):
    gen = torch.Generator().manual_seed(seed)
    seq = torch.randint(0, V, (prefix_len,), generator=gen)
    runner = runner_cls(model)
    outs = []
    if prefix_len > 1:
        out = runner.forward(None, None, seq[:-1], need_hidden=True)
        outs += [out["logits"], out["hidden"]]
    tree = random_tree(12, int(seq[-1]), gen)
    out = runner.forward(tree, torch.arange(tree.num_nodes), need_hidden=True)
    return outs + [out["logits"], out["hidden"]]


@pytest.mark.parametrize("kv_heads", [1, 2])
@pytest.mark.parametrize("prefix_len", [1, 5, 21])  # 21 > the sliding window of 8
def test_fast_logits_equal_eager(kv_heads, prefix_len):
    model = gemma(kv_heads=kv_heads)
    for mine, ref in zip(tree_logits(FastGemmaRunner, model, prefix_len, prefix_len),
                         tree_logits(ModelRunner, model, prefix_len, prefix_len)):
        torch.testing.assert_close(mine, ref, atol=ATOL, rtol=0)


def test_softcap_matches_eager():
    model = gemma(softcap=0.5, logit_scale=4.0)
    for mine, ref in zip(tree_logits(FastGemmaRunner, model, 21, 0), tree_logits(ModelRunner, model, 21, 0)):
        torch.testing.assert_close(mine, ref, atol=ATOL, rtol=0)


@pytest.mark.parametrize("broken", [WrongRope, MaskOffByOne])
def test_broken_twin_fails(broken):
    """The comparison above detects a wrong rope base and a sliding mask off by one."""
    model = gemma()
    mine, ref = tree_logits(broken, model, 21, 21), tree_logits(ModelRunner, model, 21, 21)
    with pytest.raises(AssertionError):
        for a, b in zip(mine, ref):
            torch.testing.assert_close(a, b, atol=ATOL, rtol=0)


def test_level_by_level_matches_one_pass():
    model = gemma(seed=3)
    gen = torch.Generator().manual_seed(7)
    seq = torch.randint(0, V, (15,), generator=gen)
    tree = random_tree(10, int(seq[-1]), gen)
    ref = ModelRunner(model)
    ref.forward(None, None, seq[:-1])
    full = ref.forward(tree, torch.arange(10))["logits"]
    split = FastGemmaRunner(model)
    first = split.forward(tree, torch.arange(4), seq[:-1])["logits"][-4:]
    second = split.forward(tree, torch.arange(4, 10))["logits"]
    torch.testing.assert_close(torch.cat([first, second]), full, atol=ATOL, rtol=0)


@pytest.mark.parametrize("capacity", [16, 1024])  # 16: the static cache grows (doubles) on the way
def test_commits_then_cache_equals_fresh_prefill(capacity):
    model = gemma(seed=1, kv_heads=1)
    gen = torch.Generator().manual_seed(11)
    runner, ref = FastGemmaRunner(model, capacity=capacity), ModelRunner(model)
    seq = torch.randint(0, V, (5,), generator=gen).tolist()
    runner.forward(None, None, torch.tensor(seq[:-1]))
    ref.forward(None, None, torch.tensor(seq[:-1]))
    for step in range(60):
        tree = random_tree(int(torch.randint(1, 8, (1,), generator=gen)), seq[-1], gen)
        a = runner.forward(tree, torch.arange(tree.num_nodes))["logits"]
        b = ref.forward(tree, torch.arange(tree.num_nodes))["logits"]
        torch.testing.assert_close(a, b, atol=ATOL, rtol=0)
        path = tree.root_path(int(torch.randint(0, tree.num_nodes, (1,), generator=gen)))
        runner.commit(path)
        ref.commit(path)
        seq.extend(tree.tokens[path[1:]].tolist())
        seq.append(int(torch.randint(0, V, (1,), generator=gen)))
        assert runner.length == len(seq) - 1 == runner.cache_length
        assert torch.equal(runner.key_positions, ref.key_positions)
    fresh = ModelRunner(model)
    fresh.forward(None, None, torch.tensor(seq[:-1]))
    for mine, other in zip(runner.cache.layers, fresh.cache.layers):
        torch.testing.assert_close(mine.keys, other.keys, atol=ATOL, rtol=0)
        torch.testing.assert_close(mine.values, other.values, atol=ATOL, rtol=0)
    nxt = runner.forward(TokenTree.chain(seq[-1], []), torch.arange(1))["logits"][0]
    torch.testing.assert_close(nxt, model(torch.tensor([seq])).logits[0, -1].float(), atol=ATOL, rtol=0)
    runner.reset()  # a new request reuses the buffers
    out = runner.forward(None, None, torch.tensor(seq[:9]))["logits"]
    torch.testing.assert_close(out, model(torch.tensor([seq[:9]])).logits[0].float(), atol=ATOL, rtol=0)


DRAFTS = {
    "tree221": lambda: ShapeDrafter(gemma(seed=1, logit_scale=8), TreeShape.widths((2, 2, 1)), "iid"),
    "self_tree_fast": lambda: ShapeDrafter(FastGemmaRunner(gemma(seed=0, logit_scale=8)), TreeShape.widths((3, 2, 1)), "iid"),
    "ngram": lambda: NgramDrafter(NgramConfig(depth=5, branches=3)),
}


@pytest.mark.parametrize("draft", sorted(DRAFTS))
def test_greedy_identity(draft):
    model = gemma(seed=0, logit_scale=8)
    for prompt in ([3, 4, 5, 6, 7, 3, 4, 5], [9]):
        plain = generate(model, prompt, None, GREEDY).token_ids
        assert generate(FastGemmaRunner(model), prompt, None, GREEDY).token_ids == plain
        assert generate(FastGemmaRunner(model), prompt, DRAFTS[draft](), GREEDY).token_ids == plain


def test_early_exit_draft_shares_the_fast_cache():
    from treespec.models.early_exit import early_exit_model

    model = gemma(seed=0, logit_scale=8)
    prompt = [3, 4, 5, 6, 7, 3, 4, 5]
    plain = generate(model, prompt, None, GREEDY).token_ids
    drafter = ShapeDrafter(early_exit_model(model, 2), TreeShape.widths((2, 1)), "iid")
    assert generate(FastGemmaRunner(model), prompt, drafter, GREEDY).token_ids == plain


def decode_logits(runner_cls, model, prefix_len, seed, steps=(1, 2, 1, 3)):
    """Logits of a prefill then of chains of ``steps`` tokens (plain-decoding passes of 1-3 rows)."""
    gen = torch.Generator().manual_seed(seed)
    runner = runner_cls(model)
    outs = [runner.forward(None, None, torch.randint(0, V, (prefix_len,), generator=gen))["logits"]]
    for n in steps:
        outs.append(runner.forward(None, None, torch.randint(0, V, (n,), generator=gen))["logits"])
    return outs


@pytest.mark.parametrize("prepack", [
    pytest.param(True, marks=pytest.mark.skipif(
        not bf16_packing_supported(),
        reason="oneDNN packs no bf16 weights on this CPU (it needs avx512bw/vl/dq or avx_ne_convert)")),
    False])
def test_bf16_equals_eager(prepack):
    """bf16 with one KV head (Gemma-3-270M's layout): the same dtype casts as HF's modules and the
    same products (stacked q/k/v and gate/up, 1-2-row products padded), so the same bits, on tree
    passes and on passes of 1-3 tokens, with or without the prepacked oneDNN weights."""
    model = gemma(seed=2, dtype=torch.bfloat16, kv_heads=1)
    runner = functools.partial(FastGemmaRunner, prepack=prepack)
    pairs = [*zip(tree_logits(runner, model, 21, 5), tree_logits(ModelRunner, model, 21, 5)),
             *zip(decode_logits(runner, model, 9, 3), decode_logits(ModelRunner, model, 9, 3))]
    for mine, ref in pairs:
        assert torch.equal(mine, ref)


def test_fallback_and_refusal():
    llama = tiny_model("llama", V)
    assert fast_supported(llama) is not None
    assert type(make_runner(llama, fast=True)) is ModelRunner
    assert type(make_runner(gemma(), fast=True)) is FastGemmaRunner
    assert type(make_runner(gemma(), fast=False)) is ModelRunner
    with pytest.raises(ValueError, match="ModelRunner"):
        FastGemmaRunner(llama)


@pytest.mark.gemma
def test_real_gemma_fast_runner():
    """Gemma-3-270M: fp32 greedy identity over 32 tokens (plain and with n-gram trees) and the
    prefill logits within 1e-4 (fp32); bf16 logits equal to the eager runner's."""
    from treespec.models.loading import load_model, load_tokenizer

    torch.set_num_threads(2)
    try:
        tok = load_tokenizer("embedded")
        ids = tok("The history of the Roman Empire begins with")["input_ids"]
        config = GenerationConfig(max_new_tokens=32, sampling=SamplingConfig(0.0), stop_on_eos=False)
        model = load_model("embedded", dtype="float32")
        plain = generate(model, ids, None, config).token_ids
        assert generate(FastGemmaRunner(model), ids, None, config).token_ids == plain
        spec = generate(FastGemmaRunner(model), ids, NgramDrafter(NgramConfig(depth=4, branches=2)), config)
        assert spec.token_ids == plain
        a = FastGemmaRunner(model).forward(None, None, torch.tensor(ids))["logits"]
        b = ModelRunner(model).forward(None, None, torch.tensor(ids))["logits"]
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)
        del model
        model = load_model("embedded", dtype="bfloat16")
        a = FastGemmaRunner(model).forward(None, None, torch.tensor(ids))["logits"]
        b = ModelRunner(model).forward(None, None, torch.tensor(ids))["logits"]
        assert torch.equal(a.argmax(-1), b.argmax(-1))
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)  # observed: identical bits
    finally:
        torch.set_num_threads(1)
