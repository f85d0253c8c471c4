"""Sampling controls: logits -> probabilities, applied identically to target and draft.

Losslessness needs the draft distribution used in verification to be exactly the one the drafts
were drawn from, and the target distribution to be exactly the one plain sampling would use. Both
come from :func:`logits_to_probs` with the same :class:`SamplingConfig`, in float32.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

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
    5.8 to 3.0 ms (benchmarks/results/profile/2026-11-26-xeon-amx-argmax-ab). Tested equal to ``argmax``
    on ties, in float32 and bf16. A NaN counts as the maximum in both (the model runners reject NaN
    logits before any of this runs).

    scores of any shape (``[..., V]`` with the default ``dim``) -> int64 ``[...]`` (``[..., 1]`` with
    ``keepdim``)."""
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


#: the first candidate count of :func:`top_p_mask` (grown fourfold while a row's nucleus is larger)
TOP_P_FIRST_K = 64


def top_p_mask(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """:func:`top_p_mask_reference` without sorting the vocabulary (tested equal, ties included).

    A nucleus is usually small. Take the ``k`` largest values of a row (``torch.topk``, a partial selection) and
    the reference's own test on them (the same prefix sums as the full sort). Once their mass exceeds ``top_p``
    by more than float32's rounding, every later token is outside, and the ``K`` kept positions are known; the
    kept tokens are then every token above the ``K``-th value ``v`` plus, among the tokens equal to ``v``, the
    lowest ids that fill ``K`` (the stable order). Rows whose nucleus is larger retry with 4k candidates; at the
    whole vocabulary the reference decides. On a 262,144-entry row this replaces a full sort (tens of ms a row
    on a 2-core CPU) by a selection of a few dozen values.

    probs ``[..., V]`` -> bool ``[..., V]`` (the reference's layout and result).
    """
    if probs.dtype not in (torch.float32, torch.float64):  # the margin below is float32's rounding
        probs = probs.float()
    shape = probs.shape
    flat = probs.reshape(-1, shape[-1])  # [M, V]
    vocab = flat.shape[1]
    keep = torch.zeros_like(flat, dtype=torch.bool)  # [M, V]
    todo = torch.arange(flat.shape[0], device=flat.device)
    k = min(TOP_P_FIRST_K, vocab)
    while todo.numel():
        rows = flat if todo.numel() == flat.shape[0] else flat[todo]  # [m, V]
        if k >= vocab:
            keep[todo] = top_p_mask_reference(rows, top_p)
            break
        vals = torch.topk(rows, k, dim=-1).values  # [m, k] descending
        cum = vals.cumsum(dim=-1)
        inside = (cum - vals) < top_p  # [m, k] the reference's test at the first k sorted positions
        inside[:, 0] = True
        count = inside.sum(dim=-1, keepdim=True)  # [m, 1]
        prefix = (inside == (torch.arange(k, device=flat.device) < count)).all(dim=-1)
        decided = prefix & (cum[:, -1] - _TOP_P_MARGIN >= top_p)  # later positions: mass before them >= top_p
        if bool(decided.any()):
            idx = todo[decided]
            cut = vals[decided].gather(1, count[decided] - 1)  # [d, 1] the smallest kept value
            sub = rows if bool(decided.all()) else rows[decided]  # [d, V]
            at_least = sub >= cut  # [d, V]
            # more tokens equal to the cut than the nucleus has room for (ties): the lowest ids among them
            excess = at_least.sum(dim=-1, keepdim=True) > count[decided]
            if bool(excess.any()):
                tied = sub == cut
                need = count[decided] - (at_least & ~tied).sum(dim=-1, keepdim=True)
                at_least = torch.where(excess, (at_least & ~tied) | (tied & (tied.cumsum(dim=-1) <= need)), at_least)
            keep[idx] = at_least
        todo = todo[~decided]
        k = min(4 * k, vocab)
    return keep.reshape(shape)


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
