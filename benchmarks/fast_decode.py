"""Plain decoding speed: Hugging Face ``generate`` vs treespec's eager runner vs the fast runner.

    python benchmarks/fast_decode.py [--dtype bfloat16] [--threads 2] [--new-tokens 64] [--repeats 3]

Greedy, no drafter, the same prompt; tokens/s are medians of ``--repeats`` runs (after one warm-up
run each), runs interleaved so that machine noise hits every variant alike. Also checks that the
three produce the same tokens (fp32: must; bf16: reported). Writes ``results.json`` and
``results.md`` under ``benchmarks/results/fast_decode/<date>-<commit>/``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import add_output_args, finish, open_results, write_json  # noqa: E402
from treespec.generate import GenerationConfig, generate  # noqa: E402
from treespec.models.fast import FastGemmaRunner  # noqa: E402
from treespec.models.loading import load_model, load_tokenizer  # noqa: E402
from treespec.models.runner import ModelRunner  # noqa: E402
from treespec.sampling import SamplingConfig  # noqa: E402

PROMPT = "The history of the Roman Empire begins with"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompt", default=PROMPT)
    ap.add_argument("--tag", default=None)
    add_output_args(ap)
    args = ap.parse_args(argv)
    started = time.time()
    out, prov = open_results("fast_decode", args.out, allow_dirty=args.allow_dirty, tag=args.tag)
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    model, tok = load_model("embedded", dtype=args.dtype), load_tokenizer("embedded")
    ids = tok(args.prompt)["input_ids"]
    n = args.new_tokens
    config = GenerationConfig(max_new_tokens=n, sampling=SamplingConfig(0.0), stop_on_eos=False)
    eager, fast = ModelRunner(model), FastGemmaRunner(model)

    def hf():
        x = torch.tensor([ids])
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False)
        return out[0, len(ids):].tolist()

    variants = {"hf_generate": hf,
                "treespec_eager": lambda: generate(eager, ids, None, config).token_ids,
                "treespec_fast": lambda: generate(fast, ids, None, config).token_ids}
    tokens, times = {}, {k: [] for k in variants}
    warmup_s = {}
    for name, fn in variants.items():  # warm-up (and first-call costs) apart
        t0 = time.perf_counter()
        tokens[name] = fn()
        warmup_s[name] = time.perf_counter() - t0
        print(f"warm-up {name}: {warmup_s[name]:.2f} s", flush=True)
    for _ in range(args.repeats):
        for name, fn in variants.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    rows = {name: {"tokens_per_s": n / statistics.median(ts), "median_s": statistics.median(ts), "runs_s": ts,
                   "tokens_per_s_min": n / max(ts), "tokens_per_s_max": n / min(ts), "warmup_s": warmup_s[name]}
            for name, ts in times.items()}
    same = {name: tokens[name] == tokens["hf_generate"] for name in variants}
    base = rows["hf_generate"]["tokens_per_s"]
    meta = {"provenance": prov, "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}}
    write_json(out / "results.json", {"meta": meta, "rows": rows, "same_tokens_as_hf": same})
    flags = ", ".join(f for f, on in prov["machine"]["cpu_flags"].items() if on) or "no AVX-512 / bf16 flags"
    lines = [f"# Plain greedy decoding, Gemma-3-270M {args.dtype}, {args.threads} threads, {n} new tokens", "",
             f"commit {prov['commit_short']}{' (dirty)' if prov['dirty'] else ''}; {prov['machine']['cpu']} ({flags}); "
             f"median of {args.repeats} interleaved runs (min-max in brackets), warm-up apart", "",
             "| variant | tokens/s | x HF generate | same tokens as HF | warm-up s |", "|---|---|---|---|---|"]
    lines += [f"| {name} | {r['tokens_per_s']:.1f} [{r['tokens_per_s_min']:.1f}-{r['tokens_per_s_max']:.1f}] | "
              f"{r['tokens_per_s'] / base:.2f} | {same[name]} | {r['warmup_s']:.1f} |" for name, r in rows.items()]
    (out / "results.md").write_text("\n".join(lines) + "\n")
    finish(out, started)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
