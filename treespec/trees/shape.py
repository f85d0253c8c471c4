"""Tree shapes: template trees that say how many children each drafted node gets.

A :class:`TreeShape` is a rooted *ordered* tree given by a parent array (node 0 = the root, i.e. the
newest emitted token; ``parents[i] < i``). The children of a node, in index order, are its
children's sibling ranks 0, 1, 2, ... (rank 0 = first drawn / most likely). A drafter growing the
shape gives each drafted node as many children as its template node has; the tokens come from the
draft. Shapes are stored in a canonical breadth-first order (by depth, then parent, then rank), so
each depth level is a contiguous block of indices and the shape grows level by level.

Constructors:

* :meth:`TreeShape.chain` K drafted tokens in a line (classic speculative decoding);
* :meth:`TreeShape.kary` a full k-ary tree of depth d;
* :meth:`TreeShape.widths` SpecInfer-style per-depth widths <k1..km>: every node at depth i has
  k_{i+1} children (SpecInfer, arXiv 2305.09781);
* :meth:`TreeShape.from_paths` an explicit list of index paths, Medusa-style (Medusa,
  arXiv 2401.10774): ``[[0], [1], [0, 0], [0, 1]]`` = the root's children of ranks 0 and 1, and
  two children under the rank-0 child. Every path's prefixes must be listed too (or are implied
  with ``fill=True``), and sibling ranks must be consecutive from 0;
* :meth:`TreeShape.independent_chains` k independent draft sequences of length L merged at the
  root (SpecTr, arXiv 2310.15141): the root has k children, each continuing a chain.

A shape is saved as JSON ``{"parents": [...], "name": ...}`` (:meth:`save` / :meth:`load`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from ..files import atomic_write_json


def _canonical(parents: list[int]) -> list[int]:
    """Reorder a parent array breadth-first (depth, then parent's new index, then old index)."""
    n = len(parents)
    children: list[list[int]] = [[] for _ in range(n)]
    for i in range(1, n):
        children[parents[i]].append(i)
    order, new_index, new_parents = [0], {0: 0}, [-1]
    head = 0
    while head < len(order):
        node = order[head]
        head += 1
        for child in children[node]:  # children in old index order = rank order
            new_index[child] = len(order)
            order.append(child)
            new_parents.append(new_index[node])
    return new_parents


@dataclass(frozen=True)
class TreeShape:
    """A template tree (parent array, node 0 = root) in canonical breadth-first order.

    ``parents`` may be given in any topological order (``parents[0] == -1``, ``parents[i] < i``);
    children keep their relative order (= sibling rank) and the array is re-ordered breadth-first.
    """

    parents: tuple[int, ...] = (-1,)
    name: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        parents = [int(p) for p in self.parents]
        if not parents or parents[0] != -1:
            raise ValueError("a tree shape needs its root: parents[0] must be -1")
        for i, p in enumerate(parents[1:], start=1):
            if not 0 <= p < i:
                raise ValueError(f"parents[{i}] = {p}: every non-root node needs a parent with a smaller index")
        object.__setattr__(self, "parents", tuple(_canonical(parents)))

    # ------------------------------------------------------------------ constructors
    @classmethod
    def chain(cls, length: int) -> "TreeShape":
        if length < 0:
            raise ValueError("chain length must be >= 0")
        return cls(tuple(range(-1, length)), f"chain{length}")

    @classmethod
    def widths(cls, widths: tuple[int, ...] | list[int]) -> "TreeShape":
        """Every node at depth i has ``widths[i]`` children (SpecInfer's <k1..km>)."""
        widths = tuple(int(w) for w in widths)
        if any(w < 1 for w in widths):
            raise ValueError(f"widths must be positive, got {widths}")
        parents, level = [-1], [0]
        for w in widths:
            nxt = []
            for node in level:
                for _ in range(w):
                    nxt.append(len(parents))
                    parents.append(node)
            level = nxt
        return cls(tuple(parents), "widths" + "-".join(map(str, widths)))

    @classmethod
    def kary(cls, k: int, depth: int) -> "TreeShape":
        shape = cls.widths((k,) * depth) if depth > 0 else cls()
        return cls(shape.parents, f"kary{k}x{depth}")

    @classmethod
    def independent_chains(cls, k: int, length: int) -> "TreeShape":
        """k draft sequences of ``length`` tokens each, merged at the root (SpecTr-style)."""
        if k < 1 or length < 1:
            raise ValueError("need k >= 1 chains of length >= 1")
        parents = [-1]
        for _ in range(k):
            prev = 0
            for _ in range(length):
                parents.append(prev)
                prev = len(parents) - 1
        return cls(tuple(parents), f"chains{k}x{length}")

    @classmethod
    def from_paths(cls, paths: list[list[int]] | list[tuple[int, ...]], *, fill: bool = False) -> "TreeShape":
        """Medusa-style index paths (sibling ranks from the root). ``fill`` adds missing prefixes
        and missing lower-ranked siblings instead of raising."""
        wanted = {tuple(int(r) for r in p) for p in paths if len(p) > 0}
        if any(r < 0 for p in wanted for r in p):
            raise ValueError("sibling ranks must be >= 0")
        closure = set(wanted)
        for p in wanted:
            for j in range(1, len(p) + 1):
                prefix = p[:j]
                closure.add(prefix)
                closure.update(prefix[:-1] + (r,) for r in range(prefix[-1]))
        if closure != wanted and not fill:
            missing = sorted(closure - wanted)[:5]
            raise ValueError(f"paths must be prefix-closed with consecutive sibling ranks; missing e.g. {missing}")
        ordered = sorted(closure, key=lambda p: (len(p), p))
        index = {(): 0}
        parents = [-1]
        for p in ordered:
            index[p] = len(parents)
            parents.append(index[p[:-1]])
        return cls(tuple(parents), "paths")

    # ------------------------------------------------------------------ structure
    @property
    def num_nodes(self) -> int:
        """Nodes including the root."""
        return len(self.parents)

    @property
    def num_drafted(self) -> int:
        """Drafted nodes (root excluded): the node budget the shape spends."""
        return len(self.parents) - 1

    @property
    def num_children(self) -> tuple[int, ...]:
        counts = [0] * len(self.parents)
        for p in self.parents[1:]:
            counts[p] += 1
        return tuple(counts)

    @property
    def children(self) -> tuple[tuple[int, ...], ...]:
        kids: list[list[int]] = [[] for _ in self.parents]
        for i, p in enumerate(self.parents[1:], start=1):
            kids[p].append(i)
        return tuple(tuple(k) for k in kids)

    @property
    def depths(self) -> tuple[int, ...]:
        d = [0] * len(self.parents)
        for i, p in enumerate(self.parents[1:], start=1):
            d[i] = d[p] + 1
        return tuple(d)

    @property
    def max_depth(self) -> int:
        return max(self.depths)

    @property
    def ranks(self) -> tuple[int, ...]:
        """Sibling rank of each node (root: 0)."""
        r = [0] * len(self.parents)
        seen = [0] * len(self.parents)
        for i, p in enumerate(self.parents[1:], start=1):
            r[i] = seen[p]
            seen[p] += 1
        return tuple(r)

    def paths(self) -> list[list[int]]:
        """Medusa-style index path of every non-root node (inverse of :meth:`from_paths`)."""
        ranks, out = self.ranks, [[]]
        for i, p in enumerate(self.parents[1:], start=1):
            out.append(out[p] + [ranks[i]])
        return out[1:]

    def truncate(self, max_depth: int) -> "TreeShape":
        """The nodes at depth <= ``max_depth`` (breadth-first order keeps them a prefix)."""
        keep = sum(1 for d in self.depths if d <= max_depth)
        return TreeShape(self.parents[:keep], self.name)

    # ------------------------------------------------------------------ JSON
    def to_dict(self) -> dict:
        return {"parents": list(self.parents), "name": self.name}

    @classmethod
    def from_dict(cls, data: dict) -> "TreeShape":
        if "parents" in data:
            return cls(tuple(data["parents"]), data.get("name", ""))
        if "paths" in data:
            return cls(cls.from_paths(data["paths"]).parents, data.get("name", "paths"))
        if "widths" in data:
            return cls(cls.widths(data["widths"]).parents, data.get("name", ""))
        raise ValueError("a tree shape JSON needs 'parents', 'paths' or 'widths'")

    def save(self, path: str | Path) -> None:
        atomic_write_json(path, self.to_dict(), indent=None)

    @classmethod
    def load(cls, path: str | Path) -> "TreeShape":
        return cls.from_dict(json.loads(Path(path).read_text()))

    def __repr__(self) -> str:
        label = f"{self.name!r}, " if self.name else ""
        return f"TreeShape({label}drafted={self.num_drafted}, depth={self.max_depth})"
