"""What every benchmark records, and where it may write.

Provenance (one place, used by every script in ``benchmarks/``):

* :func:`add_output_args` gives a script ``--out DIR`` and ``--allow-dirty``;
* :func:`open_results` checks the working tree (a tree with uncommitted changes is REFUSED unless
  ``--allow-dirty``; then ``git diff HEAD`` and the untracked files are stored as ``diff.patch`` in the
  results folder), refuses to write into a folder that git tracks (results are evidence: a new run
  goes to a new folder), creates the folder and writes ``provenance.json``: commit, clean / dirty,
  machine (CPU model, cores, the bf16 / AMX / AVX-512 flags of /proc/cpuinfo), library versions
  (python, torch, transformers, numpy, ...), the exact command (``sys.argv``), the environment
  variables that change speed (threads), date and wall time.

Nothing in a result is typed by hand: a script records what it measured or read from a file.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import re
import shlex
import subprocess
import sys
from pathlib import Path

from treespec.files import atomic_write_json

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
#: the shared data folder: ``../shared`` next to the repository, or ``$TREESPEC_SHARED``
SHARED = Path(os.environ.get("TREESPEC_SHARED") or REPO.parent / "shared")
SPEC_BENCH = SHARED / "data" / "eval" / "spec_bench.prompts.jsonl"
HUMANEVAL = SHARED / "data" / "eval" / "humaneval.prompts.jsonl"
TRAIN_PROMPTS = SHARED / "data" / "train" / "train_prompts.jsonl"
SUBTASKS = ("mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag")
#: CPU flags that decide what a CPU computes natively (recorded in every result)
CPU_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "avx512_fp16",
             "avx_vnni", "amx_tile", "amx_bf16", "amx_int8")
#: untracked files below these folders do not make a tree dirty (they are the outputs of runs)
OUTPUT_DIRS = ("benchmarks/results/",)
#: new or changed files below these folders do not make a tree dirty either: data written by a long job that
#: may be running beside a benchmark (the corpus chunks of recipes/*.sh), never code
DATA_DIRS = ("corpora/",)
SPEED_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "TORCH_NUM_THREADS", "CUDA_VISIBLE_DEVICES", "TREESPEC_CACHE",
             "TREESPEC_SHARED", "TREESPEC_ALLOW_DIRTY")


class ProvenanceError(SystemExit):
    """Raised (as a clean exit with a message) when a run would not have a provenance we can stand by."""


class MissingSharedData(SystemExit):
    """Raised (as a clean exit with one line) when a prompt file of the shared data folder is not there."""


def require_shared(path: Path) -> Path:
    """``path`` when it is a file; else :class:`MissingSharedData` saying where the shared data is expected."""
    path = Path(path)
    if not path.is_file():
        raise MissingSharedData(
            f"error: {path} not found: the benchmarks read prompts from the shared/ folder beside the repository "
            f"checkout ({SHARED / 'data' / 'eval'} and {SHARED / 'data' / 'train'}, i.e. ../shared/data/eval and "
            "../shared/data/train; TREESPEC_SHARED names another folder)")
    return path


# ---------------------------------------------------------------------------------------------- git

def _git(args: list[str], repo: Path) -> str:
    return subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, check=True).stdout


def git_state(repo: Path = REPO) -> dict:
    """``{"commit", "short", "dirty", "changed", "untracked"}`` of the working tree at ``repo``.

    Dirty = a tracked file differs from HEAD (staged or not), or an untracked, not ignored file exists,
    outside the results folders (:data:`OUTPUT_DIRS`) and the data folders of long jobs (:data:`DATA_DIRS`). Outside a git checkout: commit "unknown", dirty True.
    """
    try:
        sha = _git(["rev-parse", "HEAD"], repo).strip()
        status = _git(["status", "--porcelain", "--untracked-files=all"], repo).splitlines()
    except (OSError, subprocess.CalledProcessError):
        return {"commit": "unknown", "short": "unknown", "dirty": True, "changed": [], "untracked": []}
    changed = [line[3:] for line in status if not line.startswith("??")
               and not any(line[3:].startswith(d) for d in DATA_DIRS)]
    untracked = [line[3:] for line in status if line.startswith("??")
                 and not any(line[3:].startswith(d) for d in OUTPUT_DIRS + DATA_DIRS)]
    return {"commit": sha, "short": sha[:7], "dirty": bool(changed or untracked), "changed": changed,
            "untracked": untracked}


def git_commit(repo: Path = REPO) -> str:
    """Short commit, with ``-dirty`` when the tree has uncommitted changes (for titles of tables)."""
    s = git_state(repo)
    return s["short"] + ("-dirty" if s["dirty"] else "")


def git_diff(repo: Path = REPO, untracked: list[str] | None = None) -> str:
    """``git diff HEAD`` (binary-safe) plus every untracked file as a diff against /dev/null."""
    text = _git(["diff", "HEAD", "--binary"], repo)
    for path in untracked or []:
        proc = subprocess.run(["git", "diff", "--no-index", "--binary", "--", "/dev/null", path], cwd=repo,
                              capture_output=True, text=True)
        text += proc.stdout  # exit status 1 = "differs", which is the point
    return text


def tracked_files_under(path: Path, repo: Path = REPO) -> list[str]:
    """Files git tracks inside ``path`` (empty when ``path`` is outside ``repo`` or not tracked)."""
    try:
        rel = Path(os.path.relpath(path.resolve(), repo.resolve()))
    except ValueError:
        return []
    if rel.parts and rel.parts[0] == "..":
        return []
    try:
        return _git(["ls-files", "--", str(rel)], repo).splitlines()
    except (OSError, subprocess.CalledProcessError):
        return []


# ------------------------------------------------------------------------------------------ machine

def cpu_info(text: str | None = None) -> dict:
    """CPU model and the flags that matter for bf16 / AMX / AVX-512, read from ``text`` (default: the
    contents of /proc/cpuinfo), with the first processor's family, model and clock (``cpu MHz``: the
    clock at the moment of reading, which drifts on hosts that scale their frequency)."""
    cpu, flags, ids = "unknown", set(), {}
    try:
        text = Path("/proc/cpuinfo").read_text() if text is None else text
    except OSError:
        text, cpu = "", platform.processor() or "unknown"
    for line in text.splitlines():
        key, _, value = (part.strip() for part in line.partition(":"))
        if key == "model name" and cpu == "unknown":
            cpu = value
        if key == "flags" and not flags:
            flags = set(value.split())
        # hosts sold under one model name differ (an "AMD EPYC" of family 25 model 17 is not every
        # "AMD EPYC"): family and model tell two records' hosts apart, beside a speed run's host reference
        if key in ("cpu family", "model", "cpu MHz") and key not in ids:
            ids[key] = value
    present = {f: (f in flags) for f in CPU_FLAGS}
    return {"cpu": cpu, "cpu_flags": present, "bf16_native": present["avx512_bf16"] or present["amx_bf16"],
            "cpu_family": ids.get("cpu family"), "cpu_model": ids.get("model"), "cpu_mhz": ids.get("cpu MHz")}


def host_name(machine: dict) -> str:
    """The CPU as a results header names it: model name, then family / model and the clock when read."""
    ids = [f"{label} {machine[key]}" for key, label in (("cpu_family", "family"), ("cpu_model", "model"))
           if machine.get(key)]
    if machine.get("cpu_mhz"):
        ids.append(f"{float(machine['cpu_mhz']):.0f} MHz when read")
    return machine.get("cpu", "unknown") + (f" ({', '.join(ids)})" if ids else "")


def versions() -> dict:
    """Versions of the libraries a number depends on (missing ones as ``None``)."""
    out = {"python": platform.python_version()}
    for name, module in (("torch", "torch"), ("transformers", "transformers"), ("numpy", "numpy"),
                         ("scipy", "scipy"), ("llama_cpp_python", "llama_cpp")):
        try:
            out[name] = __import__(module).__version__
        except Exception:  # noqa: BLE001 - not installed, or broken: recorded as absent
            out[name] = None
    return out


def machine_info() -> dict:
    info = cpu_info()
    info.update(cores=os.cpu_count(), platform=platform.platform())
    try:
        import torch

        info.update(torch_threads=torch.get_num_threads(), cuda=torch.cuda.is_available())
    except ImportError:
        pass
    info.update(versions())  # flat as before: python / torch / transformers at the top level
    return info


def _repo_relative(path: str, repo: Path = REPO) -> str:
    """``path`` relative to the repository (results carry no machine's folders): inside it as ``a/b``, outside it
    (a worktree run with the main checkout's interpreter, say) as ``../main/.venv/bin/python``."""
    return os.path.relpath(os.path.abspath(path), repo.resolve())


def command() -> dict:
    return {"argv": list(sys.argv), "shell": " ".join(shlex.quote(a) for a in sys.argv),
            "python": _repo_relative(sys.executable), "cwd": _repo_relative(os.getcwd()),
            "env": {k: _env_value(os.environ[k]) for k in SPEED_ENV if k in os.environ}}


def _env_value(value: str) -> str:
    """An environment value as recorded: an absolute path (``TREESPEC_CACHE``, say) relative to the repository."""
    return _repo_relative(value) if os.path.isabs(value) else value


def provenance(repo: Path = REPO, state: dict | None = None) -> dict:
    state = state or git_state(repo)
    return {"commit": state["commit"], "commit_short": state["short"], "dirty": state["dirty"],
            "changed_files": state["changed"], "untracked_files": state["untracked"],
            "machine": machine_info(), "versions": versions(), "command": command(),
            "date_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")}


# ---------------------------------------------------------------------------------- results folders

def add_output_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--out", type=Path, default=None,
                    help="results folder (default: benchmarks/results/<kind>/<date>-<commit>[-tag]); a folder "
                         "git tracks is never overwritten")
    ap.add_argument("--allow-dirty", action="store_true",
                    help="run on a tree with uncommitted changes; the diff (git diff HEAD + untracked files) is "
                         "stored as diff.patch in the results folder and the result is marked dirty")


