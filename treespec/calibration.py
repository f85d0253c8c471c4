"""Calibration of the Sequoia DP (:mod:`treespec.trees.sequoia`): measured acceptance and hardware costs.

* :func:`measure_acceptance_vector`: the positional acceptance vector (rows per depth on request)
  of (target, draft, sampling, law), teacher-forced on calibration prompts (use the *train* prompts,
  never eval), averaging the verifier's exact acceptance probabilities given the drafted children;
* :func:`measure_profile`: the verify cost of target tree passes of m tokens, one draft step, and the
  time to read every target weight once, as a :class:`~treespec.trees.sequoia.HardwareProfile`.

Both run models (the target, a draft causal LM or a head); the DP and the shape choice itself
(:class:`~treespec.trees.sequoia.SequoiaDP`, :func:`~treespec.trees.sequoia.choose_tree`) do not.
"""

from __future__ import annotations

import platform
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch

from .drafting.laws import draw_children
from .drafting.subset_head import SubsetHead
from .sampling import SamplingConfig, logits_to_probs
from .tree import TokenTree
from .trees.sequoia import AcceptanceVector, HardwareProfile, conditional_from_unconditional
from .verify import VERIFIER_RULES, resolve_verifier


@torch.no_grad()
def measure_acceptance_vector(target, draft, prompts: list[list[int]], sampling: SamplingConfig, *,
                              law: str = "without_replacement", width: int = 8, verifier: str | None = None,
                              max_positions: int = 128, chunk: int = 64, depths: int = 1,
                              min_weight: float = 20.0, score_from: list[int] | None = None,
                              generator: torch.Generator | None = None,
                              skip_unscored: bool = True) -> AcceptanceVector:
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
    context. None: every position counts. ``skip_unscored`` (default) does no work for the rows before
    that point at each depth (they carry no weight and no later depth reads them; with a train prompt
    of 192 tokens and 64 generated, three quarters of the work); False computes every row, the reference
    the tests compare it with (at T = 0 the two agree exactly; at T > 0 they draw different random children).
    """
    if depths < 1:
        raise ValueError("depths must be >= 1")
    if score_from is not None and len(score_from) != len(prompts):
        raise ValueError(f"score_from has {len(score_from)} entries for {len(prompts)} prompts")
    law = "deterministic" if sampling.greedy else law
    name = resolve_verifier("auto" if sampling.greedy else verifier or "auto", law, sampling)
    if name not in VERIFIER_RULES:
        raise ValueError(f"verifier {name!r} judges whole chains, not one node's drafts: the acceptance vector "
                         f"needs a node-rule verifier ({', '.join(sorted(VERIFIER_RULES))})")
    setup = _Scoring(law=law, rule=VERIFIER_RULES[name], sampling=sampling, width=width, chunk=chunk,
                     vocab=target.get_output_embeddings().weight.shape[0],
                     is_head=isinstance(draft, SubsetHead),  # drafts from the target's hidden states
                     skip_unscored=skip_unscored, generator=generator)
    total = torch.zeros(depths, width + 1, dtype=torch.float64)
    weight = torch.zeros(depths, dtype=torch.float64)
    for index, ids in enumerate(prompts):
        ids = list(ids)[:max_positions]
        if len(ids) < 2:
            continue
        gen = 0 if score_from is None else int(score_from[index])
        t_logits, per_depth, nxt = _prompt_logits(target, draft, ids, depths, setup.is_head)
        _score_prompt(t_logits, per_depth, nxt, gen, setup, total, weight)
    rows = _depth_rows(total, weight, width, min_weight)
    acc = rows[0]
    meta = {"law": law, "verifier": name, "width": width, "temperature": sampling.temperature,
            "top_k": sampling.top_k, "top_p": sampling.top_p, "positions": int(weight[0]), "prompts": len(prompts),
            "reject_all": float(total[0, width] / max(float(weight[0]), 1e-12)), "depths": depths,
            "depth_weights": [float(w) for w in weight]}
    return AcceptanceVector(acc, conditional_from_unconditional(acc), meta, rows if depths > 1 else [])


@dataclass(frozen=True)
class _Scoring:
    """How :func:`measure_acceptance_vector` drafts and verifies at every position."""

    law: str  # drafting law ("deterministic" at temperature 0)
    rule: Callable  # the verifier's exact acceptance rule (VERIFIER_RULES[name])
    sampling: SamplingConfig
    width: int  # children drawn per position
    chunk: int  # positions per verifier call
    vocab: int  # the target's vocabulary size (draft logits are padded to it)
    is_head: bool  # the draft reads the target's hidden states (a SubsetHead)
    skip_unscored: bool
    generator: torch.Generator | None


def _prompt_logits(target, draft, ids: list[int], depths: int,
                   is_head: bool) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
    """Teacher-forced logits of one prompt: the target's ``[R, V]``, the draft's per depth (``depths`` tensors
    ``[R, V_draft]``) and the text token each row predicts ``[R']`` (``R' <= R``)."""
    x = torch.tensor([ids], device=next(target.parameters()).device)
    if is_head:  # the head reads the target's hidden states (rows = positions 1..L-1)
        t_logits, per_depth = draft.depth_logits(target, x, depths)
        return t_logits, per_depth, x[0, 2:]  # the text token each row predicts
    # a causal LM reads the true context at every depth: the same rows serve each depth
    t_logits = target(x).logits[0].float()  # [L, V]
    return t_logits, [draft(x).logits[0].float()] * depths, x[0, 1:]


def _score_prompt(t_logits: torch.Tensor, per_depth: list[torch.Tensor], nxt: torch.Tensor, gen: int,
                  setup: _Scoring, total: torch.Tensor, weight: torch.Tensor) -> None:
    """Add one prompt's weighted acceptance per depth and rank to ``total`` ``[depths, W + 1]`` and its
    weights to ``weight`` ``[depths]`` (scored from position ``gen`` on)."""
    is_head, depths = setup.is_head, len(per_depth)
    rows_n = t_logits.shape[0]
    predicted = torch.arange(rows_n, dtype=torch.float64) + (2 if is_head else 1)  # position of row's token
    text_ok = torch.zeros(rows_n, dtype=torch.float64)  # P(the next text token is drafted and accepted)
    reach = torch.ones(rows_n, dtype=torch.float64)  # P(the path to this row's node was accepted)
    for k, d_logits in enumerate(per_depth):
        if k:  # level k+1 at row i hangs below level k at row i - 1
            reach = torch.cat([reach.new_zeros(1), (reach * text_ok)[:-1]])
        if d_logits.shape[-1] < setup.vocab:
            d_logits = torch.nn.functional.pad(d_logits, (0, setup.vocab - d_logits.shape[-1]), value=float("-inf"))
        text_ok = torch.zeros(rows_n, dtype=torch.float64)
        first = k if is_head else 0  # a head has no depth-(k+1) node in its first k rows
        if setup.skip_unscored:  # rows predicting a position before gen + k weigh 0 here and feed no deeper row
            first = max(first, gen + k - int(predicted[0]))
        for s in range(first, rows_n, setup.chunk):
            e = min(s + setup.chunk, rows_n)
            choice, drafts = _verify_chunk(t_logits[s:e], d_logits[s:e], setup)
            w = reach[s:e] * (predicted[s:e] >= gen + k)  # root (at position - k - 1) >= gen - 1
            total[k] += (w[:, None] * choice).sum(dim=0)
            weight[k] += w.sum()
            if k + 1 < depths:
                m = min(e, nxt.numel()) - s  # rows with a next text token
                if m > 0:
                    hit = (drafts.tokens[:m].cpu() == nxt[s:s + m, None]) & drafts.valid[:m].cpu()
                    text_ok[s:s + m] = (choice[:m, :setup.width] * hit.double()).sum(dim=1)


def _verify_chunk(t_logits: torch.Tensor, d_logits: torch.Tensor, setup: _Scoring):
    """Draw ``width`` children per row from the draft's logits ``[M, V]`` and the verifier's exact probability
    of accepting each rank (last column: none) against the target's ``[M, V]``; returns (choice ``[M, W + 1]``
    float64 on the CPU, the drawn children)."""
    p = logits_to_probs(t_logits, setup.sampling)  # target_probs
    if setup.law == "deterministic":
        q = None
        drafts = draw_children(d_logits, setup.width, "deterministic")
    else:
        q = logits_to_probs(d_logits, setup.sampling)  # draft_probs
        drafts = draw_children(q, setup.width, setup.law, setup.generator)
    choice, _ = setup.rule(p, q, drafts.tokens, drafts.valid)  # [M, W + 1]
    return choice.double().clamp(min=0).cpu(), drafts


def _depth_rows(total: torch.Tensor, weight: torch.Tensor, width: int, min_weight: float) -> list[list[float]]:
    """Acceptance per rank for each depth; a depth whose weight is below ``min_weight`` copies the row above."""
    rows = []
    for k in range(total.shape[0]):
        if k and weight[k] < min_weight:
            rows.append(list(rows[-1]))
        else:
            rows.append((total[k, :width] / max(float(weight[k]), 1e-12)).tolist())
    return rows


DEFAULT_SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128)


def synchronize(device: torch.device | str) -> None:
    """Wait for the work queued on ``device`` (a CUDA device runs kernels asynchronously: a clock read without
    this measures the launches only); nothing to wait for on the CPU."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_tree_pass(runner, tokens: int, repeats: int, vocab: int) -> float:
    tree = TokenTree.from_lists([-1] + [0] * (tokens - 1), [t % vocab for t in range(1, tokens + 1)],
                                device=runner.device)
    nodes = torch.arange(tokens, device=runner.device)
    times = []
    for _ in range(repeats):
        synchronize(runner.device)
        t0 = time.perf_counter()
        runner.forward(tree, nodes)
        synchronize(runner.device)
        times.append(time.perf_counter() - t0)
        runner.commit([])  # drop the tree again
    return statistics.median(times)


