"""Sparse attention on the numpy backend: host-backed sparse pools, the batch's leases and
cells, resolve / fetch / write indices / flush through the Batch, fingerprint-verified engine
runs whose hit and miss counts equal an exact LRU, and the misuse paths."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sparse_helpers import PREEMPTING, TPB, UT, requests, run_loop, sparse_config

from kvcm_core import (
    Batch,
    ConfigError,
    InvalidArgumentError,
    InvalidStateError,
    KVCacheManager,
)
from kvcm_core.backend import MemoryKind
from kvcm_core.records import KernelBackendCapabilities
from kvcm_core.sparse.storage import check_sparse_backend
from kvcm_core.testing.engine import EngineLoop


def _manager(**kw: Any) -> KVCacheManager:
    return KVCacheManager(sparse_config(**kw))


def _cache(m: KVCacheManager, history: int, capacity: int | None = None, seed: int = 0) -> Any:
    toks = [int(x) for x in np.random.default_rng(seed).integers(1, 30000, 4 * TPB * 8)]
    c = m.create_kv_cache(None, toks[:history])
    assert c.resume()
    if history:
        assert c.resize(history) and c.resize(history, history)
    if capacity is not None:
        assert c.resize(capacity)
    return c


def _host_unit(m: KVCacheManager, cache: Any, layer: int, role: str, unit: int) -> np.ndarray:
    region = m.get_page_region(layer, role)
    size = m.buffer_attr(layer, role).size
    ub = size // (TPB // UT)
    g = m.get_buffer_group_id(layer, role)
    slot = int(cache.get_base_page_indices(g)[unit // (TPB // UT)])
    at = region.page_start(slot) + (unit % (TPB // UT)) * ub
    return region.buffer.host_view()[at: at + ub]


def _entry(b: Batch, row: int, layer: int, role: str, entry: int) -> np.ndarray:
    c = b.sparse_cells(layer, role)
    at = c.cells.page_start(b.sparse_lease(row) * c.lease_cells + entry // c.units_per_page) \
        + (entry % c.units_per_page) * c.unit_bytes
    return c.cells.buffer.host_view()[at: at + c.unit_bytes]


def _fill_host(m: KVCacheManager, seed: int = 7) -> None:
    """Random bytes in every sparse host pool."""
    rng = np.random.default_rng(seed)
    for pg, store in zip(m.layout.pool_groups, m.stores[0], strict=True):
        if pg.sparse:
            for pool in store.pools:
                view = pool.buffer.host_view()
                view[:] = rng.integers(0, 256, view.size, dtype=np.uint8)


def _filled(rows: int, history: int, capacity: int | None = None
            ) -> tuple[KVCacheManager, Batch, Any]:
    """Random bytes in the sparse host pools, one cache seated in row 0, published."""
    m = _manager()
    _fill_host(m)
    b = Batch(m, max_rows=rows, max_blocks_per_row=8)
    cache = _cache(m, history, capacity)
    b.add_kv_cache(cache)
    b.publish()
    return m, b, cache


SPARSE_BUFFERS = [(0, "k"), (0, "v"), (1, "k"), (1, "v")]


# -- storage and configuration ------------------------------------------------------------------


def test_sparse_pools_live_in_host_memory_on_level_0_under_their_own_quota() -> None:
    m = _manager(quota=1 << 20, sparse_host_quota=3 << 20)
    for pg, store in zip(m.layout.pool_groups, m.stores[0], strict=True):
        kinds = {p.buffer.kind for p in store.pools}
        nbytes = sum(p.nbytes for p in store.pools)
        if pg.sparse:
            assert kinds == {MemoryKind.HOST}
            assert (3 << 20) - pg.page_bytes < nbytes <= 3 << 20
        else:
            assert kinds == {MemoryKind.DEVICE}
            assert nbytes <= 1 << 20
    sparse_slots = [s.num_slots for pg, s in zip(m.layout.pool_groups, m.stores[0],
                                                 strict=True) if pg.sparse]
    assert m.resize(0, 1 << 19)  # level 0's quota moves the dense groups only
    assert sparse_slots == [s.num_slots for pg, s in zip(m.layout.pool_groups, m.stores[0],
                                                         strict=True) if pg.sparse]
    m.shutdown()


def test_sparse_buffers_need_a_host_capable_kernel_backend() -> None:
    class NoHost:
        capabilities = KernelBackendCapabilities(has_device=True, host_mapped=False)

    with pytest.raises(ConfigError, match="host-capable") as info:
        check_sparse_backend(sparse_config(), NoHost(), "nohost")  # type: ignore[arg-type]
    assert info.value.field == "kernel_backend" and info.value.value == "nohost"


# -- leases and cells --------------------------------------------------------------------------


def test_rows_hold_the_lowest_free_lease_returned_on_remove_and_carried_by_move() -> None:
    m = _manager()
    b = Batch(m, max_rows=4, max_blocks_per_row=8)
    a, c, d = (_cache(m, 16, seed=i) for i in range(3))
    for cache in (a, c, d):
        b.add_kv_cache(cache)
    assert [b.sparse_lease(r) for r in range(4)] == [0, 1, 2, -1]
    b.remove_kv_cache(c)
    b.move(d, 3)
    assert [b.sparse_lease(r) for r in range(4)] == [0, -1, -1, 2]
    e = _cache(m, 16, seed=5)
    assert b.add_kv_cache(e) == 1 and b.sparse_lease(1) == 1
    b.publish()
    np.testing.assert_array_equal(b.sparse_lease_table(), [0, 1, -1, 2])
    b.close()


def test_every_buffer_of_a_layer_has_its_own_cells_by_the_address_rule() -> None:
    """Entry e of buffer b: cell lease * cells_per_lease + slot_in_pool(b) *
    cells_per_buffer + e // units_per_page; no two buffers share a byte of a lease."""
    m = _manager()
    b = Batch(m, max_rows=2, max_blocks_per_row=8)
    per_buffer = 3  # ceil(max working set 12 / 4 units per page)
    spans: dict[int, list[tuple[int, int]]] = {}
    for layer, role in [*SPARSE_BUFFERS, (2, "kv")]:
        c = b.sparse_cells(layer, role)
        attr = m.buffer_attr(layer, role)
        in_pool = m.get_page_stride(layer, role) // attr.size
        assert c.lease_cells == in_pool * per_buffer
        assert c.cells.stride == attr.size
        assert c.cells.offset == (attr.offset // attr.size) * per_buffer * attr.size
        assert c.unit_bytes == attr.size // (TPB // UT)
        spans.setdefault(c.cells.buffer.ptr, []).append(
            (c.cells.offset, c.cells.offset + per_buffer * c.cells.stride))
    for ranges in spans.values():
        ranges.sort()
        assert all(x[1] <= y[0] for x, y in itertools.pairwise(ranges))
    b.close()


# -- resolve, fetch, write indices, flush ----------------------------------------------------------


def test_fetch_copies_each_missed_unit_of_every_buffer_of_the_group_into_its_entry() -> None:
    m = _manager()
    _fill_host(m)
    b = Batch(m, max_rows=3, max_blocks_per_row=8)
    caches = [_cache(m, 96, seed=i) for i in range(2)]
    b.add_kv_cache(caches[0])
    b.add_kv_cache(caches[1], row=2)
    b.publish()
    sel = np.full((3, 4), -1, dtype=np.int32)
    sel[0] = [3, 0, 3, 17]  # a duplicate, resolved to one entry
    sel[2] = [23, -1, 5, 40]  # -1 and an id past max_units (8 blocks * 4): unused slots
    sel[1] = [1, 2, 3, 4]  # an empty row: ignored
    emap = np.array(b.resolve_sparse_selection(1, sel))  # any layer names the group
    np.testing.assert_array_equal(emap[0], [0, 1, 0, 2])
    assert emap[0, 0] == emap[0, 2] and (emap[1] == -1).all()
    np.testing.assert_array_equal(emap[2], [0, -1, 1, -1])
    for layer in (0, 1):
        b.fetch_resolved_pages(layer)
    for r, cache in ((0, caches[0]), (2, caches[1])):
        for s, unit in enumerate(sel[r]):
            if unit < 0 or unit >= 24:
                continue
            for layer, role in SPARSE_BUFFERS:
                np.testing.assert_array_equal(_entry(b, r, layer, role, int(emap[r, s])),
                                              _host_unit(m, cache, layer, role, int(unit)))
    assert b.peek_hit_miss_counter() == (0, 5)  # distinct units
    b.close()


def test_misses_take_free_entries_lowest_first_then_the_least_recently_used() -> None:
    m = _manager()
    b = Batch(m, max_rows=1, max_blocks_per_row=8)
    b.add_kv_cache(_cache(m, 128))
    b.publish()

    def step(units: list[int]) -> list[int]:
        out = np.array(b.resolve_sparse_selection(0, np.array([units], dtype=np.int32)))
        b.fetch_resolved_pages(0)
        b.fetch_resolved_pages(1)
        return out[0].tolist()

    assert step([0, 1, 2, 3]) == [0, 1, 2, 3]
    assert step([4, 5, 6, 7]) == [4, 5, 6, 7]
    assert step([8, 9, 10, 11]) == [8, 9, 10, 11]  # all 12 entries in use
    assert step([3, 2, 1, 0]) == [3, 2, 1, 0]  # hits; 3 is now older than 0 (slot order)
    # Least recent first: units 4, 5, 6, 7 (entries 4..7), then 8.. are newer than 3..0.
    assert step([20, 21, 22, 23]) == [4, 5, 6, 7]
    assert step([24, 25, 26, 27]) == [8, 9, 10, 11]
    assert step([28, 29, 30, 31]) == [3, 2, 1, 0]  # unit 3 took slot 0 of its step: oldest
    assert b.peek_hit_miss_counter() == (4, 24)
    b.close()


def test_in_flight_units_are_pinned_and_a_selected_one_is_a_hit_on_its_entry() -> None:
    m = _manager()
    b = Batch(m, max_rows=1, max_blocks_per_row=16)
    cache = _cache(m, 160)
    b.add_kv_cache(cache)
    b.resize(np.array([166]))  # units 40 and 41 in flight
    pinned = np.array(b.prepare_sparse_write_indices(0))[0]
    assert pinned[0] >= 0 and pinned[1] >= 0 and (pinned[2:] == -1).all()
    rng = np.random.default_rng(0)
    for _ in range(20):
        sel = rng.choice(40, 4, replace=False).astype(np.int32)[None]
        emap = np.array(b.resolve_sparse_selection(0, sel))
        assert not np.isin(emap, pinned[:2]).any()  # never evicted
        b.fetch_resolved_pages(0)
        b.fetch_resolved_pages(1)
    hits = b.peek_hit_miss_counter()[0]
    emap = np.array(b.resolve_sparse_selection(0, np.array([[41, 40, -1, -1]], np.int32)))
    np.testing.assert_array_equal(emap[0, :2], [pinned[1], pinned[0]])
    assert b.peek_hit_miss_counter()[0] == hits + 2
    b.close()


def test_flush_writes_back_the_units_history_crossed_and_nothing_else() -> None:
    m, b, cache = _filled(2, 10)
    b.resize(np.array([21, -1]))  # tokens 10..20 in flight: units 2..5
    wmap = np.array(b.prepare_sparse_write_indices(0))[0]
    rng = np.random.default_rng(3)
    written = {}
    for k, unit in enumerate(range(2, 6)):
        for layer, role in SPARSE_BUFFERS:
            data = rng.integers(0, 256, _entry(b, 0, layer, role, 0).size, dtype=np.uint8)
            _entry(b, 0, layer, role, int(wmap[k]))[:] = data
            written[(unit, layer, role)] = data
    untouched = [(u, layer, role) for u in (1, 6) for layer, role in SPARSE_BUFFERS]
    before = {key: _host_unit(m, cache, key[1], key[2], key[0]).copy() for key in untouched}
    assert b.resize(np.array([21, -1]), np.array([21, -1])) == [True, True]
    assert b.flush_sparse_units() == 8  # units 2..5 (tokens 10..20), in each of 2 groups
    for (unit, layer, role), data in written.items():
        np.testing.assert_array_equal(_host_unit(m, cache, layer, role, unit), data)
    for key, data in before.items():
        np.testing.assert_array_equal(_host_unit(m, cache, key[1], key[2], key[0]), data)
    b.close()


def test_a_request_that_arrives_with_history_flushes_nothing() -> None:
    m = _manager()
    b = Batch(m, max_rows=1, max_blocks_per_row=8)
    b.add_kv_cache(_cache(m, 40))
    b.publish()
    assert b.flush_sparse_units() == 0
    b.close()


def test_a_pinned_unit_with_history_below_it_is_fetched_from_its_host_page() -> None:
    """A resumed request whose history ends inside a unit: the unit's entry gets the
    tokens already on the host before the new ones are written."""
    m, b, cache = _filled(1, 10, capacity=12)
    entry = int(np.array(b.prepare_sparse_write_indices(0))[0, 0])
    for layer, role in SPARSE_BUFFERS:
        np.testing.assert_array_equal(_entry(b, 0, layer, role, entry),
                                      _host_unit(m, cache, layer, role, 2))
    b.close()


# -- engine runs --------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_engine_runs_with_sparse_layers_are_fingerprint_verified_and_counts_equal_exact_lru(
        seed: int) -> None:
    loop = run_loop(seed=seed)
    sp = loop.sparse
    assert sp is not None and sp.checked_entries > 100
    assert sp.hits > 0 and sp.misses > 0
    assert loop.batch is not None and loop.batch.peek_hit_miss_counter() == (sp.hits, sp.misses)
    assert len(loop.finished) == len(requests(seed))
    loop.close()


