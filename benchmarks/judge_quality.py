"""Judge decoding (LOSSY): what it gains in speed and what it costs in quality, beside the lossless default.

    python benchmarks/judge_quality.py [--judge shipped] [--thresholds T ...] [--items 20] [--per-subtask 2]
        [--max-new-tokens 96] [--threads 2] [--quick]

On the embedded Gemma-3-270M (bf16 where the CPU computes it natively), temperature 0, drafting as the CLI's
T=0 default does (``--draft lookup+head``). Every item runs the lossless default and the judge at each threshold,
in a seeded order per item, in the same round:

1. **Tasks with an answer**, made here by code (seeded; none comes from ../shared, so nothing was trained or tuned
   on them): few-shot two-digit addition, continuing an arithmetic sequence, repeating a list of words, and the
   letter after a given one. An answer is right when the first line of the output, stripped, is the expected
   text. Accuracy of the lossless default and of each judge setting, and the items where they differ.
2. **Spec-Bench prompts** (``--per-subtask`` of each subtask, benchmark only): tokens per second of each judge
   setting against the lossless default on the same prompt (geometric mean of the per-prompt ratios, sign test),
   tokens per target pass, and the per-token divergence from the target: the share of emitted tokens the target
   would not have chosen after their prefix (``judged_tokens``), and where the output first leaves the lossless
   one.

Writes ``results.json`` and ``table.md`` with provenance under ``benchmarks/results/judge/``. Timings need a quiet
machine. ``--quick`` runs two items of each task and one prompt (a check that the script works, not a result).
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import string
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import (add_output_args, finish, host_name, load_prompts,  # noqa: E402
                               open_results_from_args, write_json)
from benchmarks.report import sign_test  # noqa: E402
from treespec.files import atomic_write_text  # noqa: E402

WORDS = ("apple river stone cloud garden window silver forest candle bridge paper orange winter market "
         "pencil island thunder mirror basket rocket violin meadow castle dragon").split()


def _few_shot(examples: list[tuple[str, str]], query: str) -> str:
    """Examples ``question answer`` a line each, then the query. Prompts end without a space: the tokenizer joins
    a word's leading space to the word (a trailing space made the target write nonsense on a first run)."""
    return "".join(f"{q} {a}\n" for q, a in examples) + query


def make_tasks(items: int, seed: int) -> list[dict]:
    """``items`` of each task kind: ``{"task", "prompt", "answer"}`` (module docstring)."""
    rng = random.Random(seed)
    tasks = []
    for _ in range(items):
        pairs = [(rng.randint(10, 49), rng.randint(10, 49)) for _ in range(5)]
        shots = [(f"{a} + {b} =", str(a + b)) for a, b in pairs[:4]]
        tasks.append({"task": "addition", "prompt": _few_shot(shots, f"{pairs[4][0]} + {pairs[4][1]} ="),
                      "answer": str(sum(pairs[4]))})
        seqs = [(rng.randint(1, 30), rng.randint(2, 9)) for _ in range(3)]
        shots = [(", ".join(str(s + d * i) for i in range(4)) + ",", str(s + d * 4)) for s, d in seqs[:2]]
        s, d = seqs[2]
        query = ", ".join(str(s + d * i) for i in range(4)) + ","
        tasks.append({"task": "sequence", "prompt": _few_shot(shots, query), "answer": str(s + d * 4)})
        lists = [rng.sample(WORDS, 4) for _ in range(3)]
        shots = [(f"Words: {' '.join(w)}\nRepeat:", " ".join(w)) for w in lists[:2]]
        tasks.append({"task": "repeat", "prompt": _few_shot(shots, f"Words: {' '.join(lists[2])}\nRepeat:"),
                      "answer": " ".join(lists[2])})
        letters = rng.sample(string.ascii_uppercase[:-1], 4)
        shots = [(f"The letter after {c} is", chr(ord(c) + 1)) for c in letters[:3]]
        tasks.append({"task": "next letter", "prompt": _few_shot(shots, f"The letter after {letters[3]} is"),
                      "answer": chr(ord(letters[3]) + 1)})
    return tasks


def first_line(text: str) -> str:
    return text.strip("\n").split("\n")[0].strip()


