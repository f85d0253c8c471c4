"""Speed and acceptance on Spec-Bench (and HumanEval), side by side with Hugging Face decoding.

One command::

    python benchmarks/run.py --quick            # ~ a few minutes: 1 prompt per subtask, 32 tokens
    python benchmarks/run.py                    # 10 prompts per subtask + 10 HumanEval, 128 tokens

Methods (same target, dtype, prompts and run): Hugging Face ``generate`` (plain), Hugging Face
prompt-lookup decoding, Hugging Face assisted generation (with ``--draft``; its defaults and a
sweep of ``num_assistant_tokens``), treespec's plain loop, and treespec with n-gram chains and
trees (and model-drafted chains / trees with ``--draft``). The baseline is the faster plain method.
Prompts are plain text (the embedded Gemma-3-270M is a base model: no chat template); batch 1;
warm-up first; fixed threads and seeds; generation runs exactly N new tokens (EOS does not stop
it, and no logits are altered to force that).

Writes ``summary.json``, ``per_prompt.jsonl``, ``table.md`` and PNG plots to
``benchmarks/results/speed/<date>-<commit>/`` with machine and settings.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path
from statistics import mean

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import (  # noqa: E402
    git_commit,
    load_prompts,
    load_train_prompts,
    machine_info,
    results_dir,
    write_json,
)
from treespec.drafting.model import ModelDrafter, StaticTreeShape  # noqa: E402
from treespec.drafting.ngram import NgramConfig, NgramDrafter  # noqa: E402
from treespec.generate import GenerationConfig, generate  # noqa: E402
from treespec.models.loading import load_model, load_tokenizer  # noqa: E402
from treespec.sampling import SamplingConfig  # noqa: E402


class ForwardCounter:
    """Counts top-level forward calls of a model (target passes for tau of HF methods)."""

    def __init__(self, model) -> None:
        self.calls = 0
        model.register_forward_hook(self._hook)

    def _hook(self, *args) -> None:
        self.calls += 1


def hf_method(name: str, model, counter: ForwardCounter, draft=None, **extra):
    def run(ids: list[int], n: int, temperature: float, seed: int) -> dict:
        gen_cfg = copy.deepcopy(model.generation_config)
        gen_cfg.eos_token_id = None  # run exactly n tokens without touching the logits
        gen_cfg.pad_token_id = gen_cfg.pad_token_id if gen_cfg.pad_token_id is not None else 0
        kwargs = dict(max_new_tokens=n, generation_config=gen_cfg, do_sample=temperature > 0, **extra)
        if temperature > 0:
            kwargs.update(temperature=temperature, top_k=0, top_p=1.0)
        if draft is not None:
            kwargs["assistant_model"] = draft
        x = torch.tensor([ids])
        torch.manual_seed(seed)
        counter.calls = 0
        t0 = time.perf_counter()
        out = model.generate(x, attention_mask=torch.ones_like(x), **kwargs)
        wall = time.perf_counter() - t0
        tokens = out[0, len(ids):].tolist()
        return {"tokens": tokens, "wall_s": wall, "target_calls": counter.calls}
    run.method = name
    return run


def ts_method(name: str, model, make_drafter):
    def run(ids: list[int], n: int, temperature: float, seed: int) -> dict:
        cfg = GenerationConfig(max_new_tokens=n, sampling=SamplingConfig(temperature), seed=seed, stop_on_eos=False)
        res = generate(model, ids, make_drafter(), cfg)
        s = res.summary()
        return {"tokens": res.token_ids, "wall_s": s["wall_s"], "target_calls": s["target_calls"],
                "draft_s": s["draft_s"], "verify_s": s["verify_s"], "other_s": s["other_s"],
                "prefill_s": s["prefill_s"],
                "mean_tree_nodes": s["mean_tree_nodes"]}
    run.method = name
    return run


def build_methods(model, draft, args) -> list:
    counter = ForwardCounter(model)
    methods = [
        hf_method("hf_plain", model, counter),
        ts_method("ts_plain", model, lambda: None),
        hf_method("hf_prompt_lookup", model, counter, prompt_lookup_num_tokens=args.lookup_tokens),
        ts_method("ts_ngram_chain", model, lambda: NgramDrafter(NgramConfig(depth=args.ngram_depth, branches=1))),
        ts_method("ts_ngram_adaptive", model, lambda: NgramDrafter(NgramConfig(
            depth=args.ngram_depth, branches=1, adaptive=True))),
        ts_method("ts_ngram_tree", model, lambda: NgramDrafter(NgramConfig(
            depth=args.ngram_depth, branches=args.ngram_branches, max_nodes=args.ngram_nodes))),
    ]
    # one store for the whole run: it learns from every earlier prompt and output (online adaptation)
    from treespec.drafting.online import OnlineNgramConfig, OnlineNgramDrafter

    online = OnlineNgramDrafter(OnlineNgramConfig(NgramConfig(depth=args.ngram_depth, branches=1, adaptive=True)))
    online_method = ts_method("ts_online_ngram", model, lambda: online)
    online_method.reset = lambda: online.__init__(online.config)  # a fresh store per temperature
    methods.append(online_method)
    if args.head:  # the trained draft head (EAGLE-style): alone, and behind prompt lookup
        from treespec.drafting.head import EagleHead, HeadDrafter
        from treespec.drafting.hybrid import LookupHeadDrafter
        from treespec.drafting.shipped import load_default_head

        head = load_default_head(model) if args.head == "shipped" else EagleHead.load(args.head, model)
        chain = tuple(args.head_tree)

        def head_drafter(confidence: float) -> HeadDrafter:
            return HeadDrafter(head, StaticTreeShape(chain), min_confidence=confidence)

        from treespec.trees.dyspec import DySpecDrafter
        from treespec.trees.eagle2 import Eagle2Drafter

        methods += [
            ts_method("ts_head_chain", model, lambda: head_drafter(0.0)),
            ts_method("ts_head_confident", model, lambda: head_drafter(args.head_confidence)),
            # the head behind the dynamic tree builders (HeadRunner), budget 8 nodes, depth <= 4
            ts_method("ts_head_dyspec", model, lambda: DySpecDrafter(head, 8, 4)),
            ts_method("ts_head_eagle2", model, lambda: Eagle2Drafter(head, 8, top_k=4, depth=4)),
            ts_method("ts_lookup_head", model, lambda: LookupHeadDrafter(NgramDrafter(NgramConfig(
                depth=args.ngram_depth, branches=1, adaptive=True)), head_drafter(args.head_confidence))),
        ]
        # online fine-tuning (OSD-style): its own copy of the head, kept (and learning) across the
        # prompts of one temperature, like the online n-gram store; a fresh copy per temperature
        from treespec.drafting.online_head import OnlineHeadConfig, OnlineHeadDrafter

        def online_head() -> OnlineHeadDrafter:
            own = load_default_head(model) if args.head == "shipped" else EagleHead.load(args.head, model)
            return OnlineHeadDrafter(HeadDrafter(own, StaticTreeShape(chain), min_confidence=args.head_confidence),
                                     OnlineHeadConfig())

        learner = [online_head()]
        learner_method = ts_method("ts_online_head", model, lambda: learner[0])
        learner_method.reset = lambda: learner.__setitem__(0, online_head())
        methods.append(learner_method)
    if args.medusa:  # Medusa-style decoding heads: deterministic top-k candidates along index paths
        from treespec.drafting.medusa import MedusaHeads
        from treespec.trees.grow import ShapeDrafter
        from treespec.trees.shape import TreeShape

        from treespec.drafting.shipped import load_default_medusa

        medusa = load_default_medusa(model) if args.medusa == "shipped" else MedusaHeads.load(args.medusa, model)
        for paths in args.medusa_paths:  # one method per tree, named by its node count
            shape = TreeShape.from_paths(json.loads(paths))
            methods.append(ts_method(f"ts_medusa_{shape.num_drafted}", model,
                                     lambda shape=shape: ShapeDrafter(medusa, shape, "deterministic")))
            if args.medusa_confidence > 0:  # adaptive draft length: only confident candidates kept
                methods.append(ts_method(
                    f"ts_medusa_{shape.num_drafted}_c{args.medusa_confidence:g}", model,
                    lambda shape=shape: ShapeDrafter(medusa, shape, "deterministic",
                                                     min_confidence=args.medusa_confidence)))
    if draft is not None:
        methods += [
            hf_method("hf_assisted", model, counter, draft=draft),
            ts_method("ts_model_chain", model, lambda: ModelDrafter(draft, StaticTreeShape.chain(4))),
            ts_method("ts_model_tree", model, lambda: ModelDrafter(draft, StaticTreeShape((2, 2, 1, 1)))),
        ]
    return [m for m in methods if not args.methods or m.method in args.methods]


def summarise(rows: list[dict]) -> dict:
    """Per (dtype, temperature, method): means, speedup over the faster plain method, equality rate."""
    out: dict = {}
    keys = sorted({(r["dtype"], r["temperature"]) for r in rows})
    for dtype, temp in keys:
        sel = [r for r in rows if r["dtype"] == dtype and r["temperature"] == temp]
        methods = sorted({r["method"] for r in sel})
        tps = {m: mean(r["tokens_per_s"] for r in sel if r["method"] == m) for m in methods}
        plain = [m for m in ("hf_plain", "ts_plain") if m in tps]
        baseline = max(plain, key=lambda m: tps[m]) if plain else None
        block = {"baseline": baseline}
        for m in methods:
            mine = [r for r in sel if r["method"] == m]
            entry = {
                "prompts": len(mine),
                "tokens_per_s": tps[m],
                "tau": mean(r["tau"] for r in mine),
                "speedup": (mean(r["tokens_per_s"] / r["baseline_tokens_per_s"] for r in mine)
                            if baseline else None),
            }
            if temp == 0:
                entry["greedy_equal_rate"] = mean(float(r["equal_to_plain"]) for r in mine)
            if "draft_s" in mine[0]:
                wall = sum(r["wall_s"] for r in mine)
                entry["share_draft"] = sum(r["draft_s"] for r in mine) / wall
                entry["share_verify"] = sum(r["verify_s"] for r in mine) / wall
                entry["share_prefill"] = sum(r["prefill_s"] for r in mine) / wall
                entry["share_other"] = sum(r["other_s"] for r in mine) / wall  # bookkeeping outside the passes
            subtasks = sorted({r["subtask"] for r in mine})
            entry["per_subtask"] = {
                s: {"speedup": mean(r["tokens_per_s"] / r["baseline_tokens_per_s"] for r in mine if r["subtask"] == s)
                    if baseline else None,
                    "tau": mean(r["tau"] for r in mine if r["subtask"] == s)}
                for s in subtasks
            }
            block[m] = entry
        out[f"{dtype}/T={temp:g}"] = block
    return out


def markdown(summary: dict, meta: dict) -> str:
    lines = [f"# Speed benchmark ({meta['commit']}, {meta['date']})", "",
             f"Machine: {meta['machine']['cpu']}, {meta['machine']['cores']} cores, torch threads "
             f"{meta['machine']['torch_threads']}, bf16 native: {meta['machine']['bf16_native']}. "
             f"Settings: {json.dumps(meta['settings'])}", ""]
    for key, block in summary.items():
        lines += [f"## {key} (baseline: {block['baseline']})", "",
                  "| method | tokens/s | speedup | tau | greedy = plain | prefill / draft / verify / other |",
                  "|---|---|---|---|---|---|"]
        for m, e in block.items():
            if m == "baseline":
                continue
            eq = f"{e['greedy_equal_rate']:.2f}" if "greedy_equal_rate" in e else "-"
            split = (f"{e.get('share_prefill', float('nan')):.2f} / {e['share_draft']:.2f} / "
                     f"{e['share_verify']:.2f} / {e['share_other']:.2f}"
                     if "share_draft" in e else "-")
            sp = f"{e['speedup']:.2f}x" if e["speedup"] is not None else "-"
            lines.append(f"| {m} | {e['tokens_per_s']:.2f} | {sp} | {e['tau']:.2f} | {eq} | {split} |")
        lines += ["", "Per subtask (speedup / tau):", "",
                  "| method | " + " | ".join(next(iter(v["per_subtask"] for k, v in block.items() if k != "baseline"))) + " |",
                  "|---|" + "---|" * len(next(iter(v["per_subtask"] for k, v in block.items() if k != "baseline")))]
        for m, e in block.items():
            if m == "baseline":
                continue
            cells = [f"{v['speedup']:.2f}x / {v['tau']:.2f}" if v["speedup"] is not None else f"- / {v['tau']:.2f}"
                     for v in e["per_subtask"].values()]
            lines.append(f"| {m} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def plot(summary: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, metric in zip(axes, ("speedup", "tau")):
        keys = list(summary)
        methods = sorted({m for b in summary.values() for m in b if m != "baseline"})
        width = 0.8 / max(len(keys), 1)
        for i, key in enumerate(keys):
            vals = [summary[key].get(m, {}).get(metric) or 0 for m in methods]
            ax.bar([j + i * width for j in range(len(methods))], vals, width, label=key)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(methods))])
        ax.set_xticklabels(methods, rotation=30, ha="right")
        ax.set_title(metric)
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "speed.png", dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="1 prompt per subtask, 32 new tokens, T=0 only")
    ap.add_argument("--per-subtask", type=int, default=10)
    ap.add_argument("--prompt-set", choices=["eval", "train"], default="eval",
                    help="eval: Spec-Bench + HumanEval (measurement); train: ../shared/data/train prompts per "
                         "category, for tuning drafter settings without touching the eval set (results/tuning/)")
    ap.add_argument("--humaneval", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    ap.add_argument("--dtypes", nargs="+", default=["float32"], choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--draft", default=None,
                    help="draft model path/id or early-exit:L (enables HF assisted and model drafts)")
    ap.add_argument("--methods", nargs="*", default=None, help="subset of methods to run")
    ap.add_argument("--head", default=None,
                    help="'shipped' or a head .safetensors: adds ts_head_chain, ts_head_confident, ts_lookup_head")
    ap.add_argument("--medusa", default=None,
                    help="'shipped' or Medusa heads .safetensors: adds ts_medusa_N (N = drafted nodes) per tree")
    ap.add_argument("--medusa-paths", nargs="+", default=["[[0],[1],[0,0]]", "[[0],[1],[2],[0,0],[0,1],[1,0],[0,0,0]]"],
                    help="Medusa trees as JSON index paths (rank in each head's top-k, one entry per depth)")
    ap.add_argument("--medusa-confidence", type=float, default=0.2,
                    help="also run each Medusa tree with this min_confidence (0: no confident variant)")
    ap.add_argument("--head-tree", type=int, nargs="+", default=[1, 1, 1], help="children per depth of head trees")
    ap.add_argument("--head-confidence", type=float, default=0.2, help="min_confidence of the confident variants")
    ap.add_argument("--lookup-tokens", type=int, default=10, help="HF prompt_lookup_num_tokens")
    ap.add_argument("--ngram-depth", type=int, default=8)
    ap.add_argument("--ngram-branches", type=int, default=4)
    ap.add_argument("--ngram-nodes", type=int, default=16)
    ap.add_argument("--tag", default=None, help="results folder suffix (default: the commit)")
    args = ap.parse_args(argv)
    if args.quick:
        args.per_subtask, args.humaneval, args.max_new_tokens, args.temperatures = 1, 0, 32, [0.0]
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    tok = load_tokenizer("embedded")
    if args.prompt_set == "train":  # tuning runs: train prompts only, results kept apart
        prompts = load_train_prompts(args.per_subtask)
        out = results_dir("tuning", args.tag)
    else:
        prompts = load_prompts(args.per_subtask, args.humaneval)
        out = results_dir("speed", args.tag)
    meta = {"commit": git_commit(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "machine": machine_info(), "settings": {k: v for k, v in vars(args).items()},
            "prompts": [p["id"] for p in prompts]}
    rows: list[dict] = []
    per_prompt = (out / "per_prompt.jsonl").open("w")
    for dtype in args.dtypes:
        model = load_model("embedded", dtype=dtype)
        if args.draft and args.draft.startswith("early-exit:"):  # self-speculative: the target's first layers
            from treespec.models.loading import load_draft_model
            draft = load_draft_model(args.draft, model)
        else:
            draft = load_model(args.draft, dtype=dtype) if args.draft else None
        methods = build_methods(model, draft, args)
        warm = tok("Warm-up: the quick brown fox jumps over the lazy dog.")["input_ids"]
        for m in methods:  # warm-up
            m(warm, 8, 0.0, 0)
        for temp in args.temperatures:
            for m in methods:  # stateful methods (the online store) start empty at each temperature
                getattr(m, "reset", lambda: None)()
            bar = tqdm(prompts, desc=f"{dtype} T={temp:g}", unit="prompt")
            for p in bar:
                ids = tok(p["prompt"])["input_ids"]
                results = {m.method: m(ids, args.max_new_tokens, temp, args.seed) for m in methods}
                plain_tokens = results.get("ts_plain", results.get("hf_plain"))["tokens"]
                tps = {k: len(r["tokens"]) / r["wall_s"] for k, r in results.items()}
                base = max((tps[k] for k in ("hf_plain", "ts_plain") if k in tps), default=float("nan"))
                for k, r in results.items():
                    row = {"dtype": dtype, "temperature": temp, "method": k, "prompt_id": p["id"],
                           "subtask": p["subtask"], "new_tokens": len(r["tokens"]), "tokens_per_s": tps[k],
                           "baseline_tokens_per_s": base, "tau": len(r["tokens"]) / max(r["target_calls"], 1),
                           "equal_to_plain": r["tokens"] == plain_tokens, **r}
                    rows.append({kk: vv for kk, vv in row.items() if kk != "tokens"})
                    per_prompt.write(json.dumps(row) + "\n")
                per_prompt.flush()
    per_prompt.close()
    summary = summarise(rows)
    write_json(out / "summary.json", {"meta": meta, "summary": summary})
    (out / "table.md").write_text(markdown(summary, meta))
    plot(summary, out)
    print((out / "table.md").read_text())
    print(f"results in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
