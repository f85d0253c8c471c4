"""Distilling an :class:`~treespec.drafting.head.EagleHead` from a corpus built by :mod:`.corpus`.

Training example at position ``j`` of a corpus sequence: input ``(h_{j-1}, x_j)``, targets

* soft: the target's next-token distribution at ``j``; ``soft="subset"`` (default) recomputes it
  exactly on the draft's vocabulary subset from the stored ``h_j`` (the head's LM rows *are* the
  target's), renormalised there; ``soft="topk"`` uses the stored top-k log-probabilities
  (renormalised over the top-k tokens inside the subset);
* hard: the corpus token ``x_{j+1}`` (cross-entropy, skipped when outside the subset);
* feature: ``h_j`` (the head's output feature should imitate it: relative MSE).

Batches are random windows of random sequences; which shard and which windows a step uses is a
pure function of (seed, step), so resuming from a checkpoint continues the identical stream.
Checkpoints (head + optimizer + step) are written atomically every ``ckpt_every`` steps under the
run directory (default ``~/.cache/treespec/distill/runs/<name>``), outside the repository.
"""

from __future__ import annotations

import math
import os
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from ..drafting.eagle3 import Eagle3Head, new_eagle3_head
from ..drafting.head import EagleHead, HeadConfig, LayerHead, new_head
from ..drafting.weights_file import build_checked
from ..files import atomic_write_json, recorded_path, remove_stale_temporaries
from ..models.features import normalise_feature_layers
from .corpus import SHARD_TENSORS, load_manifest, read_shard
from .inputs import (DistillInputError, contained_path, first_line, load_checkpoint, read_head_file, require_dir,
                     require_type)
from .losses import subset_distill_losses, subset_tv_loss
from .loop import LoopConfig, latest_checkpoint, open_run, run_loop

CKPT_NAME = "ckpt-{step}.pt"  # the newest ``keep_ckpts`` are kept
HEAD_LAYOUTS = ("eagle", "eagle3")  # TrainConfig.layout: treespec's EAGLE head, EAGLE-3's layout (serving engines)


def distill_root() -> Path:
    from ..models.loading import cache_root

    return cache_root() / "distill"


