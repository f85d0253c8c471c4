"""End-to-end losslessness of the new tree builders at temperature 1: the law of the first three
generated tokens equals the exact target law (same setup, helpers and alpha = 1e-3 as
test_end_to_end_stats.py: tiny vocabulary-6 Llama target and draft, prompt [1, 2, 3], G test),
but N = 400 samples per case by default to keep the suite fast (set ``TREESPEC_TREES_STATS_N=1500``
for the full-power run; all cases passed at 1500 when written).

Cases: a Medusa-style shape whose draws without replacement are truncated by top-k sampling (so
children and their subtrees go missing), DySpec heap trees (children drawn at different times,
shape driven by revealed draft masses), EAGLE-2 reranked candidates merged with an n-gram trie
(deterministic candidates), and SpecTr-style independent chains verified by K-SEQ (in the default
run). Then the matrix: every tree builder (static shapes, a Sequoia shape, DySpec heap and
threshold, EAGLE-2) with every draft law it accepts, each verified by the verifier of that law."""

import os

import pytest
import test_end_to_end_stats as base

from treespec.drafting.ngram import NgramConfig
from treespec.sampling import SamplingConfig
from treespec.trees.dyspec import DySpecDrafter
from treespec.trees.eagle2 import Eagle2Drafter
from treespec.trees.grow import ShapeDrafter
from treespec.trees.merged import MergedDrafter
from treespec.trees.shape import TreeShape

from test_end_to_end_stats import ALPHA, T1, exact_law, g_test, models  # noqa: F401

pytestmark = pytest.mark.stats

N = int(os.environ.get("TREESPEC_TREES_STATS_N", "400"))
#: Power (noncentral chi^2 approximation): at N = 400, alpha = 1e-3, power 0.9 the G test detects
#: KL >= 0.044 nats at df 10 (0.037 at df 5, 0.054 at df 20), i.e. any TV shift >= 0.148 (df 10);
#: with TREESPEC_TREES_STATS_N=1500, KL >= 0.0117 / TV >= 0.076. spectr_chains_kseq now runs by default (~12 s).

TOPK3 = SamplingConfig(1.0, top_k=3)
CASES = {
    "medusa_wor_truncated": (lambda d: ShapeDrafter(d, TreeShape.from_paths(
        [[0], [1], [2], [3], [0, 0], [0, 1], [1, 0], [3, 0]]), "without_replacement"),
        "rrs_without_replacement", TOPK3),
    "spectr_chains_kseq": (lambda d: ShapeDrafter(d, TreeShape.independent_chains(3, 2), "iid"), "kseq", T1),
    "dyspec_heap": (lambda d: DySpecDrafter(d, 5), "rrs_without_replacement", T1),
    "eagle2_merged_ngram": (lambda d: MergedDrafter(Eagle2Drafter(d, 4, top_k=2, depth=2),
                                                    NgramConfig(min_ngram=1, depth=2, branches=2, max_nodes=4)),
                            "deterministic", T1),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_first_three_tokens_follow_target_law(models, case):  # noqa: F811
    target, draft = models
    make, verifier, sampling = CASES[case]
    counts = base.sample_counts(target, lambda: make(draft), verifier, sampling, n=N)
    p_value = g_test(counts, exact_law(target, sampling), N)
    assert p_value > ALPHA, f"{case}: output law differs from the target's (G-test p = {p_value:.2e})"


# Builder x draft law x verifier: every pairing the API accepts (the verifier of each law), same G test.
IRREGULAR = TreeShape.from_paths([[0], [1], [2], [0, 0], [0, 1], [1, 0]])  # 3 / 2 / 1 children
BINARY = TreeShape.from_paths([[0], [1], [0, 0], [0, 1], [1, 0]])  # at most 2 children (spechub)


def _sequoia_shape() -> TreeShape:
    from treespec.trees.sequoia import SequoiaDP

    return SequoiaDP([0.55, 0.2, 0.1, 0.05], max_nodes=6, max_depth=3).shape(6, 3)


MATRIX = {
    "shape_iid_rrs": (lambda d: ShapeDrafter(d, IRREGULAR, "iid"), "rrs"),
    "shape_iid_kseq": (lambda d: ShapeDrafter(d, IRREGULAR, "iid"), "kseq"),
    "shape_chain_iid_single": (lambda d: ShapeDrafter(d, TreeShape.chain(3), "iid"), "single"),
    "shape_wor_rrs_wor": (lambda d: ShapeDrafter(d, IRREGULAR, "without_replacement"), "rrs_without_replacement"),
    "shape_deterministic": (lambda d: ShapeDrafter(d, IRREGULAR, "deterministic"), "deterministic"),
    "shape_greedy_draft": (lambda d: ShapeDrafter(d, IRREGULAR, "greedy_draft"), "greedy_draft"),
    "shape_spechub": (lambda d: ShapeDrafter(d, BINARY, "spechub"), "spechub"),
    "sequoia_iid_rrs": (lambda d: ShapeDrafter(d, _sequoia_shape(), "iid"), "rrs"),
    "sequoia_wor_rrs_wor": (lambda d: ShapeDrafter(d, _sequoia_shape(), "without_replacement"),
                            "rrs_without_replacement"),
    "dyspec_threshold_wor": (lambda d: DySpecDrafter(d, 5, variant="threshold"), "rrs_without_replacement"),
    "dyspec_heap_deterministic": (lambda d: DySpecDrafter(d, 5, law="deterministic"), "deterministic"),
    "eagle2_deterministic": (lambda d: Eagle2Drafter(d, 5, top_k=2, depth=3), "deterministic"),
}


@pytest.mark.parametrize("case", sorted(MATRIX))
def test_builder_law_verifier_matrix(models, case):  # noqa: F811
    target, draft = models
    make, verifier = MATRIX[case]
    counts = base.sample_counts(target, lambda: make(draft), verifier, T1, n=N)
    p_value = g_test(counts, exact_law(target, T1), N)
    assert p_value > ALPHA, f"{case}: output law differs from the target's (G-test p = {p_value:.2e})"
