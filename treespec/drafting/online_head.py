"""Online adaptation of a draft head while it serves (Online Speculative Decoding, arXiv 2310.07177).

:class:`OnlineHeadDrafter` wraps a tree builder drafting with a head (any
:class:`~treespec.trees.common.RunnerDrafter` over a :class:`~treespec.drafting.head_runner.HeadRunner`,
e.g. ``ShapeDrafter(head, shape, law)``) and fine-tunes its head on the target's own data collected during generation: every committed position ``j`` of a
request gives an example ``(h_{j-1}, x_j) -> ``

* soft label: the target's next-token distribution at ``j`` on the head's vocabulary subset,
  recomputed exactly from the target's hidden state ``h_j`` (the head's output rows are the
  target's LM-head rows), as in offline distillation (:mod:`treespec.distill.train`);
* hard label: the committed token ``x_{j+1}`` (skipped when outside the subset).

Every ``update_every`` committed tokens, ``steps`` AdamW steps are taken on the most recent
``window`` positions of the current request, then the head's cache of committed entries is rebuilt
with the new weights (one teacher-forced head pass), so drafting continues consistently.

Losslessness: the head changes only between proposals; each tree is drafted, and its draft
probabilities recorded, by one fixed head, and verification never looks at how the draft was
obtained, so the output law stays the target's whatever the updates do. The target is never
touched. Costs: one small training step (the head's one layer plus its subset output rows) per
``update_every`` tokens, and the optimizer state (2 x the head's trained parameters).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..sampling import SamplingConfig
from ..verify import VerifyResult
from .base import Draft, DraftState
from .head_runner import HeadRunner


@dataclass(frozen=True)
class OnlineHeadConfig:
    """``lr``: AdamW learning rate; ``update_every``: committed tokens between updates;
    ``window``: most recent positions trained on; ``steps``: optimizer steps per update;
    ``w_hard``: weight of the hard-label loss next to the soft one."""

    lr: float = 1e-4
    update_every: int = 32
    window: int = 256
    steps: int = 1
    w_hard: float = 0.1

    def __post_init__(self) -> None:
        if not self.lr > 0 or self.update_every < 1 or self.window < 2 or self.steps < 1 or self.w_hard < 0:
            raise ValueError(f"invalid OnlineHeadConfig {self}")


class OnlineHeadDrafter:
    """A head drafter whose head keeps learning from the requests it serves.

    Parameters
    ----------
    drafter : a tree builder whose ``runner`` is a :class:`HeadRunner` (e.g. ``ShapeDrafter(head, ...)``).
    config : the learning settings.
    """

    def __init__(self, drafter, config: OnlineHeadConfig = OnlineHeadConfig()) -> None:
        if not isinstance(getattr(drafter, "runner", None), HeadRunner):
            raise TypeError("OnlineHeadDrafter wraps a drafter whose runner is a HeadRunner (a draft head)")
        self.drafter = drafter
        self.runner: HeadRunner = drafter.runner
        self.head = self.runner.head
        self.feature_layers = self.runner.feature_layers  # the target layers its head reads
        self.config = config
        self.params = [p for p in self.head.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=config.lr, weight_decay=0.0)
        self.sub_index = torch.full((self.head.cfg.target_vocab_size,), -1, dtype=torch.long,
                                    device=self.runner.device)
        self.sub_index[self.head.vocab_ids] = torch.arange(self.head.vocab_ids.numel(), device=self.runner.device)
        self.updates = 0
        self.begin([])

    def law(self, sampling: SamplingConfig) -> str:
        return self.drafter.law(sampling)

    def begin(self, prompt_ids: list[int]) -> None:
        self.drafter.begin(prompt_ids)
        self.hidden = torch.zeros(0, self.head.cfg.feature_width, device=self.runner.device)  # rows = positions 0..
        self.tokens: list[int] = list(prompt_ids)
        self.since_update = 0

    def propose(self, state: DraftState, sampling: SamplingConfig, generator: torch.Generator | None) -> Draft:
        hid = state.target_hidden
        if hid is not None and hid.shape[0]:
            first = len(state.tokens) - 1 - hid.shape[0]  # position of the first new row
            if first == self.hidden.shape[0]:
                own = self.head.own_features(hid.detach()).float()  # the columns this head reads
                self.hidden = torch.cat([self.hidden, own.to(self.hidden.device)])
        self.tokens = list(state.tokens)
        return self.drafter.propose(state, sampling, generator)

    def accept(self, result: VerifyResult, emitted: list[int]) -> None:
        self.drafter.accept(result, emitted)
        self.since_update += len(emitted)
        if self.since_update >= self.config.update_every and self.hidden.shape[0] >= 3:
            self.since_update = 0
            self._update()

    # ------------------------------------------------------------------ learning
    def _update(self) -> None:
        head, cfg = self.head, self.config
        rows = self.hidden.shape[0]  # hidden known for positions 0..rows-1
        lo = max(rows - 1 - cfg.window, 0)
        # example at position j (lo+1 .. rows-1): input (h_{j-1}, x_j), soft label from h_j, hard x_{j+1}
        j = torch.arange(lo + 1, rows, device=self.hidden.device)
        toks = torch.tensor(self.tokens, dtype=torch.long, device=self.hidden.device)
        hard = self.sub_index[toks[j + 1]] if int(j[-1]) + 1 < toks.numel() else None
        with torch.no_grad():
            soft = torch.softmax(head.logits(head.last_hidden(self.hidden[j])), dim=-1)  # [n, |S|] target on S
        head.train()
        with torch.enable_grad():
            for _ in range(cfg.steps):
                feats = head(self.hidden[j - 1][None], toks[j][None], j[None])[0]
                logq = torch.log_softmax(head.logits(feats), dim=-1)
                loss = -(soft * logq).sum(-1).mean()
                if hard is not None and bool((hard >= 0).any()):
                    loss = loss + cfg.w_hard * F.cross_entropy(logq, hard, ignore_index=-1)
                self.optimizer.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(self.params, 1.0)
                self.optimizer.step()
        head.eval()
        self.updates += 1
        self.runner.rebuild(self.hidden, toks)  # the committed entries, recomputed with the new weights
