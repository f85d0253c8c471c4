"""kill -9 at seeded random moments of corpus building, training and export; then run again.

Each trial forks the test process (torch and the tiny target already loaded, so a trial costs
milliseconds, not an interpreter start), lets the child work, and SIGKILLs it after a delay drawn
from ``random.Random(seed)`` between 0 and 1.1x the wall time of an uninterrupted forked run. The
command is then run again to completion in the parent. The result must equal the uninterrupted
run's: bit-identical corpus shards and manifest (wall-clock fields aside); identical checkpoint,
optimizer and head tensors after training (the head file's metadata holds wall-clock times); an
exported file with the same header and the same bytes after it (safetensors orders its metadata
map by hash, differently on each write). No temporary file may remain. 20 seeded trials for
corpus building and training, 60 for export (short); each test also checks that kills did land
mid-run (partial corpora, resumed checkpoints).

Random delays land inside a file write only by chance (an export's write is a few milliseconds), so
corpus building, training and export also run deterministic trials: the child is killed at its N-th
atomic write (:mod:`treespec.files`), with the temporary file complete but not yet moved onto its
target, or cut to half its length (what a kill inside the write leaves); the target must keep its
previous content and the next run must finish with the same result.
"""

from __future__ import annotations

import json
import os
import random
import re
import select
import signal
import time
import traceback
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from treespec.distill.continuations import ContinuationOptions, build_continuations
from treespec.distill.corpus import CorpusOptions, build_corpus
from treespec.distill.medusa import MedusaTrainConfig, train_medusa
from treespec.distill.train import TrainConfig, export_checkpoint, train
from treespec.models.tiny import tiny_model

pytestmark = pytest.mark.faults

TRIALS = 20
EXPORT_TRIALS = 60  # an export is ~0.05 s: more trials, so that many kills land before it ends
V = 96
OPTS = CorpusOptions(topk=4, shard_positions=60, batch_size=2)
CFG = TrainConfig(steps=40, batch_size=2, seq_len=16, lr=3e-3, warmup=5, vocab_size=64, num_heads=4,
                  intermediate_size=32, ckpt_every=4, keep_ckpts=2, steps_per_shard=5, soft="topk",
                  feature_noise=0.05, amp="off")


def seqs() -> list[list[int]]:
    g = random.Random(0)
    return [[0] + [g.randrange(1, V) for _ in range(g.randrange(8, 30))] for _ in range(16)]


@pytest.fixture(scope="module")
def target():
    return tiny_model("gemma3", V, seed=0, logit_scale=6.0)


def killed_run(work, delay: float) -> bool:
    """Run ``work()`` in a forked child, SIGKILL it after ``delay`` s; True if it was still running."""
    pid = os.fork()
    if pid == 0:  # child: do the work, then leave without running the parent's cleanup
        try:
            with torch.enable_grad():
                work()
        finally:
            os._exit(0)
    end = time.perf_counter() + delay
    while time.perf_counter() < end:
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done:
            return False
        time.sleep(0.002)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return True


