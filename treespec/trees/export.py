"""Static tree shapes as the speculative-decoding settings of two serving engines, vLLM and SGLang.

A :class:`~treespec.trees.shape.TreeShape` (or per-depth widths such as ``(4, 2, 1)``) becomes

* **vLLM**: the ``speculative_config`` keys ``speculative_token_tree``, ``num_speculative_tokens`` and
  ``method`` (:func:`vllm_export`). The tree is carried over exactly, for the shapes vLLM can draft;
* **SGLang**: ``speculative_num_steps``, ``speculative_eagle_topk`` and ``speculative_num_draft_tokens``
  (:func:`sglang_export`). SGLang has no static tree: the three numbers bound the tree it grows anew at every
  step, and only some shapes come out exactly (below).

Only the *shape* travels. Which tokens fill it (the engines take the draft's top-k) and how it is verified are
the engine's own; treespec's draft laws and verifiers stay in treespec.

Vocabulary: the root is the newest emitted token (not drafted); a node's *path* is the tuple of sibling ranks
from the root down to it (rank 0 = the draft's most likely child), as in :meth:`TreeShape.paths`.

vLLM's format, as read in vllm-project/vllm (2025-07 to 2026-05)
-----------------------------------------------------------------
* ``speculative_token_tree`` is a *string* holding a Python list literal of paths, one tuple per drafted node,
  the root left out: ``"[(0,), (1,), (0, 0), (1, 0)]"``. vLLM reads it with ``ast.literal_eval``;
  ``SpeculativeConfig`` re-sorts it by (path length, path), i.e. breadth-first and, within a depth, in path
  order, and the tree-attention backend then looks every path's prefixes up in that list, so every prefix
  must be listed (``vllm/config/speculative.py``, ``vllm/v1/attention/backends/tree_attn.py``). We write it
  already sorted, so the string vLLM keeps is the one written here.
* ``num_speculative_tokens`` = the number of drafted nodes (the list's length), not the depth: vLLM's own
  proposer test builds the tree config with ``num_speculative_tokens = len(tree)``
  (``tests/v1/spec_decode/test_eagle.py::test_propose_tree``).
* Drafting: the EAGLE proposer (``vllm/v1/spec_decode/eagle.py``; methods ``eagle`` and ``eagle3``) counts the
  nodes of each depth and gives *every* node of a depth (count at depth d) // (count at depth d - 1) children,
  the draft's top-k. So only trees where all nodes of a depth have the same number of children are drafted
  as written (the feature's author says so in a comment on vllm-project/flash-attention#81, 2025-09): per-depth
  widths trees like ``--tree 4,2,1``. Other shapes (most Sequoia trees) are refused here with the depth that
  breaks the rule, rather than exported into a tree vLLM would draft differently.
* The tree is used only with the ``TREE_ATTN`` attention backend; with another backend the EAGLE proposer
  drafts a chain.
* Versions: added by vllm-project/vllm#20401 ("Add tree attention backend for v1 (part 1)", merged July 2025)
  and removed by vllm-project/vllm#42121 ("[Attention][Cleanup] Remove tree attention", merged May 2026): the
  newest ``vllm/config/speculative.py`` read (commit 002e77c) has no ``speculative_token_tree`` field. Use a
  vLLM release from that window.

SGLang's EAGLE settings, as read in sgl-project/sglang and docs.sglang.io
------------------------------------------------------------------------
* The documentation (docs.sglang.io, "Speculative Decoding") calls ``speculative_num_steps`` the depth of the
  autoregressive drafting, ``speculative_eagle_topk`` the branching factor per step and
  ``speculative_num_draft_tokens`` the maximum number of tokens verified in parallel.
* How the tree grows (``python/sglang/srt/speculative/eagle_utils.py`` and the draft loop): step 1 takes the
  root's top-k children; every later step keeps the ``topk`` best nodes of the newest depth (by the product
  of draft probabilities along the path) and gives each its top-k children, so there are
  ``topk + (num_steps - 1) * topk**2`` candidates. ``organize_draft_results`` then keeps the best
  ``num_draft_tokens - 1`` candidates: **num_draft_tokens counts the root** (the last verified token) plus the
  drafted nodes. With ``topk == 1`` ``server_args.py`` resets ``num_draft_tokens`` to ``num_steps + 1``.
* Mapping of a static shape (:func:`sglang_export`):

  - ``speculative_num_steps`` = the shape's depth (exact: SGLang drafts no deeper);
  - ``speculative_num_draft_tokens`` = drafted nodes + 1 (exact: the same verify width, root included);
  - ``speculative_eagle_topk`` = the smallest top-k whose candidates contain the shape: at least the most
    children of any node *and* the most nodes with children at one depth (SGLang expands only ``topk`` nodes
    per depth). For ``4,2,1`` that is 8, not 4: eight depth-2 nodes have a child.

  SGLang verifies exactly this shape only when the candidates are exactly the shape (drafted nodes =
  ``topk + (num_steps - 1) * topk**2``): chains, one level of k, ``k,k`` trees. Otherwise
  (:attr:`EngineSettings.exact` False) it verifies a tree with the same depth bound and node count that it
  picks itself each step by draft scores; the static shape is one it *can* pick, not one it must.

What was checked here is the format, on a CPU (``tests/treespec/test_tree_export.py``); loading the settings
in vLLM or SGLang needs a GPU engine and was not done (docs/serving.md).
"""

