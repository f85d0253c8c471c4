"""Block verification (``VERIFIERS["block"]``) is lossless, and keeps at least as many drafts as token-level
verification.

1. **Exact law** (float64, tolerance 1e-12): for context-dependent target / draft tables over V = 3 and chains of
   g = 1..3 drafts, every chain is enumerated with its draft probability; the law of (kept drafts, next token)
   from :func:`block_outcome_law`, continued by the target up to g + 1 tokens, must be the target's joint law.
   A twin that forgets the block weight in the residual fails it.
2. **Sampling** (G test, alpha = 1e-3, seeds fixed, 4,000 verifications): ``VERIFIERS["block"]`` and a slow
   loop written from the procedure's definition (one uniform per draft, the LAST passing test decides) both
   follow :func:`block_outcome_law`; a loop that takes the FIRST passing test fails.
3. The expected number of kept drafts is at least token-level verification's, on every table.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from stats_helpers import g_test
from treespec.tree import TokenTree
from treespec.verify import VERIFIERS, block
from treespec.verify.block import block_outcome_law

DT = torch.float64
V = 3
ALPHA = 1e-3


def _tables(seed: int, depth: int, zeros: bool) -> tuple[dict, dict]:
    """Target and draft next-token laws for every prefix of up to ``depth`` tokens (context-dependent)."""
    rng = np.random.default_rng(seed)
    target, draft = {}, {}
    for length in range(depth + 1):
        for prefix in itertools.product(range(V), repeat=length):
            p = rng.dirichlet(np.full(V, 0.7))
            q = rng.dirichlet(np.full(V, 0.7))
            if zeros and rng.random() < 0.3:
                p[rng.integers(V)] = 0.0
            if zeros and rng.random() < 0.3:
                q[rng.integers(V)] = 0.0
            target[prefix], draft[prefix] = p / p.sum(), q / q.sum()
    return target, draft


def _chain(xs: tuple[int, ...], target: dict, draft: dict) -> tuple[TokenTree, torch.Tensor, torch.Tensor]:
    tree = TokenTree.chain(0, list(xs), "iid")
    p = torch.tensor(np.stack([target[xs[:i]] for i in range(len(xs) + 1)]), dtype=DT)  # [g + 1, V]
    q = torch.tensor(np.stack([draft[xs[:i]] for i in range(len(xs) + 1)]), dtype=DT)  # [g + 1, V]
    return tree, p, q


def _joint(target: dict, seq: tuple[int, ...]) -> float:
    out = 1.0
    for i, x in enumerate(seq):
        out *= target[seq[:i]][x]
    return out


def _output_joint(target: dict, draft: dict, g: int, law_of=block_outcome_law) -> dict:
    """Law of the first g + 1 tokens: block verification's output, continued by the target."""
    out = {s: 0.0 for s in itertools.product(range(V), repeat=g + 1)}
    for xs in itertools.product(range(V), repeat=g):
        weight = _joint(draft, xs)
        if weight == 0:
            continue
        tree, p, q = _chain(xs, target, draft)
        law = law_of(tree, p, q).numpy()  # [g + 1, V]
        for tau in range(g + 1):
            for y in range(V):
                emitted = xs[:tau] + (y,)
                mass = weight * law[tau, y]
                if mass == 0:
                    continue
                for rest in itertools.product(range(V), repeat=g - tau):
                    seq = emitted + rest
                    out[seq] += mass * _joint(target, seq) / _joint(target, emitted)
    return out


CASES = [(seed, g, zeros) for seed in range(6) for g in (1, 2, 3) for zeros in (False, True)]


@pytest.mark.parametrize("seed, g, zeros", CASES)
def test_exact_output_law_is_the_target(seed, g, zeros):
    target, draft = _tables(seed, g, zeros)
    out = _output_joint(target, draft, g)
    err = max(abs(mass - _joint(target, seq)) for seq, mass in out.items())
    assert err < 1e-12, err


def _broken_law(tree, p, q):
    """Twin: the residual after i kept drafts forgets the block weight (token-level (p - q)+)."""
    stop, _, row_of = block._block_laws(tree, p, q)
    g = tree.num_nodes - 1
    residual = (p[:g] - q[:g]).clamp(min=0)
    mass = residual.sum(dim=1, keepdim=True)
    recovered = torch.where(mass > 0, residual / torch.where(mass > 0, mass, torch.ones_like(mass)), residual)
    return stop[:, None] * torch.cat([recovered, p[g:g + 1]])


