"""Helpers for the multi-level tests (tests/test_levels.py, tests/test_faults.py).

Self-contained on purpose (it does not import conftest): managers with a GPU level and
colder host / disk levels sized in *slots per life cycle*, a small fingerprint driver,
page-location helpers, a whole-manager state snapshot (for "failed operations change
nothing"), and plugin objects for a fault-injecting disk tier and an event recorder.

Every data check goes through :class:`~kvcm_core.testing.fingerprint.FingerprintEngine`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kvcm_core import (
    AttentionLayerConfig,
    BlockEvent,
    BufferConfig,
    EventSink,
    KVCacheManager,
    KVCacheManagerConfig,
    KvcmPluginManager,
    LevelConfig,
    ReuseScope,
    SsmLayerConfig,
    hookimpl,
)
from kvcm_core.frame import FrameFormat, LevelFrames
from kvcm_core.testing.faults import FaultPlan, FaultyTier, faulty_tier_spec
from kvcm_core.testing.fingerprint import FingerprintEngine, StepWork

TPB = 4
#: Bytes per buffer page: one 16-byte record per token slot.
PAGE = 16 * TPB


# -- model layouts ------------------------------------------------------------------------


def kv(size: int = PAGE) -> list[BufferConfig]:
    return [BufferConfig(role="k", size=size), BufferConfig(role="v", size=size)]


def full_layers() -> list[Any]:
    """Two full-attention layers of K and V: one life cycle, 4 pages of 64 bytes a slot."""
    return [AttentionLayerConfig(layer_id=0, buffers=kv()),
            AttentionLayerConfig(layer_id=1, buffers=kv())]


def hybrid_layers() -> list[Any]:
    """Full attention, windowed attention with sink tokens, and an SSM layer: three life
    cycles with different page sizes (three GPU pool groups, several cold groups)."""
    return [
        AttentionLayerConfig(layer_id=0, buffers=kv()),
        AttentionLayerConfig(layer_id=1, buffers=[BufferConfig(role="k", size=2 * PAGE)],
                             sliding_window_size=8, num_sink_tokens=4),
        AttentionLayerConfig(layer_id=2, buffers=kv()),
        SsmLayerConfig(layer_id=3, buffers=[BufferConfig(role="state", size=48)]),
    ]


LAYOUTS = {"full": full_layers, "hybrid": hybrid_layers}


# -- managers sized in slots --------------------------------------------------------------

_UNITS: dict[str, tuple[int, list[int]]] = {}


def _units(layout: str) -> tuple[int, list[int]]:
    """(GPU quota bytes per slot per life cycle, the cold page size of each life cycle)."""
    if layout not in _UNITS:
        cfg = KVCacheManagerConfig(
            tokens_per_block=TPB, layers=LAYOUTS[layout](), kernel_backend="numpy",
            levels=[LevelConfig(tier="gpu", quota=1 << 20),
                    LevelConfig(tier="host", quota=1 << 20)],
            commit_min_snapshot=layout == "hybrid")
        m = KVCacheManager(cfg)
        try:
            gpu = sum(pg.page_bytes * len(pg.life_cycles) for pg in m.layout.pool_groups)
            cold = [key[1] for key in m.storage_levels.cold_key_of]
        finally:
            m.shutdown()
        _UNITS[layout] = (gpu, cold)
    return _UNITS[layout]


def quota(layout: str, level: int, slots: int, framed: bool | None = None,
          blob_codec: bool = False) -> int:
    """Quota bytes giving every life cycle exactly ``slots`` slots at ``level``.

    ``framed``: the level is a disk level, whose slots hold a frame around each cold page
    (default: level 2, where these tests put the disk when a host level comes first);
    ``blob_codec``: it has a blob codec (slots keep room for incompressible pages).
    """
    if framed is None:
        framed = level == 2
    gpu, cold = _units(layout)
    if level == 0:
        unit = gpu
    elif framed:
        frames = LevelFrames(FrameFormat(0, bytes(16)), blob=object() if blob_codec else None)
        unit = sum(frames.slot_bytes(size) for size in cold)
    else:
        unit = sum(cold)
    return slots * unit + unit // 2


def make_levels(layout: str, tiers: Sequence[tuple[str, int]], tmp_path: Path,
                disk: Mapping[str, Any] | None = None,
                evict_ahead: int | None = None) -> list[LevelConfig]:
    """Levels of ``tiers[i] = (tier, slots per life cycle)``; ``disk``: more options of
    disk levels, their ``blob_codec`` and ``write_queue_depth`` (e.g. ``{"mode": "blob",
    "blob_codec": "zstd"}``); ``evict_ahead``: every level's."""
    out = []
    extra = dict(disk or {})
    blob_codec = extra.pop("blob_codec", None)
    depth = extra.pop("write_queue_depth", None)
    for i, (tier, slots) in enumerate(tiers):
        is_disk = "disk" in tier
        options = {"path": str(tmp_path / f"L{i}"), **extra} if is_disk else {}
        size = quota(layout, i, slots, is_disk, is_disk and blob_codec is not None)
        out.append(LevelConfig(tier=tier, quota=size, options=options,
                               blob_codec=blob_codec if is_disk else None,
                               write_queue_depth=depth if is_disk else None,
                               evict_ahead=evict_ahead))
    return out


