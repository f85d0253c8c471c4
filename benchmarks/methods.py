"""The method rows of ``benchmarks/run.py``: which drafter, verifier target and settings each row name stands for.

Every row is one entry of :data:`ROWS` (data, not code): its target (the engine it runs on), its ``--draft`` word
and CLI settings, or the constructor settings of a drafter the CLI does not build. A row's description is
generated from those same fields (:func:`describe`), so what a table says a row is and what the row runs
cannot differ. :func:`build_methods` turns the chosen rows into :class:`Method` objects on a loaded target.
"""

from __future__ import annotations

import contextlib
import copy
import sys
import time
from dataclasses import dataclass, replace
from typing import Any, Callable

import torch

#: a row's target: where its tokens are verified (and so which plain decoding it is paired with)
TARGET_ENGINE = {
    "ts": "treespec",              # the embedded target behind the runner of --runner (as `treespec generate`)
    "ts_eager": "treespec",        # the same target on the eager Hugging Face forward
    "ts_int4": "treespec-int4",    # the target on 4-bit weights (`treespec generate --quantize int4`)
    "ts_int8h": "treespec-int8-head",  # the target with an 8-bit LM head (`treespec generate --quantize int8-head`)
    "ts_gguf": "treespec-llama.cpp",  # the embedded GGUF in llama.cpp behind treespec's tree pass
    "hf": "hf",                    # Hugging Face transformers `generate`
    "llama": "llama.cpp",          # llama-cpp-python's own generation on the embedded GGUF
}
#: each engine's plain decoding: the baseline its rows are paired with
BASELINES = {"treespec": "ts_plain", "hf": "hf_plain", "llama.cpp": "llama_plain", "treespec-int4": "ts_plain_int4",
             "treespec-int8-head": "ts_plain_int8h",
             "treespec-llama.cpp": "tsl_plain"}
BASELINE_LABEL = {"ts_plain": "treespec plain", "hf_plain": "HF generate", "llama_plain": "llama.cpp plain",
                  "ts_plain_int4": "treespec int4 plain", "tsl_plain": "treespec plain on llama.cpp",
                  "ts_plain_int8h": "treespec int8-head plain"}
#: the ``--draft`` value of a row that drafts with the run's ``--assistant``
ASSISTANT = "<assistant>"


@dataclass(frozen=True)
class Row:
    """One method row. ``draft``: the ``--draft`` word (None: ``--plain``; for ``hf`` / ``llama`` rows
    ``prompt-lookup`` or ``assistant``); ``tree`` / ``min_confidence`` / ``law`` / ``quantize`` / ``max_reject``:
    ``--tree``, ``--min-confidence``, ``--law``, ``--draft-quantize``, ``--max-reject`` (None: the CLI's default);
    ``leaf_logits``: False for ``--leaf-logits off``; ``drafter``: a key of :data:`CUSTOM_DRAFTERS` (a drafter the
    CLI does not build) with its constructor ``settings``; ``protocol``: part of the default protocol; ``judge``:
    ``--judge shipped`` (LOSSY judge decoding, temperature 0 only)."""

    name: str
    target: str
    draft: str | None = None
    tree: tuple[int, ...] | None = None
    min_confidence: float | None = None
    law: str | None = None
    quantize: str | None = None
    leaf_logits: bool = True
    max_reject: float | None = None
    drafter: str | None = None
    settings: tuple[tuple[str, Any], ...] = ()
    protocol: bool = False
    judge: bool = False

    @property
    def engine(self) -> str:
        return TARGET_ENGINE[self.target]