def runner_weights(runner) -> list[torch.Tensor]:
    """The weight tensors a step of ``runner`` reads: a quantised fast runner's weights as its products read them
    (4-bit copies: packed codes, scales and offsets; an 8-bit LM head: codes, scales and float32 outlier columns;
    the others as prepacked; a weight oneDNN holds in a tensor torch cannot read is stood for by a buffer of as
    many bytes) and norms (its input embedding, untied from the quantised LM head, is read one row per token and
    left out), else the model's parameters and buffers."""
    from .models.fast.quant import Int4Weight

    if getattr(runner, "quantize", None) is None:
        return [*runner.model.parameters(), *runner.model.buffers()]
    out = [runner.final_norm]
    head8 = getattr(runner, "head8", None)
    if head8 is not None:
        out += [head8.packed, head8.scales, head8.outlier_weight]
    for item in [x for layer in runner.layers for x in layer] + [runner.lm_head_weight]:
        if isinstance(item, Int4Weight):
            out += [item.packed, item.scales_zeros]
        elif isinstance(item, torch.Tensor):
            out.append(item)
    return [_readable(t) for t in out]


def _readable(t: torch.Tensor) -> torch.Tensor:
    """``t``, or for an opaque oneDNN tensor a zero buffer of as many bytes (reading it costs the same)."""
    if t.layout != torch._mkldnn:
        return t
    return torch.zeros(t.numel() * t.element_size(), dtype=torch.uint8)


