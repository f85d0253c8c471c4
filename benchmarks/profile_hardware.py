"""Hardware profile: target verify cost t(n)/t(1) for n tree tokens, the draft step cost, and the
bandwidth reference (the time to read every target weight byte once, measured in the same run).

    python benchmarks/profile_hardware.py [--dtype float32] [--threads 2] [--draft early-exit:12] [--fast]
    python benchmarks/profile_hardware.py --dtype bfloat16 --compare     # eager runner vs fast runner
    python benchmarks/profile_hardware.py --dtype bfloat16 --compare --quantize int4   # + the 4-bit target
    python benchmarks/profile_hardware.py --dtype bfloat16 --fast --sizes 1,4,8,16 --verification  # + T=1 verification

``--fast`` profiles the fast runner (``treespec.models.fast``: lean forward, static KV cache);
``--compare`` profiles both runners on the same loaded model, one after the other.

Saves ``profile.json`` (a :class:`treespec.trees.sequoia.HardwareProfile`, reusable by the Sequoia
chooser) and ``profile.md`` under ``benchmarks/results/profile/<date>-<commit>/``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import add_output_args, finish, host_name, open_results, write_json  # noqa: E402
from treespec.models.loading import load_draft_model, load_model  # noqa: E402
from treespec.calibration import measure_profile  # noqa: E402


CORPUS = Path(__file__).resolve().parent.parent / "corpora" / "head-v2" / "continuations" / "v2-greedy"


@torch.no_grad()
def quantised_agreement(target, quantize: str, rows: int = 6, tokens: int = 200) -> dict:
    """How close the quantised target is to the unquantised one: top-1 agreement and mean KL(p || p_q)
    of the next-token distributions, teacher-forced on the first ``tokens`` ids of ``rows`` of the
    target's own greedy continuations of train prompts (the committed head-v2 corpus; never eval data)."""
    from treespec.distill.continuations import chunk_path, read_chunk_rows
    from treespec.models.fast import make_runner

    seqs = [r["continuation"][:tokens] for r in read_chunk_rows(CORPUS, 0, 10**9)[:rows]]
    full, quant = make_runner(target, fast=True), make_runner(target, quantize=quantize)
    agree = kl = n = 0
    for seq in seqs:
        logp = []
        for runner in (full, quant):
            runner.reset()
            logp.append(torch.log_softmax(runner.forward(None, None, torch.tensor(seq))["logits"], -1))
        agree += int((logp[0].argmax(-1) == logp[1].argmax(-1)).sum())
        kl += float((logp[0].exp() * (logp[0] - logp[1])).sum())
        n += len(seq)
    return {"positions": n, "top1_agreement": agree / n, "mean_kl_nats": kl / n, "source": chunk_path(CORPUS, 0).name}


#: rows of the product that measures the machine's arithmetic rate (enough to be compute-bound)
PEAK_ROWS = 512


