"""Sequoia: hardware-aware optimal tree shapes (Sequoia: Scalable, Robust, and Hardware-aware
Speculative Decoding, arXiv 2402.12374).

Convention (the *positional acceptance vector*). ``acc[k]`` (k = 0, 1, ..., W-1) is the
**unconditional** probability that, at a node that has been reached (accepted), the child of
sibling rank k is the one the verifier accepts: the children before it were rejected and it was
accepted. ``sum(acc) <= 1``. It depends only on the rank (the positional acceptance assumption),
not on how many more siblings follow, because verification tries children in order. The
*conditional* form ``acc[k] / (1 - acc[0] - ... - acc[k-1])`` (accept rank k given ranks < k
were rejected) is stored alongside for reference. With it, the probability that a node is on the
accepted path is the product of ``acc[rank]`` along its root path, so

    F(T) = sum over nodes (root included) of prod_{v on the root path, v != root} acc[rank(v)]

is the expected number of tokens a step emits (accepted drafts + the bonus token): the predicted
tau of the tree (:func:`predicted_tau`).

Rows per depth. The positional assumption breaks in two ways that matter here: a draft head reads
its own features below depth 1 (acceptance falls with depth), and acceptance comes in runs (a
node deep in the tree is reached mostly where the draft does well, so the acceptance *given the
path was accepted* rises with depth). Both are captured by one row per depth, ``acc_d[k]`` for
children at depth d (deeper children use the last row), measured conditionally on the path; F(T)
then takes ``acc_{depth(v)}[rank(v)]`` along each path and the DP below stays exact (a node of
remaining depth d sits at depth D - d in a tree of depth bound D).

Pieces:

* :func:`treespec.calibration.measure_acceptance_vector` measures ``acc`` (and, with ``depths > 1``, the rows per depth)
  for (target, draft, sampling, law) at real positions of calibration prompts (use the *train*
  prompts, never eval); it averages the verifier's exact acceptance probabilities given the
  drafted children (Rao-Blackwellised: no coin flips needed);
* :class:`SequoiaDP` the depth-bounded dynamic program for the tree of at most n drafted nodes and
  depth <= d maximising F;
* :func:`enumerate_shapes` / :func:`brute_force_best` all ordered trees with a few nodes (tests);
* :class:`HardwareProfile` (measured by :func:`treespec.calibration.measure_profile`) the verify cost t(m) / t(1) of m tokens
  (m = 1..128) and the draft step cost c, as JSON; :func:`choose_tree` picks (n, d) maximising
  F(n, d) / (t(n + 1) + d c), the predicted speedup over plain decoding.

Budgets ``n`` count drafted nodes (the root excluded), as everywhere in treespec; a tree of n
drafted nodes costs a verify pass over n + 1 tokens.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from ..files import atomic_write_json
from .shape import TreeShape


# ====================================================================== acceptance vector
@dataclass
class AcceptanceVector:
    """Positional acceptance probabilities (see the module docstring for the convention)."""

    acc: list[float]  # unconditional P(rank-k child accepted), k = 0..W-1
    conditional: list[float] = field(default_factory=list)
    meta: dict = field(default_factory=dict)
    #: optional rows per tree depth (row d-1: children at depth d; deeper children use the last row),
    #: for drafts whose acceptance falls with depth (a head drafting from its own features)
    by_depth: list[list[float]] = field(default_factory=list)

    @property
    def rows(self) -> list[list[float]]:
        """The acceptance rows the DP and :func:`predicted_tau` use (``by_depth`` if measured)."""
        return [list(r) for r in self.by_depth] if self.by_depth else [list(self.acc)]

    @property
    def width(self) -> int:
        return len(self.acc)

    def to_dict(self) -> dict:
        return asdict(self)

    def save(self, path: str | Path) -> None:
        atomic_write_json(path, self.to_dict())

    @classmethod
    def load(cls, path: str | Path) -> "AcceptanceVector":
        return cls(**json.loads(Path(path).read_text()))


def conditional_from_unconditional(acc: list[float]) -> list[float]:
    out, left = [], 1.0
    for a in acc:
        out.append(a / left if left > 1e-12 else 0.0)
        left -= a
    return out


# ====================================================================== tree value
def acceptance_rows(acc) -> list[list[float]]:
    """Acceptance rows from a vector (one row, every depth), rows per depth, or an AcceptanceVector."""
    if isinstance(acc, AcceptanceVector):
        return acc.rows
    acc = list(acc)
    if acc and isinstance(acc[0], (list, tuple, np.ndarray)):
        rows = [[float(a) for a in row] for row in acc]
    else:
        rows = [[float(a) for a in acc]]
    if not rows or any(a < 0 for row in rows for a in row):
        raise ValueError("acceptance probabilities must be >= 0 (and at least one row)")
    return rows


def shape_value(parents: list[int] | tuple[int, ...], acc) -> float:
    """F(T) for a parent array (any topological order; children ranks by index order).

    ``acc``: one acceptance vector, or rows per depth (row ``d - 1`` for children at depth ``d``;
    deeper children use the last row)."""
    rows = acceptance_rows(acc)
    n = len(parents)
    prob = [1.0] * n
    seen = [0] * n
    depth = [0] * n
    for i in range(1, n):
        p = parents[i]
        rank = seen[p]
        seen[p] += 1
        depth[i] = depth[p] + 1
        row = rows[min(depth[i], len(rows)) - 1]
        prob[i] = prob[p] * (row[rank] if rank < len(row) else 0.0)
    return float(sum(prob))


def predicted_tau(shape: TreeShape, acc) -> float:
    """Expected tokens per step (accepted drafts + bonus) of a shape under ``acc`` (see :func:`shape_value`)."""
    return shape_value(shape.parents, acc)


# ====================================================================== the DP
class SequoiaDP:
    """Best trees of at most ``max_nodes`` drafted nodes and depth <= ``max_depth``.

    G[d][s] = best F over trees of at most s nodes (root included) and depth <= d;
    G[0][s] = 1 (s >= 1). For d >= 1 a root's children of ranks i, i+1, ... share m nodes:
    H_i(m) = max(0, max_{1<=s<=m} a_i G[d-1][s] + H_{i+1}(m - s)), H_W = 0, and
    G[d][s] = 1 + H_0(s - 1). The "0" option stops adding children (leftover budget unused).
    O(max_depth * W * max_nodes^2), vectorised over m.

    With acceptance rows per depth (``acc[k - 1]`` for children at depth ``k``, the last row beyond),
    a subtree's value depends on its absolute depth; in a tree of depth bound D a node of remaining
    depth d sits at depth D - d, so the same recursion holds with ``a_i`` taken from row D - d + 1.
    :meth:`value` and :meth:`shape` for another bound d then solve the DP for d (cached).
    """

    def __init__(self, acc, max_nodes: int, max_depth: int) -> None:
        self.rows = acceptance_rows(acc)
        self.acc = self.rows[0]  # the depth-1 row (the positional vector when there is one row)
        self.max_nodes, self.max_depth = int(max_nodes), int(max_depth)
        self._other: dict[int, "SequoiaDP"] = {}
        size = self.max_nodes + 2  # s = 0 .. max_nodes + 1 (root included)
        self.width = width = max(len(r) for r in self.rows)
        G = np.full((self.max_depth + 1, size), -np.inf)
        G[:, 1:] = 1.0
        self.choice = np.zeros((self.max_depth + 1, width + 1, size), dtype=np.int64)
        s_idx = np.arange(size)
        for d in range(1, self.max_depth + 1):
            row = self._row(d)
            prev = np.where(np.isfinite(G[d - 1]), G[d - 1], 0.0)  # s = 0 is masked below
            H = np.zeros(size)  # H_W
            for i in range(width - 1, -1, -1):
                a = row[i] if i < len(row) else 0.0
                # cand[m, s] = a_i * G[d-1][s] + H[m - s] for 1 <= s <= m
                diff = s_idx[:, None] - s_idx[None, :]  # m - s
                cand = np.where((s_idx[None, :] >= 1) & (diff >= 0),
                                a * prev[None, :] + H[np.clip(diff, 0, None)], -np.inf)
                best_s = cand.argmax(axis=1)
                best = cand[s_idx, best_s]
                take = best > 0.0  # strictly better than stopping
                self.choice[d, i] = np.where(take, best_s, 0)
                H = np.where(take, best, 0.0)
            G[d, 1:] = 1.0 + H[: size - 1]
        self.G = G

    @property
    def depth_dependent(self) -> bool:
        return len(self.rows) > 1

    def _row(self, d: int) -> list[float]:
        """Acceptance row of the children of a node with remaining depth d."""
        depth = self.max_depth - d + 1 if self.depth_dependent else 1
        return self.rows[min(depth, len(self.rows)) - 1]

    def _for_depth(self, d: int) -> "SequoiaDP":
        d = min(d, self.max_depth)
        if not self.depth_dependent or d == self.max_depth:
            return self
        if d not in self._other:
            self._other[d] = SequoiaDP(self.rows, self.max_nodes, d)
        return self._other[d]

    def value(self, n: int, d: int) -> float:
        """Best F with at most n drafted nodes and depth <= d (predicted tau)."""
        dp = self._for_depth(d)
        return float(dp.G[dp.max_depth, n + 1]) if dp is not self else float(self.G[min(d, self.max_depth), n + 1])

    def shape(self, n: int, d: int) -> TreeShape:
        """An optimal shape for (n, d)."""
        dp = self._for_depth(d)
        d = min(d, dp.max_depth)
        parents = [-1]

        def build(node: int, size: int, depth: int) -> None:
            m, i = size - 1, 0
            while depth > 0 and i < dp.width and m > 0:
                s = int(dp.choice[depth, i, m])
                if s == 0:
                    break
                child = len(parents)
                parents.append(node)
                build(child, s, depth - 1)
                m -= s
                i += 1

        build(0, n + 1, d)
        return TreeShape(tuple(parents), f"sequoia-n{n}-d{d}")


# ====================================================================== brute force (tests)
def enumerate_shapes(num_nodes: int) -> list[tuple[int, ...]]:
    """All ordered (plane) trees with exactly ``num_nodes`` nodes as pre-order parent arrays."""

    def forests(size: int, offset: int, parent: int) -> list[list[int]]:
        # ordered forests of `size` nodes hanging from `parent`, node ids from `offset` (pre-order)
        if size == 0:
            return [[]]
        out = []
        for first in range(1, size + 1):  # size of the first tree
            for sub in forests(first - 1, offset + 1, offset):
                for rest in forests(size - first, offset + first, parent):
                    out.append([parent] + sub + rest)
        return out

    if num_nodes < 1:
        return []
    return [tuple([-1] + f) for f in forests(num_nodes - 1, 1, 0)]


def brute_force_best(acc, max_nodes: int, max_depth: int) -> float:
    """max F over all ordered trees with at most ``max_nodes`` drafted nodes and depth <= d."""
    best = -math.inf
    for total in range(1, max_nodes + 2):
        for parents in enumerate_shapes(total):
            depth = [0] * total
            for i in range(1, total):
                depth[i] = depth[parents[i]] + 1
            if max(depth) <= max_depth:
                best = max(best, shape_value(parents, acc))
    return best


# ====================================================================== hardware profile
@dataclass
class HardwareProfile:
    """Measured costs: ``verify_s[j]`` seconds of a target tree pass over ``sizes[j]`` tokens
    (root included; ``sizes[0] == 1`` is plain decoding) and ``draft_step_s`` seconds of one draft
    step (0 for model-free drafts)."""

    sizes: list[int]
    verify_s: list[float]
    draft_step_s: float = 0.0
    meta: dict = field(default_factory=dict)
    #: bandwidth reference measured in the same run: seconds to read every target weight byte once
    #: (0 = not measured), and how many bytes that is
    stream_s: float = 0.0
    weight_bytes: int = 0

    def t(self, tokens: int) -> float:
        """Verify cost of ``tokens`` tokens relative to one token (linear interpolation)."""
        return float(np.interp(tokens, self.sizes, self.verify_s) / self.verify_s[0])

    @property
    def c(self) -> float:
        """Draft step cost relative to one plain target decoding step."""
        return self.draft_step_s / self.verify_s[0]

    def to_dict(self) -> dict:
        return asdict(self)

    def save(self, path: str | Path) -> None:
        atomic_write_json(path, self.to_dict())

    @classmethod
    def load(cls, path: str | Path) -> "HardwareProfile":
        return cls(**json.loads(Path(path).read_text()))


def choose_tree(acc: list[float] | AcceptanceVector, profile: HardwareProfile, *,
                budgets: tuple[int, ...] | None = None, max_depth: int = 12) -> dict:
    """The (n, d) maximising F(n, d) / (t(n + 1) + d c): returns n, d, predicted tau and speedup, shape."""
    max_n = profile.sizes[-1] - 1
    budgets = budgets or tuple(range(1, max_n + 1))
    dp = SequoiaDP(acc, max(budgets), max_depth)
    best = {"n": 0, "d": 0, "tau": 1.0, "speedup": 1.0}
    for n in budgets:
        for d in range(1, max_depth + 1):
            tau = dp.value(n, d)
            speed = tau / (profile.t(n + 1) + d * profile.c)
            if speed > best["speedup"] + 1e-12:
                best = {"n": n, "d": d, "tau": tau, "speedup": speed}
    best["shape"] = dp.shape(best["n"], best["d"]) if best["n"] else TreeShape()
    return best