def default_out(kind: str, tag: str | None = None, state: dict | None = None, repo: Path = REPO) -> Path:
    state = state or git_state(repo)
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d")
    name = f"{stamp}-{state['short']}" + ("-dirty" if state["dirty"] else "") + (f"-{tag}" if tag else "")
    folder = repo / "benchmarks" / "results" / kind / name
    i = 2
    while folder.exists() and any(folder.iterdir()):  # an earlier run today at this commit: keep it
        folder = folder.with_name(f"{name}-{i}")
        i += 1
    return folder


def open_results(kind: str, out: Path | None = None, *, allow_dirty: bool = False, tag: str | None = None,
                 repo: Path = REPO, extra: dict | None = None) -> tuple[Path, dict]:
    """Check the tree, choose and create the results folder, write ``provenance.json`` (and
    ``diff.patch`` for a dirty tree). Returns ``(folder, provenance)``; raises
    :class:`ProvenanceError` (a ``SystemExit`` with the reason) when the run must not start."""
    state = git_state(repo)
    if state["dirty"] and not allow_dirty:
        files = (state["changed"] + state["untracked"])[:10]
        raise ProvenanceError(
            f"refusing to benchmark an uncommitted tree ({len(state['changed'])} changed, "
            f"{len(state['untracked'])} untracked files, e.g. {', '.join(files)}): commit first, or pass "
            "--allow-dirty (the diff is then stored in the results folder and the result marked dirty)")
    folder = Path(out) if out is not None else default_out(kind, tag, state, repo)
    tracked = tracked_files_under(folder, repo)
    if tracked:
        raise ProvenanceError(
            f"refusing to write into {folder}: git tracks {len(tracked)} file(s) there (e.g. {tracked[0]}); "
            "committed results are evidence and are never overwritten. Choose a new folder with --out DIR")
    folder.mkdir(parents=True, exist_ok=True)
    keep_earlier_provenance(folder)
    prov = provenance(repo, state)
    if extra:
        prov.update(extra)
    if state["dirty"]:
        (folder / "diff.patch").write_text(git_diff(repo, state["untracked"]))
        prov["diff"] = "diff.patch"
    write_json(folder / "provenance.json", prov)
    return folder, prov


