"""Growing any :class:`~treespec.trees.shape.TreeShape` with a draft causal LM, level by level.

One draft forward per depth: the frontier nodes that have children in the template are fed
together through the draft's KV cache with a tree mask, and all their children are drawn in one
vectorised :func:`~treespec.drafting.laws.draw_children` call with per-node child counts.

Every draft law of :data:`treespec.tree.DRAFT_LAWS` is supported ("spechub" needs at most two
children per node). At temperature 0 every law becomes deterministic top-k of the draft logits
(the verifier is greedy then). Under "without_replacement" a node whose q has fewer non-zero
tokens than the template asks (e.g. with top-k / top-p sampling) gets only those children, and
the template subtrees of the missing children are dropped: the tree is then smaller than the
shape. Dropping is decided by the draft alone (before any missing child could be drawn), so the
verification stays lossless.

Cost: ``shape.max_depth`` draft forwards per step (one per level) plus one host read-back per level of the
drawn tokens (with their validity and confidence), whatever the level's width.
"""

from __future__ import annotations

import torch

from ..drafting.base import Draft, DraftState
from ..drafting.laws import draw_children
from ..drafting.stopping import ConfidenceStop, PredictedStop, StopDecision, stopping_rule
from ..sampling import SamplingConfig, logits_to_probs
from ..tree import DRAFT_LAWS, TokenTree
from .common import RunnerDrafter
from .shape import TreeShape


def check_shape_law(shape: TreeShape, law: str) -> None:
    if law not in DRAFT_LAWS:
        raise ValueError(f"unknown draft law {law!r}; expected one of {DRAFT_LAWS}")
    if law == "spechub" and shape.num_drafted and max(shape.num_children) > 2:
        raise ValueError("the spechub law drafts at most two children per node")


def _to_host(tokens: torch.Tensor, valid: torch.Tensor, decision: StopDecision | None
             ) -> tuple[list[list[int]], list[list[int]], list[list[int]], list[list[int]]]:
    """One level's drawn children ``[M, K]`` (tokens, valid, and the stopping rule's keep / grow, all True
    without one) as host lists, read back together: the one host sync of a level."""
    parts = [tokens, valid.long()]
    if decision is not None:
        parts += [decision.keep.long(), decision.grow.long()]
    host = torch.stack(parts).tolist()
    if decision is None:
        return host[0], host[1], host[1], host[1]  # valid children are kept and grow
    return host[0], host[1], host[2], host[3]


