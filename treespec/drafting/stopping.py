"""When a drafted path stops growing: the draft's own confidence, or a trained acceptance head.

A stopping rule looks at one level of drawn children and says, for each child, whether it is proposed at
all (``keep``) and whether it gets children of its own (``grow``). It may read only what the draft
computed (its probabilities, its features, the drawn tokens), never the target, so every tree it shapes
verifies losslessly; a sampled child is always kept, since dropping it after the draw would change the
law its siblings were drawn under.

- :class:`ConfidenceStop`: a child grows when the draft gives it at least ``min_confidence`` (EAGLE-2,
  arXiv 2406.16858, shows that confidence predicts acceptance); at temperature 0 a child below it is not
  proposed.
- :class:`PredictedStop`: the rule of SpecDec++ ("SpecDec++: Boosting Speculative Decoding via Adaptive
  Candidate Lengths", arXiv 2405.19715): a small trained head (:class:`AcceptanceHead`) predicts each
  drafted token's chance of acceptance given that its ancestors were accepted; a path stops growing once
  the predicted chance that some token on it is rejected, ``1 - prod(a)``, exceeds ``max_reject``. The
  token that crosses it is still proposed (as a leaf).

:class:`AcceptanceHead` reads the draft's output feature that produced ``q`` (``[M, H]``) and four numbers
per drawn child: ``log q(x)``, ``log max q``, the entropy of ``q`` and the child's depth. Trained by
``python -m treespec.distill acceptance`` on the target's own continuations (soft labels
``min(1, p(x) / q(x))`` for sampled drafts, ``[x = argmax p]`` at temperature 0), one set of weights per
regime ("greedy" and "sampled").
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

#: the regimes an acceptance head has weights for: temperature 0 and temperature > 0
REGIMES = ("greedy", "sampled")
#: the per-child numbers the head reads beside the feature (:func:`child_numbers`)
NUM_NUMBERS = 4
STOP_HEAD_FORMAT = "treespec-acceptance-head"


@dataclass(frozen=True)
class StopDecision:
    """One level's decision: ``keep`` / ``grow`` ``[M, k]`` bool and the path's predicted acceptance
    ``[M, k]`` (the product of the predicted acceptances from the root down to the child; None where the
    rule keeps none)."""

    keep: torch.Tensor  # [M, k] bool: the child is proposed
    grow: torch.Tensor  # [M, k] bool: the child gets children
    path_accept: torch.Tensor | None  # [M, k] float


def child_numbers(q: torch.Tensor, columns: torch.Tensor, depth: torch.Tensor) -> torch.Tensor:
    """``[M, k, 4]``: ``log q(x)``, ``log max q``, ``H(q)`` (nats) and the child's depth, for drawn columns
    ``columns`` ``[M, k]`` (negative: no child; its numbers are those of column 0) of probability rows ``q``
    ``[M, Vs]`` whose nodes sit at depth ``depth`` ``[M]`` (the children at ``depth + 1``)."""
    q = q.float()
    logq = torch.log(q.clamp(min=1e-30))  # [M, Vs]
    entropy = -(q * logq).sum(-1)  # [M]
    log_max = logq.max(-1).values  # [M]
    picked = logq.gather(1, columns.clamp(min=0))  # [M, k]
    k = columns.shape[1]
    return torch.stack([picked, log_max[:, None].expand(-1, k), entropy[:, None].expand(-1, k),
                        (depth.float() + 1)[:, None].expand(-1, k)], dim=-1)  # [M, k, 4]


@dataclass(frozen=True)
class AcceptanceHeadConfig:
    hidden_size: int  # the draft feature's width H
    width: int = 64  # the hidden layer's width


class AcceptanceHead(nn.Module):
    """Predicted acceptance of a drafted token: ``sigmoid(w2 relu(w1 [f / rms(f), numbers] + b1) + b2)``, one
    set of weights per regime (:data:`REGIMES`)."""

    def __init__(self, cfg: AcceptanceHeadConfig) -> None:
        super().__init__()
        self.cfg = cfg
        inputs = cfg.hidden_size + NUM_NUMBERS
        self.nets = nn.ModuleDict({r: nn.Sequential(nn.Linear(inputs, cfg.width), nn.ReLU(), nn.Linear(cfg.width, 1))
                                   for r in REGIMES})
        #: the numbers' scale (centre, spread), set from the training rows
        self.register_buffer("number_shift", torch.zeros(NUM_NUMBERS))
        self.register_buffer("number_scale", torch.ones(NUM_NUMBERS))

    def logit(self, regime: str, feature: torch.Tensor, numbers: torch.Tensor) -> torch.Tensor:
        """Acceptance logits ``[...]`` of features ``[..., H]`` and numbers ``[..., 4]``."""
        f = feature.float()
        f = f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + 1e-6)
        x = torch.cat([f, (numbers.float() - self.number_shift) / self.number_scale], dim=-1)
        return self.nets[regime](x)[..., 0]

    def predict(self, regime: str, feature: torch.Tensor, q: torch.Tensor, columns: torch.Tensor,
                depth: torch.Tensor) -> torch.Tensor:
        """Predicted acceptance ``[M, k]`` of the children ``columns`` ``[M, k]`` drawn from ``q`` ``[M, Vs]``
        by nodes of feature ``feature`` ``[M, H]`` at depth ``depth`` ``[M]``."""
        numbers = child_numbers(q, columns, depth)  # [M, k, 4]
        k = columns.shape[1]
        with torch.no_grad():
            return torch.sigmoid(self.logit(regime, feature[:, None, :].expand(-1, k, -1), numbers))

    def save(self, path: str | Path, extra: dict | None = None) -> None:
        from .weights_file import save_module

        save_module(self, path, fmt=STOP_HEAD_FORMAT, config=asdict(self.cfg), extra=extra)

    @classmethod
    def load(cls, path: str | Path, device: torch.device | str = "cpu") -> "AcceptanceHead":
        """An acceptance head from its file (one clear ``ValueError`` for a file that is not one)."""
        from .weights_file import load_module

        return load_module(cls, AcceptanceHeadConfig, path, fmt=STOP_HEAD_FORMAT, what="acceptance head",
                           device=device)


@dataclass(frozen=True)
class ConfidenceStop:
    """A child grows when its draft probability reaches ``min_confidence``; at temperature 0 (deterministic
    candidates, ranks in falling probability) a child below it is not proposed."""

    min_confidence: float
    needs_feature = False
    tracks_path = False  # decide() takes no parent_accept / depth (None)

    def __post_init__(self) -> None:
        if not 0.0 <= self.min_confidence < 1.0:
            raise ValueError(f"min_confidence must be in [0, 1), got {self.min_confidence}")

    def decide(self, deterministic: bool, q: torch.Tensor, columns: torch.Tensor, feature: torch.Tensor | None,
               parent_accept: torch.Tensor | None, depth: torch.Tensor | None) -> StopDecision:
        """``q`` ``[M, Vs]``: the probabilities the children ``columns`` ``[M, k]`` were ranked or drawn by."""
        confident = q.gather(1, columns.clamp(min=0)) >= self.min_confidence  # [M, k]
        keep = confident if deterministic else torch.ones_like(confident)
        return StopDecision(keep, confident, None)


@dataclass(frozen=True, eq=False)
class PredictedStop:
    """SpecDec++'s rule with a trained :class:`AcceptanceHead`: a child's path acceptance is its parent's times
    the head's prediction for it; every child is proposed, and it grows while its path's predicted chance of
    some rejection, ``1 - path_accept``, stays at most ``max_reject``."""

    head: AcceptanceHead
    max_reject: float
    needs_feature = True
    tracks_path = True

    def __post_init__(self) -> None:
        if not 0.0 <= self.max_reject < 1.0 or math.isnan(self.max_reject):
            raise ValueError(f"max_reject must be in [0, 1), got {self.max_reject}")

    def decide(self, deterministic: bool, q: torch.Tensor, columns: torch.Tensor, feature: torch.Tensor | None,
               parent_accept: torch.Tensor, depth: torch.Tensor) -> StopDecision:
        """``q`` ``[M, Vs]`` as in :class:`ConfidenceStop`; ``feature`` ``[M, H]`` the draft's output behind each row;
        ``parent_accept`` ``[M]`` each node's path acceptance; ``depth`` ``[M]`` each node's depth (the children's
        is one more). At temperature 0 (``deterministic``) the head's greedy weights, else its sampled ones."""
        if feature is None:
            raise ValueError("the acceptance head reads the draft's features: this draft gave none")
        if feature.shape[-1] != self.head.cfg.hidden_size:
            raise ValueError(f"the acceptance head reads features of width {self.head.cfg.hidden_size}; "
                             f"this draft's are {feature.shape[-1]} wide")
        regime = "greedy" if deterministic else "sampled"
        accept = self.head.predict(regime, feature, q, columns, depth)  # [M, k]
        path = parent_accept.float()[:, None] * accept  # [M, k]
        keep = torch.ones_like(path, dtype=torch.bool)
        return StopDecision(keep, path >= 1.0 - self.max_reject, path)


def stopping_rule(min_confidence: float = 0.0, stop: ConfidenceStop | PredictedStop | None = None
                  ) -> ConfidenceStop | PredictedStop | None:
    """The rule a tree builder's ``min_confidence`` / ``stop`` arguments stand for: ``stop`` itself, a
    :class:`ConfidenceStop` for a positive ``min_confidence``, else None. Giving both is refused (``ValueError``)."""
    if stop is not None and min_confidence != 0.0:
        raise ValueError("give min_confidence or a stopping rule, not both")
    return stop if stop is not None or min_confidence == 0.0 else ConfidenceStop(float(min_confidence))
