"""Training judge decoding's judge (:class:`~treespec.drafting.judge.JudgeHead`) on labels the target makes itself.

Judge decoding ("Judge Decoding: Faster Speculative Sampling Requires Going Beyond Model Alignment", Bachmann et
al., arXiv 2501.19309) trains its judge on drafted answers marked by hand (or by a strong model) as correct or
not. Nothing here can mark correctness, so the labels are the target's own, on its greedy continuations of train
prompts (stored by :mod:`.continuations`):

**A substitution is acceptable when the target does not notice it.** At a position ``j`` of a continuation where
the text's token ``y_j`` is the target's greedy choice, each of the target's next-ranked tokens ``b`` (ranks 2 to
``alternatives + 1``), and ``far`` tokens far down its ranking (one from ranks up to 101, the rest from the whole
vocabulary, so that the judge sees tokens the target ranks anywhere), is put in ``y_j``'s place; the label is 1
when the target's greedy choice after ``b`` is the text again for the next ``resync`` tokens
(``argmax p(. | y_<j, b) = y_{j+1}``, ..., ``argmax p(. | y_<j, b, y_{j+1..j+resync-1}) = y_{j+resync}``),
else 0. Two passes per sequence: a causal
pass over the text gives the target's ranking at the sampled positions, then one tree pass computes every label
and feature: the text as a chain, and at each sampled position one branch per substitution, ``b`` followed by the
text.

What the label can and cannot tell: it accepts a token the target treats as interchangeable in context (a
synonym, another article, a different but equivalent phrasing that joins the same text) and rejects one that
sends the text elsewhere; it cannot tell a wrong number or name from a right one when the text reads on the
same way after it ("5 apples" for "6 apples"). The quality cost of that is measured, not assumed:
``benchmarks/judge_quality.py``.

The judge reads the target's last hidden state at ``b`` and the logit gap of ``b`` below the greedy token
(:class:`~treespec.drafting.judge.JudgeHead`). Its threshold is chosen on validation sequences for a precision
(the share of accepted substitutions that are acceptable by the label).
"""

from __future__ import annotations

import copy
import math
import sys
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..drafting.judge import JudgeHead, JudgeHeadConfig
from .acceptance import sequences_aside
from ..tree import TokenTree


@dataclass(frozen=True)
class JudgeRowsOptions:
    positions: int = 16  # sampled positions per sequence
    alternatives: int = 3  # the target's ranks 2 .. alternatives + 1 at each position
    far: int = 2  # substitutions far down the ranking: one from ranks <= 101, the rest from the whole vocabulary
    resync: int = 4  # tokens after the substitution that must be the text again for label 1
    max_tokens: int = 96  # generated tokens of a sequence read (bounds the tree pass)
    seed: int = 0


@dataclass
class JudgeRows:
    """``hidden`` ``[N, H]`` (float16), ``gap`` ``[N]``, ``label`` ``[N]`` (0 / 1), ``sequence`` ``[N]``."""

    hidden: torch.Tensor
    gap: torch.Tensor
    label: torch.Tensor
    sequence: torch.Tensor

    @property
    def size(self) -> int:
        return int(self.label.numel())

    def take(self, mask: torch.Tensor) -> "JudgeRows":
        return JudgeRows(self.hidden[mask], self.gap[mask], self.label[mask], self.sequence[mask])


def branch_tree(ids: list[int], root: int, branches: list[tuple[int, int]], resync: int
                ) -> tuple[TokenTree, list[list[int]]]:
    """The labelling tree of one sequence: the root ``ids[root]``, the text ``ids[root + 1:]`` as a chain, and
    for each ``(j, b)`` in ``branches`` a branch under the text's node of ``ids[j - 1]``: ``b``, then
    ``ids[j + 1 .. j + resync - 1]``. Returns the tree and each branch's node indices."""
    parents = [-1] + list(range(len(ids) - root - 1))
    tokens = list(ids[root:])
    nodes = []
    for j, b in branches:
        parent = j - 1 - root  # the text's node of ids[j - 1]
        mine = []
        for t, tok in enumerate([b, *ids[j + 1:j + resync]]):
            mine.append(len(tokens))
            parents.append(parent if t == 0 else mine[-2])
            tokens.append(tok)
        nodes.append(mine)
    return TokenTree.from_lists(parents, tokens), nodes


def substitutions(order: list[int], vocab_size: int, opts: JudgeRowsOptions, generator: torch.Generator) -> list[int]:
    """The tokens put in place of the greedy token ``order[0]`` (``order``: the target's ranking, best first, at
    least its top 101 where the vocabulary has them): ranks 2 .. ``alternatives + 1``, then ``far`` tokens (one
    drawn from the rest of ``order``, the others from the whole vocabulary), each token once, never ``order[0]``."""
    out = order[1:opts.alternatives + 1]
    rest = order[opts.alternatives + 1:]
    far = [rest[int(torch.randint(len(rest), (1,), generator=generator))]] if rest and opts.far else []
    far += torch.randint(vocab_size, (max(opts.far - 1, 0),), generator=generator).tolist()
    for t in far:
        if t != order[0] and t not in out:
            out.append(t)
    return out


