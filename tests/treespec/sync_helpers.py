"""Counting device -> host synchronisation points on the CPU (issue 46: device-clean hot paths).

On a CPU nothing ever waits, but the same Python code run on CUDA blocks the host at every point where
it needs a device value. :class:`SyncCounter` counts those points while a region runs:

* ``scalar``: every ``aten._local_scalar_dense`` (what ``.item()``, ``int(t)``, ``float(t)``, ``bool(t)``
  and ``if t:`` dispatch to) and ``aten.equal`` (``torch.equal`` returns a Python bool), seen by a
  :class:`~torch.utils._python_dispatch.TorchDispatchMode`;
* ``readback``: calls of ``Tensor.tolist``, ``Tensor.numpy``, ``Tensor.cpu`` and ``Tensor.to`` to the CPU
  (patched for the region: ``.tolist()`` on a CPU tensor never reaches the dispatcher; for ``.to`` see
  :func:`_to_cpu`);
* ``shape``: ops whose output size depends on the data (``nonzero``, ``masked_select``, ``unique``,
  indexing with a bool mask, ``repeat_interleave`` without ``output_size``): CUDA copies the size back.

``count.total`` is their sum. ``SyncCounter(stacks=True)`` also keeps, for each point, the innermost
frame under ``treespec/`` that caused it (``count.sites``: a ``Counter`` of ``"file:line func"``), to find them.

Not counted: host data uploaded to the device (``torch.tensor(list, device=...)``), which on CUDA waits for
the copy but not for queued kernels.
"""

from __future__ import annotations

import collections
import contextlib
import sys
import traceback

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_aten = torch.ops.aten
_SCALAR = {_aten._local_scalar_dense.default, _aten.equal.default}
_SHAPE = {_aten.nonzero.default, _aten.masked_select.default, _aten.nonzero_static.default,
          _aten._unique2.default, _aten.unique_dim.default, _aten.unique_consecutive.default}
_READBACK = ("tolist", "numpy", "cpu", "to")


def _is_bool_index(func, args) -> bool:
    """``x[mask]`` / ``x[mask] = v`` with a bool (or uint8) mask: the kernel turns it into nonzero."""
    if func not in (_aten.index.Tensor, _aten.index_put.default, _aten.index_put_.default,
                    _aten._index_put_impl_.default):
        return False
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in (args[1] or ()))


def _is_repeat_interleave_sized_on_host(func, args, kwargs) -> bool:
    return (func in (_aten.repeat_interleave.Tensor, _aten.repeat_interleave.self_Tensor)
            and kwargs.get("output_size") is None)


def _to_cpu(tensor: torch.Tensor, args, kwargs) -> bool:
    """Whether ``tensor.to(*args, **kwargs)`` reads a device tensor back to the host: the target device is the
    CPU and the tensor is not there, or the call names the CPU by the literal string ``"cpu"`` (code that means
    the host). ``.to(runner.device)`` on a CPU session is a no-op, as it is on CUDA: not counted."""
    target = kwargs.get("device")
    for a in args:
        if isinstance(a, (str, torch.device)):
            target = a
        elif isinstance(a, torch.Tensor):
            target = a.device
    if target is None or torch.device(target).type != "cpu":
        return False
    return tensor.device.type != "cpu" or isinstance(target, str)


class SyncCounter(TorchDispatchMode):
    """Context manager counting the host sync points of a region (see the module docstring)."""

    def __init__(self, stacks: bool = False) -> None:
        super().__init__()
        self.stacks = stacks
        self.kinds: collections.Counter = collections.Counter()
        self.sites: collections.Counter = collections.Counter()
        self._saved: dict[str, object] = {}
        self._inside = 0  # > 0 while a patched method runs (its own internals are not counted again)

    @property
    def total(self) -> int:
        return sum(self.kinds.values())

    def reset(self) -> None:
        self.kinds.clear()
        self.sites.clear()

    def _hit(self, kind: str) -> None:
        self.kinds[kind] += 1
        if self.stacks:
            self.sites[_site()] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self._inside:
            if func in _SCALAR:
                self._hit("scalar")
            elif func in _SHAPE or _is_bool_index(func, args) or _is_repeat_interleave_sized_on_host(func, args,
                                                                                                        kwargs):
                self._hit("shape")
        return func(*args, **kwargs)

    def _patch(self) -> None:
        for name in _READBACK:
            original = getattr(torch.Tensor, name)
            self._saved[name] = original
            setattr(torch.Tensor, name, self._counted(name, original))

    def _counted(self, name: str, original):
        counter = self

        def method(tensor, *args, **kwargs):
            if not counter._inside and (name != "to" or _to_cpu(tensor, args, kwargs)):
                counter._hit("readback")
            counter._inside += 1
            try:
                return original(tensor, *args, **kwargs)
            finally:
                counter._inside -= 1

        method.__name__ = name
        return method

    def __enter__(self):
        self._patch()
        try:
            return super().__enter__()
        except BaseException:
            self._unpatch()
            raise

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._unpatch()

    def _unpatch(self) -> None:
        for name, original in self._saved.items():
            setattr(torch.Tensor, name, original)
        self._saved.clear()


def _site() -> str:
    """The innermost frame in treespec's own code (else the innermost outside this module and torch)."""
    fallback = None
    for frame in reversed(traceback.extract_stack(sys._getframe(2))):
        path = frame.filename.replace("\\", "/")
        if "/treespec/" in path and "/tests/" not in path:
            return f"{path.split('/treespec/')[-1]}:{frame.lineno} {frame.name}"
        if fallback is None and "/torch/" not in path and not path.endswith("sync_helpers.py"):
            fallback = f"{path.rsplit('/', 1)[-1]}:{frame.lineno} {frame.name}"
    return fallback or "?"


@contextlib.contextmanager
def count_syncs(stacks: bool = False):
    """``with count_syncs() as c: ...`` then ``c.total`` (a :class:`SyncCounter`)."""
    counter = SyncCounter(stacks=stacks)
    with counter:
        yield counter
