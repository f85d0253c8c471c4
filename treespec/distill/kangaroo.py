"""Training Kangaroo's adapter on distillation corpora (``python -m treespec.distill kangaroo``).

The adapter (:class:`~treespec.drafting.kangaroo.KangarooAdapter`) reads, at every position ``j``, the
target's residual stream ``r_{L-1, j}`` after its first ``L`` layers. A corpus built with ``--feature-layers``
holding ``L - 1`` stores ``r_{L-1}`` at every position, so training needs no target forward at all. At inference the
adapter sees exactly these states (the early layers run on the drafted tokens themselves), so it
trains teacher-forced, at depth 1 only, on windows of whole sequences (its attention reads the
window's earlier states).

Labels at ``j``: the target's distribution after ``x_j`` restricted to the adapter's vocabulary
subset and renormalised (soft, recomputed from the stored last hidden state ``h_j`` and the frozen
LM-head rows) and the text token ``x_{j+1}`` (hard). Windows are a pure function of the step, so a
resumed run continues exactly (:mod:`.loop`); checkpoints are written atomically.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..drafting.kangaroo import KangarooAdapter, final_norm_gain, new_adapter
from ..files import atomic_write_json, recorded_path
from .corpus import load_manifest, read_shard
from .inputs import DistillInputError
from .losses import subset_distill_losses
from .loop import LoopConfig, check_subset_run, open_run, run_loop

CKPT_NAME = "kangaroo-ckpt.pt"  # one checkpoint, rewritten in place


@dataclass(frozen=True)
class AdapterTrainConfig:
    exit_layers: int = 2  # L: the adapter reads the target's residual stream after its first L layers
    steps: int = 300
    batch_size: int = 8  # windows per step
    seq_len: int = 128  # positions per window
    lr: float = 1e-3
    warmup: int = 20
    floor: float = 0.1  # final learning rate as a fraction of lr
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    w_hard: float = 0.1  # weight of the text token's cross-entropy beside the soft one
    num_heads: int = 8
    head_dim: int = 64
    ckpt_every: int = 25
    seed: int = 0
    max_shards: int | tuple[int, ...] | None = None  # the first shards of each corpus (one count, or one per corpus)
    time_limit_s: float | None = None

    def __post_init__(self) -> None:
        for name in ("exit_layers", "steps", "batch_size", "seq_len", "num_heads", "head_dim", "ckpt_every"):
            if getattr(self, name) < 1:
                raise DistillInputError(f"{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if not self.lr > 0 or self.w_hard < 0 or not 0 <= self.floor <= 1:
            raise DistillInputError("need lr > 0, w-hard >= 0 and 0 <= floor <= 1")
        shards = self.max_shards
        if isinstance(shards, (list, tuple)):  # the CLI gives a tuple: one count for every corpus, or one each
            shards = tuple(int(x) for x in shards)
            shards = shards[0] if len(shards) == 1 else shards
        if shards is not None and min(shards if isinstance(shards, tuple) else (shards,)) < 1:
            raise DistillInputError(f"max-shards must be counts >= 1, got {self.max_shards}")
        object.__setattr__(self, "max_shards", shards)


class StatePool:
    """The early-exit states' source in memory: per position the stored residual ``r_{L-1}`` and last hidden
    state ``h`` (bf16) and the token, for every finished shard of the corpora; :meth:`batch` cuts windows."""

    def __init__(self, corpora: list[str | Path], layer: int, max_shards: int | tuple[int, ...] | None = None) -> None:
        from .train import corpus_shards

        resid, hidden, tokens, starts, ends = [], [], [], [], []
        base = 0
        self.shard_names: list[str] = []  # "corpus/shard" of every shard read: the data a run trains on
        counts = max_shards if isinstance(max_shards, tuple) else (max_shards,) * len(corpora)
        if len(counts) != len(corpora):
            raise DistillInputError(f"max_shards={list(max_shards)} gives {len(counts)} counts for {len(corpora)} "
                                    "corpora; give one count, or one per corpus")
        for corpus, count in zip(corpora, counts):
            stored = list(load_manifest(corpus)["options"].get("feature_layers", []))
            if layer not in stored:
                raise DistillInputError(f"corpus {corpus}: the adapter reads target layer {layer}, the corpus stores "
                                        f"{stored} (build one with --feature-layers {layer})")
            col = stored.index(layer)
            for path, sh in corpus_shards(corpus, count):
                self.shard_names.append(f"{Path(corpus).name}/{path.name}")
                data = read_shard(path, ("offsets", "hidden", "tokens", "features"), sh["positions"])
                h = data["hidden"].shape[1]
                resid.append(data["features"][:, col * h:(col + 1) * h].clone())
                hidden.append(data["hidden"])
                tokens.append(data["tokens"].long())
                off = data["offsets"]
                starts.append(off[:-1] + base)
                ends.append(off[1:] + base)
                base += int(off[-1])
        if not base:
            raise DistillInputError("the corpora hold no positions yet")
        self.resid = torch.cat(resid)  # [N, H] bf16
        self.hidden = torch.cat(hidden)  # [N, H] bf16
        self.tokens = torch.cat(tokens)  # [N]
        self.starts, self.ends = torch.cat(starts), torch.cat(ends)  # [S] each: one sequence per entry
        lens = (self.ends - self.starts).float()
        self.weights = lens * (lens >= 2)  # a sequence is drawn by its length (positions equally often)
        if not bool((self.weights > 0).any()):
            raise DistillInputError("the corpora hold no sequence of 2 or more positions")
        self.num_positions = base

    def batch(self, size: int, seq_len: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
        """``size`` windows: ``resid`` / ``hidden`` ``[B, T, H]`` float32, ``positions`` ``[B, T]`` (in the
        sequence), ``next`` ``[B, T]`` the next token (-1 past the sequence's end), ``mask`` ``[B, T]``."""
        seqs = torch.multinomial(self.weights, size, replacement=True, generator=generator)  # [B]
        h = self.resid.shape[1]
        out = {"resid": torch.zeros(size, seq_len, h), "hidden": torch.zeros(size, seq_len, h),
               "positions": torch.zeros(size, seq_len, dtype=torch.long),
               "next": torch.full((size, seq_len), -1, dtype=torch.long),
               "mask": torch.zeros(size, seq_len, dtype=torch.bool)}
        for b, s in enumerate(seqs.tolist()):
            lo, hi = int(self.starts[s]), int(self.ends[s])
            t = min(seq_len, hi - lo)
            first = lo + int(torch.randint(hi - lo - t + 1, (1,), generator=generator))
            out["resid"][b, :t] = self.resid[first:first + t].float()
            out["hidden"][b, :t] = self.hidden[first:first + t].float()
            out["positions"][b, :t] = torch.arange(first - lo, first - lo + t)
            nxt = self.tokens[first + 1:min(first + 1 + t, hi)]
            out["next"][b, :nxt.numel()] = nxt
            out["mask"][b, :t] = True
        return out


def adapter_losses(adapter: KangarooAdapter, batch: dict, cfg: AdapterTrainConfig, sub_index: torch.Tensor
                   ) -> dict[str, torch.Tensor]:
    """Soft (the target's distribution on the subset) and hard (text token) cross-entropies over the real
    entries of a batch, and ``agree``: how often the adapter's top-1 is the target's top-1 on the subset."""
    mask = batch["mask"]
    feats = adapter(batch["resid"], batch["positions"], mask)[mask]  # [P, H]
    with torch.no_grad():
        soft = torch.softmax(adapter.logits(batch["hidden"][mask]), dim=-1)  # [P, |S|]
    nxt = batch["next"][mask]
    hard = torch.where(nxt >= 0, sub_index[nxt.clamp(min=0)], -1)  # [P]
    soft_loss, hard_loss, top1 = subset_distill_losses(adapter.logits(feats, float32=False), soft, hard)
    agree = (top1 == soft.argmax(-1)).float().mean()
    return {"total": soft_loss + cfg.w_hard * hard_loss, "soft": soft_loss.detach(), "hard": hard_loss.detach(),
            "agree": agree}


def train_adapter(target, corpora: list[str | Path], run_dir: str | Path, vocab_ids: torch.Tensor,
                  cfg: AdapterTrainConfig = AdapterTrainConfig(), *, progress: bool = True
                  ) -> tuple[KangarooAdapter, dict]:
    """Train (or resume) a Kangaroo adapter for ``target`` (float32) on ``corpora``; returns it and a summary.

    ``vocab_ids``: the subset it scores (e.g. the shipped EAGLE head's); a resumed run keeps its own."""
    from .train import _corpus_dirs

    _corpus_dirs(target, corpora, cfg)  # built with this target, or refused in one line
    run_dir, ckpt_path, ckpt = open_run(run_dir, CKPT_NAME)
    if ckpt is not None:
        check_subset_run(ckpt, ckpt_path, "Kangaroo adapter", asdict(cfg),
                         free=("time_limit_s", "max_shards"))  # the shards read are checked by name below
        vocab_ids = ckpt["vocab_ids"]
    adapter = new_adapter(target, vocab_ids, cfg.exit_layers, num_heads=cfg.num_heads, head_dim=cfg.head_dim,
                          seed=cfg.seed)
    adapter.train()
    # the output norm's gain starts at 1 and has to reach the scale of the target's own final-norm gains (a mean of
    # 26 on Gemma-3-270M): its steps are scaled by that size, as Adam's steps are about lr each
    scale = max(float(final_norm_gain(target).abs().mean()), 1.0)
    others = [p for n, p in adapter.named_parameters() if n != "out_norm.weight"]
    opt = torch.optim.AdamW([{"params": others}, {"params": [adapter.out_norm.weight], "weight_decay": 0.0,
                                                  "lr_scale": scale}], lr=cfg.lr, weight_decay=cfg.weight_decay)
    history, start_seconds = (ckpt["history"], ckpt["seconds"]) if ckpt is not None else ([], 0.0)
    seconds = start_seconds
    sub_index = torch.full((adapter.cfg.target_vocab_size,), -1, dtype=torch.long)
    sub_index[adapter.vocab_ids.cpu()] = torch.arange(adapter.vocab_ids.numel())
    pool = StatePool(corpora, adapter.cfg.feature_layer, cfg.max_shards)
    if ckpt is not None and "shards" in ckpt and ckpt["shards"] != pool.shard_names:
        raise DistillInputError(f"{run_dir} trained on other corpus shards ({len(ckpt.get('shards') or [])} then, "
                                f"{len(pool.shard_names)} now): pin them with --max-shards, or use another run "
                                "directory")
    device = adapter.qkv.weight.device
    sub_index = sub_index.to(device)
    loop = LoopConfig(steps=cfg.steps, lr=cfg.lr, warmup=cfg.warmup, floor=cfg.floor, clip=cfg.grad_clip,
                      ckpt_every=cfg.ckpt_every, time_limit_s=cfg.time_limit_s)

    def step_fn(step: int) -> dict:
        g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)  # windows: a function of the step
        batch = {k: v.to(device) for k, v in pool.batch(cfg.batch_size, cfg.seq_len, g).items()}
        return adapter_losses(adapter, batch, cfg, sub_index)

    def on_step(step: int, losses: dict) -> None:
        nonlocal seconds
        seconds = start_seconds + time.perf_counter() - t0
        if step % 5 == 0 or step == cfg.steps:
            row = {"step": step, "loss": round(float(losses["total"].detach()), 4),
                   "agree": round(float(losses["agree"]), 4), "seconds": round(seconds, 1)}
            history.append(row)
            if progress:
                print(f"step {step}: loss {row['loss']:.3f} top-1 agreement {row['agree']:.3f}", flush=True)

    def extra() -> dict:
        return {"config": asdict(cfg), "vocab_ids": adapter.vocab_ids.cpu(), "history": history, "seconds": seconds,
                "shards": pool.shard_names}

    t0 = time.perf_counter()
    step = run_loop(loop, adapter, opt, step_fn, run_dir=run_dir, name=CKPT_NAME, keys=("adapter", "opt"),
                    state=ckpt, extra=extra, on_step=on_step, state_path=ckpt_path)
    adapter.eval()
    summary = {"steps": step, "of": cfg.steps, "seconds": round(seconds, 1), "positions": pool.num_positions,
               "corpora": [recorded_path(c) for c in corpora], "trained_parameters": adapter.num_trained_parameters,
               "config": asdict(cfg), "last": history[-1] if history else None}
    atomic_write_json(run_dir / "summary.json", summary)
    return adapter, summary
