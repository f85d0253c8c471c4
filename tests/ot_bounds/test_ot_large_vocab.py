"""Fast algorithms vs independent, slower exact methods on larger vocabularies."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from ot_bounds import optimal_acceptance, optimal_subset, prob_all_drafts_in
from ot_bounds import draft_laws
from ot_bounds.draft_laws import draft_tuple_law, wor_prob_all_in


def _lm_like(v: int, seed: int, scale: float = 3.0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    z = rng.standard_normal(v) * scale
    zp = z + rng.standard_normal(v)
    q = np.exp(z - z.max())
    p = np.exp(zp - zp.max())
    return p / p.sum(), q / q.sum()


def _wor3_all_prefixes(p: np.ndarray, q: np.ndarray) -> float:
    """Exact n = 3 without replacement via the O(V^2) double sum, every prefix.

    Q_3(H) = Q_2(H) - c * sum_{i != j in H} q_i q_j / ((1 - q_i)(1 - q_i - q_j)),
    i.e. P(first two drafts in H) minus P(first two in H, third outside).
    """
    pos = np.flatnonzero(q > 0)
    order = pos[np.argsort(p[pos] / q[pos], kind="stable")]
    qs, ps = q[order], p[order]
    best, pair_sum, s1, s = 0.0, 0.0, 0.0, 0.0
    for k in range(qs.size):
        a, prev = qs[k], qs[:k]
        pair_sum += np.sum(a * prev / ((1 - a) * (1 - a - prev))) + np.sum(prev * a / ((1 - prev) * (1 - prev - a)))
        s += a
        s1 += a / (1 - a)
        c = max(1.0 - s, 0.0)
        q2 = s - c * s1
        q3 = max(q2 - c * pair_sum, 0.0) if c > 0 else 1.0
        best = min(best, ps[: k + 1].sum() - q3)
    return 1.0 + best


@pytest.mark.parametrize("seed", [0, 1])
def test_wor_n3_v2000_vs_double_sum(seed: int) -> None:
    rng = np.random.default_rng(seed)
    p, q = rng.dirichlet(np.ones(2000) * 0.3), rng.dirichlet(np.ones(2000) * 0.3)
    assert optimal_acceptance(p, q, 3, "without_replacement") == pytest.approx(_wor3_all_prefixes(p, q), abs=1e-10)
    p, q = _lm_like(2000, seed)
    assert optimal_acceptance(p, q, 3, "without_replacement") == pytest.approx(_wor3_all_prefixes(p, q), abs=1e-10)


@pytest.mark.parametrize("batch", [64, 2, 1])
@pytest.mark.parametrize("n, scale, seed", [(4, 2.0, 5), (3, 6.0, 1), (4, 6.0, 2), (5, 4.0, 3), (3, 1.0, 4)])
def test_wor_branch_and_bound_vs_full_scan(n: int, scale: float, seed: int, batch: int,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Branch and bound (monotone bounds, one shared quadrature grid) vs every prefix exactly (V = 300).

    Scale 6 makes q peaked: heavy tokens sit inside the ratio order, where the short prefixes have
    almost no mass outside their n-1 largest tokens (the slow-path / long-time-range case). With
    one or two prefixes per round the bounds before and after the evaluated ones decide most.
    """
    from ot_bounds import optimal

    monkeypatch.setattr(optimal, "_BB_BATCH", batch)
    p, q = _lm_like(300, seed, scale=scale)
    pos = np.flatnonzero(q > 0)
    order = pos[np.argsort(p[pos] / q[pos], kind="stable")]
    best = 0.0
    for k in range(1, order.size + 1):
        h = order[:k]
        best = min(best, p[h].sum() - wor_prob_all_in(q[h], float(q.sum() - q[h].sum()), n))
    assert optimal_acceptance(p, q, n, "without_replacement") == pytest.approx(1.0 + best, abs=1e-10)


def test_prefix_quadrature_matches_single_evaluations() -> None:
    """The shared grid of WorPrefixQuadrature vs one wor_prob_all_in per prefix."""
    from ot_bounds.draft_laws import WorPrefixQuadrature

    p, q = _lm_like(3000, 7, scale=4.0)
    qs = q[np.argsort(p / q, kind="stable")]
    for n in (3, 4, 6):
        ks = np.array([n, 10, 200, 1000, 1777, 2999, 3000])
        quad = WorPrefixQuadrature(qs, 0.0, n, int(ks.min()), int(ks.max()))
        ref = [wor_prob_all_in(qs[:k], float(qs[k:].sum()), n) for k in ks]
        np.testing.assert_allclose(quad(ks), ref, atol=1e-12)
        with pytest.raises(ValueError, match="range"):
            quad([3001])


