"""Judge decoding's verifier, temperature 0: LOSSY by design.

A drafted token is accepted when it is the target's greedy choice (as with :func:`verify_tree_greedy`), or
else when a trained judge accepts it: its logit is above ``threshold``. Among several judged children of one
node the one with the highest judge logit is followed. The output then no longer follows the target's
distribution: it is greedy decoding of the target with some tokens replaced by drafts the judge found
acceptable ("Judge Decoding: Faster Speculative Sampling Requires Going Beyond Model Alignment", Bachmann et
al., arXiv 2501.19309). The token after the accepted path is the target's greedy token there, as in greedy
verification. With no judged node (every judge logit at or below ``threshold``) this is greedy verification.

It is not in :data:`treespec.verify.VERIFIERS`, whose members are lossless: the generate loop calls it when
a :class:`~treespec.generate.GenerationConfig` names a judge.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..sampling import first_argmax
from ..tree import TokenTree
from .core import VerifyResult, _result, _walk, at, check_inputs


@dataclass(frozen=True)
class JudgedResult(VerifyResult):
    """A :class:`VerifyResult` whose path may hold tokens the target would not have chosen: ``judged_nodes``
    (in path order), accepted by the judge alone."""

    judged_nodes: list[int]


def verify_judge(tree: TokenTree, target_scores: torch.Tensor, judge_logits: torch.Tensor,
                 threshold: float, best: torch.Tensor | None = None) -> JudgedResult:
    """The accepted path under judge decoding (temperature 0, lossy).

    target_scores ``[num_nodes, V]``: the target's logits (or probabilities) after every node, leaves
    included (a judged path may end at any node). judge_logits ``[num_nodes]``: the judge's logit for each
    node's own token (the root's is ignored). threshold: a node is judged acceptable when its logit is above it.
    best ``[num_nodes]``: each row's greedy token where the caller has it (``first_argmax(target_scores)``).
    """
    check_inputs(tree, target_scores, None, False, "judge")
    if target_scores.shape[0] != tree.num_nodes:
        raise ValueError(f"verifier 'judge' needs the target's row of every node ({tree.num_nodes}), got "
                         f"{target_scores.shape[0]}: a judged path may end at a leaf")
    if judge_logits.shape != (tree.num_nodes,):
        raise ValueError(f"judge_logits must be [num_nodes] = [{tree.num_nodes}], got {list(judge_logits.shape)}")
    best = first_argmax(target_scores) if best is None else best  # [n] the target's greedy token after each node
    kids = tree.children  # [n, K]
    valid = kids >= 0
    safe = kids.clamp(min=0)
    match = valid & (tree.tokens[safe] == best[:, None])  # [n, K] children the target would choose
    logit = judge_logits[safe].float()  # [n, K]
    judged = valid & (logit > threshold)  # [n, K] children the judge accepts
    # the target's choice first (its first such child); else the judged child with the highest logit
    own = match.to(torch.int8).argmax(dim=1)  # [n]
    top_judged = torch.where(judged, logit, torch.full_like(logit, float("-inf"))).argmax(dim=1)  # [n]
    pick = torch.where(match.any(dim=1), own, top_judged)[:, None]  # [n, 1]
    next_node = torch.where((match | judged).any(dim=1), kids.gather(1, pick).squeeze(1), torch.full_like(best, -1))
    cur = _walk(tree, next_node)
    base = _result(tree, cur, at(best, cur), at(tree.num_children, cur) == 0, torch.ones((), dtype=torch.bool))
    # a node on the path is judged when its token is not its parent's greedy token
    not_greedy = (tree.tokens != best.index_select(0, tree.parents.clamp(min=0))).tolist()  # [n]
    return JudgedResult(base.accepted_nodes, base.accepted_tokens, base.next_token, base.is_bonus,
                        [i for i in base.accepted_nodes if not_greedy[i]])


def verify_judge_reference(tree: TokenTree, target_scores: torch.Tensor, judge_logits: torch.Tensor,
                           threshold: float) -> JudgedResult:
    """:func:`verify_judge` written as the obvious loop from the root, for the tests."""
    best = [int(torch.argmax(row)) for row in target_scores]  # first maximum, as first_argmax
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    logit = judge_logits.tolist()
    node, path, judged = 0, [], []
    while True:
        kids = [c for c in range(1, tree.num_nodes) if parents[c] == node]
        own = [c for c in kids if tokens[c] == best[node]]
        if own:
            node = own[0]
        else:
            ok = [c for c in kids if logit[c] > threshold]
            if not ok:
                break
            node = max(ok, key=lambda c: (logit[c], -c))
            judged.append(node)
        path.append(node)
    leaf = not any(parents[c] == node for c in range(1, tree.num_nodes))
    return JudgedResult(path, [tokens[i] for i in path], best[node], leaf, judged)
