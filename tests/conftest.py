"""Shared helpers for the manager tests: small model configurations, a driver that runs
one cache step by step through the fingerprint engine, and invariant checks.

Every step a test drives goes through :class:`~kvcm_core.testing.fingerprint.
FingerprintEngine` (check what the history needs, then write this step's records), so a
wrong page, a stale page left in a table or a corrupted copy fails the test at once.
"""

from __future__ import annotations

import gc
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import pytest
from hypothesis import settings

from kvcm_core import (
    BAD_PAGE_INDEX,
    AttentionLayerConfig,
    BufferConfig,
    FingerprintPages,
    KVCacheManager,
    KVCacheManagerConfig,
    LevelConfig,
    ReusePolicy,
    ReuseScope,
    SsmLayerConfig,
)
from kvcm_core.testing.fingerprint import FingerprintEngine, StepWork

TPB = 4
#: Bytes per buffer page: 16 bytes per token record for TPB tokens.
PAGE = 16 * TPB
BIG_QUOTA = 1 << 20

# -- configurations ---------------------------------------------------------------------


def kv(size: int = PAGE, policy: ReusePolicy | None = None) -> list[BufferConfig]:
    """A key and a value buffer of ``size`` bytes per block."""
    return [BufferConfig(role="k", size=size, reuse_policy=policy),
            BufferConfig(role="v", size=size, reuse_policy=policy)]


# CI runs the property tests derandomised, so a submission's result never depends on luck;
# locally they explore new examples every run (and `KVCM_HYPOTHESIS_PROFILE=ci` reproduces CI).
settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True)
settings.register_profile("dev", deadline=None, print_blob=True)
settings.load_profile(os.environ.get("KVCM_HYPOTHESIS_PROFILE",
                                     "ci" if os.environ.get("CI") else "dev"))

#: Kernel backend the manager tests run on: numpy here; set ``KVCM_TEST_BACKEND=cuda`` (or
#: ``cupy``) on a GPU machine to run the same fingerprint-verified tests there.
TEST_BACKEND = os.environ.get("KVCM_TEST_BACKEND", "numpy")


def make_config(layers: Sequence[Any], *, quota: int = BIG_QUOTA, tpb: int = TPB,
                **kw: Any) -> KVCacheManagerConfig:
    return KVCacheManagerConfig(
        tokens_per_block=tpb, layers=list(layers),
        levels=[LevelConfig(tier="gpu", quota=quota)], kernel_backend=TEST_BACKEND, **kw)


def full_layers(tpb: int = TPB) -> list[Any]:
    """Two full-attention layers of K and V: one life cycle, one pool of 4 pages a slot."""
    page = 16 * tpb
    return [AttentionLayerConfig(layer_id=0, buffers=kv(page)),
            AttentionLayerConfig(layer_id=1, buffers=kv(page))]


def windowed_layers(window: int = 8, sinks: int = 4, tpb: int = TPB) -> list[Any]:
    """Two windowed layers with sink tokens (one life cycle)."""
    page = 16 * tpb
    return [AttentionLayerConfig(layer_id=0, buffers=kv(page), sliding_window_size=window,
                                 num_sink_tokens=sinks),
            AttentionLayerConfig(layer_id=1, buffers=kv(page), sliding_window_size=window,
                                 num_sink_tokens=sinks)]


def hybrid_layers(window: int = 8, sinks: int = 4, ssm: bool = True,
                  tpb: int = TPB) -> list[Any]:
    """Full attention, windowed attention with sinks and (optionally) an SSM layer.

    Page sizes differ per kind so every life cycle has its own pool group.
    """
    page = 16 * tpb
    layers: list[Any] = [
        AttentionLayerConfig(layer_id=0, buffers=kv(page)),
        AttentionLayerConfig(layer_id=1, buffers=[BufferConfig(role="k", size=2 * page)],
                             sliding_window_size=window, num_sink_tokens=sinks),
        AttentionLayerConfig(layer_id=2, buffers=kv(page)),
    ]
    if ssm:
        layers.append(SsmLayerConfig(layer_id=3, buffers=[BufferConfig(role="state",
                                                                        size=48)]))
    return layers


