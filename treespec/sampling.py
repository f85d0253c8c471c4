"""Sampling controls: logits -> probabilities, applied identically to target and draft.

Losslessness needs the draft distribution used in verification to be exactly the one the drafts
were drawn from, and the target distribution to be exactly the one plain sampling would use. Both
come from :func:`logits_to_probs` with the same :class:`SamplingConfig`, in float32.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import numpy as np
import torch


#: the smallest positive temperature accepted (logits / T stays finite in float32 for |logits| < 3e35)
MIN_TEMPERATURE = 1e-3


@dataclass(frozen=True)
class SamplingConfig:
    """How next-token distributions are formed.

    temperature : 0 means greedy (argmax, ties to the lowest token id); > 0 scales logits.
    top_k : keep the k most likely tokens (0 = off).
    top_p : keep the smallest set of most likely tokens whose mass reaches top_p (1.0 = off).
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        # any real number but a bool (numpy scalars included) is taken, as a Python float / int
        for name in ("temperature", "top_p"):
            value = getattr(self, name)
            if isinstance(value, numbers.Real) and not isinstance(value, bool):
                try:
                    object.__setattr__(self, name, float(value))
                except OverflowError:  # an int beyond float: refused below
                    pass
        if isinstance(self.top_k, numbers.Integral) and not isinstance(self.top_k, bool):
            object.__setattr__(self, "top_k", int(self.top_k))
        if not isinstance(self.temperature, float) or math.isnan(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a number >= 0 (0 = greedy), got {self.temperature!r}")
        if math.isinf(self.temperature):
            raise ValueError("temperature must be finite")
        if 0 < self.temperature < MIN_TEMPERATURE:
            raise ValueError(f"temperature must be 0 (greedy) or >= {MIN_TEMPERATURE}, got {self.temperature!r}: "
                             f"smaller values overflow logits / temperature")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not isinstance(self.top_p, float) or not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def first_argmax(scores: torch.Tensor, dim: int = -1, keepdim: bool = False) -> torch.Tensor:
    """The index of the first maximal entry along ``dim``: ``scores.argmax(dim)``, faster.

    ``torch.max(scores, dim)`` returns the first maximal index (documented, as for ``argmax``: ties go
    to the lowest token id) and on the CPU runs several times faster than ``argmax`` over a full
    vocabulary: the greedy verifier on a 16-node tree of Gemma-3-270M's 262,144 columns went from about
    5.8 to 3.0 ms (benchmarks/results/profile/2026-11-26-xeon-amx-argmax-ab). A float32 or float64 tensor on
    the CPU goes to numpy's ``argmax`` instead (the same first maximal index, documented), a vectorised scan
    about ten times faster again on one row (``benchmarks/sampling_cost.py`` times both). Tested equal to
    ``argmax`` on ties, in float32, float64 and bf16. A NaN counts as the maximum in all three (the model runners
    reject NaN logits before any of this runs).

    scores of any shape (``[..., V]`` with the default ``dim``) -> int64 ``[...]`` (``[..., 1]`` with
    ``keepdim``)."""
    if scores.device.type == "cpu" and scores.dtype in (torch.float32, torch.float64) and scores.dim() > 0:
        found = np.argmax(scores.detach().resolve_conj().resolve_neg().numpy(), axis=dim, keepdims=keepdim)
        return torch.as_tensor(found, dtype=torch.int64)
    return torch.max(scores, dim=dim, keepdim=keepdim).indices


class NonFiniteLogitsError(ValueError):
    """Raised when a model produced NaN or inf logits."""


def check_finite(logits: torch.Tensor, who: str) -> None:
    """Raise :class:`NonFiniteLogitsError` if a row of ``logits`` has NaN or +inf, or is all -inf.

    One reduction (the row maximum propagates NaN) and one host sync. logits ``[..., V]`` (rows along the
    last dimension).
    """
    row_max = logits.amax(dim=-1)
    if not bool(torch.isfinite(row_max).all()):
        bad = "NaN" if bool(torch.isnan(row_max).any()) else "infinite"
        raise NonFiniteLogitsError(
            f"{who} produced {bad} logits; check the model weights and dtype (try --dtype float32)"
        )


def logits_to_probs(logits: torch.Tensor, config: SamplingConfig) -> torch.Tensor:
    """``[..., V]`` logits -> ``[..., V]`` float32 probabilities under ``config``.

    Greedy (temperature 0) gives a one-hot of the argmax.
    """
    logits = logits.float()
    if config.greedy:
        return torch.zeros_like(logits).scatter_(-1, first_argmax(logits, keepdim=True), 1.0)
    check_finite(logits, "a model (target or draft)")  # NaN would reach the draws as garbage ids
    if config.temperature != 1.0:
        logits = logits / config.temperature
    vocab = logits.shape[-1]
    if 0 < config.top_k < vocab:
        kth = torch.topk(logits, config.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if config.top_p < 1.0:
        probs = probs * top_p_mask(probs, config.top_p)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def top_p_mask_reference(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """The nucleus of each row of ``probs`` ``[..., V]`` as a bool mask, the slow and obvious way: sort each row
    (probability descending, ties by token id ascending: a stable sort), keep a token if the mass strictly before
    it is below ``top_p`` (the top token is always kept). Rows below float32 precision are summed in float32."""
    if probs.dtype not in (torch.float32, torch.float64):
        probs = probs.float()
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    before = sorted_probs.cumsum(dim=-1) - sorted_probs
    keep_sorted = before < top_p
    keep_sorted[..., 0] = True  # a top_p below float32's resolution (e.g. 1e-300 -> 0) still keeps the top token
    return torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)


#: the probability thresholds :func:`top_p_mask` tries, largest first: the tokens at or above one are its candidates
TOP_P_THRESHOLDS = (1e-4, 1e-6, 1e-8)


def top_p_mask(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """:func:`top_p_mask_reference` without sorting the vocabulary (tested equal, ties included).

    A nucleus is usually small. For a threshold ``t`` (:data:`TOP_P_THRESHOLDS`, largest first) the candidates
    are a row's tokens with probability ``>= t``: every other token comes after all of them in the reference's
    order. Sorting the candidates alone (stable, so ties keep the lowest ids first) gives the first positions of
    that order and the reference's own prefix sums; once their mass exceeds ``top_p`` by more than float32's
    rounding, the mass before every later token does too, so the nucleus is the first ``K`` candidates whose mass
    before them is below ``top_p``. A row whose candidates hold too little mass tries the next threshold; past the
    last one the reference decides. On real logits the nucleus is small (top-p 0.95 at T=0.7 on Gemma-3-270M:
    a median of 8 tokens), so a row of 262,144 entries costs a few vectorised scans (its minimum, a comparison
    and its nonzero positions) and a sort of a few dozen values instead of a full sort; a nucleus reaching
    below the last threshold pays the candidate sorts and then the reference's. The reasoning needs entries
    that are >= 0 and not NaN (probabilities): a row with a negative or NaN entry goes to the reference.

    probs ``[..., V]`` -> bool ``[..., V]`` (the reference's layout and result).
    """
    if probs.dtype not in (torch.float32, torch.float64):  # the margin below is float32's rounding
        probs = probs.float()
    flat = probs.reshape(-1, probs.shape[-1])  # [M, V]
    keep = torch.zeros_like(flat, dtype=torch.bool)  # [M, V]
    for r in range(flat.shape[0]):
        keep[r] = _nucleus_of_row(flat[r], top_p)
    return keep.reshape(probs.shape)


def _nucleus_of_row(row: torch.Tensor, top_p: float) -> torch.Tensor:
    """:func:`top_p_mask` of one row ``[V]`` -> bool ``[V]``."""
    if not float(row.amin()) >= 0:  # a negative entry (the reference's prefix sums fall) or NaN (it sorts first)
        return top_p_mask_reference(row[None], top_p)[0]
    for threshold in TOP_P_THRESHOLDS:
        ids = (row >= threshold).nonzero().squeeze(1)  # [C] ascending token ids
        if ids.numel() == 0:
            continue
        values, order = torch.sort(row.index_select(0, ids), descending=True, stable=True)  # [C]
        cum = values.cumsum(dim=0)
        if float(cum[-1]) - _TOP_P_MARGIN < top_p:  # the nucleus may reach below the threshold
            continue
        inside = (cum - values) < top_p  # [C] the reference's test at the first C sorted positions
        inside[0] = True
        count = int(inside.sum())
        if not bool(inside[:count].all()):  # not a prefix (rounding of an unnormalised row): let the reference say
            break
        keep = torch.zeros_like(row, dtype=torch.bool)
        return keep.index_fill_(0, ids.index_select(0, order[:count]), True)
    return top_p_mask_reference(row[None], top_p)[0]


#: how far past top_p the candidates' mass must reach before later tokens are known to be outside: a prefix sum
#: minus its last term may round below the sum before it by an ulp (1.2e-7 near 1)
_TOP_P_MARGIN = 1e-6


def row_mass(x: torch.Tensor, block: int = 512) -> torch.Tensor:
    """Row sums of ``x`` ``[M, V]`` as float64 ``[M, 1]``: float32 sums over blocks of ``block``
    entries, then a float64 sum of the blocks (close to a float64 sum, without casting every entry)."""
    m, v = x.shape
    pad = (-v) % block
    if pad:
        x = torch.nn.functional.pad(x, (0, pad))
    return x.view(m, -1, block).sum(-1).double().sum(-1, keepdim=True)


def draw(probs: torch.Tensor, generator: torch.Generator | None = None, num_draws: int = 1,
         block: int = 512) -> torch.Tensor:
    """Exact draws with replacement from each row of ``probs``: ``[..., V]`` -> ``[..., num_draws]``.

    Inverse-CDF sampling in two stages, so that no row needs a cumulative sum over all ``V``
    entries: a first uniform picks a block of ``block`` tokens with probability (block mass) /
    (row mass), from float64 cumulative sums of the block masses; a second uniform picks a token
    inside the block with probability p_i / (block mass), from a float64 cumulative sum of that
    block alone. Token ``i`` is thus drawn with probability p_i / sum(p) up to float64 rounding
    (block masses are float32 sums of their entries, relative error about 1e-7, the order of the
    rounding of ``probs`` itself; every later sum is float64), and a zero-probability token never.

    Rows need not be normalised but must have positive, finite mass (not checked here: that would
    cost a host sync; :func:`logits_to_probs` and the verification rules guarantee it). Costs two
    uniforms per draw and one read of ``probs``; on a CPU with a 262,144-token vocabulary it is
    several times faster than ``torch.multinomial`` (which draws V exponentials per row).

    >>> g = torch.Generator().manual_seed(0)
    >>> draw(torch.tensor([[0.0, 1.0, 0.0], [0.5, 0.0, 0.5]]), g, num_draws=4)[0].tolist()
    [1, 1, 1, 1]
    """
    if num_draws < 1:
        raise ValueError(f"num_draws must be >= 1, got {num_draws}")
    lead, v = probs.shape[:-1], probs.shape[-1]
    flat = probs.reshape(-1, v)  # [R, V]
    rows = flat.shape[0]
    pad = (-v) % block
    if pad:
        flat = torch.nn.functional.pad(flat, (0, pad))
    blocks = flat.view(rows, -1, block)  # [R, nb, block]
    cdf = blocks.sum(-1).double().cumsum(-1)  # [R, nb] (a float64 sum would cast every entry first)
    total = cdf[:, -1:]  # [R, 1]
    zero = torch.zeros((), dtype=torch.float64, device=probs.device)
    u = torch.rand(rows, num_draws, generator=generator, dtype=torch.float64, device=probs.device) * total
    # u < total strictly (rounding of u * total could reach it): the block found has positive mass
    u = torch.minimum(u, torch.nextafter(total, zero))
    kb = torch.searchsorted(cdf, u, right=True).clamp(max=cdf.shape[1] - 1)  # [R, n]
    inner = blocks.gather(1, kb[:, :, None].expand(rows, num_draws, block)).double().cumsum(-1)  # [R, n, block]
    mass = inner[..., -1:]  # [R, n, 1]
    u2 = torch.rand(rows, num_draws, 1, generator=generator, dtype=torch.float64, device=probs.device) * mass
    u2 = torch.minimum(u2, torch.nextafter(mass, zero))
    tokens = kb * block + torch.searchsorted(inner, u2, right=True).squeeze(-1)  # [R, n]
    return tokens.reshape(*lead, num_draws)
