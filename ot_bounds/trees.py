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
exceed it (the tests show a case). The best any lossless verifier can do is
:func:`lp_tree_optimal_acceptance`, a linear program over what a verifier may do
with each drafted tree (keep the path to one node, emit one token, then decoding
goes on from the target); on one level it is ``alpha*(n)``, on a chain block
verification's value (small vocabularies). :func:`tree_acceptance` gives
``rrs``'s and ``traversal``'s exact values beside it (traversal: few tokens
with ``q > 0``), :func:`sample_tree_acceptance` traversal's on any draft.

References
----------
Chen et al., "Sequoia: Scalable, Robust, and Hardware-aware Speculative Decoding", arXiv:2402.12374.
Hu et al., "Towards Optimal Multi-draft Speculative Decoding", ICLR 2025, arXiv:2502.18779.
Weng et al., "Traversal Verification for Speculative Tree Decoding", arXiv:2505.12398.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike, NDArray
from scipy import optimize, sparse

from ._validation import check_count, check_distributions, check_int
from .optimal import optimal_acceptance
from .verifiers import positional_acceptance

#: the tree verifiers whose exact expected accepted length :func:`tree_acceptance` computes
TREE_VERIFIERS: tuple[str, ...] = ("rrs", "traversal")

#: most drafted trees (``A^N``) an exact enumeration visits
MAX_TREES = 50_000

#: most entries of one ``[trees, A + 1]`` traversal state array (``A`` tokens with ``q > 0``): the bound of
#: :func:`tree_acceptance`'s enumeration; :func:`sample_tree_acceptance` sizes its chunks so that the few arrays
#: live at once stay within it
MAX_STATE_ENTRIES = 20_000_000

#: most variables (drafted trees x stopping nodes x emitted tokens) of :func:`lp_tree_optimal_acceptance`
MAX_LP_VARIABLES = 250_000

#: most entries of its constraint matrix
MAX_LP_NONZEROS = 5_000_000


@dataclass(frozen=True)
class SampledAcceptance:
    """A Monte Carlo estimate of an expected accepted length.

    Attributes
    ----------
    mean : float
        Mean over the sampled drafts (blocks or trees) of the exact expected accepted length given them (an
        unbiased estimate).
    stderr : float
        Standard error of ``mean`` (sample standard deviation / sqrt(samples)).
    samples : int
        Number of drafts sampled.
    """

    mean: float
    stderr: float
    samples: int


def check_samples_and_seed(samples: object, seed: object) -> tuple[int, int]:
    """Validate a sample count (an integer >= 2) and a seed (a non-negative integer)."""
    return check_int(samples, "samples", 2), check_int(seed, "seed", 0)


def sampled_mean(values: list[NDArray[np.float64]]) -> SampledAcceptance:
    """Mean and standard error of the per-draft values (chunks of one sample)."""
    x = np.concatenate(values)
    return SampledAcceptance(mean=float(x.mean()), stderr=float(x.std(ddof=1) / np.sqrt(x.size)), samples=int(x.size))


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
    children = _children(par)
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


def enumerate_sequences(tokens: NDArray[np.int64], length: int) -> NDArray[np.int64]:
    """Every sequence of ``length`` entries of ``tokens``, in lexicographic order: shape (A**length, length).

    The caller bounds ``A**length`` (:func:`~ot_bounds._validation.check_count`) before calling.

    Examples
    --------
    >>> enumerate_sequences(np.array([3, 5]), 2).tolist()
    [[3, 3], [3, 5], [5, 3], [5, 5]]
    """
    a = tokens.size
    index = np.arange(a ** length)[:, None] // (a ** np.arange(length - 1, -1, -1))[None, :] % max(a, 1)
    return tokens[index]


