"""The benchmark harness: provenance (clean / dirty refusal, diff, tracked folders), spreads, rounds.

Provenance is tested on a temporary git repository (the real working tree may be dirty while it is
edited); nothing here loads a model or downloads anything.
"""

from __future__ import annotations

import errno
import json
import subprocess
from pathlib import Path

import pytest

from benchmarks import common
from benchmarks.common import ProvenanceError, bootstrap_ci, median, open_results


def _git(repo: Path, *args: str) -> None:
    subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True)


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    r = tmp_path / "repo"
    r.mkdir()
    _git(r, "init", "-q")
    _git(r, "config", "user.email", "t@example.com")
    _git(r, "config", "user.name", "t")
    (r / "code.py").write_text("x = 1\n")
    (r / "benchmarks" / "results" / "speed" / "old").mkdir(parents=True)
    (r / "benchmarks" / "results" / "speed" / "old" / "table.md").write_text("| a | 2.08x |\n")
    _git(r, "add", "-A")
    _git(r, "commit", "-q", "-m", "init")
    return r


def test_clean_tree_records_commit_machine_versions_command(repo):
    out, prov = open_results("speed", repo / "out", repo=repo)
    saved = json.loads((out / "provenance.json").read_text())
    assert saved["dirty"] is False and not (out / "diff.patch").exists()
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True).stdout.strip()
    assert saved["commit"] == head
    m = saved["machine"]
    assert m["cpu"] and "avx512_bf16" in m["cpu_flags"] and "amx_bf16" in m["cpu_flags"]
    assert isinstance(m["bf16_native"], bool)
    assert {"cpu_family", "cpu_model", "cpu_mhz"} <= set(m)
    assert {"python", "torch", "transformers", "numpy"} <= set(saved["versions"])
    assert saved["command"]["argv"] and saved["date_utc"]


def test_a_resumed_folder_keeps_every_invocations_provenance(repo):
    """Opening a folder an earlier invocation wrote (``--out`` to resume) keeps the earlier provenance.json beside
    the new one; a third invocation keeps both earlier ones."""
    folder = repo / "benchmarks" / "results" / "ablation" / "resumed"  # untracked results do not make the tree dirty
    out, first = open_results("ablation", folder, repo=repo, extra={"which": 1})
    open_results("ablation", folder, repo=repo, extra={"which": 2})
    open_results("ablation", folder, repo=repo, extra={"which": 3})
    saved = sorted(json.loads(p.read_text())["which"] for p in out.glob("provenance*.json"))
    assert saved == [1, 2, 3]
    assert json.loads((out / "provenance.json").read_text())["which"] == 3


def test_dirty_tree_is_refused_unless_allowed_then_the_diff_is_stored(repo):
    (repo / "code.py").write_text("x = 2\n")
    with pytest.raises(ProvenanceError, match="--allow-dirty"):
        open_results("speed", repo / "out", repo=repo)
    assert not (repo / "out").exists()
    out, prov = open_results("speed", repo / "out", repo=repo, allow_dirty=True)
    assert prov["dirty"] is True and prov["changed_files"] == ["code.py"]
    patch = (out / "diff.patch").read_text()
    assert "-x = 1" in patch and "+x = 2" in patch


def test_untracked_source_is_dirty_but_results_outputs_are_not(repo):
    (repo / "benchmarks" / "results" / "speed" / "new-run").mkdir()
    (repo / "benchmarks" / "results" / "speed" / "new-run" / "table.md").write_text("new\n")
    assert common.git_state(repo)["dirty"] is False
    (repo / "helper.py").write_text("y = 3\n")
    state = common.git_state(repo)
    assert state["dirty"] is True and state["untracked"] == ["helper.py"]
    out, _ = open_results("speed", repo / "out2", repo=repo, allow_dirty=True)
    assert "+y = 3" in (out / "diff.patch").read_text()


def test_a_tracked_results_folder_is_never_overwritten(repo):
    tracked = repo / "benchmarks" / "results" / "speed" / "old"
    with pytest.raises(ProvenanceError, match="--out"):
        open_results("speed", tracked, repo=repo)
    with pytest.raises(ProvenanceError, match="git tracks"):
        open_results("speed", repo / "benchmarks" / "results" / "speed", repo=repo, allow_dirty=True)
    assert (tracked / "table.md").read_text() == "| a | 2.08x |\n"


def test_default_folder_is_dated_named_by_commit_and_never_reused(repo):
    out1, prov = open_results("speed", None, repo=repo, tag="t0")
    assert out1.parent == repo / "benchmarks" / "results" / "speed"
    assert out1.name.endswith(f"-{prov['commit_short']}-t0")
    out2, _ = open_results("speed", None, repo=repo, tag="t0")
    assert out2 != out1 and out2.name == out1.name + "-2"


def test_the_real_repository_refuses_its_committed_results():
    with pytest.raises(ProvenanceError, match="git tracks"):
        open_results("speed", common.RESULTS / "speed" / "2026-11-22-t0", allow_dirty=True)


def test_bootstrap_interval_is_seeded_and_brackets_the_median():
    xs = [0.9, 1.1, 1.2, 1.25, 1.3, 1.4, 2.0, 2.1, 0.8, 1.5]
    a, b = bootstrap_ci(xs, seed=0), bootstrap_ci(xs, seed=0)
    assert a == b
    assert a[0] <= median(xs) <= a[1] and a[0] >= min(xs) and a[1] <= max(xs)
    assert bootstrap_ci([1.3], seed=0) == (1.3, 1.3)
    tight = bootstrap_ci([1.0 + 0.001 * i for i in range(40)], seed=0)
    assert tight[1] - tight[0] < a[1] - a[0]


