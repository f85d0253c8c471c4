"""Real-model OT study: optimal vs achieved multi-draft acceptance on Gemma-3-270M.

    python benchmarks/study_real_model.py --draft head    # 2 prompts / subtask, 176 tokens (2,112 positions)
    python benchmarks/study_real_model.py --small         # 1 prompt / subtask, 8 tokens (tests / notebook)

Target p: the embedded Gemma-3-270M (float32). Draft q: a self-speculative early exit of the same
model, hidden state after decoder layer ``--layer`` (default 12 of 18) -> the model's final norm ->
the LM head. Layer 12 is the middle choice of the measured top-1 agreement ladder (0.04 / 0.45 / 0.74
after layers 6 / 12 / 15): a draft that is neither useless nor almost the target, so the gaps between
draft laws and verifiers are visible, and it costs 2/3 of a target forward, a realistic draft budget.

Positions: the ``--per-subtask`` shortest of the first 10 Spec-Bench prompts of each of the 6 subtasks
(raw prompt text, as in ``benchmarks/run.py``; short prompts keep the prefill cheap), each continued by ``--new-tokens`` tokens sampled from the target at
``--gen-temperature`` (seeded); then ONE teacher-forced forward with ``output_hidden_states=True``
over each full sequence gives p and q at every generated position (measurement only).

For each temperature T (p and q both at T) and n: optimal acceptance for i.i.d., without-replacement
and greedy drafting and each verifier's exact acceptance (``P(output in drafts)``) at full vocabulary
(see :mod:`ot_bounds.study`; ``rrs_without_replacement`` is skipped: no closed form at V = 262,144).
Without replacement for n >= 3 is exact by default (``--wor exact``: ``ot_bounds.optimal_acceptance``'s branch
and bound per position, tens of milliseconds at V = 262,144); the certified per-position bracket [lo, hi] of
``ot_bounds.study.wor_brackets`` is computed beside it, reported, and every exact value is checked to lie in it.
``--wor bracket`` skips the exact search and reports hi. Writes ``summary.json``, ``summary.md`` and
``positions.npz`` (+ ``provenance.json``) to ``--out`` (default ``benchmarks/results/ot_study/<date>-<commit>/``).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime as _dt
import json
import multiprocessing
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import SUBTASKS, add_output_args, finish, load_prompts, open_results, write_json  # noqa: E402
from ot_bounds import study as st  # noqa: E402

VERIFIER_NS = {"single": [1], "rrs": None, "kseq": None, "spechub": [2], "greedy_draft": None, "deterministic": None}
#: verifier -> the draft law whose optimum bounds it
VERIFIER_BOUND = {"single": "iid", "rrs": "iid", "kseq": "iid", "spechub": "greedy",
                  "greedy_draft": "greedy", "deterministic": None}


def choose_prompts(per_subtask: int, pool: int = 10) -> list[dict]:
    """The ``per_subtask`` shortest (in characters) of the first ``pool`` prompts of each subtask."""
    rows = load_prompts(pool)
    out = []
    for sub in SUBTASKS:
        mine = [r for r in rows if r["subtask"] == sub]
        out += sorted(mine, key=lambda r: (len(r["prompt"]), r["id"]))[:per_subtask]
    return out


def sample_continuation(model, prompt_ids: list[int], new_tokens: int, temperature: float,
                        generator: torch.Generator) -> list[int]:
    """``new_tokens`` tokens sampled from the target at ``temperature`` with its KV cache, one prompt at a time.

    Plain incremental decoding (prefill, then one token per step). One prompt at a time avoids the
    padding cost of batched ``generate`` on prompts of very different lengths (17 to 720 tokens here),
    which measured 28 s for 8 tokens of 12 prompts against 0.13 s per token unbatched.
    """
    from treespec.models.kv_cache import cache_kwargs, output_cache

    with torch.no_grad():
        out = model(torch.tensor([prompt_ids]), use_cache=True, logits_to_keep=1)
        tokens: list[int] = []
        for _ in range(new_tokens):
            probs = torch.softmax(out.logits[0, -1].double() / temperature, dim=-1)
            nxt = torch.multinomial(probs, 1, generator=generator)
            tokens.append(int(nxt))
            if len(tokens) == new_tokens:
                break
            out = model(nxt[None], **cache_kwargs(model, output_cache(out)), use_cache=True)
    return tokens


def collect(model, tok, prompts, layer: int, new_tokens: int, gen_temperature: float, seed: int, head=None):
    """Sample each continuation (KV-cached decoding), then one teacher-forced forward per sequence.

    Yields (subtask, target_logits [new_tokens, V], draft_logits [new_tokens, V]). With ``head`` (an
    attached EagleHead) the draft is the head, one step ahead from the target's true hidden states
    (its logits are -inf outside its vocabulary subset: q = 0 there); else the early exit.
    Prompt ``i`` is sampled with a generator seeded ``seed + i``.
    """
    from treespec.models.features import model_features

    norm, lm = model.model.norm, model.lm_head
    for i, pr in enumerate(prompts):
        e = tok(pr["prompt"])["input_ids"]
        gen = torch.Generator().manual_seed(seed + i)
        seq = torch.tensor([e + sample_continuation(model, e, new_tokens, gen_temperature, gen)])
        with torch.no_grad():
            out = model(seq, output_hidden_states=True)
            start = len(e) - 1  # logits at position t predict token t + 1
            stop = seq.shape[1] - 1
            target = out.logits[0, start:stop].float()
            if head is None:
                draft = lm(norm(out.hidden_states[layer][0, start:stop])).float()
            else:  # head input at j - 1 is (h_{j-1}, x_j): its output predicts token j + 1, like p at j
                h = model_features(model, seq, layers=head.cfg.feature_layers).float()  # post final norm (+ layers)
                feats = head(h[:, :-1], seq[:, 1:], torch.arange(1, seq.shape[1])[None])[0]
                draft = torch.full_like(target, -torch.inf)
                draft[:, head.vocab_ids] = head.logits(feats[start - 1:stop - 1])
        yield pr["subtask"], target, draft


#: exact values may exceed the certified bracket by rounding only
BRACKET_TOL = 1e-9


def evaluate_chunk(target: torch.Tensor, draft: torch.Tensor, temps, ns, wor: str = "exact"):
    """All metrics for a chunk of positions: dict name -> array [len(temps), B].

    ``wor="exact"``: ``opt_wor_n{n}`` for ``n >= 3`` is the exact optimum (one branch and bound per
    position); ``"bracket"``: it is the bracket's upper end. Both keep ``opt_wor_lo_n{n}`` /
    ``opt_wor_hi_n{n}``, the certified bracket.
    """
    from ot_bounds import optimal_acceptance

    res: dict[str, list] = {}

    def put(name, t_idx, values):
        res.setdefault(name, [None] * len(temps))[t_idx] = np.asarray(values, dtype=np.float64)

    order = st.logit_order(target, draft)  # the p / q order at every temperature: one sort
    for ti, temp in enumerate(temps):
        p = torch.softmax(target.double() / temp, dim=-1)
        q = torch.softmax(draft.double() / temp, dim=-1)
        sp = st.sort_pairs(p, q, order)
        put("top1_agree", ti, (p.argmax(1) == q.argmax(1)).double().numpy())
        put("tv", ti, (0.5 * (p - q).abs().sum(1)).numpy())
        iid = {n: st.optimal_iid(sp, n) for n in ns}
        for n in ns:
            put(f"opt_iid_n{n}", ti, iid[n].numpy())
            put(f"opt_greedy_n{n}", ti, st.optimal_greedy(p, q, n).numpy())
            put(f"ver_greedy_draft_n{n}", ti, res[f"opt_greedy_n{n}"][ti])
            put(f"ver_deterministic_n{n}", ti, st.verifier_deterministic(p, q, n).numpy())
            put(f"ver_kseq_n{n}", ti, st.verifier_kseq(p, q, sp, n).numpy())
        rrs = st.verifier_rrs(p, q, list(ns))
        for n in ns:
            put(f"ver_rrs_n{n}", ti, rrs[n].numpy())
        put("ver_single_n1", ti, st.verifier_single(p, q).numpy())
        put("ver_spechub_n2", ti, st.verifier_spechub(p, q).numpy())
        if 1 in ns:
            put("opt_wor_n1", ti, st.verifier_single(p, q).numpy())
        if 2 in ns:
            put("opt_wor_n2", ti, st.optimal_wor2(sp).numpy())
        big_ns = [n for n in ns if n >= 3]
        p_rows, q_rows = p.numpy(), q.numpy()  # shape [B, V] each
        for n, (lo, hi) in st.wor_brackets(sp, big_ns, iid).items():
            put(f"opt_wor_lo_n{n}", ti, lo.numpy())
            put(f"opt_wor_hi_n{n}", ti, hi.numpy())
            if wor == "exact":
                put(f"opt_wor_n{n}", ti, [optimal_acceptance(pr, qr, n, "without_replacement")
                                          for pr, qr in zip(p_rows, q_rows)])
            else:
                put(f"opt_wor_n{n}", ti, hi.numpy())
    return {k: np.stack(v) for k, v in res.items()}


def _worker_init() -> None:
    torch.set_num_threads(1)


def evaluate_rows(target: torch.Tensor, draft: torch.Tensor, temps, ns, chunk: int,
                  wor: str = "exact") -> dict[str, np.ndarray]:
    """:func:`evaluate_chunk` over ``chunk`` rows at a time (1 keeps each [V] row cache-resident)."""
    parts = [evaluate_chunk(target[lo:lo + chunk], draft[lo:lo + chunk], temps, ns, wor)
             for lo in range(0, target.shape[0], chunk)]
    return {k: np.concatenate([c[k] for c in parts], axis=1) for k in parts[0]}


def summarise(metrics: dict[str, np.ndarray], subtasks: np.ndarray, temps, ns) -> dict:
    def means(mask):
        return {k: [float(v[ti, mask].mean()) for ti in range(len(temps))] for k, v in metrics.items()}

    out = {"all": means(np.ones(subtasks.size, dtype=bool))}
    out["per_subtask"] = {s: means(subtasks == s) for s in SUBTASKS if np.any(subtasks == s)}
    out["positions_per_subtask"] = {s: int(np.sum(subtasks == s)) for s in SUBTASKS}
    def width(n, ti):
        return metrics[f"opt_wor_hi_n{n}"][ti] - metrics[f"opt_wor_lo_n{n}"][ti]

    def outside_at(n, ti):  # positions whose exact value is outside the certified bracket
        v = metrics[f"opt_wor_n{n}"][ti]
        return np.flatnonzero((v < metrics[f"opt_wor_lo_n{n}"][ti] - BRACKET_TOL)
                              | (v > metrics[f"opt_wor_hi_n{n}"][ti] + BRACKET_TOL))

    def outside(n, ti):  # how many (0 when wor = "bracket")
        return int(outside_at(n, ti).size)

    def outside_rows(n, ti):  # each as [position, exact, lo, hi] in full precision
        return [[int(i)] + [float(metrics[f"opt_wor{k}_n{n}"][ti][i]) for k in ("", "_lo", "_hi")]
                for i in outside_at(n, ti)]

    out["wor_bracket"] = {
        f"n{n}": {"mean_width": [float(width(n, ti).mean()) for ti in range(len(temps))],
                  "max_width": [float(width(n, ti).max()) for ti in range(len(temps))],
                  "exact_outside": [outside(n, ti) for ti in range(len(temps))],
                  "exact_outside_positions": [outside_rows(n, ti) for ti in range(len(temps))],
                  "hi_minus_value_mean": [float((metrics[f"opt_wor_hi_n{n}"][ti]
                                                 - metrics[f"opt_wor_n{n}"][ti]).mean()) for ti in range(len(temps))]}
        for n in ns if n >= 3}
    return out


def markdown(summary: dict, settings: dict) -> str:
    temps, ns = settings["temperatures"], settings["ns"]
    allm = summary["all"]
    lines = [
        "# OT study: optimal vs achieved acceptance, Gemma-3-270M target",
        "",
        f"- commit: `{settings['commit']}`; date (UTC): {settings['date']}; runtime {settings['runtime_s']:.0f} s",
        f"- machine: {settings['machine']['cpu']}, {settings['machine']['cores']} cores, torch {settings['machine']['torch']}",
        f"- target: embedded Gemma-3-270M float32; draft: {settings['draft']}",
        f"- positions: {settings['positions']} ({settings['per_subtask']} Spec-Bench prompts per subtask, ids "
        f"{', '.join(settings['prompt_ids'])}; {settings['new_tokens']} tokens sampled at T = "
        f"{settings['gen_temperature']}, seed {settings['seed']})",
        "- acceptance = P(output token is one of the drafts) at one node; p and q both at temperature T; "
        + ("exact at full vocabulary (V = 262,144), optimal without replacement for n >= 3 included (the "
           "branch and bound of ot_bounds.optimal_acceptance per position; the last table checks each "
           "value against the certified bracket of ot_bounds.study.wor_brackets)"
           if settings.get("wor", "bracket") == "exact" else
           "exact at full vocabulary (V = 262,144) except optimal without replacement for n >= 3, which is "
           "a certified bracket [lo, hi] per position (ot_bounds.study.wor_bracket; tables show hi, the "
           "widths are in the last table)"),
        "- `rrs_without_replacement` skipped: its exact value is a recursion over rejected tokens, O(V^n)",
        "",
        "## Means over all positions",
        "",
    ]
    for ti, temp in enumerate(temps):
        lines += [f"### T = {temp}", "", f"top-1 agreement {allm['top1_agree'][ti]:.3f}, TV(p, q) "
                  f"{allm['tv'][ti]:.3f}", "",
                  "| n | opt iid | opt w/o repl. | opt greedy | w/o - iid | rrs | kseq | greedy_draft | "
                  "spechub | deterministic | gap rrs | gap kseq |",
                  "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for n in ns:
            g = lambda k: allm[k][ti] if k in allm else float("nan")  # noqa: E731
            spec = g("ver_spechub_n2") if n == 2 else float("nan")
            rrs = g("ver_single_n1") if n == 1 else g(f"ver_rrs_n{n}")
            lines.append(
                f"| {n} | {g(f'opt_iid_n{n}'):.4f} | {g(f'opt_wor_n{n}'):.4f} | {g(f'opt_greedy_n{n}'):.4f} | "
                f"{g(f'opt_wor_n{n}') - g(f'opt_iid_n{n}'):+.4f} | {rrs:.4f} | {g(f'ver_kseq_n{n}'):.4f} | "
                f"{g(f'ver_greedy_draft_n{n}'):.4f} | {spec:.4f} | {g(f'ver_deterministic_n{n}'):.4f} | "
                f"{g(f'opt_iid_n{n}') - rrs:.4f} | {g(f'opt_iid_n{n}') - g(f'ver_kseq_n{n}'):.4f} |"
            )
        lines.append("")
    lines += ["gap = optimal acceptance of the verifier's draft law (iid for rrs / kseq) minus its acceptance; "
              "greedy_draft attains its optimum exactly; spechub's bound is the greedy optimum at n = 2.", "",
              "## Per subtask (T = 0.7 if present, else the first T)", ""]
    ti = temps.index(0.7) if 0.7 in temps else 0
    n_show = [n for n in ns if n in (1, 2, 4, 8)] or ns
    head = "| subtask | positions | agree | " + " | ".join(
        f"iid n={n} | w/o n={n} | greedy n={n} | rrs n={n}" for n in n_show) + " |"
    lines += [head, "|" + "---|" * (3 + 4 * len(n_show))]
    for sub, m in summary["per_subtask"].items():
        cells = []
        for n in n_show:
            rrs = m["ver_single_n1"][ti] if n == 1 else m[f"ver_rrs_n{n}"][ti]
            cells += [f"{m[f'opt_iid_n{n}'][ti]:.3f}", f"{m[f'opt_wor_n{n}'][ti]:.3f}",
                      f"{m[f'opt_greedy_n{n}'][ti]:.3f}", f"{rrs:.3f}"]
        lines.append(f"| {sub} | {summary['positions_per_subtask'][sub]} | {m['top1_agree'][ti]:.3f} | "
                     + " | ".join(cells) + " |")
    big = [n for n in ns if n >= 3]
    lines += ["", "## Without replacement, n >= 3: certified bracket width (hi - lo), mean and max"
              + (", and exact values outside the bracket (must be 0)" if settings.get("wor") == "exact" else ""), "",
              "| T | " + " | ".join(f"mean n={n} | max n={n} | outside n={n}" for n in big) + " |",
              "|---:|" + "---:|" * (3 * len(big))]
    br = summary["wor_bracket"]
    for ti, temp in enumerate(temps):
        lines.append(f"| {temp} | " + " | ".join(
            f"{br[f'n{n}']['mean_width'][ti]:.2e} | {br[f'n{n}']['max_width'][ti]:.2e} | "
            f"{br[f'n{n}']['exact_outside'][ti] if settings.get('wor') == 'exact' else '-'}" for n in big) + " |")
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--per-subtask", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=176)
    ap.add_argument("--layer", type=int, default=12)
    ap.add_argument("--draft", default="early-exit",
                    help="'early-exit' (layer --layer), 'head' (the shipped Gemma-3-270M draft head), an EAGLE or "
                         "EAGLE-3 head .safetensors, or a speculators EAGLE-3 folder")
    ap.add_argument("--gen-temperature", type=float, default=0.7)
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.5, 0.7, 1.0])
    ap.add_argument("--ns", type=int, nargs="+", default=[1, 2, 3, 4, 8])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--chunk", type=int, default=1,
                    help="positions evaluated together (1 keeps each [V] row in cache: measured 2.5x faster than 16)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the collecting process")
    ap.add_argument("--workers", type=int, default=2,
                    help="evaluation processes (1 thread each), working while collection goes on; 1 = in process")
    ap.add_argument("--task", type=int, default=16, help="positions per evaluation task")
    ap.add_argument("--wor", choices=("exact", "bracket"), default="exact",
                    help="without replacement, n >= 3: the exact optimum per position, or the bracket's upper end")
    ap.add_argument("--small", action="store_true", help="1 prompt per subtask, 8 tokens, T in {0.7, 1.0}")
    add_output_args(ap)
    return ap


def collect_and_evaluate(model, tok, prompts: list[dict], head, args) -> tuple[list[dict], list[str], float, float]:
    """Collect every prompt's target / draft rows and evaluate them in ``--task`` position chunks, in ``--workers``
    processes (one thread each) while the next sequence is collected. Returns the evaluated chunks, the subtask of
    every position, the collection time and the evaluation time left after the last collection (s)."""
    pool = None
    if args.workers > 1:
        ctx = multiprocessing.get_context("spawn")
        pool = concurrent.futures.ProcessPoolExecutor(args.workers, mp_context=ctx, initializer=_worker_init)
    futures, subtasks = [], []
    t_collect = 0.0
    t1 = time.time()
    for sub, target, draft in collect(model, tok, prompts, args.layer, args.new_tokens, args.gen_temperature,
                                      args.seed, head):
        t_collect += time.time() - t1
        for lo in range(0, target.shape[0], args.task):
            job = (target[lo:lo + args.task].clone(), draft[lo:lo + args.task].clone(), args.temperatures,
                   args.ns, args.chunk, args.wor)
            futures.append(pool.submit(evaluate_rows, *job) if pool else evaluate_rows(*job))
        subtasks += [sub] * target.shape[0]
        print(f"{sub}: {len(subtasks)} positions collected, collect {t_collect:.0f} s", flush=True)
        t1 = time.time()
    chunks = [f.result() for f in futures] if pool else futures
    if pool:
        pool.shutdown()
    t_eval = time.time() - t1  # evaluation still running after the last sequence was collected
    return chunks, subtasks, t_collect, t_eval


def run_settings(args, prov: dict, prompts: list[dict], head, positions: int, times: dict) -> dict:
    """The settings recorded beside the study's numbers (``times``: runtime_s, load_s, collect_s,
    evaluate_after_collect_s)."""
    return {
        "commit": prov["commit_short"] + ("-dirty" if prov["dirty"] else ""),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), "machine": prov["machine"], "layer": args.layer, "per_subtask": args.per_subtask,
        "prompt_ids": [p["id"] for p in prompts], "new_tokens": args.new_tokens,
        "gen_temperature": args.gen_temperature, "temperatures": args.temperatures, "ns": args.ns,
        "seed": args.seed, "positions": positions, **times, "workers": args.workers, "threads": args.threads, "wor": args.wor,
        "draft": (f"early exit after layer {args.layer} -> final norm -> LM head" if head is None else
                  f"EAGLE-style draft head {'(shipped)' if args.draft == 'head' else args.draft} "
                  f"({head.num_trained_parameters / 1e6:.2f}M parameters, "
                  f"vocabulary subset {head.vocab_ids.numel()})"),
        "acceptance": "P(output token in drafts), one node, exact" + (
            "" if args.wor == "exact" else " (w/o replacement n >= 3: bracket upper end)"),
        "skipped": {"rrs_without_replacement": "no closed form at full vocabulary (O(V^n) recursion)"},
    }


def main(argv=None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.small:
        args.per_subtask, args.new_tokens, args.temperatures, args.workers = 1, 8, [0.7, 1.0], 1
    prompts = choose_prompts(args.per_subtask)  # read before a results folder exists
    out, prov = open_results("ot_study", args.out, allow_dirty=args.allow_dirty)
    torch.set_num_threads(args.threads)
    t0 = time.time()
    from treespec.models.loading import load_model, load_tokenizer

    model = load_model("embedded", dtype="float32")
    tok = load_tokenizer("embedded")
    t_load = time.time() - t0
    head = None
    if args.draft != "early-exit":
        from treespec.drafting.head_files import load_layer_head
        from treespec.drafting.shipped import load_default_head

        try:  # an EAGLE or EAGLE-3 head file, or a speculators folder
            head = load_default_head(model) if args.draft == "head" else \
                load_layer_head(args.draft, model, what="study_real_model.py")
        except (OSError, ValueError) as err:
            ap.error(f"--draft {args.draft}: {str(err).splitlines()[0]}")
    chunks, subtasks, t_collect, t_eval = collect_and_evaluate(model, tok, prompts, head, args)
    metrics = {k: np.concatenate([c[k] for c in chunks], axis=1) for k in chunks[0]}
    sub_arr = np.array(subtasks)
    summary = summarise(metrics, sub_arr, args.temperatures, args.ns)
    settings = run_settings(args, prov, prompts, head, int(sub_arr.size),
                            {"runtime_s": time.time() - t0, "load_s": t_load, "collect_s": t_collect,
                             "evaluate_after_collect_s": t_eval})
    write_json(out / "summary.json", {"settings": settings, **summary})
    (out / "summary.md").write_text(markdown(summary, settings))
    np.savez_compressed(out / "positions.npz", subtask=sub_arr,
                        temperatures=np.array(args.temperatures), ns=np.array(args.ns),
                        **{k: v.astype(np.float32) for k, v in metrics.items()})
    print(f"{sub_arr.size} positions in {settings['runtime_s']:.0f} s (load {t_load:.0f}, collect "
          f"{t_collect:.0f}, evaluation after the last collection {t_eval:.0f}); wrote {out}")
    finish(out, t0)
    if args.wor == "exact":
        bad = sum(sum(v["exact_outside"]) for v in summary["wor_bracket"].values())
        print(f"exact w/o-replacement optima outside the certified bracket: {bad}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
