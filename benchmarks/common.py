"""What every benchmark records: machine, commit, versions; prompts; result directories."""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
#: the shared data folder: ``../shared`` next to the repository, or ``$TREESPEC_SHARED``
SHARED = Path(os.environ.get("TREESPEC_SHARED") or REPO.parent / "shared")
SPEC_BENCH = SHARED / "data" / "eval" / "spec_bench.prompts.jsonl"
HUMANEVAL = SHARED / "data" / "eval" / "humaneval.prompts.jsonl"
TRAIN_PROMPTS = SHARED / "data" / "train" / "train_prompts.jsonl"
SUBTASKS = ("mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag")


def git_commit() -> str:
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                             text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "uncommitted"


def machine_info() -> dict:
    import torch
    import transformers

    cpu = "unknown"
    flags: set[str] = set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and cpu == "unknown":
                cpu = line.split(":", 1)[1].strip()
            if line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "bf16_native": bool({"avx512_bf16", "amx_bf16"} & flags),
        "cuda": torch.cuda.is_available(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "platform": platform.platform(),
    }


def load_prompts(per_subtask: int, humaneval: int = 0) -> list[dict]:
    """The first ``per_subtask`` Spec-Bench prompts of each subtask, then ``humaneval`` HumanEval prompts."""
    rows = [json.loads(line) for line in SPEC_BENCH.read_text().splitlines() if line.strip()]
    chosen = []
    for sub in SUBTASKS:
        chosen += [dict(r, subtask=sub) for r in rows if r["subtask"] == sub][:per_subtask]
    if humaneval:
        he = [json.loads(line) for line in HUMANEVAL.read_text().splitlines() if line.strip()]
        chosen += [dict(r, subtask="humaneval") for r in he[:humaneval]]
    return chosen


def load_train_prompts(per_category: int) -> list[dict]:
    """Tuning prompts from ../shared/data/train (never the eval set): the last ``per_category`` rows
    of each category in file order, labelled by category in ``subtask``."""
    rows = [json.loads(line) for line in TRAIN_PROMPTS.read_text(encoding="utf-8").split("\n") if line.strip()]
    chosen: list[dict] = []
    for cat in sorted({r["category"] for r in rows}):
        chosen += [dict(r, subtask=cat) for r in rows if r["category"] == cat][-per_category:]
    return chosen


def results_dir(kind: str, tag: str | None = None) -> Path:
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d")
    out = REPO / "benchmarks" / "results" / kind / f"{stamp}-{tag or git_commit()}"
    out.mkdir(parents=True, exist_ok=True)
    return out


def write_json(path: Path, data) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)