# ------------------------------------------------------------------------------------------ run.py

def _runs():
    """Two prompts, two repeats: ts_plain 1 s, ts_ngram 0.5 s, hf_plain 0.8 s, hf_prompt_lookup 1 s."""
    times = {"ts_plain": 1.0, "ts_ngram": 0.5, "hf_plain": 0.8, "hf_prompt_lookup": 1.0}
    engine = {"ts_plain": "treespec", "ts_ngram": "treespec", "hf_plain": "hf", "hf_prompt_lookup": "hf"}
    rows = []
    for pid, sub, scale in (("p1", "qa", 1.0), ("p2", "rag", 2.0)):
        for rep in range(2):
            for m, t in times.items():
                rows.append({"dtype": "float32", "temperature": 0.0, "prompt_id": pid, "subtask": sub, "repeat": rep,
                             "method": m, "engine": engine[m], "new_tokens": 32, "wall_s": t * scale,
                             "target_calls": 32 if "plain" in m else 16, "equal_to_own_plain": True,
                             "equal_to_ts_plain": True})
    return rows


def test_speedups_name_their_baselines():
    from benchmarks import report

    prompt_rows = report.per_prompt_speedups(_runs())
    ng = [r for r in prompt_rows if r["method"] == "ts_ngram"]
    assert all(r["speedup_vs_ts_plain"] == pytest.approx(2.0) for r in ng)
    assert all(r["speedup_vs_hf_plain"] == pytest.approx(1.6) for r in ng)
    assert all(r["speedup_vs_own_plain"] == pytest.approx(2.0) for r in ng)
    pl = [r for r in prompt_rows if r["method"] == "hf_prompt_lookup"]
    assert all(r["speedup_vs_own_plain"] == pytest.approx(0.8) for r in pl)  # own = HF generate
    summary = report.summarise(prompt_rows, seed=0)
    e = summary["float32/T=0"]["ts_ngram"]
    assert e["speedup_vs_ts_plain"]["median"] == pytest.approx(2.0)
    assert e["speedup_vs_ts_plain"]["ci95"] == [pytest.approx(2.0), pytest.approx(2.0)]
    assert e["tau"] == pytest.approx(2.0) and e["greedy_equal_rate_own_plain"] == 1.0
    assert set(e["per_subtask"]) == {"qa", "rag"}
    prov = {"commit_short": "abc1234", "dirty": False, "date_utc": "now",
            "command": {"shell": "python benchmarks/run.py"},
            "machine": {"cpu": "cpu", "cores": 2, "cpu_flags": {"avx512_bf16": True}, "bf16_native": True},
            "versions": {"torch": "x"}}
    settings = {"prompts": 2, "prompt_set": "eval", "max_new_tokens": 32, "repeats": 2, "threads": 1, "seed": 0,
                "warmup_tokens": 8}
    table = report.markdown(summary, {"provenance": prov, "settings": settings, "skipped": ["llama.cpp: not here"],
                                   "methods": {"ts_ngram": "x"}})
    for header in ("speedup vs treespec plain", "speedup vs HF generate", "speedup vs llama.cpp plain",
                   "Warm-up", "95%", "Skipped: llama.cpp"):
        assert header in table
    assert "| ts_ngram | treespec | 48.00 | 2.00x [2.00, 2.00] | 1.60x [1.60, 1.60] | - |" in table


def test_rounds_put_baselines_first_then_reverse():
    from benchmarks import harness, methods

    ms = [methods.Method(n, e, None, "") for n, e in (("ts_plain", "treespec"), ("ts_ngram", "treespec"),
                                                   ("hf_plain", "hf"), ("ts_head", "treespec"))]
    first = [m.name for m in harness.round_order(ms, 0, 0, seed=0)]
    second = [m.name for m in harness.round_order(ms, 0, 1, seed=0)]
    assert first[:2] == ["ts_plain", "hf_plain"] and sorted(first) == sorted(m.name for m in ms)
    assert second == first[::-1]
    assert first == [m.name for m in harness.round_order(ms, 0, 0, seed=0)]  # seeded


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    from benchmarks import report

    report.plot(report.summarise(report.per_prompt_speedups(_runs()), seed=0), tmp_path)
    assert (tmp_path / "speedup.png").stat().st_size > 1000


def test_llama_missing_is_a_reason_not_a_crash():
    from benchmarks import methods

    reason = methods.llama_available()
    assert reason is None or isinstance(reason, str)


@pytest.mark.parametrize("script", ["run", "bench_trees", "bench_ot_bounds", "draft_card", "early_exit_layers",
                                    "study_real_model", "study_chains", "fault_conversion", "head_domains"])
def test_every_script_uses_the_common_provenance(script):
    src = (common.REPO / "benchmarks" / f"{script}.py").read_text()
    assert "add_output_args(ap)" in src and "open_results(" in src
    assert "--train-minutes" not in src and "no native bf16 on this CPU" not in src


def test_bench_ot_bounds_end_to_end(tmp_path):
    """A tiny run writes its results and provenance into --out (dirty allowed: the tree is being edited)."""
    from benchmarks import bench_ot_bounds

    out = tmp_path / "ot"
    bench_ot_bounds.main(["--vocab", "300", "--repeats", "1", "--budget", "0.05", "--allow-dirty", "--out", str(out)])
    prov = json.loads((out / "provenance.json").read_text())
    res = json.loads((out / "bench_ot_bounds.json").read_text())
    assert prov["complete"] and res["commit"].startswith(prov["commit"]) and res["rows"]
    assert (out / "diff.patch").exists() == prov["dirty"]


