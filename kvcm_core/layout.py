"""Storage layout: coalesced buffers, pools, pool groups and buffer places.

Within one life cycle, buffers of equal page size are coalesced: one slot of a pool holds
the pages of all of them for one block, contiguously. The pools of a life cycle form its
pool layout; life cycles whose layouts share the key ``(pool_reuse_policy(policy), slot
sizes, sparse)`` share one pool group on the GPU level, and one slot id indexes the same
block in every pool of the group.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from fractions import Fraction
from typing import Any

import attrs
import numpy as np

from kvcm_core.codec import BufferPlace, PageLayout
from kvcm_core.errors import ConfigError
from kvcm_core.lifecycle import BufferKey, LifeCycleRegistry
from kvcm_core.types import CacheGroupId, PoolGroupId, ReusePolicy, pool_reuse_policy

__all__ = ["BufferAttr", "PageIndexConverter", "PoolGroupLayout", "StorageLayout"]


@attrs.frozen
class BufferAttr:
    """Where a buffer lives: its cache group, pool group, pool, offset in the slot, size."""

    group: CacheGroupId
    pool_group: PoolGroupId
    pool: int
    offset: int
    size: int


@attrs.frozen
class PageIndexConverter:
    """Slot id to a buffer's page index: ``index = slot * scale + offset (+ e < expansion)``.

    In the SHARED index space a pool is an array of pages of the buffer's size starting at
    the pool's base, so ``scale = slot_bytes // size`` and ``offset = offset_in_slot //
    size``. ``BAD_PAGE_INDEX`` stays as it is. Blocks of an SWA scratch range map into
    their scratch slots' sub-pages (:meth:`convert`, :mod:`kvcm_core.scratch`).
    """

    scale: int
    offset: int
    expansion: int = 1
    #: SWA scratch: sub-pages per scratch block (0: the buffer's group has no scratch).
    scratch_pages_per_block: int = 0

    def convert(self, base: Any, scratch: Any = None, backend: Any = None,
                stream: Any = None) -> np.ndarray:
        """Page indices of this buffer for a base page table (int32, last axis blocks).

        Ordinary blocks: ``slot * scale + offset``; the blocks of ``scratch`` (a
        :class:`~kvcm_core.scratch.ScratchDesc` from ``cache.scratch(group)``): their
        rotated index in the scratch slots; ``BAD_PAGE_INDEX`` stays as it is. Runs
        ``backend.convert_page_indices`` (on ``stream``) when a kernel backend is given,
        else its NumPy reference; see :func:`kvcm_core.scratch.convert_with_scratch`.
        """
        from kvcm_core.scratch import convert_with_scratch

        return convert_with_scratch(base, self.scale, self.offset, self.expansion,
                                    self.scratch_pages_per_block, scratch, backend, stream)


@attrs.frozen
class PoolGroupLayout:
    """One GPU pool group.

    Attributes:
        id: pool group id.
        policy: the pool policy (SINK_REQUIRED_ONLY pooled as REQUIRED).
        slot_sizes: bytes per slot of each pool.
        sparse: pools of sparse buffers (host-backed on level 0).
        life_cycles: cache groups that draw slots from it.
        places: where each buffer of those life cycles lies.
    """

    id: PoolGroupId
    policy: ReusePolicy
    slot_sizes: tuple[int, ...]
    sparse: bool
    life_cycles: tuple[CacheGroupId, ...]
    places: dict[BufferKey, BufferPlace]

    @property
    def page_bytes(self) -> int:
        return sum(self.slot_sizes)

    def page_layout(self, group: CacheGroupId | None = None) -> PageLayout:
        """The layout a page codec sees (the buffers of one life cycle, or all)."""
        return PageLayout(self.slot_sizes, tuple(self.places.values()))


def _coalesce(members: Sequence[tuple[int, str, int]],
              types: Mapping[BufferKey, tuple[str, int, bool]]) -> tuple[tuple[int, ...], dict]:
    """Slot sizes (pools by buffer size, largest first) and each buffer's place (with its
    element type, scale group and exactness, for page codecs)."""
    by_size: dict[int, list[tuple[int, str]]] = {}
    for layer_id, role, size in members:
        by_size.setdefault(size, []).append((layer_id, role))
    slot_sizes = []
    places: dict[BufferKey, BufferPlace] = {}
    for pool, size in enumerate(sorted(by_size, reverse=True)):
        bufs = by_size[size]
        slot_sizes.append(size * len(bufs))
        for k, (layer_id, role) in enumerate(bufs):
            dtype, group_size, exact = types.get((layer_id, role), ("bytes", 128, True))
            places[(layer_id, role)] = BufferPlace(layer_id, role, pool, k * size, size,
                                                   dtype, group_size, exact)
    return tuple(slot_sizes), places


class StorageLayout:
    """The GPU pool groups of a model and each buffer's :class:`BufferAttr`."""

    def __init__(self, registry: LifeCycleRegistry) -> None:
        keyed: dict[tuple, list[CacheGroupId]] = {}
        layouts: dict[CacheGroupId, tuple[tuple[int, ...], dict]] = {}
        for gid, lc in enumerate(registry.life_cycles):
            group = CacheGroupId(gid)
            slot_sizes, lc_places = _coalesce(registry.members[group], registry.buffer_types)
            layouts[group] = (slot_sizes, lc_places)
            key = (pool_reuse_policy(lc.policy), slot_sizes, lc.sparse)
            keyed.setdefault(key, []).append(group)
        self.pool_groups: list[PoolGroupLayout] = []
        self.group_to_pool_group: dict[CacheGroupId, PoolGroupId] = {}
        self.buffer_attrs: dict[BufferKey, BufferAttr] = {}
        for pgid, (key, groups) in enumerate(keyed.items()):
            policy, slot_sizes, sparse = key
            places: dict[BufferKey, BufferPlace] = {}
            for group in groups:
                places.update(layouts[group][1])
                self.group_to_pool_group[group] = PoolGroupId(pgid)
                for bkey, place in layouts[group][1].items():
                    self.buffer_attrs[bkey] = BufferAttr(
                        group, PoolGroupId(pgid), place.pool, place.offset, place.size
                    )
            self.pool_groups.append(
                PoolGroupLayout(PoolGroupId(pgid), policy, slot_sizes, sparse,
                                tuple(groups), places)
            )

    def converter(self, key: BufferKey) -> PageIndexConverter:
        attr = self.buffer_attrs[key]
        slot_bytes = self.pool_groups[attr.pool_group].slot_sizes[attr.pool]
        return PageIndexConverter(slot_bytes // attr.size, attr.offset // attr.size)

    def split_quota(
        self, quota: int, ratios: Sequence[float] | None, level: int = 0,
        groups: Sequence[int] | None = None, field: str | None = None,
    ) -> list[int]:
        """Slots per pool group for a level quota.

        By default every life cycle gets the same number of slots (the share of a pool group
        is its bytes per slot times its number of life cycles); ``ratios`` override the
        shares, one per pool group. ``groups`` splits among those pool groups only.
        ``field``: the configuration field a quota too small is blamed on (default: the
        level's quota).
        """
        pgs = self.pool_groups if groups is None else [self.pool_groups[g] for g in groups]
        # Exact shares (Fractions): a float product of a large quota and a large ratio
        # would overflow (1e308 is a finite ratio), and rounding would shift slots.
        weights: list[Fraction]
        if ratios is None:
            weights = [Fraction(pg.page_bytes * len(pg.life_cycles)) for pg in pgs]
        else:
            if len(ratios) != len(pgs):
                raise ConfigError(
                    "pool_group_ratios", tuple(ratios),
                    f"needs one ratio per pool group ({len(pgs)}: see pool_group_descs)",
                )
            weights = [Fraction(r) for r in ratios]
        total = sum(weights, Fraction(0))
        slots = [int(quota * w / total) // pg.page_bytes for w, pg in zip(weights, pgs,
                                                                          strict=True)]
        for pg, n in zip(pgs, slots, strict=True):
            if n < 1:
                raise ConfigError(
                    field or f"levels[{level}].quota", quota,
                    f"too small: pool group {pg.id} ({pg.page_bytes} bytes per block) gets "
                    "no slot",
                )
        return slots
