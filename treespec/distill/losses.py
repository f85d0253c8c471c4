"""The distillation losses of a draft head on its vocabulary subset, fused and chunked.

For subset logits ``z`` ``[P, S]`` (one row per training position), soft labels ``w`` ``[P, S]`` (the
target's distribution on the subset) and hard labels ``y`` ``[P]`` (the next token's index in the
subset, ``-1`` where it lies outside):

* soft cross-entropy ``L_soft = mean_{i kept} ( lse(z_i) * sum_s w_is - sum_s w_is z_is )``,
* hard cross-entropy ``L_hard = mean_{i kept, y_i >= 0} ( lse(z_i) - z_{i, y_i} )`` (0 when no row has one),
* gradient ``dL/dz_i = g_soft / K * (q_i * sum_s w_is - w_i) + g_hard / n * [y_i >= 0] * (q_i - e_{y_i})``
  on kept rows (``K`` of them, ``n`` with a hard label; 0 elsewhere), ``q_i = softmax(z_i)``;
* optionally the total-variation loss ``L_tv = mean_{i kept} (1 - sum_s min(w_is, q_is))``
  (:func:`subset_tv_loss`), one minus the single-draft acceptance the head would have.

The composite form (``log_softmax``, a product with the labels, a second ``log_softmax`` inside
``cross_entropy``) writes several float32 ``[P, S]`` temporaries per depth: at P = 2,048 and S = 16,384
each is 134 MB, and on a CPU these memory passes cost more than the bf16 products that make the logits.
:func:`subset_distill_losses` reads each row block once forward and once backward and keeps the float32
work in a cache-sized block; :func:`subset_distill_losses_reference` is the composite form it is tested
against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK_ROWS = 128  # rows per block: 128 x 16,384 float32 = 8 MB of temporaries


class _SubsetDistill(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, soft: torch.Tensor, hard: torch.Tensor, keep: torch.Tensor, chunk: int):
        rows = logits.shape[0]
        valid = (hard >= 0) & keep  # [P]
        lse = torch.empty(rows, dtype=torch.float32, device=logits.device)  # [P]
        top1 = torch.empty(rows, dtype=torch.long, device=logits.device)  # [P]
        soft_sum = torch.zeros((), dtype=torch.float32, device=logits.device)
        hard_sum = torch.zeros((), dtype=torch.float32, device=logits.device)
        for a in range(0, rows, chunk):
            z = logits[a:a + chunk].float()  # [C, S]
            w = soft[a:a + chunk].float()  # [C, S]
            y = hard[a:a + chunk]  # [C]
            lse_c = torch.logsumexp(z, dim=-1)  # [C]
            lse[a:a + chunk] = lse_c
            top1[a:a + chunk] = z.argmax(-1)
            soft_sum += ((lse_c * w.sum(-1) - (w * z).sum(-1)) * keep[a:a + chunk]).sum()
            picked = z.gather(1, y.clamp(min=0)[:, None])[:, 0]  # [C]
            hard_sum += ((lse_c - picked) * valid[a:a + chunk]).sum()
        n_hard = valid.sum().clamp(min=1).float()
        n_keep = keep.sum().clamp(min=1).float()
        ctx.save_for_backward(logits, soft, hard, valid, lse, keep, n_hard, n_keep)
        ctx.chunk = chunk
        ctx.mark_non_differentiable(top1)
        return soft_sum / n_keep, hard_sum / n_hard, top1

    @staticmethod
    def backward(ctx, g_soft: torch.Tensor, g_hard: torch.Tensor, _g_top1):
        logits, soft, hard, valid, lse, keep, n_hard, n_keep = ctx.saved_tensors
        rows, chunk = logits.shape[0], ctx.chunk
        grad = torch.empty_like(logits)  # [P, S] in the logits' dtype
        for a in range(0, rows, chunk):
            z = logits[a:a + chunk].float()  # [C, S]
            w = soft[a:a + chunk].float()  # [C, S]
            c_soft = (g_soft.float() / n_keep) * keep[a:a + chunk].float()[:, None]  # [C, 1]
            c_hard = (g_hard.float() / n_hard) * valid[a:a + chunk].float()[:, None]  # [C, 1]
            q = torch.exp(z - lse[a:a + chunk, None])  # [C, S]
            g = q * (c_soft * w.sum(-1, keepdim=True) + c_hard) - c_soft * w
            g.scatter_add_(1, hard[a:a + chunk].clamp(min=0)[:, None], -c_hard)
            grad[a:a + chunk] = g.to(grad.dtype)
        return grad, None, None, None, None


def subset_distill_losses(logits: torch.Tensor, soft: torch.Tensor, hard: torch.Tensor,
                          keep: torch.Tensor | None = None, chunk: int = CHUNK_ROWS) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Soft and hard cross-entropies of subset logits, and each row's top-1 index, in one chunked pass.

    Parameters
    ----------
    logits : torch.Tensor
        ``[P, S]`` the head's logits on its subset (any float dtype; computed in float32 block by block,
        the gradient returned in this dtype).
    soft : torch.Tensor
        ``[P, S]`` soft labels (rows of the target's distribution on the subset; no gradient).
    hard : torch.Tensor
        ``[P]`` long: the next token's subset index, ``-1`` where it has none.
    keep : torch.Tensor, optional
        ``[P]`` bool: the rows that count (both means run over them; the others get no gradient).
        Default: every row.

    Returns
    -------
    (soft_loss, hard_loss, top1)
        Two float32 scalars (the formulas of the module docstring) and the ``[P]`` argmax of each row.

    >>> z = torch.tensor([[0.0, 0.0]]); w = torch.tensor([[0.5, 0.5]])
    >>> [round(float(x), 4) for x in subset_distill_losses(z, w, torch.tensor([1]))[:2]]
    [0.6931, 0.6931]
    """
    if keep is None:
        keep = torch.ones(hard.shape, dtype=torch.bool, device=hard.device)
    if logits.dim() != 2 or soft.shape != logits.shape or hard.shape != logits.shape[:1] or keep.shape != hard.shape:
        raise ValueError(f"expected logits and soft [P, S], hard and keep [P], got {tuple(logits.shape)}, "
                         f"{tuple(soft.shape)}, {tuple(hard.shape)}, {tuple(keep.shape)}")
    return _SubsetDistill.apply(logits, soft.detach(), hard, keep, chunk)


