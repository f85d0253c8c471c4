"""treespec.files: atomic writes keep the old content on failure and on kill -9, and leave no
temporaries behind (a killed writer's temporary is removed once its process is gone)."""

import os
import re
import signal
import stat
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
    [leftover] = [p for p in tmp_path.iterdir() if p.name.startswith(f".weights.bin.tmp{pid}-")]
    assert target.read_bytes() == b"old complete content"
    assert files.remove_stale_temporaries(tmp_path) == [leftover]
    assert [p.name for p in tmp_path.iterdir()] == ["weights.bin"]


def test_stale_temporaries_of_both_namings_are_removed(tmp_path):
    """Leftovers of dead writers are removed whether named ``.NAME.tmpPID-RANDOM`` or, by writers before
    the random part, ``.NAME.tmpPID``; a live writer's are kept in both namings."""
    dead = _dead_pid()
    old, new = tmp_path / f".a.json.tmp{dead}", tmp_path / f".b.json.tmp{dead}-0123456789abcdef"
    live_old, live_new = tmp_path / f".c.json.tmp{os.getpid()}", tmp_path / f".d.json.tmp{os.getpid()}-00ff"
    for p in (old, new, live_old, live_new):
        p.write_text("x")
    assert sorted(files.remove_stale_temporaries(tmp_path)) == sorted([old, new])
    assert live_old.exists() and live_new.exists()


def test_temporary_names_are_unpredictable_and_in_the_same_folder(tmp_path):
    seen = []

    def record(tmp):
        seen.append(tmp)
        assert tmp.exists() and not tmp.is_symlink()  # created exclusively before ``write`` runs
        tmp.write_text("content")

    for _ in range(3):
        files.atomic_write(tmp_path / "out.json", record)
    assert len(set(seen)) == 3 and all(p.parent == tmp_path for p in seen)
    assert all(re.fullmatch(rf"\.out\.json\.tmp{os.getpid()}-[0-9a-f]{{16}}", p.name) for p in seen), seen
    assert [p.name for p in tmp_path.iterdir()] == ["out.json"]


def _planted_links(folder, name, victim):
    """A symbolic link to ``victim`` at every name the old scheme (``.NAME.tmpPID``) would write to: this
    process's id and its parent's (a forked writer), and a dangling one for the next ids."""
    pids = {os.getpid(), os.getppid(), *range(os.getpid() + 1, os.getpid() + 4)}
    links = [folder / f".{name}.tmp{pid}" for pid in pids]
    for link in links:
        link.symlink_to(victim)
    return links


@pytest.mark.parametrize("existed", [True, False])
def test_a_planted_symlink_is_never_written_through(tmp_path, existed):
    folder, outside = tmp_path / "results", tmp_path / "outside"
    folder.mkdir()
    outside.mkdir()
    victim = outside / "precious.txt"
    victim.write_text("do not touch")
    target = folder / "summary.json"
    if existed:
        target.write_text("old")
    links = _planted_links(folder, target.name, victim)
    files.atomic_write_json(target, {"new": True})
    assert victim.read_text() == "do not touch"
    assert stat.S_ISREG(os.lstat(target).st_mode) and not target.is_symlink()
    assert target.read_text() == '{\n "new": true\n}'
    assert all(link.is_symlink() and os.readlink(link) == str(victim) for link in links)


def test_a_temporary_swapped_for_a_link_is_not_moved_into_place(tmp_path):
    """Should a writer's temporary become a symbolic link before the rename, the target stays as it was."""
    victim = tmp_path / "precious.txt"
    victim.write_text("do not touch")
    target = tmp_path / "out.txt"
    target.write_text("old")

    def swap(tmp):
        tmp.unlink()
        tmp.symlink_to(victim)

    with pytest.raises(OSError, match="regular file"):
        files.atomic_write(target, swap)
    assert target.read_text() == "old" and not target.is_symlink() and victim.read_text() == "do not touch"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.txt", "precious.txt"]