class _MovingLoop(EngineLoop):
    """An engine loop that moves a random member to a random empty row before some steps
    (the batch has two rows more than requests run at once)."""

    def __init__(self, manager: KVCacheManager, running: int, seed: int, **kw: Any) -> None:
        super().__init__(manager, max_batch=running + 2, sparse_seed=seed, **kw)
        self.max_batch = running
        self.rng = np.random.default_rng(seed)
        self.moves = 0

    def step(self) -> Any:
        b = self.batch
        assert b is not None
        seated = [c for c in b.members if c is not None]
        empty = [r for r, c in enumerate(b.members) if c is None]
        if seated and self.rng.random() < 0.5:
            b.move(seated[int(self.rng.integers(len(seated)))], int(self.rng.choice(empty)))
            self.moves += 1
        return super().step()


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**31), running=st.integers(1, 5),
       chunk=st.sampled_from([1, 3, 8, 16]))
def test_random_engine_runs_with_moved_rows_hold_their_units_and_count_like_exact_lru(
        seed: int, running: int, chunk: int) -> None:
    """Shared and lone selections, rows moved between steps (leases go with them),
    requests of random lengths prefilled in random chunks: every fetched entry holds its
    unit, every flushed page its tokens, and the counts are the exact LRU's."""
    loop = _MovingLoop(KVCacheManager(sparse_config()), running, seed, chunk_tokens=chunk)
    reqs = requests(seed % 1000, n=6)
    loop.run(reqs)
    assert loop.sparse is not None and loop.batch is not None
    assert loop.batch.peek_hit_miss_counter() == (loop.sparse.hits, loop.sparse.misses)
    assert len(loop.finished) == len(reqs) and loop.moves > 0
    loop.close()


