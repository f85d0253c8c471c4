"""Sampling controls: logits -> probabilities, applied identically to target and draft.

Losslessness needs the draft distribution used in verification to be exactly the one the drafts
were drawn from, and the target distribution to be exactly the one plain sampling would use. Both
come from :func:`logits_to_probs` with the same :class:`SamplingConfig`, in float32.
"""

from __future__ import annotations

import math
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
        if not isinstance(self.temperature, (int, float)) or math.isnan(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a number >= 0 (0 = greedy), got {self.temperature!r}")
        if math.isinf(self.temperature):
            raise ValueError("temperature must be finite")
        if 0 < self.temperature < MIN_TEMPERATURE:
            raise ValueError(f"temperature must be 0 (greedy) or >= {MIN_TEMPERATURE}, got {self.temperature!r}: "
                             f"smaller values overflow logits / temperature")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not isinstance(self.top_p, (int, float)) or not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


class NonFiniteLogitsError(ValueError):
    """Raised when a model produced NaN or inf logits."""


def check_finite(logits: torch.Tensor, who: str) -> None:
    """Raise :class:`NonFiniteLogitsError` if a row of ``logits`` has NaN or +inf, or is all -inf.

    One reduction (the row maximum propagates NaN) and one host sync.
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
        return torch.zeros_like(logits).scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)
    check_finite(logits, "a model (target or draft)")  # else NaN reaches torch.multinomial as a raw error
    logits = logits / config.temperature
    vocab = logits.shape[-1]
    if 0 < config.top_k < vocab:
        kth = torch.topk(logits, config.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if config.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        # keep a token if the mass strictly before it is < top_p (the top token is always kept)
        before = sorted_probs.cumsum(dim=-1) - sorted_probs
        keep_sorted = before < config.top_p
        keep_sorted[..., 0] = True  # a top_p below float32's resolution (e.g. 1e-300 -> 0) still keeps the top token
        keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
        probs = probs * keep
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs
