"""The reports of ``benchmarks/run.py``: per-prompt speedups against named baselines, their spreads and sign
tests, and the files a run writes (``summary.json``, ``table.md``, ``speedup.png``).

Speedup of a method on a prompt = the baseline's summed time over the repeats / the method's; each table gives
the median over prompts with a seeded percentile-bootstrap 95% interval (:func:`benchmarks.common.bootstrap_ci`)
and, against ``treespec generate``'s default row, the exact two-sided sign test (:func:`sign_test`).
"""

from __future__ import annotations

from pathlib import Path
from statistics import mean

import torch
from scipy.stats import binomtest

from benchmarks.common import block_heading, block_top_p, bootstrap_ci, host_name, median, write_json
from benchmarks.methods import BASELINE_LABEL, BASELINES, EXTRA_METHODS, PROTOCOL_METHODS


def sign_test(ratios: list[float]) -> dict:
    """Paired sign test of ``ratios`` (default's time / a method's, one per prompt) against 1: how many
    prompts the method was faster / slower on (ties dropped), and the exact two-sided binomial p-value
    (:func:`scipy.stats.binomtest`, p = 1/2) of a split at least that uneven if faster and slower were equally
    likely."""
    wins = sum(r > 1 for r in ratios)
    losses = sum(r < 1 for r in ratios)
    if wins + losses == 0:
        return {"wins": 0, "losses": 0, "p_sign": 1.0}
    p = binomtest(wins, wins + losses, 0.5, alternative="two-sided").pvalue
    return {"wins": wins, "losses": losses, "p_sign": min(1.0, float(p))}


def per_prompt_speedups(runs: list[dict], defaults: dict | None = None) -> list[dict]:
    """One row per (dtype, T, prompt, method): summed time over repeats, speedups against each named
    baseline (baseline's summed time over the same repeats / the method's), tau, greedy equality.

    ``defaults`` maps (dtype, T) to the row that is ``treespec generate``'s default there
    (:func:`cli_default_method`); where that row ran on the same prompt, every method also gets
    ``speedup_vs_default``: the PAIRED ratio default's time / the method's on that prompt."""
    defaults = defaults or {}
    groups: dict = {}
    for r in runs:
        groups.setdefault((r["dtype"], r["temperature"], r["prompt_id"]), []).append(r)
    rows = []
    for (dtype, temp, pid), rs in groups.items():
        by_method: dict = {}
        for r in rs:
            by_method.setdefault(r["method"], []).append(r)
        wall = {m: sum(x["wall_s"] for x in v) for m, v in by_method.items()}
        ntok = {m: sum(x["new_tokens"] for x in v) for m, v in by_method.items()}
        for m, v in by_method.items():
            row = {"dtype": dtype, "temperature": temp, "prompt_id": pid, "subtask": v[0]["subtask"], "method": m,
                   "engine": v[0]["engine"], "repeats": len(v), "tokens_per_s": ntok[m] / wall[m]}
            for b in BASELINE_LABEL:
                if b in wall:
                    row[f"speedup_vs_{b}"] = wall[b] / wall[m] * (ntok[m] / ntok[b])
            own = BASELINES[v[0]["engine"]]
            if own in wall:
                row["speedup_vs_own_plain"] = wall[own] / wall[m] * (ntok[m] / ntok[own])
            default = defaults.get((dtype, temp))
            if default in wall:
                row["speedup_vs_default"] = wall[default] / wall[m] * (ntok[m] / ntok[default])
            calls = [x["target_calls"] for x in v if x.get("target_calls")]
            row["tau"] = (sum(x["new_tokens"] for x in v if x.get("target_calls")) / sum(calls)) if calls else None
            if temp == 0:
                row["equal_to_own_plain"] = all(x.get("equal_to_own_plain", True) for x in v)
                row["equal_to_ts_plain"] = all(x.get("equal_to_ts_plain", True) for x in v)
            rows.append(row)
    return rows


