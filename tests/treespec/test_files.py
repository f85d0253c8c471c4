"""treespec.files: atomic writes keep the old content on failure and on kill -9, and leave no
temporaries behind (a killed writer's temporary is removed once its process is gone)."""

import os
import signal
import subprocess
import sys

import pytest

from treespec import files


def _dead_pid():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_atomic_write_text_and_json(tmp_path):
    files.atomic_write_text(tmp_path / "a.txt", "hello")
    files.atomic_write_json(tmp_path / "b.json", {"x": 1})
    assert (tmp_path / "a.txt").read_text() == "hello"
    assert (tmp_path / "b.json").read_text() == '{\n "x": 1\n}'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "b.json"]


@pytest.mark.parametrize("existed", [True, False])
def test_failed_write_keeps_old_content_and_removes_temporary(tmp_path, existed):
    target = tmp_path / "result.txt"
    if existed:
        target.write_text("old")

    def half_then_fail(tmp):
        tmp.write_text("half of the new con")
        raise RuntimeError("writer crashed")

    with pytest.raises(RuntimeError, match="writer crashed"):
        files.atomic_write(target, half_then_fail)
    assert (target.read_text() == "old") if existed else not target.exists()
    assert [p.name for p in tmp_path.iterdir()] == (["result.txt"] if existed else [])


def test_stale_temporaries_of_dead_pids_removed_live_kept(tmp_path):
    dead = tmp_path / f".x.json.tmp{_dead_pid()}"
    mine = tmp_path / f".y.json.tmp{os.getpid()}"
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        live = tmp_path / f".z.json.tmp{sleeper.pid}"
        unrelated = tmp_path / "notes.tmp123"
        for p in (dead, mine, live, unrelated):
            p.write_text("x")
        assert files.remove_stale_temporaries(tmp_path) == [dead]
        assert not dead.exists() and mine.exists() and live.exists() and unrelated.exists()
    finally:
        sleeper.kill()
        sleeper.wait()
    assert files.remove_stale_temporaries(tmp_path / "missing") == []


def test_kill9_during_write_leaves_old_file_intact(tmp_path):
    target = tmp_path / "weights.bin"
    target.write_bytes(b"old complete content")
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: write half of the new file, tell the parent, then hang
        try:
            os.close(read_fd)

            def slow(tmp):
                with open(tmp, "wb") as fh:
                    fh.write(b"NEW" * 1000)
                    fh.flush()
                    os.write(write_fd, b"1")
                    signal.pause()

            files.atomic_write(target, slow)
        finally:
            os._exit(1)
    try:
        os.close(write_fd)
        assert os.read(read_fd, 1) == b"1"
        os.close(read_fd)
    finally:  # never leave the hanging child behind, whatever the assertions say
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    leftover = tmp_path / f".weights.bin.tmp{pid}"
    assert leftover.exists()
    assert target.read_bytes() == b"old complete content"
    assert files.remove_stale_temporaries(tmp_path) == [leftover]
    assert [p.name for p in tmp_path.iterdir()] == ["weights.bin"]
