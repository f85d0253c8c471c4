"""Judge decoding's judge: a small trained head that accepts drafted tokens the target would not have chosen.

LOSSY by design: a run with a judge does not follow the target's distribution ("Judge Decoding: Faster
Speculative Sampling Requires Going Beyond Model Alignment", Bachmann et al., arXiv 2501.19309). The judge
reads what the target's tree pass computes anyway for a drafted node ``c`` with parent ``u``:

- ``h_c`` ``[H]``: the target's last hidden state at ``c`` (after the final norm; it has read ``c``'s token),
  scaled to unit RMS;
- ``gap_c = s_u[x_c] - max s_u``: how far the target's logit for ``c``'s token lies below its greedy token's.

and returns one logit, ``w . [h_c / rms(h_c), (gap_c - shift) / scale] + b``; a node is accepted when the logit
is above ``threshold`` (chosen in training for a precision on held-out rows, recorded in the file). A node whose
gap lies below every gap of the training rows (``gap_min``) is never accepted: a linear judge says nothing
trustworthy outside the range it was fitted on. The file records the target it was trained for (its hidden
width and vocabulary); :meth:`JudgeHead.check_target` refuses another.
Trained by ``python -m treespec.distill judge`` (:mod:`treespec.distill.judge`, which says what its labels are).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from ..tree import TokenTree

JUDGE_FORMAT = "treespec-judge-head"


@dataclass(frozen=True)
class JudgeHeadConfig:
    hidden_size: int  # the target's hidden width H
    threshold: float = 0.0  # a node is accepted when its judge logit is above this

    def __post_init__(self) -> None:
        t = self.threshold
        if not isinstance(t, (int, float)) or isinstance(t, bool) or t != t:
            raise ValueError(f"the judge's threshold must be a number, got {t!r}")


class JudgeHead(nn.Module):
    """A linear judge over the target's hidden state of a drafted node and its logit gap (module docstring)."""

    def __init__(self, cfg: JudgeHeadConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.linear = nn.Linear(cfg.hidden_size + 1, 1)
        #: the gap's centre and spread, set from the training rows
        self.register_buffer("gap_shift", torch.zeros(1))
        self.register_buffer("gap_scale", torch.ones(1))
        #: the lowest gap of the training rows: below it the judge accepts nothing
        self.register_buffer("gap_min", torch.full((1,), float("-inf")))
        self.extra: dict = {}

    @property
    def threshold(self) -> float:
        return float(self.cfg.threshold)

    def with_threshold(self, threshold: float) -> "JudgeHead":
        """The same weights with another acceptance threshold."""
        head = JudgeHead(JudgeHeadConfig(self.cfg.hidden_size, float(threshold)))
        head.load_state_dict(self.state_dict())
        head.extra = dict(self.extra)
        return head.to(self.gap_shift.device).eval()

    def logit(self, hidden: torch.Tensor, gap: torch.Tensor) -> torch.Tensor:
        """Judge logits ``[...]`` of hidden states ``[..., H]`` and gaps ``[...]``."""
        h = hidden.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        g = ((gap.float() - self.gap_shift) / self.gap_scale)[..., None]
        return self.linear(torch.cat([h, g], dim=-1))[..., 0]

    def check_target(self, vocab_size: int, hidden_size: int | None) -> None:
        """Refuse (``ValueError``) a target other than the one the judge was trained for: another hidden width,
        or another vocabulary where the file records one (``hidden_size`` None: not known, not checked)."""
        trained = self.extra.get("target_vocab_size")
        if hidden_size is not None and hidden_size != self.cfg.hidden_size:
            raise ValueError(f"the judge reads hidden states of width {self.cfg.hidden_size}; this target's are "
                             f"{hidden_size} wide: train a judge for it (python -m treespec.distill judge)")
        if trained is not None and trained != vocab_size:
            raise ValueError(f"the judge was trained for a target of {trained} tokens; this one has {vocab_size}: "
                             f"train a judge for it (python -m treespec.distill judge)")

    def node_logits(self, tree: TokenTree, target_scores: torch.Tensor, hidden: torch.Tensor,
                    best: torch.Tensor) -> torch.Tensor:
        """``[num_nodes]`` judge logits of a tree pass: ``target_scores`` ``[num_nodes, V]`` (logits), ``hidden``
        ``[num_nodes, (k + 1) * H]`` whose last ``H`` columns are the last hidden state, ``best`` ``[num_nodes]``
        each row's greedy token (computed once for the verifier too). The root's entry is -inf (it is never
        judged), and so is a node whose gap lies below the training rows' (``gap_min``)."""
        if hidden.shape[-1] % self.cfg.hidden_size:
            raise ValueError(f"the judge reads hidden states of width {self.cfg.hidden_size}; this target's "
                             f"features are {hidden.shape[-1]} wide")
        h = hidden[:, -self.cfg.hidden_size:]  # [n, H]
        parent = tree.parents.clamp(min=0)  # [n]
        top = target_scores.gather(1, best[:, None])[:, 0].float()  # [n] each row's greedy score
        mine = target_scores[parent, tree.tokens].float()  # [n] the parent row's score of each node's token
        gap = mine - top.index_select(0, parent)  # [n]
        with torch.no_grad():
            out = self.logit(h, gap)  # [n]
        out = out.masked_fill(gap < self.gap_min, float("-inf"))
        return out.index_fill(0, torch.zeros(1, dtype=torch.long, device=out.device), float("-inf"))

    def save(self, path: str | Path, extra: dict | None = None) -> None:
        from .weights_file import save_module

        save_module(self, path, fmt=JUDGE_FORMAT, config=asdict(self.cfg), extra=extra)

    @classmethod
    def load(cls, path: str | Path, device: torch.device | str = "cpu") -> "JudgeHead":
        """A judge from its file (one clear ``ValueError`` for a file that is not one)."""
        from .weights_file import load_module

        try:
            return load_module(cls, JudgeHeadConfig, path, fmt=JUDGE_FORMAT, what="judge head", device=device)
        except ValueError as err:
            raise ValueError(f"{path}: {err}" if str(path) not in str(err) else str(err)) from None
