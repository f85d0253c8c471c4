"""The online n-gram store: lossless, learns across requests, bounded memory.

Statistical test: vocabulary-6 llama of test_end_to_end_stats, prompt [1, 2, 3]; ONE drafter instance
serves all N = 600 runs (seeds 0..N-1), so its store grows across requests exactly as in serving; the
law of the first three generated tokens at T=1 must equal the exact target law (G test, cells of
expected count < 5 pooled, alpha = 1e-3). Twin: the same trees mislabelled as i.i.d. draws from a
uniform q must fail it. Power (stats_helpers): at N = 600, alpha = 1e-3, power 0.9 and df 10 it detects KL >= 0.029 nats,
i.e. any total-variation shift >= 0.12.
"""

import pytest
import torch

from treespec.drafting.base import Draft
from treespec.drafting.ngram import NgramConfig
from treespec.drafting.online import OnlineNgramConfig, OnlineNgramDrafter
from treespec.generate import GenerationConfig, generate
from treespec.models.tiny import tiny_model
from treespec.sampling import SamplingConfig
from treespec.tree import TokenTree

from .test_end_to_end_stats import PROMPT, exact_law, g_test


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", 64, seed=1, logit_scale=4.0)


def test_greedy_identical_and_learns_across_requests(model):
    cfg = GenerationConfig(max_new_tokens=40, sampling=SamplingConfig(0.0), stop_on_eos=False)
    drafter = OnlineNgramDrafter(OnlineNgramConfig(NgramConfig(depth=8, branches=2, max_nodes=12)))
    prompts = [[3, 9, 27, 17], [5, 6, 7], [3, 9, 27, 17]]  # the third repeats the first
    calls = []
    for prompt in prompts:
        plain = generate(model, prompt, None, cfg).token_ids
        out = generate(model, prompt, drafter, cfg)
        assert out.token_ids == plain
        calls.append(out.target_calls)
    # the repeated request is drafted from the first one's stored output: far fewer target passes
    assert calls[2] <= calls[0] // 3, calls
    assert drafter.requests == 3


def test_store_is_bounded_and_keeps_working(model):
    cfg = GenerationConfig(max_new_tokens=30, sampling=SamplingConfig(0.0), stop_on_eos=False)
    drafter = OnlineNgramDrafter(OnlineNgramConfig(NgramConfig(depth=4, branches=1), max_store_tokens=80))
    for i in range(6):
        prompt = [1 + i, 2 + i, 3 + i]
        assert generate(model, prompt, drafter, cfg).token_ids == generate(model, prompt, None, cfg).token_ids
        assert len(drafter.store) <= 80
    # every indexed position points inside the store, right after its n-gram
    for gram, positions in drafter.index.items():
        for pos in positions:
            assert tuple(drafter.store[pos - len(gram):pos]) == gram
    with pytest.raises(ValueError, match="max_store_tokens"):
        OnlineNgramConfig(max_store_tokens=10)


class _Mislabelled(OnlineNgramDrafter):
    """Deliberately broken: deterministic candidates passed off as i.i.d. draws from a uniform q."""

    def propose(self, state, sampling, generator):
        tree = super().propose(state, sampling, generator).tree
        return Draft(TokenTree(tree.parents, tree.tokens, "iid"), torch.full((tree.num_nodes, 6), 1 / 6))


@pytest.mark.stats
@pytest.mark.parametrize("broken", [False, True])
def test_law_at_t1_with_a_store_shared_by_all_runs(broken):
    small = tiny_model("llama", 6, seed=0, logit_scale=6.0)
    cls = _Mislabelled if broken else OnlineNgramDrafter
    drafter = cls(OnlineNgramConfig(NgramConfig(depth=3, branches=2, min_ngram=1)))
    n, counts, drafted = 600, {}, 0
    for seed in range(n):
        out = generate(small, PROMPT, drafter,
                       GenerationConfig(max_new_tokens=3, sampling=SamplingConfig(1.0), seed=seed, stop_on_eos=False))
        counts[tuple(out.token_ids)] = counts.get(tuple(out.token_ids), 0) + 1
        drafted += sum(s.tree_nodes for s in out.steps)
    assert drafted > n  # the store did propose (from earlier runs too)
    p_value = g_test(counts, exact_law(small, SamplingConfig(1.0)), n)
    if broken:
        assert p_value < 1e-3, f"the broken twin passed (G-test p = {p_value:.2e})"
    else:
        assert p_value > 1e-3, f"output law differs from the target's (G-test p = {p_value:.2e})"
