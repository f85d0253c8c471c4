"""Losslessness of every verifier, three ways.

1. **Exact laws** (float64, tolerance 1e-9): for each verifier and 240 (p, q, n) cases, enumerate
   every ordered draft tuple with its exact probability under the verifier's draft law (independent
   enumerators below, written from the law's definition) and mix ``output_law`` of the verifier's
   node rule over them: the result must be p. All tuples of all cases go through the rule in ONE
   batch, so rows with different child counts share a batch (K-SEQ's per-node n).
2. **Loop reference**: a slow textbook per-node procedure (NumPy, one uniform at a time) is
   sampled for fixed drafts; its outcome frequencies (which child, or which residual token) must
   match the rule's ``choice_probs`` / ``residual`` (G test).
3. **Tree sampling**: ``verify_*`` on a small tree drafted with ``draw_children``; the sampled
   (final node, next token) must follow the law obtained by composing each node's rule down the tree
   (G test).
Each statistical test has a twin with a deliberately broken verifier that must fail it.

Statistical conventions: G test (likelihood ratio), categories with expected count < 5 merged
into one bin, any count in a zero-probability category is a failure (p-value 0); alpha = 1e-3;
every test fixes its seed, and its sample size is stated next to it.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from scipy import optimize, stats

from stats_helpers import g_test
from treespec.drafting.laws import draw_children
from treespec.tree import DRAFT_LAWS, TokenTree
from treespec.verify import DEFAULT_VERIFIER, LAW_OF_VERIFIER, VERIFIER_LAWS, VERIFIER_RULES, VERIFIERS, output_law
from treespec.verify.core import FactoredResidual, dense_residual, residual_rows, verify_tree
from treespec.verify.rules import _normalise, _ratio

DT = torch.float64
ALPHA = 1e-3
#: statistical tests here (marked ``stats``): alpha = 1e-3, fixed numpy/torch seeds per test. For a
#: G test with N samples and df cells-1, power 0.9 needs noncentrality lambda (df 5: 29.2, df 10: 35.1,
#: df 20: 43.3, df 40: 54.9), i.e. detects KL >= lambda / (2 N) nats, TV >= sqrt(lambda / (4 N)).
#: the node-rule verifiers (block verification, a path verifier, has its own tests: test_block_verify.py)
ALL_VERIFIERS = tuple(VERIFIER_RULES)


# ====================================================================== independent law enumerators
# Each returns a list of (ordered tuple of tokens, probability > 0) under the law, for one node with
# draft distribution q (a list of floats summing to 1) and n requested children.

def _desc(q):
    """Token ids by decreasing q, ties by increasing id."""
    return sorted(range(len(q)), key=lambda y: (-q[y], y))


def enum_iid(q, n):
    out = []
    for t in itertools.product(range(len(q)), repeat=n):
        prob = math.prod(q[x] for x in t)
        if prob > 0:
            out.append((t, prob))
    return out


def enum_without_replacement(q, n):
    """Sequential draws without replacement, truncated at the support of q."""
    support = [y for y in range(len(q)) if q[y] > 0]
    out = []
    for t in itertools.permutations(support, min(n, len(support))):
        prob, left = 1.0, set(support)
        for x in t:
            prob *= q[x] / sum(q[y] for y in left)
            left.discard(x)
        out.append((t, prob))
    return out


def enum_deterministic(q, n):
    return [(tuple(_desc(q)[:n]), 1.0)]


def enum_greedy_draft(q, n):
    fixed = _desc(q)[:n - 1]
    rest = [y for y in range(len(q)) if y not in fixed]
    mass = sum(q[y] for y in rest)
    law = {y: (q[y] / mass if mass > 0 else 1.0 / len(rest)) for y in rest}
    return [(tuple(fixed) + (y,), law[y]) for y in rest if law[y] > 0]


def enum_spechub(q, n):
    if n == 1:
        return enum_iid(q, 1)
    a = max(range(len(q)), key=lambda y: (q[y], -y))  # first maximal index
    others = [y for y in range(len(q)) if y != a]
    mass = sum(q[y] for y in others)
    out = [((i, a), q[i]) for i in others if q[i] > 0]  # first draw i != a, then the hub
    for i in others:  # first draw is the hub, second from q without the hub
        prob = q[a] * (q[i] / mass if mass > 0 else 1.0 / len(others))
        if prob > 0:
            out.append(((a, i), prob))
    return out


ENUMERATORS = {
    "iid": enum_iid,
    "without_replacement": enum_without_replacement,
    "deterministic": enum_deterministic,
    "greedy_draft": enum_greedy_draft,
    "spechub": enum_spechub,
}


def test_enumerators_cover_every_law_and_sum_to_one():
    assert set(ENUMERATORS) == set(DRAFT_LAWS)
    q = [0.5, 0.0, 0.3, 0.2]
    for law, enum in ENUMERATORS.items():
        for n in (1, 2, 3):
            if law == "spechub" and n > 2:
                continue
            assert sum(prob for _, prob in enum(q, n)) == pytest.approx(1.0, abs=1e-12), (law, n)


# ====================================================================== cases
KINDS = ("random", "equal", "disjoint", "point_p", "point_q", "point_both", "zeros_p", "zeros_q",
         "zeros_both", "near")


def _dirichlet(rng, v):
    return rng.dirichlet(np.full(v, rng.choice([0.3, 1.0, 3.0])))


def _zero_some(rng, x):
    keep = rng.random(len(x)) < 0.5
    keep[rng.integers(len(x))] = True
    x = np.where(keep, x, 0.0)
    return x / x.sum()


def _point(rng, v):
    x = np.zeros(v)
    x[rng.integers(v)] = 1.0
    return x


def make_pq(rng, kind, v):
    """One (p, q) pair of float64 probability vectors of size v, by edge-case kind."""
    p, q = _dirichlet(rng, v), _dirichlet(rng, v)
    if kind == "equal":
        p = q = _zero_some(rng, q) if rng.random() < 0.5 else q
    elif kind == "disjoint":
        perm = rng.permutation(v)
        cut = rng.integers(1, v)
        p = np.zeros(v); p[perm[:cut]] = rng.random(cut) + 0.1
        q = np.zeros(v); q[perm[cut:]] = rng.random(v - cut) + 0.1
    elif kind == "point_p":
        p = _point(rng, v)
    elif kind == "point_q":
        q = _point(rng, v)
    elif kind == "point_both":
        p, q = _point(rng, v), _point(rng, v)
    elif kind == "zeros_p":
        p = _zero_some(rng, p)
    elif kind == "zeros_q":
        q = _zero_some(rng, q)
    elif kind == "zeros_both":
        p, q = _zero_some(rng, p), _zero_some(rng, q)
    elif kind == "near":
        q = p + 0.05 * rng.random(v)
    return p / p.sum(), q / q.sum()


def child_counts(name, v):
    """Children per node each verifier is tested with."""
    if name == "single":
        return [1]
    if name == "spechub":
        return [2, 2, 2, 1]
    if name in ("deterministic", "greedy_draft"):
        return list(range(1, min(4, v) + 1))
    return [1, 2, 3, 4]


def make_cases(name, num_cases=240, seed=0):
    """[(p, q, n)] covering vocab 2..6, every child count and every edge-case kind."""
    rng = np.random.default_rng(seed)
    cases = []
    for c in range(num_cases):
        v = 2 + c % 5
        counts = child_counts(name, v)
        n = counts[(c // 5) % len(counts)]
        p, q = make_pq(rng, KINDS[(c // 7) % len(KINDS)], v)
        if name == "greedy":  # temperature 0: the target is a point mass
            p = np.eye(v)[int(np.argmax(p))]
        cases.append((p, q, n))
    return cases


def exact_mixture(rule, law, cases, k_max=4):
    """For each case, ``sum_tuples Q(tuple) * output_law(tuple)`` -> [num_cases, Vmax] (float64).

    One rule call per vocabulary size holding every tuple of every case of that size, so rows with
    different child counts share a batch. (Vocabularies are not padded to a common size: a padded
    token would change the laws' uniform fallbacks.) Rows of smaller vocabularies are zero-padded in
    the returned tensors only."""
    v_max = max(len(p) for p, _, _ in cases)
    mix = torch.zeros(len(cases), v_max, dtype=DT)
    choices, residuals = [], []
    for v in sorted({len(p) for p, _, _ in cases}):
        rows_p, rows_q, rows_t, rows_valid, weights, owner = [], [], [], [], [], []
        for c, (p, q, n) in enumerate(cases):
            if len(p) != v:
                continue
            for t, prob in ENUMERATORS[law](list(q), n):
                rows_p.append(p)
                rows_q.append(q)
                rows_t.append(list(t) + [0] * (k_max - len(t)))
                rows_valid.append([True] * len(t) + [False] * (k_max - len(t)))
                weights.append(prob)
                owner.append(c)
        p_rows = torch.tensor(np.array(rows_p), dtype=DT)
        q_rows = torch.tensor(np.array(rows_q), dtype=DT)
        tokens = torch.tensor(rows_t, dtype=torch.long)
        valid = torch.tensor(rows_valid)
        choice, residual = _dense(rule(p_rows, q_rows, tokens, valid))
        choices.append(choice)
        residuals.append(residual)
        law_rows = output_law(p_rows, q_rows, tokens, valid, rule)  # [R, v]
        mix[:, :v].index_add_(0, torch.tensor(owner), torch.tensor(weights, dtype=DT)[:, None] * law_rows)
    targets = torch.tensor(np.array([np.pad(p, (0, v_max - len(p))) for p, _, _ in cases]), dtype=DT)
    return mix, targets, torch.cat(choices), torch.cat([torch.nn.functional.pad(r, (0, v_max - r.shape[1]))
                                                        for r in residuals])


def _draft_law_for_exact_test(name):
    return "iid" if name == "greedy" else VERIFIER_LAWS[name][0]


# ====================================================================== 1. exact laws
@pytest.mark.parametrize("name", ALL_VERIFIERS)
def test_exact_output_law_is_the_target(name):
    cases = make_cases(name)
    assert len(cases) >= 200
    mix, targets, choice, residual = exact_mixture(VERIFIER_RULES[name], _draft_law_for_exact_test(name), cases)
    err = (mix - targets).abs().max(dim=1).values
    worst = int(err.argmax())
    assert float(err.max()) < 1e-9, (name, cases[worst])
    # The rule's outputs are probability vectors.
    assert float(choice.min()) >= -1e-12 and float(residual.min()) >= -1e-12
    assert torch.allclose(choice.sum(dim=1), torch.ones(choice.shape[0], dtype=DT), atol=1e-9)
    assert torch.allclose(residual.sum(dim=1), torch.ones(residual.shape[0], dtype=DT), atol=1e-9)


def _sparse_q_cases(seed=0, num_cases=90):
    """(p, q, n) with q zero outside at most half of the vocabulary (a draft head's q lives on its
    subset), so that the rejection rules take their support path; p: random, zero on part of q's
    support, all of its mass on q's support, or none of it there."""
    rng = np.random.default_rng(seed)
    cases = []
    for c in range(num_cases):
        v = 6 + c % 5
        s = 1 + (c // 5) % (v // 2)
        on = rng.permutation(v)[:s]
        q = np.zeros(v)
        q[on] = rng.dirichlet(np.ones(s))
        p = _dirichlet(rng, v)
        kind = c % 3
        if kind == 1:  # all of p's mass on q's support (p is 0 off it)
            p = np.zeros(v); p[on] = rng.random(s) + 0.05
        elif kind == 2 and s < v:  # part of q's support has p = 0
            p[on[: max(1, s // 2)]] = 0.0
        cases.append((p / p.sum(), q, 1 + c % 3))
    return cases


def _dense(out):
    """A rule's (choice_probs, residual) with the residual as a full tensor."""
    return out[0], dense_residual(out[1])


@pytest.mark.parametrize("name", ["rrs", "rrs_without_replacement", "single"])
def test_support_path_exact_law_and_equal_to_dense(name):
    """The rejection rules on q's support (one case per call, so the union of q's supports is at most
    half of the vocabulary and the support path runs): the exact output law is p (float64, 1e-9), and
    choice_probs / residual equal the dense reference's (1e-12), also for drawn children with q = 0."""
    from treespec.verify import rules

    law = VERIFIER_LAWS[name][0]
    dense = rules.dense_rrs_rule if law == "iid" else rules.dense_rrs_without_replacement_rule
    rule = VERIFIER_RULES[name]
    used_support_path = 0
    for p, q, n in _sparse_q_cases():
        if name == "single":
            n = 1
        tuples = ENUMERATORS[law](list(q), n)
        pr = torch.tensor(np.array([p] * len(tuples)), dtype=DT)
        qr = torch.tensor(np.array([q] * len(tuples)), dtype=DT)
        tokens = torch.tensor([list(t) for t, _ in tuples], dtype=torch.long)
        valid = torch.ones_like(tokens, dtype=torch.bool)
        weights = torch.tensor([w for _, w in tuples], dtype=DT)
        mix = (weights[:, None] * output_law(pr, qr, tokens, valid, rule)).sum(dim=0)
        assert float((mix - pr[0]).abs().max()) < 1e-9, (name, p, q, n)
        for got, ref in zip(_dense(rule(pr, qr, tokens, valid)), dense(pr, qr, tokens, valid)):
            assert torch.allclose(got, ref, atol=1e-12, rtol=0), (name, p, q, n)
        # children the law never draws (q = 0 there, some off every row's support) and invalid slots
        odd = torch.randint(0, len(p), tokens.shape, generator=torch.Generator().manual_seed(len(tuples)))
        slots = torch.rand(tokens.shape, generator=torch.Generator().manual_seed(1)) < 0.8
        for got, ref in zip(_dense(rule(pr, qr, odd, slots)), dense(pr, qr, odd, slots)):
            assert torch.allclose(got, ref, atol=1e-12, rtol=0), (name, p, q, n)
        used_support_path += int(2 * int((q > 0).sum()) <= len(q))
    assert used_support_path == len(_sparse_q_cases())


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_support_path_rows_with_different_supports(dtype):
    """One call with rows whose q's differ in support (the union still at most half of V), so a row's
    q is zero on part of the union and each row keeps its own scale off it: equal to the dense rule
    (float64 1e-12, float32 1e-6), with and without replacement."""
    from treespec.verify import rules

    g = torch.Generator().manual_seed(3)
    m, v, k = 12, 40, 4
    p = torch.softmax(2 * torch.randn(m, v, generator=g, dtype=torch.float64), dim=1)
    p[::3, 25:] = 0.0  # every third row: no target mass off the union of supports
    p = (p / p.sum(dim=1, keepdim=True)).to(dtype)
    q = torch.zeros(m, v, dtype=torch.float64)
    for i in range(m):
        on = torch.randperm(20, generator=g)[: 2 + i % 6]  # union within the first 20 of 40 columns
        q[i, on] = torch.rand(on.numel(), generator=g, dtype=torch.float64) + 0.05
    q = (q / q.sum(dim=1, keepdim=True)).to(dtype)
    tokens = torch.randint(0, 24, (m, k), generator=g)  # some children off every row's support
    valid = torch.rand(m, k, generator=g) < 0.85
    tol = 1e-12 if dtype == torch.float64 else 1e-6
    for wor in (False, True):
        got = rules.rejection_rule(p, q, tokens, valid, without_replacement=wor)
        ref = rules.rejection_rule(p, q, tokens, valid, without_replacement=wor, dense=True)
        assert isinstance(got[1], FactoredResidual) and isinstance(ref[1], torch.Tensor)
        for a, b in zip(_dense(got), ref):
            assert a.dtype == dtype and torch.allclose(a, b, atol=tol, rtol=0), wor
        # the rows verify_tree forms one at a time: equal to the dense rows, in any order and repeated
        idx = torch.tensor([5, 0, 11, 5])
        assert torch.allclose(residual_rows(got[1], idx), ref[1][idx], atol=tol, rtol=0)
        assert torch.equal(residual_rows(ref[1], idx), ref[1][idx])


def test_support_path_peaked_q_no_mass_off_support_stays_finite():
    """Regression: p one-hot on q's support and q nearly one-hot on the same token, ten children of
    that token (float32): the scale off the support grows past float32's range; the residual must stay
    finite and equal the dense rule's."""
    from treespec.verify import rules

    v = 64
    p = torch.zeros(1, v); p[0, 5] = 1.0
    q = torch.zeros(1, v); q[0, 5] = 1 - 1e-5; q[0, 6] = 1e-5
    tokens = torch.full((1, 10), 5)
    valid = torch.ones(1, 10, dtype=torch.bool)
    for wor in (False, True):
        got = _dense(rules.rejection_rule(p, q, tokens, valid, without_replacement=wor))
        ref = rules.rejection_rule(p, q, tokens, valid, without_replacement=wor, dense=True)
        assert torch.isfinite(got[1]).all() and torch.isfinite(got[0]).all()
        for a, b in zip(got, ref):
            assert torch.allclose(a, b, atol=1e-6, rtol=0), wor

def test_support_path_twin_dropping_the_mass_off_the_support_fails():
    """Twin: the support path told that q's support is the whole vocabulary (so the residual's part off
    the support, c * p, is lost) breaks the exact law on the same cases."""
    from treespec.verify import rules

    worst = 0.0
    for p, q, n in _sparse_q_cases():
        tuples = ENUMERATORS["iid"](list(q), n)
        pr = torch.tensor(np.array([p] * len(tuples)), dtype=DT)
        qr = torch.tensor(np.array([q] * len(tuples)), dtype=DT)
        cols = torch.nonzero(qr[0] > 0).flatten()

        def broken(p_, q_, t_, v_, cols=cols):
            return rules._rejection_on_support(p_, q_, t_, v_, cols, torch.ones(p_.shape[1], dtype=torch.bool),
                                               False)

        tokens = torch.tensor([list(t) for t, _ in tuples], dtype=torch.long)
        weights = torch.tensor([w for _, w in tuples], dtype=DT)
        mix = (weights[:, None] * output_law(pr, qr, tokens, torch.ones_like(tokens, dtype=torch.bool),
                                              broken)).sum(dim=0)
        worst = max(worst, float((mix - pr[0]).abs().max()))
    assert worst > 1e-3

def test_greedy_with_deterministic_candidates_is_exact():
    cases = make_cases("greedy", seed=1)
    cases = [(p, q, min(n, len(p))) for p, q, n in cases]
    mix, targets, _, _ = exact_mixture(VERIFIER_RULES["greedy"], "deterministic", cases)
    assert float((mix - targets).abs().max()) < 1e-9


def test_deterministic_rule_with_repeated_and_invalid_candidates():
    # a candidate offered twice is accepted at most once (r(x) = 0 after its rejection); invalid
    # slots are skipped: the output law stays p exactly, and the choice matches a loop over ranks
    rng = np.random.default_rng(7)
    for xs, valid in [((2, 2, 0), (1, 1, 1)), ((1, 3, 1, 3), (1, 1, 1, 1)), ((0, 4, 0), (1, 0, 1)),
                      ((3, 3), (1, 1)), ((4, 0, 4), (0, 1, 1)), ((3, 0, 4), (0, 1, 1)), ((1, 0, 2, 3, 4), (1, 1, 1, 1, 1))]:
        p = torch.tensor(rng.dirichlet(np.ones(5) * 0.7), dtype=DT)[None]
        tokens, ok = torch.tensor([xs]), torch.tensor([valid], dtype=torch.bool)
        law = output_law(p, None, tokens, ok, VERIFIER_RULES["deterministic"])
        assert float((law - p).abs().max()) < 1e-12, (xs, valid)
        choice, _ = VERIFIER_RULES["deterministic"](p, None, tokens, ok)
        r, alive, want = p[0].clone(), 1.0, []
        for x, v in zip(xs, valid):
            a = float(r[x]) if v else 0.0
            want.append(alive * a)
            alive *= 1 - a
            if v and float(r.sum() - r[x]) > 0:
                r[x] = 0.0
                r = r / r.sum()
        assert torch.allclose(choice[0, :-1], torch.tensor(want, dtype=DT), atol=1e-12), (xs, valid)


# ------------------------------------------------------------------ broken rules (twins)
def broken_rrs_no_residual_update(p, q, child_tokens, child_valid):
    """RRS that keeps testing against p after a rejection (the classic bug)."""
    m, k = child_tokens.shape
    alive = torch.ones(m, 1, dtype=p.dtype)
    choice = torch.zeros(m, k + 1, dtype=p.dtype)
    for i in range(k):
        x = child_tokens[:, i:i + 1]
        a = _ratio(p.gather(1, x), q.gather(1, x)) * child_valid[:, i:i + 1]
        choice[:, i:i + 1] = alive * a
        alive = alive * (1 - a)
    choice[:, k:] = alive
    residual, ok = _normalise((p - q).clamp(min=0))
    return choice, torch.where(ok, residual, p)


def broken_kseq_rho_one(p, q, child_tokens, child_valid):
    """K-SEQ with rho fixed to 1 instead of solving for rho* (over-accepts with several drafts)."""
    from treespec.verify import kseq

    original = kseq.solve_rho
    kseq.solve_rho = lambda p_, q_, n_, steps=0: torch.ones_like(n_)
    try:
        return kseq.kseq_rule(p, q, child_tokens, child_valid)
    finally:
        kseq.solve_rho = original


def broken_greedy_draft_unrestricted(p, q, child_tokens, child_valid):
    """Greedy drafting verified against q instead of the restricted q' it was drawn from."""
    from treespec.verify import greedy_draft

    original = greedy_draft.restricted_draft
    greedy_draft.restricted_draft = lambda q_, mask: q_
    try:
        return greedy_draft.greedy_draft_rule(p, q, child_tokens, child_valid)
    finally:
        greedy_draft.restricted_draft = original


def broken_spechub_no_hub_factor(p, q, child_tokens, child_valid):
    """SpecHub with Q(a, i) taken as qbar(i), forgetting the factor q(a)."""
    from treespec.verify import spechub

    original = spechub.hub_and_second_law

    def wrong(q_):
        a, qbar = original(q_)
        return a, qbar / q_.gather(1, a).clamp(min=1e-12)  # makes q(a) * qbar == qbar

    spechub.hub_and_second_law = wrong
    try:
        return spechub.spechub_rule(p, q, child_tokens, child_valid)
    finally:
        spechub.hub_and_second_law = original


@pytest.mark.parametrize("broken, name", [
    (broken_rrs_no_residual_update, "rrs"),
    (broken_kseq_rho_one, "kseq"),
    (broken_greedy_draft_unrestricted, "greedy_draft"),
    (broken_spechub_no_hub_factor, "spechub"),
])
def test_exact_law_test_catches_broken_rules(broken, name):
    cases = [c for c in make_cases(name) if c[2] >= 2]
    mix, targets, _, _ = exact_mixture(broken, _draft_law_for_exact_test(name), cases)
    assert float((mix - targets).abs().max()) > 1e-3


# ====================================================================== statistics helpers
# ====================================================================== 2. loop reference
def _pos_norm(x, fallback):
    x = np.clip(x, 0.0, None)
    s = x.sum()
    return x / s if s > 0 else fallback


def _test(u, num, den):
    """``u < num / den`` with the convention that an impossible draft (den == 0) passes iff num > 0."""
    return num > 0 if den <= 0 else u * den < num


def ref_rrs(p, q, xs, rng, without_replacement=False):
    r, qi = p.copy(), q.copy()
    for j, x in enumerate(xs):
        if _test(rng.random(), r[x], qi[x]):
            return ("child", j)
        r = _pos_norm(r - qi, r)
        if without_replacement:
            nq = qi.copy(); nq[x] = 0.0
            qi = _pos_norm(nq, qi)
    return ("res", int(rng.choice(len(p), p=r)))


def ref_deterministic(p, q, xs, rng):
    r = p.copy()
    for j, x in enumerate(xs):
        if rng.random() < r[x]:
            return ("child", j)
        nr = r.copy(); nr[x] = 0.0
        r = _pos_norm(nr, r)
    return ("res", int(rng.choice(len(p), p=r)))


def ref_greedy(p, q, xs, rng):
    best = int(np.argmax(p))
    for j, x in enumerate(xs):
        if x == best:
            return ("child", j)
    return ("res", best)


def ref_kseq(p, q, xs, rng):
    n = len(xs)

    def beta(rho):
        return np.minimum(q, p / rho).sum()

    def f(rho):
        return 1 - (1 - beta(rho)) ** n - rho * beta(rho)

    rho = 1.0 if n == 1 or f(n) >= 0 or f(1.0) <= 0 else optimize.brentq(f, 1.0, float(n), xtol=1e-14)
    for j, x in enumerate(xs):
        if _test(rng.random(), p[x] / rho, q[x]):
            return ("child", j)
    b = beta(rho)
    scale = (1 - (1 - b) ** n) / b if b > 0 else n
    r = _pos_norm(p - np.minimum(q, p / rho) * scale, p)
    return ("res", int(rng.choice(len(p), p=r)))


def ref_greedy_draft(p, q, xs, rng):
    fixed, x = list(xs[:-1]), xs[-1]
    rest = np.ones(len(q), dtype=bool); rest[fixed] = False
    q_rest = _pos_norm(np.where(rest, q, 0.0), rest / rest.sum())
    if _test(rng.random(), p[x], q_rest[x]):
        return ("child", len(xs) - 1)
    y = int(rng.choice(len(p), p=_pos_norm(p - q_rest, p)))
    return ("child", fixed.index(y)) if y in fixed else ("res", y)


def ref_spechub(p, q, xs, rng):
    v = len(q)
    if len(xs) == 1:
        return ref_rrs(p, q, xs, rng)
    a = int(np.argmax(q))
    others = np.arange(v) != a
    qbar = _pos_norm(np.where(others, q, 0.0), others / others.sum())
    q_ia = np.where(others, q, 0.0)  # Q(i, a)
    q_ai = q[a] * qbar  # Q(a, i)
    p_off = np.where(others, p, 0.0)
    first_i = xs[1] == a
    i = xs[0] if first_i else xs[1]
    if first_i and _test(rng.random(), p[i], q_ia[i]):  # step 1: pair (i, a), accept i
        return ("child", 0)
    p1 = np.clip(p_off - q_ia, 0, None)
    if not first_i and _test(rng.random(), p1[i], q_ai[i]):  # step 2: pair (a, i), accept i
        return ("child", 1)
    p2 = np.clip(p1 - q_ai, 0, None)
    s_ai = np.clip(q_ai - p1, 0, None).sum()
    s_ia = np.clip(q_ia - p_off, 0, None).sum()
    if not first_i and _test(rng.random(), p[a], s_ai):  # step 3: pair (a, i), accept the hub
        return ("child", 0)
    pa1 = max(p[a] - s_ai, 0.0)
    if first_i and _test(rng.random(), pa1, s_ia):  # step 4: pair (i, a), accept the hub
        return ("child", 1)
    r = p2.copy(); r[a] = max(pa1 - s_ia, 0.0)
    return ("res", int(rng.choice(v, p=_pos_norm(r, p))))


REFERENCES = {
    "greedy": ref_greedy,
    "single": ref_rrs,
    "rrs": ref_rrs,
    "rrs_without_replacement": lambda p, q, xs, rng: ref_rrs(p, q, xs, rng, without_replacement=True),
    "deterministic": ref_deterministic,
    "kseq": ref_kseq,
    "greedy_draft": ref_greedy_draft,
    "spechub": ref_spechub,
}


def _loop_vs_rule(reference, rule, p, q, xs, num_samples, seed):
    """p-value of the reference procedure's outcome counts against the rule's exact outcome law."""
    k, v = len(xs), len(p)
    choice, residual = _dense(rule(torch.tensor(p, dtype=DT)[None], torch.tensor(q, dtype=DT)[None],
                                   torch.tensor([list(xs)]), torch.ones(1, k, dtype=torch.bool)))
    probs = np.concatenate([choice[0, :k].numpy(), float(choice[0, k]) * residual[0].numpy()])
    rng = np.random.default_rng(seed)
    counts = np.zeros(k + v)
    for _ in range(num_samples):
        kind, idx = reference(p, q, list(xs), rng)
        counts[idx if kind == "child" else k + idx] += 1
    return g_test(counts, probs)


def _loop_cases(name, seed):
    """Three (p, q, drafts) per verifier, vocab 4, drafts sampled from the verifier's own law."""
    rng = np.random.default_rng(seed)
    out = []
    for kind in ("random", "zeros_both", "near"):
        p, q = make_pq(rng, kind, 4)
        if name == "greedy":
            p = np.eye(4)[int(np.argmax(p))]
        n = 1 if name == "single" else (2 if name == "spechub" else 3)
        tuples = ENUMERATORS[_draft_law_for_exact_test(name)](list(q), n)
        weights = np.array([w for _, w in tuples])
        xs = tuples[rng.choice(len(tuples), p=weights / weights.sum())][0]
        out.append((p, q, xs))
    return out


@pytest.mark.stats
@pytest.mark.parametrize("name", ALL_VERIFIERS)
def test_loop_reference_matches_rule(name):
    # seed 10 + case index, 2000 samples per case, alpha = 1e-3 per case
    for idx, (p, q, xs) in enumerate(_loop_cases(name, seed=100 + ALL_VERIFIERS.index(name))):
        pval = _loop_vs_rule(REFERENCES[name], VERIFIER_RULES[name], p, q, xs, 2000, seed=10 + idx)
        assert pval > ALPHA, (name, p, q, xs, pval)


@pytest.mark.stats
def test_loop_reference_twin_broken_rrs_fails():
    # The rule forgets the residual update; the textbook loop does it. 2000 samples, seed 3.
    p = np.array([0.1, 0.5, 0.4, 0.0])
    q = np.array([0.55, 0.15, 0.1, 0.2])
    pval = _loop_vs_rule(REFERENCES["rrs"], broken_rrs_no_residual_update, p, q, (0, 0, 1), 2000, seed=3)
    assert pval < 1e-6


# ====================================================================== 3. tree sampling
def _tree_for(name, v=3, seed=0):
    """A 2-level tree drafted with draw_children under the verifier's law, plus target / draft rows.

    Root with n children; its first child has n children, its second child (if any) has one
    (so nodes with different child counts share a verification batch). ``single``: a chain.
    """
    law = LAW_OF_VERIFIER[name]
    g = torch.Generator().manual_seed(seed)
    n = 1 if name == "single" else 2 if name == "spechub" else 3
    max_nodes = 1 + n + n + 1
    draft = torch.softmax(1.5 * torch.randn(max_nodes, v, generator=g, dtype=DT), dim=1)
    target = torch.softmax(1.5 * torch.randn(max_nodes, v, generator=g, dtype=DT), dim=1)
    target[:, -1] = 0.0  # zeros in p
    target = target / target.sum(dim=1, keepdim=True)
    if name == "greedy":
        target = torch.nn.functional.one_hot(target.argmax(dim=1), v).to(DT)
    parents, tokens = [-1], [0]
    kids = draw_children(draft[0:1], n, law, g)
    first_level = []
    for j in range(n):
        if bool(kids.valid[0, j]):
            parents.append(0); tokens.append(int(kids.tokens[0, j])); first_level.append(len(parents) - 1)
    for depth_one, count in zip(first_level, [n, 1]):
        kids = draw_children(draft[depth_one:depth_one + 1], count, law, g)
        for j in range(count):
            if bool(kids.valid[0, j]):
                parents.append(depth_one); tokens.append(int(kids.tokens[0, j]))
    tree = TokenTree.from_lists(parents, tokens, law)
    return tree, target[:tree.num_nodes], draft[:tree.num_nodes]


def composed_outcome_law(tree, target, draft, rule):
    """Exact law of (final node, next token) ``[num_nodes, V]``, composing the rule node by node."""
    v = target.shape[1]
    law = torch.zeros(tree.num_nodes, v, dtype=DT)
    children = [[c for c in tree.children[u].tolist() if c >= 0] for u in range(tree.num_nodes)]

    def walk(u, mass):
        kids = children[u]
        if not kids:
            law[u] += mass * target[u]
            return
        toks = tree.tokens[kids][None]
        choice, residual = _dense(rule(target[u:u + 1], draft[u:u + 1], toks,
                                       torch.ones_like(toks, dtype=torch.bool)))
        for j, c in enumerate(kids):
            walk(c, mass * choice[0, j])
        law[u] += mass * choice[0, len(kids)] * residual[0]

    walk(0, torch.tensor(1.0, dtype=DT))
    return law


def _sample_outcomes(verify, tree, target, draft, num_samples, seed):
    g = torch.Generator().manual_seed(seed)
    counts = np.zeros((tree.num_nodes, target.shape[1]))
    for _ in range(num_samples):
        res = verify(tree, target, draft, g)
        final = res.accepted_nodes[-1] if res.accepted_nodes else 0
        assert res.accepted_tokens == [int(tree.tokens[i]) for i in res.accepted_nodes]
        assert res.is_bonus == (int(tree.num_children[final]) == 0)
        counts[final, res.next_token] += 1
    return counts


@pytest.mark.stats
@pytest.mark.parametrize("name", ALL_VERIFIERS)
def test_tree_sampling_follows_composed_law(name):
    # seed 7 for drafting, seed 11 for verification, 600 verifications, alpha = 1e-3
    tree, target, draft = _tree_for(name, seed=7)
    law = composed_outcome_law(tree, target, draft, VERIFIER_RULES[name])
    assert float(law.sum()) == pytest.approx(1.0, abs=1e-12)
    counts = _sample_outcomes(VERIFIERS[name], tree, target, draft, 600, seed=11)
    pval = g_test(counts.ravel(), law.numpy().ravel())
    assert pval > ALPHA, (name, pval)


@pytest.mark.stats
def test_tree_sampling_twin_broken_verifier_fails():
    # verify_tree driven by the RRS rule without the residual update; 600 verifications, seed 11.
    tree = TokenTree.from_lists([-1, 0, 0, 0, 1, 1], [0, 0, 0, 1, 2, 2], "iid")
    target = torch.tensor([[0.1, 0.5, 0.4]] * 6, dtype=DT)
    draft = torch.tensor([[0.7, 0.2, 0.1]] * 6, dtype=DT)
    law = composed_outcome_law(tree, target, draft, VERIFIER_RULES["rrs"])
    good = _sample_outcomes(VERIFIERS["rrs"], tree, target, draft, 600, seed=11)
    assert g_test(good.ravel(), law.numpy().ravel()) > ALPHA

    def broken(tree_, target_, draft_, generator):
        return verify_tree(tree_, target_, draft_, generator, broken_rrs_no_residual_update)

    bad = _sample_outcomes(broken, tree, target, draft, 600, seed=11)
    assert g_test(bad.ravel(), law.numpy().ravel()) < 1e-6


@pytest.mark.stats
def test_tree_sampling_twin_wrong_temperature_fails():
    # Children drawn from q at temperature 1, verified with q at temperature 0.5: 600 verifications.
    tree = TokenTree.from_lists([-1, 0, 0], [0, 1, 2], "iid")
    logits = torch.tensor([[0.0, 1.0, 1.5]] * 3, dtype=DT)
    draft = torch.softmax(logits, dim=1)
    sharper = torch.softmax(logits / 0.5, dim=1)
    target = torch.tensor([[0.6, 0.25, 0.15]] * 3, dtype=DT)
    law = composed_outcome_law(tree, target, draft, VERIFIER_RULES["rrs"])
    good = _sample_outcomes(VERIFIERS["rrs"], tree, target, draft, 600, seed=5)
    assert g_test(good.ravel(), law.numpy().ravel()) > ALPHA
    bad = _sample_outcomes(VERIFIERS["rrs"], tree, target, sharper, 600, seed=5)
    assert g_test(bad.ravel(), law.numpy().ravel()) < 1e-6


# ====================================================================== refusals and shapes
def _tiny_tree(law, n=2):
    return TokenTree.from_lists([-1] + [0] * n, [0] + list(range(1, n + 1)), law)


@pytest.mark.parametrize("name", [n for n in ALL_VERIFIERS if VERIFIER_LAWS[n] is not None])
def test_verifier_refuses_other_draft_laws(name):
    probs = torch.full((3, 4), 0.25, dtype=DT)
    for law in DRAFT_LAWS:
        if law in VERIFIER_LAWS[name]:
            continue
        with pytest.raises(ValueError) as err:
            VERIFIERS[name](_tiny_tree(law, 2), probs, probs)
        assert repr(name) in str(err.value) and repr(law) in str(err.value)


def test_greedy_accepts_every_law():
    probs = torch.tensor([[0.1, 0.6, 0.2, 0.1]] * 3, dtype=DT)
    for law in DRAFT_LAWS:
        res = VERIFIERS["greedy"](_tiny_tree(law, 2), probs)
        assert res.tokens[0] == 1


def test_single_refuses_several_children():
    probs = torch.full((3, 4), 0.25, dtype=DT)
    with pytest.raises(ValueError, match="at most one child"):
        VERIFIERS["single"](_tiny_tree("iid", 2), probs, probs)


def test_spechub_refuses_more_than_two_children():
    probs = torch.full((4, 4), 0.25, dtype=DT)
    with pytest.raises(ValueError, match="at most 2 children"):
        VERIFIERS["spechub"](_tiny_tree("spechub", 3), probs, probs)
    with pytest.raises(ValueError, match="at most 2 children"):
        draw_children(probs, 3, "spechub")


@pytest.mark.parametrize("name", ALL_VERIFIERS)
def test_shape_mismatches_raise(name):
    law = LAW_OF_VERIFIER[name]
    tree = _tiny_tree(law, 1)
    good = torch.full((2, 4), 0.25, dtype=DT)
    with pytest.raises(ValueError, match="target_probs"):
        VERIFIERS[name](tree, torch.full((3, 4), 0.25, dtype=DT), good)
    with pytest.raises(ValueError, match="target_probs"):
        VERIFIERS[name](tree, torch.full((2,), 0.5, dtype=DT), good)
    if name in ("greedy", "deterministic"):
        return  # these ignore draft_probs
    with pytest.raises(ValueError, match="draft_probs"):
        VERIFIERS[name](tree, good, torch.full((2, 5), 0.2, dtype=DT))
    with pytest.raises(ValueError, match="draft_probs"):
        VERIFIERS[name](tree, good, None)


def test_registries_agree():
    assert set(VERIFIERS) == set(VERIFIER_LAWS) == set(LAW_OF_VERIFIER)
    assert set(VERIFIER_RULES) == set(VERIFIERS) - {"block", "traversal"}  # path verifiers judge whole paths
    for name, law in LAW_OF_VERIFIER.items():
        assert law in DRAFT_LAWS
        assert VERIFIER_LAWS[name] is None or law in VERIFIER_LAWS[name]
    for law, name in DEFAULT_VERIFIER.items():
        assert law in DRAFT_LAWS and LAW_OF_VERIFIER[name] == law


def test_engine_and_ot_bounds_verifier_tables_agree():
    """ot_bounds may not import treespec, so it keeps its own verifier -> law table; the two
    must name the same verifiers (ot_bounds has no "greedy") under the same draft law, spelt alike."""
    import ot_bounds.verifiers as ob
    from ot_bounds import TUPLE_LAWS

    assert set(ob.VERIFIERS) == set(ob.VERIFIER_LAW) == set(LAW_OF_VERIFIER) - {"greedy", "block", "traversal"}
    for name, law in ob.VERIFIER_LAW.items():
        assert LAW_OF_VERIFIER[name] == law, name
    assert set(TUPLE_LAWS) == set(DRAFT_LAWS)


# ====================================================================== K-SEQ details
def test_kseq_rho_solves_the_fixed_point_per_node():
    rng = np.random.default_rng(4)
    ps, qs, ns = [], [], []
    for n in (1, 2, 3, 4, 7):
        p, q = make_pq(rng, "random", 6)
        ps.append(p); qs.append(q); ns.append(n)
    from treespec.verify.kseq import solve_rho

    rho = solve_rho(torch.tensor(np.array(ps)), torch.tensor(np.array(qs)),
                    torch.tensor(ns, dtype=DT)[:, None])[:, 0].numpy()
    for p, q, n, r in zip(ps, qs, ns, rho):
        beta = np.minimum(q, p / r).sum()
        assert 1.0 <= r <= n
        assert 1 - (1 - beta) ** n <= r * beta + 1e-12  # the side that keeps the residual >= 0
        if n > 1:
            assert abs(1 - (1 - beta) ** n - r * beta) < 1e-9  # and it is the root


def test_kseq_acceptance_is_one_minus_beta_to_the_n():
    # Acceptance of K-SEQ = 1 - (1 - beta(rho*))^n, and it beats RRS's first-draft acceptance.
    rng = np.random.default_rng(5)
    p, q = make_pq(rng, "random", 5)
    for n in (1, 2, 3):
        tuples = enum_iid(list(q), n)
        toks = torch.tensor([t for t, _ in tuples])
        w = torch.tensor([pr for _, pr in tuples], dtype=DT)
        P = torch.tensor(p, dtype=DT).expand(len(tuples), -1)
        Q = torch.tensor(q, dtype=DT).expand(len(tuples), -1)
        choice, _ = VERIFIER_RULES["kseq"](P, Q, toks, torch.ones_like(toks, dtype=torch.bool))
        acc = float((w * (1 - choice[:, -1])).sum())
        from treespec.verify.kseq import solve_rho

        r = float(solve_rho(P[:1], Q[:1], torch.tensor([[float(n)]], dtype=DT)))
        beta = np.minimum(q, p / r).sum()
        assert acc == pytest.approx(1 - (1 - beta) ** n, abs=1e-12)
        assert acc >= np.minimum(p, q).sum() - 1e-12


def test_ot_bounds_verifier_table_agrees_with_the_engine():
    """ot_bounds keeps its own verifier -> draft law table (it imports no treespec module): the
    verifiers it scores are the engine's, each under the engine's draft law."""
    from ot_bounds.verifiers import VERIFIER_LAW, VERIFIERS as OT_VERIFIERS

    # greedy (temperature 0) has no coupling to score; block and traversal verification judge whole paths, not
    # one node's drafts
    assert set(OT_VERIFIERS) == set(VERIFIERS) - {"greedy", "block", "traversal"}
    for name in OT_VERIFIERS:
        assert VERIFIER_LAW[name] == LAW_OF_VERIFIER[name], name
        assert VERIFIER_LAW[name] in DRAFT_LAWS


@pytest.mark.parametrize("name", ["rrs", "rrs_without_replacement"])
def test_verify_tree_on_a_sparse_q_equals_the_dense_rule_run(name):
    """End to end through verify_tree: with q on a small support (the factored-residual path) and the same
    generator seed, the accepted path and the emitted token equal those of the dense rule (200 trees,
    float64, V = 64, supports of 4-12 tokens; children drawn under the verifier's law)."""
    from treespec.verify import rules

    law = LAW_OF_VERIFIER[name]
    dense = rules.dense_rrs_rule if law == "iid" else rules.dense_rrs_without_replacement_rule
    rule = VERIFIER_RULES[name]
    v, g = 64, torch.Generator().manual_seed(17)
    stops_at_inner = 0
    for case in range(200):
        n = 7
        q = torch.zeros(n, v, dtype=DT)
        for i in range(n):
            on = torch.randperm(v // 2, generator=g)[: 4 + case % 9]  # union within half of V
            q[i, on] = torch.softmax(2 * torch.randn(on.numel(), generator=g, dtype=DT), dim=0)
        p = torch.softmax(2 * torch.randn(n, v, generator=g, dtype=DT), dim=1)
        kids = draw_children(q[0:1], 3, law, g)
        parents, tokens = [-1], [0]
        for j in range(3):
            if bool(kids.valid[0, j]):
                parents.append(0); tokens.append(int(kids.tokens[0, j]))
        below = draw_children(q[1:2], 2, law, g)
        for j in range(2):
            if bool(below.valid[0, j]):
                parents.append(1); tokens.append(int(below.tokens[0, j]))
        tree = TokenTree.from_lists(parents, tokens, law)
        m = tree.num_nodes
        seed = 1000 + case
        got = verify_tree(tree, p[:m], q[:m], torch.Generator().manual_seed(seed), rule)
        ref = verify_tree(tree, p[:m], q[:m], torch.Generator().manual_seed(seed), dense)
        assert (got.accepted_nodes, got.next_token, got.is_bonus) == (ref.accepted_nodes, ref.next_token,
                                                                     ref.is_bonus), case
        stops_at_inner += int(not got.is_bonus)
    assert stops_at_inner > 50  # the recovered token (the factored row) is drawn in many cases
