"""Measuring a draft head against its target on held-out prompts (used only to measure).

* ``top1_agreement`` (T=0): over the positions of the target's own greedy continuations, how often
  the head's most likely token equals the target's;
* ``acceptance_t1`` (T=1): over the positions of the target's sampled (T=1) continuations, the
  mean single-draft acceptance ``sum_x min(p(x), q(x))``;
both teacher-forced from the target's true hidden states, at the head's first level and (``depth_metrics``)
at deeper tree levels along the same text.
* ``step_cost``: one head step (one token, with cache, subset logits) / one target step (one token,
  with cache, full logits, the engine's runner), median wall time on this machine.
* ``tau`` (optional): tokens per target pass of a chain in the engine at T=0 and T=1.
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
from ..models.features import model_features
from .corpus import lm_logits


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
def depth_metrics(model, head: EagleHead, prompts: list[list[int]], gens: list[list[int]], depths: int = 1,
                  groups: list[str] | None = None) -> dict:
    """Top-1 agreement and sum min(p, q) of the head at tree depths ``1..depths`` over generated positions.

    Depth ``k`` at position ``j`` is the head's q for the node ``k`` levels below a root at
    ``j - k + 1`` whose path follows the text (:meth:`EagleHead.unroll`): along the target's greedy
    text, its top-1 agreement is the acceptance of depth ``k`` of a chain given that depths
    ``1..k-1`` were accepted; along sampled text, sum min(p, q) is the single-draft acceptance there.
    Positions whose depth-``k`` root would precede position 1 are left out of depth ``k``.
    Returns per-depth lists ``top1_agreement_by_depth``, ``sum_min_pq_by_depth``, ``positions_by_depth``
    and the depth-1 values as ``top1_agreement`` / ``sum_min_pq`` / ``positions``.
    ``groups`` (one label per prompt, e.g. its task): also ``by_group``, the same per-depth lists for the
    prompts of each label (a position-weighted split of the totals).
    """
    if depths < 1:
        raise ValueError("depths must be >= 1")
    if groups is not None and len(groups) != len(prompts):
        raise ValueError(f"groups: {len(groups)} labels for {len(prompts)} prompts")
    sums: dict[str | None, list[list[float]]] = {}  # label -> [agree, accept, count] per depth
    device = head.lm_rows.device
    for i, (prompt, gen) in enumerate(zip(prompts, gens)):
        if not gen:
            continue
        agree, accept, count = sums.setdefault(None if groups is None else groups[i],
                                               [[0.0] * depths, [0.0] * depths, [0] * depths])
        seq = torch.tensor(prompt + gen, device=device)
        f = model_features(model, seq[None], layers=head.cfg.feature_layers)[0].float()  # [n, F]
        h = head.last_hidden(f)  # [n, H]
        feats = head.unroll(f[None, :-1], seq[None, 1:], torch.arange(1, seq.numel(), device=device)[None], depths)
        hi = seq.numel() - 1  # positions j in [lo, hi) predict generated tokens
        p = torch.softmax(lm_logits(model, h[max(len(prompt) - 1, 1):hi]), dim=-1)  # [g, V]
        top_p = p.argmax(-1)
        for k in range(1, depths + 1):
            lo = max(len(prompt) - 1, k)  # feats[.][j - 1] is position j; depth k needs j >= k
            if lo >= hi:
                continue
            pk = p[lo - max(len(prompt) - 1, 1):]
            q_sub = torch.softmax(head.logits(feats[k - 1][0, lo - 1:hi - 1]), dim=-1)  # [g_k, |S|]
            agree[k - 1] += float((head.vocab_ids[q_sub.argmax(-1)] == top_p[-pk.shape[0]:]).sum())
            accept[k - 1] += float(torch.minimum(pk[:, head.vocab_ids], q_sub).sum())
            count[k - 1] += hi - lo

    def summarise(agree: list[float], accept: list[float], count: list[int]) -> dict:
        by_agree = [a / max(n, 1) for a, n in zip(agree, count)]
        by_accept = [a / max(n, 1) for a, n in zip(accept, count)]
        return {"positions": count[0], "top1_agreement": by_agree[0], "sum_min_pq": by_accept[0],
                "positions_by_depth": count, "top1_agreement_by_depth": by_agree, "sum_min_pq_by_depth": by_accept}

    totals = [[sum(v[j][k] for v in sums.values()) for k in range(depths)] for j in range(3)]
    out = summarise(totals[0], totals[1], [int(n) for n in totals[2]])
    if groups is not None:
        out["by_group"] = {g: summarise(*v) for g, v in sorted(sums.items())}
    return out


@torch.no_grad()
def step_cost(model, head: EagleHead, context: int = 128, reps: int = 30) -> dict:
    """Median seconds of one target step and one head step (one token each, with cache), as the engine runs them.

    The target step is the engine's runner of ``model`` (the fast runner where it covers the model,
    :func:`~treespec.models.fast.make_runner`; the eager Hugging Face runner is timed beside it, as
    ``eager_target_step_s``). The head step is what :class:`~treespec.drafting.head_runner.HeadRunner`
    does for a new root: take the target's last hidden state, one entry through the head, the root's
    logits on the head's subset (what the tree builders ask for), keep it. Pass the head as it drafts
    (``head.for_inference(dtype)`` is the CLI's path: bf16 and packed on a CPU with native bf16).
    Target and head steps alternate, so both see the same state of the machine.
    """
    from ..drafting.base import DraftState
    from ..drafting.head_runner import HeadRunner
    from ..models.fast import make_runner
    from ..models.runner import ModelRunner
    from ..tree import TokenTree

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, head.cfg.target_vocab_size, (context + reps + 1,), generator=g)
    layers = head.cfg.feature_layers
    drafter = HeadRunner(head)

    def head_step(root: int, new_hidden: torch.Tensor, chain: torch.Tensor | None) -> None:
        """Root at position ``root``; ``new_hidden`` ends with the target's state at ``root - 1``."""
        drafter.observe(DraftState(ids[: root + 1].tolist(), 1, new_hidden))
        tree = TokenTree.from_lists([-1], [int(ids[root])], "deterministic")
        drafter.forward(tree, torch.zeros(1, dtype=torch.long), chain, need_logits="subset")
        drafter.commit([0])

    result = {}
    for name, runner in (("eager", ModelRunner(model)), ("engine", make_runner(model, fast=True))):
        drafter.reset()
        hidden = runner.forward(None, None, ids[:context], need_hidden=True, feature_layers=layers)["hidden"]  # [context, F]
        head_step(context - 1, hidden[:-1], ids[: context - 1])
        last = hidden[-1:]  # [1, F] the target's state at the position before the next root
        t_target, t_head = [], []
        for i in range(reps):
            t0 = time.perf_counter()
            out = runner.forward(None, None, ids[context + i:context + i + 1], need_hidden=True, feature_layers=layers)
            t1 = time.perf_counter()
            head_step(context + i, last, None)
            t2 = time.perf_counter()
            last = out["hidden"]
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
