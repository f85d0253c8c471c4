"""Measuring a draft head against its target on held-out text, teacher-forced (used only to measure).

* ``top1_agreement`` (T=0): over the positions of the target's own greedy continuations, how often
  the head's most likely token equals the target's;
* ``sum_min_pq`` (T=1): over the positions of the target's sampled (T=1) continuations, the
  mean single-draft acceptance ``sum_x min(p(x), q(x))``;
both from the target's true hidden states, at the head's first level and at deeper tree levels along
the same text (:func:`depth_metrics`). What needs the speculative engine (the target's continuations,
step cost, tau of a chain) is :mod:`treespec.analysis.acceptance`.
"""

from __future__ import annotations

import torch

from ..drafting.head import EagleHead
from ..models.features import model_features
from .corpus import lm_logits


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
        hi = seq.numel() - 1  # positions j in [lo, hi) predict generated tokens
        first = max(len(prompt) - 1, 1)
        p, draft_rows = _rows_along(model, head, seq, depths, first)  # p from position first; q rows at j - 1
        p = torch.softmax(p, dim=-1)  # [g, V]
        top_p = p.argmax(-1)
        for k in range(1, depths + 1):
            lo = max(len(prompt) - 1, k)  # row j - 1 is position j; depth k needs j >= k
            if lo >= hi:
                continue
            pk = p[lo - max(len(prompt) - 1, 1):]
            q_sub = torch.softmax(draft_rows(k, lo), dim=-1)  # [g_k, |S|]
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


def _rows_along(model, head, seq: torch.Tensor, depths: int, first: int):
    """The target's logits ``[n - 1 - first, V]`` at positions ``first .. n - 2`` of ``seq`` ``[n]`` and a function
    ``(k, lo) ->`` the head's subset logits at depth ``k`` at positions ``lo .. n - 2`` (``lo >= 1``): through
    :meth:`EagleHead.unroll` for a one-layer head that feeds on its own outputs; for a Kangaroo adapter, whose
    draft along the text is the same at every depth, through one teacher-forced pass of the adapter."""
    from ..drafting.kangaroo import KangarooAdapter

    hi = seq.numel() - 1
    f = model_features(model, seq[None], layers=tuple(head.feature_layers))[0].float()  # [n, F]
    if isinstance(head, KangarooAdapter):
        h = head.cfg.hidden_size
        with torch.no_grad():
            positions = torch.arange(seq.numel(), device=seq.device)[None]
            out = head(f[None, :, :h].to(head.attn_norm.weight.dtype), positions)  # [1, n, H]
        return lm_logits(model, f[first:hi, h:]), lambda k, lo: head.logits(out[0, lo:hi])
    feats = head.unroll(f[None, :-1], seq[None, 1:], torch.arange(1, seq.numel(), device=seq.device)[None], depths)
    return lm_logits(model, head.last_hidden(f)[first:hi]), lambda k, lo: head.logits(feats[k - 1][0, lo - 1:hi - 1])
