"""One prepared check of treespec on an accelerator (or, with ``--device cpu``, on this machine).

    python benchmarks/device_check.py --out DIR [--device auto|cpu|cuda] [--quick] [--weights auto|embedded|random]

Runs from a plain checkout where only PyTorch and transformers are installed and nothing can be downloaded, and
writes everything it measured into ``DIR`` (``results.json``, ``README.md``), step by step, so that a check cut
short still leaves what it had:

1. **tests**: ``tests/treespec/test_devices.py`` on the device (tree pass against per-path forwards, cache commit,
   greedy identity, the sampled law with its broken twin), where pytest is installed;
2. **profile**: the target's tree-pass time t(n) for n = 1..128 tokens after a 128-token context, eager runner and
   fast runner, and t(n) / t(1);
3. **speed**: tokens per second of plain decoding, n-gram lookup, the shipped head's chain, a Sequoia tree and a
   DySpec tree at T = 0 and T = 1 (on the runner the CLI picks: the fast one where it covers the model), plain
   decoding and the head's chain again on the graphed runner (``--runner graphs``), beside Hugging Face
   ``generate`` on the same device, in the same rounds.

Weights: the embedded Gemma-3-270M where it loads here (``--weights embedded``); elsewhere (``random``, or
``auto`` when it does not load) random weights at its real shapes (``benchmarks/data/gemma3-270m-config.json``),
and every figure is labelled **timing only**: a random target's acceptance means nothing, so the speed table
then measures the machinery's cost (t(n), step overheads) and not a speedup a user would see. Prompts are token
ids (random, with repeats for n-gram lookup) in that case, a few fixed sentences otherwise. ``--quick``: a tiny
Gemma-3 and a few sizes, for the tests (it runs end to end on a CPU in seconds).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

CONFIG = REPO / "benchmarks" / "data" / "gemma3-270m-config.json"
SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128)
QUICK_SIZES = (1, 2, 4, 8)
#: the speed table's methods (name -> what it drafts), each at T = 0 and T = 1
METHODS = ("plain", "ngram", "head_chain", "sequoia", "dyspec")
SENTENCES = (
    "The history of the printing press begins in the fifteenth century, when",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "A recipe for bread: mix flour, water, salt and yeast, then",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="folder for results.json and README.md")
    ap.add_argument("--device", default="auto", help="auto (CUDA where present), cpu, cuda or cuda:N")
    ap.add_argument("--quick", action="store_true", help="tiny model, few sizes: the tests' end-to-end run")
    ap.add_argument("--weights", choices=["auto", "embedded", "random"], default="auto")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--no-tests", action="store_true", help="skip step 1 (pytest)")
    return ap.parse_args(argv)


class Results:
    """``results.json`` and ``README.md`` in ``out``, rewritten (atomically) after every step."""

    def __init__(self, out: Path, meta: dict) -> None:
        from treespec.files import atomic_write_json

        self.out, self.data, self._write = out, {"meta": meta, "steps": {}}, atomic_write_json
        out.mkdir(parents=True, exist_ok=True)

    def step(self, name: str, fn, *args) -> object:
        started = time.perf_counter()
        try:
            value, status = fn(*args), "ok"
        except Exception as err:  # a failed step is recorded, and the check goes on
            value, status = {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()}, "failed"
        self.data["steps"][name] = {"status": status, "seconds": round(time.perf_counter() - started, 2),
                                    "result": value}
        self.save()
        return value if status == "ok" else None

    def save(self) -> None:
        self._write(self.out / "results.json", self.data)
        tmp = self.out / "README.md.tmp"
        tmp.write_text(render(self.data))
        os.replace(tmp, self.out / "README.md")


def machine(device: torch.device) -> dict:
    """The benchmarks' own machine record (CPU family, model and flags, versions) with the device, the GPU where
    there is one, and the commit (from git, else ``$TREESPEC_COMMIT``: the GPU machines' copies have no git)."""
    from benchmarks.common import git_state, machine_info

    info = {"device": str(device), **machine_info()}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1), cuda=torch.version.cuda,
                    capability=f"{props.major}.{props.minor}")
    state = git_state(REPO)
    info["commit"] = state["commit"] if state["commit"] != "unknown" else \
        os.environ.get("TREESPEC_COMMIT", "unknown (no git here; set TREESPEC_COMMIT)")
    info["dirty"] = state["dirty"]
    return info


