"""keep_large_allocations: a large tensor comes from the heap, not from a fresh mmap (glibc).

Measured without timing: glibc's ``mallinfo2().hblkhd`` counts the bytes held in mmapped blocks.
Each check runs in a fresh interpreter (the setting is process-wide). The twin without the call
shows glibc's default: the same tensor is an mmapped block, so the check can fail.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from treespec.models.fast import allocator

_LIBC = allocator._libc()
pytestmark = pytest.mark.skipif(_LIBC is None or not hasattr(_LIBC, "mallinfo2"),
                                reason="glibc >= 2.33 on Linux only (mallinfo2)")

PROBE = """
import ctypes, sys
import torch
from treespec.models.fast.allocator import keep_large_allocations


class Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Mallinfo2
if sys.argv[1] == "keep":
    if not keep_large_allocations():
        print("refused")  # a glibc that caps the threshold: nothing to measure
        sys.exit(0)
    assert keep_large_allocations() is True  # idempotent
before = libc.mallinfo2().hblkhd
x = torch.empty(48 * 262144, dtype=torch.float32)  # the float32 logits of a 48-node tree: 50 MB
x.fill_(1.0)
print(libc.mallinfo2().hblkhd - before)
"""


def _mmapped_growth(mode: str, env: dict | None = None) -> int:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=120,
                         env=env)
    assert out.returncode == 0, out.stderr
    last = out.stdout.strip().splitlines()[-1]
    if last == "refused":
        pytest.skip("this glibc refuses a 1 GiB mmap threshold")
    return int(last)


def test_large_tensor_comes_from_the_heap():
    assert _mmapped_growth("keep") < 1 << 20


def test_twin_without_the_setting_maps_the_tensor():
    assert _mmapped_growth("default") >= 48 * 262144 * 4


def test_opt_out_leaves_malloc_alone():
    """TREESPEC_KEEP_LARGE_ALLOCATIONS=0: the call declines and the tensor is mmapped as by default."""
    import os

    env = dict(os.environ, TREESPEC_KEEP_LARGE_ALLOCATIONS="0")
    out = subprocess.run([sys.executable, "-c", PROBE.replace('if sys.argv[1] == "keep":',
                                                               'assert keep_large_allocations() is False\nif False:'),
                          "keep"], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout.strip().splitlines()[-1]) >= 48 * 262144 * 4


def test_threshold_is_validated():
    for applied in (None, True, False):  # checked before the first call's answer is reused
        saved = allocator._applied
        allocator._applied = applied
        try:
            with pytest.raises(ValueError, match="threshold"):
                allocator.keep_large_allocations(0)
            with pytest.raises(ValueError, match="threshold"):
                allocator.keep_large_allocations(2**31)
        finally:
            allocator._applied = saved
