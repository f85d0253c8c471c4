"""An n-gram store that learns while serving: prompt lookup across requests.

:class:`OnlineNgramDrafter` keeps every prompt and every emitted token of every request it has served
(up to ``max_store_tokens``, oldest dropped first) in one token store, with a hash index from each
n-gram to the positions that followed it, updated token by token as tokens are committed. A step looks
up the longest suffix of the current sequence (``max_ngram`` down to ``min_ngram`` tokens) in the
index; the continuations that followed its most recent occurrences — in this request or in any
earlier one — become the branches of a trie. Repeated questions, boilerplate and code idioms seen in
earlier requests are drafted from the first step of a new request (the idea of online adaptation,
"Online Speculative Decoding", arXiv 2310.07177, applied to a model-free store).

The candidates are chosen from tokens committed before the step, never from the target's current
outputs, so they are deterministic candidates and verify losslessly like any n-gram draft. Costs:
O(max_ngram) dict updates per committed token and O(branches * depth) per lookup (host side).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..sampling import SamplingConfig
from ..verify import VerifyResult
from .base import Draft, DraftState, tree_device
from .ngram import NgramConfig, distinct, trie_tree

_SEP = -1  # separates requests in the store: no n-gram or continuation crosses it


def _until_sep(tokens: list[int]) -> list[int]:
    return tokens[:tokens.index(_SEP)] if _SEP in tokens else tokens


@dataclass(frozen=True)
class OnlineNgramConfig:
    """ngram: lookup settings (suffix lengths, depth, branches, node budget, adaptive depth).
    max_store_tokens: tokens kept across requests (the oldest half is dropped when it is exceeded)."""

    ngram: NgramConfig = field(default_factory=lambda: NgramConfig(depth=8, branches=1, adaptive=True))
    max_store_tokens: int = 1_000_000

    def __post_init__(self) -> None:
        if self.max_store_tokens < 64:
            raise ValueError(f"max_store_tokens must be >= 64, got {self.max_store_tokens}")


class OnlineNgramDrafter:
    """Prompt lookup over everything served so far (this request and earlier ones)."""

    reads_target_hidden = False

    def __init__(self, config: OnlineNgramConfig = OnlineNgramConfig(), device: torch.device | str | None = None) -> None:
        self.config = config
        self.device = device
        self.store: list[int] = []
        self.index: dict[tuple[int, ...], list[int]] = {}  # n-gram -> positions of the token after it
        self.requests = 0
        self._depth = config.ngram.start_depth
        self._proposed_depth = 0

    # ------------------------------------------------------------------ store
    def _append(self, tokens: list[int]) -> None:
        cfg = self.config.ngram
        store, index = self.store, self.index
        for tok in tokens:
            store.append(int(tok))
            end = len(store)  # the n-grams ending at the new token are followed by position `end`
            for n in range(cfg.min_ngram, cfg.max_ngram + 1):
                if end - n < 0:
                    break
                gram = tuple(store[end - n:end])
                if _SEP in gram:
                    break
                index.setdefault(gram, []).append(end)
        if len(store) > self.config.max_store_tokens:
            self._shrink()

    def _shrink(self) -> None:
        keep = self.store[len(self.store) // 2:]
        self.store, self.index = [], {}
        self._append([_SEP, *keep])

    def _lookup(self, tokens: list[int], depth: int) -> list[list[int]]:
        cfg = self.config.ngram
        store = self.store
        for n in range(min(cfg.max_ngram, len(tokens)), cfg.min_ngram - 1, -1):
            positions = self.index.get(tuple(tokens[-n:]))
            if not positions:
                continue
            conts = distinct((_until_sep(store[pos:pos + depth]) for pos in reversed(positions)),  # most recent first
                             cfg.branches)
            if conts:
                return conts
        return []

    # ------------------------------------------------------------------ protocol
    def law(self, sampling: SamplingConfig) -> str:
        return "deterministic"

    def begin(self, prompt_ids: list[int]) -> None:
        self.requests += 1
        self._append([_SEP, *prompt_ids])
        self._depth = min(self.config.ngram.start_depth, self.config.ngram.depth) if self.config.ngram.adaptive \
            else self.config.ngram.depth
        self._proposed_depth = 0

    def propose(self, state: DraftState, sampling: SamplingConfig, generator: torch.Generator | None) -> Draft:
        depth = min(self._depth, state.max_depth)
        branches = self._lookup(state.tokens, depth) if depth > 0 else []
        self._proposed_depth = max((len(b) for b in branches), default=0)
        return Draft(trie_tree(state.tokens[-1], branches, self.config.ngram.max_nodes, tree_device(state, self.device)))

    def accept(self, result: VerifyResult, emitted: list[int]) -> None:
        self._append(emitted)  # the store learns every committed token
        if not self.config.ngram.adaptive or self._proposed_depth == 0:
            return
        if result.is_bonus:
            self._depth = min(self._depth + 2, self.config.ngram.depth)
        else:
            self._depth = max(self._depth - 1, 1)
