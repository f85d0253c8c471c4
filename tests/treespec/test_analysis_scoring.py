"""Scoring the real code: treespec's own verifiers against ot_bounds.verifier_acceptance.

Two checks per (p, q, n, verifier):

* exact: the engine's node rule (``treespec.verify.VERIFIER_RULES``) over every enumerated draft
  tuple reproduces ``verifier_acceptance`` and the target law to 1e-9 (no sampling noise);
* Monte Carlo: ``treespec.analysis.scoring.monte_carlo_acceptance`` runs ``treespec.verify.VERIFIERS[name]``
  on depth-1 trees drafted by ``treespec.drafting.laws.draw_children`` (fixed seeds, stated sample
  sizes). ``num_accepted`` is compared with ``verifier_acceptance(event=ENGINE_EVENT[name])`` and
  "first emitted token is a draft" with ``event="in_drafts"``; tolerance: binomial z-score
  ``|mc - exact| / sqrt(exact (1 - exact) / N) <= 4.5`` (exact agreement when exact is 0 or 1).
  The empirical law of the emitted token is checked against p token by token with the same rule.

A deliberately broken verifier (monkeypatched into ``treespec.verify.VERIFIERS``) is detected.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import treespec.verify as tv
from ot_bounds import verifier_acceptance
from treespec.analysis.scoring import ENGINE_EVENT, monte_carlo_acceptance, rule_acceptance, z_score

Z_MAX = 4.5

_rng = np.random.default_rng(20261122)
#: name -> (p, q, n for multi-draft verifiers, Monte-Carlo samples)
CASES = {
    "dirichlet_v5_n3": (_rng.dirichlet(np.ones(5)), _rng.dirichlet(np.ones(5)), 3, 1000),
    "peaked_v4_n2": (np.array([0.7, 0.1, 0.15, 0.05]), np.array([0.4, 0.45, 0.05, 0.1]), 2, 600),
    # edge cases: q a point mass, q with fewer non-zeros than n, disjoint supports, p = q
    "q_point_mass": (np.array([0.2, 0.3, 0.5]), np.array([0.0, 1.0, 0.0]), 3, 150),
    "q_support_lt_n": (np.array([0.2, 0.3, 0.5, 0.0]), np.array([0.0, 0.6, 0.4, 0.0]), 3, 150),
    "disjoint": (np.array([0.5, 0.5, 0.0, 0.0]), np.array([0.0, 0.0, 0.5, 0.5]), 2, 150),
    "p_equals_q": (np.array([0.1, 0.2, 0.3, 0.4]), np.array([0.1, 0.2, 0.3, 0.4]), 3, 150),
}
VERIFIER_NAMES = sorted(ENGINE_EVENT)


def _n_for(verifier: str, n: int) -> int:
    return {"single": 1, "spechub": 2}.get(verifier, n)


def _check_mc(p, q, n, verifier, samples, seed):
    mc = monte_carlo_acceptance(p, q, n, verifier, samples=samples, seed=seed)
    exact_user = verifier_acceptance(p, q, n, verifier, event=ENGINE_EVENT[verifier])
    exact_in = verifier_acceptance(p, q, n, verifier, event="in_drafts")
    z_user = z_score(mc.accepted, exact_user, samples)
    z_in = z_score(mc.in_drafts, exact_in, samples)
    z_out = max(z_score(float(mc.output[y]), float(p[y]), samples) for y in range(len(p)))
    return mc, exact_user, exact_in, z_user, z_in, z_out


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("verifier", VERIFIER_NAMES)
def test_engine_rule_matches_exact(case: str, verifier: str) -> None:
    p, q, n, _ = CASES[case]
    n = _n_for(verifier, n)
    rule = rule_acceptance(p, q, n, verifier)
    assert rule.accepted == pytest.approx(verifier_acceptance(p, q, n, verifier, event=ENGINE_EVENT[verifier]), abs=1e-9)
    assert rule.in_drafts == pytest.approx(verifier_acceptance(p, q, n, verifier), abs=1e-9)
    np.testing.assert_allclose(rule.output, p, atol=1e-9)  # lossless


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("verifier", VERIFIER_NAMES)
def test_engine_verifier_monte_carlo(case: str, verifier: str) -> None:
    p, q, n, samples = CASES[case]
    n = _n_for(verifier, n)
    seed = 1000 + VERIFIER_NAMES.index(verifier) + 100 * list(CASES).index(case)
    mc, exact_user, exact_in, z_user, z_in, z_out = _check_mc(p, q, n, verifier, samples, seed)
    msg = (f"{verifier} on {case} (n={n}, N={samples}, seed={seed}): num_accepted {mc.accepted:.4f} vs "
           f"{exact_user:.4f} (z={z_user:.2f}); in_drafts {mc.in_drafts:.4f} vs {exact_in:.4f} (z={z_in:.2f}); "
           f"output law max z={z_out:.2f}")
    assert z_user <= Z_MAX, msg
    assert z_in <= Z_MAX, msg
    assert z_out <= Z_MAX, msg


def test_kseq_and_greedy_draft_events_differ() -> None:
    """num_accepted is P(accepted) for kseq but P(output in drafts) for greedy_draft."""
    p, q, _n, _ = CASES["dirichlet_v5_n3"]
    ks_acc = verifier_acceptance(p, q, 3, "kseq", event="accepted")
    ks_in = verifier_acceptance(p, q, 3, "kseq", event="in_drafts")
    gd_acc = verifier_acceptance(p, q, 3, "greedy_draft", event="accepted")
    gd_in = verifier_acceptance(p, q, 3, "greedy_draft", event="in_drafts")
    assert gd_in - gd_acc > 0.1  # p(T) on the fixed tokens
    assert ks_in >= ks_acc
    assert rule_acceptance(p, q, 3, "greedy_draft").accepted == pytest.approx(gd_in, abs=1e-9)
    assert rule_acceptance(p, q, 3, "kseq").accepted == pytest.approx(ks_acc, abs=1e-9)


def _broken_rrs_rule(p, q, child_tokens, child_valid):
    """RRS that forgets to update the residual: every child is tested against p itself."""
    m, k = child_tokens.shape
    alive = torch.ones(m, 1, dtype=p.dtype)
    choice = torch.zeros(m, k + 1, dtype=p.dtype)
    for i in range(k):
        x = child_tokens[:, i:i + 1]
        a = (p.gather(1, x) / q.gather(1, x)).clamp(max=1.0) * child_valid[:, i:i + 1]
        choice[:, i:i + 1] = alive * a
        alive = alive * (1 - a)
    choice[:, k:] = alive
    residual = (p - q).clamp(min=0)
    return choice, residual / residual.sum(dim=1, keepdim=True)


def test_broken_verifier_is_detected(monkeypatch: pytest.MonkeyPatch) -> None:
    p, q, n, _ = CASES["dirichlet_v5_n3"]
    samples, seed = 1000, 7

    def broken(tree, target_probs, draft_probs, generator=None):
        return tv.core.verify_tree(tree, target_probs, draft_probs, generator, _broken_rrs_rule)

    monkeypatch.setitem(tv.VERIFIERS, "rrs", broken)
    _mc, _eu, _ei, z_user, z_in, z_out = _check_mc(p, q, n, "rrs", samples, seed)
    assert max(z_user, z_in, z_out) > Z_MAX, (z_user, z_in, z_out)
