"""Write the model card of a distilled draft head from what was measured.

    python -m treespec.distill evaluate --head H --num-prompts 12 --new-tokens 48 --tau --json M
    python benchmarks/draft_card.py --head H --metrics M --corpus train-k0,train-greedy,train-sample \
        [--run-summary ~/.cache/treespec/distill/runs/RUN/summary.json] [--continues EARLIER/metrics.json] \
        [--baseline EARLIER_HEAD_NOW.json] --card treespec/assets/gemma3-270m-head.md

Everything in the card comes from files, nothing is typed by hand: the head's own metadata
(architecture, training config, step), the corpus manifests under the distill cache (sources,
positions, build time), the training run's own ``summary.json`` when given (time and precision of its
last training segment; without it the card states no training time) and the metrics JSON written by
``treespec.distill evaluate`` (held-out Spec-Bench prompts, used only to measure; its dtype, threads and
step costs). The card names no machine it cannot read from those files. The record (metrics, corpora,
card, provenance) goes to ``benchmarks/results/draft/<date>-<commit>/`` (or ``--out``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from safetensors import safe_open

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import REPO, add_output_args, finish, open_results, write_json  # noqa: E402
from treespec.files import atomic_write_text  # noqa: E402

#: the draft head's goals: held-out Spec-Bench, the target's own continuations, bf16 on a CPU with native bf16
GOALS = {"top1_agreement_T0": 0.60, "sum_min_pq_T1": 0.55, "step_fraction": 0.08}


def head_metadata(path: Path) -> dict:
    with safe_open(str(path), framework="pt") as fh:
        meta = fh.metadata() or {}
        shapes = {k: list(fh.get_slice(k).get_shape()) for k in fh.keys()}
    return {"config": json.loads(meta.get("config", "{}")), "extra": json.loads(meta.get("extra", "{}")),
            "shapes": shapes}


def _continuations_of(fingerprint: str) -> dict | None:
    """The committed stage-1 continuations (``corpora/*/continuations/<name>/manifest.json``) with this fingerprint."""
    for man_path in sorted((REPO / "corpora").glob("*/continuations/*/manifest.json")):
        man = json.loads(man_path.read_text())
        if man.get("fingerprint") == fingerprint:
            return {"path": str(man_path.parent.relative_to(REPO)), **man.get("options", {})}
    return None


def train_facts(meta: dict) -> tuple[dict, list[str]]:
    """The training config and the training corpora (in training order) a head file records: an exported
    checkpoint keeps both in its ``summary``, a head written at the end of training beside it."""
    extra = meta["extra"]
    summary = extra.get("summary", {})
    return (summary.get("train_config") or extra.get("train_config") or {},
            list(summary.get("corpus") or extra.get("corpus") or []))


def pinned_shards(train_corpora: list[str], max_shards) -> dict[str, int]:
    """Shards read per corpus folder name under ``TrainConfig.max_shards`` (one count, or one per corpus in
    training order); {} when training read every shard."""
    if max_shards is None:
        return {}
    counts = [max_shards] * len(train_corpora) if isinstance(max_shards, int) else list(max_shards)
    if len(counts) != len(train_corpora):
        raise ValueError(f"max_shards {max_shards} does not fit the {len(train_corpora)} training corpora")
    pinned: dict[str, int] = {}
    for path, n in zip(train_corpora, counts):
        name = Path(path).name
        if pinned.setdefault(name, n) != n:
            raise ValueError(f"corpus {name} is read with two shard counts ({pinned[name]} and {n})")
    return pinned


def corpus_stats(names: list[str], pinned: dict[str, int] | None = None) -> list[dict]:
    """Manifest facts of each training corpus (a name under the distill cache or a directory); with ``pinned``
    (folder name -> shards read) ``positions`` counts the positions of the shards training read."""
    from treespec.distill.train import distill_root

    out = []
    for name in dict.fromkeys(names):  # a corpus listed twice (upweighted) is described once
        folder = Path(name).expanduser() if ("/" in name or name.startswith("~")) else distill_root() / "corpus" / name
        man = json.loads((folder / "manifest.json").read_text())
        stats = {"name": folder.name, "positions": man["positions"], "positions_built": man["positions"],
                 "sequences": man["sequences_done"], "of": man["num_input_sequences"], "seconds": man["seconds"],
                 "options": man["options"], "weight": names.count(name)}
        shards = man.get("shards") or []
        if pinned and folder.name in pinned and shards:
            used = shards[:pinned[folder.name]]
            stats.update(positions=sum(s["positions"] for s in used), sequences=sum(s["sequences"] for s in used),
                         shards_used=f"{len(used)} of {len(shards)}")
        if man.get("continuations"):
            stats["continuations"] = _continuations_of(man["continuations"]) or {"fingerprint": man["continuations"]}
        out.append(stats)
    return out


def corpus_content(c: dict) -> str:
    """What a corpus holds, in words, from its manifest facts."""
    cont = c.get("continuations")
    if cont:
        if "path" not in cont:
            return f"prompt + stored continuations (fingerprint {cont['fingerprint'][:12]}, not in this checkout)"
        mode = cont.get("mode", "?") + (f" (T={cont['temperature']})" if cont.get("mode") == "sample" else "")
        return (f"prompt + the target's {mode} continuation (up to {cont.get('new_tokens', '?')} "
                f"tokens, `{cont['path']}`)")
    opts = c["options"]
    if opts["continuation"] == "none":
        return "prompt text"
    return f"prompt + the target's {opts['continuation']} continuation ({opts['new_tokens']} tokens)"


def earlier_training(record: dict) -> str:
    """One line on the training of the head a continued run started from, read from that head's draft
    record (its ``metrics.json`` keeps the head's metadata and its run summary)."""
    meta = record.get("head_metadata") or {}
    tc, _ = train_facts({"extra": meta.get("extra", {})})
    steps = (meta.get("extra", {}).get("summary", {}) or {}).get("step") or tc.get("steps")
    rs = record.get("run_summary") or {}
    return (f"{steps} steps x {tc.get('batch_size')} windows of up to {tc.get('seq_len')} positions, AdamW lr "
            f"{tc.get('lr')} (cosine), seed {tc.get('seed')}"
            + (f", last segment {rs['seconds_this_run'] / 60:.0f} minutes in {rs.get('precision', '?')}"
               if "seconds_this_run" in rs else ""))


def corpora_change(earlier: dict, corpora: list[dict]) -> str:
    """How this run's data differs from the data of the run it continued (each record lists its corpora and
    the shards it read)."""
    def reads(entries: list[dict]) -> dict:
        return {c["name"]: c.get("shards_used") for c in entries}

    before, now = reads(earlier.get("corpora", [])), reads(corpora)
    if before == now:
        return "on the same corpora"
    changed = [f"{name}: {before.get(name) or 'none'} -> {now.get(name) or 'none'} shards"
               for name in sorted(set(before) | set(now)) if before.get(name) != now.get(name)]
    return "on more or other data than the earlier run read (" + "; ".join(changed) + ")"


def _step_how(cost: dict) -> str:
    """How the step was timed, where the record says (records before 2026-11-26 timed the eager runner and
    the head as loaded)."""
    if "target_runner" not in cost:
        return "; the eager target runner, the head as loaded"
    return (f"; target: {cost['target_runner']} (the eager runner: {cost['eager_target_step_s'] * 1e3:.1f} ms, "
            f"fraction {cost['eager_fraction']:.3f}); head: {cost['head_dtype'].removeprefix('torch.')}"
            f"{', ' + cost.get('head_weights', 'packed') if cost['head_packed'] else ''}, as the CLI drafts")


PAIRED_KEYS = ("prompt_set", "prompts", "new_tokens", "positions_T0", "positions_T1")


def paired_lines(metrics: dict, baseline: dict) -> list[str]:
    """The like-for-like lines: ``baseline`` is the ``evaluate --json`` of the head a continued run started
    from, measured by the same command on the same prompts and cached target continuations as ``metrics``
    (the history rows may come from other hosts, whose continuations differ). Refuses a baseline measured on
    other positions."""
    differ = [k for k in PAIRED_KEYS if baseline.get(k) != metrics.get(k)]
    if differ:
        raise ValueError("the baseline was not measured on the same positions as the metrics (" + ", ".join(
            f"{k}: {baseline.get(k)!r} against {metrics.get(k)!r}" for k in differ) + "): no paired comparison")

    def deep(key: str) -> str:
        b, m = baseline.get(key) or [], metrics.get(key) or []
        return f", depth {len(m)} {b[-1]:.3f} -> {m[-1]:.3f}" if b and len(b) == len(m) else ""

    return ["", "Like for like: the head this run started from, measured by the same command on the same "
            f"{metrics['positions_T0']} T=0 and {metrics['positions_T1']} T=1 positions (the same cached target "
            f"continuations): T=0 top-1 {baseline['top1_agreement_T0']:.3f} -> {metrics['top1_agreement_T0']:.3f}"
            f"{deep('top1_agreement_T0_by_depth')}; T=1 sum min(p, q) {baseline['sum_min_pq_T1']:.3f} -> "
            f"{metrics['sum_min_pq_T1']:.3f}{deep('sum_min_pq_T1_by_depth')}. One head each on one set of positions: "
            "no interval."]


def _goal(key: str, value: float, lower_is_better: bool = False) -> str:
    target = GOALS[key]
    met = value <= target if lower_is_better else value >= target
    return f"{value:.3f} (goal {'<=' if lower_is_better else '>='} {target:.2f}: {'met' if met else 'not met'})"


def _architecture_lines(head: Path, meta: dict, metrics: dict, commit: str) -> list[str]:
    cfg, summary = meta["config"], meta["extra"].get("summary", {})
    params = metrics.get("trained_parameters", summary.get("trained_parameters"))
    size_mb = head.stat().st_size / 1e6
    return [
        "# Draft head for Gemma-3-270M (`gemma3-270m-head.safetensors`)",
        "",
        "The draft head treespec ships for the embedded Gemma-3-270M (`--draft head`; `--draft lookup+head` adds",
        "prompt lookup where the context repeats; which drafter `--draft auto` picks is measured and stated in the",
        "README). Generated by `benchmarks/draft_card.py` from the head's metadata, the corpus manifests and measured",
        f"metrics (commit `{commit}`).",
        "",
        "## Architecture",
        "",
        f"- EAGLE-style head (arXiv 2401.15077 / 2406.16858): input `fc(norm(h_(t-1)) ++ norm(emb(x_t)))`, one "
        f"decoder layer ({cfg.get('num_heads')} heads x {cfg.get('head_dim')}, rotary, SwiGLU "
        f"{cfg.get('intermediate_size')}), output norm, then the target's own frozen LM-head rows restricted "
        f"to a vocabulary subset of {metrics.get('vocab_subset')} tokens (q is exactly 0 elsewhere, so "
        "verification stays lossless).",
        f"- Trained parameters: {params:,} ({size_mb:.1f} MB on disk, float16). The target's embedding and "
        "LM head are borrowed at load time, not stored.",
        f"- Hidden size {cfg.get('hidden_size')}, target vocabulary {cfg.get('target_vocab_size')}.",
        (f"- Input features fused from the target's decoder layers {', '.join(map(str, cfg['feature_layers']))} and "
         "its last hidden state (EAGLE-3, arXiv 2503.01840)." if cfg.get("feature_layers") else
         "- Input feature: the target's last hidden state."),
        "",
    ]


def _training_lines(meta: dict, corpora: list[dict], run_summary: dict | None,
                    continues: tuple[str, dict] | None) -> list[str]:
    summary = meta["extra"].get("summary", {})
    tc, _ = train_facts(meta)
    return [
        "## Training",
        "",
        "- Signal: the target's own next-token distributions (soft labels recomputed exactly on the subset from "
        "stored last hidden states), its last hidden states (feature regression) and the corpus tokens (hard "
        "labels); `python -m treespec.distill` (see the README).",
        *([f"- Continued training: this run started from the head of record `{continues[0]}` (commit "
           f"{continues[1].get('commit', '?')}), trained before for {earlier_training(continues[1])}; the "
           f"steps below are this run's, {corpora_change(continues[1], corpora)}."] if continues else []),
        f"- Steps: {summary.get('step')} x {tc.get('batch_size')} windows of up to {tc.get('seq_len')} positions, "
        f"AdamW lr {tc.get('lr')} (cosine), feature noise {tc.get('feature_noise')}, seed {tc.get('seed')}; loss weights "
        f"soft {tc.get('w_soft')}, hard {tc.get('w_hard')}, feature {tc.get('w_feat')}, total variation {tc.get('w_tv', 0.0)}.",
        *([f"- Training-time test (EAGLE-3, arXiv 2503.01840): the head is unrolled on its own features for "
           f"{tc['depths']} steps and every depth is trained (loss weight x{tc.get('depth_decay')} per depth)."]
          if (tc.get("depths") or 1) > 1 else []),
        *([f"- Precision: autocast `{tc.get('amp')}`"
           + (" (bf16 where the CPU computes bf16 natively, else float32)" if tc.get("amp") == "auto" else "")
           + (f", subset logits {'under the same autocast' if tc.get('logits_amp') else 'in float32'}."
              if tc.get("amp") != "off" else ", everything in float32.")]
          if "logits_amp" in tc else []),
        *(["- Data pinned: training read only the first shards of each corpus (`max_shards`); the table counts "
           "those."] if any("shards_used" in c for c in corpora) else []),
        (f"- Last training segment (the run's summary.json): {run_summary['seconds_this_run'] / 60:.0f} minutes, "
         f"{run_summary.get('positions_this_run', 0):,} positions, precision {run_summary.get('precision', '?')}, "
         f"ending at step {run_summary.get('step')}."
         if run_summary and "seconds_this_run" in run_summary else
         "- Training time: not recorded in the head or a run summary (pass --run-summary to state it)."),
    ]


def _corpus_lines(corpora: list[dict]) -> list[str]:
    lines = [
        "- Corpus (only ../shared/data/train prompts, never the eval set):",
        "",
        "| corpus | sequences | positions | shards read | content | build time | sampling weight |",
        "|---|---:|---:|---:|---|---:|---:|",
    ]
    for c in corpora:
        lines.append(f"| {c['name']} | {c['sequences']:,} of {c['of']:,} | {c['positions']:,} | "
                     f"{c.get('shards_used', 'all')} | {corpus_content(c)} | "
                     f"{c['seconds'] / 60:.0f} min | x{c['weight']} |")
    return lines + ["", f"Total: {sum(c['positions'] for c in corpora):,} token positions."]


def _measured_lines(metrics: dict) -> list[str]:
    cost, goal = metrics["step_cost"], _goal
    lines = [
        "",
        "## Measured (held-out Spec-Bench prompts, used only to measure)",
        "",
        f"- Prompts: {metrics['prompts']} (seeded choice from ../shared/data/eval), continuations of "
        f"{metrics.get('new_tokens', '?')} tokens by the target itself (greedy for T=0, sampled for T=1).",
        f"- Top-1 agreement with the target at T=0 over {metrics['positions_T0']} positions: "
        f"{goal('top1_agreement_T0', metrics['top1_agreement_T0'])}.",
        f"- Single-draft acceptance sum min(p, q) at T=1 over {metrics['positions_T1']} positions: "
        f"{goal('sum_min_pq_T1', metrics['sum_min_pq_T1'])}.",
        f"- One head step (one token, with cache) / one target step: {goal('step_fraction', cost['fraction'], True)}"
        f" ({cost['head_step_s'] * 1e3:.1f} ms vs {cost['target_step_s'] * 1e3:.1f} ms, {metrics['dtype']}, "
        f"{metrics['threads']} thread{_step_how(cost)}).",
    ]
    by_depth = metrics.get("top1_agreement_T0_by_depth")
    if by_depth:
        t1 = metrics.get("sum_min_pq_T1_by_depth", [])
        lines += ["", "Per tree depth (depth k: the head's k-th step along the target's own text, given that depths "
                  "1..k-1 were accepted; at T=0 top-1 agreement is a chain's acceptance at depth k):", "",
                  "| depth | " + " | ".join(str(k + 1) for k in range(len(by_depth))) + " |",
                  "|---|" + "---:|" * len(by_depth),
                  "| T=0 top-1 agreement | " + " | ".join(f"{v:.3f}" for v in by_depth) + " |"]
        if t1:
            lines.append("| T=1 sum min(p, q) | " + " | ".join(f"{v:.3f}" for v in t1[:len(by_depth)])
                         + " |" * (len(by_depth) - len(t1)) + " |")
        lines.append("")
    return lines


def _history_lines(history: list[tuple[str, dict]]) -> list[str]:
    lines = ["", "## Earlier heads (history)", "",
             "Each from its own record under `benchmarks/results/draft/`; prompts, lengths and dtype differ "
             "between records, so compare with care:", "",
             "| record | commit | prompts x tokens | T=0 top-1 | T=1 sum min(p, q) | head step / target step | dtype |",
             "|---|---|---|---:|---:|---:|---|"]
    for name, rec in history:
        m = rec["metrics"]
        lines.append(f"| {name} | {rec.get('commit', '?')} | {m['prompts']} x {m.get('new_tokens', '?')} | "
                     f"{m['top1_agreement_T0']:.3f} | {m['sum_min_pq_T1']:.3f} | "
                     f"{m['step_cost']['fraction']:.3f} | {m['dtype'].removeprefix('torch.')} |")
    return lines


def render(head: Path, meta: dict, metrics: dict, corpora: list[dict], run_summary: dict | None,
           commit: str, history: list[tuple[str, dict]] = (),
           continues: tuple[str, dict] | None = None, baseline: dict | None = None) -> str:
    """The model card of ``head``: architecture, training, corpora, measured metrics (paired against a
    ``baseline`` record where given), earlier heads and limits."""
    lines = (_architecture_lines(head, meta, metrics, commit) + _training_lines(meta, corpora, run_summary, continues)
             + _corpus_lines(corpora))
    lines += _measured_lines(metrics)
    if "tau_chain4_T0" in metrics:
        lines.append(f"- tau of a chain of 4 in the engine: {metrics['tau_chain4_T0']:.2f} at T=0, "
                     f"{metrics['tau_chain4_T1']:.2f} at T=1.")
    if baseline is not None:
        lines += paired_lines(metrics, baseline)
    if history:
        lines += _history_lines(history)
    lines += [
        "",
        "## Limits",
        "",
        "- It only drafts for the embedded Gemma-3-270M (it reads that model's hidden states and uses its "
        "embedding and LM-head rows); loading it for another target raises an error.",
        "- Where a goal above is not met, the README and the issue notes give the measured gap and the ablation "
        "behind this recipe; training resumes from this file with `--init-head`.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--head", type=Path, required=True)
    ap.add_argument("--metrics", type=Path, required=True, help="JSON of treespec.distill evaluate --json")
    ap.add_argument("--corpus", required=True, help="corpus names as given to training (comma-separated)")
    ap.add_argument("--run-summary", type=Path, default=None,
                    help="the training run's summary.json (python -m treespec.distill train writes it): training "
                         "time and precision of its last segment; left out of the card when not given")
    ap.add_argument("--history", type=Path, nargs="*", default=[],
                    help="earlier draft records (benchmarks/results/draft/*/metrics.json) listed as history")
    ap.add_argument("--continues", type=Path, default=None,
                    help="the draft record (benchmarks/results/draft/*/metrics.json) of the head this run started "
                         "from (train --init-head): the card states that head's training too")
    ap.add_argument("--baseline", type=Path, default=None,
                    help="evaluate --json of the head this run started from, measured by the same command on the same "
                         "prompts and cached continuations: the card states the paired change (stored in the record)")
    ap.add_argument("--card", type=Path, required=True, help="where to write the model card (e.g. treespec/assets/...md)")
    add_output_args(ap)
    args = ap.parse_args(argv)
    started = __import__("time").time()
    meta = head_metadata(args.head)
    names = args.corpus.split(",")
    _, trained_on = train_facts(meta)
    if trained_on and [Path(c).name for c in dict.fromkeys(trained_on)] != [Path(c).name for c in dict.fromkeys(names)]:
        raise SystemExit(f"--corpus {args.corpus} is not what the head records it was trained on: "
                         f"{', '.join(Path(c).name for c in trained_on)}")
    tc, _ = train_facts(meta)
    corpora = corpus_stats(names, pinned_shards(trained_on or names, tc.get("max_shards")))
    metrics = json.loads(args.metrics.read_text())
    baseline = json.loads(args.baseline.read_text()) if args.baseline else None
    if baseline is not None:
        try:
            paired_lines(metrics, baseline)  # refused before the record folder is made
        except ValueError as err:
            raise SystemExit(f"--baseline {args.baseline}: {err}") from None
    rec, prov = open_results("draft", args.out, allow_dirty=args.allow_dirty)
    run_summary = json.loads(args.run_summary.read_text()) if args.run_summary else None
    commit = prov["commit_short"] + ("-dirty" if prov["dirty"] else "")
    def record_of(path: Path) -> tuple[str, dict]:
        earlier = json.loads(path.read_text())
        if "commit" not in earlier and (path.parent / "provenance.json").exists():
            prov_h = json.loads((path.parent / "provenance.json").read_text())
            earlier["commit"] = prov_h["commit_short"] + ("-dirty" if prov_h.get("dirty") else "")
        return path.parent.name, earlier

    history = [record_of(path) for path in args.history]
    continues = record_of(args.continues) if args.continues else None
    card = render(args.head, meta, metrics, corpora, run_summary, commit, history, continues, baseline)
    atomic_write_text(args.card, card)
    write_json(rec / "metrics.json", {"metrics": metrics, "corpora": corpora, "run_summary": run_summary,
                                      "sources": {"head": str(args.head), "metrics": str(args.metrics),
                                                  "run_summary": str(args.run_summary) if args.run_summary else None,
                                                  "history": [str(p) for p in args.history],
                                                  "continues": str(args.continues) if args.continues else None,
                                                  "baseline": str(args.baseline) if args.baseline else None},
                                      "head_metadata": {k: meta[k] for k in ("config", "extra")}})
    atomic_write_text(rec / "card.md", card)
    if baseline is not None:
        write_json(rec / "previous-head-metrics.json", baseline)
    finish(rec, started)
    print(card)
    return 0


if __name__ == "__main__":
    sys.exit(main())
