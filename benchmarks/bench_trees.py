"""Compare draft-tree builders at equal node budgets on a subset of Spec-Bench.

For each temperature (0 and 1 by default) and budget (8, 16, 32, 64 drafted nodes) every builder
generates the same prompts, interleaved prompt by prompt with plain decoding of the same target: for
each prompt plain decoding and every builder run one after the other (the order reversed on every
other prompt, so a linear drift of the machine's speed cancels), and plain decoding is re-measured in
every budget block. Reported per (builder, budget, temperature): tau (tokens per target pass),
tokens/s, speedup over the plain decoding of the same block (total time ratio, and the median over
prompts with a seeded bootstrap 95% interval), draft / verify / other time, mean tree size. Warm-up:
each drafter once on the first prompt (4 tokens) per block, not measured.

Prompt subset: the first ``--per-subtask`` rows of each Spec-Bench subtask (mt_bench, translation,
summarization, qa, math_reasoning, rag) of ../shared/data/eval/spec_bench.prompts.jsonl, first
turn only, no chat template, truncated to ``--max-prompt-tokens`` tokens (from the left).

Builders: model-free ``ngram`` (prompt lookup) always; with ``--draft PATH`` (a causal LM sharing
the target's tokenizer) also ``chain``, ``specinfer`` (per-depth widths), ``spectr`` (4 independent
chains), ``sequoia`` (DP shape from an acceptance vector measured on train prompts, or
``--sequoia-acc``), ``dyspec`` (heap), ``dyspec_threshold``, ``eagle2`` and ``merged``
(EAGLE-2 tree + n-gram trie). Model builders need ``--draft`` (a path / id, or ``early-exit:L`` for
the target's own first L layers). For Sequoia the tau predicted from the calibration acceptance
vector is reported beside the measured one.

Rows of builders that draft a fixed shape (chain, specinfer, spectr, sequoia) also keep the shape
(``shape``: its parent array) and the settings that serve it on vLLM and SGLang (``serving``:
:func:`treespec.trees.export.serving_settings`, with vLLM's refusal where it cannot draft the shape and
SGLang's exact flag and note), so the best row can be served without re-running the DP.

Writes results.json, results.md and results.png (rewritten after every budget) and provenance.json
(commit, dirty + diff, CPU and flags, versions, command) under ``benchmarks/results/trees/<date>-<commit>/``
(or ``--out``; a folder git tracks is never overwritten).

    python benchmarks/bench_trees.py --draft path/to/draft          # the full comparison
    python benchmarks/bench_trees.py --tiny --quick                 # smoke test on tiny random models
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from treespec.calibration import measure_acceptance_vector  # noqa: E402
from treespec.distill.inputs import read_prompt_texts  # noqa: E402
from treespec.drafters import build_tree_drafter, is_head_path  # noqa: E402
from treespec.drafting.head import LayerHead  # noqa: E402
from treespec.drafting.subset_head import SubsetHead  # noqa: E402
from treespec.files import atomic_write_text  # noqa: E402
from treespec.generate import GenerationConfig, generate  # noqa: E402
from treespec.sampling import SamplingConfig  # noqa: E402
from treespec.trees.export import serving_settings  # noqa: E402
from treespec.trees.sequoia import AcceptanceVector, SequoiaDP, predicted_tau  # noqa: E402

from benchmarks.common import (SHARED, add_output_args, bootstrap_ci, finish, median, open_results,  # noqa: E402
                               require_shared, write_json)
from benchmarks.common import load_prompts as load_all_prompts  # noqa: E402

TRAIN = SHARED / "data" / "train" / "train_prompts.jsonl"
MODEL_FREE = ("ngram",)
MODEL_BUILDERS = ("chain", "specinfer", "spectr", "sequoia", "dyspec", "dyspec_threshold", "eagle2", "merged")


# Spec-Bench subtask -> train-file categories of the same kind of task (for --calib-mix specbench)
SPECBENCH_MIX = {"mt_bench": ("writing", "general"), "translation": ("translation",),
                 "summarization": ("summarization",), "qa": ("qa",), "math_reasoning": ("math",),
                 "rag": ("qa_context",)}
# train-file rows in the shipped head's corpora (its model card): the first 6,108 of the seed-0
# shuffle (train-k0; train-greedy used its first 128) and the first 128 of the seed-1 shuffle (train-sample)
HEAD_ROWS_SEED0, HEAD_ROWS_SEED1 = 6108, 128


def _held_out_pool() -> list[dict]:
    """Train rows in no shipped head's corpora, in the seed-0 shuffle's order."""
    from treespec.distill.corpus import read_prompts as shuffled_prompts

    seen = {r["id"] for r in shuffled_prompts(require_shared(TRAIN), seed=1)[:HEAD_ROWS_SEED1]}
    return [r for r in shuffled_prompts(require_shared(TRAIN), seed=0)[HEAD_ROWS_SEED0:] if r["id"] not in seen]


def held_out_eval_rows(per_subtask: int, calib_count: int) -> list[dict]:
    """Held-out train rows to measure on, disjoint from the ``--calib-mix specbench`` calibration rows.

    For each Spec-Bench subtask, the ``per_subtask`` rows of the same kind of task just before the
    ones :func:`held_out_rows` takes for calibration: the same distribution as the calibration
    (so a gap to the prediction is the predictor's, not a shift between datasets), other prompts.
    """
    pool, calib_per = _held_out_pool(), -(-calib_count // len(SPECBENCH_MIX))
    rows: list[dict] = []
    for sub, cats in SPECBENCH_MIX.items():
        kind = [r for r in pool if r["category"] in cats]
        rows += [dict(r, subtask=sub) for r in kind[-(calib_per + per_subtask):-calib_per]]
    return rows


def held_out_rows(count: int, mix: str = "train") -> list[dict]:
    """``count`` train rows the shipped head never saw: the end of the seed-0 shuffle past its corpora.

    ``mix="train"``: the last rows, in the train file's own task mix. ``mix="specbench"``: equally many
    rows for each Spec-Bench subtask, from the train categories of the same kind of task
    (:data:`SPECBENCH_MIX`), i.e. the benchmark's task mix with train text only (the eval prompts
    are never read)."""
    pool = _held_out_pool()
    if mix == "train":
        return pool[-count:]
    if mix != "specbench":
        raise ValueError(f"unknown calibration mix {mix!r}")
    per = -(-count // len(SPECBENCH_MIX))
    rows: list[dict] = []
    for cats in SPECBENCH_MIX.values():
        rows += [r for r in pool if r["category"] in cats][-per:]
    return rows


def calibration_sequences(target, draft, encode, args):
    """Token sequences the Sequoia acceptance rows are measured on (TRAIN prompts only).

    Default: the first ``--calib-prompts`` train prompts, <= 128 tokens. With ``--calib-held-out``
    train rows the shipped head was never trained on (:func:`held_out_rows`; ``--calib-mix specbench``
    picks them in the benchmark's task mix), and with ``--calib-continue N`` each
    prompt (cut to 128 - N tokens) is followed by N tokens the target itself generates at the
    calibration temperature (seeded): the text a tree is then drafted along resembles generation.
    Returns ``(sequences, score_from)``, or a function of the temperature returning them when
    continuations depend on it; ``score_from`` (the first generated index of each sequence) is set
    with ``--calib-generated-only``, so only positions a generation drafts at are counted.
    """
    if not args.calib_held_out:
        texts = read_prompt_texts(require_shared(TRAIN), args.calib_prompts)
    else:
        texts = [r["prompt"] for r in held_out_rows(args.calib_prompts, args.calib_mix)]
    n, limit = args.calib_continue, args.calib_max_len
    if n == 0:
        return [encode(p)[:limit] for p in texts], None
    # a prompt keeps its last tokens, as the eval prompts do (``--max-prompt-tokens``), then n generated
    prompts = [encode(p)[-(limit - n):] for p in texts]

    def with_continuations(t: float) -> list[list[int]]:
        cfg = lambda i: GenerationConfig(max_new_tokens=n, sampling=SamplingConfig(t), seed=i,  # noqa: E731
                                         stop_on_eos=False)
        seqs = [ids + generate(target, ids, None, cfg(i)).token_ids for i, ids in enumerate(prompts)]
        return seqs, ([len(ids) for ids in prompts] if args.calib_generated_only else None)

    return with_continuations


def load_prompts(per_subtask: int) -> list[dict]:
    return load_all_prompts(per_subtask)


def _empty() -> dict:
    return {"new_tokens": 0, "target_calls": 0, "wall_s": 0.0, "draft_s": 0.0, "verify_s": 0.0, "other_s": 0.0,
            "tree_nodes": 0.0}


def _add(tot: dict, s: dict) -> None:
    for k in ("new_tokens", "target_calls", "wall_s", "draft_s", "verify_s", "other_s"):
        tot[k] += s[k]
    tot["tree_nodes"] += s["mean_tree_nodes"] * s["target_calls"]


def _final(tot: dict) -> dict:
    return {"tau": tot["new_tokens"] / max(tot["target_calls"], 1),
            "tokens_per_s": tot["new_tokens"] / max(tot["wall_s"], 1e-9),
            "mean_tree_nodes": tot["tree_nodes"] / max(tot["target_calls"], 1), **tot}


def run_block(target, prompts_ids, makers: dict, cfg: GenerationConfig, seed: int = 0) -> dict:
    """Plain decoding and every drafter of ``makers`` on each prompt in turn (plain first on even
    prompts, last on odd ones). Returns per name the totals, and per drafter the per-prompt speedups
    (plain time / its time on the same prompt) with their median and bootstrap 95% interval."""
    names = ["plain", *makers]
    tot = {n: _empty() for n in names}
    ratios: dict[str, list[float]] = {n: [] for n in makers}
    for i, ids in enumerate(prompts_ids):
        wall = {}
        for name in (names if i % 2 == 0 else names[::-1]):
            drafter = None if name == "plain" else makers[name]()
            s = generate(target, ids, drafter, GenerationConfig(**{**cfg.__dict__, "seed": i})).summary()
            _add(tot[name], s)
            wall[name] = s["wall_s"] / max(s["new_tokens"], 1)
        for name in makers:
            ratios[name].append(wall["plain"] / wall[name])
    out = {n: _final(t) for n, t in tot.items()}
    for name in makers:
        out[name]["speedup"] = out[name]["tokens_per_s"] / out["plain"]["tokens_per_s"]
        out[name]["speedup_median"] = median(ratios[name])
        out[name]["speedup_ci95"] = list(bootstrap_ci(ratios[name], seed=seed))
        out[name]["speedup_per_prompt"] = ratios[name]
    out["plain"]["speedup"] = 1.0
    return out


def run_set(target, prompts_ids, make, cfg: GenerationConfig) -> dict:
    """One drafter (or plain decoding, ``make() -> None``) over all prompts (kept for callers)."""
    tot = _empty()
    for i, ids in enumerate(prompts_ids):
        _add(tot, generate(target, ids, make(), GenerationConfig(**{**cfg.__dict__, "seed": i})).summary())
    return _final(tot)


def write_results(out: Path, meta: dict, results: list[dict], builders: list[str], temps: list[float],
                  args: argparse.Namespace, rows: list[dict], target_name: str, draft_name: str | None) -> None:
    """results.json, results.md and results.png of what has been measured so far (rewritten after
    every budget, so a run cut short keeps the budgets it finished; ``meta["complete"]`` says which)."""
    commit = meta["commit"]
    write_json(out / "results.json", {"meta": meta, "results": results})
    lines = [f"# Tree builders, commit {commit}" + ("" if meta["complete"] else " (PARTIAL: run still going or cut short)"), "",
             f"target {target_name}, draft {draft_name}, {meta['machine']['cpu']}, "
             f"{meta['machine']['torch_threads']} threads, torch {meta['machine']['torch']}, "
             f"transformers {meta['machine']['transformers']}, {args.dtype}, target runner {meta.get('runner', 'ModelRunner')}; {meta['prompt_subset']}, "
             f"{len(rows)} prompts, {args.max_new_tokens} new tokens", "",
             "Speedup vs plain decoding measured in the same budget block, prompt by prompt: total-time ratio, "
             "and median over prompts [bootstrap 95% interval].", "",
             "| T | builder | budget | tree nodes | tau | tokens/s | speedup vs plain (total) | "
             "speedup vs plain (median [95% CI]) | draft s | verify s | other s |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        med = (f"{r['speedup_median']:.2f} [{r['speedup_ci95'][0]:.2f}, {r['speedup_ci95'][1]:.2f}]"
               if "speedup_median" in r else "-")
        lines.append(f"| {r['temperature']:g} | {r['builder']} | {r['budget']} | {r['mean_tree_nodes']:.1f} | "
                     f"{r['tau']:.2f} | {r['tokens_per_s']:.1f} | {r['speedup']:.2f} | {med} | {r['draft_s']:.2f} | "
                     f"{r['verify_s']:.2f} | {r['other_s']:.2f} |")
    seq = [r for r in results if r["builder"] == "sequoia"]
    if seq:
        lines += ["", "Sequoia: measured tau on the measured prompts vs tau predicted from the train-prompt calibration "
                  "(rows per depth for a head; the last column: the depth-1 row alone, classic Sequoia)", "",
                  "| T | budget | measured | predicted | error | predicted (depth-1 row only) |", "|---|---|---|---|---|---|"]
        for r in seq:
            alt = r.get("predicted_tau_depth1_only")
            lines.append(f"| {r['temperature']:g} | {r['budget']} | {r['tau']:.2f} | {r['predicted_tau']:.2f} | "
                         f"{r['tau'] / r['predicted_tau'] - 1:+.1%} | " + (f"{alt:.2f} |" if alt else "- |"))
    atomic_write_text(out / "results.md", "\n".join(lines) + "\n")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(2, len(temps), figsize=(5 * len(temps), 8), squeeze=False)
    for j, t in enumerate(temps):
        for name in builders:
            pts = sorted((r["budget"], r["tau"], r["speedup"]) for r in results
                         if r["builder"] == name and r["temperature"] == t)
            axes[0][j].plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
            axes[1][j].plot([p[0] for p in pts], [p[2] for p in pts], marker="o", label=name)
        axes[0][j].set_title(f"T = {t:g}: tau")
        axes[1][j].set_title(f"T = {t:g}: speedup over plain")
        axes[1][j].axhline(1.0, color="gray", lw=0.8)
        for ax in (axes[0][j], axes[1][j]):
            if any(r["temperature"] == t for r in results):  # a partial run has no points yet at later T
                ax.set_xscale("log", base=2)
            ax.set_xlabel("node budget")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "results.png", dpi=100)
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--draft", default=None,
                    help="draft for the model builders: 'head' (the shipped draft head), a head .safetensors (EAGLE, "
                         "EAGLE-3 or a Kangaroo adapter) or speculators folder, 'early-exit:L', or a causal LM path/id")
    ap.add_argument("--tiny", action="store_true", help="tiny random Gemma-3 target/draft (smoke test)")
    ap.add_argument("--quick", action="store_true", help="1 prompt per subtask, 16 new tokens, budgets 8,16")
    ap.add_argument("--budgets", default="8,16,32,64")
    ap.add_argument("--temperatures", default="0,1")
    ap.add_argument("--builders", default=None, help="comma-separated subset")
    ap.add_argument("--per-subtask", type=int, default=5)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--max-prompt-tokens", type=int, default=1024)
    ap.add_argument("--max-depth", type=int, default=10)
    ap.add_argument("--min-confidence", type=float, default=0.0,
                    help="the model builders' confidence rule: a drafted token grows (and, with deterministic "
                         "candidates, is proposed) only at this draft probability or more (0: none)")
    ap.add_argument("--dtype", default="float32", choices=["auto", "float32", "bfloat16"])
    ap.add_argument("--runner", choices=["auto", "fast", "eager"], default="auto",
                    help="the target's forward in every row, plain decoding included (as `treespec generate --runner`)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--sequoia-acc", default=None,
                    help="acceptance vector JSON, or an earlier run's results.json (its calibration rows per "
                         "temperature); else measured on train prompts")
    ap.add_argument("--calib-prompts", type=int, default=64)
    ap.add_argument("--calib-held-out", action="store_true",
                    help="calibrate on the last train rows of the distillation order (never seen by a shipped head)")
    ap.add_argument("--calib-continue", type=int, default=0,
                    help="append N target-generated tokens to each calibration prompt (at the calibration T)")
    ap.add_argument("--calib-max-len", type=int, default=128,
                    help="tokens per calibration sequence (prompt + continuation)")
    ap.add_argument("--calib-mix", choices=["train", "specbench"], default="train",
                    help="with --calib-held-out: the train file's task mix, or Spec-Bench's (equal rows per subtask "
                         "from the train categories of the same kind)")
    ap.add_argument("--calib-generated-only", action="store_true",
                    help="with --calib-continue: count only the generated positions (the prompt is context)")
    ap.add_argument("--calib-depths", type=int, default=6,
                    help="acceptance rows per depth for a draft head (deeper nodes use the last row)")
    ap.add_argument("--eval-prompts", choices=["specbench", "heldout"], default="specbench",
                    help="measure on Spec-Bench (default) or on held-out train rows in Spec-Bench's task mix, "
                         "disjoint from the calibration rows (needs --calib-held-out --calib-mix specbench)")
    ap.add_argument("--tag", default=None, help="suffix of the default results folder name")
    add_output_args(ap)
    return ap


def check_args(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse contradictory calibration / evaluation options (exit 2) and apply ``--quick``."""
    if args.eval_prompts == "heldout" and not (args.calib_held_out and args.calib_mix == "specbench"):
        ap.error("--eval-prompts heldout needs --calib-held-out --calib-mix specbench (disjoint rows)")
    if args.calib_generated_only and not args.calib_continue:
        ap.error("--calib-generated-only needs --calib-continue N (generated tokens to score)")
    if not 0 <= args.calib_continue < args.calib_max_len:
        ap.error("--calib-continue must be >= 0 and below --calib-max-len")
    if not 0.0 <= args.min_confidence < 1.0:
        ap.error(f"--min-confidence must be in [0, 1), got {args.min_confidence}")
    if args.quick:
        args.per_subtask, args.max_new_tokens, args.budgets = 1, 16, "8,16"
        args.calib_prompts = min(args.calib_prompts, 8)


def load_models(args: argparse.Namespace):
    """``(target, draft, vocab, encode, target_name, draft_name)``: tiny random Gemma-3 models with ``--tiny``,
    else the embedded target and the draft of ``--draft`` (None without it); ``encode(text)``: prompt ids."""
    if args.tiny:
        from treespec.models.tiny import tiny_model
        vocab = 256
        from treespec.models.loading import resolve_dtype
        tiny_dtype = resolve_dtype(args.dtype)  # --dtype bfloat16 runs every builder in bf16 on tiny models too
        target = tiny_model("gemma3", vocab, seed=0, hidden_size=64, logit_scale=8, max_positions=2048,
                            dtype=tiny_dtype)
        draft = tiny_model("gemma3", vocab, seed=1, hidden_size=32, logit_scale=8, max_positions=2048,
                           dtype=tiny_dtype)
        encode = lambda text: [b % vocab for b in text.encode()][-args.max_prompt_tokens:] or [1]  # noqa: E731
        target_name, draft_name = "tiny-gemma3-random", "tiny-gemma3-random"
    else:
        from treespec.models.loading import load_draft_model, load_model, load_tokenizer
        tok = load_tokenizer("embedded")
        target = load_model("embedded", dtype=args.dtype)
        vocab = target.get_output_embeddings().weight.shape[0]
        if args.draft == "head":  # the shipped draft head (any builder drafts with it via HeadRunner)
            from treespec.drafting.shipped import load_default_head
            draft = load_default_head(target)
        elif args.draft and is_head_path(args.draft):  # any head file or speculators folder, as --draft reads it
            from treespec.drafting.head_files import load_head
            draft = load_head(args.draft, target)
        else:
            draft = load_draft_model(args.draft, target, dtype=args.dtype) if args.draft else None
        encode = lambda text: tok(text)["input_ids"][-args.max_prompt_tokens:]  # noqa: E731
        target_name, draft_name = "embedded gemma-3-270m", args.draft
    if isinstance(draft, SubsetHead):  # drafts in the target's dtype, as the CLI's head does (packed in bf16)
        draft.for_inference(target.dtype)
    return target, draft, vocab, encode, target_name, draft_name


def choose_builders(args: argparse.Namespace, draft) -> list[str]:
    """The builders to compare: model-free ones always, model builders with a draft, cut to ``--builders``."""
    builders = list(MODEL_FREE) + (list(MODEL_BUILDERS) if draft is not None else [])
    if args.builders:
        wanted = args.builders.split(",")
        missing = [b for b in wanted if b in MODEL_BUILDERS and draft is None]
        if missing:
            raise SystemExit(f"builders {missing} need a draft model: pass --draft PATH (or --tiny)")
        builders = [b for b in builders if b in wanted]
    return builders


def sequoia_rows(args: argparse.Namespace, target, draft, encode, temps: list[float],
                 builders: list[str]) -> tuple[dict[float, list[float]], str]:
    """Sequoia's acceptance rows per temperature (loaded from ``--sequoia-acc`` or measured on train prompts)
    and where they came from; empty where ``sequoia`` is not compared."""
    accs: dict[float, list[float]] = {}
    acc_source = "measured in this run"
    if "sequoia" in builders:
        if args.sequoia_acc:
            saved = json.loads(Path(args.sequoia_acc).read_text())
            if "meta" in saved:  # an earlier run's results.json: its calibration rows per temperature
                found = saved["meta"].get("sequoia_acc", {})
                missing = [t for t in temps if str(t) not in found]
                if missing:
                    raise SystemExit(f"{args.sequoia_acc} has no Sequoia calibration for T = {missing}")
                accs = {t: found[str(t)] for t in temps}
            else:
                vec = AcceptanceVector.load(args.sequoia_acc)
                accs = {t: vec.rows for t in temps}
            acc_source = f"loaded from {args.sequoia_acc}"
        else:
            calib = calibration_sequences(target, draft, encode, args)  # train split only
            is_head = isinstance(draft, LayerHead)  # an EAGLE or EAGLE-3 head
            for t in temps:
                # a head is calibrated per depth (it drafts from its own features below depth 1)
                seqs, starts = calib(t) if callable(calib) else calib
                vec = measure_acceptance_vector(target, draft, seqs, SamplingConfig(t), width=8,
                                                max_positions=args.calib_max_len,
                                                depths=args.calib_depths if is_head else 1, score_from=starts,
                                                generator=torch.Generator().manual_seed(0))
                accs[t] = vec.rows
                print(f"T={t} acceptance rows (depth 1..): " + "; ".join(
                    " ".join(f"{a:.3f}" for a in row[:3]) for row in vec.rows), flush=True)

    return accs, acc_source


def serving_of(drafter) -> dict | None:
    """``{"shape": parents + name, "serving": vLLM and SGLang settings}`` for a drafter growing a fixed shape
    (a :class:`~treespec.trees.grow.ShapeDrafter`), None for dynamic builders (n-gram, DySpec, EAGLE-2, merged)."""
    shape = getattr(drafter, "tree_shape", None)
    if shape is None or shape.num_drafted == 0:
        return None
    settings = serving_settings(shape)
    return {"shape": settings.pop("shape"), "serving": settings}


def measure(runner, draft, vocab: int, prompts_ids: list[list[int]], builders: list[str], accs: dict,
            temps: list[float], budgets: list[int], args: argparse.Namespace, write) -> list[dict]:
    """Every (temperature, budget) block: plain decoding and every builder, interleaved prompt by prompt;
    ``write(results)`` after every block. Returns the rows of every block."""
    results = []
    warm = GenerationConfig(max_new_tokens=4, sampling=SamplingConfig(0.0), stop_on_eos=False)
    generate(runner, prompts_ids[0], None, warm)  # warm-up
    for t in temps:
        cfg = GenerationConfig(max_new_tokens=args.max_new_tokens, sampling=SamplingConfig(t), stop_on_eos=False)
        for b in budgets:
            makers = {name: (lambda name=name, b=b: build_tree_drafter(
                name, draft, b, vocab=vocab, acc=accs.get(t), max_depth=args.max_depth,
                min_confidence=args.min_confidence)) for name in builders}
            serving = {}
            for name, make in makers.items():
                drafter = make()
                serving[name] = serving_of(drafter)
                generate(runner, prompts_ids[0], drafter, warm)  # warm-up
            block = run_block(runner, prompts_ids, makers, cfg)
            results.append({"builder": "plain", "budget": b, "temperature": t, **block["plain"]})
            print(f"T={t} n={b} plain: {block['plain']['tokens_per_s']:.1f} tok/s", flush=True)
            for name in builders:
                r = block[name]
                if name == "sequoia":  # measured (held-out eval prompts) vs predicted (train calibration)
                    shape = SequoiaDP(accs[t], b, args.max_depth).shape(b, args.max_depth)
                    r["predicted_tau"] = predicted_tau(shape, accs[t])
                    if len(accs[t]) > 1:  # what the depth-1 vector alone (classic Sequoia) would predict
                        r["predicted_tau_depth1_only"] = predicted_tau(shape, accs[t][0])
                if serving[name] is not None:
                    r.update(serving[name])
                results.append({"builder": name, "budget": b, "temperature": t, **r})
                print(f"T={t} n={b} {name}: tau {r['tau']:.2f}, {r['tokens_per_s']:.1f} tok/s, "
                      f"speedup {r['speedup']:.2f} (median {r['speedup_median']:.2f} [{r['speedup_ci95'][0]:.2f}, "
                      f"{r['speedup_ci95'][1]:.2f}])" + (f", predicted tau {r['predicted_tau']:.2f}"
                                                          if "predicted_tau" in r else ""), flush=True)
            write(results)
    return results


def main(argv=None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    started = time.time()
    check_args(ap, args)
    if args.threads:
        torch.set_num_threads(args.threads)
    budgets = [int(b) for b in args.budgets.split(",")]
    temps = [float(t) for t in args.temperatures.split(",")]
    rows = (load_prompts(args.per_subtask) if args.eval_prompts == "specbench"
            else held_out_eval_rows(args.per_subtask, args.calib_prompts))
    target, draft, vocab, encode, target_name, draft_name = load_models(args)
    from treespec.models.fast import choose_runner

    try:  # one runner for plain decoding and every builder
        runner = choose_runner(target, args.runner)
    except ValueError as err:
        ap.error(str(err))
    builders = choose_builders(args, draft)
    prompts_ids = [encode(r["prompt"]) for r in rows]
    accs, acc_source = sequoia_rows(args, target, draft, encode, temps, builders)
    out, prov = open_results("trees", args.out, allow_dirty=args.allow_dirty,
                             tag="-".join(x for x in (args.tag, "tiny" if args.tiny else None) if x) or None)
    commit = prov["commit_short"] + ("-dirty" if prov["dirty"] else "")
    meta = {"commit": commit, "machine": prov["machine"], "target": target_name, "draft": draft_name,
            "dtype": args.dtype, "runner": type(runner).__name__, "settings": vars(args), "prompts": [r["id"] for r in rows],
            "prompt_subset": (f"first {args.per_subtask} rows of each Spec-Bench subtask (first turn)"
                              if args.eval_prompts == "specbench" else
                              f"{args.per_subtask} held-out train rows per Spec-Bench subtask kind, disjoint "
                              f"from the calibration rows"),
            "sequoia_acc": {str(k): v for k, v in accs.items()}, "sequoia_acc_source": acc_source,
            "complete": False}
    results = measure(runner, draft, vocab, prompts_ids, builders, accs, temps, budgets, args,
                      lambda results: write_results(out, meta, results, builders, temps, args, rows, target_name,
                                                    draft_name))
    meta["complete"] = True
    write_results(out, meta, results, builders, temps, args, rows, target_name, draft_name)
    finish(out, started)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
