"""Input validation shared by every public function of :mod:`ot_bounds`.

All public functions accept array-likes for ``p`` (target distribution) and
``q`` (draft distribution) and call :func:`check_distributions` first, so that
every entry point reports bad input with the same, explicit messages.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import numpy as np
from numpy.typing import ArrayLike, NDArray

#: Absolute tolerance on ``|sum(p) - 1|`` before we refuse the input.
SUM_TOLERANCE: float = 1e-6

#: Recognised draft sampling laws (see :mod:`ot_bounds.draft_laws`).
SAMPLINGS: tuple[str, ...] = ("iid", "without_replacement", "greedy_draft")


def check_distribution(x: ArrayLike, name: str) -> NDArray[np.float64]:
    """Validate one probability vector and return it renormalised.

    Parameters
    ----------
    x : array_like, shape (V,)
        Candidate probability vector.
    name : str
        Name used in error messages (``"p"`` or ``"q"``).

    Returns
    -------
    numpy.ndarray of float64, shape (V,)
        ``x / x.sum()`` (a fresh array).

    Raises
    ------
    ValueError
        If ``x`` is not 1-D, empty, contains NaN/inf, has a negative entry, or
        does not sum to 1 within :data:`SUM_TOLERANCE`.

    Examples
    --------
    >>> check_distribution([0.25, 0.75], "p")
    array([0.25, 0.75])
    """
    try:
        arr = np.asarray(x, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{name} must be a numeric array, got {type(x).__name__}") from exc
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {arr.shape}")
    if arr.size == 0:
        raise ValueError(f"{name} must be non-empty")
    # two reductions, no temporaries (a NaN or inf entry makes the sum non-finite)
    total = float(arr.sum())
    if not np.isfinite(total) and not np.all(np.isfinite(arr)):
        raise ValueError(f"{name} contains NaN or infinite entries")
    lowest = float(arr.min())
    if lowest < 0:
        raise ValueError(f"{name} has negative entries (min {lowest:.3g})")
    if abs(total - 1.0) > SUM_TOLERANCE:
        raise ValueError(
            f"{name} is not normalised: sums to {total:.10g} (tolerance {SUM_TOLERANCE:g})"
        )
    return arr / total


def check_distributions(
    p: ArrayLike, q: ArrayLike
) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    """Validate a (target, draft) pair: both valid and of the same length.

    Examples
    --------
    >>> p, q = check_distributions([0.5, 0.5], [1.0, 0.0])
    >>> q
    array([1., 0.])
    """
    p_arr = check_distribution(p, "p")
    q_arr = check_distribution(q, "q")
    if p_arr.shape != q_arr.shape:
        raise ValueError(f"p and q must have the same length, got {p_arr.size} and {q_arr.size}")
    return p_arr, q_arr


def check_int(value: Any, name: str, minimum: int = 1) -> int:
    """Validate an integer argument ``name`` that must be at least ``minimum``.

    Examples
    --------
    >>> check_int(7, "depth")
    7
    """
    kind = {0: "a non-negative integer", 1: "a positive integer"}.get(minimum, f"an integer >= {minimum}")
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be {kind}, got {value!r}")
    if int(value) < minimum:
        raise ValueError(f"{name} must be {kind} ({name} >= {minimum}), got {int(value)}")
    return int(value)


def check_n(n: Any) -> int:
    """Validate the number of drafted children ``n`` (a positive integer).

    Examples
    --------
    >>> check_n(3)
    3
    """
    return check_int(n, "n")


def check_sampling(sampling: Any) -> str:
    """Validate a draft sampling law name.

    Examples
    --------
    >>> check_sampling("iid")
    'iid'
    """
    if sampling not in SAMPLINGS:
        raise ValueError(f"unknown sampling {sampling!r}; expected one of {list(SAMPLINGS)}")
    return str(sampling)


class TooManyTuples(ValueError):
    """An exhaustive method refused because it would enumerate about ``size`` draft tuples (over ``limit``)."""

    def __init__(self, what: str, size: float, v: int, n: int, limit: int, advice: str) -> None:
        self.what, self.size, self.v, self.n, self.limit = what, size, v, n, limit
        super().__init__(f"{what} enumerates about V**n = {size:.3g} draft tuples (V={v}, n={n}); "
                         f"limit is {limit}. {advice}")


def check_small_vocab(v: int, n: int, sampling: str, limit: int, what: str,
                      advice: str = "Use optimal_acceptance for large vocabularies.") -> None:
    """Refuse exhaustive methods whose size would explode (:class:`TooManyTuples`, a ValueError).

    ``limit`` bounds the number of ordered draft tuples (about ``V**n``); ``advice`` ends the message.
    """
    size = float(v) ** n if sampling != "greedy_draft" else float(v)
    if size > limit:
        raise TooManyTuples(what, size, v, n, limit, advice)


def check_count(base: int, power: int, limit: int, message: str) -> int:
    """``base ** power`` as an int when it is at most ``limit``, else ``ValueError(message + "; limit is ...")``,
    decided in log space (no overflow, nothing allocated).

    Examples
    --------
    >>> check_count(3, 4, 100, "too many")
    81
    """
    if base > 1 and power * math.log(base) > math.log(limit) + 1e-9:
        raise ValueError(f"{message}; limit is {limit}")
    return base ** power if base > 0 else 0
