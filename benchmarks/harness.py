"""The rounds of ``benchmarks/run.py``: the order methods run in, one round per prompt and repeat, the rows it
records, and resuming a stopped run.

For every prompt and repeat one ROUND runs every method once on that prompt: the plain baselines first, then
the other methods in a seeded shuffled order; the next repeat runs the round in reverse order (A B ... B A: a
linear drift of the machine's speed cancels). Every round is appended to ``rounds.jsonl`` as it ends and the
report is rewritten after every prompt, so a stopped run keeps what it measured (:func:`read_rounds`,
:func:`check_resumable`).
"""

from __future__ import annotations

import gzip
import json
import os
import random
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Callable

from benchmarks.common import REPO, ProvenanceError, git_state, machine_info, versions
from benchmarks.common import _git as git
from benchmarks.methods import BASELINE_LABEL, BASELINES, Method, progress
from benchmarks.report import write_report


def round_order(methods: list[Method], prompt_index: int, repeat: int, seed: int) -> list[Method]:
    """Baselines first, then the others in a seeded shuffled order; odd repeats run the reverse."""
    base = [m for m in methods if m.name in BASELINE_LABEL]
    rest = [m for m in methods if m.name not in BASELINE_LABEL]
    random.Random(seed * 1_000_003 + prompt_index).shuffle(rest)
    order = base + rest
    return order[::-1] if repeat % 2 else order


#: the folders whose code decides a measured speed: a run resumes at another commit only if these are equal
CODE_PATHS = ("treespec", "benchmarks/run.py", "benchmarks/common.py", "benchmarks/methods.py",
              "benchmarks/harness.py", "benchmarks/report.py", "pyproject.toml")


def interleave(prompts: list[dict]) -> list[dict]:
    """Prompts in round-robin order over subtasks (first of each subtask, then second, ...), so that a
    run stopped part-way has measured every subtask about equally."""
    groups: dict[str, list[dict]] = {}
    for p in prompts:
        groups.setdefault(p["subtask"], []).append(p)
    out = []
    for i in range(max((len(g) for g in groups.values()), default=0)):
        out += [g[i] for g in groups.values() if i < len(g)]
    return out


def check_resumable(folder: Path) -> dict:
    """Provenance of the partial run in ``folder``, after checking that this process may add to it:
    same machine (CPU model and flags, cores), same library versions, a clean tree whose code
    (:data:`CODE_PATHS`) equals the recorded commit's. Raises :class:`ProvenanceError` naming the difference."""
    path = folder / "provenance.json"
    if not path.is_file():
        raise ProvenanceError(f"--resume {folder}: no provenance.json there (not a results folder of run.py)")
    prov = json.loads(path.read_text())
    if prov.get("complete"):
        raise ProvenanceError(f"--resume {folder}: that run is complete; start a new one")
    if prov.get("dirty"):
        raise ProvenanceError(f"--resume {folder}: the run was made on a dirty tree; only clean runs resume")
    mine = machine_info()
    for key in ("cpu", "cpu_family", "cpu_model", "cpu_flags", "cores"):
        if mine.get(key) != prov["machine"].get(key):
            raise ProvenanceError(f"--resume {folder}: machine differs ({key}: recorded "
                                  f"{prov['machine'].get(key)!r}, here {mine.get(key)!r}); resume on the same machine")
    if versions() != prov["versions"]:
        raise ProvenanceError(f"--resume {folder}: library versions differ (recorded {prov['versions']}, "
                              f"here {versions()})")
    state = git_state()
    if state["dirty"]:
        raise ProvenanceError(f"--resume {folder}: the working tree has uncommitted changes; commit first")
    if state["commit"] != prov["commit"]:
        changed = git(["diff", "--name-only", prov["commit"], state["commit"], "--", *CODE_PATHS], REPO).split()
        if changed:
            raise ProvenanceError(
                f"--resume {folder}: the code changed since the recorded commit {prov['commit_short']} "
                f"({', '.join(changed[:5])}); resume from a checkout of that commit "
                f"(git worktree add ../bench {prov['commit_short']})")
    return prov


def _round_row(line: bytes) -> dict | None:
    """The round recorded on one line of ``rounds.jsonl``, or None where the line is not a JSON object."""
    try:
        row = json.loads(line)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    return row if isinstance(row, dict) else None


