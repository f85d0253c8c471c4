"""Builders under test (shared by the test_trees_* modules), and the random trees the runner tests feed."""

import torch

from treespec.drafting.ngram import NgramConfig
from treespec.trees.dyspec import DySpecDrafter
from treespec.trees.eagle2 import Eagle2Drafter
from treespec.trees.grow import ShapeDrafter
from treespec.trees.merged import MergedDrafter
from treespec.trees.sequoia import SequoiaDP
from treespec.trees.shape import TreeShape
from treespec.tree import TokenTree

MEDUSA = TreeShape.from_paths([[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 1, 0]])
SEQUOIA = SequoiaDP([0.55, 0.2, 0.1], 8, 4).shape(8, 4)
SHAPES = {
    "chain3": TreeShape.chain(3),
    "kary2x2": TreeShape.kary(2, 2),
    "widths321": TreeShape.widths((3, 2, 1)),
    "medusa": MEDUSA,
    "spectr3x2": TreeShape.independent_chains(3, 2),
    "sequoia": SEQUOIA,
}

#: builder name -> (model, sampling-law) -> drafter. Budgets ~8 nodes.
BUILDERS = {
    **{f"shape_{k}": (lambda s: lambda m, law="without_replacement": ShapeDrafter(m, s, law))(s)
       for k, s in SHAPES.items()},
    "dyspec_heap": lambda m, law="without_replacement": DySpecDrafter(m, 8, 4, law=law),
    "dyspec_threshold": lambda m, law="without_replacement": DySpecDrafter(m, 8, 4, variant="threshold",
                                                                          threshold=0.01, law=law),
    "eagle2": lambda m, law="deterministic": Eagle2Drafter(m, 8, top_k=3, depth=4),
    "merged": lambda m, law="deterministic": MergedDrafter(Eagle2Drafter(m, 6, top_k=2, depth=3),
                                                          NgramConfig(depth=4, branches=2, max_nodes=6)),
    "merged_shape": lambda m, law="deterministic": MergedDrafter(ShapeDrafter(m, MEDUSA, "deterministic"),
                                                                NgramConfig(depth=4, branches=2, max_nodes=6)),
}


def random_tree(num_nodes: int, root: int, vocab: int, gen: torch.Generator,
                device: torch.device | str | None = None) -> TokenTree:
    """A random token tree of ``num_nodes`` nodes (each node's parent drawn among the earlier ones) under ``root``,
    on ``device``."""
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, num_nodes)]
    tokens = [root] + torch.randint(0, vocab, (num_nodes - 1,), generator=gen).tolist()
    return TokenTree.from_lists(parents, tokens, device=device)