def _drafted_trees(par: NDArray[np.int64], pa: NDArray[np.float64], qa: NDArray[np.float64],
                   what: str) -> tuple[NDArray[np.float64], NDArray[np.int64]]:
    """Every i.i.d. drafted tree of the shape: (its probability, shape (T,); its tokens, shape (T, N))."""
    atoms = np.flatnonzero(qa > 0)
    check_count(atoms.size, par.size, MAX_TREES,
                 f"{what} enumerates A**N drafted trees ({atoms.size} tokens with q > 0, N = {par.size} nodes)")
    tokens = enumerate_sequences(atoms, par.size)  # shape (T, N)
    return np.prod(qa[tokens], axis=1), tokens


def _children(par: NDArray[np.int64]) -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for i, parent in enumerate(par.tolist()):
        children.setdefault(parent, []).append(i)
    return children


def _post_order(children: dict[int, list[int]]) -> list[int]:
    """The drafted nodes in post-order (every child's subtree before the node, siblings in draft order)."""
    order, stack = [], [(-1, False)]
    while stack:
        node, done = stack.pop()
        if done:
            if node >= 0:
                order.append(node)
            continue
        stack.append((node, True))
        stack.extend((c, False) for c in reversed(children.get(node, [])))
    return order


def _lump_undrafted(pa: NDArray[np.float64], qa: NDArray[np.float64]) -> tuple[NDArray[np.float64],
                                                                             NDArray[np.float64]]:
    """(p, q) over the ``A`` tokens with ``q > 0`` and one entry more holding the target mass of the others.

    Traversal's states see a token the draft never proposes only through its share of ``m`` (``q = 0`` there:
    ``(m - q)_+ = m``, ``min(m, q) = 0``), so lumping those tokens changes no sum: the same value with states of
    ``A + 1`` entries instead of ``V``. Drafted token ``i`` (the ``i``-th with ``q > 0``) is entry ``i``."""
    drafted = qa > 0
    return np.append(pa[drafted], pa[~drafted].sum()), np.append(qa[drafted], 0.0)


def _after_rejection(m: NDArray[np.float64], q: NDArray[np.float64]) -> NDArray[np.float64]:
    """Traversal's state once a child's subtree was rejected: ``(m - q)_+ / (1 - sum(min(m, q)))``, per row."""
    residual = np.maximum(m - q, 0.0)  # shape (T, V)
    reject = np.maximum(1.0 - np.minimum(m, q).sum(axis=1, keepdims=True), 0.0)  # shape (T, 1)
    ok = (reject > 0) & (residual.sum(axis=1, keepdims=True) > 0)
    return np.where(ok, residual / np.where(ok, reject, 1.0), 0.0)


def _traversal_accepted(par: NDArray[np.int64], tokens: NDArray[np.int64], pa: NDArray[np.float64],
                        qa: NDArray[np.float64]) -> NDArray[np.float64]:
    """Traversal verification's expected accepted length for each drafted tree (tokens shape (T, N)) -> (T,).

    Each node's keep probability ``h_v`` comes from the states ``m`` (the algorithm of treespec's
    ``verify/traversal.py``, written here again from its definition, as ot_bounds stands alone): the path
    stops at the first node, in post-order, whose test passes."""
    t, n = tokens.shape
    children = _children(par)
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
    depth = _depths(par)
    fail = np.ones(t)  # every earlier test failed (the root, last in post-order, always passes)
    accepted = np.zeros(t)
    for v in _post_order(children):
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
        verification (enumeration of the ``A^N`` drafted trees over the ``A`` tokens with ``q > 0``: at most
        :data:`MAX_TREES` trees and :data:`MAX_STATE_ENTRIES` entries of their ``[A^N, A + 1]`` states; any
        vocabulary size, since the tokens ``q`` never proposes are lumped into one entry).

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
    p_l, q_l = _lump_undrafted(pa, qa)
    trees = check_count(q_l.size - 1, par.size, MAX_TREES,
                        f"tree_acceptance enumerates A**N drafted trees ({q_l.size - 1} tokens with q > 0, "
                        f"N = {par.size} nodes); use sample_tree_acceptance for larger ones")
    if trees * q_l.size > MAX_STATE_ENTRIES:
        raise ValueError(f"tree_acceptance holds [trees, A + 1] states of {trees * q_l.size:.3g} entries "
                         f"({trees} drafted trees, A = {q_l.size - 1}); limit is {MAX_STATE_ENTRIES}")
    weight, tokens = _drafted_trees(par, p_l, q_l, "tree_acceptance")
    return float(weight @ _traversal_accepted(par, tokens, p_l, q_l))