class Setup:
    """The target, the default's drafter and the judge settings: ``None`` (lossless) and one per threshold."""

    def __init__(self, judge_path: str, thresholds: list[float] | None, threads: int) -> None:
        import torch

        from benchmarks.methods import cli_drafter
        from treespec.drafting.judge import JudgeHead
        from treespec.drafting.shipped import DEFAULT_JUDGE
        from treespec.models.fast import choose_runner
        from treespec.models.loading import load_model, load_tokenizer, resolve_dtype

        torch.set_num_threads(threads)
        self.dtype = resolve_dtype("auto", torch.device("cpu"))
        print(f"judge_quality: loading the embedded target ({self.dtype}) ...", file=sys.stderr, flush=True)
        self.tok = load_tokenizer("embedded")
        self.model = load_model("embedded", dtype=self.dtype)
        self.runner = choose_runner(self.model, "auto")
        self.make_drafter = cli_drafter(self.model, self.tok, str(self.dtype).removeprefix("torch."), "lookup+head")
        judge = JudgeHead.load(DEFAULT_JUDGE if judge_path == "shipped" else judge_path)
        self.judges = {"lossless": None}
        for t in thresholds if thresholds else [judge.threshold]:
            self.judges[f"judge@{t:g}"] = judge.with_threshold(t)
        self.judge_record = judge.extra
        #: token ids whose text holds a line break (a task's answer is its first line)
        self.newline = {i for i, t in enumerate(self.tok.convert_ids_to_tokens(list(range(len(self.tok)))))
                        if t is not None and ("\n" in t or t == "<0x0A>")}

    def run(self, name: str, ids: list[int], max_new_tokens: int, stop_at_newline: bool) -> dict:
        from treespec.generate import GenerationConfig, generate
        from treespec.sampling import SamplingConfig

        cfg = GenerationConfig(max_new_tokens=max_new_tokens, sampling=SamplingConfig(0.0), seed=0, stop_on_eos=False,
                               judge=self.judges[name])
        hook = (lambda new: any(t in self.newline for t in new)) if stop_at_newline else None
        res = generate(self.runner, ids, self.make_drafter(0.0), cfg, tokenizer=self.tok, on_tokens=hook)
        s = res.summary()
        return {"tokens": res.token_ids, "text": res.text, "wall_s": s["wall_s"], "target_calls": s["target_calls"],
                "judged": s["judged_tokens"], "new_tokens": s["new_tokens"]}


def run_tasks(setup: Setup, tasks: list[dict], seed: int) -> list[dict]:
    rows = []
    rng = random.Random(seed)
    for i, item in enumerate(tasks):
        ids = setup.tok(item["prompt"])["input_ids"]
        names = list(setup.judges)
        rng.shuffle(names)
        out = {}
        for name in names:
            got = setup.run(name, ids, 12, stop_at_newline=True)
            out[name] = {"output": first_line(got["text"]), "right": first_line(got["text"]) == item["answer"],
                         "judged": got["judged"]}
        rows.append({"task": item["task"], "answer": item["answer"], "runs": out})
        if (i + 1) % 10 == 0:
            print(f"judge_quality: tasks {i + 1}/{len(tasks)}", file=sys.stderr, flush=True)
    return rows


def run_prompts(setup: Setup, prompts: list[dict], max_new_tokens: int, seed: int) -> list[dict]:
    rows = []
    rng = random.Random(seed + 1)
    for i, prompt in enumerate(prompts):
        ids = setup.tok(prompt["prompt"])["input_ids"]
        names = list(setup.judges)
        rng.shuffle(names)
        runs = {name: setup.run(name, ids, max_new_tokens, stop_at_newline=False) for name in names}
        base = runs["lossless"]["tokens"]
        row = {"id": prompt.get("id"), "subtask": prompt.get("subtask"), "runs": {}}
        for name, got in runs.items():
            leave = next((k for k, (a, b) in enumerate(zip(got["tokens"], base)) if a != b), None)
            row["runs"][name] = {"tok_s": got["new_tokens"] / got["wall_s"], "tau": got["new_tokens"] /
                                 max(got["target_calls"], 1), "judged_share": got["judged"] / max(got["new_tokens"], 1),
                                 "first_divergence": leave, "new_tokens": got["new_tokens"]}
        rows.append(row)
        print(f"judge_quality: prompts {i + 1}/{len(prompts)}", file=sys.stderr, flush=True)
    return rows


def summarise(task_rows: list[dict], prompt_rows: list[dict], names: list[str]) -> dict:
    out = {}
    for name in names:
        acc = {}
        for kind in sorted({r["task"] for r in task_rows}):
            mine = [r for r in task_rows if r["task"] == kind]
            acc[kind] = f"{sum(r['runs'][name]['right'] for r in mine)}/{len(mine)}"
        right = [r["runs"][name]["right"] for r in task_rows]
        changed = sum(r["runs"][name]["output"] != r["runs"]["lossless"]["output"] for r in task_rows)
        lost = sum(r["runs"]["lossless"]["right"] and not r["runs"][name]["right"] for r in task_rows)
        gained = sum(not r["runs"]["lossless"]["right"] and r["runs"][name]["right"] for r in task_rows)
        ratios = [r["runs"][name]["tok_s"] / r["runs"]["lossless"]["tok_s"] for r in prompt_rows]
        diverged = [r["runs"][name]["first_divergence"] for r in prompt_rows]
        out[name] = {
            "accuracy": sum(right) / max(len(right), 1), "accuracy_by_task": acc, "items": len(right),
            "right": sum(right), "right_lost": lost, "right_gained": gained, "answers_changed": changed,
            "speed_ratio_geomean": math.exp(statistics.fmean(math.log(x) for x in ratios)) if ratios else None,
            **sign_test(ratios),
            "tau": statistics.fmean(r["runs"][name]["tau"] for r in prompt_rows) if prompt_rows else None,
            "tok_s_mean": statistics.fmean(r["runs"][name]["tok_s"] for r in prompt_rows) if prompt_rows else None,
            "judged_share": statistics.fmean(r["runs"][name]["judged_share"] for r in prompt_rows)
            if prompt_rows else None,
            "prompts_diverged": sum(d is not None for d in diverged), "prompts": len(prompt_rows),
            "first_divergence_median": statistics.median([d for d in diverged if d is not None])
            if any(d is not None for d in diverged) else None}
    return out


