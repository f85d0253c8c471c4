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

* :func:`measure_acceptance_vector` measures ``acc`` (and, with ``depths > 1``, the rows per depth)
  for (target, draft, sampling, law) at real positions of calibration prompts (use the *train*
  prompts, never eval); it averages the verifier's exact acceptance probabilities given the
  drafted children (Rao-Blackwellised: no coin flips needed);
* :class:`SequoiaDP` the depth-bounded dynamic program for the tree of at most n drafted nodes and
  depth <= d maximising F;
* :func:`enumerate_shapes` / :func:`brute_force_best` all ordered trees with a few nodes (tests);
* :class:`HardwareProfile` / :func:`measure_profile` the verify cost t(m) / t(1) of m tokens
  (m = 1..128) and the draft step cost c, as JSON; :func:`choose_tree` picks (n, d) maximising
  F(n, d) / (t(n + 1) + d c), the predicted speedup over plain decoding.

Budgets ``n`` count drafted nodes (the root excluded), as everywhere in treespec; a tree of n
drafted nodes costs a verify pass over n + 1 tokens.
"""

from __future__ import annotations

import json
import math
import platform
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from ..drafting.laws import draw_children
from ..files import atomic_write_json
from ..sampling import SamplingConfig, logits_to_probs
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


def read_prompts(path: str | Path, limit: int | None = None) -> list[str]:
    """Prompt texts of a JSONL file of ``{"prompt": ...}`` rows."""
    out = []
    with open(path) as fh:
        for line in fh:
            if line.strip():
                out.append(json.loads(line)["prompt"])
                if limit is not None and len(out) >= limit:
                    break
    return out


@torch.no_grad()
def measure_acceptance_vector(target, draft, prompts: list[list[int]], sampling: SamplingConfig, *,
                              law: str = "without_replacement", width: int = 8, verifier: str | None = None,
                              max_positions: int = 128, chunk: int = 64, depths: int = 1,
                              min_weight: float = 20.0, score_from: list[int] | None = None,
                              generator: torch.Generator | None = None) -> AcceptanceVector:
    """Measure ``acc`` on token-id prompts (teacher-forced real positions).

    For every prompt (truncated to ``max_positions`` tokens) one causal forward of the target and
    of the draft gives p and q after every prefix; at each position ``width`` children are drawn
    from q under ``law`` (at temperature 0: the draft's top-``width``, verified greedily) and the
    verifier's exact probability of accepting each rank is averaged.

    ``depths > 1``: one row per tree depth 1..``depths`` (stored in ``by_depth``; :class:`SequoiaDP`
    and :func:`predicted_tau` then use them). Two effects make acceptance depend on depth, and the
    rows capture both:

    * a draft :class:`~treespec.drafting.head.EagleHead` reads the target's true hidden states at
      depth 1 but its own output features deeper in a tree
      (:func:`~treespec.drafting.head_runner.head_depth_logits` emulates that along the text);
      :class:`~treespec.drafting.medusa.MedusaHeads` draft depth k with head k from the hidden state
      before the root (:func:`~treespec.drafting.medusa.medusa_depth_logits`);
    * F(T) multiplies acceptances along a path, so the row of depth k must be the acceptance
      *given that the path to the node was accepted*; positions where the draft does well come in
      runs, so that conditional acceptance grows with depth. The row of depth k therefore weights
      each position by the probability that the text's own k-1 preceding tokens were each drafted
      and accepted at their depth (the verifier's exact acceptance of that child given the drawn
      children), i.e. it averages over the positions a depth-k node is actually reached from.
      A row whose total weight is below ``min_weight`` positions copies the row above it.

    ``score_from``: per prompt, the index of its first generated token (e.g. a train prompt followed
    by the target's own continuation). Only nodes of trees rooted at or after the last prompt token
    are then counted, i.e. the positions a generation would draft at; the prompt still serves as
    context. None: every position counts.
    """
    from ..drafting.subset_head import SubsetHead
    from ..verify import VERIFIER_RULES, resolve_verifier

    if depths < 1:
        raise ValueError("depths must be >= 1")
    if score_from is not None and len(score_from) != len(prompts):
        raise ValueError(f"score_from has {len(score_from)} entries for {len(prompts)} prompts")
    law = "deterministic" if sampling.greedy else law
    name = resolve_verifier("auto" if sampling.greedy else verifier or "auto", law, sampling)
    rule = VERIFIER_RULES[name]
    total = torch.zeros(depths, width + 1, dtype=torch.float64)
    weight = torch.zeros(depths, dtype=torch.float64)
    vocab = target.get_output_embeddings().weight.shape[0]
    is_head = isinstance(draft, SubsetHead)  # drafts from the target's hidden states
    for index, ids in enumerate(prompts):
        ids = list(ids)[:max_positions]
        if len(ids) < 2:
            continue
        gen = 0 if score_from is None else int(score_from[index])
        x = torch.tensor([ids])
        if is_head:  # the head reads the target's hidden states (rows = positions 1..L-1)
            t_logits, per_depth = draft.depth_logits(target, x, depths)
            nxt = x[0, 2:]  # the text token each row predicts
        else:  # a causal LM reads the true context at every depth: the same rows serve each depth
            t_logits = target(x).logits[0].float()  # [L, V]
            per_depth = [draft(x).logits[0].float()] * depths
            nxt = x[0, 1:]
        rows_n = t_logits.shape[0]
        predicted = torch.arange(rows_n, dtype=torch.float64) + (2 if is_head else 1)  # position of row's token
        text_ok = torch.zeros(rows_n, dtype=torch.float64)  # P(the next text token is drafted and accepted)
        reach = torch.ones(rows_n, dtype=torch.float64)  # P(the path to this row's node was accepted)
        for k, d_logits in enumerate(per_depth):
            if k:  # level k+1 at row i hangs below level k at row i - 1
                reach = torch.cat([reach.new_zeros(1), (reach * text_ok)[:-1]])
            if d_logits.shape[-1] < vocab:
                d_logits = torch.nn.functional.pad(d_logits, (0, vocab - d_logits.shape[-1]), value=float("-inf"))
            text_ok = torch.zeros(rows_n, dtype=torch.float64)
            first = k if is_head else 0  # a head has no depth-(k+1) node in its first k rows
            for s in range(first, rows_n, chunk):
                e = min(s + chunk, rows_n)
                p = logits_to_probs(t_logits[s:e], sampling)
                if law == "deterministic":
                    q = None
                    drafts = draw_children(d_logits[s:e], width, "deterministic")
                else:
                    q = logits_to_probs(d_logits[s:e], sampling)
                    drafts = draw_children(q, width, law, generator)
                choice, _ = rule(p, q, drafts.tokens, drafts.valid)  # [M, W + 1]
                choice = choice.double().clamp(min=0).cpu()
                w = reach[s:e] * (predicted[s:e] >= gen + k)  # root (at position - k - 1) >= gen - 1
                total[k] += (w[:, None] * choice).sum(dim=0)
                weight[k] += w.sum()
                if k + 1 < depths:
                    m = min(e, nxt.numel()) - s  # rows with a next text token
                    if m > 0:
                        hit = (drafts.tokens[:m].cpu() == nxt[s:s + m, None]) & drafts.valid[:m].cpu()
                        text_ok[s:s + m] = (choice[:m, :width] * hit.double()).sum(dim=1)
    rows = []
    for k in range(depths):
        if k and weight[k] < min_weight:
            rows.append(list(rows[-1]))
        else:
            rows.append((total[k, :width] / max(float(weight[k]), 1e-12)).tolist())
    acc = rows[0]
    meta = {"law": law, "verifier": name, "width": width, "temperature": sampling.temperature,
            "top_k": sampling.top_k, "top_p": sampling.top_p, "positions": int(weight[0]), "prompts": len(prompts),
            "reject_all": float(total[0, width] / max(float(weight[0]), 1e-12)), "depths": depths,
            "depth_weights": [float(w) for w in weight]}
    return AcceptanceVector(acc, conditional_from_unconditional(acc), meta, rows if depths > 1 else [])


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


DEFAULT_SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128)


def _time_tree_pass(runner, tokens: int, repeats: int, vocab: int) -> float:
    from ..tree import TokenTree

    tree = TokenTree.from_lists([-1] + [0] * (tokens - 1), [t % vocab for t in range(1, tokens + 1)])
    nodes = torch.arange(tokens, device=runner.device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        runner.forward(tree, nodes)
        times.append(time.perf_counter() - t0)
        runner.commit([])  # drop the tree again
    return statistics.median(times)


@torch.no_grad()
def measure_weight_stream(model, repeats: int = 5) -> tuple[float, int]:
    """(seconds, bytes): the median time to read every weight byte of ``model`` once (one
    reduction per distinct parameter/buffer storage; tied weights count once): the memory-bandwidth
    floor of a decoding step that reads all weights."""
    seen, tensors = set(), []
    for t in [*model.parameters(), *model.buffers()]:
        key = (t.untyped_storage().data_ptr(), t.data_ptr(), t.numel())
        if t.numel() and key not in seen:
            seen.add(key)
            tensors.append(t.detach())
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    times = []
    for _ in range(repeats + 1):  # the first pass warms up
        t0 = time.perf_counter()
        for t in tensors:
            t.sum()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:]), nbytes


@torch.no_grad()
def measure_profile(target, draft=None, *, sizes: tuple[int, ...] = DEFAULT_SIZES, prefix: int = 128,
                    repeats: int = 3, draft_width: int = 4, warmup: int = 2, fast: bool = False,
                    stream: bool = True) -> HardwareProfile:
    """Time target tree passes of ``sizes`` tokens after a ``prefix``-token context, and one draft
    step (a ``draft_width``-node frontier) of ``draft`` (None: c = 0). Medians of ``repeats``.
    ``fast``: through the fast runners (:func:`treespec.models.fast.make_runner`) where they cover
    the model. ``stream``: also time reading every target weight once (``stream_s``)."""
    from ..models.fast import make_runner

    if sizes[0] != 1:
        raise ValueError("sizes must start at 1 (plain decoding)")
    runner = make_runner(target, fast=fast)
    vocab = runner.vocab_size
    runner.reset()
    runner.forward(None, None, torch.arange(1, prefix + 1, device=runner.device) % vocab, need_logits=False)
    for _ in range(warmup):
        _time_tree_pass(runner, sizes[-1], 1, vocab)
    verify = [_time_tree_pass(runner, n, repeats, vocab) for n in sizes]
    draft_s = 0.0
    if draft is not None:
        drunner = make_runner(draft, fast=fast)
        drunner.reset()
        drunner.forward(None, None, torch.arange(1, prefix + 1, device=drunner.device) % drunner.vocab_size,
                        need_logits=False)
        for _ in range(warmup):
            _time_tree_pass(drunner, draft_width, 1, drunner.vocab_size)
        draft_s = _time_tree_pass(drunner, draft_width, repeats, drunner.vocab_size)
    meta = {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
            "torch": torch.__version__, "prefix": prefix, "repeats": repeats, "draft_width": draft_width,
            "target": type(runner.model).__name__, "runner": type(runner).__name__,
            "dtype": str(runner.dtype).replace("torch.", "")}
    stream_s, nbytes = measure_weight_stream(runner.model, max(repeats, 3)) if stream else (0.0, 0)
    return HardwareProfile(list(sizes), verify, draft_s, meta, stream_s, nbytes)


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