def pack_rounds(folder: Path) -> Path:
    """Compress a finished run's ``rounds.jsonl`` into ``rounds.jsonl.gz`` (written atomically, then the plain file
    removed): a finished run is never resumed, and its record stays whole in about a seventh of the bytes."""
    from treespec.files import atomic_write_gzip

    plain, packed = folder / "rounds.jsonl", folder / "rounds.jsonl.gz"
    if plain.is_file():
        if packed.is_file() and _packed_rows(packed) != read_rounds(plain):  # both: a packer killed before unlinking
            raise ProvenanceError(f"{folder}: rounds.jsonl and rounds.jsonl.gz hold different rounds; keep one")
        atomic_write_gzip(packed, plain.read_bytes())
        plain.unlink()
    return packed


def _packed_rows(packed: Path) -> list[dict]:
    """The rounds of a finished run's ``rounds.jsonl.gz``; a damaged file is a :class:`ProvenanceError`."""
    try:
        lines = gzip.decompress(packed.read_bytes()).splitlines()
    except (OSError, EOFError, zlib.error) as err:
        raise ProvenanceError(f"{packed}: damaged ({err})") from None
    rows = [_round_row(line) for line in lines if line]
    if any(row is None for row in rows):
        raise ProvenanceError(f"{packed}: a line is not JSON")
    return rows


def read_rounds(path: Path) -> list[dict]:
    """The rows of ``rounds.jsonl`` (or, where only that is left, of the finished run's ``rounds.jsonl.gz``:
    :func:`pack_rounds`), repairing a last line cut by a killed writer in place.

    The repair never rewrites a complete round: a cut last line is removed by truncating the file
    where that line begins (``os.truncate`` needs no free space and keeps every byte before), and a
    complete last round whose newline was cut gets its newline appended. A damaged line elsewhere is
    a :class:`ProvenanceError`."""
    packed = path.with_name(path.name + ".gz")
    if not path.is_file() and packed.is_file():
        return _packed_rows(packed)
    if not path.is_file():
        return []
    pieces = path.read_bytes().split(b"\n")
    lines = [piece + b"\n" for piece in pieces[:-1]] + ([pieces[-1]] if pieces[-1] else [])
    rows: list[dict] = []
    kept = 0  # bytes of the complete lines read so far
    for i, line in enumerate(lines):
        row = _round_row(line)
        if row is None:
            if i != len(lines) - 1:
                raise ProvenanceError(f"{path}: line {i + 1} is not JSON (only a cut last line is repaired)")
            os.truncate(path, kept)
            break
        if not line.endswith(b"\n"):  # the writer was cut between the round and its newline
            with path.open("ab") as fh:
                fh.write(b"\n")
        rows.append(row)
        kept += len(line)
    return rows




# ------------------------------------------------------------------------------------------- a run's rounds

@dataclass(frozen=True)
class Plan:
    """What every dtype block measures: temperatures, repeats per prompt, new tokens per run, the seed."""

    temperatures: tuple[float, ...]
    repeats: int
    max_new_tokens: int
    seed: int


@dataclass
class Session:
    """A run being measured: its folder, the rows measured so far (``runs``; ``done``: their round keys), the
    report's ``meta``, the open ``rounds.jsonl`` and the number of rounds the whole run has."""

    out: Path
    runs: list[dict]
    done: set
    meta: dict
    log: IO
    total_rounds: int


def missing(session: Session, dtype: str, plan: Plan, prompts: list[dict]) -> bool:
    """Whether any round of ``dtype`` is still to measure."""
    return any((dtype, t, p["id"], rep) not in session.done for t in plan.temperatures for p in prompts
               for rep in range(plan.repeats))


def prompt_order(temperatures: tuple[float, ...], n_prompts: int, stateful: bool) -> list[tuple[float, int]]:
    """Each prompt at every temperature before the next prompt (a stopped run covers every temperature);
    methods with state across prompts (online stores) need one temperature after the other instead."""
    if stateful:
        return [(t, pi) for t in temperatures for pi in range(n_prompts)]
    return [(t, pi) for pi in range(n_prompts) for t in temperatures]


