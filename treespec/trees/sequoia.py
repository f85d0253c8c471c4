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

Pieces:

* :func:`measure_acceptance_vector` measures ``acc`` for (target, draft, sampling, law) from depth-1
  trees of width W at real positions of calibration prompts (use the *train* prompts, never eval);
  it averages the verifier's exact acceptance probabilities given the drafted children
  (Rao-Blackwellised: no coin flips needed);
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
from ..sampling import SamplingConfig, logits_to_probs
from .shape import TreeShape


# ====================================================================== acceptance vector
@dataclass
class AcceptanceVector:
    """Positional acceptance probabilities (see the module docstring for the convention)."""

    acc: list[float]  # unconditional P(rank-k child accepted), k = 0..W-1
    conditional: list[float] = field(default_factory=list)
    meta: dict = field(default_factory=dict)

    @property
    def width(self) -> int:
        return len(self.acc)

    def to_dict(self) -> dict:
        return asdict(self)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1))

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
                              max_positions: int = 128, chunk: int = 64,
                              generator: torch.Generator | None = None) -> AcceptanceVector:
    """Measure ``acc`` on token-id prompts (teacher-forced real positions).

    For every prompt (truncated to ``max_positions`` tokens) one causal forward of the target and
    of the draft gives p and q after every prefix; at each position ``width`` children are drawn
    from q under ``law`` (at temperature 0: the draft's top-``width``, verified greedily) and the
    verifier's exact probability of accepting each rank is averaged.
    """
    from ..generate import DEFAULT_VERIFIER
    from ..verify import VERIFIER_RULES

    law = "deterministic" if sampling.greedy else law
    name = "greedy" if sampling.greedy else (verifier or DEFAULT_VERIFIER[law])
    rule = VERIFIER_RULES[name]
    total = torch.zeros(width + 1, dtype=torch.float64)
    count = 0
    vocab = target.get_output_embeddings().weight.shape[0]
    for ids in prompts:
        ids = list(ids)[:max_positions]
        if not ids:
            continue
        x = torch.tensor([ids])
        t_logits = target(x).logits[0].float()  # [L, V]
        d_logits = draft(x).logits[0].float()
        if d_logits.shape[-1] < vocab:
            d_logits = torch.nn.functional.pad(d_logits, (0, vocab - d_logits.shape[-1]), value=float("-inf"))
        for s in range(0, len(ids), chunk):
            p = logits_to_probs(t_logits[s:s + chunk], sampling)
            if law == "deterministic":
                q = None
                drafts = draw_children(d_logits[s:s + chunk], width, "deterministic")
            else:
                q = logits_to_probs(d_logits[s:s + chunk], sampling)
                drafts = draw_children(q, width, law, generator)
            choice, _ = rule(p, q, drafts.tokens, drafts.valid)  # [M, W + 1]
            total += choice.double().clamp(min=0).sum(dim=0).cpu()
            count += p.shape[0]
    acc = (total[:width] / max(count, 1)).tolist()
    meta = {"law": law, "verifier": name, "width": width, "temperature": sampling.temperature,
            "top_k": sampling.top_k, "top_p": sampling.top_p, "positions": count, "prompts": len(prompts),
            "reject_all": float(total[width] / max(count, 1))}
    return AcceptanceVector(acc, conditional_from_unconditional(acc), meta)


# ====================================================================== tree value
def shape_value(parents: list[int] | tuple[int, ...], acc: list[float]) -> float:
    """F(T) for a parent array (any topological order; children ranks by index order)."""
    n = len(parents)
    prob = [1.0] * n
    seen = [0] * n
    for i in range(1, n):
        p = parents[i]
        rank = seen[p]
        seen[p] += 1
        prob[i] = prob[p] * (acc[rank] if rank < len(acc) else 0.0)
    return float(sum(prob))


def predicted_tau(shape: TreeShape, acc: list[float] | AcceptanceVector) -> float:
    """Expected tokens per step (accepted drafts + bonus) of a shape under ``acc``."""
    acc = acc.acc if isinstance(acc, AcceptanceVector) else acc
    return shape_value(shape.parents, acc)