def test_wor_integral_vs_enumeration() -> None:
    """The exponential-race integral vs summing the enumerated tuple law."""
    rng = np.random.default_rng(9)
    for v, n in [(7, 3), (7, 4), (6, 5), (8, 3)]:
        for conc in (0.1, 1.0):
            q = rng.dirichlet(np.full(v, conc))
            law = draft_tuple_law(q, n, "without_replacement")
            for _ in range(20):
                mask = rng.random(v) < 0.6
                ref = law.probs[np.all(mask[law.tuples], axis=1)].sum()
                assert prob_all_drafts_in(q, mask, n, "without_replacement") == pytest.approx(ref, abs=1e-12)


def test_light_count_probs_on_far_nodes() -> None:
    """P(N(t) = b) of the light tokens where q t passes expm1's overflow (~709): against the direct
    Poisson-binomial recursion, with no floating-point warning (the old form gave inf / inf = NaN)."""
    q_light = np.array([5e-6, 4.5e-6, 4e-6, 3.5e-6, 3e-6, 1e-12])
    t = np.array([1e3, 1e6, 1e8, 3e8, 1e9, 1e12])  # q t up to 5e6
    m = 4
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = draft_laws._light_count_probs(q_light, t, m)
    for row, tt in zip(got, t):
        dist = np.zeros(m)
        dist[0] = 1.0
        for qi in q_light:
            y = -np.expm1(-qi * tt)
            dist = dist * (1 - y) + np.concatenate(([0.0], dist[:-1])) * y
        assert row == pytest.approx(dist, abs=1e-12, rel=1e-9)


@pytest.mark.parametrize("lead, n", [((), 6), ((0.5,), 7), ((0.3, 0.2), 8)])
def test_wor_integral_far_nodes_vs_enumeration(lead: tuple, n: int) -> None:
    """H = a few equal small tokens plus a 1e-12 one: the n-1 largest hold almost all of H, the
    quadrature reaches t ~ 1e13, and Q still matches the enumerated tuple law (found on a real
    Gemma-3-270M / draft-head pair at n = 8, where the NaN turned alpha* into 1.0)."""
    q = np.array([*lead, 5e-6, 4.5e-6, 4e-6, 3.5e-6, 3e-6, 1e-12, 0.0])
    q[-1] = 1.0 - q.sum()
    law = draft_tuple_law(q, n, "without_replacement")
    inside = np.arange(q.size) < q.size - 1
    ref = law.probs[np.all(inside[law.tuples], axis=1)].sum()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = wor_prob_all_in(q[:-1], float(q[-1]), n)
    assert got == pytest.approx(ref, abs=1e-12)


def _count_law_by_dp(q: np.ndarray, t: float, m: int) -> np.ndarray:
    """P(N(t) = b), b < m, by the plain Poisson-binomial recursion (the obvious reference)."""
    dist = np.zeros(m)
    dist[0] = 1.0
    for qi in q:
        y = -np.expm1(-qi * t)
        dist = dist * (1 - y) + np.concatenate(([0.0], dist[:-1])) * y
    return dist


def test_light_count_probs_unequal_masses_on_far_nodes() -> None:
    """Seven 0.1 tokens, one 1e-18 and a hundred 1e-24 ones, t from 1 to 1e22: on far nodes one
    group of z dominates (Newton's identities cancel) and the exponent -s t + 7 log max x loses the
    small masses (0.7 t + 1e-18 t rounds to 0.7 t). Both are caught by the rounding bound and
    redone by the DP; the old form returned 0 where the law is 0.37 (t = 1e18) and huge values
    for P(N = 5..7) at n = 8."""
    q_light = np.array([0.1] * 7 + [1e-18] + [1e-24] * 100)
    t = np.logspace(0, 22, 89)
    m = 8
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = draft_laws._light_count_probs(q_light, t, m)
    for row, tt in zip(got, t):
        assert row == pytest.approx(_count_law_by_dp(q_light, tt, m), abs=1e-13)


