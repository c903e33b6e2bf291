"""Helpers for the reuse-policy tests (tests/test_reuse_policies.py,
tests/test_policy_properties.py).

Small models built from one-line layer specs, managers sized in slots per pool group (GPU)
and per life cycle (cold levels), a fingerprint driver that chooses OPTIONAL groups at the
first resume and lets the engine recompute what came back fresh, and tree/page probes.
Every data check goes through :class:`~kvcm_core.testing.fingerprint.FingerprintEngine`.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from levels_helpers import Driver as LevelsDriver

from kvcm_core import (
    AttentionLayerConfig,
    BufferConfig,
    KVCacheManager,
    KVCacheManagerConfig,
    LevelConfig,
    ReusePolicy,
    SsmLayerConfig,
)
from kvcm_core.frame import FRAME_OVERHEAD

P = ReusePolicy
TPB = 4
#: Bytes per buffer page: one 16-byte record per token slot.
PAGE = 16 * TPB

#: Level stacks the tests run over: tier names, warm to cold.
STACKS = {
    "gpu": ("gpu",),
    "gpu-host": ("gpu", "host"),
    "gpu-host-disk": ("gpu", "host", "disk"),
}


# -- model layouts ------------------------------------------------------------------------


def buf(role: str, size: int = PAGE, policy: ReusePolicy | None = None) -> BufferConfig:
    return BufferConfig(role=role, size=size, reuse_policy=policy)


def att(layer_id: int, *buffers: BufferConfig, window: int | None = None, sinks: int = 0,
        policy: ReusePolicy = P.REQUIRED) -> AttentionLayerConfig:
    return AttentionLayerConfig(layer_id=layer_id, buffers=list(buffers or [buf("k")]),
                                sliding_window_size=window, num_sink_tokens=sinks,
                                reuse_policy=policy)


def ssm(layer_id: int, *buffers: BufferConfig, policy: ReusePolicy = P.REQUIRED
        ) -> SsmLayerConfig:
    return SsmLayerConfig(layer_id=layer_id, buffers=list(buffers or [buf("state", 48)]),
                          reuse_policy=policy)


def every_policy_layers() -> list[Any]:
    """One model with every policy: a split full-attention layer (K REQUIRED, V OPTIONAL),
    a SINK_REQUIRED_ONLY companion (window 8, 4 sink tokens = 1 sink block), a PRIVATE
    attention layer and a split SSM layer (REQUIRED state, PRIVATE conv, OPTIONAL extra)."""
    return [
        att(0, buf("k"), buf("v", policy=P.OPTIONAL)),
        att(1, buf("k", 2 * PAGE), window=8, sinks=4, policy=P.SINK_REQUIRED_ONLY),
        att(2, buf("k", PAGE // 2, policy=P.PRIVATE)),
        ssm(3, buf("state", 48), buf("conv", 16, P.PRIVATE), buf("o", 32, P.OPTIONAL)),
    ]


# -- managers sized in slots --------------------------------------------------------------


def _pool_layout(layers: Sequence[Any], **kw: Any) -> KVCacheManager:
    cfg = KVCacheManagerConfig(tokens_per_block=TPB, layers=list(layers),
                               levels=[LevelConfig(tier="gpu", quota=1 << 22),
                                       LevelConfig(tier="host", quota=1 << 22)],
                               kernel_backend=os.environ.get("KVCM_TEST_BACKEND", "numpy"), **kw)
    return KVCacheManager(cfg)


def make_manager(layers: Sequence[Any], stack: Sequence[str] = ("gpu",),
                 slots: int | Sequence[int] = 64, tmp_path: Path | None = None, *,
                 gpu_slots: Sequence[int] | None = None, **kw: Any) -> KVCacheManager:
    """A manager over ``stack`` (tier names). ``slots[i]``: slots per life cycle at level
    ``i`` (one int: the same at every level); ``gpu_slots`` sets each GPU pool group's
    slots exactly (in ``pool_group_descs`` order) instead."""
    if isinstance(slots, int):
        slots = [slots] * len(stack)
    probe = _pool_layout(layers, **{k: v for k, v in kw.items()
                                    if k not in ("max_util_for_resume",)})
    try:
        pgs = probe.layout.pool_groups
        if gpu_slots is None:
            gpu_slots = [slots[0] * len(pg.life_cycles) for pg in pgs]
        weights = [n * pg.page_bytes for n, pg in zip(gpu_slots, pgs, strict=True)]
        gpu_quota = sum(weights) + min(pg.page_bytes for pg in pgs) // 2
        cold_key_of = probe.storage_levels.cold_key_of
        cold_keys = probe.storage_levels.cold_keys
        counts = [sum(1 for k in cold_key_of if k == key) for key in cold_keys]
        sizes = [key[1] for key in cold_keys]
    finally:
        probe.shutdown()
    levels = [LevelConfig(tier=stack[0], quota=gpu_quota)]
    for i, tier in enumerate(stack[1:], start=1):
        options = {}
        extra = 0  # a disk slot holds a cold frame around the page
        if tier == "disk":
            assert tmp_path is not None, "a disk level needs tmp_path"
            options = {"path": str(tmp_path / f"L{i}")}
            extra = FRAME_OVERHEAD
        unit = sum((size + extra) * n for size, n in zip(sizes, counts, strict=True))
        levels.append(LevelConfig(tier=tier, quota=slots[i] * unit + (min(sizes) + extra) // 2,
                                  options=options))
    kw.setdefault("max_util_for_resume", 1.0)
    cfg = KVCacheManagerConfig(tokens_per_block=TPB, layers=list(layers), levels=levels,
                               kernel_backend=os.environ.get("KVCM_TEST_BACKEND", "numpy"),
                               pool_group_ratios=tuple(float(w) for w in weights), **kw)
    m = KVCacheManager(cfg)
    got = [s.num_slots for s in m.stores[0]]
    assert got == list(gpu_slots), (got, gpu_slots)
    return m


def tokens(n: int, seed: int = 0) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(1, 30000, n)]


def group_of(m: KVCacheManager, layer_id: int, role: str) -> int:
    return int(m.get_buffer_group_id(layer_id, role))


def groups_with(m: KVCacheManager, policy: ReusePolicy, *, ssm: bool | None = None
                ) -> list[int]:
    return [g for g, lc in enumerate(m.life_cycles)
            if lc.policy is policy and (ssm is None or lc.is_ssm == ssm)]


# -- the fingerprint driver ---------------------------------------------------------------


class Driver(LevelsDriver):
    """The levels Driver whose ``resume`` passes the OPTIONAL choice and lets the engine
    recompute fresh pages."""

    def resume(self, cache: Any, optional: Sequence[int] | None = None) -> bool:
        ok = cache.resume(optional_reuse_groups=optional)
        if ok:
            self.engine.recompute(self.work(cache))
        return ok

    def run_to(self, cache: Any, end: int | None = None, chunk: int = 5,
               optional: Sequence[int] | None = None) -> None:
        """Resume if needed (choosing ``optional``), then step to ``end`` (default: every
        token) and check the whole history."""
        if end is None:
            end = len(self.toks[id(cache)])
        if cache.status.name != "ACTIVE":
            assert self.resume(cache, optional)
        while cache.history_length < end:
            assert self.step(cache, min(chunk, end - cache.history_length))
        self.check(cache)

    def write(self, toks: Sequence[Any], end: int | None = None, *, close: bool = True,
              chunk: int = 5, **kw: Any) -> Any:
        """A request that writes (and commits) its KV to ``end``, then closes (its pages
        stay in the tree) unless ``close=False``."""
        cache = self.create(toks, match_len=0, **kw)
        self.run_to(cache, end, chunk)
        if close:
            cache.close()
            assert_invariants(self.m)
        return cache


# -- the tree and pages ---------------------------------------------------------------------


class PageView:
    """A read-only view of one page id of ``m.storage_levels.arena`` (the arrays are read
    at each access, like the old live page objects). Equal when the page ids are."""

    __slots__ = ("m", "pid")

    def __init__(self, m: KVCacheManager, pid: int) -> None:
        self.m = m
        self.pid = int(pid)

    @property
    def arena(self) -> Any:
        return self.m.storage_levels.arena

    @property
    def level(self) -> int:
        return int(self.arena.level[self.pid])

    @property
    def slot(self) -> int:
        return int(self.arena.slot[self.pid])

    @property
    def group(self) -> int:
        return int(self.arena.group[self.pid])

    @property
    def locks(self) -> int:
        return int(self.arena.locks[self.pid])

    @property
    def holds(self) -> int:
        return int(self.arena.holds[self.pid])

    @property
    def node(self) -> int:
        return int(self.arena.node[self.pid])

    @property
    def store(self) -> Any:
        """The :class:`~kvcm_core.storage.Store` holding it (None: lost)."""
        if int(self.arena.store[self.pid]) < 0:
            return None
        return self.m.storage_levels.store_of(self.pid)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PageView) and other.pid == self.pid

    def __hash__(self) -> int:
        return hash(self.pid)

    def __repr__(self) -> str:
        return self.arena.describe(self.pid)


def tree_nodes(m: KVCacheManager) -> Iterator[int]:
    """Every node id of the tree below the scope roots."""
    for root in m.tree.roots().values():
        yield from m.tree.subtree(root)


def chain(m: KVCacheManager, toks: Sequence[int], scope: Any = None) -> list[int]:
    """The tree node ids of ``toks``'s full blocks, as far as the chain exists."""
    from kvcm_core import ReuseScope
    from kvcm_core.radix import NO_NODE, block_keys, scope_root_key

    root_key = scope_root_key(scope or ReuseScope())
    node = m.tree.roots().get(root_key)
    out: list[int] = []
    if node is None:
        return out
    nfull = len(toks) // m.tokens_per_block
    for k in block_keys(root_key, list(toks), m.tokens_per_block, 0, nfull):
        node = m.tree.child(node, k)
        if node == NO_NODE:
            break
        out.append(node)
    return out