def spread(values: list[float], seed: int) -> dict:
    vals = [v for v in values if v is not None]
    if not vals:
        return {"median": None, "ci95": [None, None], "mean": None, "n": 0}
    lo, hi = bootstrap_ci(vals, seed=seed)
    return {"median": median(vals), "ci95": [lo, hi], "mean": mean(vals), "n": len(vals)}


def summarise(prompt_rows: list[dict], seed: int) -> dict:
    out: dict = {}
    for dtype, temp in sorted({(r["dtype"], r["temperature"]) for r in prompt_rows}):
        sel = [r for r in prompt_rows if r["dtype"] == dtype and r["temperature"] == temp]
        block = {}
        order = PROTOCOL_METHODS + EXTRA_METHODS
        for m in sorted(dict.fromkeys(r["method"] for r in sel), key=lambda m: (order.index(m) if m in order else 99, m)):
            mine = [r for r in sel if r["method"] == m]
            e = {"engine": mine[0]["engine"], "own_baseline": BASELINES[mine[0]["engine"]], "prompts": len(mine),
                 "tokens_per_s": spread([r["tokens_per_s"] for r in mine], seed)}
            for key in [f"speedup_vs_{b}" for b in BASELINE_LABEL] + ["speedup_vs_own_plain"]:
                if any(key in r for r in mine):
                    e[key] = spread([r.get(key) for r in mine], seed)
            paired = [r["speedup_vs_default"] for r in mine if r.get("speedup_vs_default") is not None]
            if paired:
                e["speedup_vs_default"] = spread(paired, seed)
                e["speedup_vs_default"].update(sign_test(paired))
            taus = [r["tau"] for r in mine if r["tau"] is not None]
            e["tau"] = mean(taus) if taus else None
            if temp == 0:
                e["greedy_equal_rate_own_plain"] = mean(float(r["equal_to_own_plain"]) for r in mine)
                if e["engine"] != "llama.cpp":
                    e["greedy_equal_rate_ts_plain"] = mean(float(r["equal_to_ts_plain"]) for r in mine)
            e["per_subtask"] = {
                s: {k: spread([r.get(k) for r in mine if r["subtask"] == s], seed)
                    for k in ("speedup_vs_own_plain", "speedup_vs_ts_plain") if any(k in r for r in mine)}
                for s in dict.fromkeys(r["subtask"] for r in mine)}
            block[m] = e
        out[f"{dtype}/T={temp:g}"] = block
    return out


def _fmt(s: dict | None) -> str:
    if not s or s.get("median") is None:
        return "-"
    lo, hi = s["ci95"]
    return f"{s['median']:.2f}x [{lo:.2f}, {hi:.2f}]"


def top_p_note(settings: dict) -> str:
    """The protocol line's words for the nucleus filter of the sampled blocks (nothing when off in all)."""
    filtered = [f"top-p {block_top_p(settings, t):g} at T={t:g}" for t in settings.get("temperatures", ())
                if block_top_p(settings, t) < 1.0]
    return f", {', '.join(filtered)} (every method alike)" if filtered else ""


def cli_default_method(dtype: str, temperature: float) -> str:
    """The row that ``treespec generate`` runs with every choice left to ``auto`` (``--target``, ``--draft``) on a
    CPU where ``--dtype auto`` gives ``dtype``, at ``temperature``, with llama-cpp-python installed: read from the
    measured tables :data:`~treespec.drafters.DEFAULT_TARGETS` and :data:`~treespec.drafters.DEFAULT_DRAFTS` (so a
    change of default changes the paired column)."""
    from treespec.drafters import default_draft, default_target

    target = default_target(getattr(torch, dtype), temperature).target
    draft = default_draft(target, getattr(torch, dtype), temperature)
    rows = {"ngram": "ngram", "head": "head", "lookup+head": "lookup_head", "none": "plain"}
    prefix = "tsl_" if target != "embedded" else "ts_"
    return prefix + rows.get(draft, draft)