def test_draft_card_states_only_what_its_files_record():
    """The card's training time comes from the run's summary.json or is left out; no machine is typed in."""
    from benchmarks.draft_card import head_metadata, render

    rec = json.loads((common.RESULTS / "draft" / "2026-11-22-010e29c-dirty" / "metrics.json").read_text())
    head = common.REPO / "treespec" / "assets" / "gemma3-270m-head.safetensors"
    meta = head_metadata(head)
    without = render(head, meta, rec["metrics"], rec["corpora"], None, "abc1234")
    assert "Training time: not recorded" in without and "Xeon" not in without and "EPYC" not in without
    with_run = render(head, meta, rec["metrics"], rec["corpora"],
                      {"seconds_this_run": 1500.0, "positions_this_run": 10, "precision": "bf16", "step": 7}, "abc1234")
    assert "25 minutes" in with_run and "precision bf16" in with_run


def test_draft_card_describes_stored_continuations_depths_and_history(tmp_path):
    """A corpus built from committed continuations is named by them (matched by fingerprint), an unknown
    fingerprint is said to be unknown, the per-depth table and the history rows come from their files."""
    from benchmarks.draft_card import corpus_content, corpus_stats, head_metadata, render

    stored = common.REPO / "corpora" / "head-v2" / "continuations" / "v2-greedy" / "manifest.json"
    fingerprint = json.loads(stored.read_text())["fingerprint"]
    for name, fp in (("known", fingerprint), ("unknown", "f" * 64)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "manifest.json").write_text(json.dumps(
            {"positions": 10, "sequences_done": 2, "num_input_sequences": 2, "seconds": 60.0, "continuations": fp,
             "options": {"continuation": "none", "new_tokens": 64}}))
    known, unknown = corpus_stats([str(tmp_path / "known"), str(tmp_path / "unknown")])
    assert "greedy continuation" in corpus_content(known) and "v2-greedy" in corpus_content(known)
    assert "not in this checkout" in corpus_content(unknown)

    rec = json.loads((common.RESULTS / "draft" / "2026-11-22-010e29c-dirty" / "metrics.json").read_text())
    head = common.REPO / "treespec" / "assets" / "gemma3-270m-head.safetensors"
    metrics = dict(rec["metrics"], top1_agreement_T0_by_depth=[0.51, 0.42], sum_min_pq_T1_by_depth=[0.33, 0.29])
    card = render(head, head_metadata(head), metrics, [known], None, "abc1234", [("v1-record", rec)])
    assert "| T=0 top-1 agreement | 0.510 | 0.420 |" in card and "| T=1 sum min(p, q) | 0.330 | 0.290 |" in card
    assert "| v1-record | 010e29c-dirty | 12 x 48 | 0.352 | 0.389 | 0.066 | float32 |" in card
    assert "Earlier heads" in card and "Earlier heads" not in render(head, head_metadata(head), metrics, [known], None, "abc1234")


def test_draft_card_states_the_training_a_continued_head_started_from():
    """With --continues, the card names the earlier record and that head's own training (read from the
    record's stored head metadata and run summary); without it, no such line."""
    from benchmarks.draft_card import head_metadata, render

    rec = json.loads((common.RESULTS / "draft" / "2026-11-22-010e29c-dirty" / "metrics.json").read_text())
    earlier = json.loads((common.RESULTS / "draft" / "2026-11-25-c3e123f" / "metrics.json").read_text())
    earlier["commit"] = "c3e123f"
    head = common.REPO / "treespec" / "assets" / "gemma3-270m-head.safetensors"
    meta = head_metadata(head)
    card = render(head, meta, rec["metrics"], rec["corpora"], None, "abc1234", (), ("2026-11-25-c3e123f", earlier))
    steps = earlier["head_metadata"]["extra"]["summary"]["step"]
    minutes = round(earlier["run_summary"]["seconds_this_run"] / 60)
    assert (f"started from the head of record `2026-11-25-c3e123f` (commit c3e123f), trained before for {steps} "
            f"steps") in card and f"last segment {minutes} minutes" in card
    assert "Continued training" not in render(head, meta, rec["metrics"], rec["corpora"], None, "abc1234")
    # the data: the same corpora and shards as the earlier run, or what changed
    same = render(head, meta, earlier["metrics"], earlier["corpora"], None, "abc1234", (), ("e", earlier))
    assert "this run's, on the same corpora." in same
    more = [dict(c, shards_used="47 of 47") if c["name"] == "head-v2-greedy-f2-9" else c for c in earlier["corpora"]]
    grown = render(head, meta, earlier["metrics"], more, None, "abc1234", (), ("e", earlier))
    assert "on the same corpora" not in grown
    assert "(head-v2-greedy-f2-9: 21 of 21 -> 47 of 47 shards)" in grown


