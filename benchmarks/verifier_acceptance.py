"""Tokens per target pass of the shipped head's draft (a chain, or a tree with ``--tree``; i.i.d., or under another
draft law with ``LAW/VERIFIER``) under each verifier that takes it, paired per prompt.

The embedded Gemma-3-270M generates on tuning prompts (../shared/data/train, never the eval set) with the shipped
head's sampled-temperature settings (a chain drawn i.i.d. from q, stopped by the head's confidence), once per
verifier and temperature setting, with the same seed per prompt. Acceptance does not depend on timing, so this runs
on a busy machine too. For each setting: tokens per target pass (tau) per verifier, and per prompt the ratio of
each verifier's tau to the first one's, its median with a bootstrap interval and the sign test::

    python benchmarks/verifier_acceptance.py --per-category 4 --max-new-tokens 64 --verifiers single block
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import (add_output_args, bootstrap_ci, finish, host_name, load_train_prompts,  # noqa: E402
                               open_results_from_args, write_json)

#: (name, temperature, top-p): the sampled settings users run
SETTINGS = (("T=1", 1.0, 1.0), ("T=0.7/top-p 0.95", 0.7, 0.95))


def split_variant(variant: str) -> tuple[str, str]:
    """``"law/verifier"`` (e.g. ``greedy_draft/greedy_draft``) or a verifier name alone (drafted i.i.d.)."""
    law, _, name = variant.rpartition("/")
    return law or "iid", name


def measure(model, tok, prompts: list[dict], verifiers: list[str], max_new: int, dtype: str,
            tree: tuple[int, ...] | None) -> list[dict]:
    """One generation per (setting, prompt, verifier); rows with tokens and target passes."""
    from treespec.drafters import DraftOptions, build_drafter
    from treespec.generate import GenerationConfig, generate
    from treespec.sampling import SamplingConfig

    rows = []
    for label, temperature, top_p in SETTINGS:
        drafters = {}  # one drafter per draft law: "law/verifier" variants draft under their own law
        for variant in verifiers:
            law, _ = split_variant(variant)
            if law not in drafters:
                drafters[law] = build_drafter("head", model, DraftOptions(tree=tree, law=law), temperature=temperature,
                                              tokenizer=tok, dtype=dtype)
        for i, prompt in enumerate(prompts):
            ids = tok(prompt["prompt"])["input_ids"]
            for verifier in verifiers:
                law, name = split_variant(verifier)
                cfg = GenerationConfig(max_new_tokens=max_new, sampling=SamplingConfig(temperature, top_p=top_p),
                                       seed=1000 + i, stop_on_eos=False, verifier=name)
                res = generate(model, ids, drafters[law], cfg)
                calls = res.summary()["target_calls"]
                rows.append({"setting": label, "prompt_id": prompt["id"], "verifier": verifier,
                             "tokens": len(res.token_ids), "target_calls": calls,
                             "tau": len(res.token_ids) / calls})
            print(f"{label}: prompt {i + 1}/{len(prompts)}", file=sys.stderr, flush=True)
    return rows


def summarise(rows: list[dict], verifiers: list[str]) -> list[dict]:
    """Per setting and verifier: pooled tau, and the per-prompt tau ratio against the first verifier."""
    from benchmarks.report import sign_test

    out = []
    base = verifiers[0]
    for label, _, _ in SETTINGS:
        mine = [r for r in rows if r["setting"] == label]
        by = {(r["prompt_id"], r["verifier"]): r for r in mine}
        for v in verifiers:
            own = [r for r in mine if r["verifier"] == v]
            pooled = sum(r["tokens"] for r in own) / sum(r["target_calls"] for r in own)
            ratios = [by[(r["prompt_id"], v)]["tau"] / r["tau"] for r in mine if r["verifier"] == base]
            lo, hi = bootstrap_ci(ratios)
            out.append({"setting": label, "verifier": v, "tau_pooled": pooled, "ratio_median": statistics.median(ratios),
                        "ratio_ci95": [lo, hi], **sign_test(ratios), "prompts": len(ratios)})
    return out


def render(summary: list[dict], prov: dict, args: argparse.Namespace, base: str) -> str:
    shape = "a chain" if args.tree is None or "," not in args.tree else f"the tree {args.tree}"
    lines = [f"# Draft laws and verifiers of the head's draft ({shape}): tokens per target pass "
             f"(commit {prov['commit_short']})", "",
             f"- Command: `{prov['command']['shell']}`",
             f"- Machine: {host_name(prov['machine'])}", f"- dtype {args.dtype}; the shipped head's sampled "
             f"settings (tree {args.tree or 'default'}); {summary[0]['prompts']} tuning prompts x {args.max_new_tokens} new tokens; seed 1000 + prompt "
             f"index, the same for every verifier.", "",
             f"| setting | verifier | tau (pooled) | tau over {base}'s, per prompt: median [95% CI] | higher / lower "
             f"| sign-test p |", "|---|---|---|---|---|---|"]
    for r in summary:
        lo, hi = r["ratio_ci95"]
        lines.append(f"| {r['setting']} | {r['verifier']} | {r['tau_pooled']:.3f} | {r['ratio_median']:.3f} "
                     f"[{lo:.3f}, {hi:.3f}] | {r['wins']} / {r['losses']} | {r['p_sign']:.3g} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--per-category", type=int, default=4, help="tuning prompts per category (default 4)")
    ap.add_argument("--max-new-tokens", type=int, default=64, help="default 64")
    ap.add_argument("--verifiers", nargs="+", default=["single", "block"],
                    help="verifiers of the head's i.i.d. draft: single and block (chains), rrs and traversal (any "
                         "--tree); or LAW/VERIFIER to draft under another law, e.g. greedy_draft/greedy_draft or "
                         "without_replacement/rrs_without_replacement; the first is the baseline of the ratios "
                         "(default: single block)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="default float32")
    ap.add_argument("--tag", default="chain-verifiers", help="results folder suffix (default chain-verifiers)")
    ap.add_argument("--tree", default=None, help="the head's shape: a chain length, e.g. 6, or per-depth widths, e.g. "
                                                 "2,2,1 (default: the shipped head's chain)")
    add_output_args(ap)
    args = ap.parse_args(argv)
    from treespec.models.loading import load_model, load_tokenizer

    started = time.time()
    out, prov = open_results_from_args("tuning", args, tag=args.tag)
    prompts = load_train_prompts(args.per_category)
    print(f"loading the embedded model ({args.dtype})", file=sys.stderr, flush=True)
    model, tok = load_model("embedded", dtype=args.dtype), load_tokenizer("embedded")
    rows = measure(model, tok, prompts, args.verifiers, args.max_new_tokens, args.dtype,
                   None if args.tree is None else tuple(int(x) for x in args.tree.split(",")))
    summary = summarise(rows, args.verifiers)
    write_json(out / "rows.json", rows)
    write_json(out / "summary.json", summary)
    (out / "table.md").write_text(render(summary, prov, args, args.verifiers[0]))
    finish(out, started)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