def test_exact_law_twin_without_the_block_weight_fails():
    target, draft = _tables(3, 3, False)
    out = _output_joint(target, draft, 3, law_of=_broken_law)
    err = max(abs(mass - _joint(target, seq)) for seq, mass in out.items())
    assert err > 1e-3, err


def _expected_kept(target: dict, draft: dict, g: int) -> tuple[float, float]:
    """Expected kept drafts under block verification and under token-level verification (exact)."""
    block_mean = token_mean = 0.0
    for xs in itertools.product(range(V), repeat=g):
        weight = _joint(draft, xs)
        if weight == 0:
            continue
        tree, p, q = _chain(xs, target, draft)
        law = block_outcome_law(tree, p, q).sum(dim=1).numpy()  # [g + 1] P(tau)
        block_mean += weight * float(np.dot(np.arange(g + 1), law))
        survive = 1.0
        for i, x in enumerate(xs):
            survive *= min(1.0, target[xs[:i]][x] / draft[xs[:i]][x])
            token_mean += weight * survive
    return block_mean, token_mean


@pytest.mark.parametrize("seed", range(6))
def test_keeps_at_least_as_many_drafts_as_token_verification(seed):
    target, draft = _tables(seed, 3, False)
    block_mean, token_mean = _expected_kept(target, draft, 3)
    assert block_mean >= token_mean - 1e-12, (block_mean, token_mean)


def test_keeps_more_on_the_two_token_example():
    """Target prefers b, the draft prefers a (context-free): the block keeps strictly more than tokens do."""
    target = {pre: np.array([1 / 3, 2 / 3, 0.0]) for n in range(3) for pre in itertools.product(range(V), repeat=n)}
    draft = {pre: np.array([2 / 3, 1 / 3, 0.0]) for n in range(3) for pre in itertools.product(range(V), repeat=n)}
    block_mean, token_mean = _expected_kept(target, draft, 2)
    assert block_mean > token_mean + 0.05, (block_mean, token_mean)


# ---------------------------------------------------------------------------------------------------- sampling
def _fixed_chain():
    target, draft = _tables(11, 3, False)
    return _chain((0, 2, 1), target, draft)


def _loop_reference(p: np.ndarray, q: np.ndarray, xs: list[int], rng, last: bool = True) -> tuple[int, int]:
    """The procedure as defined: one uniform per draft, tau = the last (twin: first) i with u_i <= h_i."""
    g = len(xs)
    w = [1.0]
    for i, x in enumerate(xs):
        w.append(min(1.0, w[-1] * p[i][x] / q[i][x]) if w[-1] > 0 else 0.0)
    tau = 0
    for i in range(1, g + 1):
        if i == g:
            h = w[g]
        else:
            s = np.clip(w[i] * p[i] - q[i], 0, None).sum()
            h = s / (s + 1 - w[i]) if s > 0 else 0.0
        if rng.random() <= h:
            tau = i
            if not last:
                break
    dist = p[g] if tau == g else np.clip(w[tau] * p[tau] - q[tau], 0, None)
    return tau, int(rng.choice(V, p=dist / dist.sum()))


@pytest.mark.stats
def test_verifier_samples_the_exact_law():
    # seed 5, 4,000 verifications, alpha = 1e-3
    tree, p, q = _fixed_chain()
    law = block_outcome_law(tree, p, q).numpy().ravel()
    g = torch.Generator().manual_seed(5)
    counts = np.zeros_like(law)
    for _ in range(4000):
        res = VERIFIERS["block"](tree, p, q, g)
        assert res.accepted_tokens == tree.tokens[1:1 + res.num_accepted].tolist()
        counts[res.num_accepted * V + res.next_token] += 1
    assert g_test(counts, law) > ALPHA


@pytest.mark.stats
@pytest.mark.parametrize("last, passes", [(True, True), (False, False)])
def test_loop_reference_follows_the_law_and_its_first_test_twin_fails(last, passes):
    # seed 9, 4,000 draws of the loop, alpha = 1e-3; the twin stops at the first passing test
    tree, p, q = _fixed_chain()
    law = block_outcome_law(tree, p, q).numpy().ravel()
    rng = np.random.default_rng(9)
    xs = tree.tokens[1:].tolist()
    counts = np.zeros_like(law)
    for _ in range(4000):
        tau, y = _loop_reference(p.numpy(), q.numpy(), xs, rng, last=last)
        counts[tau * V + y] += 1
    pval = g_test(counts, law)
    assert (pval > ALPHA) if passes else (pval < 1e-6), pval


