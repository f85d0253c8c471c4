"""Training SpecDec++'s acceptance head (:class:`~treespec.drafting.stopping.AcceptanceHead`) for a draft head.

Rows come from the target's own continuations ("SpecDec++: Boosting Speculative Decoding via Adaptive
Candidate Lengths", arXiv 2405.19715, trains on the target's outputs too). Along a sequence, the draft head is
unrolled on its own features as it drafts inside a tree whose path follows the text
(:meth:`~treespec.drafting.head.EagleHead.unroll`): its depth-``k`` step at position ``j`` (root at
``j - k + 1``) is the draft of depth ``k`` given that depths ``1 .. k - 1`` were accepted. Each row holds the
feature behind the step's ``q`` (``[H]``), the numbers of :func:`~treespec.drafting.stopping.child_numbers` for
the drawn token ``x`` and the label:

- ``greedy``: ``x = argmax q``, label ``[x = argmax p]`` (a chain's acceptance at temperature 0);
- ``sampled``: ``x ~ q`` at temperature 1, label ``min(1, p(x) / q(x))``, the chance that the verifier
  accepts ``x`` (soft: its expectation over the verifier's coin, which the loss can take exactly).

Only rows predicting generated tokens are used (row ``i`` predicts the token at ``i + 2``, at or past the
continuation's start), and only some of them (``positions`` a sequence, drawn with the seed), to keep the rows
small. At the first generated positions a deep row's path starts in the prompt's last tokens (at most
``depths - 2`` positions a sequence): text the target did not choose, kept as it is rare.
"""

from __future__ import annotations

import copy
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from ..drafting.stopping import REGIMES, AcceptanceHead, AcceptanceHeadConfig, child_numbers
from ..models.features import model_features
from .continuations import _head_logits


@dataclass(frozen=True)
class AcceptanceRowsOptions:
    depths: int = 6  # draft depths 1..depths
    positions: int = 24  # generated positions sampled per sequence (each at every depth)
    draws: int = 2  # sampled drafts per (position, depth)
    seed: int = 0


@dataclass
class AcceptanceRows:
    """Training rows per regime: ``feature`` ``[N, H]`` (float16), ``numbers`` ``[N, 4]``, ``label`` ``[N]``
    and ``sequence`` ``[N]`` (which sequence the row came from: splits keep a sequence's rows together)."""

    feature: dict[str, torch.Tensor]
    numbers: dict[str, torch.Tensor]
    label: dict[str, torch.Tensor]
    sequence: dict[str, torch.Tensor]

    @property
    def sizes(self) -> dict[str, int]:
        return {r: int(self.label[r].numel()) for r in REGIMES}


@torch.no_grad()
def sequence_rows(target, head, ids: list[int], gen_start: int, opts: AcceptanceRowsOptions,
                  generator: torch.Generator) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None:
    """One sequence's rows: ``{regime: (feature [n, H], numbers [n, 4], label [n])}``, or None when it has no
    generated position with a root behind it at every depth."""
    device = head.lm_rows.device
    x = torch.tensor([ids], device=device)
    hidden = model_features(target, x, layers=head.cfg.feature_layers).float()  # [1, L, F]
    n = len(ids) - 1  # head entries at positions 1 .. L-1: entry row i sits at position i + 1, predicts token i + 2
    first = max(gen_start - 2, opts.depths - 1)  # rows predicting generated tokens, every depth's root >= 1
    if first >= n - 1:
        return None
    rows = torch.randperm(n - 1 - first, generator=generator)[: opts.positions].to(device) + first  # [P]
    rows, _ = rows.sort()
    last = hidden[0, 1 + rows, -head.cfg.hidden_size:]  # [P, H] the target's last hidden state at position i + 1
    p = torch.softmax(_head_logits(target, last.to(target.dtype)), dim=-1)  # [P, V]
    positions = torch.arange(1, n + 1, device=device)
    outs = head.unroll(hidden[:, :-1], x[:, 1:], positions[None], opts.depths)  # per depth [1, n, H]
    p_top = p.argmax(-1)  # [P]
    out: dict[str, list] = {r: [[], [], []] for r in REGIMES}
    for k, f in enumerate(outs, start=1):
        feat = f[0, rows].float()  # [P, H]: the depth-k step's feature (its parent's output)
        q = torch.softmax(head.logits(feat).float(), dim=-1)  # [P, |S|]
        depth = torch.full((rows.numel(),), k - 1, device=device)  # the parent's depth
        greedy = q.argmax(-1, keepdim=True)  # [P, 1]
        hit = (head.vocab_ids[greedy[:, 0]] == p_top).float()
        _append(out["greedy"], feat, child_numbers(q, greedy, depth)[:, 0], hit)
        drawn = torch.multinomial(q.cpu(), opts.draws, replacement=True, generator=generator).to(device)  # [P, d]
        q_x = q.gather(1, drawn)  # [P, d]
        p_x = p.gather(1, head.vocab_ids[drawn])  # [P, d]
        accept = torch.clamp(p_x / q_x, max=1.0)
        numbers = child_numbers(q, drawn, depth)  # [P, d, 4]
        for d in range(opts.draws):
            _append(out["sampled"], feat, numbers[:, d], accept[:, d])
    return {r: tuple(torch.cat(parts) for parts in out[r]) for r in REGIMES}


