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
        cold_unit = sum(key[1] * sum(1 for k in probe._cold_key_of if k == key)
                        for key in probe._cold_keys)
        min_cold = min(key[1] for key in probe._cold_keys)
    finally:
        probe.shutdown()
    levels = [LevelConfig(tier=stack[0], quota=gpu_quota)]
    for i, tier in enumerate(stack[1:], start=1):
        options = {}
        if tier == "disk":
            assert tmp_path is not None, "a disk level needs tmp_path"
            options = {"path": str(tmp_path / f"L{i}")}
        levels.append(LevelConfig(tier=tier, quota=slots[i] * cold_unit + min_cold // 2,
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


def tree_nodes(m: KVCacheManager) -> Iterator[Any]:
    for root in m.tree.roots.values():
        for node in root.subtree():
            if node is not root:
                yield node


def drop(m: KVCacheManager, node: Any, group: int) -> None:
    """Evict one droppable page of the tree the way eviction does (``_drop``)."""
    page = node.pages[group]
    assert page is not None and not page.locks and not page.holds, page
    m._drop(page, from_policy=False)
    assert_invariants(m)


def evict_level(m: KVCacheManager, level: int) -> None:
    """Empty every store of ``level`` the way eviction does: held pages move one level
    down (making room there), droppable ones move down or are dropped."""
    for store in m.stores[level]:
        m._make_room(store, store.num_slots)
    assert_invariants(m)


def cache_pages(cache: Any, group: int | None = None) -> list[Any]:
    """Every page a cache owns (attention pages, live SSM states, pending claims)."""
    out = [p for pages in cache._pages for p in pages if p is not None]
    out.extend(p for p in cache._ssm if p is not None)
    out.extend(src for _, _, src in cache._pending)
    if group is not None:
        out = [p for p in out if p.group == group]
    return out


def assert_invariants(m: KVCacheManager) -> None:
    m.check_invariants()
    for level in range(len(m.levels)):
        st = m.get_storage_statistics(level)
        assert st.free + st.evictable + st.unavailable == st.total, st


def assert_no_private_in_tree(m: KVCacheManager) -> None:
    private = set(groups_with(m, P.PRIVATE))
    for node in tree_nodes(m):
        for g in private:
            assert node.pages[g] is None, f"PRIVATE group {g} published at {node}"


def assert_all_free(m: KVCacheManager) -> None:
    assert m.num_open_caches == 0
    m.clear_reusable_blocks()
    assert_invariants(m)
    for level in range(len(m.levels)):
        st = m.get_storage_statistics(level)
        assert st.free == st.total, st