@torch.no_grad()
def measure_weight_stream(model, repeats: int = 5) -> tuple[float, int]:
    """(seconds, bytes): the median time to read every weight byte of ``model`` (a module, or a list
    of tensors such as :func:`runner_weights`) once (one reduction per distinct storage; tied
    weights count once): the memory-bandwidth floor of a decoding step that reads all weights."""
    tensors = _stream_words(model)
    times = [_read_once(tensors) for _ in range(repeats + 1)]  # the first pass warms up
    return statistics.median(times[1:]), sum(t.numel() * t.element_size() for t in tensors)


def _stream_words(model) -> list[torch.Tensor]:
    """The distinct weight storages of ``model`` (module or tensor list) as :func:`_as_words` views."""
    seen, tensors = set(), []
    for t in (model if isinstance(model, list) else [*model.parameters(), *model.buffers()]):
        key = (t.untyped_storage().data_ptr(), t.data_ptr(), t.numel())
        if t.numel() and key not in seen:
            seen.add(key)
            tensors.append(_as_words(t.detach()))
    return tensors


def _read_once(tensors: list[torch.Tensor]) -> float:
    device = tensors[0].device if tensors else torch.device("cpu")
    synchronize(device)
    t0 = time.perf_counter()
    for t in tensors:
        t.sum()
    synchronize(device)
    return time.perf_counter() - t0