def _append(parts: list, feature: torch.Tensor, numbers: torch.Tensor, label: torch.Tensor) -> None:
    parts[0].append(feature.half().cpu())
    parts[1].append(numbers.float().cpu())
    parts[2].append(label.float().cpu())


def collect_rows(target, head, sequences: list[tuple[list[int], int]], opts: AcceptanceRowsOptions,
                 progress: bool = False) -> AcceptanceRows:
    """Rows of every ``(ids, gen_start)`` sequence (:func:`sequence_rows`), in order."""
    gen = torch.Generator().manual_seed(opts.seed)
    acc = {r: [[], [], [], []] for r in REGIMES}
    t0 = time.perf_counter()
    for s, (ids, start) in enumerate(sequences):
        got = sequence_rows(target, head, ids, start, opts, gen)
        if got is not None:
            for r in REGIMES:
                for part, value in zip(acc[r], got[r]):
                    part.append(value)
                acc[r][3].append(torch.full((got[r][2].numel(),), s))
        if progress and (s + 1) % 25 == 0:
            print(f"acceptance rows: {s + 1}/{len(sequences)} sequences in {time.perf_counter() - t0:.0f} s",
                  flush=True)
    cat = {r: [torch.cat(p) if p else torch.zeros(0) for p in acc[r]] for r in REGIMES}
    return AcceptanceRows(*({r: cat[r][i] for r in REGIMES} for i in range(4)))


@dataclass(frozen=True)
class AcceptanceTrainOptions:
    width: int = 64
    epochs: int = 8  # at most: training stops at the epoch with the best validation loss
    batch: int = 512
    lr: float = 2e-3
    weight_decay: float = 1e-2
    validation: float = 0.1  # share of the training sequences that only choose the epoch (early stopping)
    seed: int = 0


def train_acceptance_head(rows: AcceptanceRows, hidden_size: int,
                          opts: AcceptanceTrainOptions = AcceptanceTrainOptions()) -> AcceptanceHead:
    """An acceptance head fitted to ``rows`` (binary cross-entropy on the soft labels, AdamW), each regime's
    network on its own rows; the numbers are standardised with the training rows' mean and spread. Rows of one
    sequence are alike (one feature serves several draws and depths), so a network that reads 640 numbers learns
    sequences by heart: a share ``validation`` of the sequences is set aside, and each regime keeps the weights
    of the epoch whose loss on them was lowest (``head.epochs`` records which)."""
    fit, val = split_rows(rows, opts.validation, opts.seed + 1) if opts.validation > 0 else (rows, None)
    few = {r: (fit.sizes[r], val.sizes[r] if val is not None else None) for r in REGIMES
           if fit.sizes[r] < 2 or (val is not None and val.sizes[r] < 1)}
    if few:
        raise ValueError(f"too few rows to fit an acceptance head (fitted, validation rows per regime: {few}); "
                         "give longer or more sequences, or smaller --held-out / --validation shares")
    torch.manual_seed(opts.seed)
    head = AcceptanceHead(AcceptanceHeadConfig(hidden_size, opts.width))
    every = torch.cat([fit.numbers[r] for r in REGIMES])
    head.number_shift.copy_(every.mean(0))
    head.number_scale.copy_(every.std(0).clamp(min=1e-3))
    gen = torch.Generator().manual_seed(opts.seed)
    head.epochs = {}
    for regime in REGIMES:
        head.epochs[regime] = _fit_regime(head, regime, fit, val, opts, gen)
    return head.eval()


def _loss(head: AcceptanceHead, regime: str, rows: AcceptanceRows) -> float:
    with torch.no_grad():
        logit = head.logit(regime, rows.feature[regime].float(), rows.numbers[regime])
        return float(F.binary_cross_entropy_with_logits(logit, rows.label[regime]))


