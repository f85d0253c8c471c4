"""Draft-tree builders: static shapes (chains, k-ary, per-depth widths, Medusa index paths,
SpecTr independent chains), Sequoia's optimal shapes, DySpec's dynamic trees, EAGLE-2-style
reranked trees and n-gram + model merged trees.

Modules (one job each): :mod:`.shape` (the TreeShape value and its JSON form), :mod:`.grow`
(a draft model growing any shape), :mod:`.sequoia` (acceptance vector, DP, brute force,
hardware-aware budget choice), :mod:`.dyspec` (dynamic heap / threshold trees), :mod:`.eagle2`
(expand top-k, rerank), :mod:`.merged` (n-gram trie + model tree), :mod:`.export` (a static shape as vLLM /
SGLang settings; not imported here, so ``python -m treespec.trees.export`` runs it as a script).
"""

from .shape import TreeShape
from .grow import ShapeDrafter

__all__ = ["TreeShape", "ShapeDrafter"]