def run_tests(device: torch.device, quick: bool) -> dict:
    """``tests/treespec/test_devices.py`` on ``device`` (its cases of that device kind) in a subprocess."""
    import importlib.util

    if importlib.util.find_spec("pytest") is None:
        return {"skipped": "pytest is not installed here"}
    # the device's parametrised cases and the plumbing tests, not the other device's cases
    other = "cuda" if device.type == "cpu" else "cpu"
    select = f"{device.type} and tree_pass" if quick else f"not {other}"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/treespec/test_devices.py",
           "-k", select]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=240)
    lines = done.stdout.strip().splitlines()
    return {"command": " ".join(cmd[1:]), "returncode": done.returncode, "summary": lines[-1] if lines else "",
            "tail": "\n".join(lines[-15:])}


def load_target(args: argparse.Namespace, device: torch.device):
    """``(model, tokenizer or None, weights label)``."""
    from treespec.models.loading import default_dtype

    dtype = default_dtype(device)
    if args.quick:
        from treespec.models.tiny import tiny_model

        return tiny_model("gemma3", 256, seed=0, logit_scale=4).to(device), None, "tiny random (timing only)"
    if args.weights in ("auto", "embedded"):
        try:
            from treespec.models.loading import load_model, load_tokenizer

            return load_model("embedded", dtype=dtype, device=device), load_tokenizer("embedded"), "embedded"
        except Exception as err:  # noqa: BLE001 - any reason it cannot load here means random weights
            if args.weights == "embedded":
                print(f"device_check: --weights embedded: it does not load here ({type(err).__name__}: {err})",
                      file=sys.stderr)
                raise SystemExit(2) from None
            print(f"device_check: the embedded model does not load here ({type(err).__name__}: {err}); "
                  f"random weights at its shapes, timing only", file=sys.stderr, flush=True)
    from transformers import AutoModelForCausalLM, Gemma3TextConfig

    config = {k: v for k, v in json.loads(CONFIG.read_text()).items() if not k.startswith("_")}
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(Gemma3TextConfig(**config), dtype=dtype)
    return model.eval(), None, "random at Gemma-3-270M's shapes (timing only)"


def prompt_ids(tokenizer, vocab: int, count: int) -> list[list[int]]:
    """Token-id prompts: the fixed sentences where a tokenizer is at hand, else random ids with a repeated span."""
    if tokenizer is not None:
        return [tokenizer(s)["input_ids"] for s in SENTENCES[:count]]
    gen = torch.Generator().manual_seed(0)
    prompts = []
    for _ in range(count):
        span = torch.randint(3, vocab, (12,), generator=gen).tolist()
        prompts.append([2] + span + torch.randint(3, vocab, (20,), generator=gen).tolist() + span[:6])
    return prompts


def profile(model, quick: bool) -> dict:
    """t(n) of the eager and (where it covers the model) the fast runner, and t(n) / t(1)."""
    from treespec.calibration import measure_profile
    from treespec.models.fast import fast_supported

    from treespec.models.fast import FastGemmaRunner, GraphedGemmaRunner
    from treespec.models.runner import ModelRunner

    out = {}
    runners = {"eager": ModelRunner}
    if fast_supported(model) is None:
        runners.update(fast=FastGemmaRunner, graphs=GraphedGemmaRunner)
    for name, kind in runners.items():
        prof = measure_profile(kind(model), sizes=QUICK_SIZES if quick else SIZES, prefix=16 if quick else 128,
                               repeats=1 if quick else 5, stream=True)
        out[name] = {"sizes": prof.sizes, "t_ms": [round(1e3 * t, 3) for t in prof.verify_s],
                     "t_over_t1": [round(t / prof.verify_s[0], 3) for t in prof.verify_s],
                     "weight_read_ms": round(1e3 * prof.stream_s, 3), "weight_bytes": prof.weight_bytes,
                     "runner": prof.meta.get("runner")}
    return out


