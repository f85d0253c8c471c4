"""Model-free drafting: prompt lookup / n-gram candidates offered as the branches of one tree.

At each step the longest suffix of the committed sequence (``max_ngram`` down to ``min_ngram``
tokens) is searched for earlier in the sequence (prompt and generated text alike); the tokens
that followed the most recent matches become candidate continuations, merged into a trie. The
candidates never look at the target, so they verify losslessly as deterministic candidates.

The search is a vectorised numpy scan over the sequence (O(length * n) per step, host side: the
tokens live on the host anyway). Trie building loops over at most ``branches * depth`` tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..sampling import SamplingConfig
from ..tree import TokenTree
from ..verify import VerifyResult
from .base import Draft, DraftState, tree_device


@dataclass(frozen=True)
class NgramConfig:
    """max_ngram / min_ngram: suffix lengths tried, longest first. depth: tokens per branch.
    branches: distinct continuations kept (most recent first). max_nodes: tree budget (root excluded).
    adaptive: the branch depth follows acceptance (+2 after a step that accepted every drafted
    token on its path, -1 otherwise, within [1, depth]), starting at ``start_depth``. The depth is
    fixed before each step's tree is built, from earlier steps only, so losslessness is untouched."""

    max_ngram: int = 4
    min_ngram: int = 1
    depth: int = 8
    branches: int = 4
    max_nodes: int = 32
    adaptive: bool = False
    start_depth: int = 4

    def __post_init__(self) -> None:
        if not (1 <= self.min_ngram <= self.max_ngram):
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {self.min_ngram}, {self.max_ngram}")
        if self.depth < 1 or self.branches < 1 or self.max_nodes < 1 or self.start_depth < 1:
            raise ValueError("depth, start_depth, branches and max_nodes must be >= 1")


def find_continuations(seq: np.ndarray, config: NgramConfig, depth: int) -> list[list[int]]:
    """Continuations (most recent match first, distinct) of the longest matching suffix n-gram."""
    length = seq.shape[0]
    for n in range(min(config.max_ngram, length - 1), config.min_ngram - 1, -1):
        tail = seq[length - n:]
        windows = np.lib.stride_tricks.sliding_window_view(seq[:length - 1], n)  # [length - n, n]
        starts = np.flatnonzero((windows == tail).all(axis=1))[::-1]  # most recent first
        conts = distinct(((seq[s + n: s + n + depth].tolist()) for s in starts), config.branches)
        if conts:
            return conts
    return []


def distinct(candidates, limit: int) -> list[list[int]]:
    """The first ``limit`` distinct non-empty token lists of ``candidates`` (an iterable), in order."""
    out: list[list[int]] = []
    seen: set[tuple[int, ...]] = set()
    for cont in candidates:
        key = tuple(cont)
        if cont and key not in seen:
            seen.add(key)
            out.append(cont)
            if len(out) == limit:
                break
    return out


def trie_tree(root: int, branches: list[list[int]], max_nodes: int,
              device: torch.device | str | None = None) -> TokenTree:
    """Merge token sequences into a trie rooted at ``root`` (shared prefixes share nodes)."""
    parents, tokens = [-1], [root]
    index: dict[tuple[int, int], int] = {}
    for branch in branches:
        node = 0
        for tok in branch:
            child = index.get((node, tok))
            if child is None:
                if len(tokens) - 1 >= max_nodes:
                    break
                child = len(tokens)
                index[(node, tok)] = child
                parents.append(node)
                tokens.append(tok)
            node = child
    return TokenTree.from_lists(parents, tokens, "deterministic", device)


class NgramDrafter:
    """Prompt-lookup drafter (deterministic candidates)."""

    reads_target_hidden = False

    def __init__(self, config: NgramConfig = NgramConfig(), device: torch.device | str | None = None) -> None:
        self.config = config
        self.device = device
        self.begin([])

    def law(self, sampling: SamplingConfig) -> str:
        return "deterministic"

    def begin(self, prompt_ids: list[int]) -> None:
        self.depth = min(self.config.start_depth, self.config.depth) if self.config.adaptive else self.config.depth
        self._proposed_depth = 0

    def propose(self, state: DraftState, sampling: SamplingConfig, generator: torch.Generator | None) -> Draft:
        depth = min(self.depth, state.max_depth)
        branches = find_continuations(np.asarray(state.tokens), self.config, depth) if depth > 0 else []
        tree = trie_tree(state.tokens[-1], branches, self.config.max_nodes, tree_device(state, self.device))
        self._proposed_depth = max((len(b) for b in branches), default=0)
        return Draft(tree)

    def accept(self, result: VerifyResult, emitted: list[int]) -> None:
        if not self.config.adaptive or self._proposed_depth == 0:
            return  # no candidates: nothing learnt about the depth
        if result.is_bonus:  # the whole path down to a leaf was accepted
            self.depth = min(self.depth + 2, self.config.depth)
        else:
            self.depth = max(self.depth - 1, 1)