def test_engine_run_with_preemption_resumes_sparse_rows_from_their_host_pages() -> None:
    """Suspended requests come back with histories that end inside a unit."""
    loop = run_loop(seed=5, n=16, **PREEMPTING)
    assert sum(r.preemptions for r in loop.finished) > 0
    loop.close()


# -- misuse -------------------------------------------------------------------------------------


def _seated(rows: int = 2, **kw: Any) -> tuple[KVCacheManager, Batch, Any]:
    m = _manager()
    b = Batch(m, max_rows=rows, max_blocks_per_row=8, **kw)
    cache = _cache(m, 40)
    b.add_kv_cache(cache)
    b.publish()
    return m, b, cache


def test_fused_fetch_on_a_shared_selection_is_refused() -> None:
    _, b, _ = _seated()
    sel = np.full((2, 4), -1, dtype=np.int32)
    with pytest.raises(InvalidStateError, match="shared by layers"):
        b.fetch_sparse_pages(0, sel)
    sel3 = np.array([[1, 2, 3], [-1, -1, -1]], dtype=np.int32)
    emap = np.array(b.fetch_sparse_pages(2, sel3))  # a layer alone: fused is fine
    np.testing.assert_array_equal(emap[0], [0, 1, 2])
    b.close()


def test_resolve_before_every_layer_fetched_the_last_miss_list_is_refused() -> None:
    _, b, _ = _seated()
    sel = np.full((2, 4), -1, dtype=np.int32)
    b.resolve_sparse_selection(0, sel)
    b.fetch_resolved_pages(0)
    with pytest.raises(InvalidStateError, match=r"layers \[1\] fetched"):
        b.resolve_sparse_selection(0, sel)
    b.fetch_resolved_pages(1)
    b.resolve_sparse_selection(1, sel)
    b.close()