#: every row, in the order a run builds them (the seeded shuffle of a round starts from this order);
#: ``--variant`` rows go after ``ts_lookup_head`` (:func:`ordered_rows`)
ROWS: tuple[Row, ...] = (
    Row("ts_plain", "ts", protocol=True),
    Row("ts_plain_eager", "ts_eager", protocol=True),
    Row("ts_ngram", "ts", "ngram", protocol=True),
    Row("ts_head", "ts", "head", protocol=True),
    Row("ts_head_int4", "ts", "head", quantize="int4"),
    Row("ts_head_bf16", "ts", "head", quantize="none"),
    Row("ts_head_chain", "ts", "head", min_confidence=0.0, protocol=True),
    Row("ts_lookup_head", "ts", "lookup+head", protocol=True),
    # LOSSY, temperature 0 only: the default's drafter with the shipped judge (judge decoding, arXiv 2501.19309)
    Row("ts_lookup_head_judge", "ts", "lookup+head", judge=True),
    Row("ts_plain_int4", "ts_int4"),
    Row("ts_ngram_int4", "ts_int4", "ngram"),
    Row("ts_lookup_head_int4", "ts_int4", "lookup+head"),
    Row("ts_plain_int8h", "ts_int8h"),
    Row("ts_head_int8h", "ts_int8h", "head"),
    Row("ts_lookup_head_int8h", "ts_int8h", "lookup+head"),
    Row("ts_ngram_tree", "ts", drafter="ngram", settings=(("depth", 8), ("branches", 4), ("max_nodes", 16))),
    Row("ts_online_ngram", "ts", drafter="online_ngram", settings=(("depth", 8), ("branches", 1), ("adaptive", True))),
    # lookup+head with deeper adaptive n-gram chains (the default's lookup stops at 8: treespec.drafters.LOOKUP)
    Row("ts_lookup12_head", "ts", drafter="lookup_head", settings=(("depth", 12), ("branches", 1), ("adaptive", True))),
    Row("ts_lookup16_head", "ts", drafter="lookup_head", settings=(("depth", 16), ("branches", 1), ("adaptive", True))),
    Row("ts_head_dyspec", "ts", drafter="dyspec", settings=(("budget", 8), ("max_depth", 4))),
    Row("ts_lookup_dyspec", "ts", drafter="lookup_dyspec", settings=(("budget", 8), ("max_depth", 4))),
    Row("ts_head_eagle2", "ts", drafter="eagle2", settings=(("num_nodes", 8), ("top_k", 4), ("depth", 4))),
    # the dynamic builders with the shipped head's confidence rule (its measured 0.2, as --draft head uses)
    Row("ts_head_dyspec_c02", "ts", drafter="dyspec", settings=(("budget", 8), ("max_depth", 4),
                                                                ("min_confidence", 0.2))),
    Row("ts_head_eagle2_c02", "ts", drafter="eagle2", settings=(("num_nodes", 8), ("top_k", 4), ("depth", 4),
                                                                ("min_confidence", 0.2))),
    Row("ts_online_head", "ts", drafter="online_head"),
    Row("ts_early_exit", "ts", ASSISTANT),
    Row("ts_medusa", "ts", drafter="medusa", settings=(("paths", ((0,), (1,), (0, 0))), ("law", "deterministic"),
                                                       ("min_confidence", 0.2))),
    Row("hf_plain", "hf", protocol=True),
    Row("hf_prompt_lookup", "hf", "prompt-lookup", protocol=True),
    Row("hf_assisted", "hf", "assistant", protocol=True),
    Row("llama_plain", "llama", protocol=True),
    Row("llama_prompt_lookup", "llama", "prompt-lookup", protocol=True),
    Row("tsl_plain", "ts_gguf"),
    Row("tsl_ngram", "ts_gguf", "ngram"),
    Row("tsl_head", "ts_gguf", "head"),
    Row("tsl_lookup_head", "ts_gguf", "lookup+head"),
    Row("tsl_ngram_noleaf", "ts_gguf", "ngram", leaf_logits=False),
    Row("tsl_head_noleaf", "ts_gguf", "head", leaf_logits=False),
    Row("tsl_lookup_head_noleaf", "ts_gguf", "lookup+head", leaf_logits=False),
)
ROW = {r.name: r for r in ROWS}
PROTOCOL_METHODS = tuple(r.name for r in ROWS if r.protocol)
#: treespec on the llama.cpp target (the same GGUF llama_plain runs, through LlamaCppRunner)
LLAMA_TARGET_METHODS = tuple(r.name for r in ROWS if r.target == "ts_gguf")
#: the rows outside the protocol, as the tables order them (the llama.cpp-target rows first)
EXTRA_METHODS = (*LLAMA_TARGET_METHODS,
                 *(r.name for r in ROWS if not r.protocol and r.target != "ts_gguf"))
