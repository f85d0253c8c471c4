"""LP, dual/subset, max-flow and brute force agree on 300+ random instances."""

from __future__ import annotations

import numpy as np
import pytest

from ot_bounds import (
    brute_force_optimal_acceptance,
    flow_optimal_acceptance,
    lp_optimal_acceptance,
    optimal_subset,
    prob_all_drafts_in,
)

TOL = 1e-7
SAMPLINGS = ("iid", "without_replacement", "greedy_draft")


def _instances(seed: int, count: int) -> list[tuple[np.ndarray, np.ndarray, int]]:
    """Random (p, q, n) with vocab 2..6, n in {1, 2, 3}, sparse and degenerate cases."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(count):
        v = int(rng.integers(2, 7))
        n = int(rng.integers(1, 4))
        if v >= 6 and n == 3:  # keep the LP small (V^n x V variables)
            n = 2
        conc = float(rng.choice([0.2, 1.0, 5.0]))
        p = rng.dirichlet(np.full(v, conc))
        q = rng.dirichlet(np.full(v, conc))
        if i % 6 == 1:
            p[rng.random(v) < 0.4] = 0.0
        if i % 6 == 2:
            q[rng.random(v) < 0.4] = 0.0
        p = p / p.sum() if p.sum() > 0 else np.eye(v)[0]
        q = q / q.sum() if q.sum() > 0 else np.eye(v)[-1]
        out.append((p, q, n))
    return out


def _edge_cases() -> list[tuple[np.ndarray, np.ndarray, int]]:
    cases = []
    for n in (1, 2, 3):
        u = np.full(4, 0.25)
        cases.append((u, u.copy(), n))  # equal
        cases.append((np.array([0.5, 0.5, 0, 0]), np.array([0, 0, 0.5, 0.5]), n))  # disjoint supports
        cases.append((np.eye(3)[0], np.eye(3)[0], n))  # identical point masses
        cases.append((np.eye(3)[0], np.eye(3)[2], n))  # different point masses
        cases.append((np.array([0.7, 0.3, 0.0]), np.array([0.0, 0.5, 0.5]), n))  # zeros
        cases.append((np.array([1e-9, 1 - 1e-9]), np.array([1 - 1e-9, 1e-9]), n))  # nearly disjoint
    return cases


CASES = _instances(2024, 300) + _edge_cases()


@pytest.mark.parametrize("chunk", range(6))
def test_four_methods_agree(chunk: int) -> None:
    """Dual/subset == LP (HiGHS) == max-flow == brute force, all laws, 318 instances."""
    for p, q, n in CASES[chunk::6]:
        for sampling in SAMPLINGS:
            fast = optimal_subset(p, q, n, sampling)
            brute = brute_force_optimal_acceptance(p, q, n, sampling)
            lp = lp_optimal_acceptance(p, q, n, sampling, solver="scipy")
            flow = flow_optimal_acceptance(p, q, n, sampling)
            values = [fast.value, brute.value, lp.value, flow.value]
            assert max(values) - min(values) < TOL, (p, q, n, sampling, values)
            # zero duality gap and dual feasibility of the LP certificate
            assert abs(lp.value - lp.dual_value) < TOL
            assert lp.max_dual_violation < 1e-7
            # the returned set H certifies the value
            h = fast.subset
            certified = 1.0 + p[h].sum() - prob_all_drafts_in(q, h, n, sampling)
            assert abs(certified - fast.value) < TOL
            assert abs(flow.cut_value - flow.value) < TOL


def test_extra_laws_agree() -> None:
    """SpecHub pair law and deterministic top-n candidates, all four methods."""
    for p, q, n in CASES[:60]:
        laws = ["deterministic"] + (["spechub"] if n == 2 else [])
        for sampling in laws:
            values = [
                optimal_subset(p, q, n, sampling).value,
                brute_force_optimal_acceptance(p, q, n, sampling).value,
                lp_optimal_acceptance(p, q, n, sampling, solver="scipy").value,
                flow_optimal_acceptance(p, q, n, sampling).value,
            ]
            assert max(values) - min(values) < TOL, (sampling, values)


def test_cvxpy_backend_matches() -> None:
    """The cvxpy path gives the same value and a zero duality gap."""
    for p, q, n in CASES[:8]:
        for sampling in SAMPLINGS:
            res = lp_optimal_acceptance(p, q, n, sampling, solver="auto")
            assert abs(res.value - optimal_subset(p, q, n, sampling).value) < 1e-6
            assert abs(res.value - res.dual_value) < 1e-6
            plan = res.coupling
            assert np.allclose(plan.sum(axis=1), res.tuple_probs, atol=1e-7)
            assert np.allclose(plan.sum(axis=0), p, atol=1e-7)


def test_without_replacement_prefix_is_exact_wider() -> None:
    """Sorted prefixes vs all subsets for without replacement up to V = 9, n = 4."""
    rng = np.random.default_rng(7)
    for _ in range(25):
        v, n = int(rng.integers(5, 10)), int(rng.integers(2, 5))
        if v**n > 7000:
            n = 3
        conc = float(rng.choice([0.1, 0.5, 2.0]))
        p, q = rng.dirichlet(np.full(v, conc)), rng.dirichlet(np.full(v, conc))
        fast = optimal_subset(p, q, n, "without_replacement").value
        brute = brute_force_optimal_acceptance(p, q, n, "without_replacement").value
        assert abs(fast - brute) < 1e-9