def _fit_regime(head: AcceptanceHead, regime: str, fit: AcceptanceRows, val: AcceptanceRows | None,
                opts: AcceptanceTrainOptions, gen: torch.Generator) -> int:
    """Train one regime's network; keep its best epoch on ``val`` (0: the initial weights; without ``val`` the
    last epoch); return that epoch."""
    net = head.nets[regime]
    optim = torch.optim.AdamW(net.parameters(), lr=opts.lr, weight_decay=opts.weight_decay)
    n = fit.label[regime].numel()
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(optim, max(opts.epochs * math.ceil(n / opts.batch), 1))
    best, best_epoch, best_state = math.inf, 0, None
    if val is not None:  # epoch 0: the initial weights, kept where no epoch does better
        best, best_state = _loss(head, regime, val), copy.deepcopy(net.state_dict())
    with torch.enable_grad():  # whatever the caller's grad mode
        for epoch in range(1, opts.epochs + 1):
            for idx in torch.randperm(n, generator=gen).split(opts.batch):
                logit = head.logit(regime, fit.feature[regime][idx].float(), fit.numbers[regime][idx])
                loss = F.binary_cross_entropy_with_logits(logit, fit.label[regime][idx])
                optim.zero_grad()
                loss.backward()
                optim.step()
                sched.step()
            current = _loss(head, regime, val) if val is not None else -epoch  # no validation: the last
            if current < best:
                best, best_epoch, best_state = current, epoch, copy.deepcopy(net.state_dict())
    if best_state is not None:
        net.load_state_dict(best_state)
    return best_epoch


def save_rows(rows: AcceptanceRows, path, key: dict) -> None:
    """Collected rows with the settings that made them (``key``), written atomically."""
    import io

    from ..files import atomic_write

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    torch.save({"key": key, "rows": rows.__dict__}, buf)
    atomic_write(path, lambda tmp: tmp.write_bytes(buf.getvalue()))


def load_rows(path, key: dict, kind: type = AcceptanceRows):
    """Rows (a ``kind``: :class:`AcceptanceRows`, or the judge's rows) saved by :func:`save_rows` under the same
    ``key``, else None (rows of other settings are not reused)."""
    if not Path(path).is_file():
        return None
    try:
        saved = torch.load(path, weights_only=True)
    except Exception as err:  # noqa: BLE001 - a damaged cache is collected again
        print(f"rows: {path} is not readable ({type(err).__name__}); collecting again", file=sys.stderr)
        return None
    if not isinstance(saved, dict) or saved.get("key") != key:
        print(f"rows: {path} holds rows of other settings; collecting again", file=sys.stderr)
        return None
    return kind(**saved["rows"])


def score(head: AcceptanceHead, rows: AcceptanceRows) -> dict[str, dict[str, float]]:
    """Per regime on ``rows``: the head's cross-entropy and Brier score against the labels, beside the same for
    the draft's confidence ``q(x)`` taken as the predicted acceptance, and the mean label."""
    result = {}
    with torch.no_grad():
        for r in REGIMES:
            y = rows.label[r]
            if not y.numel():
                continue
            pred = torch.sigmoid(head.logit(r, rows.feature[r].float(), rows.numbers[r]))
            conf = rows.numbers[r][:, 0].exp().clamp(1e-6, 1 - 1e-6)  # q(x)
            result[r] = {"rows": int(y.numel()), "mean_label": float(y.mean()),
                         "head_xent": float(F.binary_cross_entropy(pred.clamp(1e-6, 1 - 1e-6), y)),
                         "confidence_xent": float(F.binary_cross_entropy(conf, y)),
                         "head_brier": float(((pred - y) ** 2).mean()),
                         "confidence_brier": float(((conf - y) ** 2).mean())}
    return result


def sequences_aside(sequence: torch.Tensor, share: float, seed: int) -> torch.Tensor:
    """The sequence ids ``[k]`` set aside from the rows' ``sequence`` ids: a seeded share ``share`` of the distinct
    ones, at least one, and at least one kept (where there are two); none for ``share`` 0."""
    seqs = torch.unique(sequence)
    perm = seqs[torch.randperm(seqs.numel(), generator=torch.Generator().manual_seed(seed))]
    count = min(max(1, round(share * seqs.numel())), max(seqs.numel() - 1, 0)) if share > 0 else 0
    return perm[:count]


def split_rows(rows: AcceptanceRows, held_out: float, seed: int) -> tuple[AcceptanceRows, AcceptanceRows]:
    """(training, held-out) rows, whole sequences to one side (a share ``held_out`` of the sequences)."""
    out_seqs = sequences_aside(torch.cat([rows.sequence[r] for r in REGIMES]), held_out, seed)
    parts = []
    for keep_out in (False, True):
        masks = {r: torch.isin(rows.sequence[r], out_seqs) == keep_out for r in REGIMES}
        parts.append(AcceptanceRows(*({r: getattr(rows, f)[r][masks[r]] for r in REGIMES}
                                      for f in ("feature", "numbers", "label", "sequence"))))
    return parts[0], parts[1]
