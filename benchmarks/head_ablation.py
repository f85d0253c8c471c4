"""Head ablations: train variants of the draft head one change at a time, measure each on held-out rows.

Every variant trains from scratch (or, with ``--init-head``, from one starting head) on the same stage-2 corpora (recipes/head_v2_train.sh, STAGE=corpus),
with the same seed, steps and batch, differing from the base only in the options it names. Each is
then measured on held-out train prompts (rows ``HELD_OUT_FROM:`` of the seeded order, which no corpus
uses; never the eval set): the target's own greedy and sampled (T=1) continuations, the head's top-1
agreement and sum min(p, q) at tree depths 1..6 along them (``treespec.distill.evaluate.depth_metrics``;
depth k = the node k levels below a root whose path follows the text), and one head step against one
target step.

    python benchmarks/head_ablation.py --steps 1000 [--variants base,ttt3,vocab32k] [--time-limit 40] [--max-shards 31]
    python benchmarks/head_ablation.py --init-head treespec/assets/gemma3-270m-head.safetensors --variants base,tv \
        --steps 150 --warmup 20 --max-shards 47,21   # continued training from the shipped head, one change at a time
    python benchmarks/head_ablation.py --tiny    # smoke test: a tiny random target, its own corpus, 20 steps

Training runs resume (checkpoints in the cache under distill/runs/ablation-<name>-<steps>-<digest of the options>); a variant's
result is written to the results folder when it is measured, and ``--out`` an unfinished folder
(not committed) skips the variants it holds. Results: ``benchmarks/results/ablation/<date>-<commit>/``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from benchmarks.common import add_output_args, finish, open_results, require_shared, write_json  # noqa: E402
from treespec.distill.cli import _int_list  # noqa: E402

#: one change at a time against "base" (the v1 recipe's options on the v2 corpus)
VARIANTS: dict[str, dict] = {
    "base": {},
    "ttt2": {"depths": 2},
    "ttt3": {"depths": 3},
    "vocab32k": {"vocab_size": 32768},
    "vocab8k": {"vocab_size": 8192},
    "no-noise": {"feature_noise": 0.0},
    "fused": {"feature_layers": "low,mid"},  # a low and a middle layer besides the last hidden state (EAGLE-3)
    # fused features read only at the first level: deeper levels run on the head's own feature, which the
    # training-time test trains it on (EAGLE-3 pairs the two); measured beside "fused" and "ttt3" alone
    "fused+ttt3": {"feature_layers": "low,mid", "depths": 3},
    # the subset logits in float32 although the head trains under bf16 autocast (every run before logits_amp)
    "fp32-logits": {"logits_amp": False},
    # the total-variation loss beside the cross-entropies: 1 - sum min(p, q), the acceptance itself (DistillSpec,
    # arXiv 2310.08461)
    "tv": {"w_tv": 1.0},
}


def low_mid_layers(num_layers: int) -> tuple[int, int]:
    """The "low,mid" fused layers of a target with ``num_layers >= 4`` decoder layers: (2, 9) of Gemma-3-270M's 18."""
    if num_layers < 4:
        raise ValueError(f"fused features need a low and a middle layer below the last; {num_layers} layers are too few")
    return num_layers // 8, num_layers // 2


def resolve(changes: dict, num_layers: int) -> dict:
    """A variant's options for a target with ``num_layers`` decoder layers."""
    return {k: low_mid_layers(num_layers) if v == "low,mid" else v for k, v in changes.items()}
BASE = {"vocab_size": 16384, "depths": 1, "feature_noise": 0.05, "w_hard": 0.1, "batch_size": 8, "seq_len": 256,
        "lr": 1e-3, "warmup": 100, "ckpt_every": 100}