def test_without_the_leaf_row_the_kept_block_emits_no_bonus():
    """Target rows over the verified nodes only: the same draws, and no bonus token after a whole block."""
    tree, p, q = _fixed_chain()
    rows = p[:-1]  # the leaf has no row
    saw_whole = saw_partial = False
    for seed in range(200):
        full = VERIFIERS["block"](tree, p, q, torch.Generator().manual_seed(seed))
        part = VERIFIERS["block"](tree, rows, q, torch.Generator().manual_seed(seed))
        assert part.accepted_nodes == full.accepted_nodes
        if full.is_bonus:
            saw_whole = True
            assert part.next_token is None
        else:
            saw_partial = True
            assert part.next_token == full.next_token
    assert saw_whole and saw_partial


def test_refuses_trees_and_other_laws():
    p = torch.full((3, V), 1 / V, dtype=DT)
    with pytest.raises(ValueError, match="chain"):
        VERIFIERS["block"](TokenTree.from_lists([-1, 0, 0], [0, 1, 2], "iid"), p, p)
    with pytest.raises(ValueError, match="iid"):
        VERIFIERS["block"](TokenTree.chain(0, [1, 2], "deterministic"), p, p)
    with pytest.raises(ValueError, match="draft_probs"):
        VERIFIERS["block"](TokenTree.chain(0, [1, 2], "iid"), p, None)


def _stopped_chain_error(target: dict, draft: dict, g_max: int, stops) -> tuple[float, set[int]]:
    """Largest error against the target's joint law of g_max + 1 tokens when the drafter ends a chain once
    ``stops(xs)`` (a rule reading the drafted prefix and q only); also the chain lengths that occurred."""

    def chains(xs, weight):
        if len(xs) == g_max or (xs and stops(xs)):
            yield xs, weight
            return
        for x in range(V):
            yield from chains(xs + (x,), weight * draft[xs][x])

    out = {s: 0.0 for s in itertools.product(range(V), repeat=g_max + 1)}
    lengths = set()
    for xs, weight in chains((), 1.0):
        lengths.add(len(xs))
        tree, p, q = _chain(xs, target, draft)
        law = block_outcome_law(tree, p, q).numpy()
        for tau in range(len(xs) + 1):
            for y in range(V):
                emitted = xs[:tau] + (y,)
                for rest in itertools.product(range(V), repeat=g_max - tau):
                    seq = emitted + rest
                    out[seq] += weight * law[tau, y] * _joint(target, seq) / _joint(target, emitted)
    return max(abs(mass - _joint(target, seq)) for seq, mass in out.items()), lengths


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("threshold", [0.5, 0.7])
def test_exact_law_with_a_draft_length_set_by_the_drafts_confidence(seed, threshold):
    """The drafter stops once its own top probability falls below ``threshold`` (a rule reading only q):
    chains of 1..3 drafts, the output still the target's law."""
    target, draft = _tables(seed, 3, False)
    err, lengths = _stopped_chain_error(target, draft, 3, lambda xs: draft[xs].max() < threshold)
    assert len(lengths) > 1  # the rule did cut some chains short
    assert err < 1e-12, err


@pytest.mark.parametrize("seed", range(4))
def test_exact_law_when_the_drafter_stops_on_its_drawn_tokens_probability(seed):
    """The shipped head's rule: a drawn token gets a child only if q gave it at least c = 0.4."""
    target, draft = _tables(seed, 3, False)
    err, lengths = _stopped_chain_error(target, draft, 3, lambda xs: draft[xs[:-1]][xs[-1]] < 0.4)
    assert len(lengths) > 1
    assert err < 1e-12, err


def test_a_row_without_finite_mass_is_named():
    """A NaN target row read by the block is the verifiers' one named error, never an IndexError."""
    tree, p, q = _fixed_chain()
    for bad in (float("nan"), float("inf")):
        broken = p.clone()
        broken[1] = bad
        with pytest.raises(ValueError, match="finite positive mass"):
            VERIFIERS["block"](tree, broken, q, torch.Generator().manual_seed(0))