def sample_tree_acceptance(parents: ArrayLike, p: ArrayLike, q: ArrayLike, *, samples: int = 10_000,
                           seed: int = 0) -> SampledAcceptance:
    """Estimate traversal verification's expected accepted length for many tokens with ``q > 0``.

    Parameters
    ----------
    parents : array_like of int, shape (N,)
        Parent array (see module docs).
    p, q : array_like, shape (V,)
        Target and draft distributions (the same at every node).
    samples : int
        Trees drafted i.i.d. from ``q`` (a ``numpy.random.Generator`` seeded with ``seed``), in chunks whose
        arrays stay within :data:`MAX_STATE_ENTRIES` entries together (the same draws whatever the chunk size).
    seed : int
        The generator's seed.

    Returns
    -------
    SampledAcceptance
        The mean over the sampled trees of the exact expected accepted length given each (the per-tree value
        of :func:`tree_acceptance`; the tokens ``q`` never proposes lumped into one entry, exact).

    Examples
    --------
    >>> p, q = [0.6, 0.3, 0.1], [0.2, 0.3, 0.5]
    >>> est = sample_tree_acceptance([-1, 0, 0], p, q, samples=20_000, seed=0)
    >>> abs(est.mean - tree_acceptance([-1, 0, 0], p, q)) < 4 * est.stderr
    True
    """
    par = check_parents(parents)
    pa, qa = check_distributions(p, q)
    samples, seed = check_samples_and_seed(samples, seed)
    if par.size == 0:
        return SampledAcceptance(mean=0.0, stderr=0.0, samples=samples)
    p_l, q_l = _lump_undrafted(pa, qa)
    rows = max(1, MAX_STATE_ENTRIES // (4 * (q_l.size + par.size)))  # ~4 [rows, A + 1] states, [rows, N] arrays
    rng = np.random.default_rng(seed)
    values, left = [], samples
    while left:
        n = min(left, rows)
        tokens = rng.choice(q_l.size - 1, size=(n, par.size), p=q_l[:-1] / q_l[:-1].sum())  # shape (n, N)
        values.append(_traversal_accepted(par, tokens, p_l, q_l))
        left -= n
    return sampled_mean(values)


def lp_tree_optimal_acceptance(parents: ArrayLike, p: ArrayLike, q: ArrayLike, *,
                               what: str = "lp_tree_optimal_acceptance") -> float:
    r"""The best expected accepted length of any lossless verifier of an i.i.d. drafted tree: a linear program.

    A verifier sees the drafted tree :math:`t` (law :math:`Q(t)`: i.i.d. children from ``q``, the same ``p`` and
    ``q`` at every node), keeps the path to one node :math:`v` and emits one more token :math:`z`, after which
    decoding goes on from the target. Its law is :math:`\pi(t, v, z) \ge 0` with :math:`\sum_{v, z} \pi(t, v, z)
    = Q(t)`; it is lossless when the output's first :math:`L = D + 1` tokens (``D`` the tree's depth; the
    path, ``z``, then fresh target tokens) have the target's law::

        sum_{t, v, z: (path_t(v), z) prefix of y} pi(t, v, z) p^{L - |v| - 1}(rest of y) = p^L(y)   for all y in V^L

    and the program maximises :math:`\sum \pi(t, v, z) |v|`. On a chain its value is block verification's (which
    is optimal among all lossless verifications of a chain, arXiv 2403.10444); on a tree it bounds traversal
    verification and every other. Sizes: at most :data:`MAX_LP_VARIABLES` variables (``A^N (N + 1) V``) and
    output rows (``V^(D + 1)``) and :data:`MAX_LP_NONZEROS` constraint entries, checked before anything is built. Solved with
    ``scipy.optimize.linprog(method="highs")``.

    Examples
    --------
    >>> round(lp_tree_optimal_acceptance([-1, 0], [0.6, 0.3, 0.1], [0.2, 0.3, 0.5]), 6)  # block's 1.0
    1.0
    """
    par = check_parents(parents)
    pa, qa = check_distributions(p, q)
    if par.size == 0:
        return 0.0
    v_size, n = pa.size, par.size
    depth = _depths(par)
    length = int(depth.max()) + 1
    trees = check_count(int(np.count_nonzero(qa > 0)), n, MAX_LP_VARIABLES,
                         f"{what} enumerates A**N drafted trees ({np.count_nonzero(qa > 0)} tokens with q > 0, "
                         f"N = {n} nodes)")
    outputs = check_count(v_size, length, MAX_LP_VARIABLES,
                           f"{what} constrains V**(D + 1) output sequences (V = {v_size}, D = {length - 1})")
    n_var = trees * (n + 1) * v_size
    # each variable of a node at depth d touches V**(L - d - 1) output rows
    nonzeros = trees * v_size * sum(v_size ** (length - 1 - d) for d in [0, *depth.tolist()])
    if n_var > MAX_LP_VARIABLES or nonzeros > MAX_LP_NONZEROS:
        raise ValueError(f"{what} needs {n_var:.3g} variables and {nonzeros:.3g} constraint entries "
                         f"({trees} drafted trees, {n + 1} stopping nodes, V = {v_size}); limits are "
                         f"{MAX_LP_VARIABLES} and {MAX_LP_NONZEROS}")
    weight, tokens = _drafted_trees(par, pa, qa, what)  # shape (T,), (T, N)
    # a sequence s of m tokens is the block of output rows [code(s) V^(L-m), (code(s) + 1) V^(L-m)) (first token
    # most significant); inside it, row r has the fresh tokens' probability suffix_prob[L - m][r]
    suffix_prob = {k: np.prod(pa[enumerate_sequences(np.arange(v_size), k)], axis=1) for k in range(length)}
    rows, cols, vals = [], [], []
    path_code = {-1: np.zeros(trees, dtype=np.int64)}  # code of the path to each node, per tree
    for v in range(n):
        path_code[v] = path_code[int(par[v])] * v_size + tokens[:, v]
    z = np.arange(v_size)
    for slot, v in enumerate([-1, *range(n)]):  # slot 0: stop at the root
        d = 0 if v < 0 else int(depth[v])
        k = length - d - 1  # fresh target tokens after z
        seq = path_code[v][:, None] * v_size + z[None, :]  # shape (T, V): code of (path, z)
        start = seq * v_size ** k  # shape (T, V)
        var = (np.arange(trees)[:, None] * (n + 1) + slot) * v_size + z[None, :]  # shape (T, V)
        rows.append((start[:, :, None] + np.arange(v_size ** k)[None, None, :]).ravel())
        cols.append(np.repeat(var.ravel(), v_size ** k))
        vals.append(np.tile(suffix_prob[k], trees * v_size))
    tree_rows = outputs + np.repeat(np.arange(trees), (n + 1) * v_size)
    a_eq = sparse.csr_matrix((np.concatenate([*vals, np.ones(n_var)]),
                              (np.concatenate([*rows, tree_rows]), np.concatenate([*cols, np.arange(n_var)]))),
                             shape=(outputs + trees, n_var))
    p_out = np.prod(pa[enumerate_sequences(np.arange(v_size), length)], axis=1)  # shape (V^L,)
    b_eq = np.concatenate((p_out / p_out.sum(), weight / weight.sum()))
    gain = np.tile(np.repeat(np.concatenate(([0.0], depth.astype(np.float64))), v_size), trees)  # |v| per variable
    # both sides sum to 1, so one equality is implied: drop the last (rounding could make it infeasible)
    res = optimize.linprog(-gain, A_eq=a_eq[:-1], b_eq=b_eq[:-1], bounds=(0, None), method="highs")
    if res.status != 0:
        raise RuntimeError(f"{what}: the LP solver failed ({res.message})")
    return float(-res.fun)
