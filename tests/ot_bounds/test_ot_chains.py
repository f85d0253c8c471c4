"""Chain level: token and block verification's exact E[tau], the chain optimum (LP) and the prefix bound.

References: block verification's exact value against treespec's own block verifier (an independent
implementation, in torch, enumerated over every drafted chain) and against the LP optimum of every lossless
verification (block verification is optimal, arXiv 2403.10444); the sampled estimates against the exact values
(seeded, z-test at 4 standard errors, about 6e-5 two-sided).
"""

from __future__ import annotations

import doctest
import importlib
import itertools
import pkgutil

import numpy as np
import pytest
import torch

import ot_bounds
from ot_bounds import (
    chain_acceptance,
    chain_acceptance_upper_bound,
    lp_chain_optimal_acceptance,
    sample_chain_acceptance,
)
from ot_bounds import chains
from treespec.tree import TokenTree
from treespec.verify.block import block_outcome_law


def random_pair(rng, v: int, zeros: bool = False):
    p, q = rng.dirichlet(np.ones(v) * 0.7), rng.dirichlet(np.ones(v) * 0.7)
    if zeros:  # a token the draft never proposes, another the target never emits
        q[0], p[1] = 0.0, 0.0
        p, q = p / p.sum(), q / q.sum()
    return p, q


def enumerated(p, q, depth: int, outcome_law) -> float:
    """E[tau] by summing, over every drafted chain, q^d(chain) x E[tau | chain] from a verifier's exact law."""
    v = len(p)
    target_probs = torch.tensor(np.tile(p, (depth + 1, 1)))  # [depth + 1, V] the same law at every node
    draft_probs = torch.tensor(np.tile(q, (depth + 1, 1)))  # [depth + 1, V]
    total = 0.0
    for tokens in itertools.product(range(v), repeat=depth):
        weight = float(np.prod(q[list(tokens)]))
        if weight == 0.0:
            continue
        law = outcome_law(TokenTree.chain(0, list(tokens), law="iid"), target_probs, draft_probs).sum(1)  # [d + 1]
        total += weight * float((torch.arange(depth + 1, dtype=law.dtype) * law).sum())
    return total


def token_outcome_law(tree, target_probs, draft_probs):
    """A deliberately different verifier for the twin: token-by-token acceptance, as a law of tau."""
    depth = tree.num_nodes - 1
    ratios = [min(1.0, float(target_probs[i, tree.tokens[i + 1]] / draft_probs[i, tree.tokens[i + 1]]))
              for i in range(depth)]
    keep = np.concatenate(([1.0], np.cumprod(ratios)))  # P(tau >= i), i = 0 .. d
    law = keep - np.concatenate((keep[1:], [0.0]))
    return torch.tensor(law)[:, None]


@pytest.mark.parametrize("seed, v, depth, zeros", [(0, 3, 1, False), (1, 3, 3, False), (2, 4, 3, False),
                                                    (3, 4, 2, True), (4, 2, 5, False)])
def test_block_equals_treespec_block_verifier(seed, v, depth, zeros):
    p, q = random_pair(np.random.default_rng(seed), v, zeros)
    assert chain_acceptance(p, q, depth, "block") == pytest.approx(enumerated(p, q, depth, block_outcome_law),
                                                                   abs=1e-12)


def test_the_block_comparison_fails_on_another_verifier():
    """The broken twin: token-by-token verification's law, enumerated the same way, is neither block's value nor
    the optimum."""
    p, q = random_pair(np.random.default_rng(2), 4, False)
    broken = enumerated(p, q, 3, token_outcome_law)
    assert broken == pytest.approx(chain_acceptance(p, q, 3, "token"), abs=1e-12)
    assert abs(broken - chain_acceptance(p, q, 3, "block")) > 1e-3
    assert abs(broken - lp_chain_optimal_acceptance(p, q, 3)) > 1e-3