def test_draft_card_main_counts_pinned_shards_and_keeps_history(tmp_path, monkeypatch):
    """End to end: the card counts only the shards training read (max_shards, in the head's training order),
    states the training-time test and precision from the head's config, lists the history record, and the
    results record names its sources; a --corpus other than the head's training corpora is refused before any
    results folder exists."""
    from benchmarks import draft_card

    def corpus(name: str, shard_positions: list[int]) -> Path:
        (tmp_path / name).mkdir()
        (tmp_path / name / "manifest.json").write_text(json.dumps(
            {"positions": sum(shard_positions), "sequences_done": 2 * len(shard_positions),
             "num_input_sequences": 2 * len(shard_positions), "seconds": 60.0,
             "options": {"continuation": "none", "new_tokens": 64},
             "shards": [{"positions": n, "sequences": 2} for n in shard_positions]}))
        return tmp_path / name

    first, second = corpus("first", [100, 200, 400]), corpus("second", [10, 20])
    v1 = common.RESULTS / "draft" / "2026-11-22-010e29c-dirty" / "metrics.json"
    head = common.REPO / "treespec" / "assets" / "gemma3-270m-head.safetensors"
    meta = draft_card.head_metadata(head)
    tc = dict(meta["extra"]["summary"]["train_config"], max_shards=[2, 1], depths=3, depth_decay=0.8, amp="auto",
              logits_amp=True)
    meta = {"config": meta["config"],
            "extra": {"summary": dict(meta["extra"]["summary"], train_config=tc, corpus=[str(first), str(second)])}}
    monkeypatch.setattr(draft_card, "head_metadata", lambda path: meta)
    metrics = tmp_path / "metrics.json"
    metrics.write_text(json.dumps(json.loads(v1.read_text())["metrics"]))
    base = ["--head", str(head), "--metrics", str(metrics), "--card", str(tmp_path / "card.md"), "--allow-dirty"]
    with pytest.raises(SystemExit, match="not what the head records"):
        draft_card.main(base + ["--corpus", f"{second},{first}", "--out", str(tmp_path / "refused")])
    assert not (tmp_path / "refused").exists() and not (tmp_path / "card.md").exists()

    assert draft_card.main(base + ["--corpus", f"{first},{second}", "--history", str(v1),
                                   "--out", str(tmp_path / "rec")]) == 0
    card = (tmp_path / "card.md").read_text()
    assert "| first | 4 of 6 | 300 | 2 of 3 |" in card and "| second | 2 of 4 | 10 | 1 of 2 |" in card
    assert "Total: 310 token positions." in card
    assert "unrolled on its own features for 3 steps" in card and "subset logits under the same autocast" in card
    assert "| 2026-11-22-010e29c-dirty | 010e29c-dirty | 12 x 48 | 0.352 | 0.389 | 0.066 | float32 |" in card
    record = json.loads((tmp_path / "rec" / "metrics.json").read_text())
    assert record["sources"]["history"] == [str(v1)] and (tmp_path / "rec" / "card.md").read_text() == card


def test_results_dir_of_older_scripts_needs_the_environment_switch(monkeypatch, repo):
    """Scripts without --allow-dirty (results_dir) refuse a dirty tree unless TREESPEC_ALLOW_DIRTY=1."""
    monkeypatch.setattr(common, "REPO", repo)
    (repo / "code.py").write_text("x = 5\n")
    monkeypatch.delenv("TREESPEC_ALLOW_DIRTY", raising=False)
    with pytest.raises(ProvenanceError, match="TREESPEC_ALLOW_DIRTY=1"):
        common.results_dir("profile")
    monkeypatch.setenv("TREESPEC_ALLOW_DIRTY", "1")
    folder = common.results_dir("profile")
    assert folder.parent == repo / "benchmarks" / "results" / "profile" and (folder / "diff.patch").exists()


# ------------------------------------------------------------------------------------ resuming run.py

def test_prompts_run_round_robin_over_subtasks():
    from benchmarks import harness

    ps = [{"id": f"{s}{i}", "subtask": s} for s in ("a", "b", "c") for i in range(3 if s != "b" else 1)]
    assert [p["id"] for p in harness.interleave(ps)] == ["a0", "b0", "c0", "a1", "c1", "a2", "c2"]


def test_a_cut_last_round_line_is_dropped(tmp_path):
    from benchmarks import harness

    path = tmp_path / "rounds.jsonl"
    path.write_text('{"a": 1}\n{"a": 2}\n{"a": ')
    assert harness.read_rounds(path) == [{"a": 1}, {"a": 2}]
    assert path.read_text() == '{"a": 1}\n{"a": 2}\n'
    path.write_text('{"a": 1}\nnot json\n{"a": 2}\n')
    with pytest.raises(harness.ProvenanceError, match="line 2"):
        harness.read_rounds(path)


def test_a_finished_runs_rounds_are_packed_and_read_back(tmp_path):
    """pack_rounds compresses rounds.jsonl (the plain file goes) and read_rounds reads the same rows back from the
    .gz; a packed file with a damaged line is refused, and a folder without rounds has none."""
    import gzip

    from benchmarks import harness

    path = tmp_path / "rounds.jsonl"
    rows = [{"method": "ts_plain", "seconds": 1.25, "i": i} for i in range(200)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    size = path.stat().st_size
    packed = harness.pack_rounds(tmp_path)
    assert not path.exists() and packed.name == "rounds.jsonl.gz" and packed.stat().st_size < size / 5
    assert harness.read_rounds(path) == rows
    assert harness.pack_rounds(tmp_path) == packed and harness.read_rounds(path) == rows  # again: nothing to do
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))  # both, the same rounds: a packer killed before
    assert harness.pack_rounds(tmp_path) == packed and not path.exists()  # unlinking; packed again
    path.write_text(json.dumps(rows[0]) + "\n")  # both files, other rounds: neither is overwritten
    with pytest.raises(harness.ProvenanceError, match="hold different rounds"):
        harness.pack_rounds(tmp_path)
    path.unlink()
    packed.write_bytes(gzip.compress(b'{"a": 1}\nnot json\n'))
    with pytest.raises(harness.ProvenanceError, match="not JSON"):
        harness.read_rounds(path)
    packed.write_bytes(b"not gzip at all")
    with pytest.raises(harness.ProvenanceError, match="damaged"):
        harness.read_rounds(path)
    assert harness.read_rounds(tmp_path / "empty" / "rounds.jsonl") == []