from __future__ import annotations

import argparse
import ast
import json
import numbers
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ..files import atomic_write_text
from .shape import TreeShape

__all__ = [
    "EngineSettings", "as_shape", "token_tree_paths", "parse_token_tree", "shape_from_token_tree",
    "check_vllm_token_tree", "vllm_token_tree_paths", "vllm_token_tree", "vllm_export", "sglang_export",
    "sglang_settings", "serving_settings", "main",
]

PathTuple = tuple[int, ...]
VLLM_METHODS = ("eagle", "eagle3")


@dataclass(frozen=True)
class EngineSettings:
    """One engine's settings for a tree shape.

    ``settings``: for vLLM the ``speculative_config`` keys; for SGLang the server arguments by their Python
    names (``sglang.Engine(**settings)``; on the command line ``_`` becomes ``-``). ``exact``: the engine
    verifies exactly this shape at every step. ``note``: what is kept and what is not, in one paragraph.
    """

    engine: str
    settings: dict[str, object] = field(default_factory=dict)
    exact: bool = True
    note: str = ""

    def command_line(self) -> str:
        """The settings as command-line flags of ``vllm serve`` / ``python -m sglang.launch_server``."""
        if self.engine == "vllm":
            return f"--speculative-config '{json.dumps(self.settings)}'"
        return " ".join(f"--{key.replace('_', '-')} {value}" for key, value in self.settings.items())

    def to_dict(self) -> dict:
        return {"engine": self.engine, "settings": dict(self.settings), "exact": self.exact, "note": self.note}


# ---------------------------------------------------------------------- shapes in, paths out
def as_shape(tree: TreeShape | Sequence[int]) -> TreeShape:
    """``tree`` as a :class:`TreeShape`: a shape as it is, or per-depth widths (``(4, 2, 1)``: 4 children
    under the root, 2 under each of those, 1 under each of those; ``(4,)`` is one level of 4, not a chain).
    Raises ``ValueError`` for a tree with no drafted node or a width below 1."""
    if isinstance(tree, TreeShape):
        shape = tree
    elif isinstance(tree, (str, bytes)) or not isinstance(tree, Sequence):
        raise TypeError(f"expected a TreeShape or per-depth widths such as (4, 2, 1), got {tree!r}")
    else:
        if any(isinstance(w, bool) or not isinstance(w, numbers.Integral) for w in tree):
            raise ValueError(f"per-depth widths must be integers, got {tuple(tree)}")
        widths = tuple(int(w) for w in tree)
        if any(w < 1 for w in widths):
            raise ValueError(f"per-depth widths must be >= 1, got {widths}")
        shape = TreeShape.widths(widths)
    if shape.num_drafted == 0:
        raise ValueError("empty tree: the shape drafts no node, so there is nothing to export")
    return shape


