"""Training Medusa-style decoding heads on a distillation corpus (``python -m treespec.distill medusa``).

The corpus (:mod:`treespec.distill.corpus`) already holds what the heads need: the target's last
hidden state ``h_j`` at every position and the text. Head ``k`` learns, from ``h_j`` alone, the
target's distribution of ``x_{j+1+k}`` given the true prefix, which is the target's own softmax at
position ``j + k`` restricted to the heads' vocabulary subset (soft labels, recomputed from the
stored ``h_{j+k}`` and the frozen LM-head rows), plus the text token itself (hard label). Head
``k``'s loss is weighted by ``head_decay ** (k - 1)`` (Medusa, arXiv 2401.10774, weighs later, less
predictable heads down).

Positions are drawn at random from all corpora at once (a head looks at one position: no windows),
with per-corpus weights; checkpoints are written atomically and a run resumes where it stopped.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..drafting.medusa import MedusaHeads, new_medusa_heads
from ..files import atomic_write_json, recorded_path
from .corpus import read_shard
from .inputs import DistillInputError
from .loop import LoopConfig, check_subset_run, open_run, run_loop

CKPT_NAME = "medusa-ckpt.pt"  # one checkpoint, rewritten in place


@dataclass(frozen=True)
class MedusaTrainConfig:
    steps: int = 1000
    batch_size: int = 256  # positions per step
    lr: float = 2e-3
    warmup: int = 30
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    w_soft: float = 1.0
    w_hard: float = 0.2
    head_decay: float = 0.8
    num_heads: int = 3
    num_layers: int = 1
    vocab_size: int = 16384  # subset size when no subset is given
    ckpt_every: int = 100
    seed: int = 0
    time_limit_s: float | None = None

    def __post_init__(self) -> None:
        if self.steps < 1 or self.batch_size < 1 or self.num_heads < 1 or self.num_layers < 1:
            raise DistillInputError("steps, batch_size, num_heads and num_layers must be >= 1")
        if not self.lr > 0 or not 0 < self.head_decay <= 1 or self.w_soft < 0 or self.w_hard < 0:
            raise DistillInputError("need lr > 0, 0 < head_decay <= 1 and non-negative loss weights")


class PositionPool:
    """Every position of one or more corpora in memory: ``hidden`` (bf16), ``tokens`` and, per
    position, the end of its sequence; :meth:`batch` draws positions with per-corpus weights."""

    def __init__(self, corpora: list[str | Path], weights: list[float] | None = None) -> None:
        from .train import corpus_shards

        weights = weights or [1.0] * len(corpora)
        if len(weights) != len(corpora):
            raise DistillInputError(f"{len(weights)} weights for {len(corpora)} corpora")
        hidden, tokens, ends, w = [], [], [], []
        base = 0
        for corpus, cw in zip(corpora, weights):
            for path, sh in corpus_shards(corpus):
                data = read_shard(path, ("offsets", "hidden", "tokens"), sh["positions"])  # not the stored layers
                off = data["offsets"]
                n = int(off[-1])
                hidden.append(data["hidden"])
                tokens.append(data["tokens"].long())
                lens = off[1:] - off[:-1]
                ends.append(torch.repeat_interleave(off[1:], lens) + base)
                w.append(torch.full((n,), float(cw)))
                base += n
        if not base:
            raise DistillInputError("the corpora hold no positions yet")
        self.hidden = torch.cat(hidden)  # [N, H] bf16
        self.tokens = torch.cat(tokens)  # [N]
        self.ends = torch.cat(ends)  # [N] index one past the last position of the sequence
        # a position is usable if head 1 has a label (x_{j+2} exists)
        usable = (torch.arange(base) + 2 < self.ends)
        self.weights = torch.cat(w) * usable
        self.num_positions = int(usable.sum())

    def batch(self, size: int, num_heads: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
        """``idx`` [B], ``h`` [B, H], per head ``k``: label hidden ``h_{j+k}`` and text ``x_{j+k+1}`` with
        validity masks (sequences may end before a far head's label)."""
        idx = torch.multinomial(self.weights, size, replacement=True, generator=generator)  # [B]
        k = torch.arange(1, num_heads + 1)
        lab = idx[:, None] + k[None, :]  # [B, K] position of the label's hidden state
        ok_soft = lab < self.ends[idx][:, None]
        ok_hard = lab + 1 < self.ends[idx][:, None]
        last = self.hidden.shape[0] - 1
        return {"h": self.hidden[idx].float(), "h_label": self.hidden[lab.clamp(max=last)].float(),
                "ok_soft": ok_soft, "next": torch.where(ok_hard, self.tokens[(lab + 1).clamp(max=last)], -1)}


def medusa_losses(heads: MedusaHeads, batch: dict, cfg: MedusaTrainConfig, sub_index: torch.Tensor
                  ) -> dict[str, torch.Tensor]:
    """Soft (target softmax on the subset) + hard (text token) cross-entropies, per-head decayed."""
    logq = torch.log_softmax(heads(batch["h"]), dim=-1)  # [B, K, |S|]
    with torch.no_grad():
        p = torch.softmax(heads.logits(batch["h_label"]), dim=-1)  # [B, K, |S|]
    ok = batch["ok_soft"].float()  # [B, K]
    soft = -(p * logq).sum(-1)  # [B, K]
    nxt = batch["next"]
    hard_ids = torch.where(nxt >= 0, sub_index[nxt.clamp(min=0)], -1)  # [B, K] (-1: no label / outside S)
    hard = -logq.gather(-1, hard_ids.clamp(min=0)[..., None])[..., 0] * (hard_ids >= 0)
    decay = cfg.head_decay ** torch.arange(logq.shape[1], dtype=torch.float32)  # [K]
    per_head_soft = (soft * ok).sum(0) / ok.sum(0).clamp(min=1)
    per_head_hard = hard.sum(0) / (hard_ids >= 0).sum(0).clamp(min=1)
    total = (decay * (cfg.w_soft * per_head_soft + cfg.w_hard * per_head_hard)).sum()
    with torch.no_grad():
        agree = ((logq.argmax(-1) == p.argmax(-1)).float() * ok).sum(0) / ok.sum(0).clamp(min=1)
    return {"total": total, "soft": per_head_soft.detach(), "hard": per_head_hard.detach(), "agree": agree}


def train_medusa(target, corpora: list[str | Path], run_dir: str | Path, cfg: MedusaTrainConfig = MedusaTrainConfig(),
                 *, corpus_weights: list[float] | None = None, vocab_ids: torch.Tensor | None = None,
                 progress: bool = True) -> tuple[MedusaHeads, dict]:
    """Train (or resume) Medusa heads for ``target``; returns the heads and a summary.

    ``vocab_ids``: the subset the heads score (e.g. the shipped EAGLE head's); default: the
    ``cfg.vocab_size`` most frequent tokens of the corpora."""
    from .train import choose_vocab

    run_dir, ckpt_path, ckpt = open_run(run_dir, CKPT_NAME)
    if ckpt is not None:
        check_subset_run(ckpt, ckpt_path, "Medusa training", asdict(cfg))
        vocab_ids = ckpt["vocab_ids"]
    elif vocab_ids is None:
        vocab_ids = choose_vocab([Path(c) for c in corpora], cfg.vocab_size)
    heads = new_medusa_heads(target, vocab_ids, num_heads=cfg.num_heads, num_layers=cfg.num_layers)
    heads.train()
    opt = torch.optim.AdamW(heads.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    history, start_seconds = (ckpt["history"], ckpt["seconds"]) if ckpt is not None else ([], 0.0)
    seconds = start_seconds
    sub_index = torch.full((heads.cfg.target_vocab_size,), -1, dtype=torch.long)
    sub_index[heads.vocab_ids] = torch.arange(heads.vocab_ids.numel())
    pool = PositionPool(corpora, corpus_weights)
    loop = LoopConfig(steps=cfg.steps, lr=cfg.lr, warmup=cfg.warmup, floor=0.0, clip=cfg.grad_clip,
                      ckpt_every=cfg.ckpt_every, time_limit_s=cfg.time_limit_s)

    def step_fn(step: int) -> dict:
        g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)  # positions: a function of the step
        return medusa_losses(heads, pool.batch(cfg.batch_size, cfg.num_heads, g), cfg, sub_index)

    def on_step(step: int, losses: dict) -> None:
        nonlocal seconds
        seconds = start_seconds + time.perf_counter() - t0
        if step % 10 == 0 or step == cfg.steps:
            history.append({"step": step, "loss": float(losses["total"].detach()), "agree": losses["agree"].tolist(),
                            "seconds": round(seconds, 1)})
            if progress:
                print(f"step {step}: loss {float(losses['total'].detach()):.3f} top-1 agreement per head "
                      + " ".join(f"{a:.3f}" for a in losses["agree"].tolist()), flush=True)

    def extra() -> dict:
        return {"config": asdict(cfg), "vocab_ids": heads.vocab_ids, "history": history, "seconds": seconds}

    t0 = time.perf_counter()
    step = run_loop(loop, heads, opt, step_fn, run_dir=run_dir, name=CKPT_NAME, keys=("heads", "opt"), state=ckpt,
                    extra=extra, on_step=on_step, state_path=ckpt_path)
    heads.eval()
    summary = {"steps": step, "of": cfg.steps, "seconds": round(seconds, 1), "positions": pool.num_positions,
               "corpora": [recorded_path(c) for c in corpora], "corpus_weights": corpus_weights,
               "trained_parameters": heads.num_trained_parameters, "config": asdict(cfg),
               "last": history[-1] if history else None}
    atomic_write_json(run_dir / "summary.json", summary)
    return heads, summary


@torch.no_grad()
def evaluate_medusa(heads: MedusaHeads, corpus: str | Path, *, max_positions: int = 20_000) -> dict:
    """Per-head top-1 agreement with the target (on the subset-restricted target argmax and on the
    target's full-vocabulary argmax = the text token of a greedy corpus) over one corpus's positions."""
    pool = PositionPool([corpus])
    n = min(max_positions, pool.num_positions)
    idx = torch.nonzero(pool.weights > 0).flatten()[:n]
    K = heads.cfg.num_heads
    agree, text, count = torch.zeros(K), torch.zeros(K), torch.zeros(K)
    for s in range(0, idx.numel(), 1024):
        i = idx[s:s + 1024]
        lab = i[:, None] + torch.arange(1, K + 1)[None, :]
        ok = lab + 1 < pool.ends[i][:, None]
        last = pool.hidden.shape[0] - 1
        guess = heads.vocab_ids[heads(pool.hidden[i].float()).argmax(-1)]  # [b, K]
        t_arg = heads.vocab_ids[heads.logits(pool.hidden[lab.clamp(max=last)].float()).argmax(-1)]
        agree += ((guess == t_arg) & ok).sum(0)
        text += ((guess == pool.tokens[(lab + 1).clamp(max=last)]) & ok).sum(0)
        count += ok.sum(0)
    return {"positions": int(n), "top1_agreement_subset": (agree / count.clamp(min=1)).tolist(),
            "top1_text": (text / count.clamp(min=1)).tolist()}