def bytes_per_slot_round(layers: Sequence[Any], tpb: int = TPB, **kw: Any) -> int:
    """Quota bytes that give every life cycle one slot (the default quota split)."""
    m = KVCacheManager(make_config(layers, tpb=tpb, **kw))
    try:
        return sum(pg.page_bytes * len(pg.life_cycles) for pg in m.layout.pool_groups)
    finally:
        m.shutdown()


def make_manager(layers: Sequence[Any], *, slots: int | None = None, tpb: int = TPB,
                 **kw: Any) -> KVCacheManager:
    """A manager; ``slots``: every life cycle gets exactly that many GPU slots."""
    if slots is None:
        return KVCacheManager(make_config(layers, tpb=tpb, **kw))
    unit = bytes_per_slot_round(layers, tpb=tpb, **kw)
    m = KVCacheManager(make_config(layers, tpb=tpb, quota=slots * unit + unit // 2, **kw))
    for pg, store in zip(m.layout.pool_groups, m.stores[0], strict=True):
        assert store.num_slots == slots * len(pg.life_cycles), (store.num_slots, slots)
    return m


def tokens(n: int, seed: int = 0, lo: int = 1, hi: int = 30000) -> list[int]:
    """``n`` random token ids (deterministic per seed)."""
    return [int(t) for t in np.random.default_rng(seed).integers(lo, hi, n)]


# -- driving caches through the fingerprint engine ----------------------------------------


class Driver:
    """Runs caches of one manager step by step: resize -> fingerprint check+write ->
    commit. Every step checks the manager's invariants too.

    Args:
        manager: the manager under test.
    """

    def __init__(self, manager: KVCacheManager) -> None:
        self.m = manager
        self.engine = FingerprintEngine(manager)
        self.toks: dict[int, list[Any]] = {}

    def create(self, toks: Sequence[Any], scope: ReuseScope | None = None,
               match_len: int | None = None, **kw: Any) -> Any:
        """A cache for a request whose tokens are ``toks``; the prefix match looks at
        ``toks[:match_len]`` (default: every token but the last)."""
        if match_len is None:
            match_len = max(0, len(toks) - 1)
        cache = self.m.create_kv_cache(scope, list(toks[:match_len]), **kw)
        self.toks[id(cache)] = list(toks)
        return cache

    def check(self, *caches: Any) -> None:
        """Check every page the caches' histories need (no write)."""
        self.engine.check([StepWork(c, self.toks[id(c)]) for c in caches])

    def step(self, cache: Any, n: int, *, commit: bool = True) -> bool:
        """Give ``cache`` its next ``n`` tokens: resize, check, write, commit. Returns
        False (after checking nothing changed) when resize fails."""
        toks = self.toks[id(cache)]
        hist = cache.history_length
        cap = hist + n
        assert cap <= len(toks), f"request has only {len(toks)} tokens"
        if not cache.resize(cap):
            return False
        self.engine.step([StepWork(cache, toks)])
        if commit:
            cache.commit(toks[hist:cap])
        assert_invariants(self.m)
        return True

    def steps(self, caches: Sequence[Any], n: int) -> None:
        """One batched step of ``n`` tokens for several caches."""
        work = []
        for c in caches:
            assert c.resize(c.history_length + n)
            work.append(StepWork(c, self.toks[id(c)]))
        self.engine.step(work)
        for c in caches:
            hist = c.history_length
            c.commit(self.toks[id(c)][hist : hist + n])
        assert_invariants(self.m)

    def run_to(self, cache: Any, end: int, chunk: int = 5) -> None:
        """Resume if needed, then step until history reaches ``end``."""
        if cache.status.name != "ACTIVE":
            assert cache.resume()
        while cache.history_length < end:
            assert self.step(cache, min(chunk, end - cache.history_length))

    def run(self, toks: Sequence[Any], *, end: int | None = None, chunk: int = 5,
            close: bool = True, scope: ReuseScope | None = None, **kw: Any) -> Any:
        """A whole request: create, resume, prefill/decode to ``end``, close."""
        cache = self.create(toks, scope, **kw)
        self.run_to(cache, len(toks) if end is None else end, chunk)
        self.check(cache)
        if close:
            cache.close()
            assert_invariants(self.m)
        return cache


def assert_invariants(m: KVCacheManager) -> None:
    """The manager's own invariants plus the public accounting identity."""
    m.check_invariants()
    st = m.get_storage_statistics(0)
    assert st.free + st.evictable + st.unavailable == st.total, st


def assert_all_free(m: KVCacheManager) -> None:
    """After every cache closed and the tree was cleared: every slot is free."""
    assert m.num_open_caches == 0
    m.clear_reusable_blocks()
    assert_invariants(m)
    st = m.get_storage_statistics(0)
    assert st.free == st.total, st


def table(cache: Any, group: int) -> list[int]:
    return [int(x) for x in cache.get_base_page_indices(group)]


def snapshot_state(m: KVCacheManager, *caches: Any) -> Any:
    """Everything a failed operation must leave unchanged."""
    st = m.get_storage_statistics(0).as_dict()
    per_cache = [
        (c.status, c.capacity, c.history_length, c.num_committed_tokens, c.num_blocks,
         [table(c, g) for g in range(m.num_cache_groups)]
         if c.status.name != "CLOSED" else None, repr(c.stats))
        for c in caches
    ]
    stores = [(s.num_free, len(s.droppable), len(s.held)) for s in m.stores[0]]
    return st, per_cache, stores, repr(m.storage_levels.stats)


def page_holds(m: KVCacheManager, layer_id: int, role: str, slot: int, toks: Sequence[int],
               block: int, n: int, address: int | None = None) -> bool:
    """Backdoor read: whether page ``slot`` of a buffer (or the page at ``address``) holds
    the fingerprint records of tokens ``[block*tpb, block*tpb + n)`` of ``toks`` (beam 0).
    """
    if address is None:
        address = (m.get_mem_pool_base_address(layer_id, role)
                   + slot * m.get_page_stride(layer_id, role))
    tpb = m.tokens_per_block
    ordinal = next(i for layer in m.config.layers if layer.layer_id == layer_id
                   for i, b in enumerate(layer.buffers) if b.role == role)
    size = m.buffer_attr(layer_id, role).size
    ids = np.zeros((1, tpb), dtype=np.uint32)
    part = np.asarray(toks[block * tpb : block * tpb + n], dtype=np.uint32)
    ids[0, : len(part)] = part
    pages = FingerprintPages(
        addresses=np.array([address], dtype=np.int64),
        page_bytes=np.array([size], dtype=np.int64),
        record_slots=np.array([tpb], dtype=np.int32),
        token_ids=ids,
        begin=np.array([0], dtype=np.int32),
        end=np.array([n], dtype=np.int32),
        positions=np.array([block * tpb], dtype=np.int64),
        tags=np.array([[layer_id, ordinal << 16]], dtype=np.uint32),
    )
    return bool(m.backend.fingerprint_check(pages)[0])


def tree_node(m: KVCacheManager, toks: Sequence[int], end: int,
              scope: ReuseScope | None = None) -> int | None:
    """The prefix-tree node id of the block ending at token ``end`` of ``toks`` (a full
    block when ``end`` is a block boundary, else a partial child holding exactly the tokens
    of that block up to ``end``), or None. Walks the tree by key; for tests only."""
    from kvcm_core.radix import NO_NODE, block_keys, scope_root_key

    tpb = m.tokens_per_block
    root_key = scope_root_key(scope)
    node = m.tree.roots().get(root_key, NO_NODE)
    nfull = end // tpb
    for key in block_keys(root_key, list(toks), tpb, 0, nfull):
        if node == NO_NODE:
            return None
        node = m.tree.child(node, key)
    if node == NO_NODE:
        return None
    if end % tpb == 0:
        return int(node)
    want = tuple(toks[nfull * tpb : end])
    return next((int(p) for p in m.tree.partial_children(node)
                 if m.tree.block_tokens(p) == want), None)


def tree_page(m: KVCacheManager, toks: Sequence[int], block: int, group: int,
              scope: ReuseScope | None = None) -> int | None:
    """The committed page id of full block ``block`` of ``toks`` in the tree, or None."""
    node = tree_node(m, toks, (block + 1) * m.tokens_per_block, scope)
    if node is None:
        return None
    pid = m.tree.page(node, group)
    return None if pid < 0 else pid


def slot_of(m: KVCacheManager, pid: int | None) -> int:
    """The slot of page ``pid`` in its store (the page must exist)."""
    assert pid is not None and pid >= 0, pid
    assert int(m.storage_levels.arena.level[pid]) >= 0, m.storage_levels.arena.describe(pid)
    return int(m.storage_levels.arena.slot[pid])


def drop_page(m: KVCacheManager, pid: int | None) -> None:
    """Evict one droppable page the way eviction does (tree entry removed, slot freed)."""
    assert pid is not None and pid >= 0, pid
    levels = m.storage_levels
    store = levels.store_of(pid)
    assert pid in store.droppable, levels.arena.describe(pid)
    levels.drop(store, np.array([pid], dtype=np.int64), queued=True)


# -- fixtures ---------------------------------------------------------------------------


@pytest.fixture
def cleanup() -> Iterator[Callable[[KVCacheManager], None]]:
    """Collects managers built with ``levels_helpers.make_manager``; at the end closes the
    caches still open, checks every slot of every level is free and shuts them down."""
    from levels_helpers import assert_all_free as all_levels_free
    from levels_helpers import close_all

    made: list[KVCacheManager] = []
    yield made.append
    for m in made:
        if m.is_shut_down:
            continue
        close_all(m)
        all_levels_free(m)
        m.shutdown()


@pytest.fixture
def managers() -> Iterator[Callable[..., KVCacheManager]]:
    """Builds managers (``make_manager`` arguments) and checks, at the end of the test,
    that closing every cache still open and clearing the tree frees every slot."""
    made: list[KVCacheManager] = []

    def build(layers: Sequence[Any], **kw: Any) -> KVCacheManager:
        m = make_manager(layers, **kw)
        made.append(m)
        return m

    yield build
    for m in made:
        if m.is_shut_down:
            continue
        for cache in list(m.open_caches):
            cache.close()
        assert_all_free(m)
        m.shutdown()


__all__ = [
    "BAD_PAGE_INDEX", "PAGE", "TPB", "Driver", "assert_all_free", "assert_invariants",
    "drop_page", "full_layers", "hybrid_layers", "kv", "make_config", "make_manager", "page_holds",
    "slot_of", "snapshot_state", "table", "tokens", "tree_node", "tree_page", "windowed_layers",
]


@pytest.fixture(params=[False, True], ids=["lazy", "eager-default"])
def deferred_schedule(request: pytest.FixtureRequest) -> Iterator[bool]:
    """Runs a test of the deferred backend (tests/deferred_backend.py) under two legal
    schedules: queued work runs only when waited for, or work on the default stream also
    runs as soon as it is queued (a GPU may run an idle stream at once). Use it with
    ``pytestmark = pytest.mark.usefixtures("deferred_schedule")``."""
    from deferred_backend import DeferredBackend

    old = DeferredBackend.eager_default
    DeferredBackend.eager_default = request.param
    yield request.param
    DeferredBackend.eager_default = old


def open_fds() -> list[str]:
    """This process's open file descriptors, once the managers earlier code dropped
    without shutdown() are released: they are collected with a cycle, and their levels
    close on a thread of their own (``kvcm-release``), so a collection that falls inside a
    test would otherwise change the count it compares."""
    gc.collect()
    for t in threading.enumerate():
        if t.name == "kvcm-release":
            t.join(30)
    return os.listdir("/proc/self/fd")
