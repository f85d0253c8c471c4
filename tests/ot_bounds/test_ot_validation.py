"""Every public function validates p, q and n with explicit messages."""

from __future__ import annotations

import numpy as np
import pytest

import ot_bounds as ob

GOOD = np.array([0.5, 0.5])

FUNCS = [
    lambda p, q, n: ob.optimal_acceptance(p, q, n, "iid"),
    lambda p, q, n: ob.optimal_subset(p, q, n, "without_replacement"),
    lambda p, q, n: ob.lp_optimal_acceptance(p, q, n, "iid", solver="scipy"),
    lambda p, q, n: ob.flow_optimal_acceptance(p, q, n, "iid"),
    lambda p, q, n: ob.brute_force_optimal_acceptance(p, q, n, "iid"),
    lambda p, q, n: ob.verifier_acceptance(p, q, n, "rrs"),
    lambda p, q, n: ob.verifier_outcome(p, q, n, "rrs"),
    lambda p, q, n: ob.positional_acceptance(p, q, n, "rrs"),
    lambda p, q, n: ob.optimal_node_acceptance(p, q, n),
]
BAD = [
    (np.array([[0.5, 0.5]]), GOOD, 1, "must be 1-D"),
    (GOOD, np.array([0.2, 0.3, 0.5]), 1, "same length"),
    (np.array([0.5, np.nan]), GOOD, 1, "NaN"),
    (np.array([1.5, -0.5]), GOOD, 1, "negative"),
    (np.array([0.5, 0.6]), GOOD, 1, "not normalised"),
    (np.array([]), GOOD, 1, "non-empty"),
]


@pytest.mark.parametrize("func", range(len(FUNCS)))
@pytest.mark.parametrize("case", range(len(BAD)))
def test_bad_distributions(func: int, case: int) -> None:
    p, q, n, message = BAD[case]
    with pytest.raises(ValueError, match=message):
        FUNCS[func](p, q, n)


@pytest.mark.parametrize("func", range(len(FUNCS) - 1))
@pytest.mark.parametrize("n", [0, -1, 1.5, True, "2"])
def test_bad_n(func: int, n) -> None:
    with pytest.raises(ValueError, match="n must be a positive integer"):
        FUNCS[func](GOOD, GOOD, n)


def test_renormalises_within_tolerance() -> None:
    p = np.array([0.5, 0.5 + 5e-7])
    assert ob.optimal_acceptance(p, GOOD, 1) == pytest.approx(1.0, abs=1e-6)


def test_unknown_names() -> None:
    with pytest.raises(ValueError, match="unknown sampling"):
        ob.optimal_acceptance(GOOD, GOOD, 1, "bogus")
    with pytest.raises(ValueError, match="unknown verifier"):
        ob.verifier_acceptance(GOOD, GOOD, 1, "bogus")
    with pytest.raises(ValueError, match="n = 1"):
        ob.verifier_acceptance(GOOD, GOOD, 2, "single")
    with pytest.raises(ValueError, match="unknown event"):
        ob.verifier_acceptance(GOOD, GOOD, 1, "rrs", event="bogus")
    with pytest.raises(ValueError, match="unknown solver"):
        ob.lp_optimal_acceptance(GOOD, GOOD, 1, solver="bogus")
    with pytest.raises(ValueError, match="draft tuples"):
        ob.lp_optimal_acceptance(np.full(50, 0.02), np.full(50, 0.02), 4)