#: rows of llama.cpp itself or on its target (skipped where llama-cpp-python is not usable)
LLAMA_METHODS = (*(r.name for r in ROWS if r.target == "llama"), *LLAMA_TARGET_METHODS)


# ------------------------------------------------------------------------------------------ descriptions

def _value(v: Any) -> str:
    if isinstance(v, tuple):
        return "[" + ",".join(_value(x) for x in v) + "]"
    return f"{v:g}" if isinstance(v, float) else str(v)


def cli_flags(row: Row) -> str:
    """The ``treespec generate`` flags of a row the CLI builds (``--plain`` or ``--draft X`` and its settings)."""
    words = ["--plain"] if row.draft is None else ["--draft", row.draft]
    if row.tree is not None:
        words += ["--tree", ",".join(str(w) for w in row.tree)]
    if row.min_confidence is not None:
        words += ["--min-confidence", _value(row.min_confidence)]
    if row.max_reject is not None:
        words += ["--max-reject", _value(row.max_reject)]
    if row.law is not None:
        words += ["--law", row.law]
    if row.quantize is not None:
        words += ["--draft-quantize", row.quantize]
    if row.judge:
        words += ["--judge", "shipped"]
    return " ".join(words)


def describe(row: Row, runner: str = "auto", runner_kind: str = "", lookup_tokens: int = 10,
             gguf: str = "the embedded GGUF") -> str:
    """What ``row`` runs, in words generated from its fields (``runner``: ``--runner``; ``runner_kind``: the class
    that choice resolved to; ``lookup_tokens``: ``--lookup-tokens``; ``gguf``: the GGUF file llama.cpp runs)."""
    if row.target == "hf":
        args = {None: "", "prompt-lookup": f"(prompt_lookup_num_tokens={lookup_tokens})",
                "assistant": f"(assistant_model={row.settings[0][1] if row.settings else ASSISTANT}) (HF defaults)"}
        return f"transformers generate{args[row.draft]} (greedy / sampling)"
    if row.target == "llama":
        how = "plain" if row.draft is None else f"LlamaPromptLookupDecoding(num_pred_tokens={lookup_tokens})"
        return f"llama-cpp-python {how} on {gguf}"
    where = {"ts": f"--target embedded --runner {runner}" + (f" ({runner_kind})" if runner_kind else ""),
             "ts_eager": "--target embedded --runner eager", "ts_int4": "--target embedded --quantize int4",
             "ts_int8h": "--target embedded --quantize int8-head", "ts_gguf": "--target embedded-gguf"}[row.target]
    if row.drafter is not None:
        custom = CUSTOM_DRAFTERS[row.drafter]
        settings = ", ".join([custom.over] * bool(custom.over) + [f"{k}={_value(v)}" for k, v in row.settings])
        state = "; state kept across the prompts of one temperature" if custom.stateful else ""
        return f"treespec {custom.label}({settings}) {where}{state}"
    # on the GGUF target `--leaf-logits auto` depends on the draft: the row names its setting either way
    leaf = f" --leaf-logits {'on' if row.leaf_logits else 'off'}" if row.target == "ts_gguf" or not row.leaf_logits else ""
    lossy = " (LOSSY: judge decoding)" if row.judge else ""
    return f"treespec generate {cli_flags(row)} {where}{leaf}{lossy}"


# ----------------------------------------------------------------------------------------------- methods