# ====================================================================== the DP
class SequoiaDP:
    """Best trees of at most ``max_nodes`` drafted nodes and depth <= ``max_depth``.

    G[d][s] = best F over trees of at most s nodes (root included) and depth <= d;
    G[0][s] = 1 (s >= 1). For d >= 1 a root's children of ranks i, i+1, ... share m nodes:
    H_i(m) = max(0, max_{1<=s<=m} acc[i] G[d-1][s] + H_{i+1}(m - s)), H_W = 0, and
    G[d][s] = 1 + H_0(s - 1). The "0" option stops adding children (leftover budget unused).
    O(max_depth * W * max_nodes^2), vectorised over m.
    """

    def __init__(self, acc: list[float] | AcceptanceVector, max_nodes: int, max_depth: int) -> None:
        self.acc = list(acc.acc if isinstance(acc, AcceptanceVector) else acc)
        if any(a < 0 for a in self.acc):
            raise ValueError("acceptance probabilities must be >= 0")
        self.max_nodes, self.max_depth = int(max_nodes), int(max_depth)
        size = self.max_nodes + 2  # s = 0 .. max_nodes + 1 (root included)
        width = len(self.acc)
        G = np.full((self.max_depth + 1, size), -np.inf)
        G[:, 1:] = 1.0
        self.choice = np.zeros((self.max_depth + 1, width + 1, size), dtype=np.int64)
        s_idx = np.arange(size)
        for d in range(1, self.max_depth + 1):
            prev = np.where(np.isfinite(G[d - 1]), G[d - 1], 0.0)  # s = 0 is masked below
            H = np.zeros(size)  # H_W
            for i in range(width - 1, -1, -1):
                # cand[m, s] = acc[i] * G[d-1][s] + H[m - s] for 1 <= s <= m
                diff = s_idx[:, None] - s_idx[None, :]  # m - s
                cand = np.where((s_idx[None, :] >= 1) & (diff >= 0),
                                self.acc[i] * prev[None, :] + H[np.clip(diff, 0, None)], -np.inf)
                best_s = cand.argmax(axis=1)
                best = cand[s_idx, best_s]
                take = best > 0.0  # strictly better than stopping
                self.choice[d, i] = np.where(take, best_s, 0)
                H = np.where(take, best, 0.0)
            G[d, 1:] = 1.0 + H[: size - 1]
        self.G = G

    def value(self, n: int, d: int) -> float:
        """Best F with at most n drafted nodes and depth <= d (predicted tau)."""
        return float(self.G[min(d, self.max_depth), n + 1])

    def shape(self, n: int, d: int) -> TreeShape:
        """An optimal shape for (n, d)."""
        d = min(d, self.max_depth)
        parents = [-1]

        def build(node: int, size: int, depth: int) -> None:
            m, i = size - 1, 0
            while depth > 0 and i < len(self.acc) and m > 0:
                s = int(self.choice[depth, i, m])
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


def brute_force_best(acc: list[float], max_nodes: int, max_depth: int) -> float:
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
        Path(path).write_text(json.dumps(self.to_dict(), indent=1))

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
def measure_profile(target, draft=None, *, sizes: tuple[int, ...] = DEFAULT_SIZES, prefix: int = 128,
                    repeats: int = 3, draft_width: int = 4, warmup: int = 2) -> HardwareProfile:
    """Time target tree passes of ``sizes`` tokens after a ``prefix``-token context, and one draft
    step (a ``draft_width``-node frontier) of ``draft`` (None: c = 0). Medians of ``repeats``."""
    from ..models.runner import ModelRunner

    if sizes[0] != 1:
        raise ValueError("sizes must start at 1 (plain decoding)")
    runner = target if isinstance(target, ModelRunner) else ModelRunner(target)
    vocab = runner.vocab_size
    runner.reset()
    runner.forward(None, None, torch.arange(1, prefix + 1, device=runner.device) % vocab, need_logits=False)
    for _ in range(warmup):
        _time_tree_pass(runner, sizes[-1], 1, vocab)
    verify = [_time_tree_pass(runner, n, repeats, vocab) for n in sizes]
    draft_s = 0.0
    if draft is not None:
        drunner = draft if isinstance(draft, ModelRunner) else ModelRunner(draft)
        drunner.reset()
        drunner.forward(None, None, torch.arange(1, prefix + 1, device=drunner.device) % drunner.vocab_size,
                        need_logits=False)
        for _ in range(warmup):
            _time_tree_pass(drunner, draft_width, 1, drunner.vocab_size)
        draft_s = _time_tree_pass(drunner, draft_width, repeats, drunner.vocab_size)
    meta = {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
            "torch": torch.__version__, "prefix": prefix, "repeats": repeats, "draft_width": draft_width,
            "target": type(runner.model).__name__}
    return HardwareProfile(list(sizes), verify, draft_s, meta)


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
