"""The benchmarks' statistics come from scipy: the percentile bootstrap (scipy.stats.bootstrap) and the exact
sign test (scipy.stats.binomtest). Each is checked against a direct implementation of the same definition."""

from __future__ import annotations

import math
import random

import pytest

from benchmarks.common import bootstrap_ci, median
from benchmarks.report import sign_test


def _percentile_bootstrap(values, n_boot=2000, level=0.95, seed=0):
    """The percentile interval by hand: sorted medians of seeded resamples, read at the two quantiles."""
    rng, n = random.Random(seed), len(values)
    stats = sorted(median([values[rng.randrange(n)] for _ in range(n)]) for _ in range(n_boot))
    return stats[int((1 - level) / 2 * n_boot)], stats[min(n_boot - 1, int((1 + level) / 2 * n_boot))]


def _exact_sign_p(wins: int, losses: int) -> float:
    n, k = wins + losses, min(wins, losses)
    return min(1.0, 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n)


@pytest.mark.parametrize("n", [14, 48, 70])
def test_bootstrap_covers_the_median_and_matches_a_direct_percentile_bootstrap(n):
    rng = random.Random(n)
    xs = [rng.lognormvariate(0.1, 0.2) for _ in range(n)]
    lo, hi = bootstrap_ci(xs, seed=3)
    assert (lo, hi) == bootstrap_ci(xs, seed=3)  # seeded
    assert lo <= median(xs) <= hi
    ref_lo, ref_hi = _percentile_bootstrap(xs, seed=3)
    width = ref_hi - ref_lo
    # two resampling streams: the ends agree within bootstrap noise (a fraction of the interval's width)
    assert abs(lo - ref_lo) < 0.25 * width and abs(hi - ref_hi) < 0.25 * width


def test_bootstrap_of_another_statistic_and_of_constant_values():
    xs = [1.0, 2.0, 3.0, 4.0, 10.0]
    lo, hi = bootstrap_ci(xs, stat=lambda v: sum(v) / len(v), n_boot=500)
    assert min(xs) <= lo <= sum(xs) / len(xs) <= hi <= max(xs)
    assert bootstrap_ci([2.0] * 6) == (2.0, 2.0)
    assert all(math.isnan(v) for v in bootstrap_ci([]))


@pytest.mark.parametrize("wins, losses", [(3, 1), (10, 0), (0, 10), (13, 1), (34, 14), (7, 7), (1, 0), (20, 31)])
def test_sign_test_p_is_the_exact_two_sided_binomial_p(wins, losses):
    ratios = [1.2] * wins + [0.8] * losses + [1.0] * 2  # ties are dropped
    got = sign_test(ratios)
    assert (got["wins"], got["losses"]) == (wins, losses)
    assert got["p_sign"] == pytest.approx(_exact_sign_p(wins, losses), rel=1e-12, abs=1e-300)
