"""Wall time of the command line's quick paths: ``treespec --help``, ``treespec generate --help`` and
``import treespec``, each in a fresh interpreter, repeated; median, minimum and maximum per command, with the
machine's load average beside them (a busy machine slows every start)::

    python benchmarks/cli_startup.py --repeats 7
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import add_output_args, finish, host_name, open_results_from_args, write_json  # noqa: E402

COMMANDS = {
    "treespec --help": ["-m", "treespec", "--help"],
    "treespec generate --help": ["-m", "treespec", "generate", "--help"],
    "import treespec": ["-c", "import treespec"],
}


def time_command(argv: list[str], repeats: int) -> list[float]:
    """Seconds of ``python ARGV`` from start to exit, ``repeats`` times (each must succeed)."""
    out = []
    for _ in range(repeats):
        start = time.perf_counter()
        subprocess.run([sys.executable, *argv], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        out.append(time.perf_counter() - start)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=7, help="runs per command (default 7)")
    ap.add_argument("--tag", default="cli-startup", help="results folder suffix (default cli-startup)")
    add_output_args(ap)
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error(f"--repeats must be >= 1, got {args.repeats}")
    started = time.time()
    out, prov = open_results_from_args("cli", args, tag=args.tag)
    load_before = os.getloadavg()
    rows = []
    for name, cmd in COMMANDS.items():
        times = time_command(cmd, args.repeats)
        rows.append({"command": name, "seconds": times, "median_s": statistics.median(times),
                     "min_s": min(times), "max_s": max(times)})
        print(f"{name}: median {rows[-1]['median_s']:.2f} s", file=sys.stderr, flush=True)
    load_after = os.getloadavg()
    write_json(out / "results.json", {"rows": rows, "load_average_before": load_before,
                                      "load_average_after": load_after})
    lines = [f"# Command-line start-up (commit {prov['commit_short']})", "",
             f"- Command: `{prov['command']['shell']}`", f"- Machine: {host_name(prov['machine'])}, "
             f"{prov['machine'].get('cores')} cores; 1-minute load average {load_before[0]:.2f} before, "
             f"{load_after[0]:.2f} after", f"- {args.repeats} runs per command, each in a fresh interpreter.", "",
             "| command | median s | min s | max s |", "|---|---|---|---|"]
    lines += [f"| `{r['command']}` | {r['median_s']:.2f} | {r['min_s']:.2f} | {r['max_s']:.2f} |" for r in rows]
    (out / "table.md").write_text("\n".join(lines) + "\n")
    finish(out, started)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
