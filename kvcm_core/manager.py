"""The KV-cache manager: levels, pools, the prefix tree and every request's cache.

One scheduler thread drives a manager (not thread safe by design: it is on the engine's
per-step path); several managers may live in one process. Statistics may be read from
other threads.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from kvcm_core.backend import CopyTask, KernelBackend, PageRegion, Stream
from kvcm_core.config import KVCacheManagerConfig
from kvcm_core.errors import ConfigError, InvalidStateError, OutOfPagesError
from kvcm_core.events import BlockEvent, EventKind
from kvcm_core.layout import BufferAttr, PageIndexConverter, StorageLayout
from kvcm_core.lifecycle import LifeCycleRegistry
from kvcm_core.matching import Match, match_prefix
from kvcm_core.plugins import KvcmPluginManager, get_plugin_manager
from kvcm_core.radix import Node, PrefixTree, scope_root_key
from kvcm_core.records import Medium
from kvcm_core.stats import IterationStats
from kvcm_core.storage import Page, PoolGroupStore, StorageStatistics
from kvcm_core.tier import DevicePool
from kvcm_core.types import CacheGroupId, ReuseScope

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
        self.life_cycles = self.registry.life_cycles
        policy_spec = pm.eviction_policy(config.eviction_policy)
        self._make_policy: Callable[[], Any] = lambda: policy_spec.factory({})

        if len(config.levels) > 1:
            raise ConfigError(
                "levels", [lv.tier for lv in config.levels],
                "only one level (the GPU level) is supported by this version",
            )
        self._tiers = []
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

        slots = self.layout.split_quota(config.levels[0].quota, config.pool_group_ratios)
        last = len(config.levels) == 1
        self.stores: list[list[PoolGroupStore]] = [[]]
        for pg, n in zip(self.layout.pool_groups, slots, strict=True):
            pools = [
                self._tiers[0].create_pool(size, n, name=f"L0-pg{pg.id}-pool{k}")
                for k, size in enumerate(pg.slot_sizes)
            ]
            self.stores[0].append(PoolGroupStore(0, pg.id, pools, self._make_policy, last))
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
        self.tree = PrefixTree(len(lcs))
        self._open: dict[int, Any] = {}
        self._ids = itertools.count()
        self._events: list[BlockEvent] = []
        self._sinks = pm.event_sinks(config)
        self._stats = IterationStats.empty(len(lcs), len(config.levels))
        self._closed = False

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
        self.registry.get_buffer_group_id(layer_id, role)
        return self.layout.converter((layer_id, role))

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
        input_tokens: Sequence[int | bytes] | np.ndarray = (),
        id: Any = None,  # noqa: A002 - the public name
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

    def _match(self, scope: ReuseScope, tokens: Sequence[int | bytes]) -> Match:
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
        that the caller will release first)."""
        for pg, n in needs.items():
            store = self.stores[0][pg]
            have = store.num_free + len(store.droppable) + (extra or {}).get(pg, 0)
            if n > have:
                return False
        return True

    def _take(self, group: int, n: int) -> list[Page]:
        """``n`` locked-ready pages for ``group`` on level 0, evicting as needed."""
        store = self._gpu_store[group]
        if n > store.num_free:
            self._evict(store, n - store.num_free)
        return store.take_slots(group, n)

    def _evict(self, store: PoolGroupStore, n: int) -> None:
        """Free ``n`` slots of a store by dropping droppable pages (LRU order)."""
        if n > len(store.droppable):
            raise OutOfPagesError(
                f"level {store.level} pool group {store.pool_group}: need {n} more slots, "
                f"only {len(store.droppable)} evictable"
            )
        freed = 0
        while freed < n:
            victim = store.droppable.pop_victim()
            if victim is None:  # pragma: no cover - guarded by the check above
                raise OutOfPagesError("eviction policy ran dry")
            freed += self._drop(victim, from_policy=True)

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
        """Detach empty leaves upwards (a block with no page and no child is garbage)."""
        while (node.parent is not None and not node.children and not node.partials
               and not node.has_pages()):
            parent = node.parent
            self.tree.detach(node)
            node = parent

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
               token_ids: tuple = ()) -> None:
        if not self._sinks:
            return
        parent = node.parent
        self._events.append(BlockEvent(
            kind=kind,
            block_key=(node.key or b"").hex() if node.key else f"partial:{id(node):x}",
            parent_key=parent.key.hex() if parent is not None and parent.key else None,
            group=group, level=level, medium=self._medium(level), token_ids=token_ids,
        ))
        if len(self._events) >= _EVENT_BATCH:
            self.flush_events()

    def _medium(self, level: int) -> str:
        return self._tiers[level].capabilities.medium.value

    def flush_events(self) -> None:
        """Deliver pending events to the event sinks."""
        if not self._events:
            return
        batch, self._events = self._events, []
        for sink in self._sinks:
            sink.on_events(batch)

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
                    self._drop(victim, from_policy=True)
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
        self._closed = True

    def resize(self, level: int, quota: int) -> bool:  # pragma: no cover - next issue
        """Change a level's quota while every cache is suspended (not in this version)."""
        raise NotImplementedError("manager.resize(level, quota) comes with multi-level storage")

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
                    if page.slot != slot or page.store is not store:
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