def make_manager(tiers: Sequence[tuple[str, int]], tmp_path: Path, *, layout: str = "full",
                 pm: KvcmPluginManager | None = None, disk: Mapping[str, Any] | None = None,
                 evict_ahead: int | None = None, **kw: Any) -> KVCacheManager:
    """A manager whose level ``i`` is tier ``tiers[i][0]`` with ``tiers[i][1]`` slots per
    life cycle (GPU pool groups shared by several life cycles get that many per member)."""
    if layout == "hybrid":
        kw.setdefault("commit_min_snapshot", True)
    # Tiny levels: let a request that fills the whole GPU resume (default gate: 0.97).
    kw.setdefault("max_util_for_resume", 1.0)
    cfg = KVCacheManagerConfig(tokens_per_block=TPB, layers=LAYOUTS[layout](),
                               levels=make_levels(layout, tiers, tmp_path, disk,
                                                  evict_ahead),
                               kernel_backend=os.environ.get("KVCM_TEST_BACKEND", "numpy"),
                               **kw)
    m = KVCacheManager(cfg, plugin_manager=pm)
    for pg, store in zip(m.layout.pool_groups, m.stores[0], strict=True):
        assert store.num_slots == tiers[0][1] * len(pg.life_cycles)
    return m


def tokens(n: int, seed: int = 0) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(1, 30000, n)]


# -- the fingerprint driver ---------------------------------------------------------------


class Driver:
    """resize -> fingerprint check + write -> commit, with invariant checks every step."""

    def __init__(self, m: KVCacheManager) -> None:
        self.m = m
        self.engine = FingerprintEngine(m)
        self.toks: dict[int, list[Any]] = {}

    def create(self, toks: Sequence[Any], match_len: int | None = None,
               scope: ReuseScope | None = None, **kw: Any) -> Any:
        if match_len is None:
            match_len = max(0, len(toks) - 1)
        cache = self.m.create_kv_cache(scope, list(toks[:match_len]), **kw)
        self.toks[id(cache)] = list(toks)
        return cache

    def work(self, *caches: Any) -> list[StepWork]:
        return [StepWork(c, self.toks[id(c)]) for c in caches]

    def check(self, *caches: Any) -> None:
        self.engine.check(self.work(*caches))

    def step(self, cache: Any, n: int) -> bool:
        toks = self.toks[id(cache)]
        hist = cache.history_length
        cap = min(len(toks), hist + n)
        if not cache.resize(cap):
            return False
        self.engine.step(self.work(cache))
        cache.commit(toks[hist:cap])
        assert_invariants(self.m)
        return True

    def run_to(self, cache: Any, end: int | None = None, chunk: int = 5) -> None:
        """Resume if needed, then step to ``end`` (default: every token)."""
        if end is None:
            end = len(self.toks[id(cache)])
        assert end <= len(self.toks[id(cache)]), "the request has fewer tokens"
        if cache.status.name != "ACTIVE":
            assert cache.resume()
        while cache.history_length < end:
            assert self.step(cache, min(chunk, end - cache.history_length))
        self.check(cache)

    def write(self, toks: Sequence[Any], end: int | None = None, chunk: int = 5,
              suspend: bool = True, **kw: Any) -> Any:
        """A request that writes its KV to ``end`` and is then suspended (or left active)."""
        cache = self.create(toks, **kw)
        self.run_to(cache, end, chunk)
        if suspend:
            cache.suspend()
            assert_invariants(self.m)
        return cache

    def resume_and_verify(self, *caches: Any) -> None:
        """Resume each cache, check every byte of its history, suspend it again (one at a
        time, so small GPU levels suffice)."""
        for c in caches:
            assert c.resume(), c
            assert all(lv == 0 for lv in page_levels(c))
            self.check(c)
            c.suspend()
            assert_invariants(self.m)


# -- where pages are ------------------------------------------------------------------------


def cache_pages(cache: Any) -> list[int]:
    """Every page id a cache owns (attention pages, live SSM states, pending reuse claims),
    lost pages (level -1, kept by their owner until it lets go) included."""
    m = cache.manager
    level = m.storage_levels.arena.level
    out = [p for g in range(m.num_cache_groups) for p in cache.pages(g) if p >= 0]
    # page_ids(): the live references (level >= 0) first, then the pending claims.
    nlive = sum(1 for p in out if level[p] >= 0)
    out.extend(cache.page_ids()[nlive:])
    return out


