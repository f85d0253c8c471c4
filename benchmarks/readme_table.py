"""The README's results table, generated from the newest protocol run (never typed by hand).

The newest protocol run is the folder under ``benchmarks/results/speed/`` whose name ends in ``-protocol``
with the latest date prefix. Its ``summary.json`` gives one row per method and block (dtype, temperature):
tokens/s, speedups over treespec plain and llama.cpp plain (median over prompts, bootstrap 95% interval) and
tau. ``python benchmarks/readme_table.py --write`` replaces the block between the README's markers; a test
(``tests/benchmarks/test_readme_table.py``) fails when the README and the newest run disagree.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import block_heading  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
SPEED = REPO / "benchmarks" / "results" / "speed"
BEGIN, END = "<!-- results-table:begin -->", "<!-- results-table:end -->"
#: what each row is, in the README's words (rows of other methods are left out of the headline)
LABELS = {
    "ts_plain": "treespec plain decoding",
    "ts_ngram": "n-gram lookup",
    "ts_head": "shipped head",
    "ts_lookup_head": "lookup + head",
    "hf_plain": "HF `generate`",
    "llama_plain": "llama.cpp plain",
    "llama_prompt_lookup": "llama.cpp prompt lookup",
    "tsl_plain": "treespec plain, llama.cpp target",
    "tsl_ngram": "n-gram lookup, llama.cpp target",
    "tsl_head": "shipped head, llama.cpp target",
    "tsl_lookup_head": "lookup + head, llama.cpp target",
}


def _started(run: Path) -> str:
    """When the run started, as its provenance records it (a clone's file times say nothing: they are the
    checkout's); empty where not recorded."""
    try:
        return json.loads((run / "provenance.json").read_text()).get("date_utc", "")
    except (OSError, ValueError):
        return ""


def newest_protocol_run(speed: Path = SPEED) -> Path:
    runs = sorted((p for p in speed.iterdir() if p.is_dir() and p.name.endswith("-protocol")
                   and (p / "summary.json").is_file()), key=lambda p: (p.name[:10], _started(p)))
    if not runs:
        raise FileNotFoundError(f"no protocol run under {speed}")
    return runs[-1]


def _cell(stat: dict | None) -> str:
    if not stat:
        return "-"
    lo, hi = stat["ci95"]
    return f"{stat['median']:.2f}x [{lo:.2f}, {hi:.2f}]"


def render(run: Path) -> str:
    """The markdown block (markers included) for the protocol run in ``run``."""
    data = json.loads((run / "summary.json").read_text())
    meta, summary = data["meta"], data["summary"]
    prov, settings = meta["provenance"], meta["settings"]
    machine = prov.get("machine", {})
    flags = [f for f, on in machine.get("cpu_flags", {}).items() if on and f in ("avx512f", "avx512_bf16", "amx_bf16")]
    host = (f"{machine.get('cpu', '?')} (family {machine.get('cpu_family', '?')}, model {machine.get('cpu_model', '?')}"
            + (f", {', '.join(flags)}" if flags else ", AVX2 only") + ")")
    lines = [BEGIN, "",
             f"From `benchmarks/results/speed/{run.name}/table.md` (commit {prov['commit'][:7]}, "
             f"{host}, {settings.get('threads')} threads; {settings.get('prompts')} eval prompts x "
             f"{settings.get('max_new_tokens')} new tokens; median over prompts [95% bootstrap interval]):", "",
             "| dtype, T | method | tokens/s | vs treespec plain | vs llama.cpp plain | tau |",
             "|---|---|---|---|---|---|"]
    for block, rows in summary.items():
        for name, label in LABELS.items():
            row = rows.get(name)
            if row is None:
                continue
            tau = row.get("tau")
            heading = block_heading(block, settings).replace("/", ", ")
            lines.append(f"| {heading} | {label} | {row['tokens_per_s']['median']:.1f} | "
                         f"{_cell(row.get('speedup_vs_ts_plain'))} | {_cell(row.get('speedup_vs_llama_plain'))} | "
                         f"{'-' if tau is None else f'{tau:.2f}'} |")
    lines += ["", END]
    return "\n".join(lines)


def readme_block(readme: str) -> str | None:
    match = re.search(re.escape(BEGIN) + r".*?" + re.escape(END), readme, re.S)
    return match.group(0) if match else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--write", action="store_true", help="replace the README's block (else print it)")
    args = ap.parse_args(argv)
    block = render(newest_protocol_run())
    if not args.write:
        print(block)
        return 0
    path = REPO / "README.md"
    text = path.read_text()
    if readme_block(text) is None:
        print(f"error: README.md has no {BEGIN} ... {END} block", file=sys.stderr)
        return 2
    path.write_text(text.replace(readme_block(text), block))
    return 0


if __name__ == "__main__":
    sys.exit(main())