def drafters(model, prompts: list[list[int]], quick: bool) -> dict:
    """Makers of every method's drafter per temperature: ``{name: fn(temperature) -> drafter or None}``."""
    from treespec.calibration import measure_acceptance_vector
    from treespec.drafters import LOOKUP, build_tree_drafter
    from treespec.drafting.ngram import NgramDrafter
    from treespec.sampling import SamplingConfig
    from treespec.trees.grow import ShapeDrafter
    from treespec.trees.shape import TreeShape

    vocab = model.get_output_embeddings().weight.shape[0]
    if quick:  # the shipped head reads the real Gemma's features: a random head of the tiny model's size
        from treespec.drafting.head import new_head

        head = new_head(model, torch.arange(vocab), num_heads=2)
    else:
        from treespec.drafting.shipped import load_default_head

        head = load_default_head(model)
    head.for_inference(model.dtype)
    acc = {t: measure_acceptance_vector(model, head, prompts, SamplingConfig(t), width=4, depths=1,
                                        generator=torch.Generator(model.device).manual_seed(0)).rows
           for t in (0.0, 1.0)}
    budget, depth = (6, 3) if quick else (16, 6)
    return {
        "plain": lambda t: None,
        "ngram": lambda t: NgramDrafter(LOOKUP),
        "head_chain": lambda t: ShapeDrafter(head, TreeShape.chain(4), "iid"),
        "sequoia": lambda t: build_tree_drafter("sequoia", head, budget, vocab=vocab, acc=acc[t], max_depth=depth),
        "dyspec": lambda t: build_tree_drafter("dyspec", head, budget, vocab=vocab, max_depth=depth),
    }


def timed(fn, device: torch.device) -> tuple[object, float]:
    from treespec.calibration import synchronize

    synchronize(device)
    started = time.perf_counter()
    value = fn()
    synchronize(device)
    return value, time.perf_counter() - started


def speed(model, prompts: list[list[int]], makers: dict, new_tokens: int, device: torch.device) -> dict:
    """Every method and HF ``generate`` at T = 0 and T = 1, interleaved prompt by prompt (the order rotating)."""
    from treespec.generate import GenerationConfig, generate
    from treespec.sampling import SamplingConfig

    from treespec.models.fast import GraphedGemmaRunner, choose_runner, fast_supported

    runner = choose_runner(model, "auto")  # what the CLI runs: the fast runner where it covers the model
    graphed = GraphedGemmaRunner(model) if fast_supported(model) is None else None
    rows = {}
    for t in (0.0, 1.0):
        cfg = GenerationConfig(max_new_tokens=new_tokens, sampling=SamplingConfig(t), stop_on_eos=False, seed=0)

        def hf(ids: list[int]):
            x = torch.tensor([ids], device=device)
            sample = {"do_sample": True, "temperature": t, "top_k": 0, "top_p": 1.0} if t > 0 else {"do_sample": False}
            return model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new_tokens,
                                  min_new_tokens=new_tokens, **sample)

        runs = {name: (lambda ids, make=make: generate(runner, ids, make(t), cfg)) for name, make in makers.items()}
        if graphed is not None:  # the same target, its passes replayed as CUDA graphs (fixed shapes on a CPU)
            for name in ("plain", "head_chain"):
                runs[f"{name}+graphs"] = lambda ids, make=makers[name]: generate(graphed, ids, make(t), cfg)
        for name, run in runs.items():
            for ids in prompts if name.endswith("+graphs") else prompts[:1]:
                run(ids)  # warm-up; for graphs every prompt, so that each budget a timed run meets is captured
        runs["hf_generate"] = hf
        hf(prompts[0][:4])
        seconds = {name: [] for name in runs}
        tau = {name: [] for name in runs if name != "hf_generate"}
        for k, ids in enumerate(prompts):
            names = list(runs)
            for name in names[k % len(names):] + names[: k % len(names)]:
                out, s = timed(lambda: runs[name](ids), device)
                seconds[name].append(s)
                if name in tau:
                    tau[name].append(out.tau)
        total = new_tokens * len(prompts)
        for name, secs in seconds.items():
            rows[f"T={t:g} {name}"] = {
                "temperature": t, "method": name, "tokens_per_s": round(total / sum(secs), 2),
                "per_prompt_s": [round(s, 4) for s in secs],
                "tau": round(statistics.mean(tau[name]), 3) if name in tau else None}
        plain, ref = rows[f"T={t:g} plain"]["tokens_per_s"], rows[f"T={t:g} hf_generate"]["tokens_per_s"]
        for name in seconds:
            row = rows[f"T={t:g} {name}"]
            row["vs_plain"], row["vs_hf_generate"] = round(row["tokens_per_s"] / plain, 3), \
                round(row["tokens_per_s"] / ref, 3)
    return rows


