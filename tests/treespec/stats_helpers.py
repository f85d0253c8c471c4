"""The one G-test helper of the statistical tests (marked ``stats``).

Power, for stating what a test detects: with N samples and ``df`` = cells - 1, G is approximately
noncentral chi^2_df with noncentrality 2 N KL(true || claimed). At alpha = 1e-3 and power 0.9 the
noncentrality needed is ``detectable_noncentrality(df)`` (df 5: 29.2, 10: 35.1, 20: 43.3, 40: 54.9), so the
test detects KL >= lambda / (2 N) nats and, by Pinsker (KL >= 2 TV^2), any TV shift >= sqrt(lambda / (4 N)).
"""

from __future__ import annotations

import numpy as np


def chi2_sf(g: float, df: int) -> float:
    """P(chi^2_df >= g): scipy's where installed, else the regularised upper incomplete gamma Q(df / 2, g / 2)
    of torch (float64; the same number to ~1e-15): the device tests run where only torch is installed."""
    try:
        from scipy import stats
    except ImportError:
        import torch

        return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                             torch.tensor(g / 2, dtype=torch.float64)))
    return float(stats.chi2.sf(g, df))


def g_test(counts, probs, min_expected: float = 5.0) -> float:
    """p-value of the G test of ``counts`` against ``probs`` (1-D arrays over the same categories).

    Cells expected below ``min_expected`` are pooled; a count in a zero-probability cell gives 0.
    """
    counts = np.asarray(counts, dtype=float)
    probs = np.asarray(probs, dtype=float)
    probs = np.where(probs < 1e-15, 0.0, probs)
    if counts[probs == 0].sum() > 0:
        return 0.0
    expected = probs * counts.sum()
    big = expected >= min_expected
    obs, exp = list(counts[big]), list(expected[big])
    if expected[~big].sum() > 0:
        obs.append(counts[~big].sum())
        exp.append(expected[~big].sum())
    obs, exp = np.array(obs), np.array(exp)
    if len(obs) < 2:
        return 1.0
    nz = obs > 0
    g = 2.0 * float((obs[nz] * np.log(obs[nz] / exp[nz])).sum())
    return chi2_sf(g, len(obs) - 1)


def g_test_law(counts: dict, law: dict, n: int) -> float:
    """:func:`g_test` of a dict of counts against a dict law (every counted cell must be in ``law``)."""
    stray = sum(c for cell, c in counts.items() if cell not in law)
    assert stray == 0, f"{stray} samples outside the law's support"
    cells = list(law)
    assert sum(counts.get(c, 0) for c in cells) == n
    return g_test([counts.get(c, 0) for c in cells], [law[c] for c in cells])


def detectable_noncentrality(df: int, alpha: float = 1e-3, power: float = 0.9) -> float:
    """The noncentrality lambda at which the G test at level ``alpha`` has the given power (needs scipy)."""
    from scipy import optimize, stats

    crit = stats.chi2.ppf(1 - alpha, df)
    return optimize.brentq(lambda lam: stats.ncx2.sf(crit, df, lam) - power, 1e-9, 1e5)
