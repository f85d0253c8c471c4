"""The drafter interface.

A drafter proposes one token tree per step from what it is told about the committed sequence;
the engine verifies it and tells the drafter what was accepted. Three kinds plug in:

* model drafters (a small causal LM with its own KV cache and tree mask);
* drafters that read the target's hidden states from the last verify pass (EAGLE / Medusa-style
  heads): :class:`DraftState` carries them;
* model-free drafters (n-gram / prompt lookup), which ignore everything but the tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from ..models.runner import TargetView
from ..sampling import SamplingConfig
from ..tree import TokenTree
from ..verify import VerifyResult


@dataclass(frozen=True)
class Draft:
    """A proposed tree and the draft distribution each node's children were drawn from.

    ``draft_probs`` ``[num_nodes, vocab]`` (row i: q at node i; rows of leaves unused) may be None
    for laws that verify without q (``"deterministic"``).
    """

    tree: TokenTree
    draft_probs: torch.Tensor | None = None


@dataclass(frozen=True)
class DraftState:
    """What a drafter may look at when proposing.

    tokens : the committed sequence; its last token is the root of the tree to propose.
    max_depth : the deepest the tree may go this step (generation ends within it).
    target_hidden : ``[num_new, H]`` the target's last hidden states at the positions committed by
        the previous step (root and accepted nodes), in order; on the first step the prefill's
        (positions 0 .. len(prompt) - 2), or None for a one-token prompt. The last row always
        predicts the current root token. For a drafter that asks for more target layers
        (:func:`feature_layers`), ``[num_new, (k + 1) * H]``: those layers' outputs, then the last
        hidden state (:mod:`treespec.models.features`).
    target_runner : the engine's target runner (a :class:`~treespec.models.runner.TargetView`: a
        :class:`~treespec.models.runner.ModelRunner` or another target runner), holding exactly the
        committed prefix (all but the root); read-only for drafters (an early-exit draft reads its
        layers' keys/values from a ``ModelRunner``), or None.
    """

    tokens: list[int]
    max_depth: int
    target_hidden: torch.Tensor | None = None
    target_runner: TargetView | None = None


def tree_device(state: DraftState, device: torch.device | str | None) -> torch.device:
    """Where a drafter without a model of its own builds its tree: ``device`` when given, else the target
    runner's device (the CPU without one)."""
    if device is not None:
        return torch.device(device)
    runner = state.target_runner
    return runner.device if runner is not None else torch.device("cpu")


@runtime_checkable
class Drafter(Protocol):
    """Protocol every drafter follows."""

    #: draft law of the trees it proposes under the sampling config it was last given
    def law(self, sampling: SamplingConfig) -> str: ...

    def begin(self, prompt_ids: list[int]) -> None:
        """Start a new sequence (reset caches, index the prompt)."""

    def propose(self, state: DraftState, sampling: SamplingConfig,
                generator: torch.Generator | None) -> Draft:
        """Grow a tree rooted at ``state.tokens[-1]``."""

    def accept(self, result: VerifyResult, emitted: list[int]) -> None:
        """Learn what the target accepted (``emitted`` = tokens actually appended)."""


def reads_target_hidden(drafter) -> bool:
    """Whether ``drafter`` reads :attr:`DraftState.target_hidden` (its optional ``reads_target_hidden``
    attribute; True when it does not say). The engine asks a target for hidden states only for such a
    drafter (on a llama.cpp target every prefill row with a hidden state also pays its LM head)."""
    return bool(getattr(drafter, "reads_target_hidden", True))


def feature_layers(drafter) -> tuple[int, ...]:
    """The target layers a drafter reads besides the last hidden state (its optional
    ``feature_layers`` attribute; ``()`` for drafters that read the last hidden state or nothing)."""
    return tuple(getattr(drafter, "feature_layers", ()))


def shared_feature_layers(drafters) -> tuple[int, ...]:
    """The one ``feature_layers`` of several drafters composed into one (a ``ValueError`` when two
    ask for different layers: the engine hands every drafter the same target features; a drafter
    reading the last hidden state alone takes it from the end of the wider features)."""
    wanted = {feature_layers(d) for d in drafters} - {()}
    if len(wanted) > 1:
        raise ValueError(f"drafters read different target layers {sorted(wanted)}; compose drafters that agree")
    return wanted.pop() if wanted else ()


class NoDrafter:
    """Proposes the root alone: the engine then decodes one token per target pass (plain decoding)."""

    reads_target_hidden = False

    def law(self, sampling: SamplingConfig) -> str:
        return "deterministic"

    def begin(self, prompt_ids: list[int]) -> None:
        pass

    def propose(self, state: DraftState, sampling: SamplingConfig, generator: torch.Generator | None) -> Draft:
        return Draft(TokenTree.chain(state.tokens[-1], [], device=tree_device(state, None)))

    def accept(self, result: VerifyResult, emitted: list[int]) -> None:
        pass