class Method:
    """A named way to generate exactly ``n`` tokens; ``engine`` decides its own plain baseline."""

    @staticmethod
    def no_reset() -> None:
        """The reset of a method that keeps no state across prompts."""

    def __init__(self, name: str, engine: str, run, describe: str, reset=None) -> None:
        self.name, self.engine, self._run, self.describe = name, engine, run, describe
        self.reset = reset or Method.no_reset

    @property
    def stateful(self) -> bool:
        """Whether the method keeps state across prompts (an online store, reset per temperature)."""
        return self.reset is not Method.no_reset

    def __call__(self, prompt: dict, n: int, temperature: float, seed: int) -> dict:
        return self._run(prompt, n, temperature, seed)


class ForwardCounter:
    """Counts top-level forward calls of a model (target passes, for tau of HF methods)."""

    def __init__(self, model) -> None:
        self.calls = 0
        model.register_forward_hook(self._hook)

    def _hook(self, *args) -> None:
        self.calls += 1


def no_top_p(temperature: float) -> float:
    """The nucleus filter of a block without one: off (1.0) at every temperature."""
    return 1.0


def hf_method(name: str, model, counter: ForwardCounter, describe: str, assistant=None,
              top_p_at: Callable[[float], float] = no_top_p, **extra) -> Method:
    """A transformers ``generate`` row (``extra``: its keyword arguments; ``top_p_at(T)``: the nucleus filter of the
    block at temperature T > 0)."""

    def run(prompt: dict, n: int, temperature: float, seed: int) -> dict:
        ids = prompt["ids"]
        gen_cfg = copy.deepcopy(model.generation_config)
        # run exactly n tokens without touching the logits: an EOS id no token has. (None does not work:
        # generate() fills every None field from model.generation_config, and would stop at the model's EOS)
        gen_cfg.eos_token_id = model.get_output_embeddings().weight.shape[0]
        gen_cfg.pad_token_id = gen_cfg.pad_token_id if gen_cfg.pad_token_id is not None else 0
        kwargs = dict(max_new_tokens=n, generation_config=gen_cfg, do_sample=temperature > 0, **extra)
        if temperature > 0:
            kwargs.update(temperature=temperature, top_k=0, top_p=top_p_at(temperature))
        if assistant is not None:
            kwargs["assistant_model"] = assistant
        x = torch.tensor([ids])  # [1, prompt_len]
        torch.manual_seed(seed)
        counter.calls = 0
        t0 = time.perf_counter()
        out = model.generate(x, attention_mask=torch.ones_like(x), **kwargs)  # [1, prompt_len + n]
        wall = time.perf_counter() - t0
        return {"tokens": out[0, len(ids):].tolist(), "wall_s": wall, "target_calls": counter.calls}

    return Method(name, "hf", run, describe)


def ts_method(name: str, model, make_drafter, describe: str, reset=None, engine: str = "treespec",
              leaf_logits: bool = True, top_p_at: Callable[[float], float] = no_top_p, judge=None) -> Method:
    """A treespec row. ``model``: the target module or the runner around it (``--runner``); ``leaf_logits``, ``judge``:
    as :class:`~treespec.generate.GenerationConfig`'s; ``top_p_at(T)``: the nucleus filter of the block at T > 0."""
    from treespec.generate import GenerationConfig, generate
    from treespec.sampling import SamplingConfig

    def run(prompt: dict, n: int, temperature: float, seed: int) -> dict:
        sampling = SamplingConfig(temperature, top_p=top_p_at(temperature) if temperature > 0 else 1.0)
        cfg = GenerationConfig(max_new_tokens=n, sampling=sampling, seed=seed, stop_on_eos=False,
                               leaf_logits=leaf_logits, judge=judge)
        res = generate(model, prompt["ids"], make_drafter(temperature), cfg)
        s = res.summary()
        return {"tokens": res.token_ids, "wall_s": s["wall_s"], "target_calls": s["target_calls"],
                **{k: s[k] for k in ("draft_s", "verify_s", "other_s", "prefill_s", "mean_tree_nodes")},
                **({"judged_tokens": s["judged_tokens"]} if judge is not None else {})}

    return Method(name, engine, run, describe, reset)


