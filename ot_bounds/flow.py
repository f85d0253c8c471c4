"""Optimal acceptance as a maximum flow / minimum cut (networkx).

Network: source -> draft set ``S`` (capacity ``Q(set of drafts = S)``) ->
each token of ``S`` (infinite capacity) -> sink (capacity ``p(y)``).  A flow
is a partial coupling that only moves mass from a draft tuple to a token it
contains, so the maximum flow is ``alpha*``.  A minimum cut keeps on the
source side a token set ``H`` and exactly the draft sets inside ``H``; its
capacity is ``1 - Q(all drafts in H) + p(H)``, which is the subset formula.

Ordered tuples with the same set of tokens are merged into one node (the
order does not matter for the objective).

References
----------
Hu et al., "Towards Optimal Multi-draft Speculative Decoding", ICLR 2025, arXiv:2502.18779.
Thomas & Pal, "Global Resolution: Optimal Multi-Draft Speculative Sampling via
Convex Minimization", arXiv:2511.15898 (max-flow view).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import networkx as nx
import numpy as np
from numpy.typing import ArrayLike, NDArray

from ._validation import check_distributions, check_n, check_small_vocab
from .draft_laws import check_law, draft_tuple_law

MAX_TUPLES = 200_000


@dataclass(frozen=True)
class FlowResult:
    """Maximum flow value and a minimum cut.

    Attributes
    ----------
    value : float
        Maximum flow = ``alpha*``.
    cut_tokens : ndarray of int64
        Tokens on the source side of the minimum cut (an optimal ``H``).
    cut_value : float
        Capacity of that cut.
    """

    value: float
    cut_tokens: NDArray[np.int64]
    cut_value: float


def flow_optimal_acceptance(p: ArrayLike, q: ArrayLike, n: int, sampling: str = "iid") -> FlowResult:
    """Optimal acceptance by max-flow / min-cut on the drafts -> tokens graph.

    Parameters
    ----------
    p, q : array_like, shape (V,)
        Target and draft distributions.
    n : int
        Number of drafted children.
    sampling : str
        Any law of :data:`ot_bounds.draft_laws.TUPLE_LAWS`.

    Returns
    -------
    FlowResult

    Examples
    --------
    >>> round(flow_optimal_acceptance([0.1, 0.9], [0.6, 0.4], 2).value, 6)
    0.74
    """
    pa, qa = check_distributions(p, q)
    n = check_n(n)
    sampling = check_law(sampling, n)
    check_small_vocab(pa.size, n, sampling, MAX_TUPLES, "flow_optimal_acceptance")
    law = draft_tuple_law(qa, n, sampling)
    sets: dict[frozenset[int], float] = defaultdict(float)
    for row, pr in zip(law.tuples.tolist(), law.probs.tolist()):
        sets[frozenset(row)] += pr
    graph = nx.DiGraph()
    for i, (members, mass) in enumerate(sets.items()):
        graph.add_edge("source", ("set", i), capacity=mass)
        for y in members:
            graph.add_edge(("set", i), ("tok", y))  # no capacity attribute = infinite
    for y in range(pa.size):
        graph.add_edge(("tok", y), "sink", capacity=float(pa[y]))
    cut_value, (source_side, _sink_side) = nx.minimum_cut(graph, "source", "sink")
    value, _flow = nx.maximum_flow(graph, "source", "sink")
    tokens = np.array(sorted(node[1] for node in source_side if isinstance(node, tuple) and node[0] == "tok"), dtype=np.int64)
    return FlowResult(value=float(min(max(value, 0.0), 1.0)), cut_tokens=tokens, cut_value=float(cut_value))
