"""The KV-cache manager: levels, pools, the prefix tree and every request's cache.

One scheduler thread drives a manager (not thread safe by design: it is on the engine's
per-step path); several managers may live in one process. Statistics may be read from
other threads.
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import numpy as np

from kvcm_core.backend import CopyTask, KernelBackend, PageRegion, Stream
from kvcm_core.codec import PageCodec
from kvcm_core.config import KVCacheManagerConfig
from kvcm_core.errors import ConfigError, InvalidStateError, OutOfPagesError, TierIOError
from kvcm_core.events import BlockEvent, EventKind
from kvcm_core.layout import BufferAttr, PageIndexConverter, StorageLayout
from kvcm_core.lifecycle import LifeCycleRegistry
from kvcm_core.matching import Match, match_prefix
from kvcm_core.migration import Mover
from kvcm_core.plugins import KvcmPluginManager, get_plugin_manager
from kvcm_core.radix import Node, PrefixTree, scope_root_key
from kvcm_core.records import CodecKind, Medium
from kvcm_core.scratch import max_scratch_blocks, validate_scratch_layout
from kvcm_core.stats import IterationStats
from kvcm_core.storage import Page, PoolGroupStore, StorageStatistics
from kvcm_core.tier import DevicePool
from kvcm_core.types import CacheGroupId, ReuseScope, pool_reuse_policy

__all__ = ["KVCacheManager"]

_EVENT_BATCH = 256


class KVCacheManager:
    """Manages the paged KV cache of every running request.

    Args:
        config: the configuration (see :class:`~kvcm_core.KVCacheManagerConfig`).
        plugin_manager: where plugins are looked up (default: the process-wide one).
    """

    def __init__(
        self, config: KVCacheManagerConfig, *, plugin_manager: KvcmPluginManager | None = None
    ) -> None:
        if not isinstance(config, KVCacheManagerConfig):
            raise ConfigError("config", type(config).__name__, "must be a KVCacheManagerConfig")
        pm = plugin_manager or get_plugin_manager()
        self.config = config
        self.tokens_per_block = config.tokens_per_block
        backend_spec = pm.select_kernel_backend(config.kernel_backend)
        self.backend: KernelBackend = backend_spec.factory({})
        self.kernel_backend: str = backend_spec.name
        self.registry = LifeCycleRegistry(config)
        self.layout = StorageLayout(self.registry)
        # SWA scratch (kvcm_core.scratch): group -> scale of each pool of its pool group,
        # and the most scratch blocks max_scratch_slots hold.
        self._scratch_scales = validate_scratch_layout(config, self.registry, self.layout)
        self._scratch_groups = sorted(self._scratch_scales)
        self._scratch_max_blocks = {
            g: max_scratch_blocks(config.swa_scratch.max_scratch_slots,
                                  config.swa_scratch.scratch_pages_per_block, scales)
            for g, scales in self._scratch_scales.items()
        } if config.swa_scratch is not None else {}
        self.life_cycles = self.registry.life_cycles
        policy_spec = pm.eviction_policy(config.eviction_policy)
        self._make_policy: Callable[[], Any] = lambda: policy_spec.factory({})

        self._tiers = []
        cold_codecs = {lv.codec or "raw" for lv in config.levels[1:]}
        if len(cold_codecs) > 1:
            raise ConfigError(
                "levels[*].codec", sorted(cold_codecs),
                "every cold level must use the same page codec (cold pages move between "
                "cold levels as they are)",
            )
        for i, level in enumerate(config.levels):
            spec = pm.tier(level.tier)
            if i == 0 and spec.capabilities.medium is not Medium.DEVICE:
                raise ConfigError(
                    "levels[0].tier", level.tier,
                    f"level 0 must be device memory; this tier's medium is "
                    f"{spec.capabilities.medium.value}",
                )
            if level.codec is not None:
                pm.codec(level.codec)  # unknown names fail here, listing the known ones
            self._tiers.append(spec.factory(self.backend, level.options))
        self.codec: PageCodec | None = None
        if cold_codecs:
            codec_spec = pm.codec(cold_codecs.pop())
            if codec_spec.capabilities.kind is not CodecKind.PAGE:
                raise ConfigError("levels[1].codec", codec_spec.name,
                                  "must be a page codec (blob codecs are for storage tiers)")
            self.codec = codec_spec.factory({})
        self._mover = Mover(self.backend, self.codec)
        nlevels = len(config.levels)

        slots = self.layout.split_quota(config.levels[0].quota, config.pool_group_ratios)
        self.stores: list[list[PoolGroupStore]] = [[]]
        for pg, n in zip(self.layout.pool_groups, slots, strict=True):
            pools = [
                self._tiers[0].create_pool(size, n, name=f"L0-pg{pg.id}-pool{k}")
                for k, size in enumerate(pg.slot_sizes)
            ]
            self.stores[0].append(
                PoolGroupStore(0, pg.id, pools, self._make_policy, nlevels == 1))
        # Cold grouping: (pool policy, cold page size), independent of the GPU grouping.
        ngroups = len(self.registry.life_cycles)
        self._layouts = [pg.page_layout() for pg in self.layout.pool_groups]
        self._cold_key_of: list[tuple] = []
        cold_keys: dict[tuple, list[int]] = {}
        if self.codec is not None:
            for g in range(ngroups):
                pgid = self.layout.group_to_pool_group[CacheGroupId(g)]
                size = self.codec.cold_page_size(self._layouts[pgid])
                key = (pool_reuse_policy(self.registry.life_cycles[g].policy), size)
                self._cold_key_of.append(key)
                cold_keys.setdefault(key, []).append(g)
        self._cold_keys = list(cold_keys)
        self._cold_store: list[list[PoolGroupStore]] = [[]]  # [level][group]
        for li in range(1, nlevels):
            quota = config.levels[li].quota
            weights = [key[1] * len(cold_keys[key]) for key in self._cold_keys]
            total = sum(weights)
            stores = []
            for ci, (key, w) in enumerate(zip(self._cold_keys, weights, strict=True)):
                n = int(quota * w / total) // key[1]
                if n < 1:
                    raise ConfigError(
                        f"levels[{li}].quota", quota,
                        f"too small: cold group {ci} ({key[1]} bytes per page) gets no slot")
                # Unnamed: kvcm does not persist its tree, so cold files are private to
                # this manager (two managers never share a file).
                pool = self._tiers[li].create_pool(key[1], n)
                stores.append(PoolGroupStore(li, ci, [pool], self._make_policy,
                                             li == nlevels - 1))
            self.stores.append(stores)
            self._cold_store.append(
                [stores[self._cold_keys.index(self._cold_key_of[g])] for g in range(ngroups)])
        # Per cache group: its level-0 store.
        self._gpu_store: list[PoolGroupStore] = [
            self.stores[0][self.layout.group_to_pool_group[CacheGroupId(g)]]
            for g in range(len(self.life_cycles))
        ]
        lcs = self.life_cycles
        self._attn_groups = [g for g, lc in enumerate(lcs) if not lc.is_ssm]
        self._ssm_groups = [g for g, lc in enumerate(lcs) if lc.is_ssm]
        self._windowed_groups = [g for g, lc in enumerate(lcs) if lc.is_windowed]
        self._walk_groups = [g for g, lc in enumerate(lcs)
                             if not lc.is_ssm and lc.window is None and lc.constrains]
        self._prune_groups = [g for g, lc in enumerate(lcs)
                              if lc.constrains and g not in self._walk_groups]
        self._publish_groups = [g for g in self._attn_groups if lcs[g].publishes]
        # A model whose every life cycle is PRIVATE publishes nothing: no tree at all.
        self._publishes_anything = any(lc.publishes for lc in lcs)
        self.tree = PrefixTree(len(lcs))
        self._open: dict[int, Any] = {}
        self._ids = itertools.count()
        self._events: list[BlockEvent] = []
        self._sinks = pm.event_sinks(config)
        self.event_sink_errors: dict[str, int] = {}
        self._stats = IterationStats.empty(len(lcs), len(config.levels))
        self._closed = False
        self._epoch = 0  # bumped whenever a page moves: page tables read it

    # -- public lookups -------------------------------------------------------------------

    @property
    def levels(self) -> tuple[Any, ...]:
        """The level configurations, warm to cold."""
        return self.config.levels

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
        pool = self.stores[0][attr.pool_group].pools[attr.pool]
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
        if group in self._scratch_scales:
            assert self.config.swa_scratch is not None
            conv = attrs.evolve(conv, scratch_pages_per_block=(
                self.config.swa_scratch.scratch_pages_per_block))
        return conv

    @property
    def pool_group_descs(self) -> list[dict[str, Any]]:
        """One description per GPU pool group: policy, slot sizes, slots, life cycles."""
        out = []
        for pg, store in zip(self.layout.pool_groups, self.stores[0], strict=True):
            out.append({
                "id": pg.id, "policy": pg.policy.name, "slot_sizes": list(pg.slot_sizes),
                "sparse": pg.sparse, "num_slots": store.num_slots,
                "cache_groups": list(pg.life_cycles),
                "life_cycles": [self.life_cycles[g].describe() for g in pg.life_cycles],
            })
        return out

    def get_storage_statistics(self, level: int = 0) -> StorageStatistics:
        """Slots of a level: ``free + evictable + unavailable == total``."""
        if isinstance(level, bool) or not isinstance(level, int) or not (
                0 <= level < len(self.stores)):
            raise ValueError(f"level={level!r}: must be in 0..{len(self.stores) - 1}")
        stats = StorageStatistics(level)
        for store in self.stores[level]:
            store.statistics(stats)
        return stats

    def get_and_reset_iteration_stats(self) -> IterationStats:
        """Counters since the last call; also flushes pending events to the sinks."""
        self.flush_events()
        out = self._stats
        self._stats = IterationStats.empty(len(self.life_cycles), len(self.config.levels))
        return out

    # -- requests -------------------------------------------------------------------------

    def create_kv_cache(
        self,
        scope: ReuseScope | None = None,
        input_tokens: Sequence[Any] | np.ndarray = (),
        id: Any = None,
        priority_callback: Callable[[int], int] | None = None,
    ) -> Any:
        """Match the prompt's prefix and return a SUSPENDED cache holding the matched pages.

        Args:
            scope: reuse scope (tenant, adapter); ``None`` is the default scope.
            input_tokens: the tokens whose KV may be reused (usually the prompt less its
                last token, which the engine must compute anyway).
            id: an identifier for the request (default: a counter).
            priority_callback: ``block ordinal -> priority (0..100)`` for its pages.
        """
        from kvcm_core.cache import KVCache

        self._check_open()
        scope = self._check_scope(scope)
        match = self._match(scope, input_tokens)
        cache = KVCache(self, scope, match, input_tokens,
                        next(self._ids) if id is None else id, priority_callback)
        self._open[builtins_id(cache)] = cache
        return cache

    def probe_reuse(self, scope: ReuseScope | None, tokens: Sequence[int | bytes]) -> int:
        """Tokens ``create_kv_cache`` would reuse now, without taking anything."""
        self._check_open()
        return self._match(self._check_scope(scope), tokens).length

    def _check_scope(self, scope: ReuseScope | None) -> ReuseScope:
        if scope is None:
            return ReuseScope()
        if not isinstance(scope, ReuseScope):
            raise TypeError(f"scope={scope!r}: must be a ReuseScope or None")
        return scope

    def _match(self, scope: ReuseScope, tokens: Sequence[Any] | np.ndarray) -> Match:
        return match_prefix(
            self.tree, scope_root_key(scope), tokens, self.tokens_per_block,
            self.life_cycles, walk_groups=self._walk_groups,
            prune_groups=self._prune_groups, partial=self.config.enable_partial_reuse,
            backoff=self.config.reuse_match_backoff,
        )

    def _check_open(self) -> None:
        if self._closed:
            raise InvalidStateError("the manager was shut down")

    # -- pages ------------------------------------------------------------------------------

    def _can_take(self, needs: Mapping[int, int], extra: Mapping[int, int] | None = None) -> bool:
        """Whether level 0 can provide ``needs[pool group]`` new slots (``extra``: slots
        that the caller will release first, becoming free or droppable)."""
        for pg, n in needs.items():
            store = self.stores[0][pg]
            have = store.num_free + len(store.droppable) + (extra or {}).get(pg, 0)
            if n > have and not self._room(store, n - (extra or {}).get(pg, 0)):
                return False
        return True

    def _take(self, group: int, n: int) -> list[Page]:
        """``n`` new pages for ``group`` on level 0 (the caller locks them), evicting
        (moving down or dropping) as needed."""
        store = self._gpu_store[group]
        if n > store.num_free:
            self._make_room(store, n)
        return store.take_slots(group, n)

    def _next_store(self, page: Page) -> PoolGroupStore:
        return self._cold_store[page.level + 1][page.group]

    def _pick_victims(self, store: PoolGroupStore, k: int) -> list[Page]:
        """The first ``k`` pages to leave ``store``: droppable ones (LRU) then held ones
        (only where they can move down)."""
        out: list[Page] = []
        for page in store.droppable.victims():
            if len(out) == k:
                return out
            out.append(page)  # type: ignore[arg-type]  # policies hold Page keys
        if not store.last_level:
            for page in store.held.victims():
                if len(out) == k:
                    return out
                out.append(page)  # type: ignore[arg-type]
        return out

    def _room(self, store: PoolGroupStore, n: int) -> bool:
        """Whether ``_make_room(store, n)`` would succeed (no side effects): enough victims,
        and the held ones among them fit one level down (droppable ones can always be
        dropped)."""
        k = n - store.num_free
        if k <= 0:
            return True
        victims = self._pick_victims(store, k)
        if len(victims) < k:
            return False
        if store.last_level:
            return True
        for pages in self._by_next(victims).values():
            held = sum(1 for p in pages if p.holds)
            if held and self._held_target(pages[0], held) is None:
                return False
        return True

    def _held_target(self, page: Page, n: int) -> PoolGroupStore | None:
        """The warmest colder store (for ``page``'s group) that can take ``n`` held pages
        at once: held pages skip a level too small for them rather than block."""
        for level in range(page.level + 1, len(self.stores)):
            target = self._cold_store[level][page.group]
            if self._room(target, n):
                return target
        return None

    def _capacity(self, store: PoolGroupStore, limit: int) -> int:
        """The most free slots (up to ``limit``) ``store`` can offer (binary search on the
        monotone ``_room``)."""
        lo, hi = min(limit, store.num_free), limit
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self._room(store, mid):
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _by_next(self, victims: list[Page]) -> dict[PoolGroupStore, list[Page]]:
        out: dict[PoolGroupStore, list[Page]] = {}
        for page in victims:
            out.setdefault(self._next_store(page), []).append(page)
        return out

    def _make_room(self, store: PoolGroupStore, n: int) -> None:
        """Free slots until ``store`` has ``n`` free: victims move one level down (making
        room there recursively) as far as the next level can take them; droppable victims
        it cannot take are dropped (the least recently used first). Checked before
        anything moves.

        Raises:
            OutOfPagesError: not enough can be freed (nothing was changed), or a write of
                held pages to the next level failed (pages that did move stay moved).
        """
        k = n - store.num_free
        if k <= 0:
            return
        if not self._room(store, n):
            raise OutOfPagesError(
                f"level {store.level} pool group {store.pool_group}: need {k} more slots; "
                f"{len(store.droppable)} droppable and {len(store.held)} held pages cannot "
                "free them"
            )
        victims = self._pick_victims(store, k)
        if store.last_level:
            for page in victims:
                if page.store is store and page.node is not None and not page.holds:
                    self._drop(page, from_policy=False)
            return
        overflow: list[Page] = []
        for nxt, pages in self._by_next(victims).items():
            held = [p for p in pages if p.holds]
            droppable = [p for p in pages if not p.holds]  # least recently used first
            if held:
                target = self._held_target(held[0], len(held))
                if target is not None:
                    self._make_room(target, len(held))
                    self._move([p for p in held if p.store is store], target)
            keep = self._capacity(nxt, len(droppable))
            cut = len(droppable) - keep
            overflow.extend(droppable[:cut])
            self._make_room(nxt, keep)
            # Making room below may have dropped an ancestor, freeing chosen pages with it.
            movers = [p for p in droppable[cut:] if p.store is store and p.slot >= 0]
            overflow.extend(self._move(movers, nxt))
        # Droppable pages the next level could not take go further down where there is
        # room, and are dropped only when no colder level can take them.
        for level in range(store.level + 2, len(self.stores)):
            if not overflow:
                break
            by_store: dict[PoolGroupStore, list[Page]] = {}
            for page in overflow:
                if page.store is store and page.slot >= 0 and page.node is not None \
                        and not page.holds and not page.locks:
                    by_store.setdefault(self._cold_store[level][page.group], []).append(page)
            overflow = []
            for dst, pages in by_store.items():
                cut = len(pages) - self._capacity(dst, len(pages))
                overflow.extend(pages[:cut])
                self._make_room(dst, len(pages) - cut)
                alive = [p for p in pages[cut:] if p.store is store and p.slot >= 0]
                overflow.extend(self._move(alive, dst))
        drops = overflow
        for page in drops:
            if page.store is store and page.slot >= 0 and page.node is not None \
                    and not page.holds and not page.locks:
                self._drop(page, from_policy=False)
        if store.num_free < n:
            raise OutOfPagesError(
                f"level {store.level} pool group {store.pool_group}: could not free {k} "
                "slots (a write of held pages to the next level failed)"
            )

    def _move(self, pages: list[Page], dst: PoolGroupStore,
              stream: Stream | None = None) -> list[Page]:
        """Move unlocked pages of one store to ``dst`` (which has room). Returns the pages
        that could not be moved (I/O failure: they stay where they were)."""
        if not pages:
            return []
        src = pages[0].store
        slots = [dst.free.pop() for _ in pages]
        layout = self._layouts[self.layout.group_to_pool_group[CacheGroupId(pages[0].group)]]
        try:
            self._mover.copy(layout, src, [p.slot for p in pages], dst, slots, stream)
        except TierIOError:
            dst.free.extend(reversed(slots))
            self._stats.io_failures += 1
            return list(pages)
        for page, slot in zip(pages, slots, strict=True):
            self._rehome(page, dst, slot)
        return []

    def _rehome(self, page: Page, dst: PoolGroupStore, slot: int) -> None:
        """Point a page at its new place after its data was copied there."""
        src = page.store
        src._leave_policy(page)
        if src.pages[page.slot] is page:
            src.pages[page.slot] = None
            src.free.append(page.slot)
        from_level = page.level
        self._epoch += 1
        page.store = dst
        page.slot = slot
        page.level = dst.level
        dst.pages[slot] = page
        dst._enter_policy(page)
        gstats = self._stats.groups[page.group]
        nbytes = self._cold_bytes(page.group)
        if dst.level > from_level:
            gstats.offload_blocks += 1
            gstats.offload_bytes += nbytes
        else:
            gstats.onboard_blocks += 1
            gstats.onboard_bytes += nbytes
        if page.node is not None:
            self._event(EventKind.MOVED, page.node, page.group, dst.level,
                        from_level=from_level)

    def _cold_bytes(self, group: int) -> int:
        pg = self.layout.group_to_pool_group[CacheGroupId(group)]
        if self.codec is None:
            return self._layouts[pg].page_bytes
        return self._cold_key_of[group][1]

    def _fill(self, group: int, pairs: list[tuple[Page, Page]],
              stream: Stream | None = None) -> None:
        """Copy the data of source pages (any level) into new level-0 pages, leaving the
        sources where they are. ``pairs`` holds ``(destination, source)``.

        Raises:
            TierIOError: a source on a storage level could not be read.
        """
        by_src: dict[PoolGroupStore, list[tuple[Page, Page]]] = {}
        for dst, src in pairs:
            by_src.setdefault(src.store, []).append((dst, src))
        layout = self._layouts[self.layout.group_to_pool_group[CacheGroupId(group)]]
        gpu = self._gpu_store[group]
        for src_store, items in by_src.items():
            self._mover.copy(layout, src_store, [s.slot for _, s in items], gpu,
                             [d.slot for d, _ in items], stream)
            if src_store.level == 0:
                self._stats.groups[group].intra_device_copies += len(items)
            else:
                self._stats.groups[group].onboard_blocks += len(items)
                self._stats.groups[group].onboard_bytes += len(items) * self._cold_bytes(group)

    def _onboard(self, pages: list[Page], stream: Stream | None = None) -> None:
        """Move held pages of colder levels to level 0 (room must exist).

        Raises:
            TierIOError: a page could not be read; it is forgotten (dropped from the tree,
                slot freed) and the others that were read stay on level 0.
        """
        # One batch per (source store, GPU store): a cold group may merge life cycles of
        # several GPU pool groups, whose pages go back to different pools.
        by_src: dict[tuple[PoolGroupStore, PoolGroupStore], list[Page]] = {}
        for page in pages:
            by_src.setdefault((page.store, self._gpu_store[page.group]), []).append(page)
        for (src, gpu), group_pages in by_src.items():
            failed = self._move(group_pages, gpu, stream)
            if failed:
                for page in failed:
                    self._lose(page)
                raise TierIOError(
                    f"reading {len(failed)} pages from level {src.level} failed; they are "
                    "dropped from the prefix tree and must be recomputed"
                )

    def _lose(self, page: Page) -> None:
        """A page whose data cannot be read: forget it everywhere (its holders keep a dead
        reference and must recompute)."""
        node = page.node
        if node is not None:
            node.pages[page.group] = None
            page.node = None
            self._event(EventKind.REMOVED, node, page.group, page.level)
            lc = self.life_cycles[page.group]
            if not lc.is_ssm and lc.constrains_block(node.ordinal) and (
                    lc.window is None or node.ordinal < lc.num_sink_blocks):
                self._invalidate_below(node, page.store)
        store = page.store
        store._leave_policy(page)
        store.release_slot(page)
        page.level = -1
        self._epoch += 1

    def _drop(self, page: Page, *, from_policy: bool) -> int:
        """Remove a droppable page from the tree and free its slot. Dropping a page that
        every longer match needs removes the subtree below its block. Returns slots freed
        in ``page``'s store."""
        store = page.store
        node: Node = page.node
        group = page.group
        if not from_policy:
            store.droppable.remove(page)
        page.node = None
        node.pages[group] = None
        gstats = self._stats.groups[group]
        gstats.dropped_blocks += 1
        if not page.reused:
            gstats.dropped_before_reuse += 1
        store.release_slot(page)
        freed = 1
        self._event(EventKind.REMOVED, node, group, page.level)
        lc = self.life_cycles[group]
        if not lc.is_ssm and lc.constrains_block(node.ordinal) and (
                lc.window is None or node.ordinal < lc.num_sink_blocks):
            freed += self._invalidate_below(node, store)
        self._collect(node)
        return freed

    def _invalidate_below(self, node: Node, store: PoolGroupStore) -> int:
        """Detach every node below ``node``: droppable pages freed, referenced ones become
        private to their holders."""
        freed = 0
        for child in list(node.subtree()):
            for g, page in enumerate(child.pages):
                if page is None:
                    continue
                child.pages[g] = None
                self._event(EventKind.REMOVED, child, g, page.level)
                if page.locks or page.holds:
                    page.node = None
                else:
                    page.store.droppable.remove(page)
                    page.node = None
                    page.store.release_slot(page)
                    if page.store is store:
                        freed += 1
                    gstats = self._stats.groups[g]
                    gstats.dropped_blocks += 1
                    if not page.reused:
                        gstats.dropped_before_reuse += 1
        for child in list(node.iter_children()):
            self.tree.detach(child)
            self.tree.num_nodes -= sum(1 for _ in child.subtree())
        return freed

    def _collect(self, node: Node) -> None:
        """Detach empty leaves upwards (a block with no page and no child is garbage), and
        forget a scope's root once nothing is cached under it."""
        while (node.parent is not None and not node.children and not node.partials
               and not node.has_pages()):
            parent = node.parent
            self.tree.detach(node)
            node = parent
        if node.parent is None and node.ordinal < 0 and not node.children \
                and not node.partials and node.key is not None \
                and self.tree.roots.get(node.key) is node:
            del self.tree.roots[node.key]

    def _copy_blocks(self, group: int, pairs: list[tuple[int, int]],
                     stream: Stream | None = None) -> None:
        """Copy level-0 blocks of ``group``: ``(dst slot, src slot)`` in every pool."""
        if not pairs:
            return
        store = self._gpu_store[group]
        arr = np.asarray(pairs, dtype=np.int32).reshape(-1, 2)
        tasks = []
        for pool in store.pools:
            assert isinstance(pool, DevicePool)
            region = pool.region
            tasks.append(CopyTask(region, region, pool.slot_bytes, arr))
        self.backend.copy_pages_batch(tasks, stream)
        self._stats.groups[group].intra_device_copies += len(pairs)

    # -- events ------------------------------------------------------------------------------

    def _event(self, kind: EventKind, node: Node, group: int, level: int,
               token_ids: tuple = (), from_level: int | None = None) -> None:
        if not self._sinks:
            return
        parent = node.parent
        self._events.append(BlockEvent(
            kind=kind,
            block_key=(node.key or b"").hex() if node.key else f"partial:{id(node):x}",
            parent_key=parent.key.hex() if parent is not None and parent.key else None,
            group=group, level=level, medium=self._medium(level), token_ids=token_ids,
            from_level=from_level,
        ))
        if len(self._events) >= _EVENT_BATCH:
            self.flush_events()

    def _medium(self, level: int) -> str:
        return self._tiers[level].capabilities.medium.value

    def flush_events(self) -> None:
        """Deliver pending events to the event sinks.

        A sink that raises never disturbs the manager: the batch is counted in
        ``event_sink_errors`` (per sink) and a warning names the sink once.
        """
        if not self._events:
            return
        batch, self._events = self._events, []
        for sink in self._sinks:
            try:
                sink.on_events(batch)
            except Exception as exc:  # a sink's failure must not break the engine's step
                name = type(sink).__name__
                if name not in self.event_sink_errors:
                    warnings.warn(f"kvcm event sink {name} raised {type(exc).__name__}: "
                                  f"{exc}; its events are dropped and counted",
                                  RuntimeWarning, stacklevel=2)
                self.event_sink_errors[name] = self.event_sink_errors.get(name, 0) + 1

    # -- whole-manager operations -------------------------------------------------------------

    @property
    def num_open_caches(self) -> int:
        return len(self._open)

    def clear_reusable_blocks(self) -> None:
        """Drop every reusable (droppable) block. Refused while caches are open."""
        self._check_open()
        if self._open:
            raise InvalidStateError(
                f"clear_reusable_blocks() refused: {len(self._open)} caches are open; close "
                "them first"
            )
        for stores in self.stores:
            for store in stores:
                while True:
                    victim = store.droppable.pop_victim()
                    if victim is None:
                        break
                    self._drop(victim, from_policy=True)  # type: ignore[arg-type]
        self.tree = PrefixTree(len(self.life_cycles))
        self.flush_events()

    def shutdown(self) -> None:
        """Release every pool. Refused while caches are open; idempotent."""
        if self._closed:
            return
        if self._open:
            raise InvalidStateError(
                f"shutdown() refused: {len(self._open)} caches are open; close them first"
            )
        self.flush_events()
        for stores in self.stores:
            for store in stores:
                for pool in store.pools:
                    pool.close()
        for tier in self._tiers:
            tier.close()
        self._mover.close()
        self._closed = True

    def resize(self, level: int, quota: int | str) -> bool:
        """Grow or shrink a level's quota while every cache is suspended, moving pages out
        of the released space (into free slots of the level, else down a level). Returns
        False, with nothing changed, when the pages cannot be placed.

        Raises:
            InvalidStateError: a cache is active.
            ConfigError: bad level or quota.
        """
        from kvcm_core.cache import CacheStatus
        from kvcm_core.units import parse_size

        self._check_open()
        if isinstance(level, bool) or not isinstance(level, int) or not (
                0 <= level < len(self.stores)):
            raise ConfigError("level", level, f"must be in 0..{len(self.stores) - 1}")
        quota = parse_size(quota, "quota")
        active = [c.id for c in self._open.values() if c.status is CacheStatus.ACTIVE]
        if active:
            raise InvalidStateError(
                f"manager.resize() needs every cache suspended; active: {active[:8]}")
        stores = self.stores[level]
        if level == 0:
            slots = self.layout.split_quota(quota, self.config.pool_group_ratios)
        else:
            weights = [key[1] * sum(1 for k in self._cold_key_of if k == key)
                       for key in self._cold_keys]
            total = sum(weights)
            slots = [int(quota * w / total) // key[1]
                     for key, w in zip(self._cold_keys, weights, strict=True)]
            if min(slots) < 1:
                raise ConfigError("quota", quota, f"too small for level {level}")
        # Check first: every store must be able to fit its live pages below its new size.
        plans = []
        for store, new in zip(stores, slots, strict=True):
            high = [p for p in store.pages[new:] if p is not None]
            free_low = sum(1 for f in store.free if f < new)
            short = len(high) - free_low
            if short > 0 and not self._room(store, store.num_free + short):
                return False
            plans.append((store, new, short))
        for store, new, short in plans:
            if new >= store.num_slots:
                self._grow_store(store, new)
                continue
            if short > 0:
                try:
                    self._make_room(store, store.num_free + short)
                except OutOfPagesError:
                    return False  # a write failed; pages that moved stay valid
            high = [p for p in store.pages[new:] if p is not None]
            low_free = sorted(f for f in store.free if f < new)[: len(high)]
            if high:
                for page in high:  # compaction: each high page into a low free slot
                    store.free.remove(low_free[0])
                    layout = self._layouts[
                        self.layout.group_to_pool_group[CacheGroupId(page.group)]]
                    self._mover.copy(layout, store, [page.slot], store, [low_free[0]])
                    store.pages[page.slot] = None
                    store.free.append(page.slot)
                    page.slot = low_free.pop(0)
                    store.pages[page.slot] = page
            for pool in store.pools:
                pool.resize(new)
            store.free = [f for f in store.free if f < new]
            del store.pages[new:]
            store.num_slots = new
        return True

    def _grow_store(self, store: PoolGroupStore, new: int) -> None:
        old = store.num_slots
        for pool in store.pools:
            pool.resize(new)
        store.pages.extend([None] * (new - old))
        store.free[:0] = list(range(new - 1, old - 1, -1))
        store.num_slots = new

    def _prefetch(self, pages: list[Page], level: int) -> int:
        """Move pages up to ``level`` where room exists without pushing held pages."""
        moved = 0
        by: dict[tuple[PoolGroupStore, PoolGroupStore], list[Page]] = {}
        for page in pages:
            dst = self._gpu_store[page.group] if level == 0 else \
                self._cold_store[level][page.group]
            by.setdefault((page.store, dst), []).append(page)
        for (_src, dst), group_pages in by.items():
            room = dst.num_free + len(dst.droppable)
            take = group_pages[:room]
            if not take:
                continue
            if len(take) > dst.num_free:
                victims = self._pick_victims(dst, len(take) - dst.num_free)
                for v in victims:
                    if not v.holds and not v.locks and v.node is not None and v.slot >= 0:
                        self._drop(v, from_policy=False)
            take = take[: dst.num_free]
            failed = self._move(take, dst)
            moved += len(take) - len(failed)
        return moved

    def check_invariants(self) -> None:
        """Check internal invariants (tests and debugging): accounting identity per pool
        group, no slot owned twice, policy membership consistent with page states."""
        for level, stores in enumerate(self.stores):
            for store in stores:
                seen_free = set(store.free)
                if len(seen_free) != len(store.free):
                    raise AssertionError(f"L{level} pg{store.pool_group}: duplicate free slots")
                locked = held = droppable = 0
                for slot, page in enumerate(store.pages):
                    if page is None:
                        if slot not in seen_free:
                            raise AssertionError(f"slot {slot} neither free nor owned")
                        continue
                    if slot in seen_free:
                        raise AssertionError(f"slot {slot} both free and owned by {page}")
                    if page.slot != slot or page.store is not store or page.level != level:
                        raise AssertionError(f"{page} is filed under slot {slot}")
                    if page.locks:
                        locked += 1
                        if page in store.droppable or page in store.held:
                            raise AssertionError(f"locked {page} is in an eviction queue")
                    elif page.holds:
                        held += 1
                        if page not in store.held:
                            raise AssertionError(f"held {page} missing from the held queue")
                    elif page.node is not None:
                        droppable += 1
                        if page not in store.droppable:
                            raise AssertionError(f"{page} missing from the droppable queue")
                        if page.node.pages[page.group] is not page:
                            raise AssertionError(f"{page} not in its node")
                    else:
                        raise AssertionError(f"unreferenced uncommitted {page} not freed")
                if droppable != len(store.droppable) or held != len(store.held):
                    raise AssertionError("eviction queues hold pages of other states")
                evictable = droppable + (0 if store.last_level else held)
                unavailable = locked + (held if store.last_level else 0)
                if len(store.free) + evictable + unavailable != store.num_slots:
                    raise AssertionError("free + evictable + unavailable != total")


builtins_id = id