def cli_default_rows() -> str:
    """Which rows are the CLI's ``--draft auto`` per dtype and temperature, read from the CLI itself (its table is
    keyed by T = 0 and T > 0; T=1 stands for the latter)."""
    return "; ".join(f"{dtype}: " + ", ".join(f"{cli_default_method(dtype, t)} at {when}"
                                              for t, when in ((0.0, "T=0"), (1.0, "T>0")))
                     for dtype in ("bfloat16", "float32"))


def markdown(summary: dict, meta: dict) -> str:
    prov, st = meta["provenance"], meta["settings"]
    mach = prov["machine"]
    flags = ", ".join(f for f, on in mach["cpu_flags"].items() if on) or "none"
    lines = [f"# Speed benchmark (commit {prov['commit_short']}{' DIRTY, see diff.patch' if prov['dirty'] else ''}, "
             f"{prov['date_utc']})", "",
             f"- Command: `{prov['command']['shell']}`",
             f"- Machine: {host_name(mach)}, {mach['cores']} cores; flags: {flags}; bf16 native: {mach['bf16_native']}",
             f"- Versions: " + ", ".join(f"{k} {v}" for k, v in prov["versions"].items() if v),
             f"- Protocol: {st['prompts']} prompts ({st['prompt_set']}), {st['max_new_tokens']} new tokens (EOS ignored), "
             f"{st['repeats']} repeat(s) per prompt in interleaved rounds (baselines first, others shuffled; reversed "
             f"on odd repeats), torch threads {st['threads']}, seed {st['seed']}{top_p_note(st)}. Warm-up: every method once on a "
             f"warm-up prompt ({st['warmup_tokens']} tokens) per dtype, not measured.",
             "- Speedup = the named baseline's time / the method's time on the same prompt (summed over repeats); "
             "median over prompts and a percentile-bootstrap 95% interval (2,000 resamples, seeded).",
             f"- `treespec generate` default (`--target auto --draft auto`, llama-cpp-python installed), by the dtype "
             f"`--dtype auto` gives: {cli_default_rows()}. llama.cpp runs "
             "the Q4_K_M GGUF itself (treespec and HF run its de-quantised weights), so its greedy output is "
             "compared with llama.cpp plain only.",
             ]
    for note in meta.get("skipped", []):
        lines.append(f"- Skipped: {note}")
    rounds = meta.get("rounds")
    if rounds and rounds["done"] < rounds["total"]:
        lines.append(f"- PARTIAL RUN: {rounds['done']} of {rounds['total']} rounds measured so far (prompts run "
                     f"round-robin over subtasks); continue with `python benchmarks/run.py --resume DIR`")
    for sess in prov.get("sessions", []):
        lines.append(f"- Resumed {sess['date_utc']} at commit {sess['commit'][:7]}")
    for dtype, ref in meta.get("host_stream", {}).items():
        lines.append(f"- Host reference ({dtype}): reading the target's {ref['mb']:.0f} MB of weights once took "
                     f"{ref['median_ms']:.1f} ms (median; range {ref['min_ms']:.1f} to {ref['max_ms']:.1f}) over "
                     f"{ref['rounds']} readings, one after each prompt's round: hosts of one CPU name differ, and "
                     "this figure tells two records' hosts apart")
    lines.append("")
    for key, block in summary.items():
        lines += [f"## {block_heading(key, st)}", "",
                  "| method | engine | tokens/s (median) | speedup vs treespec plain | speedup vs HF generate | "
                  "speedup vs llama.cpp plain | tau | greedy = own plain |",
                  "|---|---|---|---|---|---|---|---|"]
        for m, e in block.items():
            eq = (f"{e['greedy_equal_rate_own_plain']:.2f}" if "greedy_equal_rate_own_plain" in e else "-")
            tau = f"{e['tau']:.2f}" if e["tau"] is not None else "-"
            lines.append(f"| {m} | {e['engine']} | {e['tokens_per_s']['median']:.2f} | "
                         f"{_fmt(e.get('speedup_vs_ts_plain'))} | {_fmt(e.get('speedup_vs_hf_plain'))} | "
                         f"{_fmt(e.get('speedup_vs_llama_plain'))} | {tau} | {eq} |")
        paired = {m: e["speedup_vs_default"] for m, e in block.items() if "speedup_vs_default" in e}
        if len(paired) > 1:
            dtype, temp = key.split("/T=")
            default = cli_default_method(dtype, float(temp))
            lines += ["", f"Paired against the CLI default here (`{default}`): per prompt, the default's time / the "
                      "method's (> 1: faster than the default), median [95% CI]; faster / slower on how many "
                      "prompts, and the two-sided sign-test p-value:", "",
                      "| method | speedup vs default (paired) | faster / slower | sign-test p |", "|---|---|---|---|"]
            for m, pe in paired.items():
                if m != default:
                    lines.append(f"| {m} | {_fmt(pe)} | {pe['wins']} / {pe['losses']} | {pe['p_sign']:.3g} |")
        parts = meta.get("round_parts", {}).get(key)
        if parts:
            lines += ["", "Where a round goes (treespec rows; ms per target round, every round of every prompt pooled; "
                      "verify = the target's tree pass and the verifier; the prefill spread over the rounds):", "",
                      "| method | rounds | draft | verify | other | prefill | drafted nodes | tokens / round |",
                      "|---|---|---|---|---|---|---|---|"]
            for m, e in ((m, parts[m]) for m in block if m in parts):  # the order of the tables above
                lines.append(f"| {m} | {e['rounds']} | {e['draft_ms']:.1f} | {e['verify_ms']:.1f} | "
                             f"{e['other_ms']:.1f} | {e['prefill_ms']:.1f} | {e['nodes']:.2f} | "
                             f"{e['tokens_per_round']:.2f} |")
        subs = list(dict.fromkeys(s for e in block.values() for s in e["per_subtask"]))
        lines += ["", "Per subtask: speedup vs the method's own engine's plain decoding (median [95% CI]):", "",
                  "| method | " + " | ".join(subs) + " |", "|---|" + "---|" * len(subs)]
        for m, e in block.items():
            if m in BASELINE_LABEL:
                continue
            lines.append(f"| {m} (vs {BASELINE_LABEL[e['own_baseline']]}) | " + " | ".join(
                _fmt(e["per_subtask"].get(s, {}).get("speedup_vs_own_plain")) for s in subs) + " |")
        lines.append("")
    lines += ["Methods:", ""] + [f"- `{k}`: {v}" for k, v in meta["methods"].items()]
    return "\n".join(lines) + "\n"