def node_page(m: KVCacheManager, node: int, group: int) -> PageView | None:
    """The page of ``group`` in tree node ``node`` (None: no page)."""
    pid = m.tree.page(node, group)
    return None if pid < 0 else PageView(m, pid)


def drop(m: KVCacheManager, node: int, group: int) -> None:
    """Evict one droppable page of the tree the way eviction does."""
    page = node_page(m, node, group)
    assert page is not None and not page.locks and not page.holds, page
    levels = m.storage_levels
    levels.drop(levels.store_of(page.pid), np.array([page.pid], dtype=np.int64), queued=True)
    assert_invariants(m)


def evict_level(m: KVCacheManager, level: int) -> None:
    """Empty every store of ``level`` the way eviction does: held pages move one level
    down (making room there), droppable ones move down or are dropped."""
    for store in m.stores[level]:
        m.storage_levels.make_room(store, store.num_slots)
    assert_invariants(m)


def cache_pages(cache: Any, group: int | None = None) -> list[PageView]:
    """Every page a cache owns (attention pages, live SSM states, pending claims)."""
    m = cache.manager
    out = [PageView(m, p) for p in cache.page_ids()]
    if group is not None:
        out = [p for p in out if p.group == group]
    return out


def store_pages(m: KVCacheManager, store: Any) -> list[PageView]:
    """The pages in every occupied slot of ``store``."""
    return [PageView(m, p) for p in store.pages().tolist()]


