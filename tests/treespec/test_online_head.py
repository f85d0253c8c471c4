"""Online fine-tuning of the draft head while serving (:class:`treespec.drafting.online_head.OnlineHeadDrafter`).

1. Greedy output equals plain greedy decoding (fp32) while the head is updated every few tokens,
   and the updates really change the head and keep its cache consistent (the rebuilt committed
   entries equal a fresh teacher-forced pass with the new weights).
2. Output law at T = 1: ONE online drafter serves all N = 400 requests (seeds 0..399), learning all
   along; the first three generated tokens follow the exact target law (G test, cells of expected
   count < 5 pooled, alpha = 1e-3). Twin: the same drafter with its draft probabilities replaced by
   a uniform q the children were not drawn from must fail the test. Power (stats_helpers): at N = 400, alpha = 1e-3, power 0.9 and df 10 it detects KL >= 0.044 nats,
   i.e. any total-variation shift >= 0.15.
"""

import copy

import pytest
import torch

from treespec.drafting.online_head import OnlineHeadConfig, OnlineHeadDrafter
from treespec.generate import GenerationConfig, generate
from treespec.sampling import SamplingConfig
from treespec.trees.grow import ShapeDrafter
from treespec.trees.shape import TreeShape

from .test_distill import _small_head, corpus, prompts, target, trained  # noqa: F401
from .test_end_to_end_stats import ALPHA, PROMPT, UniformQ, exact_law, g_test

N = 400


def test_greedy_identity_while_learning(target, trained):  # noqa: F811
    _, head, _ = trained
    head = copy.deepcopy(head)
    before = [p.detach().clone() for p in head.parameters() if p.requires_grad]
    online = OnlineHeadDrafter(ShapeDrafter(head, TreeShape.widths((2, 1, 1)), "iid"),
                               OnlineHeadConfig(lr=1e-2, update_every=4, window=64))
    cfg = GenerationConfig(max_new_tokens=40, sampling=SamplingConfig(0.0), stop_on_eos=False)
    for prompt in [prompts()[1][:12], prompts()[2][:6] * 2, prompts()[3][:9]]:
        plain = generate(target, prompt, None, cfg).token_ids
        assert generate(target, prompt, online, cfg).token_ids == plain
    assert online.updates >= 5
    after = [p.detach() for p in head.parameters() if p.requires_grad]
    assert any(not torch.equal(a, b) for a, b in zip(before, after))
    # the rebuilt cache is what a fresh pass of the updated head gives over the committed entries
    d = online.runner
    n = d.entries
    pos = torch.arange(1, n + 1)[None]
    with torch.no_grad():
        x = head.inputs(online.hidden[:n], torch.tensor(online.tokens[1:n + 1]))[None]
        _, k, _ = head.layer.qkv_heads(x, pos)
    if online.since_update == 0:  # the last accept rebuilt the cache
        assert torch.allclose(d.keys, k, atol=1e-5)


def test_config_is_validated():
    with pytest.raises(ValueError):
        OnlineHeadConfig(lr=0.0)
    with pytest.raises(ValueError):
        OnlineHeadConfig(update_every=0)


@pytest.mark.stats
@pytest.mark.parametrize("broken", [False, True])
def test_output_law_at_t1_while_learning(tmp_path, broken):
    small, head = _small_head(tmp_path)
    sampling = SamplingConfig(1.0)
    online = OnlineHeadDrafter(ShapeDrafter(head, TreeShape.widths((2, 2)), "iid"),
                               OnlineHeadConfig(lr=1e-2, update_every=2, window=16))
    drafter = UniformQ(online) if broken else online
    counts: dict[tuple[int, ...], int] = {}
    for seed in range(N):
        out = generate(small, PROMPT, drafter, GenerationConfig(max_new_tokens=3, sampling=sampling, seed=seed,
                                                               stop_on_eos=False, verifier="rrs"))
        counts[tuple(out.token_ids)] = counts.get(tuple(out.token_ids), 0) + 1
    assert online.updates > N // 4  # it kept learning during the whole run
    p_value = g_test(counts, exact_law(small, sampling), N)
    if broken:
        assert p_value < ALPHA, f"the broken twin passed (G-test p = {p_value:.2e})"
    else:
        assert p_value > ALPHA, f"output law differs from the target's (G-test p = {p_value:.2e})"
