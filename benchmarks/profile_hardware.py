"""Hardware profile: target verify cost t(n)/t(1) for n tree tokens, the draft step cost, and the
bandwidth reference (the time to read every target weight byte once, measured in the same run).

    python benchmarks/profile_hardware.py [--dtype float32] [--threads 2] [--draft early-exit:12] [--fast]
    python benchmarks/profile_hardware.py --dtype bfloat16 --compare     # eager runner vs fast runner

``--fast`` profiles the fast runner (``treespec.models.fast``: lean forward, static KV cache);
``--compare`` profiles both runners on the same loaded model, one after the other.

Saves ``profile.json`` (a :class:`treespec.trees.sequoia.HardwareProfile`, reusable by the Sequoia
chooser) and ``profile.md`` under ``benchmarks/results/profile/<date>-<commit>/``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import add_output_args, finish, open_results, write_json  # noqa: E402
from treespec.models.loading import load_draft_model, load_model  # noqa: E402
from treespec.calibration import measure_profile  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--draft", default=None, help="draft spec (path/id or early-exit:L) for the draft step cost")
    ap.add_argument("--sizes", default="1,2,4,8,12,16,24,32,48,64,96,128")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tag", default=None)
    ap.add_argument("--fast", action="store_true", help="profile the fast runner (treespec.models.fast)")
    ap.add_argument("--compare", action="store_true", help="profile the eager and the fast runner")
    add_output_args(ap)
    args = ap.parse_args(argv)
    started = time.time()
    out, prov = open_results("profile", args.out, allow_dirty=args.allow_dirty, tag=args.tag)
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    target = load_model("embedded", dtype=args.dtype)
    draft = load_draft_model(args.draft, target) if args.draft else None
    sizes = tuple(int(s) for s in args.sizes.split(","))
    modes = [False, True] if args.compare else [args.fast]
    profs = {fast: measure_profile(target, draft, sizes=sizes, repeats=args.repeats, fast=fast) for fast in modes}
    meta = {"commit": prov["commit"], "machine": prov["machine"],
            "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}}
    write_json(out / "meta.json", meta)
    lines = [f"# Hardware profile ({meta['commit']}): Gemma-3-270M {args.dtype}, {args.threads} threads", "",
             f"{meta['machine']['cpu']}"]
    for fast, prof in profs.items():
        name = "fast" if fast else "eager"
        prof.save(out / ("profile.json" if fast == modes[-1] else f"profile-{name}.json"))
        t1 = prof.verify_s[0]
        lines += ["", f"## {prof.meta['runner']} ({name})", "",
                  f"weight streaming (read {prof.weight_bytes / 1e6:.0f} MB once): {prof.stream_s * 1000:.1f} ms; "
                  f"t(1) = {t1 * 1000:.1f} ms = {t1 / prof.stream_s:.2f} x streaming" if prof.stream_s else "",
                  f"draft {args.draft or 'none'}: step {prof.draft_step_s * 1000:.1f} ms ({prof.draft_step_s / t1:.2f} x t(1))",
                  "", "| n | t(n) ms | t(n)/t(1) |", "|---|---|---|"]
        lines += [f"| {n} | {t * 1000:.1f} | {t / t1:.2f} |" for n, t in zip(prof.sizes, prof.verify_s)]
    (out / "profile.md").write_text("\n".join(lines) + "\n")
    finish(out, started)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