#: the base of continued-training ablations (``--init-head``): the options of the shipped head's recipe
#: (recipes/head_v2_train.sh: training-time test at depths 1-3, continued runs at lr 5e-4, warmup 50)
BASE_CONTINUED = {**BASE, "depths": 3, "depth_decay": 0.8, "lr": 5e-4, "warmup": 50}
#: options a continued run cannot change (the starting head fixes them)
FIXED_BY_INIT = ("vocab_size", "feature_layers", "num_heads", "head_dim", "intermediate_size")


def held_out_prompts(num: int, max_len: int) -> list[list[int]]:
    """``num`` held-out train prompts (seeded order, rows HELD_OUT_FROM:), token ids cut to the last ``max_len``."""
    from treespec.distill.corpus import DEFAULT_TRAIN
    from treespec.distill.corpus import HELD_OUT_FROM, read_prompts
    from treespec.models.loading import load_tokenizer

    rows = read_prompts(require_shared(REPO / DEFAULT_TRAIN), seed=0)[HELD_OUT_FROM:HELD_OUT_FROM + num]
    tok = load_tokenizer("embedded")
    return [tok(r["prompt"])["input_ids"][-max_len:] for r in rows]


def chain_length(acceptance_by_depth: list[float]) -> float:
    """Tokens per target pass of a chain drafted to ``len(acceptance_by_depth)`` levels if each level k were accepted
    independently with probability ``acceptance_by_depth[k-1]``: ``1 + sum_k prod_{j<=k} a_j``.

    The per-depth metrics average depth k over every position of the text (the head's earlier levels fed the text's
    tokens), not only where the earlier levels agreed, so acceptances at successive depths are likely correlated and
    this is an estimate that ranks variants by all depths at once; measured tau comes from the speed benchmarks.

    >>> chain_length([0.5, 0.5])
    1.75
    """
    total, prod = 1.0, 1.0
    for a in acceptance_by_depth:
        prod *= a
        total += prod
    return total


def run_name(variant: str, cfg, init_head: str | Path | None = None) -> str:
    """The cache folder of a variant's training run: its name, steps and a digest of every training option (and of the
    starting head's bytes, for a continued run), so that a run with other options (another base, a new option's
    default, another start) never resumes from this one's checkpoints."""
    import hashlib
    from dataclasses import asdict

    options = {k: v for k, v in asdict(cfg).items() if k != "time_limit_s"}
    if init_head is not None:
        options["init_head"] = hashlib.sha256(Path(init_head).read_bytes()).hexdigest()
    digest = hashlib.sha256(json.dumps(options, sort_keys=True, default=str).encode()).hexdigest()[:8]
    return f"ablation-{variant}-{cfg.steps}-{digest}"


def table(results: dict[str, dict], depths: int) -> str:
    head = "| variant | options | " + " | ".join(f"T0 d{k}" for k in range(1, depths + 1)) + " | " + \
        " | ".join(f"T1 d{k}" for k in range(1, depths + 1)) + " | chain T0 | chain T1 | head/target step |"
    lines = [head, "|---|---|" + "---:|" * (2 * depths + 3)]
    for name, r in results.items():
        a, s = r["top1_agreement_T0_by_depth"], r["sum_min_pq_T1_by_depth"]
        lines.append(f"| {name} | {json.dumps(r['changes'])} | " + " | ".join(f"{x:.3f}" for x in a) + " | "
                     + " | ".join(f"{x:.3f}" for x in s) + f" | {chain_length(a):.2f} | {chain_length(s):.2f} | "
                     f"{r['step_cost']['fraction']:.3f} |")
    note = ("\nchain T0 / T1: 1 + sum_k prod_(j<=k) a_j over the depths measured, a_j = T0 top-1 agreement / "
            "T1 sum min(p, q) at depth j (head_ablation.chain_length): a chain's expected tokens per target pass "
            "if each depth were accepted independently at its rate; an estimate for ranking variants.")
    return "\n".join(lines) + "\n" + note


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--corpus", default=None,
                    help="stage-2 corpus folders, comma-separated (default: the head-v2 recipe's, in the cache)")
    ap.add_argument("--variants", default="base,ttt3,vocab32k")
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prompts", type=int, default=24, help="held-out prompts measured")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--depths", type=int, default=6)
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--time-limit", type=float, default=None, help="minutes of training per variant per call")
    ap.add_argument("--max-shards", type=_int_list, default=None,
                    help="train every variant on the first N shards of each corpus (pins a corpus that is still growing); "
                         "N1,N2: one count per corpus")
    ap.add_argument("--init-head", default=None,
                    help="continued training: every variant starts from this head file, with the shipped recipe's options "
                         "(BASE_CONTINUED) as its base; variants that change what the head file fixes are refused")
    ap.add_argument("--warmup", type=int, default=None, help="warmup steps (default: the base's)")
    ap.add_argument("--tiny", action="store_true",
                    help="smoke test on a tiny random Gemma-3 target with its own small corpus (temporary folders)")
    add_output_args(ap)
    args = ap.parse_args(argv)
    if args.tiny:
        with tempfile.TemporaryDirectory() as tmp:
            return _main(args, Path(tmp))
    return _main(args, None)


