"""A preallocated KV cache indexed by cache slot, for the lean forwards (gpt-fast style).

One buffer per kind ``[layers, kv_heads, capacity, head_dim]`` holds every layer; a forward writes
its new entries at slots ``[used, used + q)`` in place, a commit moves the accepted entries down
next to the committed prefix (one index copy for all layers at once) and rejected slots are simply
overwritten by the next forward. The buffers survive :meth:`StaticKVCache.clear` (a new request
reuses them); they only grow (doubling) when a sequence outgrows them. Sliding windows live in the
masks, so every layer keeps all its keys.

:meth:`StaticKVCache.as_tree_cache` exposes the buffers as a
:class:`~treespec.models.kv_cache.TreeKVCache` of views (no copy), for code written against the
eager runner's cache (tests comparing caches, the early-exit draft sharing the target's cache).
"""

from __future__ import annotations

import torch

from ..kv_cache import TreeKVCache, TreeKVLayer


class StaticKVCache:
    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, capacity: int = 1024, max_capacity: int | None = None) -> None:
        self.shape = (num_layers, kv_heads, head_dim)
        self.dtype, self.device = dtype, device
        self.max_capacity = max_capacity
        self.k = self.v = None
        self.positions = None  # [capacity] long: position of the token in each slot
        self.used = 0  # filled slots (committed prefix + uncommitted tree nodes)
        self._allocate(capacity)

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    def _allocate(self, capacity: int) -> None:
        if self.max_capacity is not None:
            capacity = max(min(capacity, self.max_capacity), 1)
        layers, heads, dim = self.shape
        k = torch.zeros((layers, heads, capacity, dim), dtype=self.dtype, device=self.device)
        v = torch.zeros_like(k)
        pos = torch.zeros(capacity, dtype=torch.long, device=self.device)
        if self.k is not None and self.used:
            k[:, :, : self.used] = self.k[:, :, : self.used]
            v[:, :, : self.used] = self.v[:, :, : self.used]
            pos[: self.used] = self.positions[: self.used]
        self.k, self.v, self.positions = k, v, pos

    def reserve(self, needed: int) -> None:
        """Make room for ``needed`` slots (rare: doubles the buffers, keeping the filled part)."""
        if needed > self.capacity:
            if self.max_capacity is not None and needed > self.max_capacity:
                raise RuntimeError(f"KV cache overflow: {needed} slots needed, at most {self.max_capacity}")
            self._allocate(max(needed, 2 * self.capacity))

    def clear(self) -> None:
        self.used = 0

    def keep(self, prefix: int, slots: torch.Tensor) -> None:
        """Keep slots ``[0, prefix)`` then ``slots`` (ascending, all >= prefix); drop the rest."""
        a = slots.numel()
        if a:
            self.k[:, :, prefix: prefix + a] = self.k[:, :, slots]  # advanced indexing copies first
            self.v[:, :, prefix: prefix + a] = self.v[:, :, slots]
            self.positions[prefix: prefix + a] = self.positions[slots]
        self.used = prefix + a

    def as_tree_cache(self) -> TreeKVCache:
        """The filled part as a :class:`TreeKVCache` of per-layer views ``[1, kv_heads, capacity, dim]``."""
        cache = TreeKVCache()
        for i in range(self.shape[0]):
            layer = TreeKVLayer()
            layer.dtype, layer.device, layer.is_initialized = self.dtype, self.device, True
            layer._k, layer._v, layer._len = self.k[i][None], self.v[i][None], self.used
            cache.layers.append(layer)
        return cache
