"""Speed of every decoding method on Spec-Bench + HumanEval, each beside its baselines, with spreads.

One protocol, one command::

    python benchmarks/run.py --quick     # a few minutes: 1 prompt of 3 subtasks, 32 tokens, T=0, one dtype
    python benchmarks/run.py             # 10 prompts x 6 Spec-Bench subtasks + 10 HumanEval, 128 tokens,
                                         # T=0, T=0.7 with top-p 0.95 and T=1, bf16 (where the CPU computes it
                                         # natively) and fp32

The prompts are read from the ``shared/`` folder beside the repository checkout (``../shared/data/eval``;
``--prompt-set train``: ``../shared/data/train``), or ``$TREESPEC_SHARED``.

Methods (same target, prompts, dtype and run; ``--methods`` picks a subset, ``--list-methods`` shows every row
with what it runs): treespec rows built as ``treespec generate`` builds them (``ts_*``; ``tsl_*`` on the
embedded GGUF in llama.cpp, ``ts_*_int4`` on the 4-bit target, ``ts_*_int8h`` on the target with an 8-bit LM head), Hugging Face transformers ``generate``
(``hf_plain``, ``hf_prompt_lookup``, ``hf_assisted`` with ``--assistant``) and llama-cpp-python on the same
Q4_K_M GGUF the embedded target is de-quantised from (``llama_*``; ``pip install -e ".[peers]"``, skipped with a
message when not installed). Each row is one entry of ``benchmarks/methods.py``'s table, and its description in
the tables is generated from that entry. Which row is ``treespec generate``'s default per dtype and temperature
is read from the CLI, named in every table, and every row is paired against it.

Fairness: for every prompt and repeat one ROUND runs every method once on that prompt: the plain
baselines first, then the other methods in a seeded shuffled order; the next repeat runs the round in
reverse order (A B ... B A: a linear drift of the machine's speed cancels). The speedup of a method on a
prompt is the baseline's summed time over the repeats divided by the method's (equal token counts:
exactly N new tokens, EOS does not stop generation and no logits are altered). Each table reports,
per method, the median over prompts and a seeded percentile-bootstrap 95% interval, against NAMED
baselines: treespec plain, HF ``generate`` and the method's own engine's plain decoding. Warm-up: every
method runs once on a warm-up prompt (8 tokens) per dtype before the first round; not measured.

Long runs resume: every round is appended to ``rounds.jsonl`` as it ends and the table is rewritten after
every prompt (prompts run round-robin over subtasks); ``python benchmarks/run.py --resume DIR`` continues the
run in DIR with its recorded arguments, only on the same machine, library versions and code, and records each
session in ``provenance.json``. Progress lines go to stderr; the table to stdout.

Writes ``provenance.json`` (commit, dirty + diff, machine and CPU flags, versions, command),
``rounds.jsonl`` (every measured run; ``rounds.jsonl.gz`` once the run is finished), ``summary.json``, ``table.md``
and ``speedup.png`` to
``benchmarks/results/speed/<date>-<commit>[-tag]/`` (or ``--out``).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import (  # noqa: E402
    SUBTASKS,
    ProvenanceError,
    add_output_args,
    cpu_info,
    finish,
    git_state,
    load_prompts,
    load_train_prompts,
    open_results,
    write_json,
)
from benchmarks.harness import (Plan, Session, check_resumable, interleave, measure_block, missing,  # noqa: E402
                                pack_rounds, read_rounds)
from benchmarks.methods import (  # noqa: E402,F401  (cli_drafter: the drafters of the treespec rows)
    EXTRA_METHODS,
    LLAMA_METHODS,
    PROTOCOL_METHODS,
    ROW,
    ROWS,
    RunOptions,
    Targets,
    build_methods,
    cli_drafter,
    describe,
    llama_available,
    ordered_rows,
    progress,
    resolve,
    variant_row,
)
from benchmarks.report import cli_default_method, write_report  # noqa: E402
from treespec.models.fast.quant import QUANTIZE_MODES  # noqa: E402

WARMUP_TEXT = "Warm-up: the quick brown fox jumps over the lazy dog."


#: the protocol's sampling blocks, (temperature, top-p or None): greedy, T=0.7 with top-p 0.95 as chat users sample
#: (issue 43), and T=1
PROTOCOL_BLOCKS = ((0.0, None), (0.7, 0.95), (1.0, None))


def sampling_block(text: str) -> tuple[float, float | None]:
    """``T`` or ``T:P`` -> (temperature, top-p or None): one ``--temperatures`` value."""
    temp, colon, top_p = text.partition(":")
    try:
        return float(temp), (float(top_p) if colon else None)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a temperature T or T:P (P the top-p), got {text!r}") from None


def block_text(block: tuple[float, float | None]) -> str:
    return f"{block[0]:g}" + ("" if block[1] is None else f":{block[1]:g}")


def build_parser() -> argparse.ArgumentParser:
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
    ap.add_argument("--temperatures", type=sampling_block, nargs="+", default=list(PROTOCOL_BLOCKS), metavar="T[:P]",
                    help="the sampling blocks: a temperature, or T:P for temperature T with the nucleus filter P "
                         "(every method alike: treespec, HF and llama.cpp); default "
                         f"{' '.join(block_text(b) for b in PROTOCOL_BLOCKS)}: greedy, as chat users sample, and T=1")
    ap.add_argument("--top-p", type=float, default=1.0,
                    help="nucleus filter of the sampled blocks given as a bare temperature (default 1.0 = off), "
                         "e.g. --temperatures 0.7 --top-p 0.95")
    ap.add_argument("--dtypes", nargs="+", default=["auto"], choices=["auto", "float32", "bfloat16"],
                    help="auto: bfloat16 where the CPU computes it natively (avx512_bf16 / amx_bf16), and float32")
    ap.add_argument("--repeats", type=int, default=2, help="rounds per prompt (even: A..B B..A)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--methods", nargs="+", default=None,
                    help=f"subset / extras (default: the protocol: {' '.join(PROTOCOL_METHODS)}; extras: "
                         f"{' '.join(EXTRA_METHODS)}); baselines ts_plain / hf_plain are always added, and "
                         "without --methods the CLI default's row of every block")
    ap.add_argument("--list-methods", action="store_true", help="print every row and what it runs, then exit")
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
                         "without_replacement int4; CONF reject:H is --max-reject H instead")
    ap.add_argument("--tag", default=None, help="suffix of the default results folder name")
    ap.add_argument("--resume", type=Path, default=None, metavar="DIR",
                    help="continue the unfinished run in DIR with its recorded settings (same machine, library "
                         "versions and code; rounds already measured are kept, the others run)")
    add_output_args(ap)
    return ap


def split_blocks(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Check ``--temperatures`` / ``--top-p`` (exit 2, one line) and split them into ``args.temperatures`` (floats)
    and ``args.top_p_by_temperature`` (``(T, top-p)`` of each sampled block)."""
    if not 0.0 < args.top_p <= 1.0:
        ap.error(f"--top-p must be in (0, 1], got {args.top_p}")
    blocks = [b if isinstance(b, tuple) else (float(b), None) for b in args.temperatures]
    temps = [t for t, _ in blocks]
    if len(set(temps)) < len(temps):
        ap.error(f"--temperatures: each temperature once (one block each), got {' '.join(map(block_text, blocks))}")
    for t, p in blocks:
        if t < 0 or t != t:
            ap.error(f"--temperatures: a temperature is >= 0, got {t:g}")
        if p is not None and not 0.0 < p <= 1.0:
            ap.error(f"--temperatures {block_text((t, p))}: top-p must be in (0, 1]")
        if t == 0 and p is not None and p < 1.0:
            ap.error(f"--temperatures {block_text((t, p))}: top-p filters sampled blocks only (T > 0)")
    args.temperatures = temps
    args.top_p_by_temperature = [[t, args.top_p if p is None else p] for t, p in blocks if t > 0]


