"""Draft heads on Spec-Bench and on held-out train rows, side by side: where the head's agreement is lost.

For every head and both prompt sets, ``python -m treespec.distill evaluate`` (the metrics of the draft
card: top-1 agreement with the target at T=0 and sum min(p, q) at T=1 along the target's own
continuations, per tree depth and per task) on

* ``specbench``: a seeded choice of Spec-Bench prompts (used only to measure), as the card does;
* ``heldout``: a seeded choice of train rows no corpus reads (``--held-out-train``: rows 11000: of the
  corpora's seeded order), in the train file's own task mix.

A gap between the two with the same head is the domain (prompt style, tasks), not the head's training.

    python benchmarks/head_domains.py --heads shipped=treespec/assets/gemma3-270m-head.safetensors \\
        previous=git:4dba31b:treespec/assets/gemma3-270m-head.safetensors --num-prompts 48

``git:REV:PATH`` reads a head file as committed at ``REV`` (an earlier shipped head); a suffix ``@int4``
measures the head on 4-bit weights (``evaluate --quantize int4``, as ``--draft-quantize int4`` drafts), e.g.
``--heads bf16=H int4=H@int4 --sets specbench``. Results:
``benchmarks/results/draft/<date>-<commit>-domains/`` (``metrics.json``, ``table.md``, ``provenance.json``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import REPO, add_output_args, finish, open_results, write_json  # noqa: E402
from treespec.files import atomic_write_text  # noqa: E402

SETS = {"specbench": [], "heldout": ["--held-out-train"]}


def head_file(spec: str, tmp: Path) -> Path:
    """``PATH`` or ``git:REV:PATH`` -> a head file on disk."""
    if not spec.startswith("git:"):
        return Path(spec)
    _, rev, path = spec.split(":", 2)
    data = subprocess.run(["git", "show", f"{rev}:{path}"], cwd=REPO, capture_output=True, check=True).stdout
    out = tmp / f"{rev}-{Path(path).name}"
    out.write_bytes(data)
    return out


def split_spec(spec: str) -> tuple[str, list[str]]:
    """``PATH[@int4]`` -> (the head's path spec, the evaluate options its suffix asks for)."""
    path, _, weights = spec.rpartition("@") if spec.endswith("@int4") else (spec, "", "")
    return path, (["--quantize", weights] if weights else [])


def evaluate(head: Path, extra: list[str], args: argparse.Namespace, out_json: Path) -> dict:
    from treespec.distill.cli import main as distill_main

    distill_main(["evaluate", "--head", str(head), "--num-prompts", str(args.num_prompts), "--new-tokens",
                  str(args.new_tokens), "--depths", str(args.depths), "--dtype", args.dtype, "--threads",
                  str(args.threads), "--no-progress", "--json", str(out_json), *extra])
    return json.loads(out_json.read_text())


def table(results: dict) -> list[str]:
    lines = ["| head | prompts | positions T=0 | T=0 top-1, depth 1 | depth 3 | depth 6 | T=1 sum min(p, q), depth 1 | "
             "depth 3 | depth 6 | head step / target step |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, sets in results.items():
        for s, m in sets.items():
            a, b, cost = m["top1_agreement_T0_by_depth"], m["sum_min_pq_T1_by_depth"], m["step_cost"]
            lines.append(f"| {name} | {s} | {m['positions_T0']} | {a[0]:.3f} | {a[min(2, len(a) - 1)]:.3f} | "
                         f"{a[-1]:.3f} | {b[0]:.3f} | {b[min(2, len(b) - 1)]:.3f} | {b[-1]:.3f} | "
                         f"{cost['fraction']:.3f} ({cost['head_step_s'] * 1e3:.2f} / {cost['target_step_s'] * 1e3:.1f} ms, "
                         f"{cost.get('head_weights', '?')}) |")
    lines += ["", "Per task (depth 1; Spec-Bench subtask, or the train row's category):", "",
              "| head | prompts | task | prompts in it | positions T=0 | T=0 top-1 | T=1 sum min(p, q) |",
              "|---|---|---|---:|---:|---:|---:|"]
    for name, sets in results.items():
        for s, m in sets.items():
            for g, v in sorted(m.get("by_group", {}).items()):
                lines.append(f"| {name} | {s} | {g} | {v['prompts']} | {v['positions_T0']} | "
                             f"{v['top1_agreement_T0_by_depth'][0]:.3f} | {v['sum_min_pq_T1_by_depth'][0]:.3f} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--heads", nargs="+", required=True, help="NAME=PATH or NAME=git:REV:PATH")
    ap.add_argument("--sets", default="specbench,heldout")
    ap.add_argument("--num-prompts", type=int, default=48)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--depths", type=int, default=6)
    ap.add_argument("--dtype", default="bfloat16", choices=["auto", "float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tag", default="domains")
    add_output_args(ap)
    args = ap.parse_args(argv)
    sets = args.sets.split(",")
    names = [h.split("=", 1)[0] for h in args.heads]
    if any(s not in SETS for s in sets) or any("=" not in h for h in args.heads) or len(set(names)) < len(names):
        raise SystemExit(f"--sets takes {sorted(SETS)}; --heads takes distinct NAME=PATH entries "
                         f"(got {args.sets!r}, {args.heads})")
    heads = dict(h.split("=", 1) for h in args.heads)
    started = time.time()
    out, prov = open_results("draft", args.out, allow_dirty=args.allow_dirty, tag=args.tag)
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, spec in heads.items():
            where, weights = split_spec(spec)
            path = head_file(where, Path(tmp))
            results[name] = {}
            for s in sets:
                results[name][s] = evaluate(path, SETS[s] + weights, args, Path(tmp) / f"{name}-{s}.json")
                results[name][s]["head"] = spec
            write_json(out / "metrics.json", {"settings": vars(args) | {"out": str(args.out)}, "results": results})
    lines = [f"# Draft heads on Spec-Bench and held-out train rows (commit {prov['commit_short']})", "",
             f"{prov['machine']['cpu']}, {args.dtype}, {args.threads} threads; {args.num_prompts} prompts per set, "
             f"{args.new_tokens} tokens continued by the target (greedy for T=0, sampled for T=1); heads: "
             + ", ".join(f"{k} = `{v}`" for k, v in heads.items()), "", *table(results)]
    atomic_write_text(out / "table.md", "\n".join(lines) + "\n")
    finish(out, started)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
