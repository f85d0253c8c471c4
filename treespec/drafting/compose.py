"""Composing drafters: the first one that has something to offer drafts the step.

``FirstOf(NgramDrafter(...), ShapeDrafter(head, ...))`` is prompt lookup first and a trained head
where lookup finds nothing (the CLI's ``--draft lookup+head``): n-gram candidates are free to
draft and, when the context repeats itself, long and almost always right; a head costs a little
per token but drafts anywhere.

Every drafter after the one that drafted is still told about the step: it is asked for a tree of
depth 0 (so a draft cache that follows the committed sequence, e.g. a head fed the target's hidden
states, keeps up) and, like every drafter that did not draft, told that only its root was
accepted; the tokens the winner got accepted reach the others at the next proposal, as committed
tokens. Each proposed tree keeps its own draft law and the engine picks the matching verifier per
step, so every step is verified losslessly.
"""

from __future__ import annotations

import dataclasses

import torch

from ..sampling import SamplingConfig
from ..verify import VerifyResult
from .base import Draft, Drafter, DraftState, reads_target_hidden, shared_feature_layers


class FirstOf:
    """Asks ``drafters`` in order; the first tree with more than the root is proposed (else the last's).

    Attributes
    ----------
    counts : list[int]
        Trees proposed by each drafter since :meth:`begin`, in the order of ``drafters``.
    last : int | None
        Index of the drafter that proposed the current tree.
    """

    def __init__(self, *drafters: Drafter) -> None:
        if len(drafters) < 2:
            raise ValueError("FirstOf composes at least two drafters")
        self.drafters = drafters
        self.feature_layers = shared_feature_layers(drafters)  # the target layers its heads read
        self.reads_target_hidden = any(reads_target_hidden(d) for d in drafters)
        self.begin([])

    def law(self, sampling: SamplingConfig) -> str:
        # the law of the fallback; each proposed tree carries its own law (the engine follows it)
        return self.drafters[-1].law(sampling)

    def begin(self, prompt_ids: list[int]) -> None:
        for drafter in self.drafters:
            drafter.begin(prompt_ids)
        self.counts = [0] * len(self.drafters)
        self.last: int | None = None

    def propose(self, state: DraftState, sampling: SamplingConfig, generator: torch.Generator | None) -> Draft:
        for i, drafter in enumerate(self.drafters):
            draft = drafter.propose(state, sampling, generator)
            if draft.tree.num_nodes > 1:
                break
        self.last = i
        self.counts[i] += 1
        follow = dataclasses.replace(state, max_depth=0)  # consume the step, draft nothing
        for drafter in self.drafters[i + 1:]:
            drafter.propose(follow, sampling, generator)
        return draft

    def accept(self, result: VerifyResult, emitted: list[int]) -> None:
        root_only = VerifyResult([], [], emitted[0], True)  # what the others' root-only trees got
        for i, drafter in enumerate(self.drafters):
            drafter.accept(result if i == self.last else root_only, emitted)
