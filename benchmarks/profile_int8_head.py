"""The 8-bit LM head (``--quantize int8-head``): how far its model is from the float32 one, and what a pass costs.

    python benchmarks/profile_int8_head.py [--threads 2] [--per-category 1] [--new-tokens 40] [--passes 15]

On the embedded Gemma-3-270M and tuning prompts (../shared/data/train, never the eval set):

1. **distance from the float32 model**: the float32 target continues each prompt greedily for ``--new-tokens``
   tokens; on those positions (teacher forced), each target's next-token distribution is compared with the
   float32 one: KL(float32 || target) (mean and 95th percentile) and top-1 agreement. Targets: bf16 (the CLI
   default's PyTorch target), bf16 with the 8-bit head, float32 with the 8-bit head, and llama.cpp on the GGUF the
   model was de-quantised from (the whole model: Q4_K_M weights, 8-bit activations in every product), where
   llama-cpp-python is installed;
2. **pass cost** t(n): a chain of n tokens after a 100-token prefix, for the bf16 and float32 targets with and
   without the 8-bit head (median of ``--passes``), and the LM head alone on n rows (float32 is the dtype
   ``--dtype auto`` gives on CPUs without native bf16).

The table names the head's activation codes (8 bits, or 7 where oneDNN's int8 kernel adds pairs of products in
16 saturating bits: :func:`treespec.models.fast.int8_head.activation_levels`).

Writes ``results.json`` and ``table.md`` with provenance under ``benchmarks/results/profile/``. Timings need a
quiet machine.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import (add_output_args, finish, host_name, load_train_prompts,  # noqa: E402
                               open_results_from_args, write_json)

ROWS = (1, 2, 4, 8, 16)


def distances(prompts: list[dict], new_tokens: int, threads: int) -> list[dict]:
    """KL(float32 || target) and top-1 agreement on the float32 model's own greedy continuations."""
    import torch

    from treespec.models.fast import make_runner
    from treespec.models.llama_cpp import LlamaCppRunner, llama_cpp_available
    from treespec.models.loading import embedded_gguf, load_model, load_tokenizer

    tok = load_tokenizer("embedded")
    m32, m16 = load_model("embedded", dtype="float32"), load_model("embedded", dtype="bfloat16")
    targets = {"float32": make_runner(m32, fast=True), "bfloat16": make_runner(m16, fast=True),
               "bfloat16, int8 head": make_runner(m16, quantize="int8-head"),
               "float32, int8 head": make_runner(m32, quantize="int8-head")}
    if llama_cpp_available() is None:
        targets["llama.cpp (Q4_K_M GGUF)"] = LlamaCppRunner(embedded_gguf(), threads=threads)
    kl: dict[str, list] = {k: [] for k in targets if k != "float32"}
    agree: dict[str, list] = {k: [] for k in kl}
    ref_runner = targets["float32"]
    for i, prompt in enumerate(prompts):
        ids = torch.tensor(tok(prompt["prompt"])["input_ids"][:96])
        ref_runner.reset()
        logits = ref_runner.forward(None, None, chain=ids)["logits"]
        seq = ids.tolist()
        for _ in range(new_tokens):
            seq.append(int(logits[-1].argmax()))
            logits = ref_runner.forward(None, None, chain=torch.tensor(seq[-1:]))["logits"]
        full = torch.tensor(seq)
        outs = {}
        for name, runner in targets.items():
            runner.reset()
            outs[name] = runner.forward(None, None, chain=full)["logits"][len(ids) - 1:].float()  # [new + 1, V]
        ref = outs["float32"].log_softmax(-1)
        for name in kl:
            lp = outs[name].log_softmax(-1)
            kl[name].append((ref.exp() * (ref - lp)).sum(-1))
            agree[name].append((lp.argmax(-1) == ref.argmax(-1)).float())
        print(f"distance: prompt {i + 1}/{len(prompts)}", file=sys.stderr, flush=True)
    out = []
    for name in kl:
        k, a = torch.cat(kl[name]), torch.cat(agree[name])
        out.append({"target": name, "kl_mean": float(k.mean()), "kl_p95": float(k.quantile(0.95)),
                    "top1_agreement": float(a.mean()), "positions": int(k.numel())})
    return out


