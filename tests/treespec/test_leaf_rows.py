"""Target rows for the verified nodes only (``GenerationConfig(leaf_logits=False)``).

A target that pays for each output row (llama.cpp's LM head) may return rows for ``tree.verified_nodes``
alone: the root and every node with children. The verifiers then decide exactly as with every row, and a
path accepted down to a leaf ends without its bonus token.

1. Every verifier, 5 trees x 40 seeds: the outcome from the verified rows equals the outcome from every
   row under the same generator (same path, same next token, None only where the path ends at a leaf);
   the twin reading the verified rows as if they were the first nodes' rows disagrees.
2. Generation: at T=0 the output equals plain greedy decoding; at T=1 (marked ``stats``) the law of the
   first three tokens equals the target's (G test, seeds 0..1499, alpha 1e-3, as in
   ``test_end_to_end_stats``), and the twin that emits the bonus token of a row-less leaf from the
   root's row fails it.
3. Verifier inputs: a tree token below 0, a stopping row with no mass or NaN, are refused by name.
"""

from __future__ import annotations

import pytest
import torch

from test_verifiers import ALL_VERIFIERS, _tree_for
from treespec.drafting.ngram import NgramConfig, NgramDrafter
from treespec.generate import GenerationConfig, generate
from treespec.models.tiny import tiny_model
from treespec.sampling import SamplingConfig
from treespec.tree import TokenTree
from treespec.trees.grow import ShapeDrafter
from treespec.trees.shape import TreeShape
from treespec.verify import VERIFIERS
from treespec.verify import core as verify_core

SEEDS = range(40)
TREES = range(5)


def outcomes_agree(name: str) -> bool:
    """Whether verifying from the verified rows gives the full rows' outcome for every tree and seed."""
    verify = VERIFIERS[name]
    for tree_seed in TREES:
        tree, target, draft = _tree_for(name, v=4, seed=tree_seed)
        verified = tree.verified_nodes
        assert verified.numel() < tree.num_nodes  # the trees have leaves to skip
        compact = target.index_select(0, verified)  # [R, V]
        for seed in SEEDS:
            full = verify(tree, target, draft, torch.Generator().manual_seed(seed))
            part = verify(tree, compact, draft, torch.Generator().manual_seed(seed))
            last = full.accepted_nodes[-1] if full.accepted_nodes else 0
            expected = None if full.is_bonus and last not in verified.tolist() else full.next_token
            if (part.accepted_nodes, part.is_bonus, part.next_token) != (full.accepted_nodes, full.is_bonus, expected):
                return False
    return True


@pytest.mark.parametrize("name", ALL_VERIFIERS)
def test_verified_rows_give_the_full_rows_outcome(name):
    assert outcomes_agree(name)


def test_twin_reading_verified_rows_as_the_first_nodes_disagrees(monkeypatch):
    def first_rows(tree, target_probs):  # the broken map: row i taken as node i's
        return torch.arange(tree.num_nodes).clamp(max=target_probs.shape[0] - 1)

    monkeypatch.setattr(verify_core, "target_rows", first_rows)
    assert not all(outcomes_agree(name) for name in ("rrs", "greedy", "deterministic"))


def test_verified_nodes_are_the_root_and_the_parents():
    tree = TokenTree.from_lists([-1, 0, 0, 1, 1, 2], [5, 6, 7, 8, 9, 10])
    assert tree.verified_nodes.tolist() == [0, 1, 2]
    assert TokenTree.from_lists([-1], [3]).verified_nodes.tolist() == [0]


def test_wrong_row_count_is_refused():
    tree, target, draft = _tree_for("rrs", v=4, seed=0)
    with pytest.raises(ValueError, match="verified nodes"):
        VERIFIERS["rrs"](tree, target[:-1], draft)


# ---------------------------------------------------------------------------------------------- generation
V = 6
PROMPT = [1, 2, 3]


@pytest.fixture(scope="module")
def models():
    return tiny_model("llama", V, seed=0, logit_scale=6.0), tiny_model("llama", V, seed=5, logit_scale=6.0)


def test_greedy_without_leaf_rows_equals_plain(models):
    target, draft = models
    prompt = [1, 2, 3, 4, 2, 3, 4, 2, 3]
    cfg = GenerationConfig(max_new_tokens=40, sampling=SamplingConfig(0.0), stop_on_eos=False)
    plain = generate(target, prompt, None, cfg)
    lean = GenerationConfig(max_new_tokens=40, sampling=SamplingConfig(0.0), stop_on_eos=False, leaf_logits=False)
    for drafter in (NgramDrafter(NgramConfig(min_ngram=1, depth=4, branches=2)),
                    ShapeDrafter(draft, TreeShape.widths((3, 2)), "deterministic")):
        out = generate(target, prompt, drafter, lean)
        assert out.token_ids == plain.token_ids
        assert out.target_calls < plain.target_calls


