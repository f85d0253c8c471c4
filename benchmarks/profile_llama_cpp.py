"""What one pass of the llama.cpp target costs: t(n) for chains of n tree nodes on the embedded GGUF.

Per node count n (a chain of n nodes after a 100-token prefix; every pass rolled back so the prefix stays), the
median over ``--reps`` passes of three ways to ask llama.cpp for what a verifier needs:

* ``logits``: logits of every node (what :class:`~treespec.models.llama_cpp.LlamaCppRunner` asks for a tree pass);
* ``body``: no output row at all (the transformer body and the cache writes; a floor of any tree pass);
* ``hidden``: every node's hidden state captured from the graph, the LM head skipped (``capture_hidden``);
* ``hidden_int8``: the same, then treespec's 8-bit LM head (:mod:`treespec.models.fast.int8_head`, built from the
  de-quantised embedded model's head, ranges from llama.cpp's own hidden states of the calibration ids) over every
  node: llama.cpp's body with another head. Where oneDNN's int8 kernel is missing this column is left out.

``logits - body`` is llama.cpp's LM head over n rows (262,144 entries each for Gemma-3-270M) plus the copy of
the rows; ``t(n) / t(1)`` says how much a tree pass of n nodes costs over a plain decoding step. A second table
holds a pass of ``--rows-of`` nodes with logits for its first k nodes only (``forward(..., rows=...)``, what
``--leaf-logits off`` asks for, without the runner's even padding), for each k of ``--rows``, every k once per
round: what each LM-head row adds. Writes
``profile.json`` and ``table.md`` under ``benchmarks/results/profile/<date>-<commit>-llama-cpp[-tag]/``::

    python benchmarks/profile_llama_cpp.py --threads 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import add_output_args, finish, host_name, machine_info, open_results, write_json  # noqa: E402

MODES = ("logits", "body", "hidden", "hidden_int8")
LABELS = {"logits": "logits of every node (ms)", "body": "body only, no output (ms)",
          "hidden": "hidden states captured, no LM head (ms)",
          "hidden_int8": "hidden states + treespec's int8 head (ms)"}


def time_passes(runner, n: int, mode: str, reps: int, rows: int | None = None, head=None) -> list[float]:
    """Seconds of ``reps`` tree passes of a chain of ``n`` nodes, each committed then rolled back (``rows``:
    logits of the first ``rows`` nodes only; ``head``: the 8-bit head of ``hidden_int8``)."""
    from treespec.models.fast.int8_head import int8_head_logits
    from treespec.tree import TokenTree

    tree = TokenTree.chain(5, list(range(2000, 2000 + n - 1)))
    nodes = torch.arange(n)
    picked = None if rows is None else torch.arange(rows)
    base = runner.length
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        out = runner.forward(tree, nodes, need_logits=mode == "logits", need_hidden=mode.startswith("hidden"),
                             rows=picked)
        if mode == "hidden_int8":
            int8_head_logits(out["hidden"], head)  # [n, V]
        times.append(time.perf_counter() - t0)
        runner.commit([0])
        runner._ll.llama_memory_seq_rm(runner._mem, 0, base, -1)  # the prefix alone again
        runner.length = base
    return times


def int8_head_of(capture):
    """treespec's 8-bit LM head over the embedded model's head weight, its ranges from the hidden states llama.cpp
    gives the calibration ids (``capture``: a runner with ``capture_hidden``, reset afterwards); None where
    oneDNN's int8 kernel is missing."""
    from treespec.models.fast.int8_head import (OUTLIERS, calibration_ids, int8_kernel_missing, plan_int8_head,
                                                quantize_int8_head)
    from treespec.models.loading import load_model

    if int8_kernel_missing() is not None:
        return None
    weight = load_model("embedded", dtype=torch.float32).lm_head.weight.detach()  # [V, H]
    with torch.no_grad():
        hidden = capture.forward(None, None, calibration_ids(weight.shape[0]), need_logits=False,
                                 need_hidden=True)["hidden"]  # [CALIBRATION_TOKENS, H]
    capture.reset()
    return quantize_int8_head(weight, plan_int8_head(weight, hidden.abs().amax(0), OUTLIERS))


def _relative(path: Path) -> str:
    """``path`` relative to the repository when inside it (no machine-specific paths in results)."""
    try:
        return str(Path(path).resolve().relative_to(Path(__file__).resolve().parent.parent))
    except ValueError:
        return str(path)


