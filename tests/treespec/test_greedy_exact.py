"""Greedy exactness: tree-speculative greedy output is token-identical to plain greedy decoding
(our loop and Hugging Face ``generate``), for chains, trees and model-free drafts, on tiny random
Llama, GPT-2 and Gemma-3 models (fp32; the Gemma-3 generation crosses its sliding window of 8)."""

import pytest
import torch

from treespec.drafting.ngram import NgramConfig, NgramDrafter
from treespec.generate import GenerationConfig, generate
from treespec.models.tiny import ARCHITECTURES, tiny_model
from treespec.sampling import SamplingConfig
from treespec.trees.grow import ShapeDrafter
from treespec.trees.shape import TreeShape

GREEDY = GenerationConfig(max_new_tokens=40, sampling=SamplingConfig(0.0), stop_on_eos=False)
PROMPTS = [[3, 4, 5, 6, 7, 3, 4, 5], [9], [10, 11, 12, 10, 11]]

DRAFTS = {
    "chain4": lambda arch: ShapeDrafter(tiny_model(arch, 64, seed=1, logit_scale=8), TreeShape.chain(4), "iid"),
    "tree221": lambda arch: ShapeDrafter(tiny_model(arch, 64, seed=1, logit_scale=8), TreeShape.widths((2, 2, 1)), "iid"),
    # the target drafting for itself: every draft is accepted, so long paths and leaf commits are exercised
    "self_tree": lambda arch: ShapeDrafter(tiny_model(arch, 64, seed=0, logit_scale=8), TreeShape.widths((3, 2, 1)), "iid"),
    "ngram": lambda arch: NgramDrafter(NgramConfig(depth=5, branches=3)),
    "ngram_adaptive": lambda arch: NgramDrafter(NgramConfig(depth=8, branches=1, adaptive=True, start_depth=2)),
}


@pytest.fixture(scope="module", params=ARCHITECTURES)
def target(request):
    return request.param, tiny_model(request.param, 64, seed=0, logit_scale=8)


@pytest.mark.parametrize("draft", sorted(DRAFTS))
def test_greedy_output_identical_to_plain(target, draft):
    arch, model = target
    for prompt in PROMPTS:
        plain = generate(model, prompt, None, GREEDY).token_ids
        hf = model.generate(torch.tensor([prompt]), max_new_tokens=40, min_new_tokens=40, do_sample=False,
                            attention_mask=torch.ones(1, len(prompt), dtype=torch.long))[0, len(prompt):].tolist()
        assert plain == hf, "our plain loop must agree with Hugging Face greedy decoding"
        spec = generate(model, prompt, DRAFTS[draft](arch), GREEDY)
        assert spec.token_ids == plain
        assert len(spec.token_ids) == GREEDY.max_new_tokens
    if draft == "self_tree":
        assert spec.tau > 3.5  # all 3 levels accepted + bonus on (nearly) every step


def test_eos_inside_accepted_path_ends_generation_there():
    model = tiny_model("llama", 64, seed=0, logit_scale=8)
    prompt = PROMPTS[0]
    plain = generate(model, prompt, None, GREEDY).token_ids
    eos = plain[12]  # a token the greedy continuation emits mid-way
    first = plain.index(eos)
    drafter = ShapeDrafter(tiny_model("llama", 64, seed=0, logit_scale=8), TreeShape.widths((2, 2, 2, 2)), "iid")
    out = generate(model, prompt, drafter, GREEDY.__class__(max_new_tokens=40, sampling=SamplingConfig(0.0)),
                   eos_ids={eos})
    assert out.token_ids == plain[: first + 1]
    assert out.stopped_on_eos


@pytest.mark.parametrize("max_new", [1, 2, 7, 13])
def test_max_new_tokens_is_exact(max_new):
    model = tiny_model("gpt2", 64, seed=0, logit_scale=8)
    drafter = ShapeDrafter(tiny_model("gpt2", 64, seed=0, logit_scale=8), TreeShape.widths((2, 2, 2, 2)), "iid")
    cfg = GenerationConfig(max_new_tokens=max_new, sampling=SamplingConfig(0.0), stop_on_eos=False)
    out = generate(model, PROMPTS[0], drafter, cfg)
    assert len(out.token_ids) == max_new
    assert out.token_ids == generate(model, PROMPTS[0], None, cfg).token_ids


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_caches_after_generation_equal_fresh_prefill(temperature):
    """After 60+ speculative steps, the target's and the draft's caches hold exactly the committed
    sequence (the draft may lag by the accepted leaves it never processed)."""
    from treespec.models.runner import ModelRunner

    target = ModelRunner(tiny_model("gemma3", 64, seed=0, logit_scale=8))
    drafter = ShapeDrafter(tiny_model("gemma3", 64, seed=1, logit_scale=8), TreeShape.widths((2, 2, 1)), "iid")
    cfg = GenerationConfig(max_new_tokens=150, sampling=SamplingConfig(temperature), stop_on_eos=False, seed=0)
    out = generate(target, PROMPTS[0], drafter, cfg)
    assert out.target_calls >= 50
    seq = PROMPTS[0] + out.token_ids
    assert target.length == target.cache_length == len(seq) - 1
    assert drafter.runner.length == drafter.runner.cache_length <= len(seq) - 1
    for runner in (target, drafter.runner):
        fresh = ModelRunner(runner.model)
        fresh.forward(None, None, torch.tensor(seq[: runner.length]), need_logits=False)
        for mine, ref in zip(runner.cache.layers, fresh.cache.layers):
            torch.testing.assert_close(mine.keys, ref.keys, atol=1e-5, rtol=0)
            torch.testing.assert_close(mine.values, ref.values, atol=1e-5, rtol=0)


def test_adaptive_ngram_depth_follows_acceptance():
    from treespec.verify import VerifyResult

    drafter = NgramDrafter(NgramConfig(depth=6, branches=1, adaptive=True, start_depth=3))
    drafter.begin([1, 2, 3, 1, 2])
    drafter._proposed_depth = 3
    drafter.accept(VerifyResult([1, 2, 3], [3, 1, 2], 3, True), [3, 1, 2, 3])
    assert drafter.depth == 5
    drafter.accept(VerifyResult([1, 2, 3], [3, 1, 2], 3, True), [3, 1, 2, 3])
    assert drafter.depth == 6  # capped at the configured depth
    drafter.accept(VerifyResult([1], [3], 9, False), [3, 9])
    assert drafter.depth == 5