def test_fetch_before_any_resolve_is_refused() -> None:
    _, b, _ = _seated()
    with pytest.raises(InvalidStateError, match="before any resolve"):
        b.fetch_resolved_pages(0)
    b.close()


def test_a_flush_of_units_that_were_in_flight_fits_the_write_back_bound() -> None:
    # (was refused: the bound came from max_total_input_tokens, which a cache grown behind
    # the batch's back, or histories moving late, exceed; review 27 F6)
    _, b, cache = _seated(max_total_input_tokens=4)
    assert cache.resize(60)  # units 10..14 in flight
    b.publish()
    assert cache.resize(60, 60)
    assert b.flush_sparse_units() == 2 * 5  # 5 units for each of the 2 selections
    b.resize(np.array([64, -1]))
    b.resize(np.array([64, -1]), np.array([64, -1]))  # history moves on (was: not flushed)
    b.close()


def test_sparse_rows_refuse_beams() -> None:
    m = KVCacheManager(sparse_config(max_beam_width=2))
    b = Batch(m, max_rows=2, max_blocks_per_row=8, max_beam_width=2)
    cache = _cache(m, 16, capacity=20)
    assert cache.set_beam_width(2)
    with pytest.raises(InvalidStateError, match="beam width 2"):
        b.add_kv_cache(cache)
    assert b.row_of(cache) is None
    b.close()