def run_round(methods: list[Method], prompt: dict, pi: int, n_prompts: int, rep: int, temp: float, plan: Plan,
              label: str) -> dict[str, tuple[Method, dict]]:
    """Every method once on ``prompt`` (repeat ``rep``), in :func:`round_order`; a progress line per method on
    stderr. Each method must generate exactly ``plan.max_new_tokens`` tokens (every row times the same work)."""
    seed = plan.seed + 1000 * pi + rep
    res: dict[str, tuple[Method, dict]] = {}
    for m in round_order(methods, pi, rep, plan.seed):
        progress(f"{label} round {rep + 1}/{plan.repeats}: {m.name} prompt {pi + 1}/{n_prompts}")
        r = m(prompt, plan.max_new_tokens, temp, seed)
        if len(r["tokens"]) != plan.max_new_tokens:
            raise RuntimeError(f"{m.name} generated {len(r['tokens'])} tokens for prompt {prompt['id']} at "
                               f"T={temp:g}, not the {plan.max_new_tokens} asked for")
        res[m.name] = (m, r)
    return res


def round_rows(res: dict[str, tuple[Method, dict]], dtype: str, temp: float, prompt: dict, rep: int,
               stream: tuple[float, int]) -> list[dict]:
    """The recorded rows of one round (with their tokens): timings, the host reference ``stream`` (seconds and
    bytes of one read of the target's weights) and, at T=0, token equality with the own and treespec plain."""
    rows = []
    for name, (m, r) in res.items():
        own = res.get(BASELINES[m.engine], (None, None))[1]
        row = {"dtype": dtype, "temperature": temp, "prompt_id": prompt["id"], "subtask": prompt["subtask"],
               "repeat": rep, "method": name, "engine": m.engine, "new_tokens": len(r["tokens"]),
               **{k: v for k, v in r.items() if k != "tokens"},
               "host_stream_s": stream[0], "host_stream_bytes": stream[1]}
        if temp == 0:
            row["equal_to_own_plain"] = own is not None and r["tokens"] == own["tokens"]
            row["equal_to_ts_plain"] = r["tokens"] == res["ts_plain"][1]["tokens"]
        rows.append({**row, "tokens": r["tokens"]})
    return rows


def record(session: Session, rows: list[dict]) -> None:
    """Append a round's rows to the session and to ``rounds.jsonl`` (flushed: a killed run keeps it)."""
    for row in rows:
        session.runs.append({k: v for k, v in row.items() if k != "tokens"})
        session.log.write(json.dumps(row) + "\n")
    session.log.flush()


def measure_block(session: Session, dtype: str, methods: list[Method], prompts: list[dict], warm: dict,
                  plan: Plan, host_reference: Callable[[], tuple[float, int]]) -> None:
    """Every missing round of ``dtype``: a warm-up run of every method (8 tokens, not measured), then the rounds
    prompt by prompt, the report rewritten after each prompt. ``host_reference()``: one timed read of the
    target's weights (seconds, bytes), recorded beside every round."""
    stateful = any(m.stateful for m in methods)
    if stateful and session.done:
        raise ProvenanceError("--resume: a method keeps state across prompts (an online store); such runs "
                              "cannot resume part-way")
    progress(f"{dtype}: warm-up of {len(methods)} methods")
    for m in methods:
        m(warm, 8, 0.0, 0)
    for temp, pi in prompt_order(plan.temperatures, len(prompts), stateful):
        p = prompts[pi]
        if stateful and pi == 0:
            for m in methods:  # online stores start empty at each temperature
                m.reset()
        todo = [rep for rep in range(plan.repeats) if (dtype, temp, p["id"], rep) not in session.done]
        for rep in todo:
            res = run_round(methods, p, pi, len(prompts), rep, temp, plan, f"{dtype} T={temp:g}")
            record(session, round_rows(res, dtype, temp, p, rep, host_reference()))
        if not todo:
            continue
        write_report(session.out, session.runs, session.meta, plan.seed, session.total_rounds)
        progress(f"{dtype} T={temp:g} {pi + 1}/{len(prompts)} {p['id']}: " + ", ".join(
            f"{k} {len(v[1]['tokens']) / v[1]['wall_s']:.1f}" for k, v in res.items()) + " tok/s")
