"""Tree level: expected accepted length of a token-tree shape.

A tree is a parent array over the drafted nodes ``0..N-1`` in topological
order: ``parents[i] = -1`` for a child of the root (the current context) and
``parents[i] < i`` otherwise.  A node's *rank* is its position among its
siblings in index order (0 = first child).

Sequoia's positional model: at every node the ``k``-th child is the accepted
one with probability ``a_k`` (independently of depth), so the expected number
of accepted drafted tokens per step is::

    F(T) = sum over nodes v of prod_{u on the path root -> v} a_{rank(u)}.

(The bonus token from the target is not counted: tokens per step ``= F + 1``.)
For a chain with acceptance ``a``, ``F = sum_{j=1}^{d} a^j``.

OT upper bound: with ``alpha*(m)`` the optimal acceptance at a node with
``m`` children (same ``p``, ``q`` at every node), any lossless verifier has
``E(u) = sum_c P(c accepted | u) (1 + E(c)) <= alpha*(m_u) (1 + max_c E(c))``,
where ``E(u)`` is the expected accepted length below ``u``; the recursion of
this inequality is :func:`tree_acceptance_upper_bound`.

References
----------
Chen et al., "Sequoia: Scalable, Robust, and Hardware-aware Speculative Decoding", arXiv:2402.12374.
Hu et al., "Towards Optimal Multi-draft Speculative Decoding", ICLR 2025, arXiv:2502.18779.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike, NDArray

from ._validation import check_distributions
from .optimal import optimal_acceptance


def check_parents(parents: ArrayLike) -> NDArray[np.int64]:
    """Validate a parent array (1-D ints, ``-1`` for root children, ``parents[i] < i``).

    Examples
    --------
    >>> check_parents([-1, -1, 0]).tolist()
    [-1, -1, 0]
    """
    arr = np.asarray(parents)
    if arr.ndim != 1:
        raise ValueError(f"parents must be 1-D, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"parents must be integers, got dtype {arr.dtype}")
    arr = arr.astype(np.int64)
    idx = np.arange(arr.size)
    bad = (arr < -1) | (arr >= idx)
    if np.any(bad):
        i = int(np.flatnonzero(bad)[0])
        raise ValueError(f"parents[{i}] = {arr[i]} must be -1 or a smaller node index")
    return arr


def child_ranks(parents: ArrayLike) -> NDArray[np.int64]:
    """Rank of each node among its siblings (index order).

    Examples
    --------
    >>> child_ranks([-1, -1, 0, 0, 1]).tolist()
    [0, 1, 0, 1, 0]
    """
    par = check_parents(parents)
    counts: dict[int, int] = {}
    ranks = np.zeros(par.size, dtype=np.int64)
    for i, parent in enumerate(par.tolist()):
        ranks[i] = counts.get(parent, 0)
        counts[parent] = ranks[i] + 1
    return ranks


def expected_accepted_length(parents: ArrayLike, positional: ArrayLike) -> float:
    """Sequoia's ``F(T)``: expected accepted drafted tokens of a tree shape.

    Parameters
    ----------
    parents : array_like of int, shape (N,)
        Parent array (see module docs).
    positional : array_like, shape (K,)
        ``a_k`` = probability that the ``k``-th child is the accepted one;
        ``K`` must cover the largest number of children of any node, and
        ``sum_k a_k <= 1``.

    Returns
    -------
    float

    Examples
    --------
    >>> expected_accepted_length([-1, 0, 1], [0.5])  # chain: 0.5 + 0.25 + 0.125
    0.875
    """
    par = check_parents(parents)
    pos = np.asarray(positional, dtype=np.float64)
    if pos.ndim != 1 or np.any(~np.isfinite(pos)) or np.any(pos < 0) or pos.sum() > 1 + 1e-9:
        raise ValueError("positional must be a 1-D vector of nonnegative probabilities summing to <= 1")
    ranks = child_ranks(par)
    if ranks.size and ranks.max() >= pos.size:
        raise ValueError(f"a node has {ranks.max() + 1} children but positional has only {pos.size} entries")
    reach = np.zeros(par.size)  # P(node accepted), shape (N,)
    for i in range(par.size):
        above = 1.0 if par[i] < 0 else reach[par[i]]
        reach[i] = above * pos[ranks[i]]
    return float(reach.sum())


def tree_acceptance_upper_bound(parents: ArrayLike, node_acceptance: ArrayLike) -> float:
    """OT upper bound on the expected accepted length of a tree shape.

    Parameters
    ----------
    parents : array_like of int, shape (N,)
        Parent array.
    node_acceptance : array_like, shape (M + 1,)
        ``node_acceptance[m]`` = the best acceptance achievable at a node with
        ``m`` children (``alpha*(m)``, entry 0 unused), e.g. from
        :func:`optimal_node_acceptance`.

    Returns
    -------
    float
        Upper bound ``E(root)`` with ``E(u) = alpha*(m_u) (1 + max_c E(c))``.

    Examples
    --------
    >>> round(tree_acceptance_upper_bound([-1, -1, 0], [0.0, 0.5, 0.7]), 6)
    1.05
    """
    par = check_parents(parents)
    acc = np.asarray(node_acceptance, dtype=np.float64)
    children: dict[int, list[int]] = {}
    for i, parent in enumerate(par.tolist()):
        children.setdefault(parent, []).append(i)
    widest = max((len(c) for c in children.values()), default=0)
    if acc.ndim != 1 or acc.size <= widest:
        raise ValueError(f"node_acceptance needs entries for 0..{widest} children, got shape {acc.shape}")
    below = np.zeros(par.size)  # E(v), shape (N,)
    for v in range(par.size - 1, -1, -1):
        kids = children.get(v, [])
        if kids:
            below[v] = acc[len(kids)] * (1.0 + max(below[k] for k in kids))
    root_kids = children.get(-1, [])
    if not root_kids:
        return 0.0
    return float(acc[len(root_kids)] * (1.0 + max(below[k] for k in root_kids)))


def optimal_node_acceptance(p: ArrayLike, q: ArrayLike, max_children: int, sampling: str = "iid") -> NDArray[np.float64]:
    """``alpha*(m)`` for ``m = 0..max_children`` (``alpha*(0) = 0``).

    Examples
    --------
    >>> optimal_node_acceptance([0.5, 0.5], [0.9, 0.1], 2, "without_replacement").round(6).tolist()
    [0.0, 0.6, 1.0]
    """
    pa, qa = check_distributions(p, q)
    if int(max_children) < 0:
        raise ValueError("max_children must be >= 0")
    out = np.zeros(int(max_children) + 1)
    for m in range(1, int(max_children) + 1):
        out[m] = optimal_acceptance(pa, qa, m, sampling)
    return out