def test_too_many_tokens_in_flight_for_a_working_set_are_refused() -> None:
    _, b, cache = _seated()
    # 8 - 3 = 5 units may be in flight for layer 2's selection: 40..61 is 6 units.
    with pytest.raises(InvalidArgumentError, match="exceed working_set_units"):
        b.resize(np.array([62, -1]))
    assert cache.capacity == 40
    b.close()


def test_moving_history_before_the_last_move_was_flushed_is_refused() -> None:
    _, b, _ = _seated()
    assert b.resize(np.array([44, -1])) == [True, True]
    assert b.resize(np.array([46, -1]), np.array([44, -1])) == [True, True]
    with pytest.raises(InvalidStateError, match="flush_sparse_units first"):
        b.resize(np.array([48, -1]), np.array([46, -1]))
    b.flush_sparse_units()
    assert b.resize(np.array([48, -1]), np.array([46, -1])) == [True, True]
    b.close()


def test_sparse_calls_name_their_bad_arguments() -> None:
    _m, b, _ = _seated()
    with pytest.raises(InvalidArgumentError, match="not a sparse layer"):
        b.resolve_sparse_selection(3, np.zeros((2, 4), np.int32))
    with pytest.raises(InvalidArgumentError, match=r"shape \(2, 4\)"):
        b.resolve_sparse_selection(0, np.zeros((2, 3), np.int32))
    with pytest.raises(InvalidArgumentError, match="sparse buffers are"):
        b.prepare_sparse_write_indices(0, ["ik"])
    b.close()
    dense = KVCacheManager(sparse_config().__class__.from_dict({
        "tokens_per_block": TPB, "levels": [{"tier": "gpu", "quota": 1 << 20}],
        "layers": [{"layer_id": 0, "buffers": [{"role": "kv", "size": 256}]}]}))
    with pytest.raises(InvalidStateError, match="no sparse layers"):
        Batch(dense, max_rows=1, max_blocks_per_row=4).peek_hit_miss_counter()


# -- kvcm simulate ------------------------------------------------------------------------------


def test_simulate_sparse_preset_exits_zero_with_verified_sparse_steps(tmp_path: Any) -> None:
    import json

    from kvcm_core import cli

    out = tmp_path / "sim"
    code = cli.main(["simulate", "--preset", "sparse", "--requests", "15", "--out", str(out),
                     "--no-plots", "--quiet"])
    assert code == 0
    report = json.loads((out / "report.json").read_text())
    assert report["verification"]["ok"] is True
    sparse = report["run"]["verification"]["sparse"]
    assert sparse["hits"] > 0 and sparse["misses"] > 0 and sparse["entries_checked"] > 0


def test_a_flush_publishes_rows_moved_since_the_last_publish_first() -> None:
    m = _manager()
    b = Batch(m, max_rows=3, max_blocks_per_row=8)
    cache = _cache(m, 8)
    b.add_kv_cache(cache)
    b.resize(np.array([12, -1, -1]))
    entry = int(np.array(b.prepare_sparse_write_indices(0))[0, 0])
    data = np.arange(_entry(b, 0, 0, "k", entry).size, dtype=np.uint8)
    _entry(b, 0, 0, "k", entry)[:] = data
    assert cache.resize(12, 12)
    b.move(cache, 2)
    assert b.flush_sparse_units() == 2  # unit 2, in each of two selections
    np.testing.assert_array_equal(_host_unit(m, cache, 0, "k", 2), data)
    b.close()


