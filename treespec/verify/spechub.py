"""SpecHub's two-draft node rule (draft law ``"spechub"``).

Reference: Sun, Zhou, Chen, Sun. "SpecHub: Provable Acceleration to Multi-Draft Speculative
Decoding", EMNLP 2024, arXiv 2411.05289; the scheme below follows the authors' public code
(github.com/MasterGodzilla/Speculative_decoding_OT: ``Sequoia/utils.py::sampling_a_and_i`` for the
pair law, ``Sequoia/Tree/MyTree.py::accept_step`` for verification), rewritten here in node-rule form.

Draft law (ordered pair). Let a = argmax q (the *hub*; ties go to the smallest token id, as
``torch.argmax``) and ``qbar = norm(q with a removed)``. Draw the first child x_1 ~ q; if x_1 != a the
second child is a, else the second child is drawn from qbar. So the pair law is sparse:

    Q(i, a) = q(i)                 (i != a)
    Q(a, i) = q(a) * qbar(i)       (i != a)

and no other pair occurs. If q is a point mass on a, qbar is uniform on the other tokens (our
convention; the authors' code divides by zero there). A node with a single child is just the first
draw x_1 ~ q, verified by single-draft speculative sampling, as in the authors' code.

Verification (a transport plan filled greedily: the non-hub token of each pair first, then the hub):

1. pair (i, a): accept i (child 1) w.p. ``min(1, p(i) / q(i))``; leftover target
   ``p1(i) = (p(i) - q(i))+``, leftover pair mass ``(q(i) - p(i))+`` whose total is ``S_ia``.
2. pair (a, i): accept i (child 2) w.p. ``min(1, p1(i) / Q(a, i))``; leftover target
   ``p2(i) = (p1(i) - Q(a, i))+``, leftover pair mass ``(Q(a, i) - p1(i))+`` whose total is ``S_ai``.
3. pair (a, i), i rejected: accept a (child 1) w.p. ``min(1, p(a) / S_ai)``;
   leftover ``pa1 = (p(a) - S_ai)+``.
4. pair (i, a), i rejected: accept a (child 2) w.p. ``min(1, pa1 / S_ia)``;
   leftover ``pa2 = (pa1 - S_ia)+``.
5. otherwise sample ``norm(p2 on tokens != a, pa2 on a)``.

Each step moves exactly ``min(leftover pair mass, leftover target)`` and the probabilities of the
hub steps do not depend on i, so the accepted mass on each token never exceeds p and the residual
carries precisely what is left: the output law is p.
"""

from __future__ import annotations

import torch

from ..sampling import first_argmax
from .rules import _normalise, _ratio


def hub_and_second_law(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The hub token ``a`` ``[M, 1]`` and ``qbar`` ``[M, V]`` (q without a, renormalised; uniform if empty)
    of q ``[M, V]``.

    Shared with the drafter so that the law sampled from and the law verified against agree.
    """
    a = first_argmax(q, dim=1, keepdim=True)  # [M, 1] first maximal index
    not_a = torch.ones_like(q, dtype=torch.bool).scatter_(1, a, False)  # [M, V]
    rest, ok = _normalise(q * not_a)
    uniform, _ = _normalise(not_a.to(q.dtype))
    return a, torch.where(ok, rest, uniform)


def spechub_rule(p: torch.Tensor, q: torch.Tensor | None, child_tokens: torch.Tensor,
                 child_valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The SpecHub node rule (see the module docstring).

    p ``[M, V]``, q ``[M, V]`` (required), child_tokens ``[M, K]`` (a node's children in columns 0 and 1,
    later columns padding), child_valid ``[M, K]`` bool -> choice_probs ``[M, K + 1]``, residual ``[M, V]``."""
    if q is None:
        raise ValueError("spechub needs draft_probs (the law the pair was drawn from)")
    m, k = child_tokens.shape  # columns past the second must be padding (rows with > 2 valid
    # children are not SpecHub nodes and fall to the reject-all branch below)
    dtype, device = p.dtype, p.device
    a, qbar = hub_and_second_law(q)  # [M, 1], [M, V]
    not_a = torch.ones_like(p, dtype=torch.bool).scatter_(1, a, False)  # [M, V]
    q_ia = q * not_a  # [M, V] Q(i, a)
    q_ai = q.gather(1, a) * qbar  # [M, V] Q(a, i)
    p_off = p * not_a
    p1 = (p_off - q_ia).clamp(min=0)
    s_ia = (q_ia - p_off).clamp(min=0).sum(dim=1, keepdim=True)  # [M, 1]
    p2 = (p1 - q_ai).clamp(min=0)
    s_ai = (q_ai - p1).clamp(min=0).sum(dim=1, keepdim=True)  # [M, 1]
    p_a = p.gather(1, a)  # [M, 1]
    pa1 = (p_a - s_ai).clamp(min=0)
    pa2 = (pa1 - s_ia).clamp(min=0)
    pair_residual, ok = _normalise(p2.scatter(1, a, pa2))  # [M, V]
    pair_residual = torch.where(ok, pair_residual, p)  # no leftover: every pair is accepted

    n = child_valid.sum(dim=1, keepdim=True)  # [M, 1]
    x0 = child_tokens[:, :1]  # [M, 1]
    x1 = child_tokens[:, 1:2] if k > 1 else x0
    zero = torch.zeros(m, 1, dtype=dtype, device=device)

    # pair (i, a): child 1 = i, child 2 = a
    ia = (n == 2) & (x1 == a) & (x0 != a)
    acc_i = _ratio(p.gather(1, x0), q.gather(1, x0))  # step 1
    acc_hub = _ratio(pa1, s_ia)  # step 4
    ia_choice = torch.cat([acc_i, (1 - acc_i) * acc_hub, (1 - acc_i) * (1 - acc_hub)], dim=1)
    # pair (a, i): child 1 = a, child 2 = i
    ai = (n == 2) & (x0 == a) & (x1 != a)
    acc_i2 = _ratio(p1.gather(1, x1), q_ai.gather(1, x1))  # step 2
    acc_hub2 = _ratio(p_a, s_ai)  # step 3
    ai_choice = torch.cat([(1 - acc_i2) * acc_hub2, acc_i2, (1 - acc_i2) * (1 - acc_hub2)], dim=1)
    # single child: x ~ q, single-draft speculative sampling
    single = n == 1
    acc_s = _ratio(p.gather(1, x0), q.gather(1, x0))
    single_choice = torch.cat([acc_s, zero, 1 - acc_s], dim=1)
    single_residual, ok_s = _normalise((p - q).clamp(min=0))
    single_residual = torch.where(ok_s, single_residual, p)
    # anything else (no children, or a pair without the hub: never drawn by the spechub law):
    # reject every child and emit from p, which is lossless on its own.
    reject_all = torch.cat([zero, zero, torch.ones_like(zero)], dim=1)

    choice3 = torch.where(ia, ia_choice, torch.where(ai, ai_choice, torch.where(single, single_choice, reject_all)))
    residual = torch.where(ia | ai, pair_residual, torch.where(single, single_residual, p))
    choice = torch.zeros(m, k + 1, dtype=dtype, device=device)  # [M, K+1]
    choice[:, :min(k, 2)] = choice3[:, :min(k, 2)]
    choice[:, k] = choice3[:, 2]
    return choice, residual