def cli_drafter(model, tok, dtype: str, draft: str, min_confidence: float | None = None,
                tree: tuple[int, ...] | None = None, law: str | None = None, quantize: str | None = None,
                max_reject: float | None = None):
    """A drafter from the registry ``treespec generate --draft DRAFT [--tree T] [--min-confidence C]
    [--law L] [--draft-quantize Q] [--max-reject H]`` uses (one per temperature; None: the CLI's default)."""
    from treespec.drafters import DraftOptions, build_drafter

    options = DraftOptions(tree=tree, law=law, min_confidence=min_confidence, quantize=quantize,
                           max_reject=max_reject)
    return lambda temperature: build_drafter(draft, model, options, temperature=temperature, tokenizer=tok,
                                             dtype=dtype)


def llama_available() -> str | None:
    """None when llama-cpp-python imports, else the reason it does not."""
    try:
        import llama_cpp  # noqa: F401
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding  # noqa: F401
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {exc}"
    return None


# ------------------------------------------------------------------------------------ drafters off the CLI

@dataclass(frozen=True)
class CustomDrafter:
    """A drafter the CLI does not build: its class name, what it drafts over (``over``), whether it keeps
    state across prompts, and ``make(targets, settings) -> (make_drafter(temperature), reset or None)``."""

    label: str
    over: str
    stateful: bool
    make: Callable


def _ngram_tree(targets: "Targets", settings: dict):
    from treespec.drafting.ngram import NgramConfig, NgramDrafter

    return (lambda t: NgramDrafter(NgramConfig(**settings))), None


def _online_ngram(targets: "Targets", settings: dict):
    from treespec.drafting.ngram import NgramConfig
    from treespec.drafting.online import OnlineNgramConfig, OnlineNgramDrafter

    store = [None]

    def fresh() -> None:  # one store per temperature, learning from every earlier prompt
        store[0] = OnlineNgramDrafter(OnlineNgramConfig(NgramConfig(**settings)))

    fresh()
    return (lambda t: store[0]), fresh


def _dyspec(targets: "Targets", settings: dict):
    from treespec.trees.dyspec import DySpecDrafter

    head = targets.head()
    return (lambda t: DySpecDrafter(head, **settings)), None


def _eagle2(targets: "Targets", settings: dict):
    from treespec.trees.eagle2 import Eagle2Drafter

    head = targets.head()
    return (lambda t: Eagle2Drafter(head, **settings)), None


def _lookup_head(targets: "Targets", settings: dict):
    from treespec.drafters import build_drafter
    from treespec.drafting.compose import FirstOf
    from treespec.drafting.ngram import NgramConfig, NgramDrafter

    def lookup_head(t: float) -> FirstOf:  # `--draft lookup+head` with another n-gram lookup in front
        head = build_drafter("head", targets.model, temperature=t)
        return FirstOf(NgramDrafter(NgramConfig(**settings)), head)

    return lookup_head, None


def _lookup_dyspec(targets: "Targets", settings: dict):
    from treespec.drafters import LOOKUP
    from treespec.drafting.compose import FirstOf
    from treespec.drafting.ngram import NgramDrafter
    from treespec.trees.dyspec import DySpecDrafter

    head = targets.head()
    return (lambda t: FirstOf(NgramDrafter(LOOKUP), DySpecDrafter(head, **settings))), None


def _online_head(targets: "Targets", settings: dict):
    from treespec.drafters import build_drafter
    from treespec.drafting.online_head import OnlineHeadConfig, OnlineHeadDrafter

    learner: dict[float, OnlineHeadDrafter] = {}

    def online_head(t: float) -> OnlineHeadDrafter:  # the shipped head as --draft head builds it at T
        if t not in learner:
            learner[t] = OnlineHeadDrafter(build_drafter("head", targets.model, temperature=t),
                                           OnlineHeadConfig(**settings))
        return learner[t]

    return online_head, learner.clear  # the next T builds its own copy of the head


