"""Traversal verification (``VERIFIERS["traversal"]``) is lossless on i.i.d.-drafted trees, and keeps at least as
many drafts as token-level recursive rejection sampling (``rrs``).

1. **Exact law** (float64, tolerance 1e-12): for context-dependent target / draft tables over V = 3 (with zeros in
   p and q) and trees of several shapes (widths (2,), (3,), (2, 1), (2, 2) and two uneven ones), every tree is
   enumerated with its i.i.d. draft probability; the law of (accepted path, next token) from
   :func:`traversal_outcome_law`, continued by the target to depth + 1 tokens, must be the target's joint law.
   Two twins fail it: one updates a rejected node with token-level RRS's residual (the path weight kept aside),
   one forgets the residual (the node keeps its state).
2. **Sampling** (G test, alpha = 1e-3, seeds fixed, 4,000 verifications): ``VERIFIERS["traversal"]`` and a slow
   recursive loop written from the procedure's definition both follow :func:`traversal_outcome_law`; the sampler
   with the RRS-residual twin and the loop with that twin fail (p < 1e-6).
3. The expected number of accepted drafts is at least ``rrs``'s, exactly, on every table and shape; on a chain the
   law is block verification's and on one level RRS's.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from stats_helpers import g_test
from treespec.tree import TokenTree
from treespec.verify import SPECS, VERIFIERS, resolve_verifier, rules, traversal
from treespec.verify.block import block_outcome_law
from treespec.verify.traversal import traversal_outcome_law

DT = torch.float64
V = 3
ALPHA = 1e-3

#: tree shapes as parent lists (node 0 is the root; siblings in draft order)
SHAPES = {
    "(2,)": [-1, 0, 0],
    "(3,)": [-1, 0, 0, 0],
    "(2,1)": [-1, 0, 0, 1, 2],
    "(2,2)": [-1, 0, 0, 1, 1, 2, 2],
    "uneven": [-1, 0, 0, 1],
    "uneven2": [-1, 0, 1, 1, 0],
}


def _tables(seed: int, depth: int, zeros: bool) -> tuple[dict, dict]:
    """Target and draft next-token laws for every prefix of up to ``depth`` tokens (context-dependent)."""
    rng = np.random.default_rng(seed)
    target, draft = {}, {}
    for length in range(depth + 1):
        for prefix in itertools.product(range(V), repeat=length):
            p, q = rng.dirichlet(np.full(V, 0.7)), rng.dirichlet(np.full(V, 0.7))
            if zeros and rng.random() < 0.3:
                p[rng.integers(V)] = 0.0
            if zeros and rng.random() < 0.3:
                q[rng.integers(V)] = 0.0
            target[prefix], draft[prefix] = p / p.sum(), q / q.sum()
    return target, draft


def _prefixes(parents: list[int], toks: tuple[int, ...]) -> list[tuple[int, ...]]:
    """The drafted tokens from the root to each node (the root's prefix is empty)."""
    out = [()]
    for i in range(1, len(parents)):
        out.append(out[parents[i]] + (toks[i - 1],))
    return out


def _tree(parents: list[int], toks: tuple[int, ...], target: dict, draft: dict):
    pre = _prefixes(parents, toks)
    tree = TokenTree.from_lists(parents, [0, *toks], "iid")
    p = torch.tensor(np.stack([target[x] for x in pre]), dtype=DT)  # [n, V]
    q = torch.tensor(np.stack([draft[x] for x in pre]), dtype=DT)  # [n, V]
    return tree, p, q, pre


def _drafted(parents: list[int], draft: dict):
    """Every tree of this shape with its i.i.d. draft probability (zero-probability trees skipped)."""
    for toks in itertools.product(range(V), repeat=len(parents) - 1):
        pre = _prefixes(parents, toks)
        weight = float(np.prod([draft[pre[parents[i]]][toks[i - 1]] for i in range(1, len(parents))]))
        if weight > 0:
            yield toks, weight


def _joint(target: dict, seq: tuple[int, ...]) -> float:
    out = 1.0
    for i, x in enumerate(seq):
        out *= target[seq[:i]][x]
    return out


def _depth(parents: list[int]) -> int:
    return max(len(x) for x in _prefixes(parents, tuple([0] * (len(parents) - 1))))


def _law_error(target: dict, draft: dict, parents: list[int], law_of=traversal_outcome_law) -> float:
    """Largest error of the output (continued by the target to depth + 1 tokens) against the target's law."""
    length = _depth(parents) + 1
    out = {s: 0.0 for s in itertools.product(range(V), repeat=length)}
    for toks, weight in _drafted(parents, draft):
        tree, p, q, pre = _tree(parents, toks, target, draft)
        law = law_of(tree, p, q).numpy()  # [n, V]
        assert abs(law.sum() - 1) < 1e-12
        for v, y in itertools.product(range(len(parents)), range(V)):
            mass = weight * law[v, y]
            if mass == 0:
                continue
            emitted = pre[v] + (y,)
            for rest in itertools.product(range(V), repeat=length - len(emitted)):
                seq = emitted + rest
                out[seq] += mass * _joint(target, seq) / _joint(target, emitted)
    return max(abs(mass - _joint(target, seq)) for seq, mass in out.items())


CASES = [(seed, shape, zeros) for seed in range(4) for shape in SHAPES for zeros in (False, True)]


@pytest.mark.parametrize("seed, shape, zeros", CASES)
def test_exact_output_law_is_the_target(seed, shape, zeros):
    parents = SHAPES[shape]
    target, draft = _tables(seed, _depth(parents), zeros)
    err = _law_error(target, draft, parents)
    assert err < 1e-12, err


def _rrs_residual_twin(m: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Twin: token-level RRS's residual norm((m / alpha - q)+), scaled back by the unchanged path weight alpha."""
    alpha = m.sum(dim=1, keepdim=True)
    r = (m / alpha.clamp(min=1e-300) - q).clamp(min=0)
    return alpha * r / r.sum(dim=1, keepdim=True).clamp(min=1e-300)


def _no_residual_twin(m: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Twin: a rejected child leaves its parent's state as it was."""
    return m


@pytest.mark.parametrize("twin", [_rrs_residual_twin, _no_residual_twin])
def test_exact_law_twins_fail(monkeypatch, twin):
    parents = SHAPES["(2,2)"]
    target, draft = _tables(3, 2, False)
    assert _law_error(target, draft, parents) < 1e-12
    monkeypatch.setattr(traversal, "_after_rejection", twin)
    err = _law_error(target, draft, parents)
    assert err > 1e-3, err


def _rrs_kept(tree: TokenTree, p: torch.Tensor, q: torch.Tensor) -> float:
    """Expected accepted drafts of token-level RRS on one tree: the sum over nodes of P(path reaches the node)."""
    kids = tree.children  # [n, K]
    internal = torch.nonzero(tree.num_children > 0).flatten()
    valid = kids[internal] >= 0
    toks = torch.where(valid, tree.tokens[kids[internal].clamp(min=0)], 0)
    choice, _ = rules.rrs_rule(p[internal], q[internal], toks, valid)  # [M, K + 1]
    reach = torch.zeros(tree.num_nodes, dtype=DT)
    reach[0] = 1.0
    for row, v in enumerate(internal.tolist()):  # parents precede children
        for k, c in enumerate(kids[v].tolist()):
            if c >= 0:
                reach[c] = reach[v] * choice[row, k]
    return float(reach[1:].sum())


def _expected_kept(target: dict, draft: dict, parents: list[int]) -> tuple[float, float]:
    """Expected accepted drafts under traversal verification and under token-level RRS (exact)."""
    trav = tok = 0.0
    depth = torch.tensor([len(x) for x in _prefixes(parents, tuple([0] * (len(parents) - 1)))], dtype=DT)
    for toks, weight in _drafted(parents, draft):
        tree, p, q, _ = _tree(parents, toks, target, draft)
        trav += weight * float(traversal_outcome_law(tree, p, q).sum(dim=1) @ depth)
        tok += weight * _rrs_kept(tree, p, q)
    return trav, tok


@pytest.mark.parametrize("seed, shape, zeros", CASES)
def test_keeps_at_least_as_many_drafts_as_rrs(seed, shape, zeros):
    parents = SHAPES[shape]
    target, draft = _tables(seed, _depth(parents), zeros)
    trav, tok = _expected_kept(target, draft, parents)
    assert trav >= tok - 1e-12, (trav, tok)


def test_keeps_more_on_the_two_token_example():
    """Target prefers b, the draft prefers a (context-free), widths (2, 1): traversal keeps strictly more."""
    target = {pre: np.array([1 / 3, 2 / 3, 0.0]) for n in range(3) for pre in itertools.product(range(V), repeat=n)}
    draft = {pre: np.array([2 / 3, 1 / 3, 0.0]) for n in range(3) for pre in itertools.product(range(V), repeat=n)}
    trav, tok = _expected_kept(target, draft, SHAPES["(2,1)"])
    assert trav > tok + 0.01, (trav, tok)


@pytest.mark.parametrize("seed", range(3))
def test_a_chain_is_block_verification_and_one_level_is_rrs(seed):
    target, draft = _tables(seed, 3, True)
    for toks, _ in _drafted([-1, 0, 1, 2], draft):
        tree, p, q, _ = _tree([-1, 0, 1, 2], toks, target, draft)
        assert torch.allclose(traversal_outcome_law(tree, p, q), block_outcome_law(tree, p, q), atol=1e-14, rtol=0)
    for toks, _ in _drafted(SHAPES["(3,)"], draft):
        tree, p, q, _ = _tree(SHAPES["(3,)"], toks, target, draft)
        choice, residual = rules.dense_rrs_rule(p[:1], q[:1], tree.tokens[1:][None], torch.ones(1, 3, dtype=bool))
        law = traversal_outcome_law(tree, p, q)
        assert torch.allclose(law.sum(dim=1)[1:], choice[0, :3], atol=1e-14, rtol=0)
        if choice[0, 3] > 1e-12:
            assert torch.allclose(law[0], choice[0, 3] * residual[0], atol=1e-14, rtol=0)


# ---------------------------------------------------------------------------------------------------- sampling
def _fixed_tree():
    """A (2, 2) tree with path weights below 1 at the first level, where the RRS-residual twin differs: its law is
    0.099 in total variation from the true one (KL(twin || true) = 0.026 nats, so at N = 4,000 the G test's
    noncentrality is about 2 N KL = 208, far beyond the 29-55 that df 5-40 need for power 0.9 at alpha 1e-3)."""
    target, draft = _tables(0, 2, False)
    return _tree(SHAPES["(2,2)"], (2, 0, 2, 1, 2, 1), target, draft)[:3]


def _loop_reference(parents: list[int], toks: list[int], p: np.ndarray, q: np.ndarray, rng,
                    after=None) -> tuple[int, int]:
    """The procedure as defined: a recursive post-order visit, one uniform per visited node, states updated as
    children are rejected; returns (stopping node, next token)."""
    children = [[c for c in range(len(parents)) if parents[c] == v] for v in range(len(parents))]

    def update(m, qv):  # the state once a child's subtree was rejected
        r = np.clip(m - qv, 0, None)
        return r / (1 - np.minimum(m, qv).sum())

    step = after or update

    def visit(v: int, m: np.ndarray):
        for c in children[v]:
            x = toks[c]
            alpha = min(1.0, m[x] / q[v][x])
            found = visit(c, alpha * p[c])
            if found is not None:
                return found
            m = step(m, q[v])
        if v == 0 or rng.random() < m.sum():
            return v, int(rng.choice(V, p=m / m.sum()))
        return None

    return visit(0, p[0])


def _twin_update(m, qv):
    alpha = m.sum()
    r = np.clip(m / alpha - qv, 0, None)
    return alpha * r / r.sum()


@pytest.mark.stats
@pytest.mark.parametrize("twin", [False, True])
def test_verifier_samples_the_exact_law(monkeypatch, twin):
    # seed 5, 4,000 verifications, alpha = 1e-3; the twin (RRS's residual at a node below the root) must fail
    tree, p, q = _fixed_tree()
    law = traversal_outcome_law(tree, p, q).numpy().ravel()
    if twin:
        monkeypatch.setattr(traversal, "_after_rejection", _rrs_residual_twin)
    g = torch.Generator().manual_seed(5)
    counts = np.zeros_like(law)
    for _ in range(4000):
        res = VERIFIERS["traversal"](tree, p, q, g)
        node = res.accepted_nodes[-1] if res.accepted_nodes else 0
        assert res.accepted_nodes == tree.root_path(node)[1:]
        counts[node * V + res.next_token] += 1
    pval = g_test(counts, law)
    assert (pval < 1e-6) if twin else (pval > ALPHA), pval


@pytest.mark.stats
@pytest.mark.parametrize("twin", [False, True])
def test_loop_reference_follows_the_law_and_its_twin_fails(twin):
    # seed 9, 4,000 draws of the loop, alpha = 1e-3
    tree, p, q = _fixed_tree()
    law = traversal_outcome_law(tree, p, q).numpy().ravel()
    rng = np.random.default_rng(9)
    counts = np.zeros_like(law)
    for _ in range(4000):
        node, y = _loop_reference(tree.parents.tolist(), tree.tokens.tolist(), p.numpy(), q.numpy(), rng,
                                  _twin_update if twin else None)
        counts[node * V + y] += 1
    pval = g_test(counts, law)
    assert (pval < 1e-6) if twin else (pval > ALPHA), pval


def test_without_the_leaf_rows_the_path_is_the_same_and_a_leaf_emits_no_bonus():
    tree, p, q = _fixed_tree()
    rows = p.index_select(0, tree.verified_nodes)  # [R, V]: no rows for the leaves
    saw_leaf = saw_inner = False
    for seed in range(300):
        full = VERIFIERS["traversal"](tree, p, q, torch.Generator().manual_seed(seed))
        part = VERIFIERS["traversal"](tree, rows, q, torch.Generator().manual_seed(seed))
        assert (part.accepted_nodes, part.is_bonus) == (full.accepted_nodes, full.is_bonus)
        if full.is_bonus:
            saw_leaf = True
            assert part.next_token is None
        else:
            saw_inner = True
            assert part.next_token == full.next_token
    assert saw_leaf and saw_inner


def test_is_opt_in_and_refuses_other_laws():
    assert not SPECS["traversal"].default and SPECS["traversal"].laws == ("iid",)
    from treespec.sampling import SamplingConfig
    assert resolve_verifier("auto", "iid", SamplingConfig(1.0)) == "rrs"
    p = torch.full((3, V), 1 / V, dtype=DT)
    for law in ("without_replacement", "deterministic", "greedy_draft", "spechub"):
        with pytest.raises(ValueError, match="iid"):
            VERIFIERS["traversal"](TokenTree.from_lists([-1, 0, 0], [0, 1, 2], law), p, p)
    with pytest.raises(ValueError, match="draft_probs"):
        VERIFIERS["traversal"](TokenTree.from_lists([-1, 0, 0], [0, 1, 2], "iid"), p, None)
    with pytest.raises(ValueError, match="iid"):
        traversal.verify_traversal(TokenTree.from_lists([-1, 0, 0], [0, 1, 2], "deterministic"), p, p)


def test_a_lone_root_emits_a_bonus_token_from_p():
    res = VERIFIERS["traversal"](TokenTree.chain(0, [], "iid"), torch.tensor([[0.0, 1.0, 0.0]], dtype=DT), None)
    assert (res.accepted_nodes, res.next_token, res.is_bonus) == ([], 1, True)


def test_a_row_without_finite_mass_is_named():
    tree, p, q = _fixed_tree()
    for bad in (float("nan"), float("inf")):
        broken = p.clone()
        broken[1] = bad
        with pytest.raises(ValueError, match="finite positive mass"):
            VERIFIERS["traversal"](tree, broken, q, torch.Generator().manual_seed(0))


# ---------------------------------------------------------------------------------------------------- end to end
@pytest.mark.stats
@pytest.mark.parametrize("leaf_logits", [True, False])
def test_generation_follows_the_target_law(leaf_logits):
    """Generation with a tiny Llama target and draft (V = 6), i.i.d. trees of widths (3, 2), verifier traversal:
    the first three tokens over seeds 0..1499 follow the target's exact law (G test, alpha = 1e-3, as in
    test_end_to_end_stats), with every target row and with the verified rows only."""
    from test_end_to_end_stats import N, PROMPT, T1, exact_law
    from stats_helpers import g_test_law
    from treespec.generate import GenerationConfig, generate
    from treespec.models.tiny import tiny_model
    from treespec.trees.grow import ShapeDrafter
    from treespec.trees.shape import TreeShape

    target = tiny_model("llama", 6, seed=0, logit_scale=6.0)
    draft = tiny_model("llama", 6, seed=5, logit_scale=6.0)
    counts: dict[tuple[int, ...], int] = {}
    for seed in range(N):
        cfg = GenerationConfig(max_new_tokens=3, sampling=T1, stop_on_eos=False, verifier="traversal", seed=seed,
                               leaf_logits=leaf_logits)
        out = generate(target, PROMPT, ShapeDrafter(draft, TreeShape.widths((3, 2)), "iid"), cfg)
        counts[tuple(out.token_ids)] = counts.get(tuple(out.token_ids), 0) + 1
    assert g_test_law(counts, exact_law(target, T1), N) > ALPHA
