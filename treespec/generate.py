"""The generate loop: propose, verify in one pass, accept, commit cache, record stats.

Invariants (tested): after every step the target's KV cache holds exactly the committed sequence
except its newest token (the root of the next tree), every emitted token follows the target's
distribution under the sampling config, and at temperature 0 the output equals plain greedy
decoding.
"""

from __future__ import annotations

import numbers
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from .drafting.base import Draft, Drafter, DraftState, NoDrafter, feature_layers, reads_target_hidden
from .drafting.judge import JudgeHead
from .models.runner import TargetRunner, target_eos_ids, target_runner
from .sampling import SamplingConfig, first_argmax, logits_to_probs
from .verify import LOSSY_VERIFIERS, VERIFIERS, JudgedResult, VerifyResult, resolve_verifier


#: the largest seed: torch.Generator.manual_seed takes [-2**63, 2**64 - 1] and maps a negative seed s to
#: 2**64 - 1 + s, so [0, 2**64 - 1] names every generator state once
MAX_SEED = 2**64 - 1


def _is_integer(value) -> bool:
    """An int or a numpy integer, not a bool (``True`` is an int to Python, never a count or a seed here)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


@dataclass(frozen=True)
class GenerationConfig:
    """max_new_tokens: exact cap on generated tokens. seed: makes sampling reproducible; None (the default)
    draws a fresh seed per call, recorded in :attr:`GenerationResult.seed` (pass it back to reproduce a run).
    stop_on_eos: end generation at the first EOS token (included in the output).
    verifier: a name in :data:`treespec.verify.VERIFIERS`, or "auto" (greedy at temperature 0,
    else the verifier matching the drafter's law).
    leaf_logits: ask the target for the rows of tree leaves too, so that a path accepted down to a
    leaf also yields its bonus token. False asks only for the rows of ``tree.verified_nodes`` (the root
    and the nodes with children): one LM-head row fewer per leaf, for targets where each output row
    is dear (llama.cpp); the output's law is the same either way.
    judge: a :class:`~treespec.drafting.judge.JudgeHead` for judge decoding, temperature 0 only. LOSSY: drafted
    tokens the judge accepts are kept though the target would not have chosen them
    (:func:`~treespec.verify.judge.verify_judge`); the result counts them (``judged_tokens``). None (the default):
    lossless."""

    max_new_tokens: int = 64
    sampling: SamplingConfig = SamplingConfig()
    seed: int | None = None
    stop_on_eos: bool = True
    verifier: str = "auto"
    leaf_logits: bool = True
    judge: JudgeHead | None = None

    def __post_init__(self) -> None:
        if not _is_integer(self.max_new_tokens) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive integer, got {self.max_new_tokens!r}")
        object.__setattr__(self, "max_new_tokens", int(self.max_new_tokens))  # a numpy integer becomes an int
        if self.seed is not None:
            if not _is_integer(self.seed) or not 0 <= self.seed <= MAX_SEED:
                raise ValueError(f"seed must be None or an integer in [0, 2**64 - 1] (what "
                                 f"torch.Generator.manual_seed takes, negatives aside), got {self.seed!r}")
            object.__setattr__(self, "seed", int(self.seed))
        if not isinstance(self.leaf_logits, bool):
            raise ValueError(f"leaf_logits must be True or False, got {self.leaf_logits!r}")
        if self.verifier != "auto" and self.verifier not in VERIFIERS:
            raise ValueError(f"unknown verifier {self.verifier!r}; expected 'auto' or one of {sorted(VERIFIERS)}")
        if self.verifier == "greedy" and not self.sampling.greedy:
            raise ValueError(f"verifier 'greedy' needs temperature 0 (it would output the argmax whatever the "
                             f"seed); got temperature {self.sampling.temperature}: use --verifier auto or a "
                             f"sampling verifier")
        if self.judge is not None:
            if not isinstance(self.judge, JudgeHead):
                raise ValueError(f"judge must be a treespec JudgeHead, got {type(self.judge).__name__}")
            if not self.sampling.greedy:
                raise ValueError(f"judge decoding is defined here at temperature 0 only; got temperature "
                                 f"{self.sampling.temperature}")
            if self.verifier not in ("auto", "greedy"):
                raise ValueError(f"judge decoding replaces the verifier; verifier must be 'auto' or 'greedy', got "
                                 f"{self.verifier!r}")


@dataclass
class StepStats:
    tree_nodes: int  # drafted nodes (root excluded)
    accepted: int  # accepted drafts
    emitted: int  # tokens appended this step
    draft_s: float
    verify_s: float
    other_s: float
    judged: int = 0  # accepted drafts the target would not have chosen (judge decoding only)


@dataclass
class GenerationResult:
    prompt_ids: list[int]
    token_ids: list[int]  # generated tokens only
    steps: list[StepStats] = field(default_factory=list)
    wall_s: float = 0.0
    prefill_s: float = 0.0  # prompt prefill (included in wall_s, in no step)
    text: str | None = None
    seed: int = 0  # the sampling seed used: the config's, or the one drawn for a config with seed=None
    stopped_on_eos: bool = False
    stopped_by_hook: bool = False  # the ``on_tokens`` hook asked generation to stop
    lossy: bool = False  # judge decoding ran: tokens may differ from the target's own choices

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
            "stopped_by_hook": self.stopped_by_hook,
            "judged_tokens": sum(s.judged for s in self.steps),
            "lossy": self.lossy,
        }


def _verifier(name: str, law: str, sampling: SamplingConfig) -> tuple[str, Callable[..., VerifyResult]]:
    name = resolve_verifier(name, law, sampling)
    return name, VERIFIERS[name]  # looked up per call: a patched table is honoured


def prompt_list(prompt_ids) -> list[int]:
    """``prompt_ids`` as a list of ints: a sequence of integers (ints, numpy integers, 0-d integer tensors), a
    1-D integer tensor or array, or a batch of one (``[1, N]``). Everything else is refused by name: a batch of
    several prompts (generate() serves one), float or bool ids (never truncated or read as 0/1), strings."""
    if isinstance(prompt_ids, (str, bytes)):
        raise ValueError(f"prompt_ids must be token ids, got a {type(prompt_ids).__name__}: tokenize the text "
                         f"first (tokenizer(text)['input_ids'])")
    if not isinstance(prompt_ids, torch.Tensor) and hasattr(prompt_ids, "__array__") and hasattr(prompt_ids, "dtype"):
        try:
            prompt_ids = torch.as_tensor(prompt_ids)  # a numpy array
        except (TypeError, ValueError, RuntimeError):
            raise ValueError(f"prompt_ids must be integer token ids, got an array of {prompt_ids.dtype}") from None
    if isinstance(prompt_ids, torch.Tensor):
        ids = prompt_ids
        if ids.dim() == 2 and ids.shape[0] == 1:
            ids = ids[0]
        if ids.dim() != 1:
            raise ValueError(f"prompt_ids must be 1-D (or a batch of one, [1, N]); got a tensor of shape "
                             f"{list(prompt_ids.shape)}: generate() serves one prompt per call")
        if ids.dtype == torch.bool or ids.is_floating_point() or ids.is_complex():
            raise ValueError(f"prompt_ids must be integer token ids, got a {str(ids.dtype).replace('torch.', '')} "
                             f"tensor")
        return [int(t) for t in ids.tolist()]
    try:
        ids = list(prompt_ids)
    except TypeError:
        raise ValueError(f"prompt_ids must be a sequence of token ids, got {type(prompt_ids).__name__}") from None
    if ids and all(isinstance(t, (list, tuple, torch.Tensor)) and not (isinstance(t, torch.Tensor) and t.dim() == 0)
                   for t in ids):
        if len(ids) != 1:
            raise ValueError(f"prompt_ids holds {len(ids)} prompts; generate() serves one prompt per call: pass a "
                             f"1-D list or a batch of one ([1, N])")
        return prompt_list(ids[0] if isinstance(ids[0], torch.Tensor) else list(ids[0]))
    out = []
    for i, t in enumerate(ids):
        if isinstance(t, torch.Tensor) and t.dim() == 0 and not (t.dtype == torch.bool or t.is_floating_point()
                                                                  or t.is_complex()):
            t = t.item()
        if not _is_integer(t):
            raise ValueError(f"prompt_ids[{i}] is {t!r} ({type(t).__name__}); token ids are integers (no floats, "
                             f"bools or strings)")
        out.append(int(t))
    return out


def check_draft_vocabulary(drafter, target_vocab_size: int) -> None:
    """Refuse a model drafter whose logits span another vocabulary than the target's, by name: the check the
    CLI runs on a draft model (:func:`~treespec.models.compat.check_draft_vocab`), for drafters built in Python
    (without it a draft of a smaller vocabulary fails in the target's embedding with a bare IndexError).
    Looks inside composed drafters (``drafters``) and wrappers (``drafter``)."""
    from .models.compat import check_draft_vocab
    from .trees.common import RunnerDrafter

    todo, seen = [drafter], set()
    while todo:
        d = todo.pop()
        if d is None or id(d) in seen:
            continue
        seen.add(id(d))
        todo.extend(getattr(d, "drafters", None) or ())
        todo.append(getattr(d, "drafter", None))
        inner = getattr(d, "model", None)  # MergedDrafter's model drafter
        if hasattr(inner, "propose"):
            todo.append(inner)
        if not isinstance(d, RunnerDrafter) or d.vocab_size == target_vocab_size:
            continue
        model = d.runner.model
        if model is not None:  # a causal LM: its own vocabulary sizes name the problem
            check_draft_vocab(target_vocab_size, model.get_input_embeddings().weight.shape[0],
                              model.get_output_embeddings().weight.shape[0])
        raise ValueError(f"draft vocabulary mismatch: {type(d).__name__} drafts over {d.vocab_size} tokens but the "
                         f"target has {target_vocab_size}; build it with target_vocab_size={target_vocab_size}")


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
    drafter and runner; a bare model passed as ``target`` gets a fresh runner per call). ``prompt_ids``: a list
    of ints, a 1-D integer tensor or array ``[N]``, or a batch of one ``[1, N]`` (:func:`prompt_list`)."""
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


def _check_prompt(prompt: list[int], runner: TargetRunner, max_new_tokens: int) -> None:
    if not prompt:
        raise ValueError("empty prompt: give at least one token (a text prompt must not tokenize to nothing)")
    if any(t < 0 or t >= runner.vocab_size for t in prompt):
        raise ValueError(f"prompt has token ids outside the target vocabulary [0, {runner.vocab_size})")
    if runner.max_positions is not None and len(prompt) + max_new_tokens > runner.max_positions:
        raise ValueError(
            f"context overflow: prompt ({len(prompt)} tokens) + max_new_tokens ({max_new_tokens}) "
            f"exceeds the target's context of {runner.max_positions} tokens"
        )


class _Verifier:
    """The verifier of the config, or with ``"auto"`` the one matching each tree's law (a drafter may mix laws,
    e.g. n-gram + head)."""

    def __init__(self, name: str, law: str, sampling: SamplingConfig) -> None:
        self.asked, self.law, self.sampling = name, law, sampling
        self.name, self.verify = _verifier(name, law, sampling)

    def follow(self, law: str) -> None:
        """Switch to the verifier of a tree drafted under another ``law`` (with "auto" only)."""
        if self.asked == "auto" and law != self.law:
            self.law = law
            self.name, self.verify = _verifier("auto", law, self.sampling)


class _TreePass:
    """The target's side of the loop: the prompt's prefill, then one pass over each drafted tree, keeping what
    the next proposal needs (the hidden states of the accepted path, for drafters that read them)."""

    def __init__(self, runner: TargetRunner, drafter: Drafter, config: GenerationConfig) -> None:
        self.runner, self.sampling, self.leaf_logits = runner, config.sampling, config.leaf_logits
        # target layers a head reads besides the last hidden state (asked for only when there are any)
        self.features = {"feature_layers": feature_layers(drafter)} if feature_layers(drafter) else {}
        self.hidden = reads_target_hidden(drafter)
        self.judge = config.judge  # judge decoding reads the last hidden state of every node
        if self.judge is not None:
            model = getattr(runner, "model", None)
            if model is None:
                raise ValueError(f"judge decoding reads the target's hidden states through a PyTorch target; "
                                 f"{type(runner).__name__} has none")
            cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
            self.judge.check_target(runner.vocab_size, getattr(cfg, "hidden_size", None))
        self.out: dict = {}
        self.rows: torch.Tensor | None = None  # [R] the nodes the last pass gave rows for; None: every node

    def prefill(self, prompt: list[int]) -> torch.Tensor | None:
        """The prompt but its last token (the first root) into the cache. Returns the prefill's hidden states
        (positions 0..len-2, the last predicts the first root), so hidden-state drafters draft from step one."""
        if len(prompt) == 1:
            return None
        out = self.runner.forward(None, None, torch.tensor(prompt[:-1], device=self.runner.device),
                                  need_logits=False, need_hidden=self.hidden, **self.features)
        return out.get("hidden")

    def verify(self, draft: Draft, verifier: _Verifier, generator: torch.Generator) -> VerifyResult:
        """One target pass over the whole tree, then the verifier's verdict on it."""
        tree = draft.tree
        nodes = torch.arange(tree.num_nodes, device=self.runner.device)  # [num_nodes]
        judge = self.judge is not None and tree.num_nodes > 1
        self.rows = None if self.leaf_logits or judge or tree.num_nodes == 1 else tree.verified_nodes  # [R] or all
        picked = {} if self.rows is None else {"rows": self.rows}  # (a runner written before ``rows`` serves every row)
        self.out = self.runner.forward(tree, nodes, need_hidden=self.hidden or judge, **picked, **self.features)
        logits = self.out["logits"]  # [num_nodes or R, vocab]
        if judge:  # LOSSY: judge decoding (temperature 0)
            best = first_argmax(logits)  # [num_nodes] the target's greedy token after each node
            judge_logits = self.judge.node_logits(tree, logits, self.out["hidden"], best)  # [num_nodes]
            return LOSSY_VERIFIERS["judge"](tree, logits, judge_logits, self.judge.threshold, best)
        # the greedy verifier needs only each row's argmax: logits serve as they are
        target_probs = logits if verifier.name == "greedy" else logits_to_probs(logits, self.sampling)
        return verifier.verify(tree, target_probs, draft.draft_probs, generator)

    def hidden_of(self, kept: list[int]) -> torch.Tensor | None:
        """The last pass's hidden states of the ``kept`` nodes (every kept node has a row: it has children or is
        the root); None for drafters that read none."""
        if not self.hidden:
            return None
        kept_rows = torch.tensor(kept, device=self.runner.device)  # [len(kept)]
        return self.out["hidden"][kept_rows if self.rows is None else torch.searchsorted(self.rows, kept_rows)]


def _cut(tokens: list[int], remaining: int, eos: set[int]) -> tuple[list[int], bool]:
    """The step's tokens cut at ``max_new_tokens`` (``remaining`` left) and after the first EOS token; and
    whether an EOS token ended them."""
    emitted = tokens[:remaining]
    for i, tok in enumerate(emitted):
        if tok in eos:
            return emitted[: i + 1], True
    return emitted, False


@torch.no_grad()
def _generate(target: TargetRunner | torch.nn.Module, prompt_ids: list[int] | torch.Tensor,
             drafter: Drafter | None = None, config: GenerationConfig = GenerationConfig(), *,
             tokenizer=None, on_tokens: Callable[[list[int]], bool | None] | None = None,
             eos_ids: set[int] | None = None) -> GenerationResult:
    """Tree-speculative generation (plain decoding when ``drafter`` is None).

    Parameters
    ----------
    target : the target causal LM, or a target runner (a :class:`ModelRunner` around one, or a
        :class:`~treespec.models.llama_cpp.LlamaCppRunner` over a GGUF model).
    prompt_ids : the prompt's token ids (at least one): a list of ints, a 1-D integer tensor or numpy
        array ``[N]``, or a batch of one ``[1, N]`` (see :func:`prompt_list`).
    drafter : proposes a token tree each step; None decodes one token per target pass.
    config : generation options.
    tokenizer : if given, the result carries the decoded text.
    on_tokens : called after each step with the tokens that step committed (accepted, then the recovered
        or bonus token; cut at EOS and at ``max_new_tokens``), for streaming and stop strings: the calls'
        concatenation is ``result.token_ids``. Returning True (a true value) stops generation after that
        step (the result ends with those tokens, ``result.stopped_by_hook`` is set); its errors propagate.
    eos_ids : EOS token ids (default: the target's generation config).
    """
    prompt = prompt_list(prompt_ids)
    runner = target_runner(target)
    drafter = drafter if drafter is not None else NoDrafter()
    check_draft_vocabulary(drafter, runner.vocab_size)
    _check_prompt(prompt, runner, config.max_new_tokens)
    sampling = config.sampling
    verifier = _Verifier(config.verifier, drafter.law(sampling), sampling)
    eos = target_eos_ids(runner) if eos_ids is None else set(eos_ids)
    seed = config.seed if config.seed is not None else secrets.randbits(63)
    generator = torch.Generator(device=runner.device)
    generator.manual_seed(seed)

    start = time.perf_counter()
    runner.reset()
    tree_pass = _TreePass(runner, drafter, config)
    target_hidden = tree_pass.prefill(prompt)
    drafter.begin(prompt)
    seq = list(prompt)
    result = GenerationResult(prompt, [], seed=seed, lossy=config.judge is not None)
    result.prefill_s = time.perf_counter() - start
    while len(result.token_ids) < config.max_new_tokens:
        t0 = time.perf_counter()
        remaining = config.max_new_tokens - len(result.token_ids)
        # propose
        draft: Draft = drafter.propose(DraftState(seq, remaining - 1, target_hidden, runner), sampling, generator)
        verifier.follow(draft.tree.law)
        t1 = time.perf_counter()
        # verify the whole tree in one target pass
        verdict = tree_pass.verify(draft, verifier, generator)
        t2 = time.perf_counter()
        # commit: the tokens cut at EOS and max_new_tokens, their path into the caches (the newest token stays
        # pending: the root of the next tree)
        emitted, result.stopped_on_eos = _cut(verdict.tokens, remaining, eos if config.stop_on_eos else set())
        kept = [0, *verdict.accepted_nodes[: len(emitted) - 1]]
        runner.commit(kept)
        drafter.accept(verdict, emitted)
        target_hidden = tree_pass.hidden_of(kept)
        seq.extend(emitted)
        result.token_ids.extend(emitted)
        result.stopped_by_hook = on_tokens is not None and bool(on_tokens(list(emitted)))
        t3 = time.perf_counter()
        # statistics
        judged = (sum(n in verdict.judged_nodes for n in verdict.accepted_nodes[:len(emitted)])
                  if isinstance(verdict, JudgedResult) else 0)  # the emitted tokens the target did not choose
        result.steps.append(StepStats(draft.tree.num_nodes - 1, verdict.num_accepted, len(emitted),
                                      t1 - t0, t2 - t1, t3 - t2, judged))
        if result.stopped_on_eos or result.stopped_by_hook:
            break
    result.wall_s = time.perf_counter() - start
    if tokenizer is not None:
        result.text = tokenizer.decode(result.token_ids, skip_special_tokens=True)
    return result