def killed_at_write(work, nth: int, half: bool) -> None:
    """Run ``work()`` in a forked child and SIGKILL it at its ``nth`` atomic write (1-based), after the
    temporary file is written and before it replaces the target; with ``half`` the temporary is first cut
    to half its length, the state a kill inside the write leaves. Fails if the child writes fewer files."""
    import treespec.files as files

    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        os.close(r)
        calls = [0]
        fsync = files._fsync

        def stop_at_nth(path: Path) -> None:
            calls[0] += 1
            if calls[0] < nth:
                return fsync(path)
            if half:
                os.truncate(path, os.path.getsize(path) // 2)
            os.write(w, b"x")  # tell the parent: kill me now
            time.sleep(600)

        files._fsync = stop_at_nth
        code = 0
        try:
            with torch.enable_grad():
                work()
        except BaseException:
            traceback.print_exc()
            code = 1
        finally:
            os._exit(code)
    os.close(w)
    try:
        ready, _, _ = select.select([r], [], [], 300)
        reached = bool(ready) and os.read(r, 1) == b"x"  # b"" when the child ended without reaching it
    finally:
        os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
        os.close(r)
    assert reached, (f"the run ended before its write number {nth} "
                     f"({'it failed: see its traceback' if os.WIFEXITED(status) and os.WEXITSTATUS(status) else 'it finished'})")


WRITE_KILLS = [(1, False), (2, True), (4, False), (7, True)]  # (n-th atomic write, cut the temporary in half)


def safetensors_content(path: Path) -> tuple[dict, bytes]:
    """(header as a dict, tensor bytes): safetensors writes its metadata map in hash order, which
    differs between writes, so two writes of the same content are compared through this."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def temporaries(folder: Path) -> list[str]:
    return [p.name for p in folder.iterdir() if ".tmp" in p.name]


def forked_wall(work) -> float:
    """Wall time of ``work()`` run to completion in a forked child (a child is slower than its parent:
    copy-on-write page faults), the scale of the kill delays."""
    t0 = time.perf_counter()
    assert not killed_run(work, 600.0)
    return time.perf_counter() - t0


def _manifest(folder: Path) -> dict:
    man = json.loads((folder / "manifest.json").read_text())
    man.pop("seconds")
    return man


def test_corpus_survives_kill_9(target, tmp_path):
    ref = tmp_path / "ref"
    build_corpus(target, seqs(), ref, OPTS, progress=False)
    wall = forked_wall(lambda: build_corpus(target, seqs(), tmp_path / "timing", OPTS, progress=False))
    files = sorted(p.name for p in ref.iterdir())
    assert len(files) >= 5, files  # several shards: kills land between and inside writes
    interrupted, partial, mid_write = 0, 0, 0
    for seed in range(TRIALS):
        out = tmp_path / f"trial-{seed}"
        interrupted += killed_run(lambda: build_corpus(target, seqs(), out, OPTS, progress=False),
                                  random.Random(seed).uniform(0, 1.1 * wall))
        mid_write += bool(temporaries(out)) if out.exists() else 0
        if (out / "manifest.json").exists() and not json.loads((out / "manifest.json").read_text())["complete"]:
            partial += 1
        build_corpus(target, seqs(), out, OPTS, progress=False)
        names = sorted(p.name for p in out.iterdir())
        assert names == files, (seed, sorted(set(names) ^ set(files)))  # no temporaries, no missing shard
        assert _manifest(out) == _manifest(ref), seed
        for name in files:
            if name.endswith(".safetensors"):
                assert (out / name).read_bytes() == (ref / name).read_bytes(), (seed, name)
    print(f"corpus: {interrupted} of {TRIALS} runs killed, {partial} with a partial corpus, {mid_write} mid-write")
    # the seeded kills' times depend on the host (CI saw 1 to 2 of 20 land after the first shard): the kills at
    # chosen writes below leave partial corpora on every host
    assert interrupted >= TRIALS // 2, (interrupted, partial)
    for nth, half in WRITE_KILLS:
        out = tmp_path / f"write-{nth}"
        killed_at_write(lambda: build_corpus(target, seqs(), out, OPTS, progress=False), nth, half)
        assert temporaries(out), nth
        if nth > 1:  # a shard and the manifest were written before this write: a partial corpus to resume
            assert not json.loads((out / "manifest.json").read_text())["complete"], nth
        build_corpus(target, seqs(), out, OPTS, progress=False)
        assert sorted(p.name for p in out.iterdir()) == files, nth
        assert _manifest(out) == _manifest(ref), nth
        for name in files:
            if name.endswith(".safetensors"):
                assert (out / name).read_bytes() == (ref / name).read_bytes(), (nth, name)


@pytest.fixture(scope="module")
def corpus(target, tmp_path_factory):
    out = tmp_path_factory.mktemp("corpus")
    build_corpus(target, seqs(), out, OPTS, progress=False)
    return out


def test_training_survives_kill_9(target, corpus, tmp_path):
    quiet = {"progress": False, "log": lambda *_: None}
    ref = tmp_path / "ref"
    with torch.enable_grad():
        train(target, corpus, ref, CFG, **quiet)
    wall = forked_wall(lambda: train(target, corpus, tmp_path / "timing", CFG, **quiet))
    ref_ckpt = torch.load(ref / f"ckpt-{CFG.steps}.pt", weights_only=True)

    def finish_and_compare(run: Path, trial) -> None:
        with torch.enable_grad():
            head, summary = train(target, corpus, run, CFG, **quiet)
        assert summary["step"] == CFG.steps
        assert not temporaries(run), (trial, temporaries(run))
        state = torch.load(run / f"ckpt-{CFG.steps}.pt", weights_only=True)
        for k, v in ref_ckpt["head"].items():
            assert torch.equal(state["head"][k], v), (trial, k)
        for k, v in ref_ckpt["optimizer"]["state"].items():
            for name, t in v.items():
                assert torch.equal(state["optimizer"]["state"][k][name], t), (trial, k, name)
        got, want = load_file(run / "head.safetensors"), load_file(ref / "head.safetensors")
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want), trial

    interrupted, resumed, mid_write = 0, 0, 0
    for seed in range(TRIALS):
        run = tmp_path / f"trial-{seed}"
        interrupted += killed_run(lambda: train(target, corpus, run, CFG, **quiet),
                                  random.Random(seed).uniform(0, 1.1 * wall))
        mid_write += bool(temporaries(run)) if run.exists() else 0
        resumed += any(run.glob("ckpt-*.pt")) and not (run / f"ckpt-{CFG.steps}.pt").exists()
        finish_and_compare(run, seed)
    print(f"training: {interrupted} of {TRIALS} runs killed, {resumed} resumed from a checkpoint, "
          f"{mid_write} mid-write")
    assert interrupted >= TRIALS // 2 and resumed >= 3, (interrupted, resumed)
    for nth, half in WRITE_KILLS:
        run = tmp_path / f"write-{nth}"
        killed_at_write(lambda: train(target, corpus, run, CFG, **quiet), nth, half)
        assert temporaries(run), nth
        finish_and_compare(run, f"write {nth}")


def test_export_survives_kill_9(target, corpus, tmp_path):
    run = tmp_path / "run"  # a wide head (~1.6M parameters): most of an export's time is the file write
    with torch.enable_grad():
        train(target, corpus, run, TrainConfig(**{**CFG.__dict__, "steps": 2, "intermediate_size": 16384}),
              progress=False, log=lambda *_: None)
    ref = tmp_path / "ref.safetensors"
    export_checkpoint(run, ref)
    wall = forked_wall(lambda: export_checkpoint(run, tmp_path / "timing.safetensors"))
    interrupted, mid_write = 0, 0
    for seed in range(EXPORT_TRIALS):
        folder = tmp_path / f"trial-{seed}"
        folder.mkdir()
        out = folder / "head.safetensors"
        interrupted += killed_run(lambda: export_checkpoint(run, out), random.Random(seed).uniform(0, 1.1 * wall))
        mid_write += bool(temporaries(folder))
        if out.exists():  # a file that exists at all is complete
            assert safetensors_content(out) == safetensors_content(ref), seed
        export_checkpoint(run, out)
        assert safetensors_content(out) == safetensors_content(ref), seed
        assert not temporaries(folder), (seed, temporaries(folder))
    print(f"export: {interrupted} of {EXPORT_TRIALS} runs killed, {mid_write} in the middle of the write")
    assert interrupted >= EXPORT_TRIALS // 2, interrupted
    old = b"the previous head file"
    for existing in (False, True):  # a first export, and one over an older file (which must survive the kill)
        for half in (False, True):
            folder = tmp_path / f"write-{existing}-{half}"
            folder.mkdir()
            out = folder / "head.safetensors"
            if existing:
                out.write_bytes(old)
            killed_at_write(lambda: export_checkpoint(run, out), 1, half)
            assert temporaries(folder), (existing, half)
            assert (out.read_bytes() == old) if existing else (not out.exists()), (existing, half)
            export_checkpoint(run, out)
            assert safetensors_content(out) == safetensors_content(ref), (existing, half)
            assert not temporaries(folder), (existing, half, temporaries(folder))


def test_stale_temporaries_of_dead_writers_are_removed(target, corpus, tmp_path):
    """Deterministic twin of the kill trials: what a killed writer leaves (``.NAME.tmpPID`` of a dead
    process) is removed when the command runs again; a live writer's temporary is kept."""
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)  # a process id that is certainly gone
    live = f".x.tmp{os.getpid()}"
    built = tmp_path / "corpus"
    for folder, name in ((built, ".shard-00000.safetensors"), (tmp_path / "run", ".ckpt-4.pt"),
                         (tmp_path / "out", ".head.safetensors")):
        folder.mkdir()
        (folder / f"{name}.tmp{pid}").write_bytes(b"half a file")
        (folder / live).write_bytes(b"being written")
    build_corpus(target, seqs(), built, OPTS, progress=False)
    with torch.enable_grad():
        train(target, corpus, tmp_path / "run", TrainConfig(**{**CFG.__dict__, "steps": 4}), progress=False,
              log=lambda *_: None)
    export_checkpoint(tmp_path / "run", tmp_path / "out" / "head.safetensors")
    for folder in (built, tmp_path / "run", tmp_path / "out"):
        assert temporaries(folder) == [live], folder


