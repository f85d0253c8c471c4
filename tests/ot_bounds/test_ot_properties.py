"""Closed forms, orderings and hypothesis property tests."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ot_bounds import (
    VERIFIER_LAW,
    VERIFIERS,
    optimal_acceptance,
    verifier_acceptance,
    verifier_outcome,
)
from ot_bounds.verifiers import kseq_rho

SAMPLINGS = ("iid", "without_replacement", "greedy_draft")
PROFILE = settings(max_examples=int(__import__("os").environ.get("OT_PROPERTY_EXAMPLES", "35")), derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def pq_pairs(draw, max_vocab: int = 6):
    """Random (p, q) with exact zeros, tiny masses (1e-12..1e-9) next to masses near 1, and ordinary ones.

    The tiny masses exercise the cancellation-prone spots: complements ``1 - q`` of a token holding
    almost all mass, and K-SEQ's root bracket when ``beta`` is ~1e-13.
    """
    v = draw(st.integers(2, max_vocab))
    weight = st.one_of(st.just(0.0), st.floats(1e-12, 1e-9, allow_nan=False), st.floats(1e-6, 1.0, allow_nan=False))
    weights = st.lists(weight, min_size=v, max_size=v)
    raw_p = np.array(draw(weights)) + np.array([1e-3] + [0.0] * (v - 1))
    raw_q = np.array(draw(weights)) + np.array([0.0] * (v - 1) + [1e-3])
    return raw_p / raw_p.sum(), raw_q / raw_q.sum()


@pytest.mark.parametrize("p, q, n", [
    ([1.0, 1e-12], [0.0, 1.0], 2),  # K-SEQ: beta ~ 5e-13, the root sits at rho = n up to rounding
    ([1.0, 1e-12], [0.0, 1.0], 3),
    ([1.0, 0.0], [1e-12, 1.0], 2),  # w/o replacement: 1 - q_1 ~ 1e-12 must keep its digits
    ([1.0, 0.0, 0.0], [1e-12, 0.5, 0.5], 3),
    ([1.0, 0.0, 0.0], [1e-12, 1.0 - 2e-12, 1e-12], 3),
])
def test_tiny_masses_next_to_large_ones(p, q, n) -> None:
    """Regression cases found by hypothesis: exact answers where the masses span 12 decades."""
    p, q = np.array(p) / np.sum(p), np.array(q) / np.sum(q)
    for verifier in ("rrs", "rrs_without_replacement", "kseq", "greedy_draft"):
        opt = optimal_acceptance(p, q, n, VERIFIER_LAW[verifier])
        acc = verifier_acceptance(p, q, n, verifier)
        assert -1e-12 <= acc <= opt + 1e-10, (verifier, acc, opt)
        np.testing.assert_allclose(verifier_outcome(p, q, n, verifier).output, p, atol=1e-10)
    if np.count_nonzero(q) <= n:  # every token with q > 0 is drafted without replacement
        assert optimal_acceptance(p, q, n, "without_replacement") == pytest.approx(
            min(1.0, p[q > 0].sum()), abs=1e-12)
    rho = kseq_rho(p, q, n)
    assert 1.0 <= rho <= n


@PROFILE
@given(pq_pairs(), st.integers(1, 3))
def test_n_equal_one_is_total_variation(pq, n) -> None:
    p, q = pq
    for sampling in SAMPLINGS:
        assert optimal_acceptance(p, q, 1, sampling) == pytest.approx(np.minimum(p, q).sum(), abs=1e-12)


@PROFILE
@given(pq_pairs(), st.integers(1, 4))
def test_equal_distributions_accept_always(pq, n) -> None:
    p, _ = pq
    for sampling in ("iid", "without_replacement"):
        assert optimal_acceptance(p, p, n, sampling) == pytest.approx(1.0, abs=1e-12)


@PROFILE
@given(pq_pairs(), st.integers(1, 4))
def test_orderings(pq, n) -> None:
    p, q = pq
    iid = [optimal_acceptance(p, q, m, "iid") for m in range(1, n + 2)]
    wor = [optimal_acceptance(p, q, m, "without_replacement") for m in range(1, n + 2)]
    greedy = [optimal_acceptance(p, q, m, "greedy_draft") for m in range(1, n + 2)]
    for seq in (iid, wor, greedy):
        assert all(b >= a - 1e-12 for a, b in zip(seq, seq[1:]))  # non-decreasing in n
    assert all(w >= i - 1e-12 for w, i in zip(wor, iid))  # without replacement >= iid
    assert all(0.0 <= x <= 1.0 for x in iid + wor + greedy)


@PROFILE
@given(pq_pairs(5), st.integers(1, 3))
def test_verifiers_below_optimum_and_lossless(pq, n) -> None:
    p, q = pq
    for verifier in VERIFIERS:
        if (verifier == "single" and n != 1) or (verifier == "spechub" and n != 2):
            continue
        opt = optimal_acceptance(p, q, n, VERIFIER_LAW[verifier])
        acc = verifier_acceptance(p, q, n, verifier)
        assert acc <= opt + 1e-10, (verifier, acc, opt)
        out = verifier_outcome(p, q, n, verifier)
        np.testing.assert_allclose(out.output, p, atol=1e-10)  # lossless
        assert out.in_drafts == pytest.approx(acc, abs=1e-10)
        assert out.accepted == pytest.approx(verifier_acceptance(p, q, n, verifier, event="accepted"), abs=1e-10)


@PROFILE
@given(pq_pairs(), st.integers(1, 5))
def test_kseq_acceptance_formula(pq, n) -> None:
    p, q = pq
    rho = kseq_rho(p, q, n)
    assert 1.0 <= rho <= n
    beta = np.minimum(q, p / rho).sum()
    assert verifier_acceptance(p, q, n, "kseq", event="accepted") == pytest.approx(1 - (1 - beta) ** n, abs=1e-12)
    assert verifier_acceptance(p, q, n, "kseq") >= verifier_acceptance(p, q, n, "kseq", event="accepted") - 1e-12


@PROFILE
@given(pq_pairs(), st.integers(1, 4))
def test_greedy_draft_verifier_is_optimal(pq, n) -> None:
    """Hu et al.: greedy drafting + single-draft verification attains alpha* of its law."""
    p, q = pq
    assert verifier_acceptance(p, q, n, "greedy_draft") == pytest.approx(optimal_acceptance(p, q, n, "greedy_draft"), abs=1e-12)


def test_known_small_values() -> None:
    p, q = np.array([0.1, 0.9]), np.array([0.6, 0.4])
    # iid n=2: H = {0}: 1 + 0.1 - 0.36
    assert optimal_acceptance(p, q, 2, "iid") == pytest.approx(0.74)
    # without replacement with two tokens and n = 2 drafts both tokens
    assert optimal_acceptance(p, q, 2, "without_replacement") == pytest.approx(1.0)
    # single draft
    assert verifier_acceptance(p, q, 1, "single") == pytest.approx(0.5)
    # deterministic top-1 of q is token 0
    assert verifier_acceptance(p, q, 1, "deterministic") == pytest.approx(0.1)
    assert optimal_acceptance(p, q, 1, "deterministic") == pytest.approx(0.1)
    # spechub's law equals greedy drafting with n = 2 as unordered sets
    rng = np.random.default_rng(3)
    for _ in range(20):
        a, b = rng.dirichlet(np.ones(6)), rng.dirichlet(np.ones(6))
        assert optimal_acceptance(a, b, 2, "spechub") == pytest.approx(optimal_acceptance(a, b, 2, "greedy_draft"))


def test_rrs_analytic_matches_enumeration_wider() -> None:
    rng = np.random.default_rng(11)
    for _ in range(10):
        p, q = rng.dirichlet(np.ones(7) * 0.5), rng.dirichlet(np.ones(7) * 0.5)
        for verifier in ("rrs", "rrs_without_replacement", "kseq"):
            assert verifier_acceptance(p, q, 3, verifier) == pytest.approx(
                verifier_acceptance(p, q, 3, verifier, method="enumerate"), abs=1e-12
            )