def render(data: dict) -> str:
    """``table.md`` from ``profile.json``'s contents."""
    prov, machine, rows, st = data["provenance"], data["machine"], data["rows"], data["settings"]
    modes = [m for m in MODES if m in rows[0]]  # an older profile, or a torch without the int8 kernel: fewer
    base = {m: rows[0][m]["median_ms"] for m in modes} if rows[0]["nodes"] == 1 else None
    flags = ", ".join(f for f, on in machine.get("cpu_flags", {}).items() if on) or "none read"
    lines = [f"# llama.cpp target: tree-pass cost (commit {prov['commit'][:7]}{' DIRTY' if prov.get('diff') else ''})",
             "", f"- Command: `{prov['command']['shell']}`",
             f"- Machine: {host_name(machine)}, {machine.get('cores')} cores; flags: {flags}",
             f"- GGUF: {data.get('gguf', 'the embedded GGUF')}, prefix {st['prefix']} tokens, threads {st['threads']}, "
             f"{st['reps']} passes per cell (median [min, max])", "",
             "| nodes | " + " | ".join(LABELS[m] for m in modes) + " | LM head + copy per row (ms) |"
             + (" t(n)/t(1) logits | t(n)/t(1) body |" if base else ""),
             "|---|" + "---|" * (len(modes) + 1) + ("---|---|" if base else "")]
    for row in rows:
        cells = [f"{row[m]['median_ms']:.1f} [{row[m]['min_ms']:.1f}, {row[m]['max_ms']:.1f}]" for m in modes]
        per_row = (row["logits"]["median_ms"] - row["body"]["median_ms"]) / row["nodes"]
        ratio = (f" {row['logits']['median_ms'] / base['logits']:.2f} | {row['body']['median_ms'] / base['body']:.2f} |"
                 if base else "")
        lines.append(f"| {row['nodes']} | " + " | ".join(cells) + f" | {per_row:.1f} |" + ratio)
    if data.get("row_sweep"):
        n = st["rows_of"]
        lines += ["", f"A pass of {n} nodes with logits for its first k nodes only (``rows``), against its body:", "",
                  "| k rows | pass (ms) | LM head + copy (ms) | per row (ms) |", "|---|---|---|---|"]
        body = next((r["body"]["median_ms"] for r in rows if r["nodes"] == n), None)
        for row in data["row_sweep"]:
            t = row["pass"]
            head = "-" if body is None else f"{t['median_ms'] - body:.1f}"
            per = "-" if body is None else f"{(t['median_ms'] - body) / row['rows']:.1f}"
            lines.append(f"| {row['rows']} | {t['median_ms']:.1f} [{t['min_ms']:.1f}, {t['max_ms']:.1f}] | {head} | {per} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prefix", type=int, default=100, help="committed tokens before each pass")
    ap.add_argument("--rows-of", type=int, default=8, help="nodes of the pass whose output rows --rows sweeps")
    ap.add_argument("--rows", type=int, nargs="*", default=[1, 2, 3, 4, 5, 6, 7, 8],
                    help="output rows k of the --rows-of pass (none: no sweep)")
    ap.add_argument("--tag", default=None)
    ap.add_argument("--render", type=Path, default=None, metavar="DIR",
                    help="only rewrite DIR/table.md from DIR/profile.json (nothing is measured)")
    add_output_args(ap)
    args = ap.parse_args(argv)
    if args.render is not None:
        data = json.loads((args.render / "profile.json").read_text())
        data.setdefault("gguf", "gemma-3-270m-q4_k_m.gguf")
        (args.render / "table.md").write_text(render(data))
        return 0
    if min(args.nodes) < 1 or args.reps < 1 or args.prefix < 1:
        ap.error("--nodes, --reps and --prefix take positive integers")
    if args.rows and not all(1 <= k <= args.rows_of for k in args.rows):
        ap.error(f"--rows takes integers in 1..--rows-of ({args.rows_of})")
    from treespec.models.fast.int8_head import CALIBRATION_TOKENS
    from treespec.models.llama_cpp import LlamaCppRunner, llama_cpp_available
    from treespec.models.loading import embedded_gguf

    reason = llama_cpp_available()
    if reason is not None:
        ap.error(reason)
    torch.set_num_threads(args.threads)
    out, prov = open_results("profile", args.out, allow_dirty=args.allow_dirty,
                             tag="llama-cpp" + (f"-{args.tag}" if args.tag else ""))
    started = time.time()
    gguf = embedded_gguf()
    plain = LlamaCppRunner(gguf, context=args.prefix + 64, threads=args.threads)
    capture = LlamaCppRunner(gguf, context=max(args.prefix, CALIBRATION_TOKENS) + 64, threads=args.threads,
                             capture_hidden=True)
    head = int8_head_of(capture)
    prefix = torch.arange(1000, 1000 + args.prefix)
    for r in (plain, capture):
        r.forward(None, None, prefix, need_logits=False)
    rows = []
    for n in args.nodes:
        row = {"nodes": n}
        for mode in MODES if head is not None else MODES[:-1]:
            runner = capture if mode.startswith("hidden") else plain
            time_passes(runner, n, mode, 2, head=head)  # warm-up
            ts = time_passes(runner, n, mode, args.reps, head=head)
            row[mode] = {"median_ms": 1e3 * statistics.median(ts), "min_ms": 1e3 * min(ts), "max_ms": 1e3 * max(ts)}
        rows.append(row)
        print(f"n={n}: " + ", ".join(f"{m} {row[m]['median_ms']:.1f} ms" for m in MODES if m in row), flush=True)
    # the row sweep: k rows as asked (no even padding), every k once per round, rounds alternating in order
    exact = LlamaCppRunner(gguf, context=args.prefix + 64, threads=args.threads, even_outputs=False)
    exact.forward(None, None, prefix, need_logits=False)
    times: dict[int, list[float]] = {k: [] for k in args.rows}
    for rep in range(args.reps + 2):
        for k in (args.rows if rep % 2 == 0 else args.rows[::-1]):
            t = time_passes(exact, args.rows_of, "logits", 1, rows=k)
            if rep >= 2:  # two warm-up rounds
                times[k] += t
    sweep = [{"rows": k, "pass": {"median_ms": 1e3 * statistics.median(ts), "min_ms": 1e3 * min(ts),
                                  "max_ms": 1e3 * max(ts)}} for k, ts in times.items()]
    for row in sweep:
        print(f"{args.rows_of} nodes, {row['rows']} rows: {row['pass']['median_ms']:.1f} ms", flush=True)
    write_json(out / "profile.json", {"provenance": prov, "machine": machine_info(), "gguf": gguf.name,
                                      "settings": vars(args) | {"out": _relative(out)}, "rows": rows,
                                      "row_sweep": sweep})
    (out / "table.md").write_text(render(json.loads((out / "profile.json").read_text())))
    finish(out, started)
    print(f"results in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