def subset_distill_losses_reference(logits: torch.Tensor, soft: torch.Tensor, hard: torch.Tensor,
                                    keep: torch.Tensor | None = None
                                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The composite form of :func:`subset_distill_losses` (float32 ``log_softmax`` of the kept rows at once;
    top-1 of every row)."""
    top1 = logits.argmax(-1)
    if keep is not None:
        logits, soft, hard = logits[keep], soft[keep], hard[keep]
    logq = torch.log_softmax(logits.float(), dim=-1)  # [P, S]
    soft_loss = -(soft * logq).sum(-1).mean()
    hard_loss = F.nll_loss(logq, hard, ignore_index=-1) if bool((hard >= 0).any()) else logq.sum() * 0
    return soft_loss, hard_loss, top1


class _SubsetTV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, soft: torch.Tensor, keep: torch.Tensor, chunk: int):
        rows = logits.shape[0]
        lse = torch.empty(rows, dtype=torch.float32, device=logits.device)  # [P]
        overlap = torch.zeros((), dtype=torch.float32, device=logits.device)
        for a in range(0, rows, chunk):
            z = logits[a:a + chunk].float()  # [C, S]
            lse_c = torch.logsumexp(z, dim=-1)  # [C]
            lse[a:a + chunk] = lse_c
            q = torch.exp(z - lse_c[:, None])  # [C, S]
            overlap += (torch.minimum(q, soft[a:a + chunk].float()).sum(-1) * keep[a:a + chunk]).sum()
        n_keep = keep.sum().clamp(min=1).float()
        ctx.save_for_backward(logits, soft, keep, lse, n_keep)
        ctx.chunk = chunk
        return 1.0 - overlap / n_keep

    @staticmethod
    def backward(ctx, g_tv: torch.Tensor):
        logits, soft, keep, lse, n_keep = ctx.saved_tensors
        rows, chunk = logits.shape[0], ctx.chunk
        grad = torch.empty_like(logits)  # [P, S] in the logits' dtype
        for a in range(0, rows, chunk):
            q = torch.exp(logits[a:a + chunk].float() - lse[a:a + chunk, None])  # [C, S]
            under = q * (q < soft[a:a + chunk].float())  # [C, S]: q_s where q_s < w_s, else 0
            c = (g_tv.float() / n_keep) * keep[a:a + chunk].float()[:, None]  # [C, 1]
            grad[a:a + chunk] = (c * (q * under.sum(-1, keepdim=True) - under)).to(grad.dtype)
        return grad, None, None, None


def subset_tv_loss(logits: torch.Tensor, soft: torch.Tensor, keep: torch.Tensor | None = None,
                   chunk: int = CHUNK_ROWS) -> torch.Tensor:
    r"""Total-variation distance between the head's subset distribution and soft labels, chunked.

    The single-draft acceptance of a draft ``q`` against a target ``w`` is :math:`\sum_s \min(w_s, q_s)`
    (speculative sampling's rule, arXiv 2211.17192), so training on

    .. math:: L_{tv} = \operatorname{mean}_{i \text{ kept}} \Big(1 - \sum_s \min(w_{is}, q_{is})\Big),
              \qquad q_i = \operatorname{softmax}(z_i)

    aims at the acceptance itself, where cross-entropy aims at likelihood (the TVD objective of
    DistillSpec, arXiv 2310.08461). Its (sub)gradient, with :math:`u_{is} = q_{is} [q_{is} < w_{is}]`:

    .. math:: \partial L_{tv} / \partial z_{ij} = \frac{1}{K} \Big(q_{ij} \sum_s u_{is} - u_{ij}\Big)

    on the ``K`` kept rows, 0 elsewhere (no kept row: 1.0, no gradient). It reads the logits once more forward
    and backward than :func:`subset_distill_losses` (about 7% of a head-v2 training step on a CPU).

    Parameters
    ----------
    logits : torch.Tensor
        ``[P, S]`` the head's logits on its subset (any float dtype; float32 block by block, the gradient
        returned in this dtype).
    soft : torch.Tensor
        ``[P, S]`` soft labels (rows of the target's distribution on the subset; no gradient).
    keep : torch.Tensor, optional
        ``[P]`` bool: the rows that count. Default: every row.

    Returns
    -------
    torch.Tensor
        A float32 scalar in ``[0, 1]``.

    >>> z = torch.tensor([[0.0, 0.0]]); w = torch.tensor([[0.75, 0.25]])
    >>> round(float(subset_tv_loss(z, w)), 4)
    0.25
    """
    if keep is None:
        keep = torch.ones(logits.shape[:1], dtype=torch.bool, device=logits.device)
    if logits.dim() != 2 or soft.shape != logits.shape or keep.shape != logits.shape[:1]:
        raise ValueError(f"expected logits and soft [P, S], keep [P], got {tuple(logits.shape)}, "
                         f"{tuple(soft.shape)}, {tuple(keep.shape)}")
    return _SubsetTV.apply(logits, soft.detach(), keep, chunk)


def subset_tv_loss_reference(logits: torch.Tensor, soft: torch.Tensor,
                             keep: torch.Tensor | None = None) -> torch.Tensor:
    """The composite form of :func:`subset_tv_loss` (autograd through ``softmax`` and ``minimum``)."""
    if keep is not None:
        logits, soft = logits[keep], soft[keep]
    q = torch.softmax(logits.float(), dim=-1)  # [K, S]
    return 1.0 - torch.minimum(q, soft).sum(-1).mean()
