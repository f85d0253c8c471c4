"""Chain level: expected accepted drafts of a drafted chain, verified token by token or as one block.

The model is the one :mod:`ot_bounds.trees` uses: the same target ``p`` and draft ``q`` at every position
(the next token's law does not depend on the prefix), drafts ``X_1 .. X_d`` drawn i.i.d. from ``q``, and
``r(x) = p(x) / q(x)``. Three verifiers' worth, each the expected number of kept drafts ``E[tau]`` (the bonus
or recovered token not counted, as in :func:`~ot_bounds.trees.expected_accepted_length`):

* **token** (speculative sampling, token by token): draft ``i`` is kept while every test so far passed,
  ``E[tau] = sum_{i=1}^{d} alpha^i`` with ``alpha = sum_x min(p(x), q(x))``;
* **block** (block verification): with ``w_0 = 1``, ``w_i = min(1, w_{i-1} r(X_i))``, the residual mass
  ``s(w) = sum_x (w p(x) - q(x))_+`` and ``h_i = s(w_i) / (s(w_i) + 1 - w_i)`` for ``i < d``, ``h_d = w_d``,
  the block keeps the first ``tau`` drafts, ``tau`` the last ``i`` whose test passes, so
  ``P(tau >= i | X) = 1 - prod_{j=i}^{d} (1 - h_j)``;
* **optimum** (:func:`lp_chain_optimal_acceptance`): the largest ``E[tau]`` of any lossless verification, a
  linear program over what a verifier may do with each drafted block (keep a prefix, emit one token, then
  decoding goes on from the target); block verification attains it (Sun et al. prove it optimal; the tests
  check the two agree).

Above them the prefix bound (:func:`chain_acceptance_upper_bound`):
``P(tau >= j) <= P(X_{1:j} = Y_{1:j}) <= beta_j = sum_{x in V^j} min(p^j(x), q^j(x))`` for the output ``Y``, so
``E[tau] <= sum_j beta_j``, cheap on any vocabulary but not attained in general: each ``j`` has its own best
coupling, and a verifier's tokens after the one it emits come fresh from the target.
``token <= block = optimum <= prefix bound``, with equality at ``d = 1`` (all are ``alpha``).

Exact values enumerate the ``A^d`` drafted blocks over the ``A`` tokens with ``q > 0`` (small vocabularies;
bounded by :data:`MAX_BLOCKS`); :func:`sample_chain_acceptance` estimates ``token``, ``block`` and the prefix
bound on any vocabulary from drafted blocks sampled with a seed, with the standard error.

References
----------
Sun, Mendlovic, Leviathan, Aharoni, Ro, Beirami, Suresh, "Block Verification Accelerates Speculative
Decoding", arXiv:2403.10444.
Leviathan, Kalman, Matias, "Fast Inference from Transformers via Speculative Decoding", arXiv:2211.17192.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike, NDArray

from ._validation import check_count, check_distributions, check_int
from .trees import (
    SampledAcceptance,
    check_samples_and_seed,
    enumerate_sequences,
    lp_tree_optimal_acceptance,
    sampled_mean,
)

#: the chain verifiers whose exact ``E[tau]`` this module computes
CHAIN_VERIFIERS: tuple[str, ...] = ("token", "block")

#: most drafted blocks (``A^d``) an exact enumeration visits
MAX_BLOCKS = 500_000

#: most sampled entries (blocks x depth) held at once by :func:`sample_chain_acceptance` (larger requests run
#: in chunks)
SAMPLE_CHUNK = 1_048_576

#: longest chain :func:`sample_chain_acceptance` takes (its chunks hold at least one block)
MAX_SAMPLED_DEPTH = 4096


def _check_depth(depth: object) -> int:
    return check_int(depth, "depth")


def _check_verifier(verifier: object, allowed: tuple[str, ...] = CHAIN_VERIFIERS) -> str:
    if verifier not in allowed:
        raise ValueError(f"unknown chain verifier {verifier!r}; expected one of {allowed}")
    return str(verifier)


class _ResidualMass:
    """``s(w) = sum_x (w p(x) - q(x))_+`` for arrays of ``w`` in ``[0, 1]``, by sorted ratios: ``O(log V)`` each."""

    def __init__(self, pa: NDArray[np.float64], qa: NDArray[np.float64]) -> None:
        keep = pa > 0  # tokens with p = 0 never add to the residual
        with np.errstate(divide="ignore"):
            ratio = np.where(qa[keep] > 0, pa[keep] / np.where(qa[keep] > 0, qa[keep], 1.0), np.inf)
        order = np.argsort(ratio, kind="stable")
        self.ratio = ratio[order]  # shape (K,), ascending
        # suffix sums: p_suffix[k] = sum of p over sorted positions >= k (k = K: 0)
        self.p_suffix = np.concatenate((np.cumsum(pa[keep][order][::-1])[::-1], [0.0]))
        self.q_suffix = np.concatenate((np.cumsum(qa[keep][order][::-1])[::-1], [0.0]))

    def __call__(self, w: NDArray[np.float64]) -> NDArray[np.float64]:
        out = np.zeros_like(w)
        live = w > 0
        # (w p - q)_+ > 0 exactly where r > 1 / w
        start = np.searchsorted(self.ratio, 1.0 / w[live], side="right")
        out[live] = w[live] * self.p_suffix[start] - self.q_suffix[start]
        return np.maximum(out, 0.0)


def _conditional_tau(ratios: NDArray[np.float64], mass: _ResidualMass, verifier: str) -> NDArray[np.float64]:
    """``E[tau | X]`` for drafted blocks given by their ratios ``r(X_i)``: shape (N, d) -> (N,)."""
    n, d = ratios.shape
    if verifier == "token":
        return np.cumprod(np.minimum(ratios, 1.0), axis=1).sum(axis=1)
    h = np.empty((n, d))
    w = np.ones(n)
    for i in range(d):  # w_i = min(1, w_{i-1} r), 0 * inf read as 0 (a dead block stays dead)
        w = np.where(w > 0, np.minimum(w * ratios[:, i], 1.0), 0.0)
        if i < d - 1:
            s = mass(w)
            denom = s + 1.0 - w
            h[:, i] = np.where(s > 0, s / np.where(denom > 0, denom, 1.0), 0.0)
        else:
            h[:, i] = w
    h = np.clip(h, 0.0, 1.0)
    # P(tau >= i) = 1 - prod_{j >= i} (1 - h_j), i = 1 .. d
    fail_from = np.cumprod((1.0 - h)[:, ::-1], axis=1)[:, ::-1]  # shape (N, d)
    return (1.0 - fail_from).sum(axis=1)


def _prefix_bound_terms(ratios: NDArray[np.float64]) -> NDArray[np.float64]:
    """``sum_j min(1, prod_{i <= j} r(X_i))`` per block: its mean under ``q^d`` is ``sum_j beta_j``.

    In log space (a product of large and zero ratios gives 0, never ``inf * 0``)."""
    with np.errstate(divide="ignore"):
        logs = np.log(np.minimum(ratios, np.finfo(np.float64).max))  # -inf where r = 0
    return np.exp(np.minimum(np.cumsum(logs, axis=1), 0.0)).sum(axis=1)


def _atoms(pa: NDArray[np.float64], qa: NDArray[np.float64]) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    """(q, r) of the tokens the draft can propose (q > 0)."""
    drafted = qa > 0
    return qa[drafted], pa[drafted] / qa[drafted]


def _enumerated_blocks(pa: NDArray[np.float64], qa: NDArray[np.float64], depth: int,
                       what: str) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    """Every drafted block: (its probability under ``q^d`` shape (A^d,), its ratios shape (A^d, d))."""
    q_atoms, r_atoms = _atoms(pa, qa)
    a = q_atoms.size
    check_count(a, depth, MAX_BLOCKS, f"{what} enumerates A**d drafted blocks ({a} tokens with q > 0, d = {depth}); "
                                       "use sample_chain_acceptance for larger ones")
    index = enumerate_sequences(np.arange(a), depth)  # shape (A^d, d)
    return np.prod(q_atoms[index], axis=1), r_atoms[index]


def chain_acceptance(p: ArrayLike, q: ArrayLike, depth: int, verifier: str = "block") -> float:
    r"""Exact expected number of kept drafts of a chain of ``depth`` i.i.d. drafts.

    Parameters
    ----------
    p, q : array_like, shape (V,)
        Target and draft distributions (the same at every position of the chain).
    depth : int
        Drafts in the chain, ``d``.
    verifier : {"token", "block"}
        Token-by-token verification (closed form) or block verification (enumeration of the ``A^d``
        drafted blocks, at most :data:`MAX_BLOCKS`).

    Returns
    -------
    float
        :math:`E[\tau]`; for ``"token"`` :math:`\sum_{i=1}^{d} \alpha^i`, :math:`\alpha = \sum_x \min(p, q)`.

    Examples
    --------
    >>> p, q = [0.6, 0.3, 0.1], [0.2, 0.3, 0.5]
    >>> round(chain_acceptance(p, q, 2, "token"), 6)
    0.96
    >>> round(chain_acceptance(p, q, 2, "block"), 6)
    1.0
    """
    pa, qa = check_distributions(p, q)
    depth, verifier = _check_depth(depth), _check_verifier(verifier)
    if verifier == "token":
        alpha = min(float(np.minimum(pa, qa).sum()), 1.0)
        return float(depth) if alpha == 1.0 else alpha * (1.0 - alpha ** depth) / (1.0 - alpha)
    weight, ratios = _enumerated_blocks(pa, qa, depth, "chain_acceptance")
    return float(weight @ _conditional_tau(ratios, _ResidualMass(pa, qa), verifier))


def chain_acceptance_upper_bound(p: ArrayLike, q: ArrayLike, depth: int) -> float:
    r"""The prefix bound :math:`\sum_{j=1}^{d} \beta_j`, :math:`\beta_j = \sum_{x \in V^j} \min(p^j(x), q^j(x))`.

    Every lossless verification of an i.i.d. chain keeps at most this many drafts in expectation
    (:math:`P(\tau \ge j)` is at most the best coupling of the ``j``-token prefixes). Exact, by enumerating
    the ``A^d`` drafted blocks (at most :data:`MAX_BLOCKS`).

    Examples
    --------
    >>> round(chain_acceptance_upper_bound([0.6, 0.3, 0.1], [0.2, 0.3, 0.5], 2), 6)
    1.04
    """
    pa, qa = check_distributions(p, q)
    depth = _check_depth(depth)
    weight, ratios = _enumerated_blocks(pa, qa, depth, "chain_acceptance_upper_bound")
    return float(weight @ _prefix_bound_terms(ratios))


def lp_chain_optimal_acceptance(p: ArrayLike, q: ArrayLike, depth: int) -> float:
    r"""The best :math:`E[\tau]` of any lossless verification of an i.i.d. chain: a linear program.

    :func:`~ot_bounds.trees.lp_tree_optimal_acceptance` on the chain's shape: over every drafted block, the law of
    the kept prefix and the one token emitted after it, such that the output (with the target's own tokens after
    it) has the target's law. Block verification attains it.

    Examples
    --------
    >>> round(lp_chain_optimal_acceptance([0.6, 0.3, 0.1], [0.2, 0.3, 0.5], 2), 6)  # block's 1.0
    1.0
    """
    depth = _check_depth(depth)
    return lp_tree_optimal_acceptance(np.arange(-1, depth - 1), p, q, what="lp_chain_optimal_acceptance")


def sample_chain_acceptance(p: ArrayLike, q: ArrayLike, depth: int, verifier: str = "block", *,
                            samples: int = 100_000, seed: int = 0) -> SampledAcceptance:
    r"""Estimate a chain's :math:`E[\tau]` on any vocabulary: the mean of :math:`E[\tau \mid X]` over sampled blocks.

    Parameters
    ----------
    p, q : array_like, shape (V,)
        Target and draft distributions.
    depth : int
        Drafts in the chain.
    verifier : {"token", "block", "bound"}
        A verifier of :data:`CHAIN_VERIFIERS`, or ``"bound"`` for the prefix bound of
        :func:`chain_acceptance_upper_bound` (the mean of :math:`\sum_j \min(1, \prod_{i \le j} r(X_i))`).
    samples : int
        Drafted blocks ``X ~ q^d`` to draw (held :data:`SAMPLE_CHUNK` entries, blocks x depth, at a time).
    seed : int
        Seed of the ``numpy.random.Generator`` that draws them.

    Returns
    -------
    SampledAcceptance

    Examples
    --------
    >>> est = sample_chain_acceptance([0.6, 0.3, 0.1], [0.2, 0.3, 0.5], 2, "block", samples=20_000, seed=0)
    >>> abs(est.mean - 1.0) < 4 * est.stderr
    True
    """
    pa, qa = check_distributions(p, q)
    depth = _check_depth(depth)
    verifier = _check_verifier(verifier, CHAIN_VERIFIERS + ("bound",))
    if depth > MAX_SAMPLED_DEPTH:
        raise ValueError(f"depth {depth} is above the {MAX_SAMPLED_DEPTH} drafts sample_chain_acceptance takes")
    samples, seed = check_samples_and_seed(samples, seed)
    rows = max(1, SAMPLE_CHUNK // depth)
    q_atoms, r_atoms = _atoms(pa, qa)
    mass = _ResidualMass(pa, qa) if verifier == "block" else None
    rng = np.random.default_rng(seed)
    values, left = [], samples
    while left:
        n = min(left, rows)
        ratios = r_atoms[rng.choice(q_atoms.size, size=(n, depth), p=q_atoms / q_atoms.sum())]  # shape (n, d)
        values.append(_prefix_bound_terms(ratios) if verifier == "bound" else _conditional_tau(ratios, mass, verifier))
        left -= n
    return sampled_mean(values)
