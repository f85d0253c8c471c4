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

Node-local OT bound: with ``alpha*(m)`` the optimal acceptance at a node with
``m`` children (same ``p``, ``q`` at every node), a verifier that decides at each
node which child (if any) to accept before it looks below that node (every node
rule of treespec: ``rrs``, ``kseq``, ``spechub``, ``greedy_draft``, ...) has
``E(u) = sum_c P(c accepted | u) (1 + E(c)) <= alpha*(m_u) (1 + max_c E(c))``,
where ``E(u)`` is the expected accepted length below ``u``; the recursion of
this inequality is :func:`tree_acceptance_upper_bound`. Verifiers that judge
whole paths (block verification on chains, traversal verification on trees)
accept a child more readily when its subtree agrees with the target, and can
exceed it (the tests show a case). The bound for every lossless verifier is
:func:`lp_tree_optimal_acceptance`: a transport LP coupling the drafted tree
with the target's output, maximising how far the output runs along a path of
the tree; :func:`tree_acceptance` gives ``rrs``'s and ``traversal``'s exact
values beside it (small vocabularies).

References
----------
Chen et al., "Sequoia: Scalable, Robust, and Hardware-aware Speculative Decoding", arXiv:2402.12374.
Hu et al., "Towards Optimal Multi-draft Speculative Decoding", ICLR 2025, arXiv:2502.18779.
Weng et al., "Traversal Verification for Speculative Tree Decoding", arXiv:2505.12398.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike, NDArray
from scipy import optimize, sparse

from ._validation import check_distributions
from .optimal import optimal_acceptance
from .verifiers import positional_acceptance

#: the tree verifiers whose exact expected accepted length :func:`tree_acceptance` computes
TREE_VERIFIERS: tuple[str, ...] = ("rrs", "traversal")

#: most drafted trees (``A^N``) an exact enumeration visits
MAX_TREES = 50_000