def _tiny_setup(tmp: Path, num_prompts: int):
    """(target, corpora, held-out prompts) of the smoke test: random prompts, corpus with the fused layers."""
    from treespec.distill.corpus import CorpusOptions, build_corpus
    from treespec.models.tiny import tiny_model

    target = tiny_model("gemma3", 64, seed=0, num_layers=4, logit_scale=6.0, max_positions=2048)
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(2, 64, (int(n),), generator=g).tolist() for n in torch.randint(8, 40, (24 + num_prompts,),
                                                                                         generator=g)]
    build_corpus(target, seqs[:24], tmp / "corpus", CorpusOptions(topk=0, shard_positions=200, batch_size=4,
                                                                 feature_layers=low_mid_layers(4)), progress=False)
    return target, [tmp / "corpus"], seqs[24:]


def _checked(args, names: list[str]) -> tuple[dict, object] | None:
    """The base training options and ``--max-shards`` as TrainConfig takes it, or None after printing the one
    line that says what is wrong (every option is checked before a results folder exists)."""
    from treespec.distill.train import TrainConfig

    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        print(f"head_ablation: unknown variants {unknown}; known: {sorted(VARIANTS)}", file=sys.stderr)
        return None
    base = dict(BASE_CONTINUED if args.init_head else BASE)
    if args.warmup is not None:
        base["warmup"] = args.warmup
    if args.init_head:
        fixed = [n for n in names if set(VARIANTS[n]) & set(FIXED_BY_INIT)]
        if fixed:
            print(f"head_ablation: variants {fixed} change what --init-head fixes ({', '.join(FIXED_BY_INIT)})",
                  file=sys.stderr)
            return None
        if not Path(args.init_head).is_file():
            print(f"head_ablation: --init-head {args.init_head}: no such file", file=sys.stderr)
            return None
    max_shards = None if not args.max_shards else args.max_shards[0] if len(args.max_shards) == 1 else args.max_shards
    try:
        TrainConfig(**{**base, "max_shards": max_shards})
    except ValueError as err:
        print(f"head_ablation: {err}", file=sys.stderr)
        return None
    return base, max_shards