MEDUSA_CFG = MedusaTrainConfig(steps=40, batch_size=16, lr=1e-2, warmup=5, num_heads=2, vocab_size=64,
                               ckpt_every=4)


def test_medusa_training_survives_kill_9(target, corpus, tmp_path):
    """``python -m treespec.distill medusa``'s trainer: a killed run resumes from medusa-ckpt.pt to the same
    heads, optimizer state and loss history (wall-clock fields aside) as an uninterrupted run."""
    ref = tmp_path / "ref"
    train_medusa(target, [corpus], ref, MEDUSA_CFG, progress=False)
    wall = forked_wall(lambda: train_medusa(target, [corpus], tmp_path / "timing", MEDUSA_CFG, progress=False))
    want = torch.load(ref / "medusa-ckpt.pt", weights_only=True)
    files = sorted(p.name for p in ref.iterdir())
    interrupted, resumed, mid_write = 0, 0, 0
    for seed in range(TRIALS):
        run = tmp_path / f"trial-{seed}"
        interrupted += killed_run(lambda: train_medusa(target, [corpus], run, MEDUSA_CFG, progress=False),
                                  random.Random(seed).uniform(0, 1.1 * wall))
        mid_write += bool(temporaries(run)) if run.exists() else 0
        if (run / "medusa-ckpt.pt").exists():
            resumed += torch.load(run / "medusa-ckpt.pt", weights_only=True)["step"] < MEDUSA_CFG.steps
        _, summary = train_medusa(target, [corpus], run, MEDUSA_CFG, progress=False)
        assert summary["steps"] == MEDUSA_CFG.steps
        assert sorted(p.name for p in run.iterdir()) == files, (seed, temporaries(run))
        got = torch.load(run / "medusa-ckpt.pt", weights_only=True)
        assert got["step"] == want["step"] and torch.equal(got["vocab_ids"], want["vocab_ids"])
        for k, v in want["heads"].items():
            assert torch.equal(got["heads"][k], v), (seed, k)
        for k, v in want["opt"]["state"].items():
            for name, t in v.items():
                assert torch.equal(got["opt"]["state"][k][name], t), (seed, k, name)
        strip = lambda rows: [{k: v for k, v in r.items() if k != "seconds"} for r in rows]  # noqa: E731
        assert strip(got["history"]) == strip(want["history"]), seed
    print(f"medusa: {interrupted} of {TRIALS} runs killed, {resumed} resumed from a checkpoint, {mid_write} mid-write")
    assert interrupted >= TRIALS // 2 and resumed >= 3, (interrupted, resumed)


