"""Large CPU buffers served from the heap, not from fresh ``mmap`` calls (Linux, glibc).

glibc's ``malloc`` serves a request above its mmap threshold (adjusted at run time, at most
32 MiB on 64-bit Linux) with a fresh ``mmap`` and unmaps it on ``free``; the next request of that
size maps new pages, and the kernel zero-fills each 4 KiB page on first touch. A target pass over
a 32-node tree makes float32 logits of 32 x 262,144 x 4 B = 33.5 MB for Gemma-3's vocabulary (and
the probabilities at T > 0 as many again), so from 32 nodes on every pass paid that page-fault
toll. Measured on an AMD EPYC with avx512_bf16 (bf16 fast runner, 2 threads, 15 interleaved
rounds): t(32) = 4.43 t(1) before (benchmarks/results/profile/2026-11-26-4dba31b-epyc-bf16-verify)
and 2.50 t(1) with the setting below (.../2026-11-26-e7337b7-epyc-bf16-verify).

:func:`keep_large_allocations` raises the mmap threshold (which also stops its run-time
adjustment) and the trim threshold, so freed large blocks stay in the heap and are reused. The
price is resident memory: the process keeps its peak heap instead of returning it to the kernel.
It changes process-wide ``malloc`` settings; the fast runner applies it on CPU (once a process),
and any process can call it (or set ``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_``). A process
that must return freed memory to the system (a long-lived server sharing its host) opts out with
``TREESPEC_KEEP_LARGE_ALLOCATIONS=0``. A glibc that refuses the threshold (older releases cap it at
32 MiB) is left as it was.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

# mallopt parameters (glibc's malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

#: requests up to this size come from the heap once :func:`keep_large_allocations` ran (1 GiB:
#: above any logits or probability tensor of a tree pass on the embedded model)
MMAP_THRESHOLD = 1 << 30

_applied: bool | None = None


def _libc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    if not hasattr(libc, "mallopt") or not hasattr(libc, "gnu_get_libc_version"):
        return None  # not glibc (musl has no mallopt tuning of this kind)
    return libc


def keep_large_allocations(threshold: int = MMAP_THRESHOLD) -> bool:
    """Serve allocations up to ``threshold`` bytes from the heap and keep freed memory there.

    Returns True when the setting is in force (glibc on Linux), False where it does not apply
    (another platform or C library, a glibc that refuses the threshold, or
    ``TREESPEC_KEEP_LARGE_ALLOCATIONS=0``). Idempotent: the first call decides; later calls return
    its answer. ``threshold`` must be positive and fit a C ``int``.
    """
    global _applied
    if not 0 < threshold < 2**31:
        raise ValueError(f"threshold must be in (0, 2**31) bytes, got {threshold}")
    if _applied is not None:
        return _applied
    libc = _libc()
    if libc is None or os.environ.get("TREESPEC_KEEP_LARGE_ALLOCATIONS", "1") == "0":
        _applied = False
        return False
    # the trim threshold only once the mmap threshold is taken: a refused call leaves malloc as it was
    _applied = bool(libc.mallopt(_M_MMAP_THRESHOLD, ctypes.c_int(threshold))) and bool(
        libc.mallopt(_M_TRIM_THRESHOLD, ctypes.c_int(2**31 - 1)))
    return _applied


__all__ = ["MMAP_THRESHOLD", "keep_large_allocations"]