def _medusa(targets: "Targets", settings: dict):
    from treespec.trees.grow import ShapeDrafter
    from treespec.trees.shape import TreeShape

    medusa = targets.medusa()
    shape = TreeShape.from_paths([list(p) for p in settings["paths"]])
    return (lambda t: ShapeDrafter(medusa, shape, settings["law"], min_confidence=settings["min_confidence"])), None


CUSTOM_DRAFTERS: dict[str, CustomDrafter] = {
    "ngram": CustomDrafter("NgramDrafter", "", False, _ngram_tree),
    "online_ngram": CustomDrafter("OnlineNgramDrafter", "", True, _online_ngram),
    "dyspec": CustomDrafter("DySpecDrafter", "the shipped head as --draft head sets it", False, _dyspec),
    "eagle2": CustomDrafter("Eagle2Drafter", "the shipped head as --draft head sets it", False, _eagle2),
    "lookup_dyspec": CustomDrafter("FirstOf(NgramDrafter(LOOKUP), DySpecDrafter)", "the shipped head as --draft head "
                                   "sets it", False, _lookup_dyspec),
    "lookup_head": CustomDrafter("FirstOf(NgramDrafter, --draft head)", "", False, _lookup_head),
    "online_head": CustomDrafter("OnlineHeadDrafter", "the drafter of --draft head at each temperature", True,
                                 _online_head),
    "medusa": CustomDrafter("ShapeDrafter", "the shipped Medusa heads", False, _medusa),
}


# --------------------------------------------------------------------------------------- building the rows

@dataclass(frozen=True)
class RunOptions:
    """The command-line settings the rows read: ``--runner``, ``--assistant``, ``--lookup-tokens``, ``--threads``,
    the nucleus filter of each sampled block (``top_p``: ``(temperature, top-p)`` pairs, from ``--temperatures`` and
    ``--top-p``), and the llama.cpp context size."""

    runner: str = "auto"
    assistant: str = "early-exit:16"
    lookup_tokens: int = 10
    threads: int = 2
    top_p: tuple[tuple[float, float], ...] = ()
    n_ctx: int = 4096

    def top_p_at(self, temperature: float) -> float:
        """The nucleus filter of the block at ``temperature`` (1.0 = off; always off at T=0)."""
        return dict(self.top_p).get(temperature, 1.0) if temperature > 0 else 1.0


def progress(line: str) -> None:
    """A progress line on stderr (stdout carries the results only)."""
    print(line, file=sys.stderr, flush=True)


class Targets:
    """The loaded target in one dtype and what rows build over it, each made once on first use."""

    def __init__(self, model, tok, dtype: str, options: RunOptions) -> None:
        self.model, self.tok, self.dtype, self.options = model, tok, dtype, options
        self._made: dict[str, Any] = {}

    def _once(self, key: str, make: Callable[[], Any]) -> Any:
        if key not in self._made:
            self._made[key] = make()
        return self._made[key]

    def runner(self):
        from treespec.models.fast import choose_runner

        # one runner for every treespec row (it resets per request)
        return self._once("runner", lambda: choose_runner(self.model, self.options.runner))

    def int4(self):
        from treespec.models.fast import make_runner

        return self._once("int4", lambda: make_runner(self.model, quantize="int4"))

    def int8_head(self):
        from treespec.models.fast import make_runner

        return self._once("int8-head", lambda: make_runner(self.model, quantize="int8-head"))

    def gguf(self, capture_hidden: bool = False):
        """A llama.cpp runner over the embedded GGUF (``capture_hidden`` for head rows, as the CLI builds it)."""
        from treespec.models.llama_cpp import LlamaCppRunner
        from treespec.models.loading import embedded_gguf

        def make():
            progress(f"loading the embedded GGUF in llama.cpp{' (hidden states captured)' if capture_hidden else ''}")
            return LlamaCppRunner(embedded_gguf(), context=self.options.n_ctx, threads=self.options.threads,
                                  capture_hidden=capture_hidden)

        return self._once(f"gguf-{capture_hidden}", make)

    def judge(self):
        """The shipped judge (``--judge shipped``; LOSSY judge decoding)."""
        from treespec.drafting.judge import JudgeHead
        from treespec.drafting.shipped import DEFAULT_JUDGE

        return self._once("judge", lambda: JudgeHead.load(DEFAULT_JUDGE))

    def head(self):
        """The shipped head as ``--draft head`` sets it for drafting (4-bit weights where the int4 kernel runs,
        else packed or plain in the target's dtype): the dynamic builders' rows draft with the same head."""
        from treespec.drafters import inference_head

        return self._once("head", lambda: inference_head(self.model)[0])

    def medusa(self):
        from treespec.drafting.shipped import load_default_medusa

        return self._once("medusa", lambda: load_default_medusa(self.model))

    def counter(self) -> ForwardCounter:
        return self._once("counter", lambda: ForwardCounter(self.model))

    def assistant(self):
        from treespec.models.loading import load_draft_model

        def make():
            progress(f"loading the assistant {self.options.assistant} ({self.dtype})")
            return load_draft_model(self.options.assistant, self.model, dtype=self.dtype)

        return self._once("assistant", make)


