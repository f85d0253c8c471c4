"""Hardening of the embedded-model cache: leftovers of killed converters, the lock file, a cache
that cannot be repaired, and kill -9 at random points of a (stub) conversion.

Children are forked from the test process (torch is already imported here, so a child costs
milliseconds); the stub converter writes a few files slowly so that a seeded kill lands anywhere
in the conversion, the manifest write or the final rename."""

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest

from treespec.models import loading

from cache_helpers import read_only_corrupted_cache

LOCK = ".gemma-3-270m.lock"
FINAL = f"gemma-3-270m-v{loading._CACHE_FORMAT}"
STUB_FILES = {"model.safetensors": b"W" * 300_000, "config.json": b'{"a": 1}',
              "tokenizer.json": b'{"model": {}}' * 50, "tokenizer_config.json": b"{}"}


def slow_stub(out_dir, progress, pause=0.01):
    for name, data in STUB_FILES.items():
        with open(out_dir / name, "wb") as fh:
            for i in range(0, len(data), 100_000):
                fh.write(data[i:i + 100_000])
                fh.flush()
                time.sleep(pause)


@pytest.fixture
def root(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("TREESPEC_CACHE", str(cache))
    monkeypatch.setattr(loading, "_convert_embedded_gemma", slow_stub)
    return cache


def _dead_pid():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _fork(target):
    pid = os.fork()
    if pid == 0:  # child
        code = 1
        try:
            target()
            code = 0
        finally:
            os._exit(code)
    return pid


def _manifest(cache_dir):
    return json.loads((cache_dir / "treespec-manifest.json").read_text())


# ------------------------------------------------------------------ 1. leftovers
def test_stale_conversion_folder_of_dead_process_is_removed_live_one_kept(root):
    root.mkdir()
    stale = root / f".gemma-3-270m-{_dead_pid()}-deadbeef"
    (stale / "gguf").mkdir(parents=True)
    (stale / "model.safetensors").write_bytes(b"half")
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        live = root / f".gemma-3-270m-{sleeper.pid}-cafebabe"
        live.mkdir()
        (live / "model.safetensors").write_bytes(b"in progress")
        stale_manifest = root / f".treespec-manifest.json.tmp{_dead_pid()}"
        stale_manifest.write_text("{")
        cache = loading.embedded_gemma_dir(progress=False)
        assert loading.cache_is_valid(cache)
        assert not stale.exists() and not stale_manifest.exists()
        assert (live / "model.safetensors").read_bytes() == b"in progress"
    finally:
        sleeper.kill()
        sleeper.wait()


def test_failed_manifest_write_leaves_no_temporary(root, monkeypatch):
    """The manifest goes through treespec.files.atomic_write: a failure after its temporary was
    written (here: fsync) removes it, and the conversion folder goes too."""
    import treespec.files as files

    def failing_fsync(path):
        assert path.exists()  # the temporary manifest was written
        raise OSError(28, "No space left on device", str(path))

    monkeypatch.setattr(files, "_fsync", failing_fsync)
    with pytest.raises(OSError, match="No space left"):
        loading.embedded_gemma_dir(progress=False)
    assert sorted(p.name for p in root.iterdir()) == [LOCK]


# ------------------------------------------------------------------ 2. the lock file
def test_symlinked_lock_is_refused_and_its_target_kept(root, tmp_path):
    root.mkdir()
    victim = tmp_path / "precious.txt"
    victim.write_text("do not truncate me")
    (root / LOCK).symlink_to(victim)
    with pytest.raises(loading.CacheError, match="symlink") as info:
        loading.embedded_gemma_dir(progress=False)
    assert isinstance(info.value, ValueError) and str(root) in str(info.value)
    assert victim.read_text() == "do not truncate me"


def test_existing_lock_file_is_not_truncated(root):
    root.mkdir()
    (root / LOCK).write_text("12345")
    loading.embedded_gemma_dir(progress=False)
    assert (root / LOCK).read_text() == "12345"


# ------------------------------------------------------------------ 4. read-only / corrupted cache
def test_read_only_corrupted_cache_gives_a_clear_error(root, monkeypatch):
    with read_only_corrupted_cache(root, monkeypatch):
        with pytest.raises(ValueError, match="TREESPEC_CACHE") as info:
            loading.embedded_gemma_dir(progress=False)
        assert isinstance(info.value, loading.CacheError)
        assert str(root) in str(info.value)


# ------------------------------------------------------------------ 5. kill -9 at random points
@pytest.mark.faults
def test_kill9_during_conversion_loses_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(loading, "_convert_embedded_gemma", slow_stub)
    monkeypatch.setenv("TREESPEC_CACHE", str(tmp_path / "reference"))
    reference = _manifest(loading.embedded_gemma_dir(progress=False))
    outcomes = {"killed before done": 0, "finished before kill": 0}
    for seed in range(24):
        rng = random.Random(seed)
        root = tmp_path / f"trial{seed}"
        monkeypatch.setenv("TREESPEC_CACHE", str(root))
        pid = _fork(lambda: loading.embedded_gemma_dir(progress=False))
        time.sleep(rng.uniform(0.0, 0.12))
        os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
        killed = os.WIFSIGNALED(status)
        outcomes["killed before done" if killed else "finished before kill"] += 1
        cache = loading.embedded_gemma_dir(progress=False)
        assert _manifest(cache) == reference, f"seed {seed}"
        assert loading.cache_is_valid(cache)
        assert sorted(p.name for p in root.iterdir()) == sorted([LOCK, FINAL]), f"seed {seed}"
        assert sorted(p.name for p in cache.iterdir()) == sorted([*STUB_FILES, "treespec-manifest.json"])
    assert outcomes["killed before done"] >= 12, outcomes


@pytest.mark.faults
def test_two_processes_converting_at_once_convert_once(root, tmp_path, monkeypatch):
    log = tmp_path / "conversions.log"

    def counting_stub(out_dir, progress):
        with open(log, "a") as fh:
            fh.write(f"{os.getpid()}\n")
        slow_stub(out_dir, progress, pause=0.05)

    monkeypatch.setattr(loading, "_convert_embedded_gemma", counting_stub)
    pids = [_fork(lambda: loading.embedded_gemma_dir(progress=False)) for _ in range(2)]
    statuses = [os.waitpid(pid, 0)[1] for pid in pids]
    assert all(os.WIFEXITED(s) and os.WEXITSTATUS(s) == 0 for s in statuses), statuses
    assert len(log.read_text().split()) == 1
    assert loading.cache_is_valid(root / FINAL)
    assert sorted(p.name for p in root.iterdir()) == sorted([LOCK, FINAL])