class ShapeDrafter(RunnerDrafter):
    """A draft causal LM growing a fixed :class:`TreeShape` under a draft law.

    Parameters
    ----------
    model : the draft causal LM (or its :class:`~treespec.models.runner.ModelRunner`).
    shape : the template tree (budget = ``shape.num_drafted`` nodes).
    law : how each node's children are drawn at temperature > 0 (one of ``DRAFT_LAWS``).
    target_vocab_size : the target's vocabulary (a smaller draft vocabulary is zero-padded).
    min_confidence : adaptive draft length with the draft's own confidence as the estimate of
        acceptance (:class:`~treespec.drafting.stopping.ConfidenceStop`). With deterministic candidates
        a child is kept only if the draft gives it at least this probability (softmax of its logits),
        its template subtree is dropped otherwise. With sampled children every drawn child is kept
        (dropping one would change the law of the children) and only those whose own draft probability
        reaches the threshold get children: a node's subtree depends on the node's token, never on its
        siblings' fate. Both depend only on the draft, so verification stays lossless.
    stop : another stopping rule instead (e.g. :class:`~treespec.drafting.stopping.PredictedStop`, the
        rule of SpecDec++, arXiv 2405.19715, with a trained acceptance head); not with ``min_confidence``.
    """

    def __init__(self, model, shape: TreeShape, law: str = "without_replacement",
                 target_vocab_size: int | None = None, min_confidence: float = 0.0,
                 stop: ConfidenceStop | PredictedStop | None = None) -> None:
        super().__init__(model, target_vocab_size)
        check_shape_law(shape, law)
        self.tree_shape = shape
        self.draft_law = law
        self.stop = stopping_rule(min_confidence, stop)

    @property
    def min_confidence(self) -> float:
        """The confidence threshold of a :class:`~treespec.drafting.stopping.ConfidenceStop` (0: none)."""
        return self.stop.min_confidence if isinstance(self.stop, ConfidenceStop) else 0.0

    def law(self, sampling: SamplingConfig) -> str:
        return "deterministic" if sampling.greedy else self.draft_law

    def propose(self, state: DraftState, sampling: SamplingConfig, generator: torch.Generator | None) -> Draft:
        law = self.law(sampling)
        shape = self.tree_shape.truncate(max(state.max_depth, 0))
        kids_of, stop = shape.children, self.stop
        device = self.runner.device
        self.draft_forwards = 0
        chain = self._pending_chain(state)
        parents, tokens, template = [-1], [state.tokens[-1]], [0]
        rows: list[torch.Tensor] = []  # q rows of expanded nodes, in node order
        expanded: list[int] = []
        # [nodes] the predicted chance that a node's whole path is accepted (rules that track one)
        tracks = stop is not None and stop.tracks_path
        path_accept = torch.ones(shape.num_drafted + 1, device=device) if tracks else None
        frontier = [0]
        while True:
            expand = [i for i in frontier if kids_of[template[i]]]
            if not expand:
                break
            tree = TokenTree.from_lists(parents, tokens, law, device)
            counts = [len(kids_of[template[i]]) for i in expand]
            widest = max(counts)
            need_feature = stop is not None and stop.needs_feature
            draft = self._forward(tree, expand, chain, need_feature).at_least(widest)  # [M, Vs] (a subset for heads)
            chain = None
            counts = torch.tensor(counts, dtype=torch.long, device=device)
            if law == "deterministic":
                # max_children: the width is known on the host (draw_children would read it back)
                drafts = draw_children(draft.logits, counts, "deterministic", max_children=widest)  # top-k
                q = torch.softmax(draft.logits.float(), dim=-1) if stop is not None else None  # [M, Vs]
            else:
                q = logits_to_probs(draft.logits, sampling)  # [M, Vs]
                drafts = draw_children(q, counts, law, generator, max_children=widest)
                rows.append(draft.spread(q))  # [M, V] for the verifier
                expanded.extend(expand)
            decision = None
            if stop is not None:
                at = torch.tensor(expand, dtype=torch.long, device=device) if tracks else None
                decision = stop.decide(law == "deterministic", q, drafts.tokens, draft.feature,
                                       path_accept[at] if tracks else None, tree.depths[at] if tracks else None)
            toks, valid, keep, grow = _to_host(draft.token_ids(drafts.tokens), drafts.valid, decision)
            frontier, grown = [], []
            for r, node in enumerate(expand):
                for j, child_template in enumerate(kids_of[template[node]]):
                    if not valid[r][j] or not keep[r][j]:
                        # without replacement: q's support is exhausted; a deterministic child below the
                        # confidence: ranks come in falling probability, later ones are below it too
                        if valid[r][j] and law != "deterministic":
                            raise RuntimeError("a stopping rule dropped a sampled child: the children's law would "
                                               "no longer be the one the verifier assumes")
                        break
                    if grow[r][j]:  # a child that does not grow stays a leaf (a sampled child's law is intact)
                        frontier.append(len(tokens))
                        grown.append((len(tokens), r, j))
                    parents.append(node)
                    tokens.append(toks[r][j])
                    template.append(child_template)
            if tracks and grown:
                at_node, rs, js = torch.tensor(grown, dtype=torch.long, device=device).T  # one copy
                path_accept[at_node] = decision.path_accept[rs, js]
        self._flush_chain(chain)
        tree = TokenTree.from_lists(parents, tokens, law, device)
        self._runner_index = None  # the runner grew exactly this tree
        if law == "deterministic" or not rows:
            return Draft(tree)
        q_all = torch.cat(rows)
        draft_probs = q_all.new_zeros(tree.num_nodes, q_all.shape[1])
        draft_probs[torch.tensor(expanded, dtype=torch.long, device=device)] = q_all
        return Draft(tree, draft_probs)