def resolve(row: Row, options: RunOptions) -> Row:
    """``row`` with the run's ``--assistant`` in place of :data:`ASSISTANT`."""
    if row.draft == ASSISTANT:
        return replace(row, draft=options.assistant)
    if row.target == "hf" and row.draft == "assistant":
        return replace(row, settings=(("assistant_model", options.assistant),))
    return row


def _treespec_method(row: Row, targets: Targets) -> Method:
    opts = targets.options
    model = {"ts": targets.runner, "ts_eager": lambda: targets.model, "ts_int4": targets.int4,
             "ts_int8h": targets.int8_head,
             "ts_gguf": lambda: targets.gguf(capture_hidden=row.draft in ("head", "lookup+head"))}[row.target]()
    reset = None
    if row.drafter is not None:
        make, reset = CUSTOM_DRAFTERS[row.drafter].make(targets, dict(row.settings))
    elif row.draft is None:
        make = lambda t: None  # noqa: E731 - plain decoding
    else:
        make = cli_drafter(targets.model, targets.tok, targets.dtype, row.draft, row.min_confidence, row.tree,
                           row.law, row.quantize, row.max_reject)
    text = describe(row, opts.runner, type(model).__name__ if row.target == "ts" else "", opts.lookup_tokens)
    judge = targets.judge() if row.judge else None
    return ts_method(row.name, model, make, text, reset, row.engine, row.leaf_logits, top_p_at=opts.top_p_at,
                     judge=judge)


def _hf_method(row: Row, targets: Targets) -> Method:
    opts = targets.options
    extra: dict[str, Any] = {}
    if row.draft == "prompt-lookup":
        extra["prompt_lookup_num_tokens"] = opts.lookup_tokens
    if row.draft == "assistant":
        extra["assistant"] = targets.assistant()
    return hf_method(row.name, targets.model, targets.counter(), describe(row, lookup_tokens=opts.lookup_tokens),
                     top_p_at=opts.top_p_at, **extra)


@contextlib.contextmanager
def _runner_model_params():
    """While open, llama-cpp-python's ``Llama`` loads with the model parameters of treespec's llama.cpp runner
    (:func:`treespec.models.llama_cpp.set_model_params`: the same extra buffer types), so that llama.cpp's own
    rows and treespec's llama.cpp target run the same kernels on every host. ``Llama`` (0.3.36) takes no
    such argument: it reads ``llama_cpp.llama_cpp.llama_model_default_params`` once while it loads."""
    import llama_cpp.llama_cpp as low

    from treespec.models.llama_cpp import set_model_params

    default = low.llama_model_default_params
    low.llama_model_default_params = lambda: set_model_params(default())
    try:
        yield
    finally:
        low.llama_model_default_params = default