@dataclass
class TrainConfig:
    steps: int = 1000
    batch_size: int = 8  # windows per step
    seq_len: int = 256  # positions per window
    lr: float = 1e-3
    warmup: int = 50
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    w_soft: float = 1.0
    w_hard: float = 0.1
    w_feat: float = 0.5
    w_tv: float = 0.0  # total-variation loss (1 - sum min(p, q) on the subset: the acceptance itself)
    soft: str = "subset"  # "subset" | "topk"
    vocab_size: int = 16384  # draft vocabulary subset size
    num_heads: int = 8
    head_dim: int | None = None
    intermediate_size: int | None = None
    feature_noise: float = 0.0  # uniform noise on input features (EAGLE), relative to their RMS
    depths: int = 1  # tree depths trained (> 1: the training-time test, EAGLE-3 arXiv 2503.01840)
    depth_decay: float = 0.8  # loss weight of depth k: depth_decay ** (k - 1), normalised over the depths
    feature_layers: tuple[int, ...] = ()  # target layers read besides h (fused features, EAGLE-3; the corpus stores them)
    # "eagle": treespec's EAGLE head; "eagle3": EAGLE-3's layout, which vLLM / SGLang / speculators load (its
    # feature_layers default to the engines' [2, L // 2, L - 3] inputs, treespec's layers (1, 8, 14) on 18 layers)
    layout: str = "eagle"
    steps_per_shard: int = 50  # consecutive steps drawn from one shard (fewer loads)
    ckpt_every: int = 200
    keep_ckpts: int = 2
    seed: int = 0
    amp: str = "auto"  # "auto" | "bf16" | "off"
    # the subset products (a step's largest: [positions, H] x [H, |S|]; the head's logits and the target's soft
    # labels) under the same autocast as the head; False keeps them in float32 (every run before this field did)
    logits_amp: bool = True
    time_limit_s: float | None = None
    # train on the first N shards of each corpus only (pins a growing corpus); a tuple: one N per corpus, in order
    max_shards: int | tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "seq_len", "vocab_size", "num_heads", "steps_per_shard", "ckpt_every",
                     "keep_ckpts", "depths"):
            if getattr(self, name) < 1:
                raise DistillInputError(f"{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        for name in ("warmup", "weight_decay", "w_soft", "w_hard", "w_feat", "w_tv", "feature_noise", "depth_decay"):
            if not getattr(self, name) >= 0:
                raise DistillInputError(f"{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")
        if not self.lr > 0 or not self.grad_clip > 0:
            raise DistillInputError(f"lr and grad-clip must be > 0, got {self.lr} and {self.grad_clip}")
        for name in ("head_dim", "intermediate_size"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise DistillInputError(f"{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if isinstance(self.max_shards, (list, tuple)):
            if any(x is None for x in self.max_shards):
                raise DistillInputError(f"max-shards: give a count for every corpus, got {list(self.max_shards)}")
            self.max_shards = tuple(int(x) for x in self.max_shards)
            if len(self.max_shards) == 1:
                self.max_shards = self.max_shards[0]
        counts = self.max_shards if isinstance(self.max_shards, tuple) else (self.max_shards,)
        if not counts or any(c is not None and c < 1 for c in counts):
            raise DistillInputError(f"max-shards must be >= 1, got {self.max_shards}")
        try:
            self.feature_layers = normalise_feature_layers(self.feature_layers)
        except ValueError as err:
            raise DistillInputError(str(err)) from None
        if self.layout not in HEAD_LAYOUTS:
            raise DistillInputError(f"layout must be one of {', '.join(HEAD_LAYOUTS)}, got {self.layout!r}")
        if self.soft not in ("subset", "topk") or self.amp not in ("auto", "bf16", "off"):
            raise DistillInputError(f"soft must be subset / topk and amp auto / bf16 / off, got {self.soft!r}, "
                                    f"{self.amp!r}")


def head_class(layout: str) -> type[LayerHead]:
    """The head class of a layout (:data:`HEAD_LAYOUTS`)."""
    return Eagle3Head if layout == "eagle3" else EagleHead


def autocast_for(device: torch.device, amp: str):
    from ..models.loading import cpu_supports_bf16

    if amp == "off":
        return nullcontext(), "fp32"
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return torch.autocast("cuda", dtype=torch.bfloat16), "bf16"
        return nullcontext(), "fp32"
    if amp == "bf16" or (amp == "auto" and cpu_supports_bf16()):
        return torch.autocast("cpu", dtype=torch.bfloat16), "bf16"
    return nullcontext(), "fp32"


def corpus_shards(corpus_dir, max_shards: int | tuple[int, ...] | None = None) -> list[tuple[Path, dict]]:
    """(file, shard entry) of every finished shard of one corpus directory or a list of them; with
    ``max_shards``, the first ``max_shards`` of each directory, or the first ``max_shards[i]`` of directory
    ``i`` (refused where fewer are finished, or where the counts do not match the directories)."""
    dirs = [corpus_dir] if isinstance(corpus_dir, (str, Path)) else list(corpus_dir)
    counts = max_shards if isinstance(max_shards, tuple) else (max_shards,) * len(dirs)
    if len(counts) != len(dirs):
        raise DistillInputError(f"max_shards={list(max_shards)} gives {len(counts)} counts for {len(dirs)} corpora; "
                                "give one count, or one per corpus")
    out = []
    for d, count in zip(dirs, counts):
        shards = load_manifest(d)["shards"]
        if count is not None:
            if len(shards) < count:
                raise DistillInputError(f"corpus {d}: {len(shards)} finished shards, fewer than max_shards={count}")
            shards = shards[:count]
        out += [(contained_path(d, sh["file"], f"corpus {d}"), sh) for sh in shards]
    return out


def choose_vocab(corpus_dir, size: int, always: list[int] = (), extra_counts: torch.Tensor | None = None,
                 max_shards: int | None = None) -> torch.Tensor:
    """The ``size`` most frequent target tokens of the corpus (next tokens + top-k mass), sorted ids.

    ``extra_counts`` ``[V]`` (e.g. token counts of every train prompt, available before the corpus
    is finished) is added to the corpus counts."""
    first = corpus_dir if isinstance(corpus_dir, (str, Path)) else corpus_dir[0]
    man = load_manifest(first)
    counts = torch.zeros(man["vocab_size"], dtype=torch.float64)
    for path, _ in corpus_shards(corpus_dir, max_shards):
        shard_counts = read_shard(path, ("counts",))["counts"]
        if shard_counts.shape != counts.shape:
            raise DistillInputError(f"corpus shard {path}: damaged (counts of {tuple(shard_counts.shape)} tokens, "
                                    f"the manifest says {man['vocab_size']})")
        counts += shard_counts.double()
    if extra_counts is not None:
        counts += extra_counts.double().to(counts.device)
    for t in always:
        counts[t] = float("inf")
    size = min(size, man["vocab_size"])
    top = torch.topk(counts, size).indices
    top = top[counts[top] > 0]
    return torch.sort(top).values


class ShardSampler:
    """Deterministic (seed, step) -> batch of windows; keeps one shard in memory.

    ``hidden_in`` holds the target's features for a head reading ``feature_layers`` (the stored
    outputs of those layers, then the last hidden state; :mod:`treespec.models.features`); every
    corpus must store them."""

    def __init__(self, corpus_dir: str | Path, cfg: TrainConfig, feature_layers: tuple[int, ...] | None = None) -> None:
        feature_layers = cfg.feature_layers if feature_layers is None else tuple(feature_layers)
        self.shards = corpus_shards(corpus_dir, cfg.max_shards)
        if not self.shards:
            raise DistillInputError(f"corpus {corpus_dir}: no shards yet")
        self.cfg = cfg
        self.columns = {}  # corpus dir -> stored feature columns, in the head's layer order
        dirs = [corpus_dir] if isinstance(corpus_dir, (str, Path)) else list(corpus_dir)
        for d in dirs:
            stored = list(load_manifest(d)["options"].get("feature_layers", []))
            missing = [x for x in feature_layers if x not in stored]
            if missing:
                raise DistillInputError(f"corpus {d}: the head reads target layers {list(feature_layers)}, the corpus "
                                        f"stores {stored} (rebuild it with --feature-layers)")
            self.columns[str(Path(d))] = [stored.index(x) for x in feature_layers]
        w = torch.tensor([s["positions"] for _, s in self.shards], dtype=torch.float64)
        self.weights = w / w.sum()
        self._loaded: tuple[int, dict] | None = None

    def _shard(self, i: int) -> dict:
        if self._loaded is None or self._loaded[0] != i:
            path, entry = self.shards[i]
            names = SHARD_TENSORS + (("features",) if self.columns[str(path.parent)] else ())  # layers if read
            self._loaded = (i, read_shard(path, names, entry["positions"]))
            self._loaded_path = path
        return self._loaded[1]

    def batch(self, step: int) -> dict[str, torch.Tensor]:
        cfg = self.cfg
        g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step // cfg.steps_per_shard)
        shard = self._shard(int(torch.multinomial(self.weights, 1, generator=g)))
        g = torch.Generator().manual_seed(cfg.seed * 7_919 + step * 2 + 1)
        off = shard["offsets"]
        lens = off[1:] - off[:-1]
        usable = torch.nonzero(lens >= 2).flatten()
        pick = usable[torch.randint(len(usable), (cfg.batch_size,), generator=g)]
        rows = []
        for s in pick.tolist():
            n = int(lens[s])
            t = min(cfg.seq_len, n - 1)  # examples j = start+1 .. start+t
            start = int(torch.randint(n - t, (1,), generator=g))  # window of positions [start, start + t]
            rows.append((int(off[s]) + start, t, start))
        T = max(t for _, t, _ in rows)
        B = len(rows)
        H = shard["hidden"].shape[1]
        k = shard["topk_ids"].shape[1]
        cols = self.columns[str(self._loaded_path.parent)]
        out = {"hidden_in": torch.zeros(B, T, (len(cols) + 1) * H), "hidden_out": torch.zeros(B, T, H),
               "tokens": torch.zeros(B, T, dtype=torch.long), "next": torch.full((B, T), -1, dtype=torch.long),
               "topk_ids": torch.zeros(B, T, k, dtype=torch.long), "topk_logp": torch.full((B, T, k), -math.inf),
               "positions": torch.zeros(B, T, dtype=torch.long), "mask": torch.zeros(B, T, dtype=torch.bool)}
        for b, (a, t, start) in enumerate(rows):
            seq_end = int(off[torch.searchsorted(off, a, right=True)])  # end of this sequence
            out["hidden_in"][b, :t, -H:] = shard["hidden"][a:a + t].float()
            if cols:  # the head's layers, in its order, from the stored ones (window rows only)
                out["hidden_in"][b, :t, :-H] = shard["features"][a:a + t].unflatten(1, (-1, H))[:, cols].flatten(1)
            out["hidden_out"][b, :t] = shard["hidden"][a + 1:a + 1 + t].float()
            out["tokens"][b, :t] = shard["tokens"][a + 1:a + 1 + t].long()
            nxt = shard["tokens"][a + 2:min(a + 2 + t, seq_end)].long()
            out["next"][b, :nxt.numel()] = nxt
            out["topk_ids"][b, :t] = shard["topk_ids"][a + 1:a + 1 + t].long()
            out["topk_logp"][b, :t] = shard["topk_logp"][a + 1:a + 1 + t].float()
            out["positions"][b, :t] = torch.arange(start + 1, start + 1 + t)
            out["mask"][b, :t] = True
        return out


def compute_losses(head: EagleHead, batch: dict, cfg: TrainConfig, sub_index: torch.Tensor,
                   autocast=nullcontext()) -> dict[str, torch.Tensor]:
    """Losses of one batch, at every trained depth (``cfg.depths``; depth 1 = the teacher-forced pass).

    The depth-``k`` feature at window entry ``j`` comes from :meth:`EagleHead.unroll` (the node ``k``
    levels below a root at ``j - k + 1``) and has the same targets as depth 1 at ``j``: the target's
    distribution after ``x_j``, the next token and ``h_j``. Entries ``j < k - 1`` have no root inside
    the window and are left out. Returned: the weighted ``total``, the depth-weighted ``soft`` /
    ``hard`` / ``feat``, ``agree`` (depth 1) and ``agree_d{k}`` per depth.
    """
    device = head.fc.weight.device
    b = {k: v.to(device) for k, v in batch.items()}
    hin = b["hidden_in"]  # [B, T, F]: the target's features
    if cfg.feature_noise > 0 and head.training:  # relative to the RMS of each feature slice
        rms = hin.unflatten(-1, (-1, head.cfg.hidden_size)).pow(2).mean(-1, keepdim=True).sqrt()
        noise = (torch.rand_like(hin) * 2 - 1).unflatten(-1, rms.shape[-2:-1] + (-1,))
        hin = hin + (noise * cfg.feature_noise * rms).flatten(-2)
    with autocast:
        feats = head.unroll(hin, b["tokens"], b["positions"], cfg.depths)  # depths x [B, T, H]
    weights = [cfg.depth_decay ** k for k in range(cfg.depths)]
    norm = sum(weights) or 1.0
    losses: dict[str, torch.Tensor] = {}
    logits_ctx = autocast if cfg.logits_amp else nullcontext()
    # every entry of depth 1 (deeper depths use a subset of them) as flat row indices into [B * T], found on the
    # batch's own mask (built on the host): no data-dependent shape, nor a test per depth, on the device
    rows, longest = _mask_rows(batch["mask"])
    m1 = rows.to(device)  # [P]
    target_h = _pick(b["hidden_out"], m1)  # [P, H]: h_j, the targets of every depth at entry j
    soft, target_top1 = _soft_labels(head, b, m1, cfg, sub_index, target_h, logits_ctx)  # once for every depth
    nxt = _pick(b["next"], m1)
    hard = torch.where(nxt >= 0, sub_index[nxt.clamp(min=0)], -1)  # [P]: the next token's subset index, or -1
    entry = m1 % b["mask"].shape[1]  # [P]: each row's index in its window
    for k, (feat_k, w) in enumerate(zip(feats, weights), start=1):
        keep = entry >= k - 1  # [P]: depth k has a root inside the window (the other rows count for nothing)
        if longest < k:  # no row kept
            continue
        part = _depth_losses(head, _pick(feat_k.float(), m1), keep, target_h, soft, hard, target_top1, logits_ctx,
                             tv=cfg.w_tv > 0)
        for name in ("soft", "hard", "feat", "tv"):
            if name in part:
                losses[name] = losses.get(name, 0.0) + part[name] * (w / norm)
        losses[f"agree_d{k}"] = part["agree"]
    losses["agree"] = losses["agree_d1"]
    losses["total"] = cfg.w_soft * losses["soft"] + cfg.w_hard * losses["hard"] + cfg.w_feat * losses["feat"]
    if "tv" in losses:
        losses["total"] = losses["total"] + cfg.w_tv * losses["tv"]
    return losses


def _mask_rows(mask: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The entries of ``mask`` ``[B, T]`` as flat row indices ``[P]`` into ``[B * T]`` (row-major, the order of
    ``x[mask]``), and the longest window (1 + the largest entry index; 0 when none)."""
    rows = torch.nonzero(mask.flatten()).squeeze(1)  # [P]
    return rows, (int((rows % mask.shape[1]).max()) + 1 if rows.numel() else 0)


def _pick(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """``x`` ``[B, T, ...]`` at the entries ``m``: a bool mask ``[B, T]`` (``x[m]``) or flat row indices ``[P]``
    (:func:`_mask_rows`; the same rows, by ``index_select``: no data-dependent shape) -> ``[P, ...]``."""
    return x[m] if m.dtype == torch.bool else x.flatten(0, 1).index_select(0, m)


def _soft_labels(head: EagleHead, b: dict, m: torch.Tensor, cfg: TrainConfig, sub_index: torch.Tensor,
                 target_h: torch.Tensor, logits_ctx) -> tuple[torch.Tensor, torch.Tensor]:
    """The soft labels ``[P, |S|]`` of the entries ``m`` (a mask or row indices, :func:`_pick`) and the target's
    top-1 token ``[P]`` there.

    ``cfg.soft == "subset"``: the target's distribution renormalised on the subset, from ``h_j`` and the
    head's (= the target's) LM rows, under ``logits_ctx`` like every subset product (bf16 autocast
    rounds these logits as the target's own bf16 forward does); ``"topk"``: the stored top-k
    probabilities inside the subset, renormalised, as dense rows."""
    with torch.no_grad():
        if cfg.soft == "subset":
            with logits_ctx:
                soft = torch.softmax(head.logits(target_h), dim=-1)  # [P, |S|]
            k = b["topk_ids"].shape[-1]
            return soft, _pick(b["topk_ids"], m)[:, 0] if k else head.vocab_ids[soft.argmax(-1)]
        ids = _pick(b["topk_ids"], m)  # [P, k]
        sub = sub_index[ids]
        w = _pick(b["topk_logp"], m).exp() * (sub >= 0)
        w = w / w.sum(-1, keepdim=True).clamp(min=1e-12)
        soft = torch.zeros(ids.shape[0], head.vocab_ids.numel(), device=ids.device).scatter_add_(1, sub.clamp(min=0), w)
        return soft, ids[:, 0]


def _depth_losses(head: EagleHead, feat: torch.Tensor, keep: torch.Tensor, target_h: torch.Tensor,
                  soft: torch.Tensor, hard: torch.Tensor, target_top1: torch.Tensor,
                  logits_ctx=nullcontext(), tv: bool = False) -> dict[str, torch.Tensor]:
    """soft / hard / feature losses and top-1 agreement of features ``feat`` ``[P, H]``, averaged over the rows
    ``keep`` ``[P]``, against the target's ``h_j`` ``target_h`` ``[P, H]``, soft labels ``soft`` ``[P, |S|]``,
    hard labels ``hard`` ``[P]`` (subset index or -1) and top-1 tokens ``target_top1`` ``[P]``; with ``tv``
    also the total-variation loss against the soft labels (:func:`~.losses.subset_tv_loss`)."""
    with logits_ctx:
        logits = head.logits(feat, float32=False)  # [P, |S|] (bf16 under autocast)
    losses = {}
    losses["soft"], losses["hard"], top1 = subset_distill_losses(logits, soft, hard, keep)
    if tv:
        losses["tv"] = subset_tv_loss(logits, soft, keep)
    kept = keep.float()[:, None]  # [P, 1]
    losses["feat"] = ((feat - target_h).pow(2) * kept).sum() / (target_h.pow(2) * kept).sum().clamp(min=1e-12)
    losses["agree"] = ((head.vocab_ids[top1] == target_top1).float() * keep).sum() / keep.sum()
    return losses


def _head_from_checkpoint(state: dict, path: Path) -> EagleHead:
    """The head a training checkpoint holds (export, train resume). Its config is checked against the
    stored tensors before anything is allocated (:func:`~treespec.drafting.weights_file.build_checked`,
    as for head files: sizes beyond the stored tensors are refused, the module is probed on the meta
    device), so a small checkpoint declaring a huge head is a named error, not gigabytes of memory."""
    weights, vocab_ids = state.get("head"), state.get("vocab_ids")
    try:
        if not isinstance(weights, dict) or not all(isinstance(v, torch.Tensor) for v in weights.values()) \
                or not isinstance(vocab_ids, torch.Tensor) or not isinstance(state.get("head_config"), dict):
            raise TypeError("expected 'head' tensors, 'vocab_ids' and a 'head_config' dict")
        layout = state.get("head_layout", "eagle")
        if layout not in HEAD_LAYOUTS:
            raise ValueError(f"head_layout {layout!r} is none of {', '.join(HEAD_LAYOUTS)}")
        head = build_checked(path, "head", HeadConfig, state["head_config"], weights,
                             lambda cfg: head_class(layout)(cfg, vocab_ids))
        head.load_state_dict(weights)
    except (KeyError, TypeError, ValueError, RuntimeError) as err:
        raise DistillInputError(f"checkpoint {path}: not a head training checkpoint ({type(err).__name__}: "
                                f"{first_line(err, 300).removeprefix(f'{path}: ')})") from None
    return head


def _corpus_dirs(target, corpus_dir: str | Path | list, cfg: TrainConfig) -> tuple[list, int]:
    """The corpus directories (checked to be built with ``target``) and the positions training draws from."""
    vocab = target.get_output_embeddings().weight.shape[0]
    dirs = [corpus_dir] if isinstance(corpus_dir, (str, Path)) else list(corpus_dir)
    mans = [load_manifest(d) for d in dirs]
    for d, man in zip(dirs, mans):
        if man["vocab_size"] != vocab or man["hidden_size"] != target.get_input_embeddings().weight.shape[1]:
            raise DistillInputError(f"corpus {d}: built with another target (vocabulary / hidden size differ)")
    return dirs, sum(sh["positions"] for _, sh in corpus_shards(dirs, cfg.max_shards))


def _resumed_config(state: dict, ckpt_path: Path, cfg: TrainConfig, log) -> TrainConfig:
    """``cfg`` as a resumed run continues it: the data it trained on must not change; a run from before
    ``logits_amp`` keeps its float32 subset products."""
    if not isinstance(state.get("train_config", {}), dict):
        raise DistillInputError(f"checkpoint {ckpt_path}: 'train_config' must be a dict")
    pinned = state.get("train_config", {}).get("max_shards")
    if pinned != cfg.max_shards:  # the data a run trains on is part of its identity
        raise DistillInputError(f"{ckpt_path}: the run trained on max_shards={pinned}, this call asks for "
                                f"max_shards={cfg.max_shards}; give the same value or start a new run")
    layout = state.get("head_layout", "eagle")
    if layout != cfg.layout:
        raise DistillInputError(f"{ckpt_path}: the run trains a head of layout {layout}; give --layout {layout} "
                                "or start a new run")
    if "logits_amp" not in state.get("train_config", {}) and cfg.logits_amp:
        cfg = replace(cfg, logits_amp=False)  # a run from before the option keeps its float32 subset products
        log(f"{ckpt_path}: a run from before logits_amp; it continues with its float32 subset products")
    return cfg


def _starting_head(target, corpus_dir, cfg: TrainConfig, state: dict | None, ckpt_path: Path | None,
                   init_head: str | Path | None, vocab_counts: torch.Tensor | None, log) -> EagleHead:
    """The head training starts from: the checkpoint's, ``init_head``'s, or a new one on a chosen subset."""
    if state is not None:
        head = _head_from_checkpoint(state, ckpt_path)
        head.attach(target)
        log(f"resuming from {ckpt_path} (step {state['step']})")
        return head
    if init_head is not None:
        return read_head_file(init_head, head_class(cfg.layout).load, target)
    from ..models.loading import eos_token_ids

    ids = choose_vocab(corpus_dir, cfg.vocab_size, sorted(eos_token_ids(target)), vocab_counts, cfg.max_shards)
    sizes = {"num_heads": cfg.num_heads, "head_dim": cfg.head_dim, "intermediate_size": cfg.intermediate_size,
             "seed": cfg.seed}
    if cfg.layout == "eagle3":
        try:
            return new_eagle3_head(target, ids, feature_layers=cfg.feature_layers or None, **sizes)
        except ValueError as err:
            raise DistillInputError(f"layout eagle3: {err}") from None
    return new_head(target, ids, feature_layers=cfg.feature_layers, **sizes)


def _feature_layers_config(cfg: TrainConfig, head: EagleHead, resumed: bool) -> TrainConfig:
    """``cfg`` with the head's feature layers (asking for others than the head reads is refused)."""
    if cfg.feature_layers == head.cfg.feature_layers:
        return cfg
    if cfg.feature_layers:  # asked for layers the resumed / initial head does not read
        raise DistillInputError(f"feature-layers {list(cfg.feature_layers)}: the "
                                f"{'checkpoint' if resumed else 'initial head'} reads "
                                f"{list(head.cfg.feature_layers)}; give those (or none) or start a new run")
    return replace(cfg, feature_layers=head.cfg.feature_layers)  # recorded as the head has them


def _subset_index(head: EagleHead, vocab: int, device: torch.device) -> torch.Tensor:
    """``[V]``: each token's index in the head's vocabulary subset, -1 outside it."""
    sub_index = torch.full((vocab,), -1, dtype=torch.long, device=device)
    sub_index[head.vocab_ids] = torch.arange(head.vocab_ids.numel(), device=device)
    return sub_index


def _finish(head: EagleHead, run_dir: Path, cfg: TrainConfig, dirs: list, step: int, positions: int,
            elapsed: float, ema: dict, precision: str) -> dict:
    """Write ``head.safetensors`` and ``summary.json`` of a finished (or stopped) run; returns the summary."""
    summary = {"step": step, "positions_this_run": positions, "seconds_this_run": elapsed,
               "positions_per_s": positions / max(elapsed, 1e-9), "ema": ema, "precision": precision,
               "trained_parameters": head.num_trained_parameters, "vocab_subset": int(head.vocab_ids.numel())}
    head.save(run_dir / "head.safetensors", extra={"train_config": asdict(cfg), "summary": summary,
                                                   "corpus": [recorded_path(d) for d in dirs]})
    atomic_write_json(run_dir / "summary.json", summary)
    return summary


def train(target, corpus_dir: str | Path | list, run_dir: str | Path, cfg: TrainConfig = TrainConfig(), *,
          init_head: str | Path | None = None, progress: bool = True, device: str | torch.device | None = None,
          vocab_counts: torch.Tensor | None = None, log=print) -> tuple[EagleHead, dict]:
    """Train (or resume) a head; returns (head, summary). ``run_dir`` holds checkpoints + ``head.safetensors``.

    ``corpus_dir``: one corpus directory or a list (shards drawn in proportion to their positions).
    ``vocab_counts`` ``[V]``: extra token counts for choosing a new run's vocabulary subset.

    Resumes from the newest checkpoint in ``run_dir`` when there is one (its config's model
    fields win); ``init_head`` starts a new run from existing head weights (e.g. the shipped draft).
    """
    from tqdm import tqdm

    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    run_dir, ckpt_path, state = open_run(run_dir, CKPT_NAME)
    target = target.to(device)
    vocab = target.get_output_embeddings().weight.shape[0]
    dirs, corpus_positions = _corpus_dirs(target, corpus_dir, cfg)
    if state is not None:
        cfg = _resumed_config(state, ckpt_path, cfg, log)
    head = _starting_head(target, corpus_dir, cfg, state, ckpt_path, init_head, vocab_counts, log)
    head = head.to(device).float()
    head.attach(target)
    cfg = _feature_layers_config(cfg, head, state is not None)
    sampler = ShardSampler(corpus_dir, cfg)
    if state is None and init_head is None:
        # start the output feature at the corpus' per-channel scale of h (measured on Gemma-3-270M:
        # per-channel RMS 1.8..43, median 2.7, while its final norm's gains are 0.19..301, median 9.2)
        h = sampler._shard(0)["hidden"][:20000].float()
        with torch.no_grad():
            head.out_norm.weight.copy_(h.pow(2).mean(0).sqrt().to(device))
    sub_index = _subset_index(head, vocab, device)
    torch.manual_seed(cfg.seed)  # feature noise; a resumed run continues the checkpoint's RNG state
    opt = torch.optim.AdamW(head.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    autocast, precision = autocast_for(device, cfg.amp)
    log(f"head: {head.num_trained_parameters / 1e6:.2f}M trained parameters, vocabulary subset "
        f"{head.vocab_ids.numel()}, {precision}, device {device}, corpus {corpus_positions} positions")
    loop = LoopConfig(steps=cfg.steps, lr=cfg.lr, warmup=cfg.warmup, floor=0.1, clip=cfg.grad_clip,
                      ckpt_every=cfg.ckpt_every, keep=cfg.keep_ckpts, time_limit_s=cfg.time_limit_s)
    head.train()
    t0, positions, ema = time.perf_counter(), 0, {}
    bar = tqdm(total=cfg.steps, initial=state["step"] if state else 0, unit="step", desc="train",
               disable=not progress)

    def step_fn(step: int) -> dict:
        nonlocal positions
        batch = sampler.batch(step)
        positions += int(batch["mask"].sum())
        return compute_losses(head, batch, cfg, sub_index, autocast)

    def on_step(step: int, losses: dict) -> None:
        # a batch of windows shorter than depth k has no "agree_dk"; "tv" only with w_tv > 0
        names = [k for k in ("total", "soft", "feat", "tv", "agree", *(f"agree_d{d}" for d in range(2, cfg.depths + 1)))
                 if k in losses]
        values = torch.stack([losses[k].detach().double() for k in names]).tolist()  # the step's one host sync
        for k, v in zip(names, values):
            ema[k] = v if k not in ema else 0.95 * ema[k] + 0.05 * v
        bar.update(1)
        bar.set_postfix(loss=f"{ema['total']:.3f}", soft=f"{ema['soft']:.3f}", feat=f"{ema['feat']:.3f}",
                        agree=f"{ema['agree']:.3f}", pos_s=f"{positions / (time.perf_counter() - t0):.0f}")

    def extra() -> dict:
        return {"vocab_ids": head.vocab_ids.cpu(), "head_config": asdict(head.cfg), "train_config": asdict(cfg),
                "head_layout": "eagle3" if isinstance(head, Eagle3Head) else "eagle",
                "corpus": [recorded_path(d) for d in dirs]}

    step = run_loop(loop, head, opt, step_fn, run_dir=run_dir, name=CKPT_NAME, keys=("head", "optimizer"),
                    state=state, extra=extra, on_step=on_step, state_path=ckpt_path)
    bar.close()
    head.eval()
    return head, _finish(head, run_dir, cfg, dirs, step, positions, time.perf_counter() - t0, ema, precision)


def export_checkpoint(run_dir: str | Path, out: str | Path, dtype: torch.dtype = torch.float16) -> dict:
    """Write the newest checkpoint of ``run_dir`` as a head file (no target needed); returns its summary."""
    ckpt = latest_checkpoint(require_dir(run_dir, "run directory"), CKPT_NAME)
    if ckpt is None:
        raise DistillInputError(f"run directory {run_dir}: no checkpoint (ckpt-N.pt) to export")
    remove_stale_temporaries(Path(out).parent)
    state = load_checkpoint(ckpt)
    head = _head_from_checkpoint(state, ckpt)
    train_config = require_type(state, "train_config", dict, f"checkpoint {ckpt}")
    corpus = state.get("corpus")  # older checkpoints may record absolute paths
    if isinstance(corpus, list):
        corpus = [recorded_path(d) if isinstance(d, (str, os.PathLike)) else d for d in corpus]
    summary = {"checkpoint": recorded_path(ckpt), "step": state["step"], "train_config": train_config,
               "corpus": corpus, "trained_parameters": head.num_trained_parameters,
               "vocab_subset": int(head.vocab_ids.numel())}
    head.save(out, dtype=dtype, extra={"summary": summary})
    return {"out": str(out), "bytes": Path(out).stat().st_size, **summary}


def export_speculators(run_dir: str | Path, out: str | Path, load_target, *, dtype: torch.dtype = torch.bfloat16,
                       verifier: str, embed: bool = True) -> dict:
    """Write the newest checkpoint of an EAGLE-3 run (``layout="eagle3"``) as a ``speculators`` checkpoint folder
    (:func:`~treespec.drafting.eagle3_export.save_speculators`); ``load_target()`` gives the target the run
    trained on (its LM-head rows and embedding table go into the folder). Returns what was written."""
    from ..drafting.eagle3_export import save_speculators

    ckpt = latest_checkpoint(require_dir(run_dir, "run directory"), CKPT_NAME)
    if ckpt is None:
        raise DistillInputError(f"run directory {run_dir}: no checkpoint (ckpt-N.pt) to export")
    state = load_checkpoint(ckpt)
    head = _head_from_checkpoint(state, ckpt)
    if not isinstance(head, Eagle3Head):
        raise DistillInputError(f"{ckpt}: --format speculators writes EAGLE-3 heads; this run trains layout "
                                f"{state.get('head_layout', 'eagle')} (train with --layout eagle3)")
    target = load_target()
    try:
        head.attach(target)
        written = save_speculators(head, out, dtype=dtype, embed=embed, verifier=verifier,
                                   verifier_architectures=list(getattr(target.config, "architectures", None) or []),
                                   max_position_embeddings=int(getattr(target.config.get_text_config(),
                                                                       "max_position_embeddings", 32768)))
    except (ValueError, FileExistsError) as err:
        raise DistillInputError(str(err)) from None
    return {**written, "checkpoint": recorded_path(ckpt), "step": state["step"]}