def token_tree_paths(tree: TreeShape | Sequence[int]) -> list[PathTuple]:
    """Every drafted node's path, breadth-first then by path (the order vLLM sorts to), root left out."""
    return sorted((tuple(p) for p in as_shape(tree).paths()), key=lambda p: (len(p), p))


def _level_widths(shape: TreeShape) -> list[set[int]]:
    """Per depth 0 .. depth - 1, the set of child counts of its nodes."""
    levels: list[set[int]] = [set() for _ in range(shape.max_depth)]
    for depth, count in zip(shape.depths, shape.num_children):
        if depth < shape.max_depth:
            levels[depth].add(count)
    return levels


def _check_uniform_levels(shape: TreeShape) -> None:
    """vLLM's proposer gives every node of a depth the same number of children; refuse other shapes."""
    for depth, counts in enumerate(_level_widths(shape)):
        if len(counts) > 1:
            raise ValueError(
                f"vLLM drafts the same number of children under every node of a depth, but at depth {depth} "
                f"this shape has nodes with {sorted(counts)} children; only per-depth widths trees such as "
                f"4,2,1 export to vLLM (SGLang takes any shape, approximately)")


# ---------------------------------------------------------------------- the choice-list format
def _literal_paths(text: str | Sequence[Sequence[int]]) -> list[PathTuple]:
    """The list of paths in ``text`` (a string as vLLM stores it, or the list itself), types checked."""
    if isinstance(text, str):
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError) as err:
            raise ValueError(f"token tree is not a Python literal: {text[:60]!r} ({type(err).__name__})") from None
    else:
        value = text
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"token tree must be a list of paths, got {type(value).__name__}")
    paths = []
    for item in value:
        if not isinstance(item, (tuple, list)) or not item:
            raise ValueError(f"every path must be a non-empty tuple of sibling ranks, got {item!r}")
        if any(isinstance(r, bool) or not isinstance(r, int) or r < 0 for r in item):
            raise ValueError(f"sibling ranks must be integers >= 0, got {item!r}")
        paths.append(tuple(item))
    if not paths:
        raise ValueError("empty tree: the token tree lists no node")
    return paths


def parse_token_tree(text: str | Sequence[Sequence[int]]) -> list[PathTuple]:
    """Validate a choice-list token tree (any shape) and return its paths.

    Checks, each with its own message: a list of non-empty tuples of ranks >= 0; no path twice; breadth-first
    order (by length, then path: the order vLLM sorts to); every path's parent listed before it; sibling ranks
    contiguous from 0 under every parent.
    """
    paths = _literal_paths(text)
    seen: set[PathTuple] = set()
    for i, path in enumerate(paths):
        if path in seen:
            raise ValueError(f"path {path} is listed twice")
        if i > 0 and (len(paths[i - 1]), paths[i - 1]) > (len(path), path):
            raise ValueError(f"not breadth-first: {paths[i - 1]} is listed before {path} "
                             "(order by path length, then by path)")
        if len(path) > 1 and path[:-1] not in seen:
            raise ValueError(f"path {path} comes before its parent {path[:-1]}, or its parent is missing")
        if path[-1] > 0 and path[:-1] + (path[-1] - 1,) not in seen:
            raise ValueError(f"ranks not contiguous: {path} is listed without {path[:-1] + (path[-1] - 1,)} "
                             "(sibling ranks run 0, 1, ..., k-1)")
        seen.add(path)
    return paths