def _as_words(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t`` as int64 words where they divide (an integer sum reads memory at full speed
    whatever the dtype: a uint8 sum widens every byte and runs ~70x slower), else ``t`` itself."""
    flat = t.contiguous().reshape(-1)
    if flat.numel() * flat.element_size() % 8 == 0:
        return flat.view(torch.uint8).view(torch.int64)
    return flat


@torch.no_grad()
def measure_profile(target, draft=None, *, sizes: tuple[int, ...] = DEFAULT_SIZES, prefix: int = 128,
                    repeats: int = 3, draft_width: int = 4, warmup: int = 2, fast: bool = False,
                    stream: bool = True, quantize: str | None = None) -> HardwareProfile:
    """Time target tree passes of ``sizes`` tokens after a ``prefix``-token context, and one draft
    step (a ``draft_width``-node frontier) of ``draft`` (None: c = 0). Medians over ``repeats`` rounds
    (at least 3 with ``stream``), each one weight read then one pass of every size (the order of the
    sizes rotates from round to round, so no size always runs right after the read).
    ``fast``: through the fast runners (:func:`treespec.models.fast.make_runner`) where they cover
    the model. ``stream``: also time reading every target weight once (``stream_s``; for a target
    quantised by ``quantize``, the weights its runner reads). ``quantize``: see :func:`make_runner`."""
    from .models.fast import make_runner

    if sizes[0] != 1:
        raise ValueError("sizes must start at 1 (plain decoding)")
    runner = make_runner(target, fast=fast, quantize=quantize)
    vocab = runner.vocab_size
    runner.reset()
    runner.forward(None, None, torch.arange(1, prefix + 1, device=runner.device) % vocab, need_logits=False)
    for _ in range(warmup):
        _time_tree_pass(runner, sizes[-1], 1, vocab)
    # rounds: one weight read (the bandwidth reference) then one pass of every size, so that every
    # ratio (t(n) / t(1), t(1) / streaming) pairs measurements taken moments apart (memory bandwidth
    # on a shared host drifts by tens of percent within seconds)
    words = _stream_words(runner_weights(runner)) if stream else []
    if words:
        _read_once(words)  # warm-up
    stream_times, times = [], {n: [] for n in sizes}
    rounds = max(repeats, 3) if stream else repeats
    for r in range(rounds):
        if words:
            stream_times.append(_read_once(words))
        for n in sizes[r % len(sizes):] + sizes[: r % len(sizes)]:  # each size takes every place in turn
            times[n].append(_time_tree_pass(runner, n, 1, vocab))
    verify = [statistics.median(times[n]) for n in sizes]
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
            "device": str(runner.device),
            "torch": torch.__version__, "prefix": prefix, "repeats": rounds, "draft_width": draft_width,
            "target": type(runner.model).__name__, "runner": type(runner).__name__,
            "dtype": str(runner.dtype).replace("torch.", ""), "quantize": quantize}
    stream_s = statistics.median(stream_times) if words else 0.0
    nbytes = sum(t.numel() * t.element_size() for t in words)
    return HardwareProfile(list(sizes), verify, draft_s, meta, stream_s, nbytes)
