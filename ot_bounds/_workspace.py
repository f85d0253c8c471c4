"""Scratch buffers reused across calls by the full-vocabulary passes of the exact bounds.

A fresh multi-megabyte numpy array costs one page fault per 4 KiB page the first time it is
written, and the C allocator hands freed heap memory back to the kernel between calls, so every
call pays them again: at V = 262,144, before these buffers, one ``optimal_acceptance`` call
without replacement (n = 3) touched ~8,500 fresh pages, about a third of its run time on the
benchmark machine. The hot paths therefore write their full-length intermediates into buffers
kept per thread (``threading.local``) and reused. Arrays handed back to the caller never live
in them; views of them are valid until the next call on the same thread.

Memory held: a few dozen bytes per vocabulary entry (~20 MB per thread at V = 262,144);
:func:`release_workspace` frees it.
"""

from __future__ import annotations

import threading

import numpy as np
from numpy.typing import DTypeLike, NDArray

_local = threading.local()


class Workspace:
    """Named scratch buffers that grow on demand and are never shrunk (see the module docs)."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, np.dtype], np.ndarray] = {}
        self._arange = np.zeros(0, dtype=np.int64)

    def take(self, name: str, size: int, dtype: DTypeLike = np.float64) -> NDArray:
        """Uninitialised buffer of ``size`` elements reserved under ``name``.

        Two live intermediates must use two names: taking a name again reuses its memory.
        """
        key = (name, np.dtype(dtype))
        buf = self._buffers.get(key)
        if buf is None or buf.size < size:
            buf = np.empty(size, dtype=key[1])
            self._buffers[key] = buf
        return buf[:size]

    def arange(self, size: int) -> NDArray[np.int64]:
        """Read-only ``np.arange(size)`` (int64), built once."""
        if self._arange.size < size:
            self._arange = np.arange(size, dtype=np.int64)
            self._arange.flags.writeable = False
        return self._arange[:size]


def workspace() -> Workspace:
    """This thread's workspace."""
    ws = getattr(_local, "workspace", None)
    if ws is None:
        ws = _local.workspace = Workspace()
    return ws


def release_workspace() -> None:
    """Free this thread's scratch buffers (they are rebuilt on the next call that needs them)."""
    _local.workspace = None