def shape_from_token_tree(text: str | Sequence[Sequence[int]]) -> TreeShape:
    """The :class:`TreeShape` a choice-list token tree describes (after :func:`parse_token_tree`)."""
    return TreeShape.from_paths(parse_token_tree(text))


def check_vllm_token_tree(text: str | Sequence[Sequence[int]]) -> list[PathTuple]:
    """:func:`parse_token_tree` plus vLLM's drafting rule (same child count for every node of a depth)."""
    paths = parse_token_tree(text)
    _check_uniform_levels(TreeShape.from_paths(paths))
    return paths


# ---------------------------------------------------------------------- vLLM
def vllm_token_tree_paths(tree: TreeShape | Sequence[int]) -> list[PathTuple]:
    """vLLM's ``speculative_token_tree`` as a list of paths; ``ValueError`` for a shape vLLM cannot draft."""
    shape = as_shape(tree)
    _check_uniform_levels(shape)
    return token_tree_paths(shape)


def vllm_token_tree(tree: TreeShape | Sequence[int]) -> str:
    """vLLM's ``speculative_token_tree`` string, e.g. ``"[(0,), (1,), (0, 0), (1, 0)]"`` for widths (2, 1)."""
    text = str(vllm_token_tree_paths(tree))
    check_vllm_token_tree(text)  # cheap: what we write must pass our own reader
    return text


def vllm_export(tree: TreeShape | Sequence[int], method: str = "eagle") -> EngineSettings:
    """vLLM ``speculative_config`` keys for ``tree`` (add the draft's ``"model"``); exact where it exports."""
    if method not in VLLM_METHODS:
        raise ValueError(f"vLLM drafts token trees with the EAGLE proposer: method must be one of "
                         f"{VLLM_METHODS}, got {method!r}")
    shape = as_shape(tree)
    text = vllm_token_tree(shape)
    settings = {"method": method, "num_speculative_tokens": shape.num_drafted, "speculative_token_tree": text}
    note = (f"exact: vLLM drafts and verifies this tree of {shape.num_drafted} drafted nodes, depth "
            f"{shape.max_depth}, at every step; add the draft's \"model\" and select the TREE_ATTN attention "
            "backend (with another backend vLLM drafts a chain); speculative_token_tree exists in vLLM from "
            "July 2025 (PR #20401) until its removal in May 2026 (PR #42121)")
    return EngineSettings("vllm", settings, True, note)


# ---------------------------------------------------------------------- SGLang
def _sglang_topk(shape: TreeShape) -> tuple[int, int, int]:
    """(topk, most children of one node, most nodes with children at one depth)."""
    max_children = max(shape.num_children)
    parents_per_depth = [0] * shape.max_depth
    for depth, count in zip(shape.depths, shape.num_children):
        if count:
            parents_per_depth[depth] += 1
    max_parents = max(parents_per_depth)
    return max(max_children, max_parents), max_children, max_parents


def sglang_export(tree: TreeShape | Sequence[int]) -> EngineSettings:
    """SGLang's three EAGLE settings for ``tree`` (see the module docstring for what they keep)."""
    shape = as_shape(tree)
    topk, max_children, max_parents = _sglang_topk(shape)
    steps, drafted = shape.max_depth, shape.num_drafted
    settings = {"speculative_num_steps": steps, "speculative_eagle_topk": topk,
                "speculative_num_draft_tokens": drafted + 1}
    candidates = topk + (steps - 1) * topk * topk
    # the candidates are the shape only when SGLang has no choice to make: a chain (topk 1), or depth <= 2, where
    # it expands every depth-1 node; deeper, it expands the best topk nodes of a depth by draft score, which vary
    exact = candidates == drafted and (topk == 1 or steps <= 2)
    if exact:
        note = (f"exact: SGLang's {candidates} candidates are this tree, so it verifies exactly this shape "
                "at every step")
    else:
        why = (f"{max_parents} nodes of one depth have children and SGLang expands only topk nodes per depth"
               if max_parents > max_children else f"a node has {max_children} children")
        note = (f"approximate: SGLang grows its own tree each step, keeping the best {drafted} of {candidates} "
                f"candidates by draft score; depth ({steps}) and node count ({drafted} drafted + the root = "
                f"{drafted + 1} verified) match, the shape is one SGLang can pick but not one it must; "
                f"topk is {topk} because {why}")
    return EngineSettings("sglang", settings, exact, note)