@torch.no_grad()
def sequence_rows(runner, ids: list[int], gen_start: int, opts: JudgeRowsOptions, generator: torch.Generator
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """One sequence's rows ``(hidden [n, H], gap [n], label [n])`` (module docstring), or None when it has no
    position to label. ``runner``: a target runner (:mod:`treespec.models.runner`), reset here."""
    k, device = opts.resync, runner.device
    if gen_start < 1:
        raise ValueError("a sequence's continuation must follow at least one prompt token (gen_start >= 1)")
    ids = ids[:gen_start + opts.max_tokens]
    candidates = list(range(max(gen_start, 1), len(ids) - k))  # y_{j+1 .. j+k} exist
    if not candidates:
        return None
    picked = torch.randperm(len(candidates), generator=generator)[: opts.positions].sort().values.tolist()
    js = [candidates[i] for i in picked]
    # pass 1: the text, causal; the target's ranking at each sampled position
    runner.reset()
    out = runner.forward(None, None, torch.tensor(ids, device=device),
                         rows=torch.tensor([j - 1 for j in js], device=device))
    logits = out["logits"].float()  # [P, V]
    ranked = logits.topk(min(logits.shape[1], max(opts.alternatives + 1, 101)), dim=-1).indices  # [P, R]
    branches, gaps = [], []
    for row, j in enumerate(js):
        order = ranked[row].tolist()
        if order[0] != ids[j]:  # the text is not the target's greedy choice here (batched rounding)
            continue
        for b in substitutions(order, logits.shape[1], opts, generator):
            branches.append((j, b))
            gaps.append(float(logits[row, b] - logits[row, order[0]]))
    if not branches:
        return None
    # pass 2: the text as a tree with one branch per alternative; rows of the branch nodes only
    root = gen_start - 1
    runner.reset()
    if root > 0:
        runner.forward(None, None, torch.tensor(ids[:root], device=device), need_logits=False)
    tree, nodes = branch_tree(ids, root, branches, k)
    rows = torch.tensor([n for mine in nodes for n in mine], device=device)  # ascending: branches are appended
    out = runner.forward(tree.to(device), torch.arange(tree.num_nodes, device=device), need_hidden=True, rows=rows)
    best = out["logits"].argmax(-1).view(len(branches), k)  # [B, k]
    want = torch.tensor([ids[j + 1:j + 1 + k] for j, _ in branches], device=best.device)  # [B, k]
    label = (best == want).all(dim=1).float()  # [B]
    hidden = out["hidden"].view(len(branches), k, -1)[:, 0]  # [B, H] the hidden state at b
    return hidden.half().cpu(), torch.tensor(gaps), label.cpu()


def collect_rows(runner, sequences: list[tuple[list[int], int]], opts: JudgeRowsOptions,
                 progress: bool = False) -> JudgeRows:
    """Rows of every ``(ids, gen_start)`` sequence (:func:`sequence_rows`), in order."""
    gen = torch.Generator().manual_seed(opts.seed)
    parts: list[list[torch.Tensor]] = [[], [], [], []]
    t0 = time.perf_counter()
    for s, (ids, start) in enumerate(sequences):
        got = sequence_rows(runner, ids, start, opts, gen)
        if got is not None:
            for part, value in zip(parts, got):
                part.append(value)
            parts[3].append(torch.full((got[2].numel(),), s))
        if progress and (s + 1) % 25 == 0:
            print(f"judge rows: {s + 1}/{len(sequences)} sequences in {time.perf_counter() - t0:.0f} s",
                  file=sys.stderr, flush=True)
    if not parts[0]:
        raise ValueError("no labelled position in these sequences (too short for --resync, or none where the text "
                         "is the target's greedy choice)")
    return JudgeRows(*(torch.cat(p) for p in parts))


@dataclass(frozen=True)
class JudgeTrainOptions:
    epochs: int = 30  # at most: training keeps the epoch with the best validation loss
    batch: int = 256
    lr: float = 3e-3
    weight_decay: float = 1e-2
    validation: float = 0.2  # share of the training sequences that choose the epoch and the threshold
    precision: float = 0.9  # the threshold is the lowest whose validation precision reaches this
    seed: int = 0


def split_sequences(rows: JudgeRows, share: float, seed: int) -> tuple[JudgeRows, JudgeRows]:
    """(kept, set aside): whole sequences to one side, a share ``share`` of them set aside (at least one, and at
    least one kept)."""
    out = torch.isin(rows.sequence, sequences_aside(rows.sequence, share, seed))
    return rows.take(~out), rows.take(out)


def _loss(head: JudgeHead, rows: JudgeRows) -> float:
    with torch.no_grad():
        return float(F.binary_cross_entropy_with_logits(head.logit(rows.hidden.float(), rows.gap), rows.label))


def choose_threshold(logits: torch.Tensor, label: torch.Tensor, precision: float, min_accepted: int = 10) -> float:
    """The lowest threshold ``t`` (a midpoint between sorted logits) such that the rows with logit above ``t``
    number at least ``min_accepted`` and have a share of label 1 of at least ``precision``; +inf if none does
    (the judge then never accepts)."""
    order = torch.argsort(logits, descending=True)
    s, y = logits[order], label[order]
    hits = torch.cumsum(y, 0)
    counts = torch.arange(1, s.numel() + 1, dtype=hits.dtype)
    ok = ((hits / counts) >= precision) & (counts >= min_accepted)
    # a cut after row i accepts rows 0..i; it must fall between distinct logits
    distinct = torch.cat([s[:-1] > s[1:], torch.tensor([True])])
    good = torch.nonzero(ok & distinct).flatten()
    if not good.numel():
        return math.inf
    i = int(good[-1])
    return float((s[i] + s[i + 1]) / 2) if i + 1 < s.numel() else float(s[i]) - 1.0


def train_judge(rows: JudgeRows, hidden_size: int, opts: JudgeTrainOptions = JudgeTrainOptions()) -> JudgeHead:
    """A judge fitted to ``rows`` (binary cross-entropy, AdamW), the gap standardised with the training rows'
    mean and spread; a share ``validation`` of the sequences keeps the best epoch and sets the threshold for
    ``precision`` (:func:`choose_threshold`). ``head.epoch`` records the epoch kept."""
    fit, val = split_sequences(rows, opts.validation, opts.seed + 1)
    if fit.size < 2 or val.size < 1:
        raise ValueError(f"too few rows to fit a judge ({fit.size} fitted, {val.size} validation); give more "
                         f"sequences or a smaller --held-out / --validation share")
    torch.manual_seed(opts.seed)
    head = JudgeHead(JudgeHeadConfig(hidden_size))
    head.gap_shift.fill_(float(fit.gap.mean()))
    head.gap_scale.fill_(max(float(fit.gap.std()), 1e-3))
    head.gap_min.fill_(float(fit.gap.min()))
    optim = torch.optim.AdamW(head.linear.parameters(), lr=opts.lr, weight_decay=opts.weight_decay)
    gen = torch.Generator().manual_seed(opts.seed)
    best, best_epoch, best_state = _loss(head, val), 0, copy.deepcopy(head.state_dict())
    with torch.enable_grad():
        for epoch in range(1, opts.epochs + 1):
            for idx in torch.randperm(fit.size, generator=gen).split(opts.batch):
                loss = F.binary_cross_entropy_with_logits(head.logit(fit.hidden[idx].float(), fit.gap[idx]),
                                                          fit.label[idx])
                optim.zero_grad()
                loss.backward()
                optim.step()
            current = _loss(head, val)
            if current < best:
                best, best_epoch, best_state = current, epoch, copy.deepcopy(head.state_dict())
    head.load_state_dict(best_state)
    with torch.no_grad():  # the threshold is chosen on what the engine would accept: no gap below gap_min
        logits = head.logit(val.hidden.float(), val.gap).masked_fill(val.gap < head.gap_min, float("-inf"))
        threshold = choose_threshold(logits, val.label, opts.precision)
    out = head.with_threshold(threshold)
    out.epoch = best_epoch
    return out


def auc(score: torch.Tensor, label: torch.Tensor) -> float:
    """Area under the ROC curve of ``score`` for ``label`` (ties count half), from ranks (Mann-Whitney U) in
    O(N log N); nan with one class only."""
    if torch.isnan(score).any():
        raise ValueError("auc: the scores hold nan")
    pos = label > 0.5
    n_pos, n_neg = int(pos.sum()), int((~pos).sum())
    if not n_pos or not n_neg:
        return math.nan
    order = torch.argsort(score)
    _, inverse, counts = torch.unique_consecutive(score[order], return_inverse=True, return_counts=True)
    counts = counts.double()
    mean_rank = torch.cumsum(counts, 0) - (counts - 1) / 2  # 1-based mean rank of each group of ties
    ranks = torch.empty(score.numel(), dtype=torch.float64, device=score.device).index_copy_(0, order,
                                                                                          mean_rank[inverse])
    return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def score(head: JudgeHead, rows: JudgeRows) -> dict[str, float]:
    """On ``rows``: the share of label 1, the judge's cross-entropy and AUC beside the gap's alone, and at the
    head's threshold the accepted share, precision (None when it accepts nothing) and recall."""
    if not rows.size:
        return {"rows": 0}
    with torch.no_grad():
        logit = head.logit(rows.hidden.float(), rows.gap)  # the cross-entropy and AUC score the judge's logits
    y = rows.label
    accepted = (logit > head.threshold) & (rows.gap >= head.gap_min)  # as the engine decides
    hits = float((accepted & (y > 0.5)).sum())
    return {"rows": rows.size, "mean_label": float(y.mean()), "xent": float(F.binary_cross_entropy_with_logits(
        logit, y)), "auc": auc(logit, y), "gap_auc": auc(rows.gap, y), "accepted_share": float(accepted.float().mean()),
        "precision": hits / int(accepted.sum()) if accepted.any() else None,
        "recall": hits / max(float(y.sum()), 1.0)}
