"""Tree level: traversal verification's exact expected accepted length, and the bound of every lossless verifier.

References: ot_bounds' traversal (numpy, written from the definition) against treespec's own traversal verifier
(torch), enumerated over every drafted tree; on chains against block verification (ot_bounds.chains); on one-level
trees against recursive rejection sampling. The LP optimum against ``optimal_acceptance`` on one level and block
verification on chains. The node-local bound of ``tree_acceptance_upper_bound`` is shown to be exceeded by a
verifier that looks below a node.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from ot_bounds import (
    chain_acceptance,
    optimal_acceptance,
    lp_tree_optimal_acceptance,
    optimal_node_acceptance,
    sample_tree_acceptance,
    tree_acceptance,
    tree_acceptance_upper_bound,
)
from ot_bounds import trees
from treespec.tree import TokenTree
from treespec.verify.traversal import traversal_outcome_law

SHAPES = {"one level": [-1, -1, -1], "chain": [-1, 0, 1], "1-2": [-1, 0, 0], "2-2": [-1, -1, 0, 0, 1, 1],
          "3-1": [-1, -1, -1, 0, 1, 2], "uneven": [-1, -1, 0, 2, 2]}


def random_pair(rng, v: int, zeros: bool):
    p, q = rng.dirichlet(np.ones(v) * 0.6), rng.dirichlet(np.ones(v) * 0.6)
    if zeros:
        q[0], p[1] = 0.0, 0.0
        p, q = p / p.sum(), q / q.sum()
    return p, q


def enumerated_traversal(parents: list[int], p, q) -> float:
    """Sum over every drafted tree of Q(tree) x E[accepted | tree] from treespec's exact traversal law."""
    n = len(parents)
    tree_parents = [-1] + [x + 1 for x in parents]  # treespec's node 0 is the root
    depth = [0] * (n + 1)
    for i in range(1, n + 1):
        depth[i] = depth[tree_parents[i]] + 1
    target_probs = torch.tensor(np.tile(p, (n + 1, 1)))  # [n + 1, V]
    draft_probs = torch.tensor(np.tile(q, (n + 1, 1)))  # [n + 1, V]
    total = 0.0
    for tokens in itertools.product(range(len(p)), repeat=n):
        weight = float(np.prod(q[list(tokens)]))
        if weight == 0.0:
            continue
        tree = TokenTree.from_lists(tree_parents, [0, *tokens], law="iid")
        stop = traversal_outcome_law(tree, target_probs, draft_probs).sum(1)  # [n + 1] P(stop at node)
        total += weight * float(np.dot(stop.numpy(), depth))
    return total


@pytest.mark.parametrize("name", sorted(SHAPES))
@pytest.mark.parametrize("zeros", [False, True])
def test_traversal_equals_treespec_traversal_verifier(name, zeros):
    p, q = random_pair(np.random.default_rng(len(name) + 10 * zeros), 3, zeros)
    assert tree_acceptance(SHAPES[name], p, q, "traversal") == pytest.approx(
        enumerated_traversal(SHAPES[name], p, q), abs=1e-12)


def test_the_traversal_comparison_fails_on_a_broken_rule(monkeypatch):
    """The twin: the parent's state after a rejection left unnormalised, (m - q)_+, changes the value."""
    p, q = random_pair(np.random.default_rng(3), 3, False)
    reference = enumerated_traversal(SHAPES["2-2"], p, q)
    monkeypatch.setattr(trees, "_after_rejection", lambda m, q_row: np.maximum(m - q_row, 0.0))
    assert abs(tree_acceptance(SHAPES["2-2"], p, q, "traversal") - reference) > 1e-3


def test_special_cases_and_ordering():
    """Traversal is block verification on a chain and rrs on one level; rrs <= traversal <= the LP bound."""
    rng = np.random.default_rng(4)
    for trial in range(10):
        p, q = random_pair(rng, int(rng.integers(2, 4)), zeros=trial % 4 == 0)
        assert tree_acceptance([-1, 0, 1], p, q) == pytest.approx(chain_acceptance(p, q, 3, "block"), abs=1e-12)
        assert tree_acceptance([-1, -1, -1], p, q) == pytest.approx(tree_acceptance([-1, -1, -1], p, q, "rrs"),
                                                                    abs=1e-12)
        for parents in (SHAPES["1-2"], SHAPES["uneven"], SHAPES["2-2"]):
            rrs, trav = tree_acceptance(parents, p, q, "rrs"), tree_acceptance(parents, p, q, "traversal")
            assert rrs <= trav + 1e-12 and trav <= lp_tree_optimal_acceptance(parents, p, q) + 1e-7


def test_the_optimum_on_one_level_and_on_chains():
    """The LP optimum is alpha*(n) of the OT dual on one level and block verification's value on a chain (10 seeded
    random pairs each)."""
    rng = np.random.default_rng(6)
    for _ in range(10):
        v, n = int(rng.integers(2, 5)), int(rng.integers(1, 4))
        p, q = random_pair(rng, v, zeros=False)
        assert lp_tree_optimal_acceptance([-1] * n, p, q) == pytest.approx(optimal_acceptance(p, q, n, "iid"), abs=1e-7)
        assert lp_tree_optimal_acceptance(list(range(-1, n - 1)), p, q) == pytest.approx(
            chain_acceptance(p, q, n, "block"), abs=1e-7)