def keep_earlier_provenance(folder: Path) -> Path | None:
    """A results folder that an earlier invocation wrote (a run resumed with ``--out``) keeps that invocation's
    ``provenance.json`` as ``provenance-<its start time>.json`` (returned), so every invocation stays on record."""
    path = folder / "provenance.json"
    if not path.exists():
        return None
    try:
        stamp = json.loads(path.read_text()).get("date_utc", "")
    except (OSError, ValueError):
        stamp = ""
    stamp = re.sub(r"[^0-9A-Za-z]", "", str(stamp)) or "earlier"
    dest, n = folder / f"provenance-{stamp}.json", 1
    while dest.exists():
        n += 1
        dest = folder / f"provenance-{stamp}-{n}.json"
    path.rename(dest)
    return dest


def open_results_from_args(kind: str, args: argparse.Namespace, tag: str | None = None,
                           extra: dict | None = None) -> tuple[Path, dict]:
    return open_results(kind, getattr(args, "out", None), allow_dirty=getattr(args, "allow_dirty", False),
                        tag=tag, extra=extra)


def results_dir(kind: str, tag: str | None = None) -> Path:
    """The results folder of a script without ``--out`` / ``--allow-dirty``: same checks; a dirty tree is
    allowed only with ``TREESPEC_ALLOW_DIRTY=1`` in the environment (recorded in provenance.json)."""
    try:
        folder, _ = open_results(kind, None, allow_dirty=os.environ.get("TREESPEC_ALLOW_DIRTY") == "1", tag=tag,
                                 repo=REPO)
    except ProvenanceError as exc:
        raise ProvenanceError(f"{exc} [this script has no --allow-dirty flag: set TREESPEC_ALLOW_DIRTY=1 "
                              "in the environment instead]") from None
    return folder