class _DiskFullFile:
    """A file opened for writing on a full disk: each write stores half of its data, then fails with ENOSPC."""

    def __init__(self, fh) -> None:
        self._fh = fh

    def write(self, data):
        self._fh.write(data[: len(data) // 2])
        self._fh.flush()
        raise OSError(errno.ENOSPC, "No space left on device")

    def __getattr__(self, name):
        return getattr(self._fh, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self._fh.close()


def _disk_full(monkeypatch) -> None:
    """Every file opened for writing or appending (``open``, ``io.open``, ``Path.open``) runs out of space."""
    import builtins
    import io

    real_open = io.open

    def full_open(file, mode="r", *args, **kwargs):
        fh = real_open(file, mode, *args, **kwargs)
        return _DiskFullFile(fh) if any(c in mode for c in "wax+") else fh

    monkeypatch.setattr(io, "open", full_open)
    monkeypatch.setattr(builtins, "open", full_open)


@pytest.mark.parametrize("tail", ['{"a": 6, "tok', '{"a": 6}'])
def test_repairing_a_cut_round_on_a_full_disk_keeps_every_complete_round(tmp_path, monkeypatch, tail):
    """``--resume`` repairs a rounds file whose last line was cut; with the disk full (every write fails
    half-way with ENOSPC) no complete round may be lost: the repair truncates, it never rewrites.
    A last round cut just before its newline is complete and is kept."""
    from benchmarks import harness

    path = tmp_path / "rounds.jsonl"
    complete = [{"a": i, "tokens": list(range(50))} for i in range(5)]
    path.write_text("".join(json.dumps(r) + "\n" for r in complete) + tail)
    want = complete + ([{"a": 6}] if tail.endswith("}") else [])
    with monkeypatch.context() as m:
        _disk_full(m)
        try:
            rows = harness.read_rounds(path)
        except OSError as err:  # a failed repair may be reported, but must not cost a round
            assert err.errno == errno.ENOSPC
            rows = None
    kept = [json.loads(line) for line in path.read_text().splitlines() if line.strip()[-1:] == "}"]
    assert kept[: len(complete)] == complete, f"{len(kept)} rounds left of {len(complete)}"
    assert not path.read_text().endswith('"tok')
    if rows is not None:
        assert rows == want
    assert harness.read_rounds(path) == want  # once the disk has room again
    assert path.read_text() == "".join(json.dumps(r) + "\n" for r in want)


def _recorded(tmp_path, **changes) -> tuple:
    from benchmarks import harness

    state = {"commit": "a" * 40, "short": "a" * 7, "dirty": False, "changed": [], "untracked": []}
    prov = {"commit": state["commit"], "commit_short": state["short"], "dirty": False,
            "machine": common.machine_info(), "versions": common.versions(), "command": {"argv": ["run.py"]}}
    prov.update(changes)
    (tmp_path / "provenance.json").write_text(json.dumps(prov))
    return harness, state


@pytest.mark.parametrize("change, state_change, diff, message", [
    ({"complete": True}, {}, "", "complete"),
    ({"dirty": True}, {}, "", "dirty tree"),
    ({"machine": {"cpu": "Another CPU", "cpu_flags": {}, "cores": 2}}, {}, "", "machine differs"),
    ({"versions": {"torch": "0.0"}}, {}, "", "versions differ"),
    ({}, {"dirty": True}, "", "uncommitted"),
    ({}, {"commit": "b" * 40}, "treespec/verify/core.py\n", "code changed"),
])
def test_resume_refuses_what_would_mix_two_setups(tmp_path, monkeypatch, change, state_change, diff, message):
    harness, state = _recorded(tmp_path, **change)
    monkeypatch.setattr(harness, "git_state", lambda repo=common.REPO: {**state, **state_change})
    monkeypatch.setattr(harness, "git", lambda args, repo: diff)
    with pytest.raises(harness.ProvenanceError, match=message):
        harness.check_resumable(tmp_path)


def test_resume_accepts_the_same_setup_and_a_commit_that_changed_no_code(tmp_path, monkeypatch):
    harness, state = _recorded(tmp_path)
    monkeypatch.setattr(harness, "git", lambda args, repo: "")  # e.g. only README / results changed
    for commit in ("a" * 40, "c" * 40):
        monkeypatch.setattr(harness, "git_state", lambda repo=common.REPO, c=commit: {**state, "commit": c})
        assert harness.check_resumable(tmp_path)["commit"] == "a" * 40
    with pytest.raises(harness.ProvenanceError, match="no provenance"):
        harness.check_resumable(tmp_path / "missing")


@pytest.mark.skipif(not common.TRAIN_PROMPTS.exists(), reason="needs ../shared/data/train")
def test_tuning_prompts_are_held_out_from_every_corpus_recipe():
    """Tuning rows come from the held-out part of the seeded order (no head is tuned on its training
    prompts): none is among rows 0:HELD_OUT_FROM, and every category is represented."""
    from treespec.distill.corpus import HELD_OUT_FROM, read_prompts

    rows = read_prompts(common.TRAIN_PROMPTS, seed=0)
    trained = {r["prompt"] for r in rows[:HELD_OUT_FROM]}
    tuning = common.load_train_prompts(4)
    assert tuning and not [r for r in tuning if r["prompt"] in trained]
    categories = {r["category"] for r in rows}
    assert {r["subtask"] for r in tuning} == categories and len(tuning) == 4 * len(categories)


def test_early_exit_search_picks_the_newest_profile_of_its_dtype(tmp_path):
    """The layer search prices chains with a profile measured in its own dtype, unquantised, newest by the
    provenance date (folder names of one day sort by commit hash, not by time)."""
    from benchmarks.early_exit_layers import newest_profile

    def profile(name, dtype, date, quantize=None):
        (tmp_path / name).mkdir()
        (tmp_path / name / "profile.json").write_text(json.dumps({"meta": {"dtype": dtype, "quantize": quantize}}))
        (tmp_path / name / "provenance.json").write_text(json.dumps({"date_utc": date}))

    profile("2026-11-25-9aaaaaa-bf16", "bfloat16", "2026-11-25T08:00:00+00:00")
    profile("2026-11-25-1bbbbbb-bf16", "bfloat16", "2026-11-25T09:00:00+00:00")  # newer, smaller name
    profile("2026-11-25-2cccccc-int4", "bfloat16", "2026-11-25T10:00:00+00:00", quantize="int4")
    profile("2026-11-26-3dddddd-fp32", "float32", "2026-11-26T08:00:00+00:00")
    assert newest_profile(tmp_path, "bfloat16").parent.name == "2026-11-25-1bbbbbb-bf16"
    assert newest_profile(tmp_path, "float32").parent.name == "2026-11-26-3dddddd-fp32"
    assert newest_profile(tmp_path, "float16") is None  # no profile of that dtype


def test_head_domains_reads_the_weights_suffix_and_tables_the_step_cost():
    """``NAME=PATH@int4`` measures the head on 4-bit weights (evaluate --quantize int4); a path without the suffix,
    or with an @ elsewhere, is passed as it is; the table shows each head's step fraction and weights."""
    from benchmarks.head_domains import split_spec, table

    assert split_spec("treespec/assets/h.safetensors@int4") == ("treespec/assets/h.safetensors", ["--quantize", "int4"])
    assert split_spec("git:abc:h.safetensors") == ("git:abc:h.safetensors", [])
    assert split_spec("dir@x/h.safetensors") == ("dir@x/h.safetensors", [])
    m = {"positions_T0": 10, "top1_agreement_T0_by_depth": [0.5, 0.4, 0.3], "sum_min_pq_T1_by_depth": [0.4, 0.3, 0.2],
         "step_cost": {"fraction": 0.083, "head_step_s": 0.00142, "target_step_s": 0.017, "head_weights": "int4"}}
    assert "| int4 | specbench | 10 | 0.500 | 0.300 | 0.300 | 0.400 | 0.200 | 0.200 | 0.083 (1.42 / 17.0 ms, int4) |" \
        in table({"int4": {"specbench": m}})


@pytest.mark.parametrize("temperature, extra", [(0.0, {}), (1.0, {}), (0.0, {"prompt_lookup_num_tokens": 2})])
def test_hf_rows_generate_every_token_past_eos(temperature, extra):
    """The HF rows time exactly n tokens even where the model emits its EOS token: a tiny model whose
    generation config names as EOS the very token it emits first (so HF's own default would stop at once); plain
    and with prompt lookup (its drafts are cut at EOS too). At T=1 the old setting failing depends on the sampled
    tokens; at T=0 it stops after one token for certain."""
    import torch

    from benchmarks.methods import ForwardCounter, hf_method
    from treespec.models.tiny import tiny_model

    model = tiny_model("llama", 64, seed=0, logit_scale=6.0)
    prompt = {"ids": [3, 17, 5, 9]}
    first = int(model(torch.tensor([prompt["ids"]])).logits[0, -1].argmax())
    model.generation_config.eos_token_id = first
    model.generation_config.pad_token_id = 0
    out = hf_method("hf_plain", model, ForwardCounter(model), "test", **extra)(prompt, 12, temperature, 0)
    assert len(out["tokens"]) == 12, out["tokens"]
    if temperature == 0:
        assert out["tokens"][0] == first  # EOS was emitted, and generation went on


def test_methods_are_paired_against_the_cli_default_with_a_sign_test():
    """Per prompt, the default row's time / a method's time (same prompt, same repeats); the sign test is
    the exact binomial one: 3 faster, 1 slower gives p = 2 * (1 + 4) / 16 = 0.625; 10 of 10 gives 2 / 1024."""
    from benchmarks import report

    rows = []
    # ts_head (the default) takes 1 s on every prompt; hw411 is faster on three prompts, slower on one
    hw = {"p1": 0.5, "p2": 0.8, "p3": 0.9, "p4": 1.25}
    for pid, t in hw.items():
        for m, wall in (("ts_plain", 1.5), ("ts_head", 1.0), ("hw411", t)):
            rows.append({"dtype": "bfloat16", "temperature": 1.0, "prompt_id": pid, "subtask": "qa", "repeat": 0,
                         "method": m, "engine": "treespec", "new_tokens": 32, "wall_s": wall, "target_calls": 16})
    prompt_rows = report.per_prompt_speedups(rows, {("bfloat16", 1.0): "ts_head"})
    got = {r["prompt_id"]: r["speedup_vs_default"] for r in prompt_rows if r["method"] == "hw411"}
    assert got == {pid: pytest.approx(1.0 / t) for pid, t in hw.items()}
    assert all(r["speedup_vs_default"] == pytest.approx(1.0) for r in prompt_rows if r["method"] == "ts_head")
    e = report.summarise(prompt_rows, seed=0)["bfloat16/T=1"]["hw411"]["speedup_vs_default"]
    assert (e["wins"], e["losses"]) == (3, 1) and e["p_sign"] == pytest.approx(0.625)
    assert e["median"] == pytest.approx((1 / 0.8 + 1 / 0.9) / 2)
    assert report.sign_test([1.1] * 10)["p_sign"] == pytest.approx(2 / 1024)
    assert report.sign_test([1.0, 1.0]) == {"wins": 0, "losses": 0, "p_sign": 1.0}
    # without a default for the block there is no paired column
    assert not any("speedup_vs_default" in r for r in report.per_prompt_speedups(rows))


def test_the_report_and_plot_carry_the_paired_table(tmp_path, monkeypatch):
    from benchmarks import report

    rows = []
    for pid, t in (("p1", 0.5), ("p2", 0.8)):
        for m, wall in (("ts_plain", 1.5), ("ts_head", 1.0), ("hw411", t)):
            rows.append({"dtype": "bfloat16", "temperature": 1.0, "prompt_id": pid, "subtask": "qa", "repeat": 0,
                         "method": m, "engine": "treespec", "new_tokens": 32, "wall_s": wall, "target_calls": 16})
    monkeypatch.setattr(report, "cli_default_method", lambda dtype, t: "ts_head")
    summary = report.summarise(report.per_prompt_speedups(rows, {("bfloat16", 1.0): "ts_head"}), seed=0)
    prov = {"commit_short": "abc1234", "dirty": False, "date_utc": "now", "command": {"shell": "x"},
            "machine": {"cpu": "cpu", "cores": 2, "cpu_flags": {}, "bf16_native": True}, "versions": {}}
    settings = {"prompts": 2, "prompt_set": "train", "max_new_tokens": 32, "repeats": 1, "threads": 2, "seed": 0,
                "warmup_tokens": 8}
    table = report.markdown(summary, {"provenance": prov, "settings": settings, "methods": {}})
    assert "Paired against the CLI default here (`ts_head`)" in table
    assert "| hw411 | 1.62x [1.25, 2.00] | 2 / 0 | 0.5 |" in table
    assert "| ts_plain | 0.67x [0.67, 0.67] | 0 / 2 | 0.5 |" in table
    report.plot(summary, tmp_path)
    assert (tmp_path / "speedup.png").stat().st_size > 0


def test_the_paired_column_follows_the_cli_default():
    """The rows of the CLI's measured defaults (treespec.cli.resolve_target and _resolved_draft), pinned: the
    PyTorch target's lookup + head at T=0 on a native-bf16 CPU, plain decoding on llama.cpp elsewhere."""
    from benchmarks import report

    want = {("bfloat16", 0.0): "ts_lookup_head", ("bfloat16", 0.7): "tsl_plain", ("bfloat16", 1.0): "tsl_plain",
            ("float32", 0.0): "tsl_plain", ("float32", 0.7): "tsl_plain", ("float32", 1.0): "tsl_plain"}
    assert {k: report.cli_default_method(*k) for k in want} == want


def test_draft_card_states_the_paired_change_and_refuses_other_positions():
    """With a baseline (the earlier head measured on the same positions) the card states the paired change,
    read from both files; a baseline measured on other positions is refused, and without one no such line."""
    from benchmarks.draft_card import head_metadata, paired_lines, render

    rec = json.loads((common.RESULTS / "draft" / "2026-11-22-010e29c-dirty" / "metrics.json").read_text())
    head = common.REPO / "treespec" / "assets" / "gemma3-270m-head.safetensors"
    meta = head_metadata(head)
    metrics = dict(rec["metrics"], top1_agreement_T0=0.648, sum_min_pq_T1=0.484,
                   top1_agreement_T0_by_depth=[0.648, 0.571], sum_min_pq_T1_by_depth=[0.484, 0.431])
    base = dict(metrics, top1_agreement_T0=0.640, sum_min_pq_T1=0.476,
                top1_agreement_T0_by_depth=[0.640, 0.567], sum_min_pq_T1_by_depth=[0.476, 0.421])
    card = render(head, meta, metrics, rec["corpora"], None, "abc1234", (), None, base)
    assert "T=0 top-1 0.640 -> 0.648, depth 2 0.567 -> 0.571" in card
    assert "T=1 sum min(p, q) 0.476 -> 0.484, depth 2 0.421 -> 0.431" in card
    assert "Like for like" not in render(head, meta, metrics, rec["corpora"], None, "abc1234")
    for key in ("positions_T1", "prompts"):
        with pytest.raises(ValueError, match=key):
            paired_lines(metrics, dict(base, **{key: (base.get(key) or 0) + 1}))


def test_host_name_and_host_stream_summary():
    from benchmarks import report
    from benchmarks.common import host_name

    assert host_name({"cpu": "AMD EPYC", "cpu_family": "25", "cpu_model": "17", "cpu_mhz": "2596.128"}) == \
        "AMD EPYC (family 25, model 17, 2596 MHz when read)"
    assert host_name({"cpu": "AMD EPYC", "cpu_family": None, "cpu_model": None, "cpu_mhz": None}) == "AMD EPYC"
    rows = [{"dtype": "bfloat16", "temperature": t, "prompt_id": p, "repeat": 0, "method": m,
             "host_stream_s": s, "host_stream_bytes": 536e6}
            for (t, p, s) in ((0.0, "a", 0.012), (0.0, "b", 0.020), (1.0, "a", 0.016)) for m in ("x", "y", "z")]
    rows.append({"dtype": "float32", "temperature": 0.0, "prompt_id": "a", "repeat": 0, "method": "x"})  # no reading
    ref = report.host_stream(rows)
    # one reading per round (three rows share it), not one per row
    assert ref == {"bfloat16": {"median_ms": 16.0, "min_ms": 12.0, "max_ms": 20.0, "rounds": 3, "mb": 536.0}}


def test_round_parts_pool_rounds_not_prompts():
    from benchmarks import report

    def row(method, calls, draft, nodes, tokens=12):
        return {"dtype": "bfloat16", "temperature": 1.0, "method": method, "target_calls": calls, "new_tokens": tokens,
                "draft_s": draft, "verify_s": 0.03 * calls, "other_s": 0.0, "prefill_s": 0.012, "mean_tree_nodes": nodes}

    rows = [row("ts_head", 4, 0.012, 2.0), row("ts_head", 8, 0.012, 0.5), row("ts_head", 0, 0.5, 9.0),  # no round
            {"dtype": "bfloat16", "temperature": 1.0, "method": "llama_plain", "target_calls": None, "new_tokens": 12}]
    parts = report.round_parts(rows)
    e = parts["bfloat16/T=1"]["ts_head"]
    assert set(parts["bfloat16/T=1"]) == {"ts_head"}  # llama.cpp rows have no parts
    # 12 rounds in all: draft 24 ms / 12, nodes (4 x 2 + 8 x 0.5) / 12 = 1.0 (a mean of prompt means says 1.25)
    assert e["rounds"] == 12 and abs(e["draft_ms"] - 2.0) < 1e-9 and abs(e["nodes"] - 1.0) < 1e-9
    assert abs(e["verify_ms"] - 30.0) < 1e-9 and abs(e["prefill_ms"] - 2.0) < 1e-9 and e["tokens_per_round"] == 2.0


def test_cpu_info_reads_family_model_and_clock():
    from benchmarks.common import cpu_info

    text = ("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 17\n"
            "model name\t: AMD EPYC\ncpu MHz\t\t: 2596.128\nflags\t\t: fpu avx2 avx512f avx512_bf16\n\n"
            "processor\t: 1\ncpu family\t: 26\nmodel\t\t: 2\nmodel name\t: other\ncpu MHz\t\t: 1.0\n")
    info = cpu_info(text)
    assert (info["cpu"], info["cpu_family"], info["cpu_model"], info["cpu_mhz"]) == ("AMD EPYC", "25", "17", "2596.128")
    assert info["cpu_flags"]["avx512_bf16"] and not info["cpu_flags"]["amx_bf16"] and info["bf16_native"]
    assert cpu_info("")["cpu_family"] is None


def test_the_report_places_round_parts_and_host_reference_under_their_block():
    from benchmarks import report

    rows = []
    for temp in (0.0, 1.0):
        for pid in ("p1", "p2"):
            for m, wall, calls, draft in (("ts_head", 1.0, 16, 0.08 if temp else 0.04), ("ts_plain", 1.6, 32, 0.0)):
                rows.append({"dtype": "bfloat16", "temperature": temp, "prompt_id": pid, "subtask": "qa", "repeat": 0,
                             "method": m, "engine": "treespec", "new_tokens": 32, "wall_s": wall, "target_calls": calls,
                             "draft_s": draft, "verify_s": 0.5, "other_s": 0.0, "prefill_s": 0.0,
                             "mean_tree_nodes": 1.5 if draft else 0.0, "host_stream_s": 0.0125,
                             "host_stream_bytes": 536e6})
    summary = report.summarise(report.per_prompt_speedups(rows), seed=0)
    prov = {"commit_short": "abc1234", "dirty": False, "date_utc": "now", "command": {"shell": "x"},
            "machine": {"cpu": "cpu", "cores": 2, "cpu_flags": {}, "bf16_native": True}, "versions": {}}
    settings = {"prompts": 2, "prompt_set": "eval", "max_new_tokens": 32, "repeats": 1, "threads": 2, "seed": 0,
                "warmup_tokens": 8}
    meta = {"provenance": prov, "settings": settings, "methods": {}, "round_parts": report.round_parts(rows),
            "host_stream": report.host_stream(rows)}
    table = report.markdown(summary, meta)
    assert ("- Host reference (bfloat16): reading the target's 536 MB of weights once took 12.5 ms (median; range "
            "12.5 to 12.5) over 4 readings") in table
    t0, t1 = table.split("## bfloat16/T=0")[1].split("## bfloat16/T=1")
    # draft 0.04 s over 16 rounds = 2.5 ms at T=0, 0.08 s = 5.0 ms at T=1: each block shows its own rounds
    assert "| ts_head | 32 | 2.5 | 31.2 | 0.0 | 0.0 | 1.50 | 2.00 |" in t0
    assert "| ts_head | 32 | 5.0 | 31.2 | 0.0 | 0.0 | 1.50 | 2.00 |" in t1
    parts = t1.split("Where a round goes")[1]
    assert parts.index("| ts_plain |") < parts.index("| ts_head |")  # the order of the tables above


def test_paths_outside_the_repository_are_recorded_relative_to_it(tmp_path):
    """A run from a worktree with another checkout's interpreter records ``../other/...``, never an absolute path."""
    from benchmarks.common import _repo_relative

    repo = tmp_path / "wt"
    repo.mkdir()
    assert _repo_relative(str(tmp_path / "main" / ".venv" / "bin" / "python"), repo) == "../main/.venv/bin/python"
    assert _repo_relative(str(repo / "benchmarks"), repo) == "benchmarks"
    assert _repo_relative(str(repo), repo) == "."


def test_path_values_of_the_environment_are_recorded_relative(monkeypatch):
    from benchmarks import common

    monkeypatch.setenv("TREESPEC_CACHE", str(common.REPO.parent / "other" / ".cache" / "treespec"))
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    env = common.command()["env"]
    assert env["TREESPEC_CACHE"] == "../other/.cache/treespec" and env["OMP_NUM_THREADS"] == "2"
