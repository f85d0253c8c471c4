"""The generate loop: propose, verify in one pass, accept, commit cache, record stats.

Invariants (tested): after every step the target's KV cache holds exactly the committed sequence
except its newest token (the root of the next tree), every emitted token follows the target's
distribution under the sampling config, and at temperature 0 the output equals plain greedy
decoding.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from .drafting.base import Draft, Drafter, DraftState, NoDrafter, feature_layers, reads_target_hidden
from .models.runner import TargetRunner, target_eos_ids, target_runner
from .sampling import SamplingConfig, logits_to_probs
from .verify import VERIFIERS, VerifyResult, resolve_verifier


@dataclass(frozen=True)
class GenerationConfig:
    """max_new_tokens: exact cap on generated tokens. seed: makes sampling reproducible.
    stop_on_eos: end generation at the first EOS token (included in the output).
    verifier: a name in :data:`treespec.verify.VERIFIERS`, or "auto" (greedy at temperature 0,
    else the verifier matching the drafter's law)."""

    max_new_tokens: int = 64
    sampling: SamplingConfig = SamplingConfig()
    seed: int | None = 0
    stop_on_eos: bool = True
    verifier: str = "auto"

    def __post_init__(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive integer, got {self.max_new_tokens!r}")
        if self.verifier != "auto" and self.verifier not in VERIFIERS:
            raise ValueError(f"unknown verifier {self.verifier!r}; expected 'auto' or one of {sorted(VERIFIERS)}")
        if self.verifier == "greedy" and not self.sampling.greedy:
            raise ValueError(f"verifier 'greedy' needs temperature 0 (it would output the argmax whatever the "
                             f"seed); got temperature {self.sampling.temperature}: use --verifier auto or a "
                             f"sampling verifier")


@dataclass
class StepStats:
    tree_nodes: int  # drafted nodes (root excluded)
    accepted: int  # accepted drafts
    emitted: int  # tokens appended this step
    draft_s: float
    verify_s: float
    other_s: float


@dataclass
class GenerationResult:
    prompt_ids: list[int]
    token_ids: list[int]  # generated tokens only
    steps: list[StepStats] = field(default_factory=list)
    wall_s: float = 0.0
    prefill_s: float = 0.0  # prompt prefill (included in wall_s, in no step)
    text: str | None = None
    stopped_on_eos: bool = False

    @property
    def target_calls(self) -> int:
        return len(self.steps)

    @property
    def tau(self) -> float:
        """Tokens emitted per target forward pass (plain decoding: 1.0)."""
        return len(self.token_ids) / max(len(self.steps), 1)

    def summary(self) -> dict:
        draft = sum(s.draft_s for s in self.steps)
        verify = sum(s.verify_s for s in self.steps)
        other = sum(s.other_s for s in self.steps)
        return {
            "new_tokens": len(self.token_ids),
            "target_calls": self.target_calls,
            "tau": self.tau,
            "mean_accepted": sum(s.accepted for s in self.steps) / max(len(self.steps), 1),
            "mean_tree_nodes": sum(s.tree_nodes for s in self.steps) / max(len(self.steps), 1),
            "wall_s": self.wall_s,
            "prefill_s": self.prefill_s,
            "tokens_per_s": len(self.token_ids) / self.wall_s if self.wall_s > 0 else float("nan"),
            "draft_s": draft,
            "verify_s": verify,
            "other_s": other,
            "stopped_on_eos": self.stopped_on_eos,
        }


def _verifier(name: str, law: str, sampling: SamplingConfig) -> tuple[str, Callable[..., VerifyResult]]:
    name = resolve_verifier(name, law, sampling)
    return name, VERIFIERS[name]  # looked up per call: a patched table is honoured


class ConcurrentDrafterError(RuntimeError):
    """Raised when a drafter (or a target runner) already generating in one call is passed to
    generate() again before that call returns (another thread, or a callback)."""


_IN_USE: dict[int, int] = {}  # id(drafter or runner) -> thread ident of the generate() call using it
_IN_USE_LOCK = threading.Lock()


def generate(target: TargetRunner | torch.nn.Module, prompt_ids: list[int] | torch.Tensor,
             drafter: Drafter | None = None, config: GenerationConfig = GenerationConfig(), **kwargs
             ) -> GenerationResult:
    """See :func:`_generate`. A drafter holds per-request state (its KV cache, its draft history) and
    so does a :class:`~treespec.models.runner.ModelRunner` (the target's KV cache): each serves one request at a time; using
    one from two calls at once raises :class:`ConcurrentDrafterError` (give each thread its own
    drafter and runner; a bare model passed as ``target`` gets a fresh runner per call)."""
    owned = [obj for obj in (drafter, None if isinstance(target, torch.nn.Module) else target) if obj is not None]
    me = threading.get_ident()
    with _IN_USE_LOCK:
        for obj in owned:
            owner = _IN_USE.get(id(obj))
            if owner is not None:
                what = "runner" if obj is target else "drafter"
                raise ConcurrentDrafterError(
                    f"{type(obj).__name__} is already generating in another call (thread {owner}); a {what} "
                    f"holds per-request state: give each thread its own {what}")
        for obj in owned:
            _IN_USE[id(obj)] = me
    try:
        return _generate(target, prompt_ids, drafter, config, **kwargs)
    finally:
        with _IN_USE_LOCK:
            for obj in owned:
                del _IN_USE[id(obj)]


@torch.no_grad()
def _generate(target: TargetRunner | torch.nn.Module, prompt_ids: list[int] | torch.Tensor,
             drafter: Drafter | None = None, config: GenerationConfig = GenerationConfig(), *,
             tokenizer=None, callback: Callable[[list[int]], None] | None = None,
             eos_ids: set[int] | None = None) -> GenerationResult:
    """Tree-speculative generation (plain decoding when ``drafter`` is None).

    Parameters
    ----------
    target : the target causal LM, or a target runner (a :class:`ModelRunner` around one, or a
        :class:`~treespec.models.llama_cpp.LlamaCppRunner` over a GGUF model).
    prompt_ids : the prompt's token ids (at least one).
    drafter : proposes a token tree each step; None decodes one token per target pass.
    config : generation options.
    tokenizer : if given, the result carries the decoded text.
    callback : called with the tokens appended at each step (streaming).
    eos_ids : EOS token ids (default: the target's generation config).
    """
    runner = target_runner(target)
    drafter = drafter if drafter is not None else NoDrafter()
    prompt = [int(t) for t in (prompt_ids.flatten().tolist() if isinstance(prompt_ids, torch.Tensor) else prompt_ids)]
    if not prompt:
        raise ValueError("empty prompt: give at least one token (a text prompt must not tokenize to nothing)")
    if any(t < 0 or t >= runner.vocab_size for t in prompt):
        raise ValueError(f"prompt has token ids outside the target vocabulary [0, {runner.vocab_size})")
    if runner.max_positions is not None and len(prompt) + config.max_new_tokens > runner.max_positions:
        raise ValueError(
            f"context overflow: prompt ({len(prompt)} tokens) + max_new_tokens ({config.max_new_tokens}) "
            f"exceeds the target's context of {runner.max_positions} tokens"
        )
    sampling = config.sampling
    law = drafter.law(sampling)
    verifier_name, verify = _verifier(config.verifier, law, sampling)
    eos = target_eos_ids(runner) if eos_ids is None else set(eos_ids)
    generator = torch.Generator(device=runner.device)
    if config.seed is not None:
        generator.manual_seed(config.seed)
    else:
        generator.seed()

    start = time.perf_counter()
    runner.reset()
    # target layers a head reads besides the last hidden state (asked for only when there are any)
    features = {"feature_layers": feature_layers(drafter)} if feature_layers(drafter) else {}
    hidden = reads_target_hidden(drafter)
    target_hidden = None
    if len(prompt) > 1:
        # the prefill's hidden states (positions 0..len-2; the last predicts the first root) go to
        # the first proposal, so hidden-state drafters can draft from step one
        out = runner.forward(None, None, torch.tensor(prompt[:-1], device=runner.device),
                             need_logits=False, need_hidden=hidden, **features)
        target_hidden = out.get("hidden")
    drafter.begin(prompt)
    seq = list(prompt)
    result = GenerationResult(prompt, [])
    result.prefill_s = time.perf_counter() - start
    while len(result.token_ids) < config.max_new_tokens:
        t0 = time.perf_counter()
        remaining = config.max_new_tokens - len(result.token_ids)
        # propose
        draft: Draft = drafter.propose(DraftState(seq, remaining - 1, target_hidden, runner), sampling, generator)
        tree = draft.tree
        if config.verifier == "auto" and tree.law != law:  # a drafter mixing laws (e.g. n-gram + head)
            law = tree.law
            verifier_name, verify = _verifier("auto", law, sampling)
        t1 = time.perf_counter()
        # verify the whole tree in one target pass
        nodes = torch.arange(tree.num_nodes, device=runner.device)
        out = runner.forward(tree, nodes, need_hidden=hidden, **features)
        # the greedy verifier needs only each row's argmax: logits serve as they are
        target_probs = out["logits"] if verifier_name == "greedy" else logits_to_probs(out["logits"], sampling)
        verdict = verify(tree, target_probs, draft.draft_probs, generator)
        t2 = time.perf_counter()
        # accept: cut at EOS and at max_new_tokens
        emitted = verdict.tokens[:remaining]
        for i, tok in enumerate(emitted):
            if tok in eos and config.stop_on_eos:
                emitted = emitted[: i + 1]
                result.stopped_on_eos = True
                break
        # commit the accepted path to the caches (the newest emitted token stays pending)
        kept = [0, *verdict.accepted_nodes[: len(emitted) - 1]]
        runner.commit(kept)
        drafter.accept(verdict, emitted)
        target_hidden = out["hidden"][torch.tensor(kept, device=runner.device)] if hidden else None
        seq.extend(emitted)
        result.token_ids.extend(emitted)
        if callback is not None:
            callback(emitted)
        t3 = time.perf_counter()
        result.steps.append(StepStats(tree.num_nodes - 1, verdict.num_accepted, len(emitted),
                                      t1 - t0, t2 - t1, t3 - t2))
        if result.stopped_on_eos:
            break
    result.wall_s = time.perf_counter() - start
    if tokenizer is not None:
        result.text = tokenizer.decode(result.token_ids, skip_special_tokens=True)
    return result
