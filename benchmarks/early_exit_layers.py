"""Measured layer search for the self-speculative (early-exit) draft of Gemma-3-270M: which exit layer drafts best.

    python benchmarks/early_exit_layers.py [--prompts 16] [--layers 2 4 6 8 10 12 14 16]

For every exit layer L the draft is the target's first L decoder layers -> final norm -> LM head
(``treespec.models.early_exit``, weights shared, nothing trained). On TRAIN prompts only
(../shared/data/train, first ``--prompts`` rows, <= 128 tokens each), ONE target forward with all
hidden states gives p and every exit's q at every position:

* acceptance of one drafted token: top-1 agreement (T = 0) and sum min(p, q) (T = 1);
* draft step cost c(L): a measured one-token step of the early-exit model with its KV cache,
  relative to a one-token step of the target (median of ``--repeats``);
* predicted speedup of a chain of k drafts: tau(a, k) = (1 - a^(k+1)) / (1 - a) tokens per step
  (independent acceptances a) over a step cost t(k + 1) + k c(L), with t the measured verify
  profile of this machine (``benchmarks/results/profile``, relative to one token).

Writes ``early_exit_layers.json`` / ``.md`` and ``provenance.json`` under
``benchmarks/results/early_exit/<date>-<commit>/`` (or ``--out``); the verify profile used is named by
path (``--profile``, default: the newest committed one) and its own provenance is recorded. The search is a grid over L (Draft & Verify, arXiv 2309.08168, searched layer subsets
by Bayesian optimisation; a measured grid over exit depths is the simple version).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import SHARED, add_output_args, finish, open_results, require_shared, write_json  # noqa: E402
from treespec.distill.inputs import read_prompt_texts  # noqa: E402
from treespec.trees.sequoia import HardwareProfile  # noqa: E402
from treespec.models.kv_cache import cache_kwargs, output_cache  # noqa: E402

TRAIN = SHARED / "data" / "train" / "train_prompts.jsonl"


def step_cost(model, ids: list[int], repeats: int) -> float:
    """Median seconds of a one-token cached step after a ``len(ids)``-token prefill (first step dropped)."""
    times = []
    with torch.no_grad():
        out = model(torch.tensor([ids]), use_cache=True, logits_to_keep=1)
        past = output_cache(out)
        nxt = torch.tensor([[int(out.logits[0, -1].argmax())]])
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            out = model(nxt, **cache_kwargs(model, past), use_cache=True)
            times.append(time.perf_counter() - t0)  # the cache grows by one token per repeat
    return statistics.median(times[1:])


def newest_profile(root: Path, dtype: str) -> Path | None:
    """The newest ``profile.json`` under ``root`` measured in ``dtype`` on unquantised weights (newest by the
    ``date_utc`` of its folder's provenance record; folders without one are older than every folder with one)."""
    def matches(path: Path) -> bool:
        meta = json.loads(path.read_text()).get("meta", {})
        return meta.get("dtype") == dtype and not meta.get("quantize")

    def date(path: Path) -> str:
        prov = path.parent / "provenance.json"
        return json.loads(prov.read_text()).get("date_utc", "") if prov.exists() else ""
    found = [p for p in root.glob("*/profile.json") if matches(p)]
    return max(found, key=lambda p: (date(p), p.parent.name), default=None)


def exit_agreement(target, prompts: list[list[int]], layers: list[int]) -> tuple[dict, dict, int]:
    """Per exit layer, summed over every prompt position: top-1 agreement with the target (T=0 acceptance of one
    draft) and the overlap sum(min(p, q)) of the two distributions (T=1); and the number of positions."""
    agree = {L: 0.0 for L in layers}
    overlap = {L: 0.0 for L in layers}
    count = 0
    norm, lm = target.model.norm, target.lm_head
    softcap = getattr(target.config.get_text_config(), "final_logit_softcapping", None)
    with torch.no_grad():
        for ids in prompts:
            out = target(torch.tensor([ids]), output_hidden_states=True)
            t_logits = out.logits[0].float()
            p1 = torch.softmax(t_logits, dim=-1)
            top = t_logits.argmax(-1)
            for L in layers:
                d = lm(norm(out.hidden_states[L][0])).float()
                if softcap:
                    d = torch.tanh(d / softcap) * softcap
                agree[L] += float((d.argmax(-1) == top).sum())
                overlap[L] += float(torch.minimum(p1, torch.softmax(d, dim=-1)).sum())
            count += len(ids)
    return agree, overlap, count


def render(rows: list[dict], best: dict, meta: dict, prof_meta: dict, args, dtype_name: str, n_prompts: int) -> str:
    """The markdown table of the layer search."""
    commit, count, t_target, profile_name = meta["commit"], meta["positions"], meta["target_step_s"], meta["profile"]
    same_cpu = prof_meta.get("machine", {}).get("cpu")
    lines = [f"# Early-exit layer search (commit {commit})", "",
             f"{meta['machine']['cpu']}, {args.threads} thread(s), {dtype_name}; {n_prompts} train prompts, {count} "
             f"positions; target step {t_target * 1e3:.0f} ms; verify profile `{profile_name}` (commit "
             f"{prof_meta.get('commit', '?')}, measured on {same_cpu or 'an unrecorded CPU'})", "",
             "| exit layer | T | acceptance (1 draft) | draft step / target step | best chain k | predicted speedup |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['layer']} | {r['temperature']} | {r['acceptance']:.3f} | {r['draft_cost']:.2f} | "
                     f"{r['best_chain']} | {r['predicted_speedup']:.2f}x |")
    lines += ["", "Best: " + "; ".join(f"{t}: layer {b['layer']}, chain {b['best_chain']}, predicted "
                                        f"{b['predicted_speedup']:.2f}x" for t, b in best.items())]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--layers", type=int, nargs="+", default=[2, 4, 6, 8, 10, 12, 14, 16])
    ap.add_argument("--max-chain", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                    help="target (and draft) dtype; auto = bf16 where the CPU computes it natively")
    ap.add_argument("--profile", type=Path, default=None,
                    help="profile.json of benchmarks/profile_hardware.py (default: the newest under results/profile)")
    add_output_args(ap)
    args = ap.parse_args(argv)
    started = time.time()
    from treespec.models.loading import resolve_dtype

    dtype = resolve_dtype(args.dtype)
    dtype_name = str(dtype).replace("torch.", "")
    profile_path = args.profile or newest_profile(ROOT / "benchmarks" / "results" / "profile", dtype_name)
    if profile_path is None:  # checked before any folder is opened or model loaded
        raise SystemExit(f"no committed {dtype_name} hardware profile: run benchmarks/profile_hardware.py "
                         f"--dtype {dtype_name} first (or pass --profile)")
    profile_path = profile_path.resolve()
    profile_name = str(profile_path.relative_to(ROOT)) if profile_path.is_relative_to(ROOT) else str(profile_path)
    require_shared(TRAIN)  # checked before a results folder exists
    folder, prov = open_results("early_exit", args.out, allow_dirty=args.allow_dirty)
    torch.set_num_threads(args.threads)
    from treespec.models.early_exit import early_exit_model
    from treespec.models.loading import load_model, load_tokenizer

    target = load_model("embedded", dtype=dtype)
    tok = load_tokenizer("embedded")
    prompts = [tok(p)["input_ids"][:128] for p in read_prompt_texts(TRAIN, args.prompts)]
    agree, overlap, count = exit_agreement(target, prompts, args.layers)
    prof = HardwareProfile.load(profile_path)
    prof_meta = next((json.loads((profile_path.parent / f).read_text()) for f in ("provenance.json", "meta.json")
                      if (profile_path.parent / f).exists()), {})
    probe = prompts[0]
    t_target = step_cost(target, probe, args.repeats)
    rows = []
    for L in args.layers:
        c = step_cost(early_exit_model(target, L), probe, args.repeats) / t_target
        for name, a in (("T=0", agree[L] / count), ("T=1", overlap[L] / count)):
            best = max(((1 - a ** (k + 1)) / (1 - a) / (prof.t(k + 1) + k * c), k) for k in range(1, args.max_chain + 1))
            rows.append({"layer": L, "temperature": name, "acceptance": a, "draft_cost": c,
                         "best_chain": best[1], "predicted_speedup": best[0]})
    best = {t: max((r for r in rows if r["temperature"] == t), key=lambda r: r["predicted_speedup"])
            for t in ("T=0", "T=1")}
    commit = prov["commit_short"] + ("-dirty" if prov["dirty"] else "")
    meta = {"commit": commit, "machine": prov["machine"], "settings": {k: str(v) for k, v in vars(args).items()},
            "positions": count, "target_step_s": t_target, "profile": profile_name,
            "profile_provenance": {k: prof_meta.get(k) for k in ("commit", "dirty", "machine") if k in prof_meta}}
    write_json(folder / "early_exit_layers.json", {"meta": meta, "rows": rows, "best": best})
    text = render(rows, best, meta, prof_meta, args, dtype_name, len(prompts))
    (folder / "early_exit_layers.md").write_text(text + "\n")
    finish(folder, started)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