CONT = ContinuationOptions(mode="sample", temperature=1.0, new_tokens=10, max_prompt_tokens=24, batch_size=2,
                           chunk_size=2)


def test_continuations_survive_kill_9(target, tmp_path):
    """``python -m treespec.distill.continuations``: a killed run resumes chunk by chunk to the same chunk
    files (bit-identical: each chunk is sampled from its own seeded generator) and manifest."""
    def build(out: Path) -> dict:
        return build_continuations(target, seqs(), out, CONT, eos={1}, model_name="tiny", progress=False)

    ref = tmp_path / "ref"
    build(ref)
    wall = forked_wall(lambda: build(tmp_path / "timing"))
    files = sorted(p.name for p in ref.iterdir())
    assert len(files) >= 8, files
    interrupted, partial, mid_write = 0, 0, 0
    for seed in range(TRIALS):
        out = tmp_path / f"trial-{seed}"
        interrupted += killed_run(lambda: build(out), random.Random(seed).uniform(0, 1.1 * wall))
        mid_write += bool(temporaries(out)) if out.exists() else 0
        if (out / "manifest.json").exists() and not json.loads((out / "manifest.json").read_text())["complete"]:
            partial += 1
        build(out)
        assert sorted(p.name for p in out.iterdir()) == files, (seed, sorted(set(files) ^ {p.name for p in out.iterdir()}))
        assert _manifest(out) == _manifest(ref), seed
        for name in files:
            if name.startswith("chunk-"):
                assert (out / name).read_bytes() == (ref / name).read_bytes(), (seed, name)
    print(f"continuations: {interrupted} of {TRIALS} runs killed, {partial} partial, {mid_write} mid-write")
    assert interrupted >= TRIALS // 2 and partial >= 3, (interrupted, partial)


