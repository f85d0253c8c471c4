"""kill -9 trials on the REAL embedded Gemma-3-270M conversion (about 90 s of CPU per run).

Each trial starts the conversion in a child process on a temporary TREESPEC_CACHE, kills it with
SIGKILL after a seeded random delay, and records what the cache root holds. The next trial (and the
final uninterrupted run) starts on that same cache, so each run must clean the leftovers of the one
killed before it. At the end the finished cache must be valid, hold no stray files, and match the
manifest of a reference cache (``--reference``, default the user's cache) file for file.

Results go through :mod:`benchmarks.common` like every benchmark: ``provenance.json`` (commit, clean /
dirty, machine, versions, command) and ``fault_conversion.json`` in
``benchmarks/results/faults/<date>-<commit>[-tag]`` (or ``--out DIR``); the children import treespec
from this checkout.

    nice -n 10 python benchmarks/fault_conversion.py --kills 2
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import REPO, add_output_args, finish, open_results, write_json  # noqa: E402

CHILD = ("import time; t = time.time(); from treespec.models.loading import embedded_gemma_dir; "
         "embedded_gemma_dir(progress=False); print('done', time.time() - t)")


def _listing(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir()) if root.exists() else []


def main(argv: list[str] | None = None) -> int:
    from treespec.models import loading

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kills", type=int, default=2, help="killed runs before the final complete run")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--min-delay", type=float, default=5.0)
    ap.add_argument("--max-delay", type=float, default=60.0)
    ap.add_argument("--reference", type=Path, default=loading.cache_root() / f"gemma-3-270m-v{loading._CACHE_FORMAT}")
    ap.add_argument("--tag", default=None, help="suffix of the default results folder name")
    add_output_args(ap)
    args = ap.parse_args(argv)
    started = time.time()
    out, prov = open_results("faults", args.out, allow_dirty=args.allow_dirty, tag=args.tag)

    rng = random.Random(args.seed)
    report: dict = {"commit": prov["commit_short"] + ("-dirty" if prov["dirty"] else ""), "seed": args.seed,
                    "kills": args.kills, "delay_s": [args.min_delay, args.max_delay], "trials": []}
    with tempfile.TemporaryDirectory(prefix="treespec-fault-") as tmp:
        root = Path(tmp) / "cache"
        pythonpath = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
        env = dict(os.environ, TREESPEC_CACHE=str(root), OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
                   PYTHONPATH=pythonpath)
        for trial in range(args.kills):
            delay = rng.uniform(args.min_delay, args.max_delay)
            before = _listing(root)
            child = subprocess.Popen([sys.executable, "-c", CHILD], env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
            try:
                child.wait(timeout=delay)
                killed = False
            except subprocess.TimeoutExpired:
                child.send_signal(signal.SIGKILL)
                child.wait()
                killed = True
            row = {"trial": trial, "delay_s": round(delay, 1), "killed": killed, "root_before": before,
                   "root_after_kill": _listing(root)}
            report["trials"].append(row)
            print(json.dumps(row), flush=True)
        t0 = time.time()
        final_run = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True)
        final = root / f"gemma-3-270m-v{loading._CACHE_FORMAT}"
        report["final"] = {
            "returncode": final_run.returncode, "seconds": round(time.time() - t0, 1),
            "root": _listing(root),
            "stray": [n for n in _listing(root) if n not in (final.name, ".gemma-3-270m.lock")],
            "valid": loading.cache_is_valid(final),
        }
        ref_manifest = args.reference / "treespec-manifest.json"
        if ref_manifest.exists() and (final / "treespec-manifest.json").exists():
            ours = json.loads((final / "treespec-manifest.json").read_text())
            ref = json.loads(ref_manifest.read_text())
            report["final"]["equals_reference"] = ours == ref
            report["final"]["differing_files"] = sorted(
                n for n in set(ours["files"]) | set(ref["files"]) if ours["files"].get(n) != ref["files"].get(n))
        print(json.dumps(report["final"]), flush=True)
    ok = report["final"]["returncode"] == 0 and report["final"]["valid"] and not report["final"]["stray"]
    report["survived"] = bool(ok and report["final"].get("equals_reference", True))
    write_json(out / "fault_conversion.json", report)
    finish(out, started)
    print(f"results in {out}")
    return 0 if report["survived"] else 1


if __name__ == "__main__":
    sys.exit(main())