def render(data: dict) -> str:
    """The README of a results folder: what ran where, then each step's table."""
    meta, steps = data["meta"], data["steps"]
    lines = ["# Device check", "", f"Weights: **{meta.get('weights', '?')}**. Command: `{meta.get('command', '')}`",
             "", "| | |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in meta.get("machine", {}).items()]
    for name, step in steps.items():
        lines += ["", f"## {name}: {step['status']} ({step['seconds']} s)", ""]
        result = step["result"] or {}
        if step["status"] != "ok":
            lines.append(f"    {result.get('error', '')}")
        elif name == "profile":
            for runner, prof in result.items():
                lines += [f"**{runner}** ({prof['runner']}); weight read {prof['weight_read_ms']} ms", "",
                          "| n | " + " | ".join(map(str, prof["sizes"])) + " |",
                          "|---|" + "---|" * len(prof["sizes"]),
                          "| t(n) ms | " + " | ".join(map(str, prof["t_ms"])) + " |",
                          "| t(n)/t(1) | " + " | ".join(map(str, prof["t_over_t1"])) + " |", ""]
        elif name == "speed":
            lines += ["| T | method | tok/s | tau | vs plain | vs HF generate |", "|---|---|---|---|---|---|"]
            lines += [f"| {r['temperature']:g} | {r['method']} | {r['tokens_per_s']} | {r['tau'] or ''} | "
                      f"{r['vs_plain']} | {r['vs_hf_generate']} |" for r in result.values()]
        elif name == "tests":
            lines.append(f"    {result.get('summary') or result.get('skipped', '')}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from treespec.models.loading import resolve_device

    try:
        device = resolve_device(args.device)
    except ValueError as err:
        print(f"device_check: {err}", file=sys.stderr)
        return 2
    torch.set_grad_enabled(False)
    results = Results(args.out, {"command": "python benchmarks/device_check.py " + " ".join(argv or sys.argv[1:]),
                                 "machine": machine(device), "started": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                                       time.gmtime())})
    if not args.no_tests:
        results.step("tests", run_tests, device, args.quick)
    model, tokenizer, weights = load_target(args, device)
    results.data["meta"]["weights"] = weights
    vocab = model.get_output_embeddings().weight.shape[0]
    prompts = prompt_ids(tokenizer, vocab, 2 if args.quick else args.prompts)
    results.step("profile", profile, model, args.quick)
    makers: dict = {}

    def build() -> list[str]:  # the step records the methods' names; their makers are no data
        makers.update(drafters(model, prompts, args.quick))
        return sorted(makers)

    if results.step("drafters", build):
        results.step("speed", speed, model, prompts, makers, 8 if args.quick else args.new_tokens, device)
    failed = [name for name, step in results.data["steps"].items() if step["status"] != "ok"]
    tests = results.data["steps"].get("tests", {}).get("result") or {}
    print(f"device_check: {args.out}: " + (f"failed steps {failed}" if failed else "every step ran")
          + (f"; tests: {tests.get('summary', tests.get('skipped', ''))}" if tests else ""), flush=True)
    return 1 if failed or tests.get("returncode", 0) != 0 else 0


if __name__ == "__main__":
    sys.exit(main())