def _median_ms(fn, passes: int) -> float:
    times = []
    for _ in range(passes + 2):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times[2:])


def pass_costs(passes: int) -> list[dict]:
    """t(n) of a chain of n tokens after a 100-token prefix, and of the LM head alone on n rows."""
    import torch

    from treespec.models.fast import make_runner
    from treespec.models.loading import load_model

    runners = {}
    for dtype, word in ((torch.bfloat16, "bf16"), (torch.float32, "float32")):
        model = load_model("embedded", dtype=dtype)
        runners[word] = make_runner(model, fast=True)
        runners[f"{word}, int8 head"] = make_runner(model, quantize="int8-head")
    prefix = torch.randint(0, 10_000, (100,), generator=torch.Generator().manual_seed(0))
    rows = []
    for n in ROWS:
        chain = torch.arange(n) + 5
        for name, runner in runners.items():
            runner.reset()
            runner.forward(None, None, chain=prefix)
            base = runner.book.length

            def one_pass(runner=runner, base=base):
                runner.forward(None, None, chain=chain)
                runner.kv.used, runner.book.length = base, base  # drop the pass again: same prefix every time

            hidden = torch.randn(n, runner.lm_head.shape[1], dtype=runner.dtype)
            rows.append({"target": name, "n": n, "pass_ms": _median_ms(one_pass, passes),
                         "head_ms": _median_ms(lambda runner=runner: runner.logits(hidden), passes)})
    return rows


def render(dist: list[dict], costs: list[dict], prov: dict, args: argparse.Namespace, prompts: int,
           act_levels: int) -> str:
    lines = [f"# The 8-bit LM head (commit {prov['commit_short']})", "",
             f"- Command: `{prov['command']['shell']}`", f"- Machine: {host_name(prov['machine'])}",
             f"- Embedded Gemma-3-270M, {args.threads} threads; {prompts} tuning prompts, the float32 model's greedy "
             f"continuation of {args.new_tokens} tokens each (teacher forced).",
             f"- The 8-bit head's activation codes: -{act_levels}..{act_levels} "
             f"({'8 bits' if act_levels > 63 else '7 bits: this kernel adds pairs of products in 16 bits'}).", "",
             "| target | KL(float32 \\|\\| target), mean | KL, 95th percentile | top-1 agreement with float32 | "
             "positions |", "|---|---|---|---|---|"]
    lines += [f"| {d['target']} | {d['kl_mean']:.5f} | {d['kl_p95']:.5f} | {d['top1_agreement']:.4f} | "
              f"{d['positions']} |" for d in dist]
    lines += ["", f"Pass cost after a 100-token prefix (median of {args.passes}, ms):", "",
              "| dtype | n tokens | pass | pass with the int8 head | ratio | LM head | int8 LM head |",
              "|---|---|---|---|---|---|---|"]
    by = {(c["target"], c["n"]): c for c in costs}
    for word in ("bf16", "float32"):
        for n in ROWS:
            a, b = by[(word, n)], by[(f"{word}, int8 head", n)]
            lines.append(f"| {word} | {n} | {a['pass_ms']:.1f} | {b['pass_ms']:.1f} | "
                         f"{b['pass_ms'] / a['pass_ms']:.2f} | {a['head_ms']:.1f} | {b['head_ms']:.1f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--per-category", type=int, default=1, help="tuning prompts per category (default 1)")
    ap.add_argument("--new-tokens", type=int, default=40)
    ap.add_argument("--passes", type=int, default=15)
    add_output_args(ap)
    args = ap.parse_args(argv)
    if args.passes < 1 or args.new_tokens < 1 or args.per_category < 1:
        ap.error("--passes, --new-tokens and --per-category must be >= 1")
    import torch

    from treespec.models.fast.int8_head import activation_levels

    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    started = time.time()
    out, prov = open_results_from_args("profile", args, tag="int8-head")
    prompts = load_train_prompts(args.per_category)
    costs = pass_costs(args.passes)
    dist = distances(prompts, args.new_tokens, args.threads)
    levels = activation_levels()
    write_json(out / "results.json", {"distance": dist, "pass_costs": costs, "act_levels": levels})
    (out / "table.md").write_text(render(dist, costs, prov, args, len(prompts), levels))
    finish(out, started)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
