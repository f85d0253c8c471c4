"""Paired comparisons inside one protocol run: method B against method A on the same prompts and rounds.

Reads ``summary.json`` of a ``benchmarks/run.py`` results folder and writes ``paired.md`` (and ``paired.json``)
beside it: for each (dtype, temperature) and each pair ``A:B``, the per-prompt ratio B's tokens/s over A's
(> 1: B faster), its median with a percentile-bootstrap 95% interval (2,000 resamples, seeded), and the
sign test (how many prompts B was faster / slower on, exact two-sided p). Nothing is measured here::

    python benchmarks/paired.py benchmarks/results/speed/DIR --pairs tsl_ngram:tsl_ngram_noleaf
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import block_heading, bootstrap_ci, write_json  # noqa: E402
from benchmarks.report import sign_test  # noqa: E402


def paired_rows(per_prompt: list[dict], pairs: list[tuple[str, str]]) -> list[dict]:
    """One row per (dtype, temperature, pair) where both methods ran on the same prompts."""
    groups: dict[tuple, dict[str, dict]] = {}
    for r in per_prompt:
        groups.setdefault((r["dtype"], r["temperature"], r["prompt_id"]), {})[r["method"]] = r
    rows = []
    for dtype, temp in dict.fromkeys((k[0], k[1]) for k in groups):
        for a, b in pairs:
            ratios = [m[b]["tokens_per_s"] / m[a]["tokens_per_s"] for (d, t, _), m in groups.items()
                      if (d, t) == (dtype, temp) and a in m and b in m]
            if not ratios:
                continue
            lo, hi = bootstrap_ci(ratios)
            rows.append({"dtype": dtype, "temperature": temp, "a": a, "b": b, "prompts": len(ratios),
                         "median": statistics.median(ratios), "ci95": [lo, hi], **sign_test(ratios)})
    return rows


def render(rows: list[dict], source: str, settings: dict | None = None) -> str:
    """paired.md; ``settings`` (the run's) name each block's top-p."""
    lines = [f"# Paired comparisons ({source})", "",
             "Per prompt, B's tokens/s over A's (> 1: B faster), median [95% bootstrap interval]; B faster / slower "
             "on how many prompts, and the two-sided sign-test p-value.", "",
             "| dtype / T | A | B | prompts | B over A | faster / slower | sign-test p |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lo, hi = r["ci95"]
        block = block_heading(f"{r['dtype']}/T={r['temperature']:g}", settings or {})
        lines.append(f"| {block} | {r['a']} | {r['b']} | {r['prompts']} | "
                     f"{r['median']:.3f}x [{lo:.3f}, {hi:.3f}] | {r['wins']} / {r['losses']} | {r['p_sign']:.3g} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folder", type=Path, help="a benchmarks/run.py results folder (holding summary.json)")
    ap.add_argument("--pairs", nargs="+", required=True, metavar="A:B")
    args = ap.parse_args(argv)
    pairs = [tuple(p.split(":")) for p in args.pairs]
    if any(len(p) != 2 or not all(p) for p in pairs):
        ap.error("--pairs takes A:B method names")
    summary = args.folder / "summary.json"
    if not summary.is_file():
        ap.error(f"no summary.json in {args.folder}")
    data = json.loads(summary.read_text())
    rows = paired_rows(data["per_prompt"], pairs)
    settings = data.get("meta", {}).get("settings")
    if not rows:
        ap.error("no pair ran on common prompts in that folder")
    write_json(args.folder / "paired.json", {"pairs": args.pairs, "rows": rows})
    text = render(rows, args.folder.name, settings)
    (args.folder / "paired.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
