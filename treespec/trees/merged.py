"""Model-free + model drafts: an n-gram (prompt-lookup) trie merged into a model-drafted tree.

Both parts are *deterministic candidates* (chosen without looking at the target), so their union
is too and verifies losslessly with the ``deterministic`` verifier (greedy at temperature 0); no
draft distribution is needed. The model tree keeps its node indices (its drafter's cache commit
keeps working); n-gram continuations are inserted as a trie hanging from it: a branch follows
existing nodes while their tokens match and appends new nodes (at most ``ngram.max_nodes``).
Model drafters must propose law "deterministic" (e.g. :class:`~treespec.trees.eagle2.Eagle2Drafter`,
or a shape drafter with law "deterministic").
"""

from __future__ import annotations

import numpy as np
import torch

from ..drafting.base import Draft, Drafter, DraftState, feature_layers
from ..drafting.ngram import NgramConfig, find_continuations
from ..sampling import SamplingConfig
from ..tree import TokenTree
from ..verify import VerifyResult


def merge_branches(tree: TokenTree, branches: list[list[int]], max_new: int) -> TokenTree:
    """``tree`` plus token sequences from its root as a trie (new nodes appended, at most ``max_new``)."""
    parents, tokens = tree.parents.tolist(), tree.tokens.tolist()
    index = {(parents[i], tokens[i]): i for i in range(1, len(tokens))}
    added = 0
    for branch in branches:
        node = 0
        for tok in branch:
            child = index.get((node, tok))
            if child is None:
                if added >= max_new:
                    break
                child = len(tokens)
                index[(node, tok)] = child
                parents.append(node)
                tokens.append(tok)
                added += 1
            node = child
    return TokenTree.from_lists(parents, tokens, "deterministic", tree.device)


class MergedDrafter:
    """The union of a model drafter's deterministic tree and prompt-lookup n-gram candidates."""

    def __init__(self, model_drafter: Drafter, ngram: NgramConfig = NgramConfig()) -> None:
        self.model = model_drafter
        self.ngram = ngram
        self.feature_layers = feature_layers(model_drafter)  # the target layers its head reads

    def law(self, sampling: SamplingConfig) -> str:
        law = self.model.law(sampling)
        if law != "deterministic":
            raise ValueError(f"MergedDrafter needs a model drafter of law 'deterministic', got {law!r}")
        return "deterministic"

    def begin(self, prompt_ids: list[int]) -> None:
        self.model.begin(prompt_ids)

    def propose(self, state: DraftState, sampling: SamplingConfig, generator: torch.Generator | None) -> Draft:
        self.law(sampling)
        draft = self.model.propose(state, sampling, generator)
        depth = min(self.ngram.depth, state.max_depth)
        branches = find_continuations(np.asarray(state.tokens), self.ngram, depth) if depth > 0 else []
        return Draft(merge_branches(draft.tree, branches, self.ngram.max_nodes))

    def accept(self, result: VerifyResult, emitted: list[int]) -> None:
        # n-gram nodes have indices past the model tree: the model drafter skips them when committing
        self.model.accept(result, emitted)