def plot(summary: dict, out: Path, settings: dict | None = None) -> None:
    """speedup.png: per (dtype, T) one panel; per subtask (and all prompts) the median speedup of every
    method over its own engine's plain decoding, with the bootstrap 95% interval as error bars; ``settings``
    (the run's) name each block's top-p in its title."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = list(summary)
    fig, axes = plt.subplots(len(keys), 1, figsize=(14, 3.8 * len(keys)), squeeze=False)
    for ax, key in zip(axes[:, 0], keys):
        block = {m: e for m, e in summary[key].items() if m not in BASELINE_LABEL}
        subs = list(dict.fromkeys(s for e in block.values() for s in e["per_subtask"])) + ["all"]
        width = 0.8 / max(len(block), 1)
        for i, (m, e) in enumerate(block.items()):
            stats = [e["per_subtask"].get(s, {}).get("speedup_vs_own_plain") for s in subs[:-1]]
            stats.append(e.get("speedup_vs_own_plain"))
            med = [s["median"] if s and s["median"] is not None else float("nan") for s in stats]
            lo = [m_ - s["ci95"][0] if s and s["median"] is not None else 0 for m_, s in zip(med, stats)]
            hi = [s["ci95"][1] - m_ if s and s["median"] is not None else 0 for m_, s in zip(med, stats)]
            xs = [j + (i - (len(block) - 1) / 2) * width for j in range(len(subs))]
            ax.bar(xs, med, width, yerr=[lo, hi], capsize=2, label=f"{m} (vs {BASELINE_LABEL[e['own_baseline']]})")
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xticks(range(len(subs)))
        ax.set_xticklabels(subs)
        ax.set_ylabel("speedup (median, 95% CI)")
        ax.set_title(f"{block_heading(key, settings or {})}: speedup over the same engine's plain decoding, "
                     "per subtask")
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(out / "speedup.png", dpi=110)
    plt.close(fig)


def host_stream(runs: list[dict]) -> dict:
    """Per dtype, the host's weight-read times recorded with the rounds (``host_stream_s``, one per
    round: every row of a round carries it) as median / range in ms and the bytes read."""
    out = {}
    for dtype in dict.fromkeys(r["dtype"] for r in runs):
        per_round = {(r["temperature"], r["prompt_id"], r["repeat"]): r for r in runs
                     if r["dtype"] == dtype and r.get("host_stream_s") is not None}
        times = [r["host_stream_s"] * 1000 for r in per_round.values()]
        if times:
            out[dtype] = {"median_ms": median(times), "min_ms": min(times), "max_ms": max(times),
                          "rounds": len(times), "mb": next(iter(per_round.values()))["host_stream_bytes"] / 1e6}
    return out


def round_parts(runs: list[dict]) -> dict:
    """Per block and treespec method, where a target round goes: draft, verify (the target's tree pass
    and the verifier) and other (accept and commit) in ms per round, the prefill spread over the rounds,
    the mean drafted nodes per tree and the tokens a round emits (every round of every prompt pooled)."""
    out: dict = {}
    for r in runs:
        if r.get("draft_s") is None or not r.get("target_calls"):
            continue
        acc = out.setdefault(f"{r['dtype']}/T={r['temperature']:g}", {}).setdefault(
            r["method"], {"draft_s": 0.0, "verify_s": 0.0, "other_s": 0.0, "prefill_s": 0.0, "rounds": 0,
                          "tokens": 0, "node_rounds": 0.0})
        for k in ("draft_s", "verify_s", "other_s", "prefill_s"):
            acc[k] += r[k]
        acc["rounds"] += r["target_calls"]
        acc["tokens"] += r["new_tokens"]
        acc["node_rounds"] += r["mean_tree_nodes"] * r["target_calls"]
    return {key: {m: {"draft_ms": 1000 * a["draft_s"] / a["rounds"], "verify_ms": 1000 * a["verify_s"] / a["rounds"],
                      "other_ms": 1000 * a["other_s"] / a["rounds"], "prefill_ms": 1000 * a["prefill_s"] / a["rounds"],
                      "nodes": a["node_rounds"] / a["rounds"], "tokens_per_round": a["tokens"] / a["rounds"],
                      "rounds": a["rounds"]} for m, a in block.items()}
            for key, block in out.items()}


def write_report(out: Path, runs: list[dict], meta: dict, seed: int, total_rounds: int) -> None:
    """summary.json, table.md and speedup.png from every measured row so far (partial runs say so)."""
    done = len({(r["dtype"], r["temperature"], r["prompt_id"], r["repeat"]) for r in runs})
    meta["rounds"] = {"done": done, "total": total_rounds}
    meta["host_stream"] = host_stream(runs)
    meta["round_parts"] = round_parts(runs)
    blocks = {(r["dtype"], r["temperature"]) for r in runs}
    prompt_rows = per_prompt_speedups(runs, {k: cli_default_method(*k) for k in blocks})
    summary = summarise(prompt_rows, seed)
    write_json(out / "summary.json", {"meta": meta, "summary": summary, "per_prompt": prompt_rows})
    (out / "table.md").write_text(markdown(summary, meta))
    if summary:
        plot(summary, out, meta.get("settings"))