def law_counts(target, draft, n: int, leaf_logits: bool) -> dict:
    counts: dict[tuple[int, ...], int] = {}
    for seed in range(n):
        cfg = GenerationConfig(max_new_tokens=3, sampling=SamplingConfig(1.0), seed=seed, stop_on_eos=False,
                               verifier="rrs", leaf_logits=leaf_logits)
        drafter = ShapeDrafter(draft, TreeShape.widths((3, 2)), "iid")
        drafter.reads_target_hidden = False  # (a draft model reads none; the twin would otherwise stop at a missing row)
        key = tuple(generate(target, PROMPT, drafter, cfg).token_ids)
        counts[key] = counts.get(key, 0) + 1
    return counts


@pytest.mark.stats
def test_first_three_tokens_follow_target_law_without_leaf_rows(models):
    from stats_helpers import g_test_law
    from test_end_to_end_stats import ALPHA, N, exact_law

    target, draft = models
    p_value = g_test_law(law_counts(target, draft, N, False), exact_law(target, SamplingConfig(1.0)), N)
    assert p_value > ALPHA, f"leaf_logits=False: output law differs from the target's (G-test p = {p_value:.2e})"


@pytest.mark.stats
def test_twin_emitting_a_bonus_from_the_wrong_row_fails(models, monkeypatch):
    """The broken variant: a leaf without a row takes the root's row, so its bonus token is emitted
    from the wrong distribution."""
    from stats_helpers import g_test_law
    from test_end_to_end_stats import ALPHA, N, exact_law

    def root_row_for_leaves(tree, target_probs):
        rows = verify_core.__dict__["_target_rows_ok"](tree, target_probs)
        return rows.clamp(min=0)  # -1 (no row) becomes row 0, the root's

    monkeypatch.setitem(verify_core.__dict__, "_target_rows_ok", verify_core.target_rows)
    monkeypatch.setattr(verify_core, "target_rows", root_row_for_leaves)
    target, draft = models
    p_value = g_test_law(law_counts(target, draft, N, False), exact_law(target, SamplingConfig(1.0)), N)
    assert p_value < ALPHA, f"the wrong bonus row was not detected (p = {p_value:.3f})"


# ---------------------------------------------------------------------------------------------- inputs
def test_negative_token_ids_are_refused():
    with pytest.raises(ValueError, match="token ids must be >= 0"):
        TokenTree.from_lists([-1, 0], [3, -1])


@pytest.mark.parametrize("name", ["single", "rrs", "deterministic"])
@pytest.mark.parametrize("fill", [0.0, float("nan")])
def test_a_stopping_row_without_mass_is_refused(name, fill):
    tree = TokenTree.from_lists([-1], [0], "iid" if name != "deterministic" else "deterministic")
    target = torch.full((1, 100), fill)
    with pytest.raises(ValueError, match="without finite positive mass"):
        VERIFIERS[name](tree, target, target.clone(), torch.Generator().manual_seed(0))


def test_a_rejecting_row_without_mass_is_refused():
    tree = TokenTree.from_lists([-1, 0], [0, 1], "iid")
    target = torch.softmax(torch.randn(2, 10, generator=torch.Generator().manual_seed(0)), dim=1)
    target[0] = float("nan")
    with pytest.raises(ValueError, match="without finite positive mass"):
        VERIFIERS["rrs"](tree, target, target.clone(), torch.Generator().manual_seed(0))


def test_leaf_logits_must_be_a_bool():
    with pytest.raises(ValueError, match="leaf_logits must be True or False"):
        GenerationConfig(leaf_logits="off")


def test_auto_skips_leaf_rows_where_measured_faster():
    """``--leaf-logits auto``: off for the GGUF drafts the paired run found faster without them, on elsewhere."""
    from treespec.drafters import DEFAULT_LEAF_LOGITS, default_leaf_logits

    assert not default_leaf_logits("model.gguf", "ngram") and not default_leaf_logits("embedded-gguf", "lookup+head")
    assert default_leaf_logits("embedded-gguf", "head") and default_leaf_logits("embedded", "ngram")
    assert all(entry.evidence.startswith("benchmarks/results/") for entry in DEFAULT_LEAF_LOGITS.values())


def test_a_runner_without_rows_serves_the_default():
    """A target runner written before ``rows=`` existed still serves the default (every row)."""
    from treespec.models.runner import ModelRunner

    class OldRunner(ModelRunner):
        def forward(self, tree, nodes, chain=None, *, need_logits=True, need_hidden=False, feature_layers=()):
            return super().forward(tree, nodes, chain, need_logits=need_logits, need_hidden=need_hidden,
                                   feature_layers=feature_layers)

    target = tiny_model("llama", V, seed=0, logit_scale=6.0)
    cfg = GenerationConfig(max_new_tokens=12, sampling=SamplingConfig(0.0), stop_on_eos=False)
    prompt = [1, 2, 3, 4, 2, 3, 4, 2, 3]
    out = generate(OldRunner(target), prompt, NgramDrafter(NgramConfig(min_ngram=1, depth=4, branches=2)), cfg)
    assert out.token_ids == generate(target, prompt, None, cfg).token_ids
