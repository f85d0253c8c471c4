"""What top-p / top-k cost treespec's plain decoding (issue 43: "plain with top-p 0.95 within 10% of its speed
without").

    python benchmarks/sampling_cost.py [--dtype auto] [--threads 2] [--per-category 2] [--new-tokens 48] [--rounds 3]

Two measurements on the embedded Gemma-3-270M, on tuning prompts (../shared/data/train, never the eval set):

1. **the filter alone**: :func:`treespec.sampling.logits_to_probs` on one row of real logits (262,144 entries) at
   T = 0.7, without a filter, with top-p 0.95, with top-k 50, and both (median of 200 calls each); beside it, in
   the same run, the kernels inside: the nucleus mask (:func:`~treespec.sampling.top_p_mask` and the sorting
   reference it is tested against) and the greedy verifier's argmax (:func:`~treespec.sampling.first_argmax`
   and ``torch.max``, which it used alone before);
2. **plain decoding**, paired per prompt: tokens per second after the prefill at T = 0.7 without a filter, with
   top-p 0.95, and at
   T = 1, the settings interleaved prompt by prompt and repeated ``--rounds`` times (each prompt's median), with
   the per-prompt ratio against T = 0.7 without a filter (median, bootstrap interval, sign test).

Writes ``results.json`` and ``table.md`` with provenance under ``benchmarks/results/profile/``. Timings need a
quiet machine (no other heavy process).
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

#: (name, temperature, top-k, top-p) of the decoding settings compared; the first is the baseline
SETTINGS = (("T=0.7", 0.7, 0, 1.0), ("T=0.7 top-p 0.95", 0.7, 0, 0.95), ("T=1", 1.0, 0, 1.0))
#: the filter settings timed alone
FILTERS = (("none", 0, 1.0), ("top-p 0.95", 0, 0.95), ("top-k 50", 50, 1.0), ("top-k 50 + top-p 0.95", 50, 0.95))
#: the kernels inside, timed on the same row (the nucleus on its T = 0.7 probabilities, the argmax on its logits)
KERNELS = ("top-p 0.95 mask: top_p_mask", "top-p 0.95 mask: sorting reference", "argmax: first_argmax",
           "argmax: torch.max")


def filter_cost(model, tok, calls: int = 200) -> list[dict]:
    """Median milliseconds of ``logits_to_probs`` on one row of the model's real logits per filter setting, and of
    each kernel of :data:`KERNELS` on the same row (checked equal to its reference there first)."""
    from functools import partial

    import torch

    from treespec.sampling import SamplingConfig, first_argmax, logits_to_probs, top_p_mask, top_p_mask_reference

    ids = torch.tensor([tok("The history of the printing press begins")["input_ids"]])
    row = model(ids).logits[0, -1:].float()  # [1, V]
    probs = logits_to_probs(row, SamplingConfig(0.7))  # [1, V]
    calls_of = {name: partial(logits_to_probs, row, SamplingConfig(0.7, top_k=top_k, top_p=top_p))
                for name, top_k, top_p in FILTERS}
    kernels = (partial(top_p_mask, probs, 0.95), partial(top_p_mask_reference, probs, 0.95), partial(first_argmax, row),
               lambda: torch.max(row, dim=-1).indices)
    if not torch.equal(kernels[0](), kernels[1]()) or not torch.equal(kernels[2](), kernels[3]()):
        raise AssertionError("a kernel disagrees with its reference on the timed row")
    calls_of.update(zip(KERNELS, kernels))
    out = []
    for name, call in calls_of.items():
        times = []
        for _ in range(calls + 5):
            t0 = time.perf_counter()
            call()
            times.append(time.perf_counter() - t0)
        out.append({"filter": name, "median_ms": 1e3 * statistics.median(times[5:])})
    return out


def decode_rows(model, tok, prompts: list[dict], new_tokens: int, rounds: int) -> list[dict]:
    """One row per (prompt, setting): the median tokens/s over ``rounds`` (settings interleaved)."""
    from treespec.generate import GenerationConfig, generate
    from treespec.models.fast import choose_runner
    from treespec.sampling import SamplingConfig

    runner = choose_runner(model, "auto")
    rows = []
    for i, prompt in enumerate(prompts):
        ids = tok(prompt["prompt"])["input_ids"]
        speeds: dict[str, list[float]] = {name: [] for name, *_ in SETTINGS}
        for r in range(rounds):
            order = SETTINGS[r % len(SETTINGS):] + SETTINGS[: r % len(SETTINGS)]
            for name, t, top_k, top_p in order:
                cfg = GenerationConfig(max_new_tokens=new_tokens, sampling=SamplingConfig(t, top_k=top_k, top_p=top_p),
                                       seed=1000 + i, stop_on_eos=False)
                res = generate(runner, ids, None, cfg)
                speeds[name].append(len(res.token_ids) / (res.wall_s - res.prefill_s))  # decoding only
        for name, values in speeds.items():
            rows.append({"prompt_id": prompt["id"], "setting": name, "tokens_per_s": statistics.median(values)})
        print(f"prompt {i + 1}/{len(prompts)}", file=sys.stderr, flush=True)
    return rows


def summarise(rows: list[dict]) -> list[dict]:
    from benchmarks.report import sign_test

    base = SETTINGS[0][0]
    by = {(r["prompt_id"], r["setting"]): r["tokens_per_s"] for r in rows}
    prompts = sorted({r["prompt_id"] for r in rows})
    out = []
    for name, *_ in SETTINGS:
        ratios = [by[(p, name)] / by[(p, base)] for p in prompts]
        sign = sign_test(ratios)
        lo, hi = bootstrap_ci(ratios)
        out.append({"setting": name, "tokens_per_s_median": statistics.median(by[(p, name)] for p in prompts),
                    "ratio_median": statistics.median(ratios), "ratio_ci95": [lo, hi], "faster": sign["wins"],
                    "slower": sign["losses"], "p_sign": sign["p_sign"], "prompts": len(prompts)})
    return out


def render(filters: list[dict], summary: list[dict], prov: dict, args: argparse.Namespace, dtype: str) -> str:
    lines = [f"# Sampling cost of plain decoding (commit {prov['commit_short']})", "",
             f"- Command: `{prov['command']['shell']}`", f"- Machine: {host_name(prov['machine'])}",
             f"- Embedded Gemma-3-270M, {dtype}, {args.threads} threads; {summary[0]['prompts']} tuning prompts x "
             f"{args.new_tokens} tokens, {args.rounds} rounds (settings interleaved, each prompt's median).", "",
             "| filter (or kernel) on one row (V = 262,144), T = 0.7 | median ms |", "|---|---|"]
    lines += [f"| {f['filter']} | {f['median_ms']:.3f} |" for f in filters]
    lines += ["", f"| plain decoding | tok/s (median of prompts) | over {SETTINGS[0][0]}, per prompt: median [95% CI] "
              "| faster / slower | sign-test p |", "|---|---|---|---|---|"]
    for r in summary:
        lo, hi = r["ratio_ci95"]
        lines.append(f"| {r['setting']} | {r['tokens_per_s_median']:.1f} | {r['ratio_median']:.3f} [{lo:.3f}, "
                     f"{hi:.3f}] | {r['faster']} / {r['slower']} | {r['p_sign']:.3g} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="auto", help="auto (bf16 where the CPU computes it natively), bfloat16, float32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--per-category", type=int, default=2, help="tuning prompts per category (default 2)")
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    add_output_args(ap)
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.new_tokens < 1 or args.per_category < 1:
        ap.error("--rounds, --new-tokens and --per-category must be >= 1")
    import torch

    from treespec.models.loading import load_model, load_tokenizer, resolve_dtype

    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    started = time.time()
    out, prov = open_results_from_args("profile", args, tag="sampling-cost")
    dtype = resolve_dtype(args.dtype)
    model, tok = load_model("embedded", dtype=dtype), load_tokenizer("embedded")
    filters = filter_cost(model, tok)
    rows = decode_rows(model, tok, load_train_prompts(args.per_category), args.new_tokens, args.rounds)
    summary = summarise(rows)
    dtype_word = str(dtype).replace("torch.", "")
    write_json(out / "results.json", {"filters": filters, "rows": rows, "summary": summary, "dtype": dtype_word})
    (out / "table.md").write_text(render(filters, summary, prov, args, dtype_word))
    finish(out, started)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
