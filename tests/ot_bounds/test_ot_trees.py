"""Tree level: Sequoia's F(T) and the per-node OT upper bound."""

from __future__ import annotations

import numpy as np
import pytest

from ot_bounds import (
    child_ranks,
    expected_accepted_length,
    optimal_node_acceptance,
    positional_acceptance,
    tree_acceptance_upper_bound,
    verifier_acceptance,
)


def test_chain_is_geometric_sum() -> None:
    a = 0.7
    assert expected_accepted_length([-1, 0, 1, 2], [a]) == pytest.approx(sum(a**j for j in range(1, 5)))


def test_ranks_and_hand_computed_tree() -> None:
    parents = [-1, -1, 0, 0, 1]
    assert child_ranks(parents).tolist() == [0, 1, 0, 1, 0]
    a = [0.5, 0.2]
    expected = 0.5 + 0.2 + 0.5 * 0.5 + 0.5 * 0.2 + 0.2 * 0.5
    assert expected_accepted_length(parents, a) == pytest.approx(expected)


def test_bound_dominates_verifiers_on_random_trees() -> None:
    rng = np.random.default_rng(0)
    for _ in range(20):
        v = 6
        p, q = rng.dirichlet(np.ones(v) * 0.5), rng.dirichlet(np.ones(v) * 0.5)
        size = int(rng.integers(1, 12))
        parents = [-1] + [int(rng.integers(-1, i)) for i in range(1, size)]
        width = max(np.bincount(np.array(parents) + 1))
        for verifier, law in (("rrs", "iid"), ("rrs_without_replacement", "without_replacement"), ("kseq", "iid")):
            pos = positional_acceptance(p, q, int(width), verifier)
            assert pos.sum() == pytest.approx(verifier_acceptance(p, q, int(width), verifier, event="accepted"))
            f = expected_accepted_length(parents, pos)
            bound = tree_acceptance_upper_bound(parents, optimal_node_acceptance(p, q, int(width), law))
            assert f <= bound + 1e-12


def test_bad_trees() -> None:
    with pytest.raises(ValueError, match="parents"):
        expected_accepted_length([0], [0.5])
    with pytest.raises(ValueError, match="children"):
        expected_accepted_length([-1, -1], [0.5])
    with pytest.raises(ValueError, match="positional"):
        expected_accepted_length([-1], [0.7, 0.6])