def test_an_indexer_may_write_the_selection_table_in_place_and_fetch_some_buffers() -> None:
    m, b, cache = _filled(1, 64)
    b.sparse_selection_table(0)[...] = [[5, 6, -1, 9]]
    emap = np.array(b.resolve_sparse_selection(0))  # None: the table as the indexer left it
    np.testing.assert_array_equal(emap[0], [0, 1, -1, 2])
    b.fetch_resolved_pages(0, "k")  # only layer 0's keys
    b.fetch_resolved_pages(1)
    for unit, entry in ((5, 0), (6, 1), (9, 2)):
        np.testing.assert_array_equal(_entry(b, 0, 0, "k", entry),
                                      _host_unit(m, cache, 0, "k", unit))
        assert not np.array_equal(_entry(b, 0, 0, "v", entry),
                                  _host_unit(m, cache, 0, "v", unit))
        np.testing.assert_array_equal(_entry(b, 0, 1, "v", entry),
                                      _host_unit(m, cache, 1, "v", unit))
    b.close()


def test_a_device_array_selection_is_copied_and_a_bad_one_named() -> None:
    """Anything with ``__cuda_array_interface__`` is copied from its address (here a
    stand-in over host memory, which the numpy backend copies like device memory)."""
    _, b, _ = _seated()
    sel = np.array([[7, 8, 9, -1], [-1, -1, -1, -1]], dtype=np.int32)

    class DeviceArray:
        def __init__(self, arr: np.ndarray) -> None:
            self.arr = arr
            self.__cuda_array_interface__ = {"shape": arr.shape, "typestr": arr.dtype.str,
                                             "data": (arr.ctypes.data, False),
                                             "strides": None, "version": 3}

    emap = np.array(b.resolve_sparse_selection(0, DeviceArray(sel)))
    np.testing.assert_array_equal(emap[0], [0, 1, 2, -1])
    np.testing.assert_array_equal(b.read_sparse_table(0, "selected"), sel)
    for layer in (0, 1):
        b.fetch_resolved_pages(layer)
    with pytest.raises(InvalidArgumentError, match="contiguous int32"):
        b.resolve_sparse_selection(0, DeviceArray(sel.astype(np.int64)))
    with pytest.raises(InvalidArgumentError, match="NumPy array or a device array"):
        b.resolve_sparse_selection(0, [[1, 2, 3, 4], [1, 2, 3, 4]])
    b.close()


def test_fetches_follow_sparse_pools_that_moved_when_the_manager_resized() -> None:
    """``manager.resize`` may reallocate pools: a batch made before reads the pages where
    they are now."""
    m = _manager(sparse_host_quota=1 << 20)
    b = Batch(m, max_rows=1, max_blocks_per_row=8)
    store = next(s for pg, s in zip(m.layout.pool_groups, m.stores[0], strict=True)
                 if pg.sparse)
    before = store.pools[0].buffer.ptr
    store.grow(store.num_slots + 8)  # what a level-0 resize does to a pool (it moves)
    assert store.pools[0].buffer.ptr != before
    _fill_host(m)
    cache = _cache(m, 32)
    b.add_kv_cache(cache)
    b.publish()
    emap = np.array(b.resolve_sparse_selection(0, np.array([[3, -1, -1, -1]], np.int32)))
    b.fetch_resolved_pages(0)
    b.fetch_resolved_pages(1)
    np.testing.assert_array_equal(_entry(b, 0, 0, "k", int(emap[0, 0])),
                                  _host_unit(m, cache, 0, "k", 3))
    b.close()


# -- refusals change nothing; seats and written units (review 20c) -----------------------


def test_a_refused_publish_changes_nothing_so_the_next_one_pins_every_rows_in_flight_units(
        ) -> None:
    m = _manager()
    b = Batch(m, max_rows=2, max_blocks_per_row=4)
    a, big = _cache(m, 16, seed=1), _cache(m, 60, seed=2)
    b.add_kv_cache(a)
    b.add_kv_cache(big)
    b.publish()
    assert a.resize(20)  # unit 4 in flight
    assert big.resize(68)  # 5 blocks: more than the rows hold
    with pytest.raises(InvalidArgumentError, match="max_blocks_per_row=4"):
        b.publish()
    assert b.dirty_rows().tolist() == [0, 1]
    b.remove_kv_cache(big)
    b.publish()
    wmap = np.array(b.prepare_sparse_write_indices(0))[0]
    assert wmap[0] >= 0  # unit 4 has its entry: the marks and pins went up
    b.close()
    big.close()