def sglang_settings(tree: TreeShape | Sequence[int]) -> dict[str, int]:
    """Just the three numbers of :func:`sglang_export` (read its ``exact`` and ``note`` before serving)."""
    return dict(sglang_export(tree).settings)  # type: ignore[arg-type]


def serving_settings(tree: TreeShape | Sequence[int], method: str = "eagle") -> dict:
    """Both engines' settings as JSON-ready data; where vLLM cannot draft the shape, ``{"refused": reason}``."""
    shape = as_shape(tree)
    try:
        vllm = vllm_export(shape, method).to_dict()
    except ValueError as err:
        vllm = {"engine": "vllm", "refused": str(err)}
    return {"shape": shape.to_dict(), "vllm": vllm, "sglang": sglang_export(shape).to_dict()}


# ---------------------------------------------------------------------- command line
PROG = "python -m treespec.trees.export"


class _Parser(argparse.ArgumentParser):
    """Bad arguments end the run with one line on stderr and exit status 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        print(f"{PROG}: error: {message}", file=sys.stderr)
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(prog=PROG, description="Write a static tree shape as vLLM or SGLang speculative-decoding "
                                        "settings (stdout, or --out FILE).")
    source = ap.add_mutually_exclusive_group(required=True)
    source.add_argument("--tree", help="per-depth widths as in `treespec generate --tree` (4,2,1; one number n: "
                                       "a chain of n)")
    source.add_argument("--shape", type=Path, help="a TreeShape JSON file ({\"parents\": ...}, \"paths\" or "
                                                   "\"widths\"), e.g. a Sequoia tree")
    ap.add_argument("--engine", required=True, choices=["vllm", "sglang"])
    ap.add_argument("--method", default="eagle", choices=list(VLLM_METHODS), help="vLLM's method (default eagle)")
    ap.add_argument("--json", action="store_true", help="engine, settings, exact and note as one JSON object")
    ap.add_argument("--out", type=Path, help="write here instead of stdout")
    return ap


def _tree_option(text: str) -> TreeShape:
    """``--tree`` as `treespec generate` reads it (treespec.drafters.tree_widths): one number n is a chain."""
    try:
        widths = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise ValueError(f"--tree: expected comma-separated integers such as 4,2,1, got {text!r}") from None
    if len(widths) == 1:
        if widths[0] < 0:
            raise ValueError(f"--tree: a chain length must be >= 0, got {widths[0]}")
        widths = (1,) * widths[0]
    return as_shape(widths)


def main(argv: list[str] | None = None) -> int:
    """Print (or write) one engine's settings; exit 2 with one line on stderr for bad input."""
    args = build_parser().parse_args(argv)
    try:
        shape = _tree_option(args.tree) if args.tree is not None else as_shape(TreeShape.load(args.shape))
        result = vllm_export(shape, args.method) if args.engine == "vllm" else sglang_export(shape)
        text = json.dumps(result.to_dict()) if args.json else result.command_line()
        if args.out is not None:
            atomic_write_text(args.out, text + "\n")
        else:
            print(text)
    except (ValueError, TypeError, OSError) as err:  # a shape file of the wrong form: TypeError
        message = str(err).splitlines()[0] if str(err) else type(err).__name__
        print(f"{PROG}: error: {message}", file=sys.stderr)
        return 2
    if not args.json and not result.exact:
        print(f"{PROG}: note: {result.note}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