def test_block_is_the_optimum_and_ordering():
    """token <= block = LP optimum <= prefix bound on 12 seeded random pairs; all are alpha at depth 1."""
    rng = np.random.default_rng(5)
    for trial in range(12):
        v, depth = int(rng.integers(2, 5)), int(rng.integers(1, 4))
        p, q = random_pair(rng, v, zeros=trial % 3 == 0)
        token, block = chain_acceptance(p, q, depth, "token"), chain_acceptance(p, q, depth, "block")
        optimum, bound = lp_chain_optimal_acceptance(p, q, depth), chain_acceptance_upper_bound(p, q, depth)
        assert token <= block + 1e-12 and block == pytest.approx(optimum, abs=1e-7) and optimum <= bound + 1e-7
        if depth == 1:
            alpha = float(np.minimum(p, q).sum())
            assert token == pytest.approx(alpha) and block == pytest.approx(alpha)
            assert optimum == pytest.approx(alpha, abs=1e-7) and bound == pytest.approx(alpha)


def test_block_gains_where_the_draft_is_off():
    """A case by hand: p = (0.6, 0.3, 0.1), q = (0.2, 0.3, 0.5), two drafts: token 0.6 + 0.36, block 1.0."""
    p, q = [0.6, 0.3, 0.1], [0.2, 0.3, 0.5]
    assert chain_acceptance(p, q, 2, "token") == pytest.approx(0.96)
    assert chain_acceptance(p, q, 2, "block") == pytest.approx(1.0)
    assert chain_acceptance_upper_bound(p, q, 2) == pytest.approx(1.04)
    assert chain_acceptance(p, p, 4, "block") == pytest.approx(4.0)  # the draft is the target: all kept


def test_prefix_bound_by_brute_force():
    p, q = random_pair(np.random.default_rng(7), 3, True)
    expected = sum(min(np.prod(p[list(x)]), np.prod(q[list(x)]))
                   for j in range(1, 4) for x in itertools.product(range(3), repeat=j))
    assert chain_acceptance_upper_bound(p, q, 3) == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("verifier", ["token", "block", "bound"])
def test_sampled_estimate_agrees(verifier):
    """Seed 0, 40,000 blocks over two chunks: within 4 standard errors of the exact value (about 6e-5 two-sided)."""
    p, q = random_pair(np.random.default_rng(1), 5, False)
    exact = (chain_acceptance_upper_bound(p, q, 3) if verifier == "bound"
             else chain_acceptance(p, q, 3, verifier))
    old = chains.SAMPLE_CHUNK
    chains.SAMPLE_CHUNK = 75_000  # 25,000 blocks of 3 drafts a chunk
    try:
        est = sample_chain_acceptance(p, q, 3, verifier, samples=40_000, seed=0)
    finally:
        chains.SAMPLE_CHUNK = old
    assert est.samples == 40_000 and 0 < est.stderr < 0.02
    assert abs(est.mean - exact) < 4 * est.stderr


def test_sampled_estimate_detects_a_wrong_value():
    """The twin: the same estimate rejects token verification's value as block's (their gap >> 4 stderr)."""
    p, q = [0.6, 0.3, 0.1], [0.2, 0.3, 0.5]
    est = sample_chain_acceptance(p, q, 3, "block", samples=40_000, seed=0)
    assert abs(est.mean - chain_acceptance(p, q, 3, "token")) > 4 * est.stderr


def test_residual_mass_on_a_full_vocabulary():
    """The sorted-ratio residual mass equals sum((w p - q)_+) computed directly, at w = 1, at ties r = 1 / w and
    elsewhere, with zeros in p and q."""
    rng = np.random.default_rng(8)
    p, q = rng.dirichlet(np.ones(262_144)), rng.dirichlet(np.ones(262_144))
    p[:100], q[100:200] = 0.0, 0.0
    p, q = p / p.sum(), q / q.sum()
    mass = chains._ResidualMass(p, q)
    w = np.array([1.0, 0.5, 0.1, 1e-6, 0.0, q[300] / p[300]])  # the last: a tie at token 300
    direct = np.array([np.maximum(x * p - q, 0.0).sum() for x in w])
    assert np.allclose(mass(w), direct, rtol=1e-9, atol=1e-15)