def check_variants(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse a malformed ``--variant`` (exit 2, one line)."""
    for v in args.variant or []:
        if len(v) not in (5, 6):
            ap.error(f"--variant takes NAME DRAFT TREE CONF LAW [QUANTIZE] (5 or 6 values); got {len(v)}: {' '.join(v)}")
        if v[1] == "ngram" and v[2] != "-":
            ap.error(f"--variant {v[0]}: n-gram lookup takes its shape in its name: DRAFT ngram:{v[2]} with TREE '-'")
        check_conf(ap, v)
        if len(v) == 6 and v[5] not in ("-", "none", *QUANTIZE_MODES):
            ap.error(f"--variant {v[0]}: QUANTIZE must be '-', 'none' or one of {', '.join(QUANTIZE_MODES)} (as "
                     f"--draft-quantize); got {v[5]!r}")


def check_conf(ap: argparse.ArgumentParser, v: list[str]) -> None:
    """A ``--variant``'s CONF: '-', a confidence or ``reject:H`` (the shipped head's ``--max-reject``)."""
    reject = v[3].startswith("reject:")
    value = v[3].removeprefix("reject:")
    try:
        if (value == "-" and reject) or (value != "-" and not 0.0 <= float(value) < 1.0):
            raise ValueError
    except ValueError:
        ap.error(f"--variant {v[0]}: CONF must be '-', a confidence or reject:H, each in [0, 1); got {v[3]!r}")
    if reject and v[1] not in ("head", "lookup+head"):
        ap.error(f"--variant {v[0]}: CONF {v[3]} reads the shipped acceptance head, trained for the shipped head "
                 f"(DRAFT head or lookup+head); got DRAFT {v[1]!r}")


def resolve_dtypes(spec: list[str]) -> list[str]:
    if spec != ["auto"]:
        return spec
    return (["bfloat16"] if cpu_info()["bf16_native"] else []) + ["float32"]


def apply_quick(args: argparse.Namespace) -> None:
    if args.quick:
        args.per_subtask, args.subtasks, args.humaneval = 1, ["qa", "summarization"], 1
        args.max_new_tokens, args.temperatures, args.repeats = 32, [0.0], 1
        args.top_p_by_temperature = []  # T=0 only: no sampled block


def wanted_methods(ap: argparse.ArgumentParser, args: argparse.Namespace, dtypes: list[str]) -> tuple[set, list]:
    """The rows asked for (the plain baselines always; the protocol also the CLI default's row of every block;
    llama.cpp rows only where llama-cpp-python is usable), and the notes of rows skipped. A 4-bit draft head outside bfloat16 is refused now, not hours later."""
    unknown = sorted(set(args.methods or ()) - set(ROW))
    if unknown:  # a misspelt or retired row would otherwise be left out without a word
        ap.error(f"unknown --methods {', '.join(unknown)}: see --list-methods")
    wanted = set(args.methods or PROTOCOL_METHODS) | {"ts_plain", "hf_plain"}
    if args.methods is None:  # the protocol pairs every block with `treespec generate`'s default row
        wanted |= {cli_default_method(dtype, t) for dtype in dtypes for t in args.temperatures}
    four_bit = [v[0] for v in args.variant or [] if len(v) == 6 and v[5] not in ("-", "none")]
    four_bit += sorted(wanted & {"ts_head_int4"})
    if four_bit and any(d != "bfloat16" for d in dtypes):
        ap.error(f"{', '.join(four_bit)}: a 4-bit draft head runs in bfloat16 only; the run's dtypes are "
                 f"{', '.join(dtypes)} (give --dtypes bfloat16)")
    judged = sorted(r.name for r in ROWS if r.judge and r.name in wanted)
    if judged and any(t != 0 for t in args.temperatures):
        ap.error(f"{', '.join(judged)}: judge decoding (LOSSY) is defined at temperature 0 only; run it with "
                 f"--temperatures 0")
    skipped: list[str] = []
    if wanted & set(LLAMA_METHODS):
        reason = "--no-llama" if args.no_llama else llama_available()
        if reason:
            skipped.append(f"llama.cpp rows ({', '.join(LLAMA_METHODS)}): llama-cpp-python not usable ({reason}); "
                           "install with `pip install -e \".[peers]\"`")
            wanted -= set(LLAMA_METHODS)
        else:
            wanted.add("llama_plain")
    return wanted, skipped


def open_run(args: argparse.Namespace, argv: list[str] | None, resumed: dict | None) -> tuple[Path, dict]:
    """A new results folder, or the resumed one with this session added to its provenance."""
    if resumed is None:
        return open_results("tuning" if args.prompt_set == "train" else "speed", args.out,
                            allow_dirty=args.allow_dirty, tag=args.tag,
                            extra={"run_argv": list(sys.argv[1:] if argv is None else argv)})
    resumed.setdefault("sessions", []).append(
        {"commit": git_state()["commit"], "date_utc": time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime()),
         "command": " ".join(sys.argv)})
    write_json(args.out / "provenance.json", resumed)
    return args.out, resumed


def prompt_rows(args: argparse.Namespace) -> list[dict]:
    """The rows of ``--prompt-set`` (one clear line, exit 1, where the shared data folder is missing)."""
    return (load_train_prompts(args.per_subtask) if args.prompt_set == "train"
            else load_prompts(args.per_subtask, args.humaneval, tuple(args.subtasks)))


def prompt_set(rows: list[dict], tok) -> tuple[list[dict], dict]:
    """The run's prompts (round-robin over subtasks, tokenised) and the warm-up prompt."""
    prompts = interleave([{"id": r["id"], "subtask": r["subtask"], "text": r["prompt"],
                           "ids": tok(r["prompt"])["input_ids"]} for r in rows])
    warm = {"id": "warm-up", "subtask": "warm-up", "text": WARMUP_TEXT, "ids": tok(WARMUP_TEXT)["input_ids"]}
    return prompts, warm


