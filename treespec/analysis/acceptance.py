"""Measuring a draft head in the speculative engine (used by ``python -m treespec.distill evaluate``).

* :func:`target_generations`: the target's own continuations (plain decoding, the engine's
  :func:`~treespec.generate.generate`), the text the teacher-forced metrics of
  :func:`treespec.distill.evaluate.depth_metrics` are read along;
* :func:`step_cost`: one head step (one token, with cache, subset logits) / one target step (one token,
  with cache, full logits, the engine's runner), median wall time on this machine;
* :func:`chain_tau`: tokens per target pass of a chain of head drafts in the engine.

Nothing here trains: :mod:`treespec.distill` holds the training code and reaches these functions
only through its ``evaluate`` command.
"""

from __future__ import annotations

import hashlib
import json
import statistics
import time
from pathlib import Path

import torch

from ..drafting.head import EagleHead
from ..files import atomic_write_text


@torch.no_grad()
def target_generations(model, prompts: list[list[int]], new_tokens: int, temperature: float, seed: int = 0,
                       cache: str | Path | None = None, progress: bool = True) -> list[list[int]]:
    """The target's continuations (plain decoding, our engine); cached in a JSON file when ``cache``."""
    from tqdm import tqdm

    from ..generate import GenerationConfig, generate
    from ..sampling import SamplingConfig

    key = hashlib.sha256(json.dumps([prompts, new_tokens, temperature, seed]).encode()).hexdigest()[:16]
    if cache is not None:
        path = Path(cache) / f"gens-{key}.json"
        if path.exists():
            return json.loads(path.read_text())
    gens = []
    for i, p in enumerate(tqdm(prompts, desc=f"target generations T={temperature}", disable=not progress)):
        cfg = GenerationConfig(max_new_tokens=new_tokens, sampling=SamplingConfig(temperature), seed=seed + i)
        gens.append(generate(model, p, None, cfg).token_ids)
    if cache is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps(gens))
    return gens


@torch.no_grad()
def step_cost(model, head: EagleHead, context: int = 128, reps: int = 30) -> dict:
    """Median seconds of one target step and one head step (one token each, with cache), as the engine runs them.

    The target step is the engine's runner of ``model`` (the fast runner where it covers the model,
    :func:`~treespec.models.fast.make_runner`; the eager Hugging Face runner is timed beside it, as
    ``eager_target_step_s``). The head step is what the head's runner (``head.as_runner()``) does for a
    new root: take the target's features of the newly committed position, one entry through the head (for
    a Kangaroo adapter: the early layers on the root, over the target's shared cache, then the adapter),
    the root's logits on the head's subset (what the tree builders ask for), keep it. Pass the head as it drafts
    (``head.for_inference(dtype)`` is the CLI's path: bf16 and packed on a CPU with native bf16).
    Target and head steps alternate, so both see the same state of the machine.
    """
    from ..drafting.base import DraftState
    from ..models.fast import make_runner
    from ..models.runner import ModelRunner
    from ..tree import TokenTree

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, head.cfg.target_vocab_size, (context + reps + 2,), generator=g)
    layers = tuple(head.feature_layers)
    drafter = head.as_runner()

    def head_step(root: int, new_hidden: torch.Tensor, target) -> None:
        """A new root at position ``root`` (the target holds every position before it); ``new_hidden`` ends with
        the target's state at ``root - 1``."""
        drafter.observe(DraftState(ids[: root + 1].tolist(), 1, new_hidden, target))
        chain = ids[drafter.length:root] if drafter.length < root else None
        tree = TokenTree.from_lists([-1], [int(ids[root])], "deterministic")
        drafter.forward(tree, torch.zeros(1, dtype=torch.long), chain, need_logits="subset")
        drafter.commit([0])

    result = {}
    for name, runner in (("eager", ModelRunner(model)), ("engine", make_runner(model, fast=True))):
        drafter.reset()
        last = runner.forward(None, None, ids[:context], need_hidden=True,
                              feature_layers=layers)["hidden"]  # [context, F]
        head_step(context, last, runner)
        t_target, t_head = [], []
        for i in range(reps):
            t0 = time.perf_counter()
            out = runner.forward(None, None, ids[context + i:context + i + 1], need_hidden=True, feature_layers=layers)
            t1 = time.perf_counter()
            head_step(context + i + 1, out["hidden"], runner)
            t2 = time.perf_counter()
            t_target.append(t1 - t0)
            t_head.append(t2 - t1)
        result[name] = (statistics.median(t_target), statistics.median(t_head), type(runner).__name__)
    (te, _, _), (tt, th, kind) = result["eager"], result["engine"]
    return {"target_step_s": tt, "head_step_s": th, "fraction": th / tt, "target_runner": kind,
            "eager_target_step_s": te, "eager_fraction": th / te,
            "head_dtype": str(head.lm_rows.dtype), "head_packed": head.inference_weights != "plain",
            "head_weights": head.inference_weights}


@torch.no_grad()
def chain_tau(model, head: EagleHead, prompts: list[list[int]], depth: int = 4, temperature: float = 0.0,
              new_tokens: int = 64, seed: int = 0) -> float:
    """Tau of a chain of ``depth`` head drafts in the engine: tokens emitted per target call, over ``prompts``
    (seeded per prompt, ``new_tokens`` each, sampled at ``temperature``)."""
    from ..generate import GenerationConfig, generate
    from ..sampling import SamplingConfig
    from ..trees.grow import ShapeDrafter
    from ..trees.shape import TreeShape

    emitted, calls = 0, 0
    for i, p in enumerate(prompts):
        cfg = GenerationConfig(max_new_tokens=new_tokens, sampling=SamplingConfig(temperature), seed=seed + i)
        out = generate(model, p, ShapeDrafter(head, TreeShape.chain(depth), "iid"), cfg)
        emitted += len(out.token_ids)
        calls += out.target_calls
    return emitted / max(calls, 1)
