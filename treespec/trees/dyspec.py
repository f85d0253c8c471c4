"""DySpec dynamic draft trees (DySpec: Faster Speculative Decoding with Dynamic Token Tree
Structure, arXiv 2410.11744).

**Heap variant** (:class:`DySpecDrafter`, ``variant="heap"``). A slot ``(u, v)`` means "draw the
next child of node u"; its value is ``v = P(u) * (1 - mass of u's children already drawn)``,
where ``P(u)`` is the product of the draft probabilities along u's root path (``P(root) = 1``).
Start with the root's slot; repeatedly pop the most valuable slot, draw u's next child c without
replacement from u's draft distribution q_u (``P(c) = P(u) q_u(c)``), then push u's sibling slot
(if q_u has mass left) and c's own first-child slot (if c may still have children), until the node
budget is spent. Children are drawn without replacement, so the tree verifies with
``rrs_without_replacement``; at temperature 0 (or with ``law="deterministic"``) the "draws" are
q's tokens in decreasing order and the tree is deterministic.

Losslessness (NOTES §1 contract (b)): whether u gets another child is decided before that child
is drawn, from draft quantities only (the values of revealed drafts); each child is drawn from q_u
restricted to the tokens not drawn yet. Nothing is ever dropped after being drawn. The draws of
one node are pre-computed by an exponential race (``E_y / q(y)`` in increasing order, the same law
as sequential draws without replacement) and revealed one at a time, so revealing the j-th draw
only uses what the sequential algorithm would have seen.

**Cost.** The heap loop is inherently sequential (one host-side pop/push per node, O(n log n)
on Python floats: negligible), but each popped node needs its draft distribution, i.e. a draft
forward of that node. Instead of one draft forward per node, the tree grows in *rounds*: a round
runs the heap until it pops a node whose distribution is unknown, then ONE batched draft forward
computes the distributions of all created-but-unforwarded nodes that could still be popped within
the remaining budget (those among the top ``remaining`` slots), and the heap resumes. The result is
exactly the sequential DySpec tree; the number of draft forwards is the number of rounds, at least
the tree depth and at most the budget (typically depth + a few). Each forward also does one
top-``budget`` race over the vocabulary per forwarded node and one host sync.

**Threshold variant** (``variant="threshold"``): layer by layer, exactly one batched draft forward
per depth. Within a layer the slots are popped most valuable first while their value exceeds
``threshold`` and the budget lasts; the drawn children form the next layer.
"""

from __future__ import annotations

import heapq
import itertools

import torch

from ..drafting.base import Draft, DraftState
from ..drafting.laws import top_order
from ..drafting.stopping import ConfidenceStop, PredictedStop, StopDecision, stopping_rule
from ..sampling import SamplingConfig, logits_to_probs
from ..tree import TokenTree
from .common import DraftLogits, RunnerDrafter

VARIANTS = ("heap", "threshold")


