"""Self-speculative early-exit drafts share the target's weights and are exact HF models.

Output law at T = 1 (vocabulary-6 Llama with 4 layers, the draft = its first layer): the first three
generated tokens follow the exact target law for an early-exit tree drawn i.i.d. and for the same
tree with confidence-based early stopping (only children the draft gives >= 0.3 get children);
seeds 0..N-1, N = 400, G test with cells of expected count < 5 pooled, alpha = 1e-3. The twin
(draft probabilities replaced by a uniform q the children were not drawn from) must fail.
Power (stats_helpers): at N = 400, alpha = 1e-3, power 0.9 and df 10 it detects KL >= 0.044 nats,
i.e. any total-variation shift >= 0.15.
"""

import pytest
import torch

from treespec.generate import GenerationConfig, generate
from treespec.models.early_exit import early_exit_model
from treespec.models.tiny import tiny_model
from treespec.sampling import SamplingConfig
from treespec.trees.grow import ShapeDrafter
from treespec.trees.shape import TreeShape

from .test_end_to_end_stats import ALPHA, UniformQ, exact_law, g_test, sample_counts

N = 400


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_early_exit_logits_are_the_truncated_target(arch):
    target = tiny_model(arch, 64, seed=0, num_layers=4)
    draft = early_exit_model(target, 2)
    assert all(a is b for a, b in zip(draft.get_output_embeddings().parameters(),
                                      target.get_output_embeddings().parameters()))
    ids = torch.randint(0, 64, (1, 20), generator=torch.Generator().manual_seed(0))
    hidden = target(ids, output_hidden_states=True).hidden_states[2]  # after layer 2, before the final norm
    expected = target.get_output_embeddings()(target.base_model.norm(hidden))
    torch.testing.assert_close(draft(ids).logits, expected, atol=1e-6, rtol=0)


def test_early_exit_draft_is_lossless_at_temperature_zero():
    target = tiny_model("gemma3", 64, seed=0, num_layers=4, logit_scale=8)
    drafter = ShapeDrafter(early_exit_model(target, 3), TreeShape.widths((2, 2, 1)), "iid")
    cfg = GenerationConfig(max_new_tokens=40, sampling=SamplingConfig(0.0), stop_on_eos=False)
    assert generate(target, [5, 6, 7], drafter, cfg).token_ids == generate(target, [5, 6, 7], None, cfg).token_ids


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_early_exit_reads_the_target_cache(arch):
    """Inside the engine the early exit reads its committed keys/values from the target's cache:
    it never feeds a committed token itself, drafts the same trees and q as with its own cache,
    and leaves the target's output unchanged (greedy identity; gemma3 has sliding-window layers)."""
    from treespec.drafting.base import DraftState
    from treespec.models.early_exit import SharedCacheRunner
    from treespec.models.runner import ModelRunner

    target = tiny_model(arch, 64, seed=0, num_layers=4, logit_scale=8)
    drafter = ShapeDrafter(early_exit_model(target, 2), TreeShape.widths((2, 2, 1)), "without_replacement")
    assert isinstance(drafter.runner, SharedCacheRunner)
    fed = []
    forward = drafter.runner.forward

    def counting(tree, nodes, chain=None, **kw):
        fed.append(0 if chain is None else chain.numel())
        return forward(tree, nodes, chain, **kw)

    drafter.runner.forward = counting
    prompt = list(range(3, 40))
    cfg = GenerationConfig(max_new_tokens=30, sampling=SamplingConfig(0.0), stop_on_eos=False)
    assert generate(target, prompt, drafter, cfg).token_ids == generate(target, prompt, None, cfg).token_ids
    assert fed and sum(fed) == 0 and drafter.runner.sharing  # no prefill, no catch-up: the target's cache
    # one proposal with the target's cache vs one with the draft's own: same tree, same q
    runner = ModelRunner(target)
    runner.forward(None, None, torch.tensor(prompt[:-1]), need_logits=False)
    sampling = SamplingConfig(1.0)
    drafts = []
    for shared in (True, False):
        d = ShapeDrafter(early_exit_model(target, 2), TreeShape.widths((2, 2, 1)), "without_replacement")
        d.begin(prompt)
        state = DraftState(prompt, 8, None, runner if shared else None)
        drafts.append(d.propose(state, sampling, torch.Generator().manual_seed(3)))
        assert d.runner.sharing is shared
    assert torch.equal(drafts[0].tree.tokens, drafts[1].tree.tokens)
    torch.testing.assert_close(drafts[0].draft_probs, drafts[1].draft_probs, atol=1e-5, rtol=0)
    assert runner.length == len(prompt) - 1 and not runner.slots  # the target's cache: untouched


def test_bad_layer_count():
    target = tiny_model("llama", 64, num_layers=4)
    with pytest.raises(ValueError, match=r"num_layers must be in \[1, 3\]"):
        early_exit_model(target, 4)


LAW_CASES = {
    "iid": lambda d: ShapeDrafter(d, TreeShape.widths((2, 2)), "iid"),
    "iid_confident": lambda d: ShapeDrafter(d, TreeShape.widths((2, 2)), "iid", min_confidence=0.3),
}


@pytest.mark.stats
@pytest.mark.parametrize("case,broken", [(c, False) for c in sorted(LAW_CASES)] + [("iid", True)])
def test_early_exit_output_law_at_t1(case, broken):
    target = tiny_model("llama", 6, seed=0, num_layers=4, logit_scale=12.0)
    draft = early_exit_model(target, 1)  # its q is far from uniform (0.02..0.48), which the twin needs
    sampling = SamplingConfig(1.0)
    wrap = UniformQ if broken else (lambda d: d)
    counts = sample_counts(target, lambda: wrap(LAW_CASES[case](draft)), "rrs", sampling, n=N)
    p_value = g_test(counts, exact_law(target, sampling), N)
    if broken:
        assert p_value < ALPHA, f"the broken twin passed (G-test p = {p_value:.2e})"
    else:
        assert p_value > ALPHA, f"{case}: output law differs from the target's (G-test p = {p_value:.2e})"
