"""The manager's answers about where pages live: cache and buffer groups, each buffer's
pool, base address, page stride, page region and page-index converter, and the GPU pool
groups. Attention kernels and engines read these once at start-up; they change nothing.
Mixed into :class:`~kvcm_core.manager.KVCacheManager`, which owns the objects they read
(``registry``, ``layout``, ``storage_levels``, ``life_cycles``, ``config``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from kvcm_core.backend import PageRegion
from kvcm_core.config import KVCacheManagerConfig
from kvcm_core.context import CacheContext
from kvcm_core.layout import BufferAttr, PageIndexConverter, StorageLayout
from kvcm_core.levels import Levels
from kvcm_core.lifecycle import LifeCycle, LifeCycleRegistry
from kvcm_core.tier import DevicePool
from kvcm_core.types import CacheGroupId

__all__ = ["LayoutQueries"]


class LayoutQueries:
    """Read-only queries of the storage layout (see the module's docstring)."""

    config: KVCacheManagerConfig
    registry: LifeCycleRegistry
    layout: StorageLayout
    storage_levels: Levels
    life_cycles: tuple[LifeCycle, ...]
    _ctx: CacheContext

    @property
    def num_cache_groups(self) -> int:
        return len(self.life_cycles)

    def get_layer_group_id(self, layer_id: int) -> CacheGroupId:
        """The cache group of a layer whose buffers all share one (ConfigError if split)."""
        return self.registry.get_layer_group_id(layer_id)

    @property
    def layer_grouping(self) -> Mapping[int, CacheGroupId]:
        return self.registry.layer_grouping

    def get_buffer_group_id(self, layer_id: int, role: str) -> CacheGroupId:
        return self.registry.get_buffer_group_id(layer_id, role)

    @property
    def buffer_grouping(self) -> Mapping[tuple[int, str], CacheGroupId]:
        return self.registry.buffer_grouping

    def buffer_attr(self, layer_id: int, role: str) -> BufferAttr:
        """Where a buffer lives (:class:`~kvcm_core.layout.BufferAttr`)."""
        self.registry.get_buffer_group_id(layer_id, role)
        return self.layout.buffer_attrs[(layer_id, role)]

    def _pool(self, layer_id: int, role: str) -> tuple[DevicePool, BufferAttr]:
        attr = self.buffer_attr(layer_id, role)
        pool = self.storage_levels.stores[0][attr.pool_group].pools[attr.pool]
        assert isinstance(pool, DevicePool)
        return pool, attr

    def get_mem_pool_base_address(self, layer_id: int, role: str) -> int:
        """Address of this buffer's page for slot 0: the page of slot ``s`` is at
        ``base + s * get_page_stride(layer_id, role)``."""
        pool, attr = self._pool(layer_id, role)
        return pool.base_address + attr.offset

    def get_page_stride(self, layer_id: int, role: str) -> int:
        """Bytes between the pages of consecutive slots (the pool's slot size)."""
        pool, _ = self._pool(layer_id, role)
        return pool.slot_bytes

    def get_page_region(self, layer_id: int, role: str) -> PageRegion:
        """The buffer's pages as a region of the pool's buffer (page ``s`` = slot ``s``)."""
        pool, attr = self._pool(layer_id, role)
        return PageRegion(pool.buffer, attr.offset, pool.slot_bytes)

    def get_page_index_converter(self, layer_id: int, role: str) -> PageIndexConverter:
        """``(scale, offset, expansion)`` of a buffer's page indices, and, for buffers of an
        SWA scratch group, ``scratch_pages_per_block`` (``convert`` maps scratch blocks)."""
        group = self.registry.get_buffer_group_id(layer_id, role)
        conv = self.layout.converter((layer_id, role))
        if group in self._ctx.scratch_scales:
            assert self.config.swa_scratch is not None
            conv = attrs.evolve(conv, scratch_pages_per_block=(
                self.config.swa_scratch.scratch_pages_per_block))
        return conv

    @property
    def pool_group_descs(self) -> list[dict[str, Any]]:
        """One description per GPU pool group: policy, slot sizes, slots, life cycles."""
        out = []
        for pg, store in zip(self.layout.pool_groups, self.storage_levels.stores[0], strict=True):
            out.append({
                "id": pg.id, "policy": pg.policy.name, "slot_sizes": list(pg.slot_sizes),
                "sparse": pg.sparse, "num_slots": store.num_slots,
                "cache_groups": list(pg.life_cycles),
                "life_cycles": [self.life_cycles[g].describe() for g in pg.life_cycles],
            })
        return out
