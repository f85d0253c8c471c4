"""End-to-end losslessness: at temperature > 0 the law of the first three generated tokens under
tree speculation equals the exact target law, for every verifier with its draft law.

Setup: tiny Llama target and draft (vocabulary 6, different seeds), prompt [1, 2, 3], trees of depth
2 (so the three tokens span several speculation steps, cache commits included). The exact law of
the 6^3 three-token continuations is computed from the target's own distributions. Each run uses
seed ``i`` for i in range(N). G test on the 216 cells (cells with expected count < 5 pooled),
N = 1500 samples, significance alpha = 1e-3. The twin test swaps in a deliberately broken RRS
(residual not updated after a rejection) and must be rejected at the same level.
"""

import itertools
import math

import pytest
import torch
from stats_helpers import g_test_law

from treespec import verify as verify_mod
from treespec.drafting.base import Draft
from treespec.drafting.ngram import NgramConfig, NgramDrafter
from treespec.generate import GenerationConfig, generate
from treespec.models.tiny import tiny_model
from treespec.sampling import SamplingConfig, logits_to_probs
from treespec.trees.grow import ShapeDrafter
from treespec.trees.shape import TreeShape
from treespec.verify.core import verify_tree

pytestmark = pytest.mark.stats

V = 6
PROMPT = [1, 2, 3]
N = 1500
#: Power (noncentral chi^2 approximation, G ~ chi^2_df(2 N KL)): at N = 1500, alpha = 1e-3, power 0.9
#: the G test detects a shift of KL >= 0.0117 nats at 11 cells (df 10; 0.0097 at df 5, 0.0144 at df 20),
#: i.e. (Pinsker, KL >= 2 TV^2) any total-variation shift TV >= 0.076 (df 10). Seeds: torch.manual_seed per case.
ALPHA = 1e-3
T1 = SamplingConfig(1.0)

CASES = {  # case: ((per-depth widths, draft law), sampling)
    "single": (((1, 1), "iid"), T1),
    "rrs": (((3, 2), "iid"), T1),
    "rrs_topk_topp": (((3, 2), "iid"), SamplingConfig(0.8, top_k=4, top_p=0.9)),
    "kseq": (((3, 2), "iid"), T1),
    "rrs_without_replacement": (((3, 2), "without_replacement"), T1),
    "deterministic": (((3, 2), "deterministic"), T1),
    "greedy_draft": (((3, 2), "greedy_draft"), T1),
    "spechub": (((2, 2), "spechub"), T1),
    "block": (((1, 1), "iid"), T1),  # block verification of a chain of 2
}


@pytest.fixture(scope="module")
def models():
    target = tiny_model("llama", V, seed=0, logit_scale=6.0)
    draft = tiny_model("llama", V, seed=5, logit_scale=6.0)
    return target, draft


def exact_law(model, sampling: SamplingConfig, prompt: list[int] = PROMPT) -> dict[tuple[int, ...], float]:
    """P(x1, x2, x3 | prompt) from one batched forward over all two-token extensions."""
    ext = torch.tensor(list(itertools.product(range(V), repeat=2)))  # [V^2, 2]
    ids = torch.cat([torch.tensor(prompt).expand(len(ext), -1), ext], dim=1)
    probs = logits_to_probs(model(ids).logits[:, -3:].float(), sampling).double()  # [V^2, 3, V]
    law = {}
    for row, (a, b) in enumerate(ext.tolist()):
        for c in range(V):
            law[(a, b, c)] = float(probs[row, 0, a] * probs[row, 1, b] * probs[row, 2, c])
    return law


g_test = g_test_law  # the shared helper (dict form)


def sample_counts(target, make_drafter, verifier: str, sampling: SamplingConfig, n: int = N) -> dict:
    """Counts of the first three generated tokens over seeds ``0..n-1`` (a fresh drafter per seed)."""
    counts: dict[tuple[int, ...], int] = {}
    cfg_base = dict(max_new_tokens=3, sampling=sampling, stop_on_eos=False, verifier=verifier)
    for seed in range(n):
        out = generate(target, PROMPT, make_drafter(), GenerationConfig(seed=seed, **cfg_base))
        key = tuple(out.token_ids)
        counts[key] = counts.get(key, 0) + 1
    return counts


@pytest.mark.parametrize("case", sorted(CASES))
def test_first_three_tokens_follow_target_law(models, case):
    target, draft = models
    (widths, law), sampling = CASES[case]
    verifier = "rrs" if case == "rrs_topk_topp" else case
    counts = sample_counts(target, lambda: ShapeDrafter(draft, TreeShape.widths(widths), law), verifier, sampling)
    p_value = g_test(counts, exact_law(target, sampling), N)
    assert p_value > ALPHA, f"{case}: output law differs from the target's (G-test p = {p_value:.2e})"


@pytest.mark.parametrize("adaptive", [False, True])
def test_ngram_candidates_follow_target_law(models, adaptive):
    target, _ = models
    config = NgramConfig(min_ngram=1, depth=2, branches=3, adaptive=adaptive, start_depth=1)
    counts = sample_counts(target, lambda: NgramDrafter(config), "deterministic", T1)
    assert g_test(counts, exact_law(target, T1), N) > ALPHA


class UniformQ:
    """Deliberately broken drafter wrapper: the children stay drawn from the inner drafter's q, the
    verifier is told q is uniform (the twin of every G test of a sampled draft law)."""

    def __init__(self, inner):
        self.inner = inner
        self.feature_layers = tuple(getattr(inner, "feature_layers", ()))  # the target layers the inner one reads

    def law(self, sampling):
        return self.inner.law(sampling)

    def begin(self, prompt):
        self.inner.begin(prompt)

    def propose(self, state, sampling, generator):
        d = self.inner.propose(state, sampling, generator)
        if d.draft_probs is None:  # a root-only tree (the last step)
            return d
        return Draft(d.tree, torch.full_like(d.draft_probs, 1.0 / d.draft_probs.shape[1]))

    def accept(self, result, emitted):
        self.inner.accept(result, emitted)


def _broken_rrs_rule(p, q, child_tokens, child_valid):
    """RRS that forgets to update the residual after a rejection (a classic bug)."""
    m, k = child_tokens.shape
    alive = torch.ones(m, 1, dtype=p.dtype)
    choice = torch.zeros(m, k + 1, dtype=p.dtype)
    for i in range(k):
        x = child_tokens[:, i:i + 1]
        a = (p.gather(1, x) / q.gather(1, x)).clamp(max=1.0) * child_valid[:, i:i + 1]
        choice[:, i:i + 1] = alive * a
        alive = alive * (1 - a)
    choice[:, k:] = alive
    return choice, p


def test_broken_verifier_fails_the_same_test(models, monkeypatch):
    target, draft = models
    monkeypatch.setitem(verify_mod.VERIFIERS, "rrs",
                        lambda tree, tp, dp, g=None: verify_tree(tree, tp, dp, g, _broken_rrs_rule))
    (widths, law), sampling = CASES["rrs"]
    counts = sample_counts(target, lambda: ShapeDrafter(draft, TreeShape.widths(widths), law), "rrs", sampling)
    p_value = g_test(counts, exact_law(target, sampling), N)
    assert p_value < ALPHA, f"the broken verifier was not detected (p = {p_value:.3f})"
