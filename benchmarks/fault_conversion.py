"""kill -9 trials on the REAL embedded Gemma-3-270M conversion (about 90 s of CPU per run).

Each trial starts the conversion in a child process on a temporary TREESPEC_CACHE, kills it with
SIGKILL after a seeded random delay, and records what the cache root holds. The next trial (and the
final uninterrupted run) starts on that same cache, so each run must clean the leftovers of the one
killed before it. At the end the finished cache must be valid, hold no stray files, and match the
manifest of a reference cache (``--reference``, default the user's cache) file for file.

    nice -n 10 python benchmarks/fault_conversion.py --kills 2 --out fault_conversion.json
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

CHILD = ("import time; t = time.time(); from treespec.models.loading import embedded_gemma_dir; "
         "embedded_gemma_dir(progress=False); print('done', time.time() - t)")


def _listing(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir()) if root.exists() else []


def main() -> int:
    from treespec.models import loading

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kills", type=int, default=2, help="killed runs before the final complete run")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--min-delay", type=float, default=5.0)
    ap.add_argument("--max-delay", type=float, default=60.0)
    ap.add_argument("--reference", type=Path, default=loading.cache_root() / f"gemma-3-270m-v{loading._CACHE_FORMAT}")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    rng = random.Random(args.seed)
    report: dict = {"seed": args.seed, "trials": []}
    with tempfile.TemporaryDirectory(prefix="treespec-fault-") as tmp:
        root = Path(tmp) / "cache"
        env = dict(os.environ, TREESPEC_CACHE=str(root), OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
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
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    ok = report["final"]["returncode"] == 0 and report["final"]["valid"] and not report["final"]["stray"]
    return 0 if ok and report["final"].get("equals_reference", True) else 1


if __name__ == "__main__":
    sys.exit(main())