def test_prefix_bound_terms_survive_huge_and_zero_ratios():
    """A ratio of 1e300 then 1e300 then 0: the running product clips to 1, then 1, then 0 (no inf * 0 = NaN)."""
    terms = chains._prefix_bound_terms(np.array([[1e300, 1e300, 0.0, 5.0]]))
    assert terms.tolist() == [2.0]


def test_sampled_estimate_on_a_full_vocabulary():
    """262,144 entries, 20,000 blocks (seed 1, the same blocks for each): token's estimate within 4 standard
    errors of its closed form; block minus token and bound minus block, paired per block, not below -4 of their
    own standard errors (block >= token and bound >= block hold in expectation, not block by block)."""
    rng = np.random.default_rng(3)
    logits = rng.standard_normal(262_144) * 3
    p = np.exp(logits - logits.max())
    q = np.exp(0.8 * logits + rng.standard_normal(262_144) - (0.8 * logits).max())
    p, q = p / p.sum(), q / q.sum()
    token = sample_chain_acceptance(p, q, 4, "token", samples=20_000, seed=1)
    assert token.mean == pytest.approx(chain_acceptance(p, q, 4, "token"), abs=4 * token.stderr)
    q_atoms, r_atoms = chains._atoms(p, q)
    ratios = r_atoms[np.random.default_rng(1).choice(q_atoms.size, size=(20_000, 4), p=q_atoms / q_atoms.sum())]
    mass = chains._ResidualMass(p, q)
    block_v, token_v = chains._conditional_tau(ratios, mass, "block"), chains._conditional_tau(ratios, mass, "token")
    bound_v = chains._prefix_bound_terms(ratios)
    for diff in (block_v - token_v, bound_v - block_v):
        assert diff.mean() > -4 * diff.std(ddof=1) / np.sqrt(diff.size)


@pytest.mark.parametrize("call, match", [
    (lambda: chain_acceptance([0.5, 0.5], [0.5, 0.5], 0), "depth must be a positive integer"),
    (lambda: chain_acceptance([0.5, 0.5], [0.5, 0.5], 2, "kseq"), "unknown chain verifier"),
    (lambda: chain_acceptance(np.ones(100) / 100, np.ones(100) / 100, 3), "limit is"),
    (lambda: chain_acceptance(np.ones(10) / 10, np.ones(10) / 10, 400), "limit is"),  # no float overflow
    (lambda: lp_chain_optimal_acceptance(np.ones(10) / 10, np.ones(10) / 10, 3), "lp_chain_optimal_acceptance"),
    (lambda: sample_chain_acceptance([0.5, 0.5], [0.5, 0.5], 2, samples=1), "samples must be"),
    (lambda: sample_chain_acceptance([0.5, 0.5], [0.5, 0.5], 2, "kseq"), "'bound'"),
    (lambda: sample_chain_acceptance([0.5, 0.5], [0.5, 0.5], 2, seed=1.5), "seed must be"),
    (lambda: sample_chain_acceptance([0.5, 0.5], [0.5, 0.5], 10**6), "drafts sample_chain_acceptance takes"),
    (lambda: chain_acceptance([0.5, 0.6], [0.5, 0.5], 2), "sum"),
])
def test_bad_input(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_every_ot_bounds_example_runs():
    """The docstrings' examples (numpydoc ``Examples``) of every ot_bounds module hold."""
    failed, attempted = 0, 0
    for info in pkgutil.walk_packages(ot_bounds.__path__, "ot_bounds."):
        if info.name == "ot_bounds.__main__":  # the command line: importing it runs it
            continue
        result = doctest.testmod(importlib.import_module(info.name), optionflags=doctest.ELLIPSIS)
        failed, attempted = failed + result.failed, attempted + result.attempted
    assert attempted >= 20 and failed == 0


def test_a_chain_with_one_draftable_token():
    """q a point mass: 200 drafts enumerate one block (no dimension limit of numpy's index arrays)."""
    p, q = [0.5, 0.5], [1.0, 0.0]
    assert chain_acceptance(p, q, 200, "block") == pytest.approx(chain_acceptance(p, q, 200, "token"))
    assert chain_acceptance(p, q, 200, "token") == pytest.approx(sum(0.5 ** i for i in range(1, 201)))