def _llama_method(row: Row, targets: Targets) -> Method:
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    from treespec.models.loading import embedded_gguf

    opts, gguf = targets.options, embedded_gguf()
    draft = opts.lookup_tokens if row.draft == "prompt-lookup" else None
    progress(f"loading {gguf.name} in llama-cpp-python for {row.name}")
    # with a draft model llama-cpp-python keeps logits of every position but sizes its buffer from the
    # logits_all argument (0.3.36): prompts longer than n_batch crashed unless logits_all is passed
    with _runner_model_params():
        llm = Llama(model_path=str(gguf), n_ctx=opts.n_ctx, n_threads=opts.threads, n_threads_batch=opts.threads,
                    n_batch=512, seed=0, verbose=False, logits_all=bool(draft),
                    draft_model=LlamaPromptLookupDecoding(num_pred_tokens=draft) if draft else None)

    def run(prompt: dict, n: int, temperature: float, seed: int) -> dict:
        toks = llm.tokenize(prompt["text"].encode("utf-8"), add_bos=True, special=False)
        if len(toks) + n + opts.lookup_tokens > llm.n_ctx():  # llama.cpp would fail with a shape error
            raise ValueError(f"{row.name}: prompt {prompt['id']} is {len(toks)} llama.cpp tokens; with {n} new "
                             f"tokens it does not fit n_ctx={llm.n_ctx()}")
        llm.reset()
        llm.set_seed(seed)
        out: list[int] = []
        t0 = time.perf_counter()
        # exactly n tokens (generate() does not stop at EOS); llama.cpp's samplers neutralised:
        # temperature and the block's top-p only (0 = greedy), no top-k / min-p / repetition penalty
        for t in llm.generate(toks, temp=temperature, top_k=0, top_p=opts.top_p_at(temperature), min_p=0.0,
                              typical_p=1.0, repeat_penalty=1.0, reset=True):
            out.append(int(t))
            if len(out) >= n:
                break
        wall = time.perf_counter() - t0
        return {"tokens": out, "wall_s": wall, "target_calls": None, "prompt_tokens_llama": len(toks)}

    return Method(row.name, "llama.cpp", run, describe(row, lookup_tokens=opts.lookup_tokens, gguf=gguf.name))


def variant_row(fields: list[str]) -> Row:
    """The row of one ``--variant NAME DRAFT TREE CONF LAW [QUANTIZE]`` ('-': the CLI's default; CONF ``reject:H``:
    ``--max-reject H`` instead of a confidence)."""
    name, draft, tree, conf, law, *quant = fields
    reject = conf.startswith("reject:")
    return Row(name, "ts", draft, tree=tuple(int(x) for x in tree.split(",")) if tree != "-" else None,
               min_confidence=None if conf == "-" or reject else float(conf), law=None if law == "-" else law,
               quantize=quant[0] if quant and quant[0] != "-" else None,
               max_reject=float(conf.removeprefix("reject:")) if reject else None)


def ordered_rows(wanted: set[str], variants: list[Row], runner: str) -> list[Row]:
    """The rows a run builds, in build order: every wanted row, its engine's plain baseline, and the
    ``--variant`` rows after ``ts_lookup_head`` (``ts_plain_eager`` only where ``--runner`` is not eager)."""
    engines = {r.engine for r in ROWS if r.name in wanted}
    chosen = [r for r in ROWS if r.name in wanted or (BASELINES[r.engine] == r.name and r.engine in engines)]
    if runner == "eager":
        chosen = [r for r in chosen if r.name != "ts_plain_eager"]
    cut = sum(ROWS.index(r) <= ROWS.index(ROW["ts_lookup_head"]) for r in chosen)  # chosen is in ROWS order
    return chosen[:cut] + variants + chosen[cut:]


def build_methods(rows: list[Row], targets: Targets) -> list[Method]:
    """One :class:`Method` per row on ``targets`` (models and runners each made once, on first use)."""
    out = []
    for row in rows:
        row = resolve(row, targets.options)
        if row.target == "hf":
            out.append(_hf_method(row, targets))
        elif row.target == "llama":
            out.append(_llama_method(row, targets))
        else:
            out.append(_treespec_method(row, targets))
    return out
