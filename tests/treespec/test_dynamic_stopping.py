"""Stopping rules in the dynamic tree builders: EAGLE-2 (:class:`~treespec.trees.eagle2.Eagle2Drafter`) and DySpec
(:class:`~treespec.trees.dyspec.DySpecDrafter`, heap and threshold variants) with
:class:`~treespec.drafting.stopping.ConfidenceStop` and :class:`~treespec.drafting.stopping.PredictedStop`.

1. EAGLE-2 with a confidence rule against a reference written from the definition: a loop that asks the draft
   model for each frontier node's distribution with a plain causal forward over the prompt and the node's root
   path, keeps a node's best ``top_k`` candidates down to the first below the threshold, expands the ``top_k``
   most valuable kept ones, and reranks. The same reference without the rule disagrees with the builder under
   the rule (so the comparison sees the rule).
2. DySpec under a confidence rule, from the definition, node by node (the draft's probability of every node
   given its root path, from a causal forward): with deterministic candidates no node is below the threshold;
   with sampled children every node that has children reaches it, and children below it do occur (kept, as
   leaves). A twin that ignores the rule's verdicts fails both checks.
3. Greedy output with either rule equals plain decoding (both builders).
4. The output law at T = 1 (setup of test_end_to_end_stats: vocabulary 6, prompt [1, 2, 3], G test at alpha 1e-3,
   cells of expected count < 5 pooled): DySpec's sampled trees under the confidence rule, and under SpecDec++'s
   rule with an acceptance head (seeds 0..999, N = 1000); each twin tells the verifier a uniform q the children
   were not drawn from and must fail. EAGLE-2's candidates under the confidence rule are deterministic (seeds
   0..399, N = 400): their twin is a deterministic verifier whose residual keeps the rejected candidates and must fail.
"""

from __future__ import annotations

import math

import pytest
import torch

from treespec import verify as verify_mod
from treespec.drafting.base import DraftState
from treespec.drafting.laws import top_order
from treespec.drafting.stopping import ConfidenceStop, PredictedStop
from treespec.generate import GenerationConfig, generate
from treespec.models.tiny import tiny_model
from treespec.sampling import SamplingConfig, logits_to_probs
from treespec.trees.dyspec import DySpecDrafter
from treespec.trees.eagle2 import Eagle2Drafter
from treespec.verify.core import verify_tree
from treespec.verify.rules import deterministic_rule

from .test_end_to_end_stats import ALPHA, UniformQ, exact_law, g_test, sample_counts
from .test_stopping import acceptance_head

V = 48
T1 = SamplingConfig(1.0)


@pytest.fixture(scope="module")
def pair():
    """A target and a draft over a vocabulary of 48 (the draft's distributions spread enough that a threshold of
    0.2 keeps some candidates and drops others)."""
    return tiny_model("llama", V, seed=0, logit_scale=3.0), tiny_model("llama", V, seed=7, logit_scale=3.0)


def draft_probs(draft, prompt: list[int], path: list[int]) -> torch.Tensor:
    """``[V]`` the draft's softmax after ``prompt + path`` (one causal forward: the slow, obvious way)."""
    with torch.no_grad():
        logits = draft(torch.tensor([prompt + path])).logits[0, -1].float()
    return torch.softmax(logits, dim=-1)


def root_paths(tree) -> list[list[int]]:
    """Each node's tokens below the root (the root's: empty)."""
    parents, tokens = tree.parents.tolist(), tree.tokens.tolist()
    paths: list[list[int]] = []
    for node, parent in enumerate(parents):
        paths.append([] if parent < 0 else paths[parent] + [tokens[node]])
    return paths


def propose(drafter, prompt: list[int], temperature: float, seed: int, max_depth: int = 8):
    drafter.begin(prompt)
    return drafter.propose(DraftState(prompt, max_depth, None), SamplingConfig(temperature),
                           torch.Generator().manual_seed(seed)).tree


def eagle2_reference(draft, prompt: list[int], num_nodes: int, top_k: int, depth: int,
                     min_confidence: float) -> tuple[list[int], list[int]]:
    """(parents, tokens) of EAGLE-2's tree with a confidence rule, from the definition (module docstring, 1)."""
    parents, tokens, value, paths = [-1], [prompt[-1]], [0.0], [[]]
    frontier = [0]
    for _ in range(depth):
        growing = []
        for node in frontier:
            q = draft_probs(draft, prompt, paths[node])
            for col in top_order(q[None], min(top_k, V))[0].tolist():
                if q[col] < min_confidence:
                    break
                growing.append(len(tokens))
                parents.append(node)
                tokens.append(col)
                value.append(value[node] + math.log(float(q[col])))
                paths.append(paths[node] + [col])
        frontier = sorted(sorted(growing, key=lambda i: (-value[i], i))[:top_k])
        if not frontier:
            break
    keep = {0}
    for i in sorted(range(1, len(tokens)), key=lambda i: (-value[i], i)):
        if len(keep) > num_nodes:
            break
        if parents[i] in keep:
            keep.add(i)
    kept = sorted(keep)
    index = {old: new for new, old in enumerate(kept)}
    return [-1] + [index[parents[i]] for i in kept[1:]], [tokens[i] for i in kept]