def _variant(name: str, target, corpora: list[Path], runs: Path, options: dict, prompts, generations: tuple,
             args) -> dict | None:
    """Train variant ``name`` with ``options`` and measure it on ``prompts`` against the target's greedy and
    sampled ``generations``; None where the time limit stopped training first."""
    from treespec.analysis.acceptance import step_cost
    from treespec.distill.evaluate import depth_metrics
    from treespec.distill.train import TrainConfig, train

    cfg = TrainConfig(**options)
    head, summary = train(target, corpora if len(corpora) > 1 else corpora[0], runs / run_name(name, cfg, args.init_head),
                          cfg, init_head=args.init_head, log=print,
                          progress=not args.tiny)
    if summary["step"] < args.steps:
        print(f"{name}: stopped at step {summary['step']} of {args.steps} (time limit); run again to continue")
        return None
    head.eval()
    greedy, sampled = generations
    with torch.no_grad():
        m0 = depth_metrics(target, head, prompts, greedy, args.depths)
        m1 = depth_metrics(target, head, prompts, sampled, args.depths)
        if next(target.parameters()).dtype == torch.bfloat16:
            head.for_inference(torch.bfloat16)  # as the CLI drafts with it (packed bf16)
        cost = step_cost(target, head)
    return {"train_summary": summary,
            "top1_agreement_T0_by_depth": m0["top1_agreement_by_depth"],
            "sum_min_pq_T0_by_depth": m0["sum_min_pq_by_depth"],
            "sum_min_pq_T1_by_depth": m1["sum_min_pq_by_depth"],
            "top1_agreement_T1_by_depth": m1["top1_agreement_by_depth"],
            "positions_T0_by_depth": m0["positions_by_depth"],
            "positions_T1_by_depth": m1["positions_by_depth"], "step_cost": cost}


def _main(args, tmp: Path | None) -> int:
    from treespec.analysis.acceptance import target_generations
    from treespec.distill.train import distill_root
    from treespec.models.features import num_decoder_layers
    from treespec.models.loading import load_model

    names = args.variants.split(",")
    checked = _checked(args, names)
    if checked is None:
        return 2
    base, max_shards = checked
    corpora = [Path(c) for c in args.corpus.split(",")] if args.corpus else \
        [p for p in (distill_root() / "corpus" / "head-v2-greedy-f2-9", distill_root() / "corpus" / "head-v2-sample-f2-9")
         if (p / "manifest.json").exists()]
    if not corpora and not args.tiny:
        print("head_ablation: no stage-2 corpus (run STAGE=corpus recipes/head_v2_train.sh first)", file=sys.stderr)
        return 2
    if not args.tiny:  # the held-out prompts, checked before a results folder exists
        from treespec.distill.corpus import DEFAULT_TRAIN

        require_shared(REPO / DEFAULT_TRAIN)
    torch.set_num_threads(args.threads)
    started = time.time()
    out, _ = open_results("ablation", args.out, allow_dirty=args.allow_dirty,
                          extra={"ablation": {**vars(args), "out": None, "base": base,
                                              "corpora": "tiny (temporary)" if args.tiny else
                                              [str(c) for c in corpora]}})
    if args.tiny:
        target, corpora, prompts = _tiny_setup(tmp, args.prompts)
        runs, cache = tmp / "runs", None
    else:
        target = load_model("embedded", dtype=args.dtype)
        prompts = held_out_prompts(args.prompts, 512)
        runs, cache = distill_root() / "runs", distill_root() / "eval-cache"
    layers = num_decoder_layers(target)
    generations = tuple(target_generations(target, prompts, args.new_tokens, t, cache=cache) for t in (0.0, 1.0))
    results: dict[str, dict] = {}
    for name in names:
        path = out / f"variant-{name}.json"
        if path.exists():
            results[name] = json.loads(path.read_text())
            continue
        changes = resolve(VARIANTS[name], layers)
        options = {**base, **changes, "steps": args.steps, "seed": args.seed, "max_shards": max_shards,
                   "time_limit_s": None if args.time_limit is None else args.time_limit * 60}
        result = _variant(name, target, corpora, runs, options, prompts, generations, args)
        if result is None:
            break
        results[name] = {"changes": changes, **result}
        write_json(path, results[name])
        (out / "table.md").write_text(table(results, args.depths) + "\n")
        print(table(results, args.depths), flush=True)
    if len(results) == len(names):
        finish(out, started)
    print(f"saved to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