def run_options(args: argparse.Namespace, n_ctx: int = 4096) -> RunOptions:
    """The settings every row reads, from the checked arguments (:func:`split_blocks` first)."""
    return RunOptions(args.runner, args.assistant, args.lookup_tokens, args.threads,
                      tuple((t, p) for t, p in args.top_p_by_temperature), n_ctx=n_ctx)


def list_methods() -> None:
    print("protocol:", *PROTOCOL_METHODS, "\nextras:", *EXTRA_METHODS)
    for row in ROWS:  # described with the default --assistant / --lookup-tokens / --runner
        print(f"  {row.name}: {describe(resolve(row, RunOptions()))}")


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    resumed = None
    if args.resume is not None:
        folder, resumed = args.resume, check_resumable(args.resume)
        if "run_argv" not in resumed:
            raise ProvenanceError(f"--resume {folder}: the run recorded no arguments (made before --resume existed)")
        args = ap.parse_args(resumed["run_argv"])  # the recorded settings, unchanged
        args.out, args.resume = folder, folder
    split_blocks(ap, args)
    check_variants(ap, args)
    if args.list_methods:
        list_methods()
        return 0
    apply_quick(args)
    dtypes = resolve_dtypes(args.dtypes)[:1] if args.quick else resolve_dtypes(args.dtypes)
    wanted, skipped = wanted_methods(ap, args, dtypes)
    for note in skipped:
        progress(f"SKIPPED: {note}")
    rows = prompt_rows(args)  # read before a results folder exists
    started = time.time()
    out, prov = open_run(args, argv, resumed)
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    from treespec.calibration import measure_weight_stream
    from treespec.models.loading import load_model, load_tokenizer

    tok = load_tokenizer("embedded")
    prompts, warm = prompt_set(rows, tok)
    options = run_options(args, n_ctx=max(len(p["ids"]) for p in prompts) + args.max_new_tokens + 64)
    settings = {**{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}, "dtypes": dtypes,
                "prompts": len(prompts), "prompt_ids": [p["id"] for p in prompts], "warmup_tokens": 8,
                "methods_run": sorted(wanted)}
    plan = Plan(tuple(args.temperatures), args.repeats, args.max_new_tokens, args.seed)
    runs = read_rounds(out / "rounds.jsonl")  # a resumed run keeps what it measured
    session = Session(out, runs, {(r["dtype"], r["temperature"], r["prompt_id"], r["repeat"]) for r in runs},
                      {"provenance": prov, "settings": settings, "skipped": skipped, "methods": {}},
                      (out / "rounds.jsonl").open("a"), len(dtypes) * len(plan.temperatures) * len(prompts) * plan.repeats)
    method_rows = ordered_rows(wanted, [variant_row(v) for v in args.variant or []], args.runner)
    for dtype in dtypes:
        if not missing(session, dtype, plan, prompts):
            continue
        progress(f"loading the embedded target ({dtype})")
        model = load_model("embedded", dtype=dtype)
        methods = build_methods(method_rows, Targets(model, tok, dtype, options))
        session.meta["methods"].update({m.name: m.describe for m in methods})
        measure_block(session, dtype, methods, prompts, warm, plan, lambda: measure_weight_stream(model, repeats=1))
        del model, methods
    session.log.close()
    write_report(out, session.runs, session.meta, args.seed, session.total_rounds)
    if session.meta["rounds"]["done"] == session.total_rounds:
        finish(out, started)
        pack_rounds(out)
    else:
        print(f"PARTIAL: {session.meta['rounds']['done']} of {session.total_rounds} rounds measured; continue with "
              f"`python benchmarks/run.py --resume {out}`", flush=True)
    print((out / "table.md").read_text())
    print(f"results in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
