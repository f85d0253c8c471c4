"""EAGLE-2-style context-aware dynamic trees (EAGLE-2: Faster Inference of Language Models with
Dynamic Draft Trees, arXiv 2406.16858), grown by any draft causal LM.

Expansion: at each depth, every frontier node (at most ``top_k`` of them) gets its ``top_k`` most
likely draft tokens as candidate children, valued by the cumulative draft log-probability of the
path (log-softmax of the draft logits at temperature 1, whatever the sampling temperature); the
``top_k`` most valuable new candidates form the next frontier. One draft forward per depth.
Rerank: all drafted candidates are sorted by value and the best ``num_nodes`` kept. A child's
value never exceeds its parent's (log-probabilities are <= 0) and ties keep the parent first, so
the kept set is a connected tree.

The candidates are chosen from draft information only, so they verify losslessly as
*deterministic candidates* (law "deterministic", any temperature; greedy at temperature 0).
Only the expanded candidates enter the draft's KV cache (its tree has at most 1 + depth * top_k
nodes); the tree handed to the target is a re-indexed subset of all candidates, and the drafter
maps accepted nodes back to the runner's indices when committing (unexpanded ones are fed later
as a committed chain).

Stopping rules (:mod:`~treespec.drafting.stopping`, as in :class:`~treespec.trees.grow.ShapeDrafter`): a
candidate the rule does not keep is not a candidate (with :class:`~treespec.drafting.stopping.ConfidenceStop`,
one whose draft probability is below ``min_confidence``; ranks fall, so the later ones are below it too), and
one it keeps without growing is a candidate that is never expanded (a leaf). The rule reads the draft's
softmax at temperature 1 (the values' own distribution) and, for a rule that tracks the path
(:class:`~treespec.drafting.stopping.PredictedStop`), each expanded node's predicted path acceptance. Both
depend on the draft alone: the tree stays a set of deterministic candidates.
"""

from __future__ import annotations

import torch

from ..drafting.base import Draft, DraftState
from ..drafting.laws import top_order
from ..drafting.stopping import ConfidenceStop, PredictedStop, StopDecision, stopping_rule
from ..sampling import SamplingConfig
from ..tree import TokenTree
from .common import RunnerDrafter


def _values_and_ids(values: torch.Tensor, ids: torch.Tensor, decision: StopDecision | None = None
                    ) -> tuple[list[list[float]], list[list[int]], list[list[bool]], list[list[bool]],
                               list[list[float]] | None]:
    """``values`` (float) and ``ids`` (int64), both ``[M, k]``, and a stopping rule's keep / grow (all True
    without one) and path acceptance (None where it tracks none), as host lists in one read-back: float64 holds a
    float32 value and a token id exactly."""
    k = values.shape[1]
    parts = [values.double(), ids.double()]
    if decision is not None:
        parts += [decision.keep.double(), decision.grow.double()]
        parts += [decision.path_accept.double()] if decision.path_accept is not None else []
    host = torch.cat(parts, dim=1).tolist()

    def block(i: int) -> list[list[float]]:
        return [row[i * k:(i + 1) * k] for row in host]

    vals, kids = block(0), [[int(t) for t in row] for row in block(1)]
    if decision is None:
        every = [[True] * k for _ in host]
        return vals, kids, every, every, None
    keeps, grows = ([[bool(x) for x in row] for row in block(i)] for i in (2, 3))
    return vals, kids, keeps, grows, block(4) if decision.path_accept is not None else None