def page_level(m: KVCacheManager, pid: int) -> int:
    return int(m.storage_levels.arena.level[pid])


def page_levels(cache: Any) -> list[int]:
    level = cache.manager.storage_levels.arena.level
    return [int(level[p]) for p in cache_pages(cache)]


def level_counts(cache: Any, nlevels: int) -> list[int]:
    lv = page_levels(cache)
    return [lv.count(i) for i in range(nlevels)]


def assert_invariants(m: KVCacheManager) -> None:
    """The manager's invariants plus the public identity on every level."""
    m.check_invariants()
    for level in range(len(m.levels)):
        st = m.get_storage_statistics(level)
        assert st.free + st.evictable + st.unavailable == st.total, st


def assert_all_free(m: KVCacheManager) -> None:
    """Every cache closed, tree cleared: every slot of every level is free."""
    assert m.num_open_caches == 0
    m.clear_reusable_blocks()
    assert_invariants(m)
    for level in range(len(m.levels)):
        st = m.get_storage_statistics(level)
        assert st.free == st.total, st


def close_all(m: KVCacheManager) -> None:
    for cache in m.open_caches:
        cache.close()
        assert_invariants(m)


def snapshot(m: KVCacheManager, *caches: Any) -> Any:
    """Everything a failed operation must leave as it was: per-level statistics, every
    store's slot table and queues, and each cache's lengths, status, page tables and page
    places."""
    stats = [m.get_storage_statistics(lv).as_dict() for lv in range(len(m.levels))]
    a = m.storage_levels.arena
    stores = [
        (s.level, s.pool_group, s.num_slots, sorted(s.free_slots().tolist()),
         len(s.droppable), len(s.held),
         [None if p < 0 else (p, int(a.locks[p]), int(a.holds[p]))
          for p in (s.page_at(slot) for slot in range(s.num_slots))])
        for level in m.stores for s in level
    ]
    per_cache = [
        (c.status, c.capacity, c.history_length, c.num_committed_tokens, c.num_blocks,
         [[int(x) for x in c.get_base_page_indices(g)] for g in range(m.num_cache_groups)],
         [(p, int(a.level[p]), int(a.slot[p]), int(a.locks[p]), int(a.holds[p]))
          for p in cache_pages(c)])
        for c in caches
    ]
    return stats, stores, per_cache


# -- plugins ----------------------------------------------------------------------------------


class TierPlugin:
    """A hand-registered plugin yielding one tier record."""

    def __init__(self, spec: Any) -> None:
        self.spec = spec

    @hookimpl
    def kvcm_tiers(self):
        yield self.spec


class Recorder(EventSink):
    def __init__(self) -> None:
        self.events: list[BlockEvent] = []

    def on_events(self, events: Sequence[BlockEvent]) -> None:
        self.events.extend(events)


class SinkPlugin:
    def __init__(self, sink: EventSink) -> None:
        self.sink = sink

    @hookimpl
    def kvcm_event_sinks(self, config):
        return [self.sink]


def faulty_disk(plan: FaultPlan, pm: KvcmPluginManager | None = None
                ) -> KvcmPluginManager:
    """A fresh plugin manager with a ``faulty-disk`` tier: the disk tier wrapped in
    :class:`FaultyTier` following ``plan``."""
    pm = pm or KvcmPluginManager()
    spec = faulty_tier_spec(pm.tier("disk"), plan, name="faulty-disk")
    pm.register(TierPlugin(spec), name="faults")
    return pm


def faulty_tier(m: KVCacheManager, level: int) -> FaultyTier:
    tier = m.storage_levels.tiers[level]
    assert isinstance(tier, FaultyTier)
    return tier


def chain(m: KVCacheManager, toks: Sequence[int], scope: ReuseScope | None = None
          ) -> list[int]:
    """The tree node ids of ``toks``'s full blocks, as far as the chain exists."""
    from kvcm_core.radix import NO_NODE, block_keys, scope_root_key

    root = m.tree.roots().get(scope_root_key(scope or ReuseScope()))
    out: list[int] = []
    if root is None:
        return out
    node = root
    tpb = m.tokens_per_block
    nfull = len(toks) // tpb
    keys = block_keys(scope_root_key(scope or ReuseScope()), list(toks), tpb, 0, nfull)
    for k in keys:
        node = m.tree.child(node, k)
        if node == NO_NODE:
            break
        out.append(node)
    return out


def node_pages(m: KVCacheManager, nid: int) -> list[int]:
    """The page ids of a tree node, one per cache group (-1: none)."""
    return [m.tree.page(nid, g) for g in range(m.num_cache_groups)]
