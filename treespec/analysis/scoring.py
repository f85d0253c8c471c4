"""Scoring the real code: Monte-Carlo acceptance of treespec's own verifiers.

:func:`monte_carlo_acceptance` drives the engine's verifier functions
(``treespec.verify.VERIFIERS[name]``, looked up at call time, so a
monkeypatched verifier is what gets measured) on depth-1
:class:`treespec.tree.TokenTree` s whose children are drawn by the engine's
drafter (``treespec.drafting.laws.draw_children`` under
``treespec.verify.LAW_OF_VERIFIER[name]``), and counts two events per step:

``accepted``
    ``VerifyResult.num_accepted == 1``: the accepted path goes into a child,
    which is what users see (the tree continues below it).
``in_drafts``
    the first emitted token (the accepted child, else the recovered token) is
    one of the drafted tokens.

Which exact quantity of :func:`ot_bounds.verifier_acceptance` each event
estimates (``event=`` argument there), derived from the node rules in
``treespec/verify``:

=========================  ========================  ===========================
verifier                   ``num_accepted`` event     output-in-drafts event
=========================  ========================  ===========================
single, rrs,               ``"in_drafts"`` (=         ``"in_drafts"``
rrs_without_replacement,   ``"accepted"``: a rejected
deterministic, spechub     draft gets zero residual)
greedy_draft               ``"in_drafts"`` (the walk  ``"in_drafts"``
                           follows a fixed child when
                           the residual lands on it)
kseq                       ``"accepted"`` (the        ``"in_drafts"``
                           residual may re-emit a
                           rejected draft, but the
                           walk stops at the root)
=========================  ========================  ===========================

:data:`ENGINE_EVENT` records the left column.  The comparison uses a
binomial z-score (:func:`z_score`): ``|mc - exact| / sqrt(exact (1 - exact) / N)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike

from ot_bounds._validation import check_distributions, check_n

#: Which ``verifier_acceptance(..., event=...)`` the engine's ``num_accepted`` estimates.
ENGINE_EVENT: dict[str, str] = {
    "single": "in_drafts",
    "rrs": "in_drafts",
    "rrs_without_replacement": "in_drafts",
    "deterministic": "in_drafts",
    "spechub": "in_drafts",
    "greedy_draft": "in_drafts",
    "kseq": "accepted",
}


@dataclass(frozen=True)
class MonteCarloAcceptance:
    """Monte-Carlo estimates from ``samples`` independent verification steps.

    Attributes
    ----------
    accepted : float
        Fraction of steps with ``VerifyResult.num_accepted == 1``.
    in_drafts : float
        Fraction of steps whose first emitted token is one of the drafts.
    output : ndarray, shape (V,)
        Empirical law of the first emitted token (should be ``p``).
    samples : int
    seed : int
    verifier : str
    law : str
        The engine draft law the children were drawn under.
    """

    accepted: float
    in_drafts: float
    output: np.ndarray
    samples: int
    seed: int
    verifier: str
    law: str


def z_score(estimate: float, exact: float, samples: int) -> float:
    """Binomial z-score ``|estimate - exact| / sqrt(exact (1 - exact) / samples)``.

    When ``exact`` is 0 or 1 the estimate must match exactly (infinite z otherwise).

    Examples
    --------
    >>> round(z_score(0.52, 0.5, 10_000), 6)
    4.0
    """
    var = exact * (1.0 - exact) / samples
    diff = abs(estimate - exact)
    if var <= 0.0:
        return 0.0 if diff <= 1e-12 else float("inf")
    return float(diff / np.sqrt(var))


def monte_carlo_acceptance(
    p: ArrayLike, q: ArrayLike, n: int, verifier: str, samples: int = 4000, seed: int = 0
) -> MonteCarloAcceptance:
    """Run treespec's own verifier on ``samples`` freshly drafted depth-1 trees.

    Parameters
    ----------
    p, q : array_like, shape (V,)
        Target and draft distributions (float64 throughout).
    n : int
        Number of children drafted at the root.
    verifier : str
        A key of ``treespec.verify.VERIFIERS`` (``"greedy"`` excluded: it has
        no counterpart in :func:`ot_bounds.verifier_acceptance`).
    samples : int
        Number of independent verification steps.
    seed : int
        Seed of the one ``torch.Generator`` used for drafting and verifying.

    Returns
    -------
    MonteCarloAcceptance

    Examples
    --------
    >>> mc = monte_carlo_acceptance([0.3, 0.7], [0.6, 0.4], 1, "single", samples=200, seed=1)
    >>> 0.5 < mc.accepted <= 1.0
    True
    """
    import torch

    import treespec.verify as tv
    from treespec.drafting.laws import draw_children
    from treespec.tree import TokenTree

    pa, qa = check_distributions(p, q)
    n = check_n(n)
    if verifier not in tv.VERIFIERS or verifier == "greedy":
        raise ValueError(f"unknown verifier {verifier!r}; expected one of {sorted(ENGINE_EVENT)}")
    samples = int(samples)
    if samples < 1:
        raise ValueError(f"samples must be >= 1, got {samples}")
    law = tv.LAW_OF_VERIFIER[verifier]
    fn = tv.VERIFIERS[verifier]  # looked up now: monkeypatching is honoured
    v = pa.size
    gen = torch.Generator().manual_seed(int(seed))
    p_t = torch.as_tensor(pa, dtype=torch.float64)
    q_t = torch.as_tensor(qa, dtype=torch.float64)
    drafts = draw_children(q_t[None, :].expand(samples, v).contiguous(), n, law, gen)
    tokens, valid = drafts.tokens.tolist(), drafts.valid.tolist()
    rows = {}  # number of children -> (target_probs, draft_probs)
    trees = {}  # child tuple -> TokenTree (immutable; identical trees are shared)
    accepted = in_drafts = 0
    counts = np.zeros(v, dtype=np.int64)
    for toks, ok in zip(tokens, valid):
        kids = [t for t, good in zip(toks, ok) if good]
        k = len(kids)
        if k not in rows:
            rows[k] = (p_t[None, :].expand(k + 1, v).contiguous(), q_t[None, :].expand(k + 1, v).contiguous())
        key = tuple(kids)
        tree = trees.get(key)
        if tree is None:
            tree = trees[key] = TokenTree.from_lists([-1] + [0] * k, [0] + kids, law)
        res = fn(tree, rows[k][0], rows[k][1], gen)
        out = res.tokens[0]
        accepted += res.num_accepted >= 1
        in_drafts += out in kids
        counts[out] += 1
    return MonteCarloAcceptance(
        accepted=accepted / samples,
        in_drafts=in_drafts / samples,
        output=counts / samples,
        samples=samples,
        seed=int(seed),
        verifier=verifier,
        law=law,
    )


@dataclass(frozen=True)
class RuleAcceptance:
    """Exact acceptance of an engine node rule over an enumerated draft law.

    Attributes
    ----------
    accepted : float
        ``P(the rule picks a child)`` (the engine's ``num_accepted == 1``).
    in_drafts : float
        ``P(the emitted token is one of the drafts)``.
    output : ndarray, shape (V,)
        Exact law of the emitted token (``p`` for a lossless rule).
    """

    accepted: float
    in_drafts: float
    output: np.ndarray


def rule_acceptance(p: ArrayLike, q: ArrayLike, n: int, verifier: str) -> RuleAcceptance:
    """Exact acceptance of ``treespec.verify.VERIFIER_RULES[verifier]`` (small V).

    Every ordered draft tuple of the verifier's law (enumerated by
    :func:`ot_bounds.draft_tuple_law`) is pushed through the engine's node rule
    in one batch; ``choice_probs`` and ``residual`` are then averaged with the
    tuple probabilities.  This checks the very rule :func:`verify_tree` samples
    from, without sampling noise (the drafter's law is checked by
    :func:`monte_carlo_acceptance`).

    Examples
    --------
    >>> round(rule_acceptance([0.3, 0.7], [0.6, 0.4], 2, "rrs").in_drafts, 6)
    0.82
    """
    import torch

    import treespec.verify as tv
    from treespec.verify.core import dense_residual

    from ot_bounds.draft_laws import draft_tuple_law
    from ot_bounds.verifiers import VERIFIER_LAW

    pa, qa = check_distributions(p, q)
    n = check_n(n)
    if verifier not in ENGINE_EVENT:
        raise ValueError(f"unknown verifier {verifier!r}; expected one of {sorted(ENGINE_EVENT)}")
    law = draft_tuple_law(qa, n, VERIFIER_LAW[verifier])
    tuples = torch.as_tensor(law.tuples)  # [M, k]
    m, k = tuples.shape
    valid = torch.ones(m, k, dtype=torch.bool)
    p_t = torch.as_tensor(pa, dtype=torch.float64)[None, :].expand(m, -1).contiguous()
    q_t = torch.as_tensor(qa, dtype=torch.float64)[None, :].expand(m, -1).contiguous()
    choice, residual = tv.VERIFIER_RULES[verifier](p_t, q_t, tuples, valid)
    choice = choice.clamp(min=0).numpy()
    residual = dense_residual(residual).numpy()
    probs = law.probs
    drafted = np.zeros((m, pa.size), dtype=bool)
    drafted[np.arange(m)[:, None], law.tuples] = True
    out = np.zeros((m, pa.size))
    np.add.at(out, (np.repeat(np.arange(m), k), law.tuples.ravel()), choice[:, :k].ravel())
    out += choice[:, k:] * residual
    accepted = float(probs @ choice[:, :k].sum(axis=1))
    in_drafts = float(probs @ (out * drafted).sum(axis=1))
    return RuleAcceptance(accepted=accepted, in_drafts=in_drafts, output=probs @ out)
