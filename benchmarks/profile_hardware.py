"""Hardware profile: target verify cost t(n)/t(1) for n tree tokens, and the draft step cost.

    python benchmarks/profile_hardware.py [--dtype float32] [--threads 2] [--draft early-exit:12]

Saves ``profile.json`` (a :class:`treespec.trees.sequoia.HardwareProfile`, reusable by the Sequoia
chooser) and ``profile.md`` under ``benchmarks/results/profile/<date>-<commit>/``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import git_commit, machine_info, results_dir, write_json  # noqa: E402
from treespec.models.loading import load_draft_model, load_model  # noqa: E402
from treespec.trees.sequoia import measure_profile  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--draft", default=None, help="draft spec (path/id or early-exit:L) for the draft step cost")
    ap.add_argument("--sizes", default="1,2,4,8,12,16,24,32,48,64,96,128")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tag", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    target = load_model("embedded", dtype=args.dtype)
    draft = load_draft_model(args.draft, target) if args.draft else None
    sizes = tuple(int(s) for s in args.sizes.split(","))
    prof = measure_profile(target, draft, sizes=sizes, repeats=args.repeats)
    out = results_dir("profile", args.tag)
    prof.save(out / "profile.json")
    meta = {"commit": git_commit(), "machine": machine_info(), "settings": vars(args)}
    write_json(out / "meta.json", meta)
    t1 = prof.verify_s[0]
    lines = [f"# Hardware profile ({meta['commit']}): Gemma-3-270M {args.dtype}, {args.threads} threads", "",
             f"{meta['machine']['cpu']}; draft {args.draft or 'none'}: step {prof.draft_step_s * 1000:.1f} ms "
             f"({prof.draft_step_s / t1:.2f} x t(1))", "", "| n | t(n) ms | t(n)/t(1) |", "|---|---|---|"]
    lines += [f"| {n} | {t * 1000:.1f} | {t / t1:.2f} |" for n, t in zip(prof.sizes, prof.verify_s)]
    (out / "profile.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