def test_eagle2_with_a_confidence_rule_follows_its_definition(pair):
    _, draft = pair
    differs = 0
    for seed in range(6):
        prompt = torch.randint(0, V, (4 + seed,), generator=torch.Generator().manual_seed(seed)).tolist()
        tree = propose(Eagle2Drafter(draft, 10, top_k=3, depth=4, min_confidence=0.2), prompt, 0.0, seed)
        want = eagle2_reference(draft, prompt, 10, 3, 4, 0.2)
        assert (tree.parents.tolist(), tree.tokens.tolist()) == want, f"prompt {prompt}"
        differs += want != eagle2_reference(draft, prompt, 10, 3, 4, 0.0)
    assert differs > 0, "the rule never changed a tree: the comparison would not see it"


class IgnoresVerdicts(ConfidenceStop):
    """Deliberately broken: decides like the rule, then keeps and grows every child."""

    def decide(self, deterministic, q, columns, feature, parent_accept, depth):
        out = super().decide(deterministic, q, columns, feature, parent_accept, depth)
        every = torch.ones_like(out.keep)
        return type(out)(every, every, out.path_accept)


def check_confidence(draft, tree, prompt: list[int], threshold: float, deterministic: bool,
                     temperature: float) -> int:
    """The confidence rule's definition on a proposed tree (module docstring, 2); returns how many kept leaves are
    below the threshold (sampled children only)."""
    parents = tree.parents.tolist()
    has_children = {p for p in parents if p >= 0}
    paths = root_paths(tree)
    below = 0
    for node in range(1, tree.num_nodes):
        parent_path = paths[parents[node]]
        if deterministic:
            q = draft_probs(draft, prompt, parent_path)
        else:
            with torch.no_grad():
                logits = draft(torch.tensor([prompt + parent_path])).logits[0, -1:]
            q = logits_to_probs(logits, SamplingConfig(temperature))[0]
        prob = float(q[paths[node][-1]])
        if deterministic:
            assert prob >= threshold - 1e-6, f"node {node} (q {prob:.4f}) is below the threshold"
        elif node in has_children:
            assert prob >= threshold - 1e-6, f"node {node} (q {prob:.4f}) grew below the threshold"
        else:
            below += prob < threshold
    return below


@pytest.mark.parametrize("variant", ["heap", "threshold"])
@pytest.mark.parametrize("broken", [False, True])
def test_dyspec_with_a_confidence_rule_follows_its_definition(pair, variant, broken):
    _, draft = pair
    rule = (IgnoresVerdicts if broken else ConfidenceStop)(0.2)
    threshold_kw = {"threshold": 0.001} if variant == "threshold" else {}
    below, failures = 0, 0
    for seed in range(6):
        prompt = torch.randint(0, V, (4 + seed,), generator=torch.Generator().manual_seed(seed)).tolist()
        for temperature, law in ((0.0, "deterministic"), (1.0, "without_replacement")):
            drafter = DySpecDrafter(draft, 12, 4, variant=variant, law=law, stop=rule, **threshold_kw)
            tree = propose(drafter, prompt, temperature, seed)
            try:
                below += check_confidence(draft, tree, prompt, 0.2, law == "deterministic", temperature)
            except AssertionError:
                if not broken:
                    raise
                failures += 1
    if broken:
        assert failures > 0, "the twin that ignores the rule passed the definition"
    else:
        assert below > 0, "no sampled child below the threshold was kept: the sampled check saw nothing"


def test_greedy_output_with_the_rules_equals_plain(pair):
    target, draft = pair
    cfg = GenerationConfig(max_new_tokens=20, sampling=SamplingConfig(0.0), stop_on_eos=False)
    makers = {
        "eagle2": lambda: Eagle2Drafter(draft, 8, top_k=3, depth=4, min_confidence=0.2),
        "dyspec_heap": lambda: DySpecDrafter(draft, 8, 4, law="deterministic", min_confidence=0.2),
        "dyspec_threshold": lambda: DySpecDrafter(draft, 8, 4, variant="threshold", threshold=0.001,
                                                  min_confidence=0.2),
    }
    for prompt in ([3, 9, 14, 2], [5], [1, 2, 3, 4, 5, 6, 7, 8]):
        plain = generate(target, prompt, None, cfg).token_ids
        for name, make in makers.items():
            assert generate(target, prompt, make(), cfg).token_ids == plain, f"{name} on {prompt}"


