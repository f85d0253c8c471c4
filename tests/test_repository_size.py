"""The tracked files stay small enough to travel: the files git tracks add up to at most ``LIMIT_MIB``.

The GPU check (``benchmarks/device_check.py``, issue 46) runs on a machine that receives the working tree and
nothing else, up to 64 MiB with whatever the call carries; a checkout above that cannot be checked there at all.
Large records belong in compressed form (continuation chunks are ``.json.gz``) or in git history (a draft head
that is not shipped: ``git show COMMIT:PATH``), not in the tree.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LIMIT_MIB = 60  # of the 64 MiB that travel, 4 are left for carried files


def tracked_sizes(root: Path) -> dict[str, int]:
    """Bytes of every file git tracks under ``root`` (links counted as links; files deleted in the tree skipped)."""
    out = subprocess.run(["git", "-C", str(root), "ls-files", "-z"], capture_output=True, check=True).stdout
    sizes = {}
    for name in out.decode("utf-8", "surrogateescape").split("\0"):
        path = root / name
        if name and (path.is_symlink() or path.is_file()):
            sizes[name] = path.lstat().st_size
    return sizes


def over_limit(sizes: dict[str, int], limit_mib: float) -> str | None:
    """None when ``sizes`` add up to at most ``limit_mib``; else one line naming the total and the largest files."""
    total = sum(sizes.values())
    if total <= limit_mib * 2**20:
        return None
    largest = sorted(sizes.items(), key=lambda kv: -kv[1])[:5]
    return (f"tracked files add up to {total / 2**20:.1f} MiB, above {limit_mib} MiB; largest: "
            + ", ".join(f"{n} ({s / 2**20:.1f} MiB)" for n, s in largest))


def test_tracked_files_fit_the_device_machine():
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    problem = over_limit(tracked_sizes(ROOT), LIMIT_MIB)
    assert problem is None, problem


def test_the_limit_catches_a_large_file(tmp_path):
    """Twin: a repository whose one tracked file is larger than the limit fails it, by name."""
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / "big.bin").write_bytes(b"\0" * (2 << 20))
    (tmp_path / "small.txt").write_text("x")
    subprocess.run(["git", "-C", str(tmp_path), "add", "big.bin", "small.txt"], check=True)
    sizes = tracked_sizes(tmp_path)
    assert sizes == {"big.bin": 2 << 20, "small.txt": 1}
    assert over_limit(sizes, 3) is None
    problem = over_limit(sizes, 1)
    assert problem is not None and "big.bin (2.0 MiB)" in problem