def test_head_files_record_paths_below_the_working_directory_relative(target, corpus, tmp_path, monkeypatch):
    """A head trained and exported from a checkout, given absolute paths below it (``TREESPEC_CACHE=$PWD/...``),
    records them relative to it: a committed head file names no host's folders. A checkpoint of an older run that
    recorded absolute paths exports relative too; paths outside the working directory stay as given."""
    import json
    import shutil

    from safetensors import safe_open

    from treespec.files import recorded_path

    work = tmp_path / "checkout"
    shutil.copytree(corpus, work / "cache" / "corpus")
    monkeypatch.chdir(work)
    run = work / "cache" / "run"
    with torch.enable_grad():
        train(target, work / "cache" / "corpus", run, TrainConfig(**{**CFG.__dict__, "steps": 2}), progress=False,
              log=lambda *_: None)
    ckpt = sorted(run.glob("ckpt-*.pt"))[-1]
    state = torch.load(ckpt, weights_only=False)
    assert state["corpus"] == ["cache/corpus"]
    state["corpus"] = [str(work / "cache" / "corpus")]  # as runs before this rule recorded it
    torch.save(state, ckpt)
    summary = export_checkpoint(run, work / "out" / "head.safetensors")
    assert summary["checkpoint"] == f"cache/run/{ckpt.name}" and summary["corpus"] == ["cache/corpus"]
    for path in (run / "head.safetensors", work / "out" / "head.safetensors"):
        with safe_open(str(path), framework="pt") as fh:
            meta = fh.metadata()
        assert str(tmp_path) not in json.dumps(meta), path
    assert json.loads(meta["extra"])["summary"]["corpus"] == ["cache/corpus"]
    assert recorded_path(tmp_path / "elsewhere") == str(tmp_path / "elsewhere")  # outside: as given
    assert recorded_path(work / "corpus") == "./corpus"  # one level down: still a path, not a name in the cache
    (work / "linked").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    assert recorded_path(work / "linked" / "x") == "linked/x"  # a linked cache inside the checkout names no host
    assert recorded_path("rel/x") == "rel/x"


_ABSOLUTE = re.compile(r"^(?:/|[A-Za-z]:[\\/])")  # a POSIX root or a Windows drive


def host_paths(metadata: dict[str, str]) -> list[str]:
    """The absolute paths in a safetensors file's metadata: any value, or any string inside a value that holds
    JSON, that starts at a filesystem root (``/...``) or a Windows drive (``C:\\...``)."""
    found = []

    def walk(value) -> None:
        if isinstance(value, str):
            if _ABSOLUTE.match(value.strip()):
                found.append(value)
        elif isinstance(value, dict):
            for item in value.values():
                walk(item)
        elif isinstance(value, list):
            for item in value:
                walk(item)

    for value in metadata.values():
        try:
            walk(json.loads(value))
        except ValueError:
            walk(value)
    return found


def test_shipped_assets_record_no_host_paths():
    """Every shipped weights file names its corpora and folders without a host's absolute paths; the twin: the
    Medusa asset's earlier metadata (``/root/.cache/...`` corpora) is caught."""
    from safetensors import safe_open

    assets = sorted((Path(__file__).resolve().parents[2] / "treespec" / "assets").glob("*.safetensors"))
    assert assets
    for asset in assets:
        with safe_open(str(asset), "pt") as f:
            assert host_paths(f.metadata() or {}) == [], asset.name
    earlier = {"extra": '{"summary": {"corpora": ["/root/.cache/treespec/distill/corpus/train-k0", "train-greedy"]}}'}
    assert host_paths(earlier) == ["/root/.cache/treespec/distill/corpus/train-k0"]
    assert host_paths({"src": "/mnt/data/x", "win": '{"a": ["C:\\\\runs\\\\head"]}', "ok": ".cache/x"}) == [
        "/mnt/data/x", "C:\\runs\\head"]