@pytest.mark.parametrize("leave", ["remove", "close"])
def test_leaving_the_batch_writes_back_units_history_crossed_since_the_last_flush(
        leave: str) -> None:
    m = _manager()
    b = Batch(m, max_rows=2, max_blocks_per_row=8)
    toks = [int(x) for x in np.random.default_rng(0).integers(1, 30000, 40)]
    cache = m.create_kv_cache(None, toks[:16])
    assert cache.resume() and cache.resize(16) and cache.resize(16, 16)
    b.add_kv_cache(cache)
    b.publish()
    b.resize(np.array([20, -1]))  # tokens 16..19 in flight: unit 4
    wmap = np.array(b.prepare_sparse_write_indices(0))[0]
    rng = np.random.default_rng(5)
    written = {}
    for layer, role in SPARSE_BUFFERS:
        data = rng.integers(0, 256, _entry(b, 0, layer, role, 0).size, dtype=np.uint8)
        _entry(b, 0, layer, role, int(wmap[0]))[:] = data
        written[(layer, role)] = data
    cache.commit(toks[:20])  # history 20: unit 4 crossed, not flushed
    assert cache.history_length == 20
    if leave == "remove":
        b.remove_kv_cache(cache)
    else:
        b.close()
    for (layer, role), data in written.items():
        np.testing.assert_array_equal(_host_unit(m, cache, layer, role, 4), data)
    cache.close()
    b.close()


def test_seats_cannot_change_while_a_resolve_awaits_its_fetches() -> None:
    m, b, cache = _filled(3, 64)
    sel = np.full((3, 4), -1, np.int32)
    sel[0] = [5, 6, 9, 10]
    b.resolve_sparse_selection(0, sel)
    with pytest.raises(InvalidStateError, match="awaits fetch_resolved_pages"):
        b.move(cache, 2)
    assert b.row_of(cache) == 0
    other = _cache(m, 8, seed=3)
    b.add_kv_cache(other)  # a seat change: the publish waits for the fetches
    with pytest.raises(InvalidStateError, match="awaits fetch_resolved_pages"):
        b.publish()
    b.fetch_resolved_pages(0)
    b.fetch_resolved_pages(1)
    b.publish()
    b.move(cache, 2)
    b.publish()
    entries = np.array(b.resolve_sparse_selection(0, np.roll(sel, 2, axis=0)))[2]
    b.fetch_resolved_pages(0)
    b.fetch_resolved_pages(1)
    for unit, e in zip([5, 6, 9, 10], entries.tolist(), strict=True):
        for layer, role in SPARSE_BUFFERS:
            np.testing.assert_array_equal(_entry(b, 2, layer, role, e),
                                          _host_unit(m, cache, layer, role, unit))
    b.close()


def test_the_sparse_steps_refuse_a_lossy_typed_sparse_buffer_with_a_clear_error() -> None:
    """The reference engine's sparse steps write fingerprint records into the entries and
    check them exactly; a typed sparse buffer that is not exact (bf16, default) would be
    checked as typed values on its host pages and fail for no fault of the manager: it
    is refused up front, naming the buffer."""
    from kvcm_core import (
        AttentionLayerConfig,
        BufferConfig,
        KVCacheManager,
        KVCacheManagerConfig,
        LevelConfig,
        SparseConfig,
    )
    from kvcm_core.testing.engine import EngineLoop

    sp = SparseConfig(unit_tokens=4, num_selected=4, working_set_units=12)
    m = KVCacheManager(KVCacheManagerConfig(
        tokens_per_block=16, kernel_backend="numpy",
        levels=[LevelConfig(tier="gpu", quota=1 << 20)], sparse_host_quota=1 << 20,
        layers=[AttentionLayerConfig(layer_id=0, sparse=sp, buffers=[
            BufferConfig(role="kv", size=256, is_sparse=True, dtype="bf16")])]))
    with pytest.raises(ValueError, match=r"layer 0/kv: .* must be exact"):
        EngineLoop(m, chunk_tokens=16, max_batch=2)
    m.shutdown()