def finish(folder: Path, started: float | None = None) -> None:
    """Add the end time (and wall time) to ``provenance.json`` of a finished run."""
    import time

    path = folder / "provenance.json"
    prov = json.loads(path.read_text())
    prov["finished_utc"] = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    if started is not None:
        prov["wall_s"] = time.time() - started
    prov["complete"] = True
    write_json(path, prov)


# ------------------------------------------------------------------------------------------ prompts

def load_prompts(per_subtask: int, humaneval: int = 0, subtasks: tuple[str, ...] = SUBTASKS) -> list[dict]:
    """The first ``per_subtask`` Spec-Bench prompts of each subtask, then ``humaneval`` HumanEval prompts."""
    rows = [json.loads(line) for line in require_shared(SPEC_BENCH).read_text().splitlines() if line.strip()]
    chosen = []
    for sub in subtasks:
        chosen += [dict(r, subtask=sub) for r in rows if r["subtask"] == sub][:per_subtask]
    if humaneval:
        he = [json.loads(line) for line in require_shared(HUMANEVAL).read_text().splitlines() if line.strip()]
        chosen += [dict(r, subtask="humaneval") for r in he[:humaneval]]
    return chosen


def load_train_prompts(per_category: int) -> list[dict]:
    """Tuning prompts from ../shared/data/train (never the eval set), labelled by category in ``subtask``:
    the first ``per_category`` rows of each category among the held-out rows of the seeded order
    (``treespec.distill.corpus.HELD_OUT_FROM`` onwards), which no distillation corpus uses, so a head
    is never tuned on the prompts it was trained on."""
    from treespec.distill.corpus import HELD_OUT_FROM, read_prompts

    rows = read_prompts(require_shared(TRAIN_PROMPTS), seed=0)[HELD_OUT_FROM:]
    chosen: list[dict] = []
    for cat in sorted({r["category"] for r in rows}):
        chosen += [dict(r, subtask=cat) for r in rows if r["category"] == cat][:per_category]
    return chosen


# ---------------------------------------------------------------------------------------- statistics

def median(xs: list[float]) -> float:
    s = sorted(xs)
    n = len(s)
    if n == 0:
        return float("nan")
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


def bootstrap_ci(values: list[float], *, stat=median, n_boot: int = 2000, level: float = 0.95,
                 seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval of ``stat`` over ``values``: ``n_boot`` resamples with replacement, the
    ``(1 - level) / 2`` and ``(1 + level) / 2`` quantiles of their statistic (:func:`scipy.stats.bootstrap`,
    ``method="percentile"``, seeded by ``seed``). One value: the interval is that value; none: NaNs."""
    if not values:
        return (float("nan"), float("nan"))
    if len(values) == 1:
        return (values[0], values[0])
    import numpy as np
    from scipy.stats import bootstrap

    if stat is median:
        statistic, vectorized = (lambda x, axis=-1: np.median(x, axis=axis)), True
    else:
        statistic, vectorized = (lambda x: stat(list(x))), False
    res = bootstrap((np.asarray(values, dtype=float),), statistic, n_resamples=n_boot, confidence_level=level,
                    method="percentile", vectorized=vectorized, rng=np.random.default_rng(seed))
    return (float(res.confidence_interval.low), float(res.confidence_interval.high))


def write_json(path: Path, data) -> None:
    atomic_write_json(path, data, default=str)


def block_top_p(settings: dict, temperature: float) -> float:
    """The nucleus filter of a run's block at ``temperature`` (1.0 = off): per block since the protocol's T=0.7 /
    top-p 0.95 block (``top_p_by_temperature``), one ``--top-p`` for every sampled block in older runs."""
    if temperature <= 0:
        return 1.0
    if "top_p_by_temperature" in settings:
        return dict((t, p) for t, p in settings["top_p_by_temperature"]).get(temperature, 1.0)
    return settings.get("top_p", 1.0)


def block_heading(key: str, settings: dict) -> str:
    """A block's key (``dtype/T=t``, ``t`` written with ``:g``) with its nucleus filter where it has one."""
    written = key.split("/T=")[1]
    temps = [t for t in settings.get("temperatures", ()) if f"{t:g}" == written] or [float(written)]
    top_p = block_top_p(settings, temps[0])
    return key if top_p >= 1.0 else f"{key}, top-p {top_p:g}"
