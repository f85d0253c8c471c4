"""Memory over time and for long prompts, on the embedded Gemma-3-270M as ``treespec generate`` runs it.

Two studies, each in a fresh subprocess (so that the peak resident memory it reports is its own):

* ``soak``: ``--requests`` generations in one process through one target runner and one drafter (the CLI's
  default drafter for this CPU's dtype at T=0, the fast runner), prompts cycling through train prompts. Resident
  memory (``VmRSS``) is read after every request; the figure is the memory after the last request against the
  memory after request 50 (the bound checked: within 5%).
* ``long``: one prompt of ``--long-tokens`` tokens (train prompts joined and repeated), prefilled and continued
  by ``--long-new`` tokens; its peak resident memory (``VmHWM``) above the memory once the model is loaded.

Writes ``memory.json`` and ``table.md`` under ``benchmarks/results/memory/<date>-<commit>[-tag]/``::

    python benchmarks/memory.py --requests 1000 --long-tokens 30000
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import (add_output_args, finish, host_name, load_train_prompts, machine_info,  # noqa: E402
                               open_results, write_json)

REPO = Path(__file__).resolve().parent.parent


def status_kb(field: str) -> int:
    """A ``/proc/self/status`` memory field (``VmRSS``, ``VmHWM``) in kB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _setup(threads: int):
    import torch

    from treespec.drafters import build_drafter, default_draft
    from treespec.models.fast import make_runner
    from treespec.models.loading import load_model, load_tokenizer, resolve_dtype

    torch.set_grad_enabled(False)
    torch.set_num_threads(threads)
    dtype = resolve_dtype("auto")
    target, tok = load_model("embedded", dtype=dtype), load_tokenizer("embedded")
    draft = default_draft("embedded", dtype, 0.0)
    drafter = None if draft == "none" else build_drafter(draft, target, temperature=0.0)
    return make_runner(target, fast=True), tok, drafter, draft, str(dtype).removeprefix("torch.")


def soak(requests: int, new_tokens: int, threads: int) -> dict:
    from treespec.generate import GenerationConfig, generate
    from treespec.sampling import SamplingConfig

    runner, tok, drafter, draft, dtype = _setup(threads)
    prompts = [tok(p["prompt"])["input_ids"][:64] for p in load_train_prompts(8)]
    config = GenerationConfig(max_new_tokens=new_tokens, sampling=SamplingConfig(0.0), stop_on_eos=False)
    rss, t0 = [], time.perf_counter()
    for i in range(requests):
        generate(runner, prompts[i % len(prompts)], drafter, config)
        rss.append(status_kb("VmRSS"))
    return {"study": "soak", "requests": requests, "new_tokens": new_tokens, "draft": draft, "dtype": dtype,
            "prompts": len(prompts), "rss_kb": rss, "wall_s": time.perf_counter() - t0}


def long_prompt(tokens: int, new_tokens: int, threads: int) -> dict:
    from treespec.generate import GenerationConfig, generate
    from treespec.sampling import SamplingConfig

    runner, tok, drafter, draft, dtype = _setup(threads)
    loaded = status_kb("VmRSS")
    ids: list[int] = []
    for p in load_train_prompts(50):
        ids += tok(p["prompt"])["input_ids"]
    ids = (ids * (tokens // max(len(ids), 1) + 1))[:tokens]
    t0 = time.perf_counter()
    out = generate(runner, ids, drafter, GenerationConfig(max_new_tokens=new_tokens, sampling=SamplingConfig(0.0),
                                                          stop_on_eos=False))
    return {"study": "long", "prompt_tokens": len(ids), "new_tokens": len(out.token_ids), "draft": draft,
            "dtype": dtype, "prefill_chunk": runner.prefill_chunk, "loaded_rss_kb": loaded,
            "peak_rss_kb": status_kb("VmHWM"), "wall_s": time.perf_counter() - t0}


def render(data: dict) -> str:
    prov, machine = data["provenance"], data["machine"]
    flags = ", ".join(f for f, on in machine.get("cpu_flags", {}).items() if on) or "none read"
    lines = [f"# Memory (commit {prov['commit'][:7]}{' DIRTY' if prov.get('diff') else ''})", "",
             f"- Command: `{prov['command']['shell']}`",
             f"- Machine: {host_name(machine)}, {machine.get('cores')} cores; flags: {flags}", ""]
    for r in data["studies"]:
        if r["study"] == "soak":
            rss = r["rss_kb"]
            at50 = rss[min(49, len(rss) - 1)]
            lines += [f"Soak: {r['requests']} requests of {r['new_tokens']} new tokens in one process (embedded target, "
                      f"{r['dtype']}, draft {r['draft']}, one runner and one drafter, {r['prompts']} train prompts in "
                      f"turn; {r['wall_s']:.0f} s)", "",
                      "| resident memory after request | MB |", "|---|---|"]
            for i in sorted({0, min(49, len(rss) - 1), *range(99, len(rss), 100), len(rss) - 1}):
                lines.append(f"| {i + 1} | {rss[i] / 1024:.1f} |")
            lines += ["", f"After the last request against after request 50: {100 * (rss[-1] / at50 - 1):+.2f}%", ""]
        else:
            grow = (r["peak_rss_kb"] - r["loaded_rss_kb"]) / 1024
            lines += [f"Long prompt: {r['prompt_tokens']:,} tokens, then {r['new_tokens']} new (embedded target, "
                      f"{r['dtype']}, draft {r['draft']}, prefill in pieces of {r['prefill_chunk']}; {r['wall_s']:.0f} s)",
                      "", "| resident memory once loaded (MB) | peak (MB) | peak above loaded (MB) |", "|---|---|---|",
                      f"| {r['loaded_rss_kb'] / 1024:.1f} | {r['peak_rss_kb'] / 1024:.1f} | {grow:.1f} |", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=1000, help="soak requests (0: no soak)")
    ap.add_argument("--new-tokens", type=int, default=4, help="new tokens per soak request")
    ap.add_argument("--long-tokens", type=int, default=30000, help="long prompt's tokens (0: no long prompt)")
    ap.add_argument("--long-new", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tag", default=None)
    ap.add_argument("--study", choices=["soak", "long"], default=None, help=argparse.SUPPRESS)  # the subprocess
    add_output_args(ap)
    args = ap.parse_args(argv)
    if min(args.requests, args.new_tokens, args.long_tokens, args.long_new) < 0 or args.threads < 1:
        ap.error("counts must be >= 0 and --threads >= 1")
    if args.study == "soak":
        print(json.dumps(soak(args.requests, args.new_tokens, args.threads)))
        return 0
    if args.study == "long":
        print(json.dumps(long_prompt(args.long_tokens, args.long_new, args.threads)))
        return 0
    out, prov = open_results("memory", args.out, allow_dirty=args.allow_dirty, tag=args.tag)
    started = time.time()
    studies = []
    for study, wanted in (("soak", args.requests), ("long", args.long_tokens)):
        if wanted:
            cmd = [sys.executable, __file__, "--study", study, "--requests", str(args.requests), "--new-tokens",
                   str(args.new_tokens), "--long-tokens", str(args.long_tokens), "--long-new", str(args.long_new),
                   "--threads", str(args.threads)]
            done = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, check=False)
            if done.returncode != 0:
                print(done.stderr[-2000:], file=sys.stderr)
                return done.returncode
            studies.append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(f"{study}: done", flush=True)
    data = {"provenance": prov, "machine": machine_info(), "settings": vars(args), "studies": studies}
    write_json(out / "memory.json", data)
    (out / "table.md").write_text(render(data))
    finish(out, started)
    print(render(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
