"""Plumbing shared by the model-drafting tree builders: the draft's runner, vocabulary padding,
and committing the accepted path to the draft's KV cache.

A builder may hand the target a tree whose node indices differ from the tree the draft runner
grew (EAGLE-2 reranks; :class:`~treespec.trees.merged.MergedDrafter` appends n-gram nodes), so each
proposal records, for every node of the proposed tree, the runner's node index (or nothing).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..drafting.base import DraftState
from ..models.compat import check_draft_vocab
from ..models.runner import DraftRunner, ModelRunner, as_runner
from ..verify import VerifyResult


@dataclass(frozen=True)
class DraftLogits:
    """Draft logits of some tree nodes, over the draft's own vocabulary.

    ``logits`` ``[M, Vs]`` cover the whole target vocabulary (``vocab_ids`` None, ``Vs = V``) or a
    sorted subset of it (``vocab_ids`` ``[Vs]``: a head that scores only its subset; its probability
    is exactly 0 elsewhere). Builders select and draw on the ``Vs`` columns (ids ascend, so ties
    broken by column are broken by token id, as on the full vocabulary) and map columns to token
    ids with :meth:`token_ids`; only the q rows handed to the verifier are spread to the full
    vocabulary, once per proposal (:meth:`spread`).
    """

    logits: torch.Tensor  # [M, Vs]
    vocab_ids: torch.Tensor | None  # [Vs] ascending target ids, or None
    vocab_size: int  # V, the target's
    feature: torch.Tensor | None = None  # [M, H] the draft's output feature behind each row, where asked for

    def token_ids(self, columns: torch.Tensor) -> torch.Tensor:
        """Column indices ``[...]`` -> target token ids (negative entries stay as they are)."""
        if self.vocab_ids is None:
            return columns
        return torch.where(columns >= 0, self.vocab_ids[columns.clamp(min=0)], columns)

    def spread(self, rows: torch.Tensor) -> torch.Tensor:
        """Probability rows ``[N, Vs]`` over these columns -> ``[N, V]`` (zeros outside the subset)."""
        if self.vocab_ids is None:
            return rows
        full = rows.new_zeros(rows.shape[0], self.vocab_size)
        return full.index_copy_(1, self.vocab_ids, rows)

    def at_least(self, columns: int) -> "DraftLogits":
        """This, or the full-vocabulary version when the subset has fewer than ``columns`` tokens
        (a law drawing that many distinct children needs them)."""
        if self.vocab_ids is None or self.logits.shape[-1] >= columns:
            return self
        full = self.logits.new_full((self.logits.shape[0], self.vocab_size), float("-inf"))
        return DraftLogits(full.index_copy_(1, self.vocab_ids, self.logits), None, self.vocab_size, self.feature)


class RunnerDrafter:
    """Base of the model drafters in :mod:`treespec.trees`: holds the draft's runner.

    ``model`` is anything :func:`~treespec.models.runner.as_runner` turns into a runner: a causal
    LM (or its runner), an early-exit model, an attached EAGLE-style head or Medusa heads.
    """

    def __init__(self, model, target_vocab_size: int | None = None) -> None:
        self.runner: DraftRunner = as_runner(model)
        self.vocab_size = target_vocab_size or self.runner.vocab_size
        if self.runner.model is not None:  # a causal LM
            check_draft_vocab(self.vocab_size, self.runner.model.get_input_embeddings().weight.shape[0],
                              self.runner.vocab_size)
        elif self.vocab_size != self.runner.vocab_size:
            raise ValueError(f"draft head built for a {self.runner.vocab_size}-token vocabulary, target has "
                             f"{self.vocab_size}")
        #: target layers the runner reads besides the last hidden state (a head with fused features)
        self.feature_layers: tuple[int, ...] = tuple(getattr(self.runner, "feature_layers", ()))
        # proposed node index -> runner node index (identity when the runner's tree is the proposal)
        self._runner_index: list[int] | None = None
        self.draft_forwards = 0  # draft forward passes in the last proposal (cost accounting)

    def begin(self, prompt_ids: list[int]) -> None:
        self.runner.reset()

    def _pad(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft logits ``[M, Vd]`` -> ``[M, V]``: a smaller draft vocabulary gets logit -inf
        (probability 0) on the target's extra tokens."""
        extra = self.vocab_size - logits.shape[-1]
        if extra == 0:
            return logits
        return torch.nn.functional.pad(logits, (0, extra), value=float("-inf"))

    def _pending_chain(self, state: DraftState) -> torch.Tensor | None:
        """Committed tokens the draft cache has not seen yet (fed with the first forward).

        Called once at the start of every proposal; a runner that drafts from the target's hidden
        states (:class:`~treespec.drafting.head_runner.HeadRunner`) takes them here."""
        self.runner.observe(state)
        committed = state.tokens[:-1]
        if len(committed) <= self.runner.length:
            return None
        return torch.tensor(committed[self.runner.length:], dtype=torch.long, device=self.runner.device)

    def _flush_chain(self, chain: torch.Tensor | None) -> None:
        """Feed a pending chain when no tree forward will carry it (depth-0 proposals)."""
        if chain is not None and chain.numel():
            self.runner.forward(None, None, chain, need_logits=False)

    def _forward(self, tree, nodes: list[int], chain: torch.Tensor | None, need_feature: bool = False
                 ) -> DraftLogits:
        """Draft logits of tree ``nodes`` (``len(nodes)`` rows): on the runner's vocabulary subset when
        it scores one (``need_logits="subset"``), else on the full vocabulary (padded); with
        ``need_feature``, also the draft's output feature of each node (``need_hidden``)."""
        idx = torch.tensor(nodes, dtype=torch.long, device=self.runner.device)
        m = 0 if chain is None else chain.numel()
        asks = {"need_hidden": True} if need_feature else {}
        if m and isinstance(self.runner, ModelRunner):  # a causal LM: no LM-head rows for the chain (a long prompt)
            rows = torch.arange(m, m + len(nodes), device=self.runner.device)
            out = self.runner.forward(tree, idx, chain, need_logits="subset", rows=rows, **asks)
        else:
            out = self.runner.forward(tree, idx, chain, need_logits="subset", **asks)
        self.draft_forwards += 1
        logits = out["logits"][-len(nodes):]
        ids = out.get("vocab_ids")
        feature = out["hidden"][-len(nodes):] if need_feature else None
        return DraftLogits(self._pad(logits) if ids is None else logits, ids, self.vocab_size, feature)

    def accept(self, result: VerifyResult, emitted: list[int]) -> None:
        accepted = result.accepted_nodes[: max(len(emitted) - 1, 0)]
        mapping = self._runner_index
        if mapping is None:
            nodes = accepted
        else:
            nodes = [mapping[i] for i in accepted if i < len(mapping) and mapping[i] >= 0]
        self.runner.commit([0, *nodes])