@pytest.mark.parametrize("small, c", [((1e-9, 5e-10), 1e-7), ((1e-9, 5e-10), 1e-4), ((1e-18,), 1e-17)])
def test_wor_integral_unequal_light_tokens_vs_enumeration(small: tuple, c: float) -> None:
    """H = five comparable tokens (all 'light': none above a quarter of the rest) and one or two
    tiny ones, n = 6: Q(all 6 drafts in H) needs the sixth draft from the tiny ones and matches
    the enumerated tuple law (the Newton form gave 0.79 for a true 3e-4 in this regime)."""
    q = np.array([0.2, 0.2, 0.2, 0.2, 0.2, *small, c])
    q[4] = 1.0 - q[:4].sum() - q[5:].sum()
    n = 6
    law = draft_tuple_law(q, n, "without_replacement")
    inside = np.arange(q.size) < q.size - 1
    ref = law.probs[np.all(inside[law.tuples], axis=1)].sum()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = wor_prob_all_in(q[:-1], c, n)
    assert got == pytest.approx(ref, abs=1e-12, rel=1e-9)


@pytest.mark.parametrize("c", [1e-17, 1e-19])
def test_wor_integral_tiny_tokens_at_far_time_scales(c: float) -> None:
    """Seven 0.1 tokens, one 1e-18 and a hundred 1e-24 ones (the tiny-moment path), n = 8: the
    quadrature runs to t ~ 1e20, where t^16 overflowed the moment expansion and s - (top mass)
    lost the 1e-18 of r. The eighth draft must come from the small tokens after the seven large
    ones, so Q = S / (S + c) with S = 1e-18 + 1e-22, up to O(1e-17) for small tokens drawn
    earlier."""
    q_in = np.array([0.1] * 7 + [1e-18] + [1e-24] * 100)
    small = 1e-18 + 1e-22
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = wor_prob_all_in(q_in, c, 8)
    assert got == pytest.approx(small / (small + c), rel=1e-9)


def test_wor_integral_multiscale_masses_vs_enumeration() -> None:
    """Seed 0, 160 random cases: 3 <= n <= 6, n <= |H| <= 7 tokens whose masses sit at the scales
    1, 1e-3, 1e-9, 1e-18 (times 1-2), the outside mass c at 1 .. 1e-19; Q(all n drafts in H) by the
    quadrature against the enumerated tuple law, |error| <= 1e-12 + 1e-9 Q. The version before the
    rounding check of the light-token law fails 3 of these cases (by up to 0.08)."""
    rng = np.random.default_rng(0)
    for _ in range(160):
        n = int(rng.integers(3, 7))
        k = int(rng.integers(n, 8))
        w = 10.0 ** (-rng.choice([0, 3, 9, 18], size=k)) * (1 + rng.random(k))
        c = 10.0 ** (-rng.choice([0, 1, 4, 7, 10, 17, 19])) * (1 + rng.random())
        q = np.append(w, c)
        q /= q.sum()
        law = draft_tuple_law(q, n, "without_replacement")
        inside = np.arange(q.size) < k
        ref = law.probs[np.all(inside[law.tuples], axis=1)].sum()
        got = wor_prob_all_in(q[:-1], float(q[-1]), n)
        assert abs(got - ref) <= 1e-12 + 1e-9 * ref, (n, q.tolist(), got, ref)


