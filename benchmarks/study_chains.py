"""Real-model chain and tree study: token-level and block verification beside a chain's prefix bound, rrs and
traversal verification on a tree (ot_bounds.chains, ot_bounds.trees).

    python benchmarks/study_chains.py                   # 2 tuning prompts / category x 96 tokens, shipped head
    python benchmarks/study_chains.py --small           # 1 prompt / category, 8 tokens (tests)

Target p: the embedded Gemma-3-270M (float32); draft q: the shipped head one step ahead from the target's own
hidden states (as ``benchmarks/study_real_model.py --draft head`` collects them; q = 0 outside its vocabulary
subset). Positions: held-out tuning prompts of ../shared/data/train (``load_train_prompts``; never the eval
set), each continued by ``--new-tokens`` tokens sampled from the target at ``--gen-temperature`` (seeded).

At each position and temperature T (p and q both at T, no top-p) the chain model of :mod:`ot_bounds.chains`:
``d`` drafts drawn i.i.d. from that position's q, verified against that position's p at every depth (the
stationary model: a real chain's later positions have laws of their own). Per position: token-level
verification's exact ``E[tau]``; block verification's and the prefix bound's, each the mean of the exact
``E[tau | X]`` over ``--samples`` drafted blocks (seed = the position's index, the same blocks for both, and
token-level verification's sampled value from those blocks too, for the paired difference). On every
``--tree-every``-th position, the tree of ``--tree-widths`` (children per node at each depth) in the same model:
``rrs``'s exact expected accepted length, traversal verification's (the mean over ``--tree-samples`` drafted trees
of its exact value given each, seeded by position) and the node-local bound of ``tree_acceptance_upper_bound``
(which path verifiers may pass). The optimum of every verifier (``lp_tree_optimal_acceptance``) needs a small
vocabulary and is not computed here. Writes
``summary.json`` and ``summary.md`` (+ ``provenance.json``) to ``--out`` (default
``benchmarks/results/ot_study/<date>-<commit>-chains/``).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import add_output_args, finish, load_train_prompts, open_results, write_json  # noqa: E402
from benchmarks.study_real_model import collect  # noqa: E402
from ot_bounds import optimal_node_acceptance, sample_tree_acceptance, tree_acceptance  # noqa: E402
from ot_bounds import tree_acceptance_upper_bound  # noqa: E402
from ot_bounds.chains import chain_acceptance, sample_chain_acceptance  # noqa: E402

#: per-position quantities, in summary order
COLUMNS = ("token", "token_sampled", "block", "bound", "block_minus_token")


def evaluate_position(p: np.ndarray, q: np.ndarray, depths: list[int], samples: int, seed: int) -> dict:
    """depth -> {column: value} at one position (p, q: float64 rows of one temperature)."""
    out = {}
    for d in depths:
        block = sample_chain_acceptance(p, q, d, "block", samples=samples, seed=seed)
        token_s = sample_chain_acceptance(p, q, d, "token", samples=samples, seed=seed)  # the same blocks
        bound = sample_chain_acceptance(p, q, d, "bound", samples=samples, seed=seed)
        out[d] = {"token": chain_acceptance(p, q, d, "token"), "token_sampled": token_s.mean, "block": block.mean,
                  "bound": bound.mean, "block_minus_token": block.mean - token_s.mean}
    return out


#: per-position tree quantities
TREE_COLUMNS = ("rrs", "traversal", "node_local_bound", "traversal_minus_rrs")


def _mean_stderr(values: np.ndarray) -> dict:
    """Mean over positions and its standard error (0 for one position)."""
    n = values.size
    return {"mean": float(values.mean()), "stderr": float(values.std(ddof=1) / np.sqrt(n)) if n > 1 else 0.0}


def widths_parents(widths: list[int]) -> list[int]:
    """Children per node at each depth -> parent array (every node of a depth has the same number of children)."""
    parents, level = [], [-1]
    for w in widths:
        nxt = []
        for node in level:
            for _ in range(w):
                parents.append(node)
                nxt.append(len(parents) - 1)
        level = nxt
    return parents


def evaluate_tree(p: np.ndarray, q: np.ndarray, parents: list[int], samples: int, seed: int) -> dict:
    width = max(np.bincount(np.array(parents) + 1))
    rrs = tree_acceptance(parents, p, q, "rrs")
    trav = sample_tree_acceptance(parents, p, q, samples=samples, seed=seed)
    bound = tree_acceptance_upper_bound(parents, optimal_node_acceptance(p, q, int(width), "iid"))
    return {"rrs": rrs, "traversal": trav.mean, "traversal_stderr": trav.stderr, "node_local_bound": bound,
            "traversal_minus_rrs": trav.mean - rrs}


def summarise_trees(rows: list[dict], temps: list[float]) -> dict:
    out = {}
    for temp in temps:
        vals = {c: np.array([r[temp][c] for r in rows]) for c in TREE_COLUMNS}
        cell = {c: _mean_stderr(v) for c, v in vals.items()}
        se = np.array([r[temp]["traversal_stderr"] for r in rows])
        # a position's traversal value is a sampled mean: count it above the bound only by 3 of its standard errors
        cell["positions_traversal_above_node_local_bound_3se"] = int(np.sum(
            vals["traversal"] - vals["node_local_bound"] > 3 * se))
        cell["positions"] = len(rows)
        out[f"T={temp}"] = cell
    return out


def summarise(rows: list[dict], temps: list[float], depths: list[int]) -> dict:
    """Means over positions and their standard errors (over positions) per (T, depth)."""
    out: dict = {}
    for temp in temps:
        for d in depths:
            vals = {c: np.array([r[temp][d][c] for r in rows]) for c in COLUMNS}
            cell = {c: _mean_stderr(v) for c, v in vals.items()}
            cell["block_over_bound"] = float(vals["block"].mean() / vals["bound"].mean())
            cell["token_over_bound"] = float(vals["token"].mean() / vals["bound"].mean())
            cell["positions_block_below_token"] = int(np.sum(vals["block_minus_token"] < 0))
            out[f"T={temp}/d={d}"] = cell
    return out


def markdown_trees(trees: dict, settings: dict) -> list[str]:
    lines = ["", f"## Tree of widths {settings['tree_widths']} ({len(settings['tree_parents'])} nodes): rrs and "
             f"traversal verification", "",
             f"One position in {settings['tree_every']}; traversal: the mean over {settings['tree_samples']} drafted "
             "trees per position; the node-local bound holds for rrs, not for traversal (a position counts above it "
             "only by 3 of its standard errors).", "",
             "| T | positions | rrs (exact) | traversal | traversal - rrs | node-local bound | "
             "positions traversal > node-local bound by 3 s.e. |", "|---:|---:|---:|---:|---:|---:|---:|"]
    for key, cell in trees.items():
        lines.append(f"| {key[2:]} | {cell['positions']} | {cell['rrs']['mean']:.4f} | {cell['traversal']['mean']:.4f} "
                     f"({cell['traversal']['stderr']:.4f}) | {cell['traversal_minus_rrs']['mean']:+.4f} "
                     f"({cell['traversal_minus_rrs']['stderr']:.4f}) | {cell['node_local_bound']['mean']:.4f} | "
                     f"{cell['positions_traversal_above_node_local_bound_3se']} |")
    return lines


def markdown(summary: dict, settings: dict, trees: dict | None = None) -> str:
    lines = [
        "# Chain study: token-level and block verification beside the prefix bound, Gemma-3-270M target",
        "",
        f"- commit: `{settings['commit']}`; date (UTC): {settings['date']}; runtime {settings['runtime_s']:.0f} s",
        f"- machine: {settings['machine']['cpu']}, {settings['machine']['cores']} cores",
        f"- target: embedded Gemma-3-270M float32; draft: {settings['draft']}",
        f"- positions: {settings['positions']} ({settings['per_category']} held-out tuning prompts per category, "
        f"{settings['new_tokens']} tokens sampled at T = {settings['gen_temperature']}, seed {settings['seed']})",
        f"- model: d i.i.d. drafts from each position's q against its p at every depth (ot_bounds.chains); "
        f"block and bound are means over {settings['samples']} drafted blocks per position (seeded by position)",
        "- E[tau] = expected kept drafts (the bonus / recovered token not counted); means over positions "
        "(standard error over positions in brackets)",
        "",
        "| T | d | token (exact) | block | prefix bound | block - token (paired) | block / bound | "
        "token / bound | positions block < token |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for key, cell in summary.items():
        temp, d = key.split("/")
        lines.append(
            f"| {temp[2:]} | {d[2:]} | {cell['token']['mean']:.4f} | {cell['block']['mean']:.4f} "
            f"({cell['block']['stderr']:.4f}) | {cell['bound']['mean']:.4f} | "
            f"{cell['block_minus_token']['mean']:+.4f} ({cell['block_minus_token']['stderr']:.4f}) | "
            f"{cell['block_over_bound']:.3f} | {cell['token_over_bound']:.3f} | "
            f"{cell['positions_block_below_token']} |")
    if trees:
        lines += markdown_trees(trees, settings)
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--per-category", type=int, default=2, help="held-out tuning prompts per category")
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--gen-temperature", type=float, default=0.7)
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.7, 1.0])
    ap.add_argument("--depths", type=int, nargs="+", default=[2, 3, 4, 6])
    ap.add_argument("--samples", type=int, default=2000, help="drafted blocks per position")
    ap.add_argument("--tree-widths", type=int, nargs="+", default=[2, 2, 1],
                    help="children per node at each depth of the tree")
    ap.add_argument("--tree-every", type=int, default=8, help="the tree part on every n-th position")
    ap.add_argument("--tree-samples", type=int, default=200, help="drafted trees per position")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--small", action="store_true", help="1 prompt per category, 8 tokens, 200 blocks")
    add_output_args(ap)
    return ap


def main(argv=None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.small:
        args.per_category, args.new_tokens, args.samples, args.tree_samples, args.tree_every = 1, 8, 200, 50, 4
    bad = [d for d in args.depths if d < 1] + ([args.samples] if args.samples < 2 else [])
    if bad or any(t <= 0 for t in args.temperatures):
        ap.error("--depths must be >= 1, --samples >= 2 and --temperatures > 0")
    if any(w < 1 for w in args.tree_widths) or args.tree_every < 1 or args.tree_samples < 2:
        ap.error("--tree-widths must be >= 1, --tree-every >= 1 and --tree-samples >= 2")
    parents = widths_parents(args.tree_widths)
    prompts = load_train_prompts(args.per_category)  # read before a results folder exists
    out, prov = open_results("ot_study", args.out, allow_dirty=args.allow_dirty, tag="chains")
    torch.set_num_threads(args.threads)
    t0 = time.time()
    from treespec.drafting.shipped import load_default_head
    from treespec.models.loading import load_model, load_tokenizer

    model = load_model("embedded", dtype="float32")
    tok = load_tokenizer("embedded")
    head = load_default_head(model)
    rows: list[dict] = []
    tree_rows: list[dict] = []
    for sub, target, draft in collect(model, tok, prompts, 0, args.new_tokens, args.gen_temperature, args.seed,
                                      head):
        for t in range(target.shape[0]):
            row, tree_row = {}, {}
            for temp in args.temperatures:
                p = torch.softmax(target[t].double() / temp, dim=-1).numpy()
                q = torch.softmax(draft[t].double() / temp, dim=-1).numpy()
                row[temp] = evaluate_position(p, q, args.depths, args.samples, seed=len(rows))
                if len(rows) % args.tree_every == 0:
                    tree_row[temp] = evaluate_tree(p, q, parents, args.tree_samples, seed=len(rows))
            rows.append(row)
            if tree_row:
                tree_rows.append(tree_row)
        print(f"{sub}: {len(rows)} positions, {time.time() - t0:.0f} s", flush=True)
    summary = summarise(rows, args.temperatures, args.depths)
    trees = summarise_trees(tree_rows, args.temperatures) if tree_rows else {}
    settings = {
        "commit": prov["commit_short"] + ("-dirty" if prov["dirty"] else ""),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), "machine": prov["machine"],
        "per_category": args.per_category, "prompt_ids": [str(p.get("id", "")) for p in prompts],
        "new_tokens": args.new_tokens, "gen_temperature": args.gen_temperature, "temperatures": args.temperatures,
        "depths": args.depths, "samples": args.samples, "seed": args.seed, "positions": len(rows),
        "runtime_s": time.time() - t0, "tree_widths": args.tree_widths, "tree_parents": parents,
        "tree_every": args.tree_every, "tree_samples": args.tree_samples,
        "draft": f"the shipped head ({head.num_trained_parameters / 1e6:.2f}M parameters, vocabulary subset "
                 f"{head.vocab_ids.numel()}), one step ahead from the target's hidden states",
    }
    write_json(out / "summary.json", {"settings": settings, "cells": summary, "trees": trees})
    (out / "summary.md").write_text(markdown(summary, settings, trees))
    print(markdown(summary, settings, trees))
    finish(out, t0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