def test_a_deep_chain_with_one_draftable_token():
    """q a point mass, 300 nodes: one drafted tree, traversal's post-order without recursion limits."""
    value = tree_acceptance(list(range(-1, 299)), [0.5, 0.5], [1.0, 0.0])
    assert value == pytest.approx(chain_acceptance([0.5, 0.5], [1.0, 0.0], 300, "block"))


def test_the_node_local_bound_does_not_hold_for_path_verifiers():
    """p = (0.6, 0.3, 0.1), q = (0.2, 0.3, 0.5), a chain of two: the node-local bound is token-level's 0.96,
    block (= traversal) verification keeps 1.0, the optimum of every lossless verifier."""
    p, q = [0.6, 0.3, 0.1], [0.2, 0.3, 0.5]
    node_local = tree_acceptance_upper_bound([-1, 0], optimal_node_acceptance(p, q, 1))
    assert node_local == pytest.approx(0.96)
    block = tree_acceptance([-1, 0], p, q)
    assert block == pytest.approx(1.0) and block > node_local + 0.03
    assert lp_tree_optimal_acceptance([-1, 0], p, q) == pytest.approx(1.0, abs=1e-7)
    assert tree_acceptance([-1, 0], p, q, "rrs") <= node_local + 1e-12  # a node rule stays below it


@pytest.mark.parametrize("call, match", [
    (lambda: tree_acceptance([-1, 0], [0.5, 0.5], [0.5, 0.5], "kseq"), "unknown tree verifier"),
    (lambda: tree_acceptance([-1] * 12, np.ones(4) / 4, np.ones(4) / 4), "drafted trees"),
    (lambda: lp_tree_optimal_acceptance([-1, 0, 1, 2], np.ones(8) / 8, np.ones(8) / 8), "variables"),
    (lambda: tree_acceptance([-1], np.ones(50_000) / 50_000, np.ones(50_000) / 50_000), "states of"),
    (lambda: tree_acceptance([-1] * 400, np.ones(10) / 10, np.ones(10) / 10), "limit is"),
    (lambda: tree_acceptance([0], [0.5, 0.5], [0.5, 0.5]), "parents"),
])
def test_bad_input(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_lumping_the_undrafted_tokens_changes_nothing():
    """tree_acceptance lumps the tokens q never proposes; the same trees over the whole vocabulary give the same value."""
    p, q = random_pair(np.random.default_rng(9), 4, True)
    q = np.array([0.0, 0.5, 0.0, 0.5])
    parents = trees.check_parents(SHAPES["uneven"])
    weight, tokens = trees._drafted_trees(parents, p, q, "test")  # tokens are vocabulary ids here
    direct = float(weight @ trees._traversal_accepted(parents, tokens, p, q))
    assert tree_acceptance(SHAPES["uneven"], p, q) == pytest.approx(direct, abs=1e-12)


def test_sampled_traversal_agrees_and_tells_rrs_apart():
    """Seed 0, 30,000 trees: within 4 standard errors (about 6e-5 two-sided) of the exact value; the twin: the
    same estimate rejects rrs's exact value, which is lower by many standard errors here."""
    p, q = random_pair(np.random.default_rng(3), 3, False)
    parents = SHAPES["2-2"]
    est = sample_tree_acceptance(parents, p, q, samples=30_000, seed=0)
    assert est.samples == 30_000 and 0 < est.stderr < 0.02
    assert abs(est.mean - tree_acceptance(parents, p, q)) < 4 * est.stderr
    assert abs(est.mean - tree_acceptance(parents, p, q, "rrs")) > 4 * est.stderr


def test_sampled_traversal_on_a_full_vocabulary():
    """262,144 entries, q on 16,384 of them (a draft head's subset): 4,000 trees of 6 nodes (seed 2) keep at least
    rrs's exact value, within 4 standard errors."""
    rng = np.random.default_rng(4)
    logits = rng.standard_normal(262_144) * 3
    p = np.exp(logits - logits.max())
    q = np.zeros(262_144)
    subset = np.argsort(-logits)[:16_384]
    q[subset] = np.exp(0.8 * logits[subset] + rng.standard_normal(16_384) - (0.8 * logits[subset]).max())
    p, q = p / p.sum(), q / q.sum()
    est = sample_tree_acceptance(SHAPES["2-2"], p, q, samples=4_000, seed=2)
    assert est.mean > tree_acceptance(SHAPES["2-2"], p, q, "rrs") - 4 * est.stderr


@pytest.mark.parametrize("kwargs, match", [({"samples": 1}, "samples must be"), ({"seed": -1}, "seed must be")])
def test_sampled_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        sample_tree_acceptance([-1, 0], [0.5, 0.5], [0.5, 0.5], **kwargs)


def test_chunks_do_not_change_the_estimate(monkeypatch):
    """The same seed gives the same draws whatever the chunk size: 3,000 trees in one chunk or in chunks of a few
    rows (MAX_STATE_ENTRIES shrunk) give bit-identical estimates, and both agree with the exact value."""
    p, q = random_pair(np.random.default_rng(11), 3, False)
    exact = tree_acceptance(SHAPES["2-2"], p, q)
    whole = sample_tree_acceptance(SHAPES["2-2"], p, q, samples=3_000, seed=7)
    monkeypatch.setattr(trees, "MAX_STATE_ENTRIES", 400)  # 400 // (4 * (4 + 6)) = 10 trees a chunk
    chunked = sample_tree_acceptance(SHAPES["2-2"], p, q, samples=3_000, seed=7)
    assert (chunked.mean, chunked.stderr) == (whole.mean, whole.stderr)
    assert abs(whole.mean - exact) < 4 * whole.stderr