@torch.no_grad()
def component_times(target, quantize: str | None = None, sizes: tuple[int, ...] = (1, 16), rounds: int = 9,
                    prefix: int = 128) -> dict:
    """Where a fast-runner tree pass of n tokens goes, medians over interleaved rounds (ms): the whole
    pass (logits included), the body (the pass without logits: inputs, masks, embedding, decoder
    layers, final norm, bookkeeping), the LM head product alone on n hidden rows, and the LM head's
    arithmetic rate (GFLOP/s, 2 n V H flops); ``rest`` = pass - body - LM head: what producing the
    logits costs besides the product (float32 copy, NaN check), plus the noise of separate timings."""
    import statistics

    from treespec.models.fast import make_runner
    from treespec.tree import TokenTree

    runner = make_runner(target, fast=True, quantize=quantize)
    runner.reset()
    runner.forward(None, None, torch.arange(1, prefix + 1) % runner.vocab_size, need_logits=False)
    hidden_size, vocab = runner.model.config.hidden_size, runner.vocab_size
    trees = {n: (TokenTree.from_lists([-1] + [0] * (n - 1), list(range(1, n + 1))), torch.arange(n)) for n in sizes}
    rows = {n: torch.randn(n, hidden_size, dtype=runner.dtype) for n in sizes}

    def timed(fn) -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    def tree_pass(n: int, logits: bool):
        def run():
            runner.forward(*trees[n], need_logits=logits)
            runner.commit([])
        return run

    parts = {(n, part): [] for n in sizes for part in ("pass", "body", "lm_head")}
    for r in range(rounds + 1):  # the first round warms up
        for n in sizes:
            for part, fn in (("pass", tree_pass(n, True)), ("body", tree_pass(n, False)),
                             ("lm_head", lambda: runner.linear(rows[n], runner.lm_head_weight))):
                t = timed(fn)
                if r:
                    parts[(n, part)].append(t)
    # the compute reference: the same LM-head product on PEAK_ROWS rows, where it is bound by arithmetic, not
    # by reading the weight; at that rate, n tokens' matrix products (every linear weight, LM head included)
    # cannot take less than 2 n P / rate: a floor under t(n) besides the streaming time
    big = torch.randn(PEAK_ROWS, hidden_size, dtype=runner.dtype)
    peak = [timed(lambda: runner.linear(big, runner.lm_head_weight)) for _ in range(4)][1:]  # the first warms up
    peak_gflops = 2 * PEAK_ROWS * vocab * hidden_size / statistics.median(peak) / 1e9
    matmul_params = vocab * hidden_size + sum(p.numel() for name, p in runner.model.named_parameters()
                                              if p.dim() == 2 and "embed" not in name and "lm_head" not in name)
    out = {}
    for n in sizes:
        med = {part: statistics.median(parts[(n, part)]) * 1000 for part in ("pass", "body", "lm_head")}
        med["rest"] = med["pass"] - med["body"] - med["lm_head"]
        med["lm_head_gflops"] = 2 * n * vocab * hidden_size / (med["lm_head"] / 1000) / 1e9
        med["matmul_floor"] = 2 * n * matmul_params / (peak_gflops * 1e9) * 1000
        out[str(n)] = med
    return {"rounds": rounds, "prefix": prefix, "quantize": quantize, "ms": out, "peak_rows": PEAK_ROWS,
            "peak_gflops": peak_gflops, "matmul_params": matmul_params}


