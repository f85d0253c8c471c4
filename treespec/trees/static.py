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

from ..tree import DRAFT_LAWS
from .grow import ShapeDrafter
from .shape import TreeShape


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


class ModelDrafter(ShapeDrafter):
    """A draft causal LM growing a static per-depth-width shape, level by level.

    A thin front of :class:`treespec.trees.grow.ShapeDrafter` (which grows any
    :class:`~treespec.trees.shape.TreeShape`): ``shape`` may also be a ``TreeShape``, then ``law``
    gives its draft law.
    """

    def __init__(self, model, shape: "StaticTreeShape | TreeShape" = StaticTreeShape(),
                 target_vocab_size: int | None = None, *, law: str = "iid") -> None:
        if isinstance(shape, StaticTreeShape):
            template, law = TreeShape.widths(shape.branching), shape.law
        else:
            template = shape
        super().__init__(model, template, law, target_vocab_size)
        self.shape = shape
