"""The chain study's evaluation (``benchmarks/study_chains.py``) on small tables, against ot_bounds' exact values."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.study_chains import evaluate_position, markdown, summarise
from ot_bounds import chain_acceptance, chain_acceptance_upper_bound, sample_chain_acceptance


def test_a_position_against_the_exact_values():
    """Seeded (position seed 3), 20,000 blocks: block and bound within 4 standard errors of their exact values,
    token exact, and the paired difference is block minus token on the same blocks."""
    rng = np.random.default_rng(0)
    p, q = rng.dirichlet(np.ones(5) * 0.6), rng.dirichlet(np.ones(5) * 0.6)
    got = evaluate_position(p, q, [2, 3], samples=20_000, seed=3)
    for d in (2, 3):
        se = sample_chain_acceptance(p, q, d, "block", samples=20_000, seed=3).stderr
        se_bound = sample_chain_acceptance(p, q, d, "bound", samples=20_000, seed=3).stderr
        assert abs(got[d]["block"] - chain_acceptance(p, q, d, "block")) < 4 * se
        assert abs(got[d]["bound"] - chain_acceptance_upper_bound(p, q, d)) < 4 * se_bound
        assert got[d]["token"] == pytest.approx(chain_acceptance(p, q, d, "token"))
        assert got[d]["block_minus_token"] == pytest.approx(got[d]["block"] - got[d]["token_sampled"])
    # the twin: the block value is not the token one (their gap is many standard errors here)
    assert abs(got[3]["block"] - got[3]["token"]) > 4 * se


def test_summary_and_table():
    rng = np.random.default_rng(1)
    rows = []
    for i in range(4):
        p, q = rng.dirichlet(np.ones(4)), rng.dirichlet(np.ones(4))
        rows.append({0.7: evaluate_position(p, q, [2], samples=500, seed=i)})
    summary = summarise(rows, [0.7], [2])
    cell = summary["T=0.7/d=2"]
    assert cell["block"]["mean"] == pytest.approx(np.mean([r[0.7][2]["block"] for r in rows]))
    assert cell["block_over_bound"] == pytest.approx(cell["block"]["mean"] / cell["bound"]["mean"])
    assert cell["token"]["stderr"] > 0
    settings = {"commit": "abc", "date": "d", "runtime_s": 1.0, "machine": {"cpu": "x", "cores": 2},
                "draft": "h", "positions": 4, "per_category": 1, "new_tokens": 8, "gen_temperature": 0.7,
                "seed": 0, "samples": 500}
    table = markdown(summary, settings)
    assert "| 0.7 | 2 |" in table and f"{cell['block']['mean']:.4f}" in table


def test_tree_part():
    """widths (2, 1): parents; a position's rrs is exact, traversal within 4 standard errors of its exact value
    (seed 5, 5,000 trees); the summary and its table."""
    from benchmarks.study_chains import evaluate_tree, markdown_trees, summarise_trees, widths_parents
    from ot_bounds import tree_acceptance

    parents = widths_parents([2, 1])
    assert parents == [-1, -1, 0, 1]
    rng = np.random.default_rng(2)
    p, q = rng.dirichlet(np.ones(4)), rng.dirichlet(np.ones(4))
    got = evaluate_tree(p, q, parents, samples=5_000, seed=5)
    assert got["rrs"] == pytest.approx(tree_acceptance(parents, p, q, "rrs"))
    assert 0 < got["traversal_stderr"] < 0.05
    assert abs(got["traversal"] - tree_acceptance(parents, p, q)) < 4 * got["traversal_stderr"]
    summary = summarise_trees([{0.7: got}, {0.7: got}], [0.7])
    assert summary["T=0.7"]["positions"] == 2 and summary["T=0.7"]["rrs"]["mean"] == pytest.approx(got["rrs"])
    table = "\n".join(markdown_trees(summary, {"tree_widths": [2, 1], "tree_parents": parents, "tree_every": 8,
                                               "tree_samples": 5000}))
    assert f"{got['traversal']:.4f}" in table