def snapshot(m: KVCacheManager, *caches: Any) -> Any:
    """Everything a failed operation must leave as it was: per-level statistics, every
    store's slot table and queues, and each cache's lengths, status, page tables and page
    places."""
    arena = m.storage_levels.arena
    stats = [m.get_storage_statistics(lv).as_dict() for lv in range(len(m.levels))]
    stores = []
    for level in m.stores:
        for s in level:
            slots = [s.page_at(i) for i in range(s.num_slots)]
            stores.append((
                s.level, s.pool_group, s.num_slots, sorted(s.free_slots().tolist()),
                len(s.droppable), len(s.held),
                [None if p < 0 else (p, int(arena.locks[p]), int(arena.holds[p]))
                 for p in slots]))
    per_cache = [
        (c.status, c.capacity, c.history_length, c.num_committed_tokens, c.num_blocks,
         [[int(x) for x in c.get_base_page_indices(g)] for g in range(m.num_cache_groups)],
         [(p.pid, p.level, p.slot, p.locks, p.holds) for p in cache_pages(c)])
        for c in caches
    ]
    return stats, stores, per_cache


def assert_invariants(m: KVCacheManager) -> None:
    m.check_invariants()
    for level in range(len(m.levels)):
        st = m.get_storage_statistics(level)
        assert st.free + st.evictable + st.unavailable == st.total, st


def assert_no_private_in_tree(m: KVCacheManager) -> None:
    private = set(groups_with(m, P.PRIVATE))
    for node in tree_nodes(m):
        for g in private:
            assert m.tree.page(node, g) < 0, f"PRIVATE group {g} published at node {node}"


def assert_all_free(m: KVCacheManager) -> None:
    assert m.num_open_caches == 0
    m.clear_reusable_blocks()
    assert_invariants(m)
    for level in range(len(m.levels)):
        st = m.get_storage_statistics(level)
        assert st.free == st.total, st