@torch.no_grad()
def verification_times(target, sizes: tuple[int, ...] = (4, 8, 16), rounds: int = 9, prefix: int = 128,
                       subset: int = 16384, width: int = 4) -> dict:
    """What a tree costs besides its target pass at temperature 1, medians over interleaved rounds (ms).

    A tree of n nodes: the root with ``width`` children, the other nodes a chain below the first child
    (a multi-draft first level, then a chain; internal nodes = n - width). Its target logits come from a
    real fast-runner pass (timed too); the draft's q lives on ``subset`` tokens (as the head's does), the
    children are drawn from it. Timed: ``pass`` (the forward, logits included), ``probs`` (logits -> float32
    target_probs at T=1, over the whole vocabulary), ``rrs`` / ``rrs_wor`` (the verifiers with and without
    replacement on those probs), ``rrs_dense`` / ``rrs_wor_dense`` (the same verifications with the node rule
    run over every column at every rank, the reference the support path replaced), ``greedy`` (the T=0
    verifier on the logits: each row's argmax).
    """
    import statistics

    from treespec.models.fast import make_runner
    from treespec.sampling import SamplingConfig, logits_to_probs
    from treespec.tree import TokenTree
    from treespec.verify import VERIFIERS
    from treespec.verify.core import verify_tree
    from treespec.verify.rules import dense_rrs_rule, dense_rrs_without_replacement_rule

    runner = make_runner(target, fast=True)
    runner.reset()
    runner.forward(None, None, torch.arange(1, prefix + 1) % runner.vocab_size, need_logits=False)
    vocab, g = runner.vocab_size, torch.Generator().manual_seed(0)
    ids = torch.randperm(vocab, generator=g)[:subset]
    cases = {}
    for n in sizes:
        w = min(width, n - 1)
        parents = [-1] + [0] * w + [1] + list(range(w + 1, n - 1))
        q = torch.zeros(n, vocab)
        q[:, ids] = torch.softmax(3 * torch.randn(n, subset, generator=g), dim=-1)  # [n, V], zero off the subset
        first = ids[torch.multinomial(q[0, ids], w, replacement=False, generator=g)].tolist()  # distinct: both laws
        chain = ids[torch.randint(0, subset, (n - 1 - w,), generator=g)].tolist()
        tokens = [int(ids[0])] + first + chain
        cases[n] = {law: TokenTree.from_lists(parents[:n], tokens, law) for law in ("iid", "without_replacement")}
        cases[n]["q"] = q
    t1 = SamplingConfig(1.0)
    names = ("pass", "probs", "rrs", "rrs_wor", "rrs_dense", "rrs_wor_dense", "greedy")
    parts = {(n, part): [] for n in sizes for part in names}
    for r in range(rounds + 1):  # the first round warms up
        for n in sizes:
            tree, nodes = cases[n]["iid"], torch.arange(n)
            t0 = time.perf_counter()
            logits = runner.forward(tree, nodes)["logits"]  # [n, V]
            runner.commit([])
            t_pass = time.perf_counter()
            p = logits_to_probs(logits, t1)  # [n, V]
            t_probs = time.perf_counter()
            VERIFIERS["rrs"](tree, p, cases[n]["q"], g)
            t_rrs = time.perf_counter()
            VERIFIERS["rrs_without_replacement"](cases[n]["without_replacement"], p, cases[n]["q"], g)
            t_wor = time.perf_counter()
            verify_tree(tree, p, cases[n]["q"], g, dense_rrs_rule)
            t_dense = time.perf_counter()
            verify_tree(cases[n]["without_replacement"], p, cases[n]["q"], g, dense_rrs_without_replacement_rule)
            t_wor_dense = time.perf_counter()
            VERIFIERS["greedy"](tree, logits)
            t_greedy = time.perf_counter()
            if r:
                for part, dt in (("pass", t_pass - t0), ("probs", t_probs - t_pass), ("rrs", t_rrs - t_probs),
                                 ("rrs_wor", t_wor - t_rrs), ("rrs_dense", t_dense - t_wor),
                                 ("rrs_wor_dense", t_wor_dense - t_dense), ("greedy", t_greedy - t_wor_dense)):
                    parts[(n, part)].append(dt)
    ms = {str(n): {part: statistics.median(parts[(n, part)]) * 1000 for part in names} for n in sizes}
    return {"rounds": rounds, "prefix": prefix, "subset": subset, "width": width, "ms": ms}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--draft", default=None, help="draft spec (path/id or early-exit:L) for the draft step cost")
    ap.add_argument("--sizes", default="1,2,4,8,12,16,24,32,48,64,96,128")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tag", default=None)
    ap.add_argument("--fast", action="store_true", help="profile the fast runner (treespec.models.fast)")
    ap.add_argument("--compare", action="store_true", help="profile the eager and the fast runner")
    ap.add_argument("--verification", action="store_true",
                    help="also time T=1 verification of 4-, 8- and 16-node trees beside their pass (fast runner)")
    ap.add_argument("--quantize", choices=["int4"], default=None,
                    help="also profile the fast runner on 4-bit weights (treespec generate --quantize int4)")
    add_output_args(ap)
    args = ap.parse_args(argv)
    started = time.time()
    out, prov = open_results("profile", args.out, allow_dirty=args.allow_dirty, tag=args.tag)
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    target = load_model("embedded", dtype=args.dtype)
    draft = load_draft_model(args.draft, target) if args.draft else None
    sizes = tuple(int(s) for s in args.sizes.split(","))
    modes = ([False, True] if args.compare else [args.fast]) + ([args.quantize] if args.quantize else [])
    profs = {mode: measure_profile(target, draft, sizes=sizes, repeats=args.repeats, fast=bool(mode),
                                   quantize=mode if isinstance(mode, str) else None) for mode in modes}
    meta = {"commit": prov["commit"], "machine": prov["machine"],
            "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}}
    if args.quantize:
        meta["quantised_agreement"] = quantised_agreement(target, args.quantize)
    if args.fast or args.compare:
        meta["components"] = {"fast": component_times(target, rounds=args.repeats)}
        if args.quantize:
            meta["components"][args.quantize] = component_times(target, args.quantize, rounds=args.repeats)
    if args.verification:
        meta["verification"] = verification_times(target, rounds=args.repeats)
    write_json(out / "meta.json", meta)
    lines = [f"# Hardware profile ({meta['commit']}): Gemma-3-270M {args.dtype}, {args.threads} threads", "",
             f"{host_name(meta['machine'])}"]
    for mode, prof in profs.items():
        name = mode if isinstance(mode, str) else ("fast" if mode else "eager")
        main = [m for m in modes if not isinstance(m, str)][-1]  # the unquantised runner the choosers reuse
        prof.save(out / ("profile.json" if mode is main else f"profile-{name}.json"))
        t1 = prof.verify_s[0]
        lines += ["", f"## {prof.meta['runner']} ({name})", "",
                  f"weight streaming (read {prof.weight_bytes / 1e6:.0f} MB once): {prof.stream_s * 1000:.1f} ms; "
                  f"t(1) = {t1 * 1000:.1f} ms = {t1 / prof.stream_s:.2f} x streaming" if prof.stream_s else "",
                  f"draft {args.draft or 'none'}: step {prof.draft_step_s * 1000:.1f} ms ({prof.draft_step_s / t1:.2f} x t(1))",
                  "", "| n | t(n) ms | t(n)/t(1) |", "|---|---|---|"]
        lines += [f"| {n} | {t * 1000:.1f} | {t / t1:.2f} |" for n, t in zip(prof.sizes, prof.verify_s)]
        if isinstance(mode, str):
            q = meta["quantised_agreement"]
            lines += ["", f"{mode} vs the unquantised target (teacher-forced on {q['positions']} positions of its own "
                          f"greedy continuations of train prompts): top-1 agreement {q['top1_agreement']:.3f}, "
                          f"mean KL {q['mean_kl_nats']:.3f} nats"]
    for name, comp in meta.get("components", {}).items():
        lines += ["", f"## Where a fast-runner pass goes ({name}; medians of {comp['rounds']} interleaved rounds, ms)", "",
                  f"Compute reference: the LM-head product on {comp['peak_rows']} rows runs at "
                  f"{comp['peak_gflops']:.0f} GFLOP/s; at that rate the matrix products of n tokens "
                  f"({comp['matmul_params'] / 1e6:.0f}M weights, LM head included) take at least the floor below.", "",
                  "| n | pass | body (layers) | LM head | rest | LM head GFLOP/s | matmul floor |",
                  "|---|---|---|---|---|---|---|"]
        lines += [f"| {n} | {c['pass']:.1f} | {c['body']:.1f} | {c['lm_head']:.1f} | {c['rest']:.1f} | "
                  f"{c['lm_head_gflops']:.0f} | {c['matmul_floor']:.1f} |" for n, c in comp["ms"].items()]
    if "verification" in meta:
        v = meta["verification"]
        lines += ["", f"## A tree at T=1 besides its pass (fast runner; the root with {v['width']} children, then a "
                      f"chain; q on {v['subset']} tokens; medians of {v['rounds']} interleaved rounds, ms)", "",
                  "| n | pass | target_probs (T=1) | rrs | rrs dense | rrs without replacement | "
                  "rrs without replacement dense | greedy (T=0) |", "|---|---|---|---|---|---|---|---|"]
        lines += [f"| {n} | {c['pass']:.1f} | {c['probs']:.1f} | {c['rrs']:.1f} | {c['rrs_dense']:.1f} | "
                  f"{c['rrs_wor']:.1f} | {c['rrs_wor_dense']:.1f} | {c['greedy']:.1f} |" for n, c in v["ms"].items()]
    (out / "profile.md").write_text("\n".join(lines) + "\n")
    finish(out, started)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