class Eagle2Drafter(RunnerDrafter):
    """Expand top-k per frontier node, keep the global top-k by cumulative log-prob, rerank to N.

    Parameters
    ----------
    model : the draft causal LM (or its runner).
    num_nodes : drafted nodes kept after the rerank (the budget, root excluded).
    top_k : children per expanded node and frontier size.
    depth : expansion depth (draft forwards per step).
    min_confidence : a candidate needs at least this draft probability (a
        :class:`~treespec.drafting.stopping.ConfidenceStop`; 0: none).
    stop : another stopping rule instead (e.g. :class:`~treespec.drafting.stopping.PredictedStop`); not with
        ``min_confidence``.
    """

    def __init__(self, model, num_nodes: int = 16, top_k: int = 4, depth: int = 5, *,
                 target_vocab_size: int | None = None, min_confidence: float = 0.0,
                 stop: ConfidenceStop | PredictedStop | None = None) -> None:
        super().__init__(model, target_vocab_size)
        if num_nodes < 1 or top_k < 1 or depth < 1:
            raise ValueError("num_nodes, top_k and depth must be >= 1")
        self.num_nodes = num_nodes
        self.top_k = top_k
        self.depth = depth
        self.stop = stopping_rule(min_confidence, stop)

    def law(self, sampling: SamplingConfig) -> str:
        return "deterministic"

    def propose(self, state: DraftState, sampling: SamplingConfig, generator: torch.Generator | None) -> Draft:
        device = self.runner.device
        self.draft_forwards = 0
        chain = self._pending_chain(state)
        # all candidates (host lists) and the runner's tree: only the expanded candidates enter the
        # draft cache, so its tree stays <= 1 + depth * top_k nodes
        parents, tokens, value = [-1], [state.tokens[-1]], [0.0]
        r_parents, r_tokens, to_runner = [-1], [state.tokens[-1]], {0: 0}
        stop = self.stop
        tracks = stop is not None and stop.tracks_path
        path_accept = {0: 1.0}  # candidate -> predicted path acceptance (rules that track one)
        frontier = [0]
        for _ in range(min(self.depth, max(state.max_depth, 0))):
            if not frontier:
                break
            for c in frontier:
                if c not in to_runner:
                    to_runner[c] = len(r_tokens)
                    r_parents.append(to_runner[parents[c]])
                    r_tokens.append(tokens[c])
            tree = TokenTree.from_lists(r_parents, r_tokens, "deterministic", device)
            at = [to_runner[c] for c in frontier]
            need_feature = stop is not None and stop.needs_feature
            draft = self._forward(tree, at, chain, need_feature)  # [M, Vs] (a subset for heads)
            chain = None
            logp = torch.log_softmax(draft.logits.float(), dim=-1)
            k = min(self.top_k, logp.shape[-1])
            cols = top_order(logp, k)  # [M, k] the k best columns, ties by id (no full-vocabulary sort)
            lp = logp.gather(1, cols)
            decision = None
            if stop is not None:
                parent_accept = depths = None
                if tracks:
                    parent_accept = torch.tensor([path_accept[c] for c in frontier], device=device)
                    depths = tree.depths[torch.tensor(at, dtype=torch.long, device=device)]
                decision = stop.decide(True, logp.exp(), cols, draft.feature, parent_accept, depths)
            # one host sync per depth: the values, token ids and the rule's verdicts read back together
            lp, kids, keeps, grows, accept = _values_and_ids(lp, draft.token_ids(cols), decision)
            growing = []
            for r, node in enumerate(frontier):
                for j in range(k):
                    if not keeps[r][j]:  # ranks fall: the later candidates are not kept either
                        break
                    if grows[r][j]:
                        growing.append(len(tokens))
                    if tracks:
                        path_accept[len(tokens)] = accept[r][j]
                    parents.append(node)
                    tokens.append(kids[r][j])
                    value.append(value[node] + lp[r][j])
            frontier = sorted(sorted(growing, key=lambda i: (-value[i], i))[: self.top_k])
        self._flush_chain(chain)
        # rerank: best num_nodes candidates by value (parents rank before their children)
        ranked = sorted(range(1, len(tokens)), key=lambda i: (-value[i], i))
        keep = {0}
        for i in ranked:
            if len(keep) > self.num_nodes:
                break
            if parents[i] in keep:
                keep.add(i)
        kept = sorted(keep)  # topological, siblings in draft rank order
        new_index = {old: new for new, old in enumerate(kept)}
        tree = TokenTree.from_lists([-1] + [new_index[parents[i]] for i in kept[1:]],
                                    [tokens[i] for i in kept], "deterministic", device)
        self._runner_index = [to_runner.get(i, -1) for i in kept]
        return Draft(tree)
