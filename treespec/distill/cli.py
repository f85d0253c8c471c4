"""``python -m treespec.distill build-corpus | train | medusa | kangaroo | evaluate | export | acceptance | judge``
(on the embedded Gemma-3-270M or any Hugging Face causal LM).

Everything it writes goes under ``~/.cache/treespec/distill/`` (``$TREESPEC_CACHE``) unless told
otherwise: corpora in ``corpus/<name>``, runs (checkpoints, ``head.safetensors``) in ``runs/<name>``.
Every command resumes: re-run the same command after an interruption.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

from ..files import atomic_write_json, recorded_path
from .corpus import DEFAULT_EVAL, DEFAULT_TRAIN
from .inputs import DistillInputError, read_head_file


def _root():
    from .train import distill_root

    return distill_root()


def _tokenize(tokenizer, rows: list[dict], max_len: int) -> list[list[int]]:
    seqs = []
    for r in rows:
        ids = tokenizer(r["prompt"])["input_ids"]
        seqs.append(ids[:max_len])
    return seqs


def _config_arguments(parser: argparse.ArgumentParser, defaults) -> None:
    """One ``--field-name`` option per field of a config dataclass (``time_limit_s`` is ``--time-limit``;
    a bool field is ``--field-name`` / ``--no-field-name``)."""
    for field, default in defaults.__dict__.items():
        if field == "time_limit_s":
            continue
        if isinstance(default, bool):
            parser.add_argument("--" + field.replace("_", "-"), action=argparse.BooleanOptionalAction, default=default)
            continue
        kind = _int_list if isinstance(default, tuple) or field == "max_shards" else \
            type(default) if default is not None else int
        parser.add_argument("--" + field.replace("_", "-"), type=kind, default=default)


def _int_list(text: str) -> tuple[int, ...]:
    """``"2,9"`` -> ``(2, 9)`` (empty text: ``()``); argparse reports a bad value by the option's name."""
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _common_arguments(p: argparse.ArgumentParser) -> None:
    """The target and machine options every command that loads the target takes."""
    p.add_argument("--target", default="embedded", help="target model ('embedded' = Gemma-3-270M, or HF path)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="target dtype (auto: bf16 only where the CPU computes it natively)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads (1 on a shared 2-core machine: 2 threads under contention "
                        "were measured ~100x slower on small element-wise ops)")
    p.add_argument("--no-progress", action="store_true")


def _add_build_corpus(sub) -> None:
    b = sub.add_parser("build-corpus", help="teacher-forced target forwards on train prompts -> shards")
    _common_arguments(b)
    b.add_argument("--prompts", default=DEFAULT_TRAIN, help="train prompts jsonl (never the eval set)")
    b.add_argument("--name", default="train", help="corpus name (directory under the cache) ...")
    b.add_argument("--out", default=None, help="... or an explicit directory")
    b.add_argument("--max-prompts", type=int, default=None)
    b.add_argument("--max-len", type=int, default=512, help="prompt tokens kept (BOS included)")
    b.add_argument("--topk", type=int, default=32, help="top-k soft labels stored (0: none, ~2x faster)")
    b.add_argument("--feature-layers", type=_int_list, default=(),
                   help="also store these decoder layers' outputs, e.g. 2,9 (for heads with fused features)")
    b.add_argument("--shard-positions", type=int, default=50_000)
    b.add_argument("--batch-size", type=int, default=1)
    b.add_argument("--continuation", choices=["none", "greedy", "sample"], default="none",
                   help="append the target's own continuation (greedy or T=1) to each prompt")
    b.add_argument("--new-tokens", type=int, default=64)
    b.add_argument("--continuations", default=None,
                   help="teacher-force stored continuations (a folder of python -m treespec.distill.continuations), "
                        "one shard per finished chunk; run again to add chunks finished since")
    b.add_argument("--rows", default=None,
                   help="with --continuations: START:END of the seeded prompt order they were generated from "
                        "(default: what the folder's manifest records)")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--time-limit", type=float, default=None, help="minutes; stops after a finished shard")


def _add_train(sub) -> None:
    t = sub.add_parser("train", help="train (or resume) a head on a corpus")
    _common_arguments(t)
    t.add_argument("--corpus", default="train", help="corpus name under the cache, or a directory; several: comma-separated")
    t.add_argument("--run", default="gemma3-270m-head", help="run name (checkpoints under the cache) ...")
    t.add_argument("--run-dir", default=None, help="... or an explicit directory")
    t.add_argument("--init-head", default=None, help="start a new run from these head weights")
    t.add_argument("--vocab-prompts", default=None,
                   help="also count tokens of this train prompts jsonl when choosing a new run's vocabulary subset")
    t.add_argument("--export", default=None, help="also copy the final head here (e.g. fp16 for shipping)")
    t.add_argument("--export-dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    t.add_argument("--device", default=None)
    t.add_argument("--time-limit", type=float, default=None, help="minutes")
    from .train import TrainConfig

    _config_arguments(t, TrainConfig())


def _add_evaluate(sub) -> None:
    e = sub.add_parser("evaluate", help="agreement / acceptance / cost on held-out Spec-Bench prompts")
    _common_arguments(e)
    e.add_argument("--head", default=None, help="head .safetensors (default: the run's head.safetensors)")
    e.add_argument("--run", default="gemma3-270m-head")
    e.add_argument("--prompts", default=DEFAULT_EVAL)
    e.add_argument("--held-out-train", action="store_true",
                   help="measure on held-out train rows instead (rows 11000: of the corpora's seeded order, which "
                        "no corpus reads), to tell the train distribution from Spec-Bench's")
    e.add_argument("--num-prompts", type=int, default=24)
    e.add_argument("--max-prompt-len", type=int, default=512)
    e.add_argument("--new-tokens", type=int, default=64)
    e.add_argument("--depths", type=int, default=6, help="tree depths measured along the text (1 = first level)")
    e.add_argument("--tau", action="store_true", help="also tau of a chain of 4 in the engine (T=0, T=1)")
    e.add_argument("--quantize", choices=["none", "int4"], default="none",
                   help="measure the head on 4-bit weights (SubsetHead.for_inference(dtype, 'int4'), CPU): every "
                        "metric, tau and the step cost then describe that head")
    e.add_argument("--tau-prompts", type=int, default=8)
    e.add_argument("--json", default=None, help="write the metrics here too")


def _add_medusa(sub) -> None:
    m = sub.add_parser("medusa", help="train (or resume) Medusa-style decoding heads on corpora")
    _common_arguments(m)
    m.add_argument("--corpus", default="train", help="corpus names or directories, comma-separated")
    m.add_argument("--corpus-weights", default=None, help="comma-separated sampling weight per corpus")
    m.add_argument("--run", default="gemma3-270m-medusa", help="run name (checkpoints under the cache) ...")
    m.add_argument("--run-dir", default=None, help="... or an explicit directory")
    m.add_argument("--vocab-from", default=None,
                   help="take the vocabulary subset of this EAGLE head file (default: the corpus's most frequent)")
    m.add_argument("--export", default=None, help="write the trained heads here (fp16)")
    m.add_argument("--evaluate", default=None, help="corpus to report per-head agreement on (held out)")
    m.add_argument("--time-limit", type=float, default=None, help="minutes")
    from .medusa import MedusaTrainConfig

    _config_arguments(m, MedusaTrainConfig())


def _add_kangaroo(sub) -> None:
    k = sub.add_parser("kangaroo", help="train (or resume) Kangaroo's adapter on corpora that store the exit layer")
    _common_arguments(k)
    k.add_argument("--corpus", default="train", help="corpus names or directories, comma-separated; each must store "
                   "the target layer exit_layers - 1 (build-corpus --feature-layers)")
    k.add_argument("--run", default="gemma3-270m-kangaroo", help="run name (checkpoints under the cache) ...")
    k.add_argument("--run-dir", default=None, help="... or an explicit directory")
    k.add_argument("--vocab-from", default=None,
                   help="take the vocabulary subset of this head file (default: the shipped EAGLE head's)")
    k.add_argument("--export", default=None, help="write the trained adapter here (.safetensors, fp16)")
    k.add_argument("--device", default=None, help="where to train (default: the CPU)")
    k.add_argument("--no-train", action="store_true",
                   help="train nothing: write the run's newest checkpoint with --export (an unfinished run's too)")
    k.add_argument("--time-limit", type=float, default=None, help="minutes")
    from .kangaroo import AdapterTrainConfig

    _config_arguments(k, AdapterTrainConfig())


def _add_export(sub) -> None:
    x = sub.add_parser("export", help="write a run's newest checkpoint as a head file (training may go on)")
    x.add_argument("--run", default="gemma3-270m-head", help="run name (checkpoints under the cache) ...")
    x.add_argument("--run-dir", default=None, help="... or an explicit directory")
    x.add_argument("--out", required=True, help="head .safetensors to write (atomically), or the checkpoint folder "
                   "with --format speculators")
    x.add_argument("--dtype", default=None, choices=["float16", "bfloat16", "float32"],
                   help="default float16 (treespec), bfloat16 (speculators)")
    x.add_argument("--threads", type=int, default=1)
    x.add_argument("--format", default="treespec", choices=["treespec", "speculators"],
                   help="speculators: an EAGLE-3 head (--layout eagle3) as vLLM / SGLang / speculators load it")
    x.add_argument("--target", default="embedded",
                   help="with --format speculators: the target the run trained on (its LM-head rows and embedding "
                        "are written)")
    x.add_argument("--verifier", default=None,
                   help="with --format speculators (required): the model the serving engine verifies with, a hub id "
                        "or path, written into config.json")
    x.add_argument("--no-embed", action="store_true",
                   help="with --format speculators: leave out the embedding table (engines that share the target's)")


def _stored_rows_arguments(p: argparse.ArgumentParser, folder: str, out: str, after_chunks=None,
                           after_held_out=None) -> None:
    """The options of a head trained on rows collected from stored continuations (``acceptance``, ``judge``);
    ``after_chunks`` / ``after_held_out``: a command's own options, added at those places of its help."""
    _common_arguments(p)
    p.add_argument("--continuations", required=True, help=f"{folder} (build_continuations)")
    p.add_argument("--rows", default=None, help="its prompt rows START:END (default: as its manifest records)")
    p.add_argument("--prompts", default=DEFAULT_TRAIN, help="the train prompts jsonl the continuations came from")
    p.add_argument("--chunks", default=None, help="the chunks to read, FIRST:END (default: every finished one)")
    if after_chunks is not None:
        after_chunks(p)
    p.add_argument("--out", required=True, help=f"{out} .safetensors to write (atomically)")
    p.add_argument("--held-out", type=float, default=0.1, help="share of sequences kept out of training, scored")
    if after_held_out is not None:
        after_held_out(p)
    p.add_argument("--json", default=None, help="write the scores and settings here too")
    p.add_argument("--rows-cache", default=None,
                   help="keep the collected rows in this file and reuse them when the same settings ask again")


def _add_acceptance(sub) -> None:
    a = sub.add_parser("acceptance", help="train SpecDec++'s acceptance head for a draft head on stored continuations")
    _stored_rows_arguments(
        a, "a continuation folder", "acceptance head",
        after_chunks=lambda p: p.add_argument(
            "--head", default=None, help="the draft head .safetensors, EAGLE or EAGLE-3 (default: the shipped head)"),
        after_held_out=lambda p: p.add_argument(
            "--validation", type=float, default=0.1,
            help="share of the training sequences that choose the epoch (0: the last epoch)"))
    from .acceptance import AcceptanceRowsOptions, AcceptanceTrainOptions

    _config_arguments(a, AcceptanceRowsOptions())
    for field, default in AcceptanceTrainOptions().__dict__.items():
        if field not in ("seed", "validation"):
            a.add_argument("--" + field.replace("_", "-"), type=type(default), default=default)


def _add_judge(sub) -> None:
    j = sub.add_parser("judge", help="train judge decoding's judge (LOSSY decoding) on stored greedy continuations")
    _stored_rows_arguments(j, "a greedy continuation folder", "judge head")
    from .judge import JudgeRowsOptions, JudgeTrainOptions

    _config_arguments(j, JudgeRowsOptions())
    for field, default in JudgeTrainOptions().__dict__.items():
        if field != "seed":
            j.add_argument("--" + field.replace("_", "-"), type=type(default), default=default)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m treespec.distill", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    for add in (_add_build_corpus, _add_train, _add_evaluate, _add_medusa, _add_kangaroo, _add_export,
                _add_acceptance, _add_judge):
        add(sub)
    return ap


def _corpus_dir(name_or_dir: str) -> Path:
    p = Path(name_or_dir)
    return p if (p / "manifest.json").exists() or p.is_absolute() or "/" in name_or_dir else _root() / "corpus" / name_or_dir


def _training_setup(args, config_cls, load_model):
    """(config from the options, target, run directory, corpus directories) of a training command."""
    from .corpus import load_manifest

    fields = {k: getattr(args, k) for k in config_cls().__dict__ if k != "time_limit_s"}
    cfg = config_cls(**fields, time_limit_s=None if args.time_limit is None else args.time_limit * 60)
    corpora = [_corpus_dir(c) for c in args.corpus.split(",")]
    for c in corpora:
        load_manifest(c)  # a missing corpus is reported before the target is loaded
    model = load_model(args.target, dtype=args.dtype)
    run_dir = Path(args.run_dir) if args.run_dir else _root() / "runs" / args.run
    return cfg, model, run_dir, corpora


def _check_numbers(args) -> None:
    """Options that argparse types cannot bound: a bad value is a :class:`DistillInputError`."""
    lows = {"threads": 1, "max_prompts": 1, "max_len": 2, "num_prompts": 1, "max_prompt_len": 1,
            "new_tokens": 1, "tau_prompts": 1, "depths": 1, "positions": 1, "draws": 1, "width": 1, "epochs": 1,
            "batch": 1, "alternatives": 1, "resync": 1, "max_tokens": 2, "far": 0}
    for name, low in lows.items():
        value = getattr(args, name, None)
        if value is not None and value < low:
            raise DistillInputError(f"--{name.replace('_', '-')} must be >= {low}, got {value}")
    for name in ("lr", "weight_decay"):
        value = getattr(args, name, None)
        if value is not None and not (math.isfinite(value) and value >= 0 and (value > 0 or name != "lr")):
            raise DistillInputError(f"--{name.replace('_', '-')} must be a finite number "
                                    f"{'> 0' if name == 'lr' else '>= 0'}, got {value}")
    for name in ("held_out", "validation"):
        share = getattr(args, name, None)
        if share is not None and not 0.0 <= share < 1.0:
            raise DistillInputError(f"--{name.replace('_', '-')} must be in [0, 1), got {share}")
    precision = getattr(args, "precision", None)
    if precision is not None and not 0.0 < precision <= 1.0:
        raise DistillInputError(f"--precision must be in (0, 1], got {precision}")
    limit = getattr(args, "time_limit", None)
    if limit is not None and not limit > 0:
        raise DistillInputError(f"--time-limit must be > 0 minutes, got {limit}")


def _check_target(args) -> None:
    """A ``--target`` written as a local path (``/``, ``.``, ``~``) must be an existing directory; anything
    else is ``embedded`` or a hub id, left to the loader."""
    target = getattr(args, "target", "embedded")
    if target != "embedded" and target.startswith(("/", ".", "~")) and not Path(target).expanduser().is_dir():
        raise DistillInputError(f"--target {target}: no such model directory")


def _continuation_prompts(folder: Path, rows: str | None, prompts: str, tokenizer) -> list[list[int]]:
    """The token ids of every prompt a continuation folder was generated from: rows ``rows`` (``START:END``; None:
    as its manifest records) of the seeded order of ``prompts``, cut as the recipe cut them, by the reader."""
    from .continuations import MANIFEST, load_continuation_manifest
    from .corpus import read_prompts

    mpath = folder / MANIFEST
    if not mpath.is_file():
        raise DistillInputError(f"--continuations {folder}: no continuation manifest ({MANIFEST}) there")
    source = load_continuation_manifest(folder).get("source", {})
    if not isinstance(source, dict):
        raise DistillInputError(f"--continuations {folder}: its manifest's 'source' must be a JSON object")
    rows_arg = rows or source.get("rows")
    if rows_arg is None:
        raise DistillInputError(f"--continuations {folder}: its manifest does not record the prompt rows; "
                                "pass --rows START:END as given to the recipe")
    lo, hi = _span(rows_arg, "--rows")
    try:
        seed = int(source.get("order_seed", 0))
    except (TypeError, ValueError):
        raise DistillInputError(f"--continuations {folder}: its manifest's order_seed is not an integer") from None
    return [tokenizer(r["prompt"])["input_ids"] for r in read_prompts(prompts, seed=seed)[lo:hi]]


def _build_from_continuations(args, opts, load_model, load_tokenizer) -> None:
    """``build-corpus --continuations DIR``: stage 2 of a corpus (see ``build_corpus_from_continuations``)."""
    from .continuations import build_corpus_from_continuations, continuation_sequences

    if args.continuation != "none" or args.max_prompts is not None:
        raise DistillInputError("--continuations takes its prompts and continuations from the folder: "
                                "drop --continuation / --max-prompts")
    folder = Path(args.continuations)
    tok = load_tokenizer(args.target)
    prompt_ids = _continuation_prompts(folder, args.rows, args.prompts, tok)
    try:
        continuation_sequences(folder, prompt_ids)  # other prompts are refused before the target is loaded
    except ValueError as err:
        raise DistillInputError(str(err)) from None
    model = load_model(args.target, dtype=args.dtype)
    out = Path(args.out) if args.out else _root() / "corpus" / args.name
    try:
        man = build_corpus_from_continuations(model, prompt_ids, folder, out, opts, progress=not args.no_progress,
                                              time_limit_s=None if args.time_limit is None else args.time_limit * 60)
    except ValueError as err:
        raise DistillInputError(str(err)) from None
    print(json.dumps({"corpus": str(out), "positions": man["positions"], "shards": len(man["shards"]),
                      "sequences": man["sequences_done"], "complete": man["complete"],
                      "positions_per_s": man["positions"] / max(man["seconds"], 1e-9)}, indent=1))


def main(argv: list[str] | None = None) -> None:
    """Run one distill command; bad input ends it with one line on stderr and exit status 2.

    Expected failures are the library's named errors (:class:`DistillInputError`, the cache's
    ``CacheError``, ``NonFiniteLogitsError``: all ``ValueError``) and ``OSError`` (missing or unreadable
    files, a folder that holds no model, read-only output folders)."""
    args = build_parser().parse_args(argv)
    try:
        _check_numbers(args)
        _check_target(args)
        _run(args)
    except DistillInputError as err:
        print(f"python -m treespec.distill {args.command}: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    except (ValueError, OSError) as err:
        message = str(err).splitlines()[0] if str(err) else ""
        print(f"python -m treespec.distill {args.command}: error: {type(err).__name__}: {message}", file=sys.stderr)
        raise SystemExit(2) from None


def _run(args) -> None:
    torch.set_num_threads(args.threads)
    {"build-corpus": _build_corpus, "export": _export, "medusa": _medusa, "kangaroo": _kangaroo, "train": _train,
     "evaluate": _evaluate, "acceptance": _acceptance, "judge": _judge}[args.command](args)


def _build_corpus(args) -> None:
    """``build-corpus``: teacher-forced target forwards on train prompts (or stored continuations) -> shards."""
    from ..models.loading import load_model, load_tokenizer
    from .corpus import CorpusOptions, build_corpus, check_not_eval, order_for_batching, read_prompts

    check_not_eval(args.prompts)
    opts = CorpusOptions(topk=args.topk, shard_positions=args.shard_positions, batch_size=args.batch_size,
                         continuation=args.continuation, new_tokens=args.new_tokens, seed=args.seed,
                         feature_layers=args.feature_layers)
    if args.continuations:
        _build_from_continuations(args, opts, load_model, load_tokenizer)
        return
    rows = read_prompts(args.prompts, limit=args.max_prompts, seed=args.seed)
    tok = load_tokenizer(args.target)
    seqs = order_for_batching(_tokenize(tok, rows, args.max_len)) if args.batch_size > 1 else \
        _tokenize(tok, rows, args.max_len)
    model = load_model(args.target, dtype=args.dtype)
    out = Path(args.out) if args.out else _root() / "corpus" / args.name
    man = build_corpus(model, seqs, out, opts, progress=not args.no_progress,
                       time_limit_s=None if args.time_limit is None else args.time_limit * 60)
    print(json.dumps({"corpus": str(out), "positions": man["positions"], "sequences": man["sequences_done"],
                      "of": man["num_input_sequences"], "complete": man["complete"],
                      "positions_per_s": man["positions"] / max(man["seconds"], 1e-9)}, indent=1))


def _export(args) -> None:
    """``export``: the newest checkpoint of a run as a head file, or as a ``speculators`` EAGLE-3 checkpoint."""
    from .train import export_checkpoint, export_speculators

    run_dir = Path(args.run_dir) if args.run_dir else _root() / "runs" / args.run
    if args.format == "treespec":
        extra = [name for name, on in (("--verifier", args.verifier), ("--no-embed", args.no_embed),
                                       ("--target", args.target != "embedded")) if on]
        if extra:
            raise DistillInputError(f"{', '.join(extra)}: only with --format speculators")
        print(json.dumps(export_checkpoint(run_dir, args.out, getattr(torch, args.dtype or "float16")), indent=1))
        return
    if not args.verifier:
        raise DistillInputError("--format speculators needs --verifier: the model the serving engine verifies with "
                                "(hub id or path)")
    print(json.dumps(export_speculators(run_dir, args.out, lambda: _load_target(args.target),
                                        dtype=getattr(torch, args.dtype or "bfloat16"), verifier=args.verifier,
                                        embed=not args.no_embed), indent=1))


def _load_target(name: str):
    """The target a command needs, in float32 (one line on stderr while it loads)."""
    from ..models.loading import load_model

    print(f"loading target {name} ...", file=sys.stderr, flush=True)
    return load_model(name, dtype="float32")


def _corpus_weights(text: str | None) -> list[float] | None:
    """``--corpus-weights``: comma-separated numbers >= 0, not all 0 (None: unweighted)."""
    try:
        weights = [float(w) for w in text.split(",")] if text else None
    except ValueError:
        raise DistillInputError(f"--corpus-weights {text!r}: expected comma-separated numbers") from None
    if weights is not None and not all(w >= 0 for w in weights) or weights is not None and not sum(weights) > 0:
        raise DistillInputError(f"--corpus-weights {text!r}: need weights >= 0, not all 0")
    return weights


def _medusa(args) -> None:
    """``medusa``: train (or resume) Medusa-style decoding heads, optionally report and export them."""
    from ..models.loading import load_model
    from .medusa import MedusaTrainConfig, evaluate_medusa, train_medusa

    weights = _corpus_weights(args.corpus_weights)
    vocab = None
    if args.vocab_from:
        from ..drafting.head_files import head_class_of

        vocab = read_head_file(args.vocab_from, head_class_of(args.vocab_from).load).vocab_ids
    cfg, model, run_dir, corpora = _training_setup(args, MedusaTrainConfig, load_model)
    heads, summary = train_medusa(model, corpora, run_dir, cfg, corpus_weights=weights, vocab_ids=vocab,
                                  progress=not args.no_progress)
    if args.evaluate:
        summary["evaluation"] = {"corpus": recorded_path(_corpus_dir(args.evaluate)),
                                 **evaluate_medusa(heads, _corpus_dir(args.evaluate))}
    if args.export:
        heads.save(args.export, dtype=torch.float16, extra={"summary": summary})
    print(json.dumps({"run_dir": str(run_dir), **summary}, indent=1))


#: the vocabulary subset of a new adapter for a target other than the embedded one (the shipped head's size)
SUBSET_SIZE = 16384


def _kangaroo(args) -> None:
    """``kangaroo``: train (or resume) Kangaroo's adapter, optionally export it."""
    from ..drafting.head_files import head_class_of
    from ..models.loading import load_model
    from .kangaroo import AdapterTrainConfig, train_adapter

    vocab = None
    if args.vocab_from:
        vocab = read_head_file(args.vocab_from, head_class_of(args.vocab_from).load).vocab_ids
    elif args.target == "embedded":
        from ..drafting.head import EagleHead
        from ..drafting.shipped import DEFAULT_HEAD

        vocab = EagleHead.load(DEFAULT_HEAD).vocab_ids
    cfg, model, run_dir, corpora = _training_setup(args, AdapterTrainConfig, load_model)
    if args.no_train:
        from dataclasses import replace

        from .kangaroo import CKPT_NAME

        if not (run_dir / CKPT_NAME).is_file():
            raise DistillInputError(f"--no-train: {run_dir} holds no Kangaroo adapter run to export")
        cfg = replace(cfg, time_limit_s=0.0)
    if args.device:
        model = model.to(args.device)
    if vocab is None:  # another target: its corpora's most frequent tokens, as many as the shipped head scores
        from .train import choose_vocab

        vocab = choose_vocab(corpora, min(SUBSET_SIZE, model.get_output_embeddings().weight.shape[0]))
    adapter, summary = train_adapter(model, corpora, run_dir, vocab, cfg, progress=not args.no_progress)
    if args.export:
        adapter.save(args.export, dtype=torch.float16, extra={"summary": summary})
    print(json.dumps({"run_dir": str(run_dir), **summary}, indent=1))


def _train(args) -> None:
    """``train``: train (or resume) an EAGLE-style head on corpora, optionally export it."""
    from ..models.loading import load_model, load_tokenizer
    from .train import TrainConfig, train

    cfg, model, run_dir, corpora = _training_setup(args, TrainConfig, load_model)
    vocab_counts = None
    if args.vocab_prompts:
        from .corpus import check_not_eval, read_prompts

        check_not_eval(args.vocab_prompts)
        tok = load_tokenizer(args.target)
        ids = [t for s in _tokenize(tok, read_prompts(args.vocab_prompts), 10**9) for t in s]
        vocab_counts = torch.bincount(torch.tensor(ids), minlength=model.get_output_embeddings().weight.shape[0])
    head, summary = train(model, corpora if len(corpora) > 1 else corpora[0], run_dir, cfg, init_head=args.init_head,
                          progress=not args.no_progress, device=args.device, vocab_counts=vocab_counts)
    if args.export:
        head.save(args.export, dtype=getattr(torch, args.export_dtype), extra={"summary": summary})
    print(json.dumps({"run_dir": str(run_dir), **summary}, indent=1))


def _evaluation_rows(args) -> list[dict]:
    """The prompt rows ``evaluate`` measures on: the seeded choice of ``--prompts`` or held-out train rows."""
    import random

    from .corpus import HELD_OUT_FROM, read_prompts, shared_dir

    if args.held_out_train:  # a seeded choice among the rows no corpus reads (HELD_OUT_FROM onwards)
        rows = read_prompts(shared_dir() / "data" / "train" / "train_prompts.jsonl", seed=0)[HELD_OUT_FROM:]
        random.Random(1234).shuffle(rows)
        return rows[: args.num_prompts]
    return read_prompts(args.prompts, limit=args.num_prompts, seed=1234)


def _attach_for_evaluation(head, model, path: str, quantize: str) -> int:
    """Attach ``head`` to ``model`` (4-bit weights with ``quantize="int4"``); returns its trained parameters."""
    try:
        head.attach(model)
    except ValueError as err:
        raise DistillInputError(f"head file {path}: {err}") from None
    trained_parameters = head.num_trained_parameters  # (4-bit layers hold no parameters)
    if quantize != "none":  # the head as it drafts on 4-bit weights, for every measurement below
        try:
            head.for_inference(next(model.parameters()).dtype, quantize=quantize)
        except ValueError as err:
            raise DistillInputError(f"--quantize {quantize}: {err} (use --dtype bfloat16)") from None
    return trained_parameters


def _evaluation_result(args, path: str, head, model, prompts: list[list[int]], groups: list[str],
                       m0: dict, m1: dict, trained_parameters: int) -> dict:
    """The teacher-forced metrics of ``evaluate`` (``m0`` along greedy text, ``m1`` along sampled text)."""
    return {"head": path, "prompt_set": "held-out train rows" if args.held_out_train else str(args.prompts),
            "prompts": len(prompts), "new_tokens": args.new_tokens, "positions_T0": m0["positions"],
            "top1_agreement_T0": m0["top1_agreement"], "positions_T1": m1["positions"],
            "sum_min_pq_T1": m1["sum_min_pq"], "top1_agreement_T0_by_depth": m0["top1_agreement_by_depth"],
            "sum_min_pq_T1_by_depth": m1["sum_min_pq_by_depth"], "sum_min_pq_T0_by_depth": m0["sum_min_pq_by_depth"],
            "positions_T0_by_depth": m0["positions_by_depth"], "trained_parameters": trained_parameters,
            "vocab_subset": int(head.vocab_ids.numel()),
            "threads": args.threads, "dtype": str(next(model.parameters()).dtype),
            "by_group": {g: {"prompts": groups.count(g),
                             "top1_agreement_T0_by_depth": m0["by_group"][g]["top1_agreement_by_depth"],
                             "positions_T0": m0["by_group"][g]["positions"],
                             "sum_min_pq_T1_by_depth": m1["by_group"][g]["sum_min_pq_by_depth"],
                             "positions_T1": m1["by_group"][g]["positions"]}
                         for g in sorted(set(m0["by_group"]) & set(m1["by_group"]))}}


def _evaluate(args) -> None:
    """``evaluate``: agreement and acceptance along the target's own text, tau and step cost in the engine
    (:mod:`treespec.analysis.acceptance`)."""
    from ..analysis.acceptance import chain_tau, step_cost, target_generations
    from ..drafting.head_files import head_class_of
    from ..models.loading import load_model, load_tokenizer
    from .evaluate import depth_metrics

    path = args.head or str(_root() / "runs" / args.run / "head.safetensors")
    head = read_head_file(path, head_class_of(path).load)  # bad files are reported before the target is loaded
    rows = _evaluation_rows(args)
    groups = [str(r.get("subtask") or r.get("category") or "all") for r in rows]  # Spec-Bench / train label
    model = load_model(args.target, dtype=args.dtype)
    tok = load_tokenizer(args.target)
    trained_parameters = _attach_for_evaluation(head, model, path, args.quantize)
    prompts = [p[-args.max_prompt_len:] if len(p) > args.max_prompt_len else p
               for p in _tokenize(tok, rows, 10**9)]
    cache = _root() / "eval-cache"
    greedy = target_generations(model, prompts, args.new_tokens, 0.0, cache=cache,
                                progress=not args.no_progress)
    sampled = target_generations(model, prompts, args.new_tokens, 1.0, cache=cache,
                                 progress=not args.no_progress)
    m0 = depth_metrics(model, head, prompts, greedy, args.depths, groups)
    m1 = depth_metrics(model, head, prompts, sampled, args.depths, groups)
    result = _evaluation_result(args, path, head, model, prompts, groups, m0, m1, trained_parameters)
    if args.tau:
        tp = prompts[: args.tau_prompts]
        result["tau_chain4_T0"] = chain_tau(model, head, tp, 4, 0.0, args.new_tokens)
        result["tau_chain4_T1"] = chain_tau(model, head, tp, 4, 1.0, args.new_tokens)
    # last: the head is timed as the CLI drafts with it (bf16 and packed where the CPU computes bf16
    # natively), which leaves it for inference only
    result["quantize"] = args.quantize
    result["step_cost"] = step_cost(model, head if args.quantize != "none"
                                    else head.for_inference(next(model.parameters()).dtype))
    print(json.dumps(result, indent=1))
    if args.json:
        atomic_write_json(args.json, result)


def _span(text: str | None, flag: str) -> tuple[int, int | None]:
    """``START:END`` (either side may be empty) as integers."""
    if text is None:
        return 0, None
    try:
        start, _, end = text.partition(":")
        return int(start or 0), (int(end) if end else None)
    except ValueError:
        raise DistillInputError(f"{flag} {text!r}: expected START:END") from None


def _stored_sequences(args, folder: Path, tokenizer, mode: str | None = None, why: str = ""):
    """``(stored, chunks, sequences)`` of ``--continuations``, ``--rows``, ``--prompts`` and ``--chunks``: the
    folder's continuations, the finished chunks asked for and their ``(ids, gen_start)`` pairs; with ``mode`` the
    folder must hold continuations of that mode (``why``: the reason, in the refusal). Refusals are
    :class:`DistillInputError` lines."""
    from .continuations import continuation_sequences, load_continuation_manifest

    prompt_ids = _continuation_prompts(folder, args.rows, args.prompts, tokenizer)  # no manifest: refused
    options = load_continuation_manifest(folder).get("options")
    found = options.get("mode") if isinstance(options, dict) else None
    if mode is not None and found != mode:
        raise DistillInputError(f"--continuations {folder}: {why} need the target's {mode} text; this folder's "
                                f"continuations are {found!r}")
    try:
        stored = continuation_sequences(folder, prompt_ids)
    except ValueError as err:
        raise DistillInputError(str(err)) from None
    first, end = _span(args.chunks, "--chunks")
    chunks = [c for c in stored.chunks if c >= first and (end is None or c < end)]
    if not chunks:
        raise DistillInputError(f"--chunks {args.chunks}: no finished chunk of {folder} in that range")
    return stored, chunks, [pair for c in chunks for pair in zip(*stored.chunk(c))]


def _acceptance(args) -> None:
    """``acceptance``: SpecDec++'s acceptance head for a draft head, from stored continuations."""
    from ..drafting.shipped import DEFAULT_HEAD
    from ..files import file_sha256
    from ..models.loading import load_model, load_tokenizer
    from .acceptance import (AcceptanceRowsOptions, AcceptanceTrainOptions, collect_rows, load_rows, save_rows,
                             score, split_rows, train_acceptance_head)

    folder = Path(args.continuations)
    stored, chunks, sequences = _stored_sequences(args, folder, load_tokenizer(args.target))
    head_path = Path(args.head) if args.head else DEFAULT_HEAD
    from ..drafting.head import LayerHead
    from ..drafting.head_files import head_class_of, load_layer_head, not_a_layer_head
    from .inputs import require_file

    kind = head_class_of(require_file(head_path, "head file"))  # a missing file or an adapter: refused before the
    if not issubclass(kind, LayerHead):  # target loads
        raise DistillInputError(f"head file {head_path}: {not_a_layer_head(kind, 'distill acceptance')}")
    model = load_model(args.target, dtype=args.dtype)
    head = read_head_file(head_path, load_layer_head, model, what="distill acceptance").eval()
    rows_opts = AcceptanceRowsOptions(args.depths, args.positions, args.draws, args.seed)
    key = {"format": 1, "target": str(args.target), "head_sha256": file_sha256(head_path),
           "fingerprint": stored.fingerprint, "chunks": chunks, "row_options": rows_opts.__dict__,
           "dtype": str(model.dtype)}
    all_rows = load_rows(args.rows_cache, key) if args.rows_cache else None
    if all_rows is None:
        all_rows = collect_rows(model, head, sequences, rows_opts, progress=not args.no_progress)
        if args.rows_cache:
            save_rows(all_rows, args.rows_cache, key)
    train_rows, held = split_rows(all_rows, args.held_out, args.seed)
    train_opts = AcceptanceTrainOptions(args.width, args.epochs, args.batch, args.lr, args.weight_decay,
                                        args.validation, args.seed)
    stop_head = train_acceptance_head(train_rows, head.cfg.hidden_size, train_opts)
    record = {"head": str(head_path.name), "head_sha256": key["head_sha256"],
              "continuations": recorded_path(folder), "chunks": chunks, "sequences": len(sequences),
              "rows": train_rows.sizes, "held_out_rows": held.sizes,
              "row_options": rows_opts.__dict__, "train_options": train_opts.__dict__, "best_epochs": stop_head.epochs,
              "held_out_scores": score(stop_head, held), "train_scores": score(stop_head, train_rows)}
    stop_head.save(args.out, extra=record)
    if args.json:
        atomic_write_json(Path(args.json), record)
    print(json.dumps(record, indent=1))


def _judge(args) -> None:
    """``judge``: judge decoding's judge, from stored greedy continuations (:mod:`.judge`)."""
    from ..models.fast import choose_runner
    from ..models.loading import load_model, load_tokenizer
    from .acceptance import load_rows, save_rows
    from .judge import JudgeRows, JudgeRowsOptions, JudgeTrainOptions, collect_rows, score, split_sequences, \
        train_judge

    folder = Path(args.continuations)
    stored, chunks, sequences = _stored_sequences(args, folder, load_tokenizer(args.target), mode="greedy",
                                                  why="the judge's labels")
    model = load_model(args.target, dtype=args.dtype)
    rows_opts = JudgeRowsOptions(args.positions, args.alternatives, args.far, args.resync, args.max_tokens, args.seed)
    key = {"format": 1, "what": "judge", "target": str(args.target), "fingerprint": stored.fingerprint,
           "chunks": chunks, "row_options": rows_opts.__dict__, "dtype": str(model.dtype)}
    all_rows = load_rows(args.rows_cache, key, JudgeRows) if args.rows_cache else None
    runner = choose_runner(model, "auto")
    if all_rows is None:
        all_rows = collect_rows(runner, sequences, rows_opts, progress=not args.no_progress)
        if args.rows_cache:
            save_rows(all_rows, args.rows_cache, key)
    train_rows, held = split_sequences(all_rows, args.held_out, args.seed)
    train_opts = JudgeTrainOptions(args.epochs, args.batch, args.lr, args.weight_decay, args.validation,
                                   args.precision, args.seed)
    judge = train_judge(train_rows, model.config.get_text_config().hidden_size, train_opts)
    target = recorded_path(args.target) if Path(args.target).exists() else str(args.target)  # a folder or a name
    record = {"lossy": True, "target": target, "target_vocab_size": runner.vocab_size,  # its logits' width
              "continuations": recorded_path(folder), "chunks": chunks, "sequences": len(sequences),
              "rows": train_rows.size, "held_out_rows": held.size, "row_options": rows_opts.__dict__,
              "train_options": train_opts.__dict__, "best_epoch": judge.epoch,
              # None: no threshold reached the precision on the validation sequences (the judge accepts nothing)
              "threshold": judge.threshold if math.isfinite(judge.threshold) else None,
              "held_out_scores": score(judge, held), "train_scores": score(judge, train_rows),
              "dtype": str(model.dtype)}
    judge.save(args.out, extra=record)
    if args.json:
        atomic_write_json(Path(args.json), record)
    print(json.dumps(record, indent=1))


if __name__ == "__main__":
    main(sys.argv[1:])
