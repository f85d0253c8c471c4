"""A KV cache that grows in place and rolls back to an accepted tree path by index selection.

Each layer keeps preallocated key/value buffers ``[batch, kv_heads, capacity, head_dim]`` that grow
geometrically; a forward writes its new entries in place (no concatenation of the whole cache
per step), and :meth:`TreeKVCache.keep` moves the accepted entries down next to the committed
prefix, touching only the uncommitted tail. Every layer is a full-attention layer as far as the
cache is concerned: sliding windows are enforced by the masks.
"""

from __future__ import annotations

import functools
import inspect

import torch
from transformers.cache_utils import Cache, DynamicLayer


class TreeKVLayer(DynamicLayer):
    """One layer's keys and values in a growable buffer; ``keys``/``values`` are views of the filled part."""

    def __init__(self) -> None:
        super().__init__()
        self._k: torch.Tensor | None = None
        self._v: torch.Tensor | None = None
        self._len = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self._k = key_states.new_empty((*key_states.shape[:2], 0, key_states.shape[3]))
        self._v = value_states.new_empty((*value_states.shape[:2], 0, value_states.shape[3]))
        self.is_initialized = True

    # the filled part, as HF code expects it
    @property
    def keys(self) -> torch.Tensor:
        return self._k[:, :, : self._len]

    @keys.setter
    def keys(self, value: torch.Tensor) -> None:  # HF's reset/reorder paths assign whole tensors
        if value is None or value.ndim != 4:
            return
        self._k, self._len = value.contiguous(), value.shape[2]

    @property
    def values(self) -> torch.Tensor:
        return self._v[:, :, : self._len]

    @values.setter
    def values(self, value: torch.Tensor) -> None:
        if value is None or value.ndim != 4:
            return
        self._v = value.contiguous()

    def _reserve(self, needed: int) -> None:
        capacity = self._k.shape[2]
        if needed <= capacity:
            return
        new_capacity = max(needed, 2 * capacity, 256)
        for name in ("_k", "_v"):
            old = getattr(self, name)
            buf = old.new_empty((*old.shape[:2], new_capacity, old.shape[3]))
            buf[:, :, : self._len] = old[:, :, : self._len]
            setattr(self, name, buf)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = key_states.shape[2]
        self._reserve(self._len + n)
        self._k[:, :, self._len: self._len + n] = key_states
        self._v[:, :, self._len: self._len + n] = value_states
        self._len += n
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self._len

    def keep(self, prefix: int, slots: torch.Tensor) -> None:
        """Keep entries ``[0, prefix)`` and then ``slots`` (ascending, all >= prefix); drop the rest."""
        a = slots.numel()
        if a:
            self._k[:, :, prefix: prefix + a] = self._k[:, :, slots]  # advanced indexing copies first
            self._v[:, :, prefix: prefix + a] = self._v[:, :, slots]
        self._len = prefix + a


class TreeKVCache(Cache):
    """A cache of :class:`TreeKVLayer` s (created lazily, one per model layer)."""

    def __init__(self) -> None:
        super().__init__(layer_class_to_replicate=TreeKVLayer)

    def keep(self, prefix: int, slots: torch.Tensor) -> None:
        for layer in self.layers:
            layer.keep(prefix, slots)


@functools.lru_cache(maxsize=None)
def _cache_keyword(forward_type: type) -> str:
    params = inspect.signature(forward_type.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def output_cache(output) -> Cache:
    """The cache a transformers model's output carries: ``output.cache`` in newer releases (where
    ``past_key_values`` is a deprecated alias), ``output.past_key_values`` in older ones."""
    cache = getattr(output, "cache", None)
    return cache if cache is not None else output.past_key_values


def cache_kwargs(module: torch.nn.Module, cache: Cache) -> dict[str, Cache]:
    """``{keyword: cache}`` for a transformers model's ``forward``: newer transformers take the cache as
    ``cache`` (``past_key_values`` is deprecated there and removed in 5.40), older releases of the range
    treespec allows only as ``past_key_values``. Read from the signature, once per model class."""
    return {_cache_keyword(type(module)): cache}