@pytest.mark.parametrize("reader", ["draft model", "head"])
def test_predicted_stop_shapes_dynamic_trees_and_keeps_greedy_output(pair, reader):
    """SpecDec++'s rule (an acceptance head reading the draft's features) in both builders, over a draft model and
    over an EAGLE-style head (test_stopping's, on a tiny Gemma-3 target): greedy output equals plain decoding,
    and the rule makes the trees shallower than without it."""
    from treespec.drafting.head import new_head

    if reader == "head":
        target = tiny_model("gemma3", 128, seed=0, logit_scale=6.0)
        draft = new_head(target, torch.arange(0, 128, 2), num_heads=2, seed=1).eval()
        width = draft.cfg.hidden_size
    else:
        target, draft = pair
        width = draft.config.hidden_size
    ah = acceptance_head(width, seed=2)
    cfg = GenerationConfig(max_new_tokens=16, sampling=SamplingConfig(0.0), stop_on_eos=False)
    prompt = list(range(3, 40, 3))
    plain = generate(target, prompt, None, cfg).token_ids
    makers = {
        "eagle2": lambda stop: Eagle2Drafter(draft, 30, top_k=3, depth=4, stop=stop),
        "dyspec_heap": lambda stop: DySpecDrafter(draft, 12, 4, law="deterministic", stop=stop),
    }
    shaped = 0
    for name, make in makers.items():
        assert generate(target, prompt, make(PredictedStop(ah, 0.2)), cfg).token_ids == plain, name
        with_rule, without = [], []
        for seed in range(6):
            p = prompt[: 4 + seed]
            hidden = target.base_model(input_ids=torch.tensor([p[:-1]])).last_hidden_state[0] \
                if reader == "head" else None
            for stop, depths in ((PredictedStop(ah, 0.2), with_rule), (None, without)):
                drafter = make(stop)
                drafter.begin(p)
                tree = drafter.propose(DraftState(p, 8, hidden), SamplingConfig(0.0), torch.Generator()).tree
                depths.append(int(tree.max_depth))
        # a path stops once its predicted chance of a rejection passes 0.2: never deeper than without the rule
        assert all(a <= b for a, b in zip(with_rule, without)), f"{name}: {with_rule} against {without}"
        shaped += sum(with_rule) < sum(without)
        if name == "eagle2":  # every candidate of 4 levels fits its 30 nodes: only the rule makes its trees shallower
            assert sum(with_rule) < sum(without), f"eagle2: the rule made no tree shallower ({with_rule})"
    assert shaped > 0, "the rule made no tree shallower"


@pytest.fixture(scope="module")
def law_pair():
    """test_end_to_end_stats' target and draft (vocabulary 6), whose exact three-token law is known."""
    return tiny_model("llama", 6, seed=0, logit_scale=6.0), tiny_model("llama", 6, seed=5, logit_scale=6.0)


#: samples per law test: at N = 400 the uniform-q twin of a DySpec tree under the confidence rule reached only
#: p = 1.8e-3 (its trees are shallow: the rule stops growth), at N = 1000 it fails at p < 1e-7
N_LAW = 1000


@pytest.mark.stats
@pytest.mark.parametrize("broken", [False, True])
@pytest.mark.parametrize("rule", ["confidence", "predicted"])
def test_dyspec_output_law_at_t1_with_a_rule(law_pair, rule, broken):
    """Seeds 0..999; the rules bite here (the heap's trees of 5 nodes reach depth 1.0 to 1.5 on average under
    them against about 1.9 without, over the process's states)."""
    target, draft = law_pair

    def make():
        stop = ConfidenceStop(0.3) if rule == "confidence" else \
            PredictedStop(acceptance_head(draft.config.hidden_size, seed=4), 0.45)
        drafter = DySpecDrafter(draft, 5, 3, stop=stop)
        return UniformQ(drafter) if broken else drafter  # the twin: the verifier is told a q not drawn from

    counts = sample_counts(target, make, "rrs_without_replacement", T1, n=N_LAW)
    p_value = g_test(counts, exact_law(target, T1), N_LAW)
    if broken:
        assert p_value < ALPHA, f"the broken twin passed (G-test p = {p_value:.2e})"
    else:
        assert p_value > ALPHA, f"output law differs from the target's (G-test p = {p_value:.2e})"


def _residual_keeps_the_candidates(p, q, child_tokens, child_valid):
    """Deliberately broken deterministic verification: after the candidates are rejected, the bonus token is drawn
    from p itself instead of p without them (the rejected candidates can come back)."""
    choice, _ = deterministic_rule(p, q, child_tokens, child_valid)
    return choice, p


@pytest.mark.stats
@pytest.mark.parametrize("broken", [False, True])
def test_eagle2_output_law_at_t1_with_a_rule(law_pair, broken, monkeypatch):
    """EAGLE-2's candidates under the confidence rule, verified as deterministic candidates (seeds 0..399,
    N = 400); the twin verifies them with :func:`_residual_keeps_the_candidates` and must fail."""
    target, draft = law_pair
    if broken:
        monkeypatch.setitem(verify_mod.VERIFIERS, "deterministic",
                            lambda tree, tp, dp, g=None: verify_tree(tree, tp, dp, g, _residual_keeps_the_candidates))
    n = 400
    counts = sample_counts(target, lambda: Eagle2Drafter(draft, 5, top_k=2, depth=3, min_confidence=0.3),
                           "deterministic", T1, n=n)
    p_value = g_test(counts, exact_law(target, T1), n)
    if broken:
        assert p_value < ALPHA, f"the broken twin passed (G-test p = {p_value:.2e})"
    else:
        assert p_value > ALPHA, f"output law differs from the target's (G-test p = {p_value:.2e})"
