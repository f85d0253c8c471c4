"""Slow, obvious reference: minimum over all ``2^V`` token sets ``H``.

``alpha* = 1 + min_H [p(H) - Q(all drafts in H)]`` with ``Q(all drafts in H)``
summed directly from the enumerated law of ordered draft tuples
(:func:`ot_bounds.draft_laws.draft_tuple_law`), independent of every closed
form used by :mod:`ot_bounds.optimal`.

References
----------
Hu et al., "Towards Optimal Multi-draft Speculative Decoding", ICLR 2025, arXiv:2502.18779.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike

from ._validation import check_distributions, check_n, check_small_vocab
from .draft_laws import check_law, draft_tuple_law
from .optimal import OptimalAcceptance

MAX_VOCAB = 14


def brute_force_optimal_acceptance(
    p: ArrayLike, q: ArrayLike, n: int, sampling: str = "iid"
) -> OptimalAcceptance:
    """Optimal acceptance by exhaustive search over all subsets ``H``.

    Parameters
    ----------
    p, q : array_like, shape (V,)
        Target and draft distributions, ``V <= 14``.
    n : int
        Number of drafted children.
    sampling : str
        Any law of :data:`ot_bounds.draft_laws.TUPLE_LAWS`.

    Returns
    -------
    OptimalAcceptance

    Examples
    --------
    >>> round(brute_force_optimal_acceptance([0.1, 0.9], [0.6, 0.4], 2).value, 6)
    0.74
    """
    pa, qa = check_distributions(p, q)
    n = check_n(n)
    sampling = check_law(sampling, n)
    v = pa.size
    if v > MAX_VOCAB:
        raise ValueError(f"brute force enumerates 2^V subsets; V = {v} exceeds {MAX_VOCAB}")
    check_small_vocab(v, n, sampling, 200_000, "brute_force_optimal_acceptance")
    law = draft_tuple_law(qa, n, sampling)
    bits = (1 << law.tuples).astype(np.int64)  # shape (T, m)
    tuple_mask = np.bitwise_or.reduce(bits, axis=1)  # shape (T,)
    subsets = np.arange(1 << v, dtype=np.int64)  # shape (2^V,)
    inside = (tuple_mask[None, :] & ~subsets[:, None]) == 0  # shape (2^V, T)
    q_in = inside.astype(np.float64) @ law.probs  # shape (2^V,)
    members = ((subsets[:, None] >> np.arange(v)[None, :]) & 1).astype(bool)  # shape (2^V, V)
    p_in = members.astype(np.float64) @ pa
    obj = p_in - q_in
    best = int(np.argmin(obj))
    value = float(min(max(1.0 + obj[best], 0.0), 1.0))
    subset = np.flatnonzero(members[best]).astype(np.int64)
    return OptimalAcceptance(value, subset, float(p_in[best]), float(q_in[best]), n, sampling, 0)
