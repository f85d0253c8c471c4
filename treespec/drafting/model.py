"""Drafting static trees with a small causal LM that shares the target's tokenizer.

The tree grows one depth level per draft forward: the whole frontier is fed at once through the
draft's own KV cache with a tree mask, and every frontier node's children are drawn in one
vectorised call. Shapes: ``branching[d]`` children for each node at depth d (a chain of K is
``(1,) * K``; ``(k,) * d`` is a k-ary tree of depth d). The draft's cache keeps the committed
sequence; accepted nodes it already processed are kept by index selection, accepted leaves it
never saw are fed next step as a committed chain in the same forward as the new root.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..models.compat import check_draft_vocab
from ..models.runner import ModelRunner
from ..sampling import SamplingConfig, logits_to_probs
from ..tree import DRAFT_LAWS, TokenTree
from ..verify import VerifyResult
from .base import Draft, DraftState


@dataclass(frozen=True)
class StaticTreeShape:
    """Children per node at each depth, and how they are drawn.

    law : "iid" / "without_replacement" / "greedy_draft" / "spechub" sample from q (at T > 0);
        "deterministic" takes the top-k of the draft logits. At temperature 0 every law becomes
        "deterministic" top-k (the verifier is greedy and sampling from a one-hot is pointless).
    """

    branching: tuple[int, ...] = (1, 1, 1, 1)
    law: str = "iid"

    def __post_init__(self) -> None:
        if not self.branching or any((not isinstance(b, int)) or b < 1 for b in self.branching):
            raise ValueError(f"branching must be a non-empty tuple of positive ints, got {self.branching!r}")
        if self.law not in DRAFT_LAWS:
            raise ValueError(f"unknown draft law {self.law!r}; expected one of {DRAFT_LAWS}")
        if self.law == "spechub" and any(b != 2 for b in self.branching):
            raise ValueError("the spechub law drafts exactly two children per node")

    @classmethod
    def chain(cls, length: int, law: str = "iid") -> "StaticTreeShape":
        return cls((1,) * length, law)

    @property
    def num_nodes(self) -> int:
        total, level = 0, 1
        for b in self.branching:
            level *= b
            total += level
        return total


class ModelDrafter:
    """A draft causal LM growing a static tree shape, level by level."""

    def __init__(self, model, shape: StaticTreeShape = StaticTreeShape(), target_vocab_size: int | None = None) -> None:
        self.runner = model if isinstance(model, ModelRunner) else ModelRunner(model)
        self.shape = shape
        self.vocab_size = target_vocab_size or self.runner.vocab_size
        check_draft_vocab(self.vocab_size, self.runner.model.get_input_embeddings().weight.shape[0],
                          self.runner.vocab_size)
        self._seen = 0  # tokens of the sequence the draft cache holds (committed)

    def law(self, sampling: SamplingConfig) -> str:
        return "deterministic" if sampling.greedy else self.shape.law

    def begin(self, prompt_ids: list[int]) -> None:
        self.runner.reset()

    def _pad(self, x: torch.Tensor) -> torch.Tensor:
        """Draft rows ``[M, Vd]`` -> ``[M, V]`` (a smaller draft vocabulary has probability 0 elsewhere)."""
        extra = self.vocab_size - x.shape[-1]
        return x if extra == 0 else torch.nn.functional.pad(x, (0, extra), value=0.0)

    def propose(self, state: DraftState, sampling: SamplingConfig, generator: torch.Generator | None) -> Draft:
        from .laws import draw_children

        device = self.runner.device
        law = self.law(sampling)
        branching = self.shape.branching[: max(state.max_depth, 0)]
        committed = state.tokens[:-1]
        chain = torch.tensor(committed[self.runner.length:], dtype=torch.long, device=device)
        parents = torch.tensor([-1], dtype=torch.long, device=device)
        tokens = torch.tensor([state.tokens[-1]], dtype=torch.long, device=device)
        frontier = torch.zeros(1, dtype=torch.long, device=device)  # node indices of the newest level
        q_rows: list[torch.Tensor] = []
        for depth, k in enumerate(branching):
            tree = TokenTree(parents, tokens, law)
            out = self.runner.forward(tree, frontier, chain if depth == 0 and chain.numel() else None)
            logits = self._pad(out["logits"][-frontier.numel():])  # [M, V]
            chain = None
            if law == "deterministic":
                kids = torch.topk(logits, k, dim=-1).indices  # [M, k]
                q = None
            else:
                q = logits_to_probs(logits, sampling)  # [M, V]
                kids, valid = draw_children(q, k, law, generator)  # [M, k], [M, k]
            q_rows.append(q)
            start = tokens.numel()
            new_parents = frontier[:, None].expand(-1, k)  # [M, k]
            if law == "without_replacement":
                # a node whose q has fewer than k tokens gets fewer children (one host sync)
                new_parents, kids = new_parents[valid], kids[valid]
            parents = torch.cat([parents, new_parents.reshape(-1)])
            tokens = torch.cat([tokens, kids.reshape(-1)])
            frontier = torch.arange(start, tokens.numel(), device=device)
        tree = TokenTree(parents, tokens, law)
        if not branching:
            if chain is not None and chain.numel():
                self.runner.forward(None, None, chain, need_logits=False)
            return Draft(tree)
        draft_probs = None
        if law != "deterministic":
            # frontier levels occupy consecutive node indices from 0, so the rows stack in order
            internal = torch.cat(q_rows)  # [num_internal, V]
            leaves = internal.new_zeros(tree.num_nodes - internal.shape[0], internal.shape[1])
            draft_probs = torch.cat([internal, leaves])  # [num_nodes, V]
        return Draft(tree, draft_probs)

    def accept(self, result: VerifyResult, emitted: list[int]) -> None:
        self.runner.commit([0, *result.accepted_nodes[: max(len(emitted) - 1, 0)]])