def dominant_token_pairs(count: int, v: int = 20000, seed: int = 0):
    """Yield ``count`` (p, q) pairs where one token holds all but ~1e-7..1e-10 of q (Gumbel logits
    with a +30..40 bump, temperature 0.5, q = 0 on half the vocabulary): the ratio order ends in
    a long tail of masses ~1e-19 .. 1e-40 that sums near 1 cannot resolve."""
    rng = np.random.default_rng(seed)
    for _ in range(count):
        z = rng.gumbel(size=v) * 3.0
        z[0] += 30 + rng.random() * 10
        d = z + rng.normal(size=v) * 1.5
        d[v // 2:] = -np.inf
        p, q = np.exp((z - z.max()) / 0.5), np.exp((d - d.max()) / 0.5)
        yield p / p.sum(), q / q.sum()


@pytest.mark.parametrize("index, n", [(4, 8), (24, 4)])
def test_wor_dominant_token_vs_scan_of_the_tail(index: int, n: int) -> None:
    """Branch and bound against every prefix whose remaining draft mass is below 1e-15 (the
    optimum sits there for these pairs), Q by the quadrature with that mass summed directly.
    Before: the cap n / (1 - M_{n-1}) came from 1 - (a sum ~1 - 4e-18) (30x too small: tokens the
    optimum needs were dropped; alpha* = 1.0 for a true 0.9999999997) and the bounds between
    prefixes used prefix-sum differences (a 3.6e-19 token that adds 1.2e-5 to Q had mass 0: alpha*
    0.998039 for 0.998027)."""
    p, q = list(dominant_token_pairs(index + 1))[index]
    pos = np.flatnonzero(q > 0)
    order = pos[np.argsort(p[pos] / q[pos], kind="stable")]
    after = np.concatenate((np.cumsum(q[order][::-1])[::-1][1:], [0.0]))  # q mass after each prefix
    big_p = np.cumsum(p[order])
    tail = np.flatnonzero(after < 1e-15) + 1
    best = min(big_p[k - 1] - wor_prob_all_in(q[order[:k]], float(after[k - 1]), n) for k in tail)
    assert optimal_acceptance(p, q, n, "without_replacement") == pytest.approx(1.0 + min(best, 0.0), abs=1e-10)


def test_branch_and_bound_refuses_non_finite_q(monkeypatch: pytest.MonkeyPatch) -> None:
    """A non-finite Q from the quadrature raises instead of being skipped by the search."""
    p, q = _lm_like(5000, 3)
    original = draft_laws.WorPrefixQuadrature.__call__

    def poisoned(self, ks):
        out = np.array(original(self, ks), dtype=np.float64)
        out[0] = np.nan
        return out

    monkeypatch.setattr(draft_laws.WorPrefixQuadrature, "__call__", poisoned)
    with pytest.raises(FloatingPointError, match="non-finite Q"):
        optimal_acceptance(p, q, 3, "without_replacement")


def test_tiny_token_moment_path_matches_direct() -> None:
    """Many tiny tokens go through the moment expansion; compare to an all-direct evaluation."""
    rng = np.random.default_rng(4)
    q = rng.dirichlet(np.ones(3000))
    h = q[:2500]
    c = float(q[2500:].sum())
    via_moments = wor_prob_all_in(h, c, 3)
    # Split H into two halves with one heavy token so the tiny path is not taken for one half:
    # P(all 3 in H) computed by conditioning on the first draw would be circular, so instead
    # compare with the exact double-sum formula.
    s = h.sum()
    q2 = s - c * np.sum(h / (1 - h))
    pair = np.sum(h[:, None] * h[None, :] / ((1 - h[:, None]) * (1 - h[:, None] - h[None, :])))
    pair -= np.sum(h * h / ((1 - h) * (1 - 2 * h)))  # remove i == j
    assert via_moments == pytest.approx(q2 - c * pair, abs=1e-12)


def test_iid_and_greedy_large_vocab_vs_reference() -> None:
    p, q = _lm_like(50_000, 3)
    # iid: full scan over all prefixes of the p/q order (no filtering)
    pos = np.flatnonzero(q > 0)
    order = pos[np.argsort(p[pos] / q[pos])]
    ref = 1.0 + min(0.0, float(np.min(np.cumsum(p[order]) - np.cumsum(q[order]) ** 3)))
    assert optimal_acceptance(p, q, 3, "iid") == pytest.approx(ref, abs=1e-10)
    # greedy: explicit formula
    top = np.argsort(-q, kind="stable")[:3]
    rest = q.copy()
    rest[top] = 0
    rest /= rest.sum()
    ref_g = p[top].sum() + np.minimum(np.delete(p, top), np.delete(rest, top)).sum()
    res = optimal_subset(p, q, 4, "greedy_draft")
    assert res.value == pytest.approx(ref_g, abs=1e-12)


@pytest.mark.parametrize("batch", [64, 3])
@pytest.mark.parametrize("n, scale, seed", [(3, 6.0, 11), (4, 6.0, 12), (3, 3.0, 13), (4, 3.0, 14)])
def test_wor_branch_and_bound_vs_every_prefix_v20000(n: int, scale: float, seed: int, batch: int,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Branch and bound vs the exact Q of every one of ~20,000 prefixes (V = 20,000).

    Large enough for several bounding rounds, the two-class tiny-token moments and the bounds
    that interpolate between evaluated prefixes; the reference evaluates all prefixes with the
    prefix quadrature (itself checked against single evaluations below) and takes the minimum.
    With 3 prefixes per round instead of 64 the optimum is usually outside the first round's
    prefixes, so every bound (before, between and after the evaluated ones) decides many rounds.
    """
    from ot_bounds import optimal
    from ot_bounds.draft_laws import WorPrefixQuadrature

    monkeypatch.setattr(optimal, "_BB_BATCH", batch)

    p, q = _lm_like(20_000, seed, scale=scale)
    pos = np.flatnonzero(q > 0)
    order = pos[np.argsort(p[pos] / q[pos], kind="stable")]
    qs, big_p = q[order], np.cumsum(p[order])
    ks = np.arange(n, order.size)  # shorter prefixes cannot hold n drafts; the full order has c = 0
    quad = WorPrefixQuadrature(qs, 0.0, n, int(ks[0]), int(ks[-1]))
    q_all = np.concatenate([quad(ks[i : i + 2000]) for i in range(0, ks.size, 2000)])
    ref = 1.0 + min(0.0, float(np.min(big_p[ks - 1] - q_all)))
    res = optimal_subset(p, q, n, "without_replacement")
    assert res.value == pytest.approx(ref, abs=1e-10)
    assert res.exact_evaluations < ks.size // 10  # the bounds did prune
    assert res.value == pytest.approx(1.0 + p[res.subset].sum() - prob_all_drafts_in(q, res.subset, n,
                                                                                       "without_replacement"), abs=1e-10)


def test_prefix_quadrature_peaked_many_drafts() -> None:
    """Peaked q on V = 20,000 (tiny, micro and exact-DP tokens all present), n up to 12: the shared
    grid agrees with single evaluations, which stay finite (an overflow used to give NaN at n = 12)."""
    from ot_bounds.draft_laws import WorPrefixQuadrature

    p, q = _lm_like(20_000, 7, scale=6.0)
    qs = q[np.argsort(p / q, kind="stable")]
    for n in (3, 4, 8, 12):
        ks = np.array([5_000, 10_000, 15_000, 19_990])
        ref = np.array([wor_prob_all_in(qs[:k], float(qs[k:].sum()), n) for k in ks])
        assert np.all(np.isfinite(ref))
        np.testing.assert_allclose(WorPrefixQuadrature(qs, 0.0, n, int(ks[0]), int(ks[-1]))(ks), ref, atol=1e-12)


def test_workspace_results_are_independent_across_calls_and_threads() -> None:
    """The hot paths reuse per-thread scratch buffers: results must not alias them, and threads
    computing at the same time must not share them (same answers as one after the other)."""
    import threading

    from ot_bounds import release_workspace

    cases = [(_lm_like(20_000, s, scale=sc), n, law) for s, sc in ((21, 3.0), (22, 6.0))
             for n, law in ((3, "without_replacement"), (4, "iid"))]
    sequential = [optimal_subset(p, q, n, law) for (p, q), n, law in cases]
    first_subset = sequential[0].subset.copy()
    optimal_subset(*_lm_like(20_000, 99), 3, "without_replacement")  # another call reuses the buffers
    np.testing.assert_array_equal(sequential[0].subset, first_subset)
    results: dict[int, list] = {}

    def worker(i: int) -> None:
        results[i] = [optimal_subset(p, q, n, law) for (p, q), n, law in cases[i::2] * 3]

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(2):
        for got, want in zip(results[i], sequential[i::2] * 3):
            assert got.value == want.value
            np.testing.assert_array_equal(got.subset, want.subset)
    release_workspace()
    assert optimal_subset(*cases[0][0], 3, "without_replacement").value == sequential[0].value


@pytest.mark.parametrize("seed", range(12))
def test_q_is_convex_in_prefix_mass_and_chords_bound_it(seed: int) -> None:
    """The branch and bound's chord bounds rest on convexity: along ANY order of the tokens the
    marginal gains (Q_k - Q_{k-1}) / q_k never decrease (the exchange inequality), so Q lies below
    every chord, including those from the empty set (0, 0) and to the vocabulary (1, 1). Exact
    Q by enumeration (V <= 7); the halved chord (a wrong bound) must be caught below Q somewhere."""
    from ot_bounds.optimal import _chord_bound

    rng = np.random.default_rng(seed)
    v = int(rng.integers(4, 8))
    q = rng.dirichlet(np.full(v, rng.choice([0.3, 1.0, 3.0])))
    broken_caught = False
    for law in ("without_replacement", "iid"):
        for n in range(2, min(v, 4) + 1):
            order = rng.permutation(v)
            s = np.concatenate(([0.0], np.cumsum(q[order])))
            big_q = np.array([0.0] + [prob_all_drafts_in(q, order[:k], n, law) for k in range(1, v + 1)])
            gains = np.diff(big_q) / q[order]
            assert np.all(np.diff(gains) >= -1e-9), (law, n, gains)
            for i in range(v + 1):
                for j in range(i + 2, v + 1):
                    ks = np.arange(i + 1, j)
                    bound = _chord_bound(s[ks] - s[i], big_q[i], s[j] - s[i], big_q[j])
                    assert np.all(bound >= big_q[ks] - 1e-12)
                    halved = big_q[i] + 0.5 * (bound - big_q[i])
                    broken_caught |= bool(np.any(halved < big_q[ks] - 1e-9))
    assert broken_caught