def table(summary: dict, meta: dict) -> str:
    lines = [f"# Judge decoding (LOSSY) against the lossless default, {meta['host']}", "",
             f"Embedded Gemma-3-270M, {meta['dtype']}, temperature 0, `--draft lookup+head`; {meta['items']} task "
             f"items, {meta['prompts']} Spec-Bench prompts x {meta['max_new_tokens']} tokens; commit "
             f"{meta['commit']}. Tasks: right answers (accuracy), right answers the judge took away / added, and "
             "answers that differ from the lossless run's. Spec-Bench prompts: speed, the geometric mean over prompts "
             "of tok/s against the lossless run of the same prompt (sign test p); tau; the judged share, emitted "
             "tokens the target would not have chosen; prompts whose output left the lossless one, and where.", "",
             "| setting | right (accuracy) | right lost / gained | answers changed | speed vs lossless "
             "| faster / slower (p) | tau | judged share | prompts diverged | first divergence (median token) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, s in summary.items():
        speed = "1 (itself)" if name == "lossless" else f"{s['speed_ratio_geomean']:.3f}x"
        test = "" if name == "lossless" else f"{s['wins']} / {s['losses']} ({s['p_sign']:.2g})"
        first = "" if s["first_divergence_median"] is None else f"{s['first_divergence_median']:g}"
        lines.append(f"| {name} | {s['right']}/{s['items']} ({s['accuracy']:.3f}) | {s['right_lost']} / "
                     f"{s['right_gained']} | {s['answers_changed']}/{s['items']} | {speed} | {test} | {s['tau']:.2f} "
                     f"| {s['judged_share']:.3f} | {s['prompts_diverged']} / {s['prompts']} | {first} |")
    by_task = (f"{name}: " + ", ".join(f"{k} {v}" for k, v in s["accuracy_by_task"].items())
               for name, s in summary.items())
    lines += ["", "Right answers by task: " + "; ".join(by_task)]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--judge", default="shipped", help="'shipped' or a judge file")
    ap.add_argument("--thresholds", type=float, nargs="*", default=None,
                    help="judge thresholds to run (default: the file's own)")
    ap.add_argument("--items", type=int, default=20, help="items of each task kind")
    ap.add_argument("--per-subtask", type=int, default=2, help="Spec-Bench prompts of each subtask")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="two items of each task, one prompt (a smoke check)")
    add_output_args(ap)
    args = ap.parse_args(argv)
    for name in ("items", "max_new_tokens", "threads", "per_subtask"):
        if getattr(args, name) < 1:
            print(f"judge_quality: --{name.replace('_', '-')} must be >= 1", file=sys.stderr)
            return 2
    if any(not t == t for t in args.thresholds or ()):
        print("judge_quality: --thresholds must be numbers (no nan)", file=sys.stderr)
        return 2
    if args.judge != "shipped" and not Path(args.judge).is_file():
        print(f"judge_quality: --judge {args.judge}: no judge file there (or 'shipped')", file=sys.stderr)
        return 2
    if args.quick:
        args.items, args.max_new_tokens = 2, 16
    started = time.time()
    folder, prov = open_results_from_args("judge", args, tag="quick" if args.quick else None)
    setup = Setup(args.judge, args.thresholds, args.threads)
    prompts = load_prompts(args.per_subtask)[:1] if args.quick else load_prompts(args.per_subtask)
    task_rows = run_tasks(setup, make_tasks(args.items, args.seed), args.seed)
    prompt_rows = run_prompts(setup, prompts, args.max_new_tokens, args.seed)
    summary = summarise(task_rows, prompt_rows, list(setup.judges))
    meta = {"host": host_name(prov["machine"]), "dtype": str(setup.dtype).removeprefix("torch."),
            "items": len(task_rows), "prompts": len(prompt_rows), "max_new_tokens": args.max_new_tokens,
            "commit": prov["commit_short"]}
    write_json(folder / "results.json", {"meta": meta, "summary": summary, "judge_record": setup.judge_record,
                                         "tasks": task_rows, "prompts": prompt_rows,
                                         "settings": {k: v for k, v in vars(args).items() if k != "out"}})
    atomic_write_text(folder / "table.md", table(summary, meta))
    finish(folder, started)
    print(table(summary, meta))
    print(f"judge_quality: wrote {folder}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