class DySpecDrafter(RunnerDrafter):
    """Dynamic token trees (DySpec) grown by a draft causal LM.

    Parameters
    ----------
    model : the draft causal LM (or its runner).
    budget : drafted nodes per step (root excluded).
    max_depth : deepest level (None: up to the budget).
    variant : "heap" (sequential greedy, batched in rounds) or "threshold" (one draft call per depth).
    threshold : the threshold variant expands slots with value > threshold (None: 1 / budget, a
        heuristic: a slot worth less than an even share of the budget is not expanded).
    law : "without_replacement" (default; verify with ``rrs_without_replacement``) or
        "deterministic" (q's tokens in decreasing order; verify with ``deterministic``). At
        temperature 0 the law is "deterministic" and slot values use the draft's softmax at T = 1.
    min_confidence : a drawn child grows only if the draft gives it at least this probability; with
        deterministic candidates one below it is not proposed (a
        :class:`~treespec.drafting.stopping.ConfidenceStop`; 0: none).
    stop : another stopping rule instead (e.g. :class:`~treespec.drafting.stopping.PredictedStop`); not with
        ``min_confidence``.
    """

    def __init__(self, model, budget: int = 16, max_depth: int | None = None, *, variant: str = "heap",
                 threshold: float | None = None, law: str = "without_replacement",
                 target_vocab_size: int | None = None, min_confidence: float = 0.0,
                 stop: ConfidenceStop | PredictedStop | None = None) -> None:
        super().__init__(model, target_vocab_size)
        if budget < 1:
            raise ValueError("budget must be >= 1")
        if variant not in VARIANTS:
            raise ValueError(f"unknown DySpec variant {variant!r}; expected one of {VARIANTS}")
        if law not in ("without_replacement", "deterministic"):
            raise ValueError("DySpec draws children without replacement: law must be 'without_replacement' or "
                             "'deterministic'")
        self.budget = budget
        self.max_depth = max_depth
        self.variant = variant
        self.threshold = 1.0 / budget if threshold is None else threshold
        self.draft_law = law
        self.stop = stopping_rule(min_confidence, stop)

    def law(self, sampling: SamplingConfig) -> str:
        return "deterministic" if sampling.greedy else self.draft_law

    # ------------------------------------------------------------------ per-node draws
    def _draws(self, draft: DraftLogits, sampling: SamplingConfig, law: str, limit: int,
               generator: torch.Generator | None, nodes: list[int]
               ) -> tuple[torch.Tensor | None, list[list[int]], list[list[float]], list[list[bool]], list[list[float]]]:
        """For each row (of tree ``nodes``): q ``[M, V]`` (or None), its tokens in draw order (at most ``limit``;
        with deterministic candidates, up to the first one the stopping rule does not keep), their q values,
        whether each grows and its predicted path acceptance (1.0 where the rule tracks none).

        Selection and draws run on the draft's own columns (its vocabulary subset, for a head)."""
        logits = draft.logits
        k = min(limit, logits.shape[-1])
        if law == "deterministic":
            value_q = torch.softmax(logits.float(), dim=-1) if sampling.greedy else logits_to_probs(logits, sampling)
            toks = top_order(value_q, k)  # [M, k] best first, ties by id (no full-vocabulary sort)
            vals = value_q.gather(1, toks)
            q = None
            keep = torch.ones_like(vals, dtype=torch.bool)
        else:
            q = logits_to_probs(logits, sampling)  # [M, V]
            race = torch.empty_like(q).exponential_(generator=generator)
            keys = torch.where(q > 0, race / q.clamp(min=torch.finfo(q.dtype).tiny), torch.inf)
            keys, toks = torch.topk(keys, k, dim=-1, largest=False, sorted=True)
            vals = q.gather(1, toks)
            keep = torch.isfinite(keys)  # the support of q ends the draws
        decision = None
        if self.stop is not None:  # it reads the draft's softmax (deterministic; value_q already is one at T=0) or q
            probs = q if q is not None else value_q if sampling.greedy else torch.softmax(logits.float(), dim=-1)
            decision = self._decide(probs, law, toks, draft.feature, nodes)
        toks = draft.token_ids(toks)
        q = None if q is None else draft.spread(q)  # [M, V] for the verifier
        parts = [toks.double(), vals.double(), keep.double()]
        if decision is not None:
            parts += [decision.keep.double(), decision.grow.double()]
            parts += [decision.path_accept.double()] if decision.path_accept is not None else []
        host = torch.cat(parts, dim=1).tolist()  # one host sync
        tok_lists, val_lists, grow_lists, accept_lists = [], [], [], []
        for row in host:
            n = int(sum(row[2 * k:3 * k]))
            if decision is not None:
                kept = row[3 * k:3 * k + n]
                if law != "deterministic" and not all(kept):
                    raise RuntimeError("a stopping rule dropped a sampled child: the children's law would no "
                                       "longer be the one the verifier assumes")
                n = kept.index(0.0) if 0.0 in kept else n  # ranks fall: the later candidates are not kept either
            tok_lists.append([int(t) for t in row[:n]])
            val_lists.append(row[k:k + n])
            grow_lists.append([bool(g) for g in row[4 * k:4 * k + n]] if decision is not None else [True] * n)
            accept_lists.append(row[5 * k:5 * k + n] if len(row) > 5 * k else [1.0] * n)
        return q, tok_lists, val_lists, grow_lists, accept_lists

    def _decide(self, probs: torch.Tensor, law: str, columns: torch.Tensor, feature: torch.Tensor | None,
                nodes: list[int]) -> StopDecision:
        """The stopping rule's verdict on the draws ``columns`` ``[M, k]`` of ``nodes``' rows, drawn or ranked by
        ``probs`` ``[M, Vs]``."""
        parent = depth = None
        if self.stop.tracks_path:
            parent = torch.tensor([self._accept[u] for u in nodes], device=columns.device)
            depth = torch.tensor([self._depth[u] for u in nodes], device=columns.device)
        return self.stop.decide(law == "deterministic", probs, columns, feature, parent, depth)

    # ------------------------------------------------------------------ proposal
    def propose(self, state: DraftState, sampling: SamplingConfig, generator: torch.Generator | None) -> Draft:
        law = self.law(sampling)
        max_depth = max(state.max_depth, 0) if self.max_depth is None else min(self.max_depth, max(state.max_depth, 0))
        device = self.runner.device
        self.draft_forwards = 0
        self._chain = self._pending_chain(state)
        self._parents, self._tokens = [-1], [state.tokens[-1]]
        self._depth, self._value = [0], [1.0]
        self._grows, self._accept = [True], [1.0]  # per node: may it get children; its predicted path acceptance
        self._cands: dict[int, tuple[list[int], list[float], list[bool], list[float]]] = {}
        self._rows: dict[int, torch.Tensor] = {}
        self._drawn: dict[int, int] = {}
        self._mass: dict[int, float] = {}
        if max_depth > 0:
            if self.variant == "heap":
                self._grow_heap(law, sampling, generator, max_depth)
            else:
                self._grow_threshold(law, sampling, generator, max_depth)
        self._flush_chain(self._chain)
        tree = TokenTree.from_lists(self._parents, self._tokens, law, device)
        self._runner_index = None
        if law == "deterministic":
            return Draft(tree)
        used = [u for u in self._rows if self._drawn.get(u, 0) > 0]
        draft_probs = torch.zeros(tree.num_nodes, self.vocab_size, device=device)
        if used:
            draft_probs[torch.tensor(used, device=device)] = torch.stack([self._rows[u] for u in used])
        return Draft(tree, draft_probs)

    def _forward_nodes(self, nodes: list[int], law: str, sampling: SamplingConfig,
                       generator: torch.Generator | None, limit: int) -> None:
        tree = TokenTree.from_lists(self._parents, self._tokens, law, self.runner.device)
        draft = self._forward(tree, nodes, self._chain, self.stop is not None and self.stop.needs_feature)
        self._chain = None
        q, toks, vals, grows, accept = self._draws(draft, sampling, law, limit, generator, nodes)
        for r, node in enumerate(nodes):
            self._cands[node] = (toks[r], vals[r], grows[r], accept[r])
            self._drawn[node], self._mass[node] = 0, 0.0
            if q is not None:
                self._rows[node] = q[r]

    def _draw_child(self, u: int) -> int | None:
        """Reveal u's next draw as a new node (None if u's draws are exhausted)."""
        toks, vals, grows, accept = self._cands[u]
        j = self._drawn[u]
        if j >= len(toks):
            return None
        self._drawn[u] = j + 1
        self._mass[u] += vals[j]
        c = len(self._tokens)
        self._parents.append(u)
        self._tokens.append(toks[j])
        self._depth.append(self._depth[u] + 1)
        self._value.append(self._value[u] * vals[j])
        self._grows.append(grows[j])
        self._accept.append(accept[j])
        return c

    def _slot_value(self, u: int) -> float:
        return self._value[u] * max(1.0 - self._mass.get(u, 0.0), 0.0)

    def _has_more(self, u: int) -> bool:
        toks = self._cands[u][0]
        return self._drawn[u] < len(toks) and self._mass[u] < 1.0

    def _grow_heap(self, law: str, sampling: SamplingConfig, generator, max_depth: int) -> None:
        tick = itertools.count()
        self._forward_nodes([0], law, sampling, generator, self.budget)
        heap = [(-1.0, next(tick), 0)]
        made = 0
        while heap and made < self.budget:
            neg, t, u = heapq.heappop(heap)
            if u not in self._cands:
                # a round ends: forward every unforwarded node that could still be popped
                heapq.heappush(heap, (neg, t, u))
                remaining = self.budget - made
                top = heapq.nsmallest(remaining, heap)
                pending = sorted({n for _, _, n in top if n not in self._cands})
                self._forward_nodes(pending, law, sampling, generator, remaining)
                continue
            c = self._draw_child(u)
            if c is None:
                continue
            made += 1
            if self._has_more(u):
                heapq.heappush(heap, (-self._slot_value(u), next(tick), u))
            if self._depth[c] < max_depth and self._grows[c]:
                heapq.heappush(heap, (-self._value[c], next(tick), c))

    def _grow_threshold(self, law: str, sampling: SamplingConfig, generator, max_depth: int) -> None:
        layer = [0]
        made = 0
        tick = itertools.count()
        for _ in range(max_depth):
            if not layer or made >= self.budget:
                break
            self._forward_nodes(layer, law, sampling, generator, self.budget - made)
            heap = [(-self._value[u], next(tick), u) for u in layer]
            heapq.heapify(heap)
            nxt = []
            while heap and made < self.budget:
                neg, _, u = heapq.heappop(heap)
                if -neg <= self.threshold:
                    break
                c = self._draw_child(u)
                if c is None:
                    continue
                made += 1
                if self._grows[c]:
                    nxt.append(c)
                if self._has_more(u):
                    heapq.heappush(heap, (-self._slot_value(u), next(tick), u))
            layer = nxt
