"""Drawing the children of many tree nodes at once, under each draft law of :data:`treespec.tree.DRAFT_LAWS`.

``draw_children(draft_probs [M, V], num_children, law, generator)`` returns the ordered child tokens
``[M, K]`` of M nodes and a validity mask ``[M, K]`` (nodes may get different child counts). The
order of the columns is the draw order, which becomes the children's index order in the tree and
is part of the law the verifier relies on. Everything is vectorised over nodes, runs on the device
of ``draft_probs`` (pass a generator on that device) and, when ``num_children`` is a Python int or
``max_children`` is given, needs no host sync.

Laws (q = the node's draft distribution, n = its number of children):

``"iid"``                 n draws from q with replacement (:func:`treespec.sampling.draw`).
``"without_replacement"`` n ordered draws without replacement, by the exponential race: the
                          tokens with the n smallest ``E_y / q(y)``, ``E_y ~ Exp(1)`` i.i.d., in
                          increasing order (same law as drawing one at a time and renormalising q).
                          **Truncates** at the support of q: a node whose q has fewer than n
                          non-zero tokens gets only those (the remaining slots are invalid). Raises
                          if n exceeds the vocabulary.
``"deterministic"``       the n most likely tokens of q, ties broken by the smaller token id.
                          Raises if n exceeds the vocabulary.
``"greedy_draft"``        the n - 1 most likely tokens T (ties by token id), then one token from
                          q restricted to the complement of T and renormalised (uniform on the
                          complement if q has no mass there), last. Raises if n exceeds the vocabulary.
``"spechub"``             n <= 2. x_1 ~ q; x_2 = the hub a = argmax q if x_1 != a, else a draw
                          from q without a, renormalised (uniform on the other tokens if q is a
                          point mass). With n = 1 just x_1. Raises if n > 2.

The restricted laws are computed by the same helpers the verifiers use
(:func:`treespec.verify.greedy_draft.restricted_draft`, :func:`treespec.verify.spechub.hub_and_second_law`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..sampling import draw
from ..tree import DRAFT_LAWS
from ..verify.greedy_draft import restricted_draft
from ..verify.spechub import hub_and_second_law


class Drafts(NamedTuple):
    tokens: torch.Tensor  # [M, K] int64 child tokens in draw order (0 where invalid)
    valid: torch.Tensor  # [M, K] bool


def _counts(num_children: int | torch.Tensor, m: int, device: torch.device,
            max_children: int | None) -> tuple[torch.Tensor, int]:
    """Per-node counts ``[M]`` int64 and the padded width K."""
    if isinstance(num_children, int):
        if num_children < 0:
            raise ValueError(f"num_children must be >= 0, got {num_children}")
        return torch.full((m,), num_children, dtype=torch.long, device=device), num_children
    counts = torch.as_tensor(num_children, device=device).long()
    if counts.shape != (m,):
        raise ValueError(f"num_children must be an int or a [M={m}] tensor, got shape {tuple(counts.shape)}")
    if max_children is not None:
        return counts, int(max_children)
    if m == 0:
        return counts, 0
    lo, hi = torch.stack([counts.min(), counts.max()]).tolist()  # one host sync to size the output
    if lo < 0:
        raise ValueError(f"num_children must be >= 0, got {lo}")
    return counts, int(hi)


def _descending_order(q: torch.Tensor) -> torch.Tensor:
    """Token ids of each row by decreasing q, ties by increasing id: ``[M, V]`` (the reference of
    :func:`top_order`)."""
    return torch.sort(q, dim=1, descending=True, stable=True).indices


def top_order(q: torch.Tensor, k: int) -> torch.Tensor:
    """The first ``k`` columns of :func:`_descending_order` (ties by increasing id) without sorting
    the whole row: one ``topk`` over an int64 key that orders by value, then by id. ``q`` ``[M, V]``
    float (no NaN; -inf allowed) -> ``[M, k]`` token ids. A full-vocabulary stable sort costs ~5 ms
    per row at V = 262,144 on a CPU core; this is a few linear passes."""
    m, v = q.shape
    if k == 0:
        return torch.zeros(m, 0, dtype=torch.long, device=q.device)
    bits = (q.float() + 0.0).view(torch.int32).long()  # + 0.0: -0.0 ties with +0.0, as in the sort
    monotone = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)  # IEEE order as integer order
    ids = torch.arange(v, device=q.device)
    key = (monotone << 32) | (v - 1 - ids)  # larger = higher value, then smaller id
    return (v - 1) - (torch.topk(key, k, dim=1, sorted=True).values & 0xFFFFFFFF)


def draw_children(draft_probs: torch.Tensor, num_children: int | torch.Tensor, law: str,
                  generator: torch.Generator | None = None, *,
                  max_children: int | None = None) -> Drafts:
    """Draw the ordered children of M nodes: ``(tokens [M, K] int64, valid [M, K] bool)``.

    ``draft_probs`` ``[M, V]``: each row a probability vector (already processed by temperature /
    top-k / top-p exactly as it will be handed to the verifier). ``num_children``: an int for every
    node, or a ``[M]`` tensor of per-node counts (then K = its max, read with one host sync unless
    ``max_children`` is given). See the module docstring for each law.
    """
    if law not in DRAFT_LAWS:
        raise ValueError(f"unknown draft law {law!r}; expected one of {DRAFT_LAWS}")
    if draft_probs.ndim != 2:
        raise ValueError(f"draft_probs must be [M, V], got shape {tuple(draft_probs.shape)}")
    q = draft_probs
    m, v = q.shape
    device = q.device
    counts, k = _counts(num_children, m, device, max_children)
    cols = torch.arange(k, device=device)
    valid = cols[None, :] < counts[:, None]  # [M, K]
    if k == 0 or m == 0:
        return Drafts(torch.zeros(m, k, dtype=torch.long, device=device), valid)
    if law != "iid" and k > v:
        raise ValueError(f"law {law!r} cannot draw {k} distinct children from a vocabulary of {v}")

    if law == "iid":
        tokens = draw(q, generator, num_draws=k)
    elif law == "without_replacement":
        race = torch.empty_like(q).exponential_(generator=generator)  # [M, V] Exp(1)
        keys = torch.where(q > 0, race / q.clamp(min=torch.finfo(q.dtype).tiny), torch.inf)
        keys, tokens = torch.topk(keys, k, dim=1, largest=False, sorted=True)
        valid = valid & torch.isfinite(keys)  # truncation at the support of q
    elif law == "deterministic":
        tokens = top_order(q, k)  # [M, K]
    elif law == "greedy_draft":
        order = top_order(q, k)  # [M, K] the k best tokens, best first
        num_fixed = (counts - 1).clamp(min=0)[:, None]  # [M, 1]
        fixed_mask = torch.zeros_like(q, dtype=torch.bool).scatter_(1, order, cols[None, :] < num_fixed)  # [M, V]
        last = draw(restricted_draft(q, fixed_mask), generator)  # [M, 1]
        tokens = torch.where(cols[None, :] == num_fixed, last, order)
    else:  # spechub
        if k > 2:
            raise ValueError(f"law 'spechub' draws at most 2 children per node, got {k}")
        first = draw(q, generator)  # [M, 1]
        if k == 1:
            tokens = first
        else:
            if v < 2:
                raise ValueError("law 'spechub' needs a vocabulary of at least 2 tokens for a pair")
            hub, qbar = hub_and_second_law(q)
            other = draw(qbar, generator)  # [M, 1]
            tokens = torch.cat([first, torch.where(first == hub, other, hub)], dim=1)
    tokens = torch.where(valid, tokens, torch.zeros_like(tokens))
    return Drafts(tokens, valid)
