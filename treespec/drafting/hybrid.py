"""Prompt lookup first, a trained head where lookup has nothing to offer.

N-gram (prompt-lookup) candidates are free to draft and, when the context repeats itself, long and
almost always right; a draft head costs a little per token but drafts anywhere. This drafter
proposes the n-gram tree when the context holds a match for the current suffix, and the head's
tree otherwise. The head is fed the target's hidden states of every committed token on every step
(also on n-gram steps), so its cache always continues the sequence.

Each proposed tree keeps its own draft law (n-gram: ``"deterministic"``; head: its shape's law,
``"deterministic"`` at temperature 0), and the engine picks the matching verifier per step, so
every step is verified losslessly.
"""

from __future__ import annotations

import torch

from ..sampling import SamplingConfig
from ..verify import VerifyResult
from .base import Draft, Drafter, DraftState
from .ngram import NgramDrafter


class LookupHeadDrafter:
    """:class:`NgramDrafter` when it finds candidates, else a head drafter."""

    def __init__(self, ngram: NgramDrafter, head: Drafter) -> None:
        self.ngram = ngram
        self.head = head
        self.begin([])

    def law(self, sampling: SamplingConfig) -> str:
        # the first trees come from the head until the context repeats; each tree carries its own law
        return self.head.law(sampling)

    def begin(self, prompt_ids: list[int]) -> None:
        self.ngram.begin(prompt_ids)
        self.head.begin(prompt_ids)
        self.last = "none"  # which part proposed the current tree
        self.counts = {"ngram": 0, "head": 0}

    def propose(self, state: DraftState, sampling: SamplingConfig, generator: torch.Generator | None) -> Draft:
        lookup = self.ngram.propose(state, sampling, generator)
        if lookup.tree.num_nodes > 1:
            # the head still consumes the new hidden states (its cache must continue the sequence),
            # but drafts nothing (max_depth 0)
            self.head.propose(DraftState(state.tokens, 0, state.target_hidden), sampling, generator)
            self.last = "ngram"
            self.counts["ngram"] += 1
            return lookup
        self.last = "head"
        self.counts["head"] += 1
        return self.head.propose(state, sampling, generator)

    def accept(self, result: VerifyResult, emitted: list[int]) -> None:
        if self.last == "ngram":
            self.ngram.accept(result, emitted)
        self.head.accept(result, emitted)