#: most coupling variables (drafted trees x output blocks) of :func:`lp_tree_optimal_acceptance`
MAX_LP_VARIABLES = 250_000


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
    """Node-local OT upper bound on the expected accepted length of a tree shape.

    It holds for verifiers that accept a child before looking below it (see the module docs); block and
    traversal verification can exceed it, :func:`lp_tree_optimal_acceptance` bounds every lossless verifier.

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


def _depths(par: NDArray[np.int64]) -> NDArray[np.int64]:
    depth = np.zeros(par.size, dtype=np.int64)  # root children: 1
    for i, parent in enumerate(par.tolist()):
        depth[i] = 1 if parent < 0 else depth[parent] + 1
    return depth


def _drafted_trees(par: NDArray[np.int64], pa: NDArray[np.float64], qa: NDArray[np.float64],
                   what: str) -> tuple[NDArray[np.float64], NDArray[np.int64]]:
    """Every i.i.d. drafted tree of the shape: (its probability, shape (T,); its tokens, shape (T, N))."""
    atoms = np.flatnonzero(qa > 0)
    size = float(atoms.size) ** par.size
    if size > MAX_TREES:
        raise ValueError(f"{what} enumerates A**N = {size:.3g} drafted trees ({atoms.size} tokens with q > 0, "
                         f"N = {par.size} nodes); limit is {MAX_TREES}")
    tokens = atoms[np.indices((atoms.size,) * par.size).reshape(par.size, -1).T]  # shape (T, N)
    return np.prod(qa[tokens], axis=1), tokens


def _after_rejection(m: NDArray[np.float64], q: NDArray[np.float64]) -> NDArray[np.float64]:
    """Traversal's state once a child's subtree was rejected: ``(m - q)_+ / (1 - sum(min(m, q)))``, per row."""
    residual = np.maximum(m - q, 0.0)  # shape (T, V)
    reject = np.maximum(1.0 - np.minimum(m, q).sum(axis=1, keepdims=True), 0.0)  # shape (T, 1)
    ok = (reject > 0) & (residual.sum(axis=1, keepdims=True) > 0)
    return np.where(ok, residual / np.where(ok, reject, 1.0), 0.0)


def _traversal_accepted(par: NDArray[np.int64], tokens: NDArray[np.int64], pa: NDArray[np.float64],
                        qa: NDArray[np.float64]) -> NDArray[np.float64]:
    """Traversal verification's expected accepted length for each drafted tree (tokens shape (T, N)) -> (T,).

    Each node's keep probability ``h_v`` comes from the states ``m`` (module docs of treespec's
    ``verify/traversal.py`` for the algorithm; written here again from the definition, as ot_bounds stands
    alone): the path stops at the first node, in post-order, whose test passes."""
    t, n = tokens.shape
    children: dict[int, list[int]] = {}
    for i, parent in enumerate(par.tolist()):
        children.setdefault(parent, []).append(i)
    alpha = np.ones((t, n))  # alpha_v as each node starts
    hold = np.empty((t, n))  # h_v
    q_row = qa[None, :]
    for v in [-1, *range(n)]:  # parents before children: a node's alpha is set when its parent is visited
        kids = children.get(v, [])
        if not kids:
            if v >= 0:
                hold[:, v] = alpha[:, v]  # a leaf keeps its sequence with its starting alpha
            continue
        m = np.broadcast_to(pa, (t, pa.size)) if v < 0 else alpha[:, v, None] * pa[None, :]  # shape (T, V)
        for c in kids:  # draft order
            x = tokens[:, c]
            m_x, q_x = m[np.arange(t), x], qa[x]
            alpha[:, c] = np.where(q_x > 0, np.minimum(m_x / np.where(q_x > 0, q_x, 1.0), 1.0), m_x > 0)
            m = _after_rejection(m, q_row)
        if v >= 0:
            hold[:, v] = np.clip(m.sum(axis=1), 0.0, 1.0)
    order: list[int] = []  # post-order of the drafted nodes (the root, last, always passes)

    def visit(v: int) -> None:
        for c in children.get(v, []):
            visit(c)
        if v >= 0:
            order.append(v)

    visit(-1)
    depth = _depths(par)
    fail = np.ones(t)  # every earlier test failed
    accepted = np.zeros(t)
    for v in order:
        accepted += fail * hold[:, v] * depth[v]
        fail = fail * (1.0 - hold[:, v])
    return accepted


def tree_acceptance(parents: ArrayLike, p: ArrayLike, q: ArrayLike, verifier: str = "traversal") -> float:
    """Exact expected accepted length of a tree shape drafted i.i.d. from ``q`` (same ``p``, ``q`` at every node).

    Parameters
    ----------
    parents : array_like of int, shape (N,)
        Parent array (see module docs).
    p, q : array_like, shape (V,)
        Target and draft distributions.
    verifier : {"rrs", "traversal"}
        Recursive rejection sampling, node by node (Sequoia's positional model, exact here), or traversal
        verification (enumeration of the ``A^N`` drafted trees over the ``A`` tokens with ``q > 0``, at most
        :data:`MAX_TREES`).

    Returns
    -------
    float
        Expected accepted drafts (the bonus or recovered token not counted).

    Examples
    --------
    >>> p, q = [0.6, 0.3, 0.1], [0.2, 0.3, 0.5]
    >>> round(tree_acceptance([-1, 0, 0], p, q, "rrs"), 6)
    1.008
    >>> round(tree_acceptance([-1, 0, 0], p, q, "traversal"), 6)
    1.04
    """
    par = check_parents(parents)
    pa, qa = check_distributions(p, q)
    if verifier not in TREE_VERIFIERS:
        raise ValueError(f"unknown tree verifier {verifier!r}; expected one of {TREE_VERIFIERS}")
    if par.size == 0:
        return 0.0
    if verifier == "rrs":
        width = int(np.bincount(par + 1).max())
        return expected_accepted_length(par, positional_acceptance(pa, qa, width, "rrs"))
    weight, tokens = _drafted_trees(par, pa, qa, "tree_acceptance")
    return float(weight @ _traversal_accepted(par, tokens, pa, qa))


def lp_tree_optimal_acceptance(parents: ArrayLike, p: ArrayLike, q: ArrayLike) -> float:
    r"""The best expected accepted length of any lossless verifier of an i.i.d. drafted tree: a transport LP.

    Variables :math:`\pi(t, y) \ge 0` for drafted trees :math:`t` (i.i.d. children from ``q``, the same
    ``p`` and ``q`` at every node) and output blocks :math:`y \in V^D` (``D`` the tree's depth, law
    :math:`p^D`)::

        maximise   sum_{t, y} pi(t, y) reach(t, y)
        subject to sum_y pi(t, y) = Q(t),   sum_t pi(t, y) = p^D(y)

    where ``reach(t, y)`` is the length of the longest prefix of ``y`` that is a root-to-node path of ``t``: a
    verifier accepts no more than that, so this bounds every lossless verifier (token-level, block, traversal),
    with full knowledge of ``p``. At most :data:`MAX_LP_VARIABLES` variables. Solved with
    ``scipy.optimize.linprog(method="highs")``.

    Examples
    --------
    >>> round(lp_tree_optimal_acceptance([-1, 0, 0], [0.6, 0.3, 0.1], [0.2, 0.3, 0.5]), 6)
    1.128
    """
    par = check_parents(parents)
    pa, qa = check_distributions(p, q)
    if par.size == 0:
        return 0.0
    depth = _depths(par)
    big_d = int(depth.max())
    outputs = np.flatnonzero(pa > 0)
    n_trees, n_out = float(np.count_nonzero(qa > 0)) ** par.size, float(outputs.size) ** big_d
    if n_trees * n_out > MAX_LP_VARIABLES:
        raise ValueError(f"lp_tree_optimal_acceptance needs {n_trees * n_out:.3g} coupling variables "
                         f"({n_trees:.3g} drafted trees x {n_out:.3g} output blocks); limit is {MAX_LP_VARIABLES}")
    weight, tokens = _drafted_trees(par, pa, qa, "lp_tree_optimal_acceptance")  # shape (T,), (T, N)
    y = outputs[np.indices((outputs.size,) * big_d).reshape(big_d, -1).T]  # shape (Y, D)
    p_y = np.prod(pa[y], axis=1)  # shape (Y,)
    reach = np.zeros((weight.size, p_y.size))  # shape (T, Y)
    for v in range(par.size):
        path = [v]
        while par[path[-1]] >= 0:
            path.append(int(par[path[-1]]))
        path = path[::-1]  # root child .. v
        on_path = (tokens[:, path][:, None, :] == y[None, :, :len(path)]).all(axis=2)  # shape (T, Y)
        reach = np.maximum(reach, on_path * float(len(path)))
    n_t, n_y = weight.size, p_y.size
    cols = np.arange(n_t * n_y)
    a_eq = sparse.csr_matrix((np.ones(2 * cols.size), (np.concatenate((cols // n_y, n_t + cols % n_y)),
                                                       np.concatenate((cols, cols)))), shape=(n_t + n_y, n_t * n_y))
    # both marginals sum to 1, so one equality is implied: drop the last (rounding could make it infeasible)
    b_eq = np.concatenate((weight / weight.sum(), p_y / p_y.sum()))
    res = optimize.linprog(-reach.ravel(), A_eq=a_eq[:-1], b_eq=b_eq[:-1], bounds=(0, None), method="highs")
    if res.status != 0:
        raise RuntimeError(f"lp_tree_optimal_acceptance: the LP solver failed ({res.message})")
    return float(-res.fun)
