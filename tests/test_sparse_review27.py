"""Sparse attention rules a review (27) found broken: a moved row's write map follows it,
interrupts leave no pin, fetch or write-back owed, write-backs are ordered against
publishes on other streams, the write-back bound never strands an accepted step, the write
map is refused between a history move and its flush, and a bad ``buffers`` is named."""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import sparse_helpers as sh
import test_sparse_stream_rules as sr

import kvcm_core.batch as batch_mod
from kvcm_core import ArgumentTypeError, Batch, InvalidStateError, KVCacheManager


class Injected(BaseException):
    """An interrupt (not KeyboardInterrupt: that stops pytest)."""


def _cache(m: KVCacheManager, toks: list[int], h: int):
    c = m.create_kv_cache(None, toks[:h])
    assert c.resume() and c.resize(h) and c.resize(h, h)
    return c


def _entry(b: Batch, row: int, layer: int, role: str, e: int) -> np.ndarray:
    """Row ``row``'s entry ``e`` of a sparse buffer (a live host view: numpy backend)."""
    cl = b.sparse_cells(layer, role)
    at = cl.cells.page_start(b.sparse_lease(row) * cl.lease_cells + e // cl.units_per_page) \
        + (e % cl.units_per_page) * cl.unit_bytes
    return cl.cells.buffer.host_view()[at: at + cl.unit_bytes]


def _host_unit(m: KVCacheManager, c, layer: int, role: str, unit: int) -> np.ndarray:
    region = m.get_page_region(layer, role)
    upp = sh.TPB // sh.UT
    ub = m.buffer_attr(layer, role).size // upp
    slot = int(c.get_base_page_indices(m.get_buffer_group_id(layer, role))[unit // upp])
    at = region.page_start(slot) + (unit % upp) * ub
    return region.buffer.host_view()[at: at + ub]


def _toks(seed: int = 0) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(1, 30000, 256)]


# -- F1: a moved row's write map ------------------------------------------------------------

def test_a_row_moved_after_the_flush_takes_its_write_map_along():
    m = KVCacheManager(sh.sparse_config())
    c = _cache(m, _toks(), 8)
    b = Batch(m, max_rows=3, max_blocks_per_row=8)
    b.add_kv_cache(c)
    b.resize(np.array([12, -1, -1]))  # tokens 8..11 in flight: unit 2 pinned
    b.flush_sparse_units()
    before = np.array(b.prepare_sparse_write_indices(0))
    b.move(c, 2)
    b.publish()  # seats uploaded, capacity unchanged: no new pin
    after = np.array(b.prepare_sparse_write_indices(0))
    assert after[2].tolist() == before[0].tolist()
    assert (after[0] == -1).all()  # the row left empty names no entry


def test_tokens_written_through_a_moved_rows_write_map_reach_the_host_and_spare_other_units():
    m = KVCacheManager(sh.sparse_config())
    toks = _toks()
    b = Batch(m, max_rows=2, max_blocks_per_row=8)
    a, other = _cache(m, toks, 8), _cache(m, toks, 40)
    b.add_kv_cache(a, 0)
    b.add_kv_cache(other, 1)
    b.publish()
    sel = np.full((2, 4), -1, np.int32)
    sel[0, :2] = [0, 1]  # a's units 0, 1 take entries 0, 1
    b.resolve_sparse_selection(0, sel)
    b.fetch_resolved_pages(0)
    b.fetch_resolved_pages(1)
    unit0 = _entry(b, 0, 0, "k", 0).copy()
    b.resize(np.array([12, 44]))  # a: unit 2 in flight; other: unit 10
    b.flush_sparse_units()
    b.remove_kv_cache(other)
    b.move(a, 1)  # into the removed row, after the step's flush
    b.publish()
    w = np.array(b.prepare_sparse_write_indices(0))
    new = np.arange(unit0.size, dtype=np.uint8)  # "the model writes unit 2"
    _entry(b, 1, 0, "k", int(w[1, 0]))[:] = new
    assert a.resize(12, 12)
    b.flush_sparse_units()
    assert np.array_equal(_host_unit(m, a, 0, "k", 2), new)
    assert np.array_equal(_entry(b, 1, 0, "k", 0), unit0)


def test_rows_swapped_through_an_empty_row_swap_their_write_maps():
    m = KVCacheManager(sh.sparse_config())
    toks = _toks()
    b = Batch(m, max_rows=3, max_blocks_per_row=8)
    a, c = _cache(m, toks, 8), _cache(m, toks, 36)
    b.add_kv_cache(a, 0)
    b.add_kv_cache(c, 1)
    b.resize(np.array([12, 44, -1]))
    b.flush_sparse_units()
    w0 = np.array(b.prepare_sparse_write_indices(2))
    b.move(a, 2)
    b.move(c, 0)
    b.move(a, 1)
    b.publish()
    w1 = np.array(b.prepare_sparse_write_indices(2))
    assert w1[1].tolist() == w0[0].tolist() and w1[0].tolist() == w0[1].tolist()
    assert (w1[2] == -1).all()


# -- F2, F3, F4: interrupts -------------------------------------------------------------------

def _random_host_pages(m: KVCacheManager, seed: int = 7) -> None:
    rng = np.random.default_rng(seed)
    for pg, store in zip(m.layout.pool_groups, m.stores[0], strict=True):
        if pg.sparse:
            for pool in store.pools:
                v = pool.buffer.host_view()
                v[:] = rng.integers(0, 256, v.size, dtype=np.uint8)


def _seated(history: int, rows: int) -> tuple[KVCacheManager, Any, Batch]:
    """A manager whose host pages hold random bytes, a cache of ``history`` tokens seated
    in row 0 of a batch of ``rows`` rows, published."""
    m = KVCacheManager(sh.sparse_config())
    _random_host_pages(m)
    c = _cache(m, _toks(), history)
    b = Batch(m, max_rows=rows, max_blocks_per_row=8)
    b.add_kv_cache(c)
    b.publish()
    return m, c, b


def _arm(monkeypatch, owner, name: str, when=lambda *a, **k: True, after: bool = False):
    """Raise ``Injected`` once from ``owner.name`` (before the call, or ``after`` it)."""
    real = getattr(owner, name)
    left = [1]

    def hooked(*args, **kw):
        if not after and left[0] and when(*args, **kw):
            left[0] = 0
            raise Injected(name)
        out = real(*args, **kw)
        if after and left[0] and when(*args, **kw):
            left[0] = 0
            raise Injected(name)
        return out
    monkeypatch.setattr(owner, name, hooked)
    return left


def test_a_publish_interrupted_before_its_pin_pins_at_the_next_publish(monkeypatch):
    m = KVCacheManager(sh.sparse_config())
    c = _cache(m, _toks(), 12)
    b = Batch(m, max_rows=1, max_blocks_per_row=8)
    b.add_kv_cache(c)
    b.publish()
    left = _arm(monkeypatch, batch_mod.Batch, "_wait_upload")
    with pytest.raises(Injected):
        b.resize([20])  # units 3, 4 in flight (a new block): the upload is interrupted
    assert not left[0] and c.capacity == 20
    b.publish()
    w = np.array(b.prepare_sparse_write_indices(0))[0]
    assert (w[:2] >= 0).all() and len(set(w[:2].tolist())) == 2


def test_a_publish_interrupted_after_the_upload_refuses_the_write_map_until_published(
        monkeypatch):
    m = KVCacheManager(sh.sparse_config())
    c = _cache(m, _toks(), 12)
    b = Batch(m, max_rows=1, max_blocks_per_row=8)
    b.add_kv_cache(c)
    b.publish()
    arena_cls = type(b._arena())
    _arm(monkeypatch, arena_cls, "publish")
    with pytest.raises(Injected):
        b.resize([16])  # unit 3 in flight, no new block
    with pytest.raises(InvalidStateError, match="publish first"):
        b.prepare_sparse_write_indices(0)
    b.publish()
    assert int(np.array(b.prepare_sparse_write_indices(0))[0, 0]) >= 0


def test_a_pin_interrupted_before_its_fetch_fetches_at_the_next_publish(monkeypatch):
    m, c, b = _seated(10, 1)
    assert c.resize(12)  # unit 2 in flight; its tokens 8, 9 are history (on the host)
    _arm(monkeypatch, type(m.backend), "sparse_copy", lambda self, job, *a: not job.flush)
    with pytest.raises(Injected):
        b.publish()
    b.publish()
    e = int(np.array(b.prepare_sparse_write_indices(0))[0, 0])
    half = b.sparse_cells(0, "k").unit_bytes // 2  # tokens 8, 9 of the unit's 4
    assert np.array_equal(_entry(b, 0, 0, "k", e)[:half], _host_unit(m, c, 0, "k", 2)[:half])


def test_a_pin_fetch_left_by_an_interrupt_uses_the_tables_it_was_pinned_with(monkeypatch):
    m, c, b = _seated(10, 2)
    assert c.resize(12)
    _arm(monkeypatch, type(m.backend), "sparse_copy", lambda self, job, *a: not job.flush)
    with pytest.raises(Injected):
        b.publish()
    b.move(c, 1)  # the next publish uploads the row's tables to row 1
    b.publish()
    e = int(np.array(b.prepare_sparse_write_indices(0))[1, 0])
    half = b.sparse_cells(0, "k").unit_bytes // 2
    assert np.array_equal(_entry(b, 1, 0, "k", e)[:half], _host_unit(m, c, 0, "k", 2)[:half])


def test_a_resolve_interrupted_after_its_kernel_still_fetches_its_misses(monkeypatch):
    m, c, b = _seated(32, 1)
    _arm(monkeypatch, type(m.backend), "sparse_resolve",
         lambda self, job, *a: job.selected is not None, after=True)
    sel = np.array([[3, 5, -1]], np.int32)
    with pytest.raises(Injected):
        b.fetch_sparse_pages(2, sel)
    emap = np.array(b.fetch_sparse_pages(2, sel))[0]  # the engine retries the step
    for unit, e in zip(sel[0][:2], emap[:2], strict=True):
        assert np.array_equal(_entry(b, 0, 2, "kv", int(e)), _host_unit(m, c, 2, "kv", unit))


def test_a_shared_resolve_interrupted_after_its_kernel_awaits_its_fetches(monkeypatch):
    m, c, b = _seated(32, 1)
    _arm(monkeypatch, type(m.backend), "sparse_resolve",
         lambda self, job, *a: job.selected is not None, after=True)
    sel = np.array([[3, 5, -1, -1]], np.int32)
    with pytest.raises(Injected):
        b.resolve_sparse_selection(0, sel)
    with pytest.raises(InvalidStateError, match="fetch"):
        b.resolve_sparse_selection(0, sel)
    b.fetch_resolved_pages(0)
    b.fetch_resolved_pages(1)
    emap = b.read_sparse_table(0, "entry_map")[0]
    for unit, e in zip(sel[0][:2], emap[:2], strict=True):
        assert np.array_equal(_entry(b, 0, 1, "v", int(e)), _host_unit(m, c, 1, "v", unit))


def test_a_removal_interrupted_while_waiting_for_its_write_back_waits_when_retried(
        monkeypatch):
    m = sr._manager()
    stream = m.backend.create_stream()
    toks = [int(x) for x in np.random.default_rng(0).integers(1, 30000, 40)]
    cache, b, written = sr._one_step(m, stream, toks)
    joins = Batch(m, max_rows=2, max_blocks_per_row=8)
    m.backend.synchronize()
    be = type(m.backend)
    real = be.synchronize
    calls = [0]

    def synchronize(self):
        calls[0] += 1
        if calls[0] == 2:  # the write-back is queued: the host's wait is interrupted
            raise Injected("synchronize")
        return real(self)
    monkeypatch.setattr(be, "synchronize", synchronize)
    with pytest.raises(Injected):
        b.remove_kv_cache(cache)
    monkeypatch.setattr(be, "synchronize", real)
    b.remove_kv_cache(cache)
    assert m.backend.pending() == 0
    cache.close()
    fetched = sr._fetch_reused_unit(m, joins, stream, toks, in_place=True)
    assert [k for k, d in written.items() if not np.array_equal(fetched[k], d)] == []


# -- F5: write-backs and publishes on two streams (deferred backend) -------------------------

def _lost(m: KVCacheManager, tables: dict, written: dict) -> list:
    return [k for k, d in written.items()
            if not np.array_equal(sr._host_unit(m, tables, *k, sr.UNIT), d)]


def _stepped(seed: int = 0):
    m = sr._manager()
    E = m.backend.create_stream()
    toks = [int(x) for x in np.random.default_rng(seed).integers(1, 30000, 40)]
    cache, b, written = sr._one_step(m, E, toks)  # unit 7 written on E, committed to 32
    tables = {g: cache.get_base_page_indices(g).copy() for g in range(m.num_cache_groups)}
    return m, E, cache, b, written, tables


def _other(m: KVCacheManager, b: Batch):
    other = m.create_kv_cache(None, [7, 8, 9, 10, 11, 12])
    assert other.resume() and other.resize(6) and other.resize(6, 6)
    b.add_kv_cache(other)
    return other


def test_a_removal_write_back_on_a_stream_is_fenced_before_the_next_publish():
    m, E, cache, b, written, tables = _stepped()
    b.record_read(E)  # docs/batch.md: fence the readers, then remove
    b.remove_kv_cache(cache, E)  # the write-back is queued on E, after the fence
    cache.close()
    _other(m, b)
    b.resize([8, -1])  # the next step's publish, default stream
    m.backend.default_stream.run()  # it runs before E, as a GPU may
    assert _lost(m, tables, written) == []


def test_a_step_flush_on_a_stream_is_fenced_before_the_next_publish():
    m, E, cache, b, written, tables = _stepped()
    b.record_read(E)
    assert b.flush_sparse_units(E) > 0  # the end of the step, on E (after the fence)
    b.remove_kv_cache(cache, E)
    cache.close()
    b.resize([-1, -1])  # the next step's publish (default stream), runs first
    m.backend.default_stream.run()
    assert _lost(m, tables, written) == []


def test_a_freed_lease_is_reset_only_after_its_write_back_on_another_stream():
    m, E, cache, b, written, tables = _stepped()
    b.remove_kv_cache(cache, E)  # the write-back is queued on E
    other = _other(m, b)
    assert other.resize(8)
    assert b.sparse_lease(b.row_of(other)) == 0  # the removed row's lease
    b.resize([-1] * b.max_rows)  # reset and pin of the lease, on the default stream
    m.backend.default_stream.run()
    cache.close()
    assert _lost(m, tables, written) == []


def test_a_removal_write_back_on_a_stream_waits_for_the_last_publish():
    m, E, cache, b, written, tables = _stepped()
    m.backend.synchronize()
    b.move(cache, 1)
    b.publish()  # default stream: the row's new seat in the lease table
    b.remove_kv_cache(cache, E)  # not dirty: no publish of its own
    E.run()  # E runs first, as a GPU may
    assert _lost(m, tables, written) == []


def test_marks_uploaded_on_two_streams_land_in_program_order():
    from deferred_backend import deferred_plugin_manager
    m = KVCacheManager(sh.sparse_config("deferred"), plugin_manager=deferred_plugin_manager())
    E = m.backend.create_stream()
    toks = [int(x) for x in np.random.default_rng(0).integers(1, 30000, 64)]
    c = m.create_kv_cache(None, toks[:32])
    assert c.resume() and c.resize(32) and c.resize(32, 32)
    b = Batch(m, max_rows=1, max_blocks_per_row=8)
    b.add_kv_cache(c)
    b.resize([33])  # step N: unit 8 in flight (default stream)
    b.wait_ready(E)
    b.record_read(E)
    assert c.resize(33, 33, stream=E)
    b.flush_sparse_units(E)  # the end of step N, on E (after the fence)
    b.resize([37])  # step N+1, same block (no upload to wait for), default stream
    m.backend.default_stream.run()  # the default stream runs first
    b.wait_ready(E)
    E.run()
    arena = b._arena()
    dev = m.backend.read(arena.lease_of_row.device, 0, 4).view(np.int32)  # (synchronizes)
    marks = m.backend.read(arena.marks.device, 0, 8).view(np.int32)
    assert int(dev[0]) == 0 and tuple(marks.tolist()) == (33, 37)
    w = b.read_sparse_table(0, "write_map")[0, :3]
    assert (w[:2] >= 0).all()  # units 8, 9 in flight have entries


# -- F6: the write-back bound --------------------------------------------------------------

def _two_layer_manager() -> KVCacheManager:
    cfg = sh.sparse_config()  # layers 0, 1 only: selection "s", 12 entries, 4 selected
    return KVCacheManager(cfg.__class__(**{**{f: getattr(cfg, f) for f in (
        "tokens_per_block", "kernel_backend", "levels", "sparse_host_quota")},
        "layers": cfg.layers[:2]}))


def test_a_prefill_step_of_the_whole_in_flight_limit_is_flushed_without_a_token_bound():
    m = _two_layer_manager()
    c = m.create_kv_cache(None, [])
    assert c.resume()
    b = Batch(m, max_rows=1, max_blocks_per_row=8)  # max_total_input_tokens=None
    b.add_kv_cache(c)
    b.publish()
    assert b.resize([32]) == [True]  # 8 units in flight: working_set - selected
    b.flush_sparse_units()
    assert b.resize([32], [32]) == [True]
    assert b.flush_sparse_units() == 8  # was refused: "exceeds the write-back bound of 5"
    assert b.resize([36], [32]) == [True]
    b.close()


def test_steps_whose_histories_move_late_are_flushed_within_the_token_bound():
    m = _two_layer_manager()
    b = Batch(m, max_rows=2, max_blocks_per_row=8, max_total_input_tokens=8)
    for i in range(2):
        c = m.create_kv_cache(None, [100 * i + j + 1 for j in range(3)])
        assert c.resume() and c.resize(3) and c.resize(3, 3)
        b.add_kv_cache(c)
    b.publish()
    b.resize([11, -1])  # step 1: row 0 writes 8 tokens
    b.flush_sparse_units()
    b.resize([-1, 11])  # step 2: row 1 writes 8 tokens
    b.flush_sparse_units()
    b.resize([11, 11], [11, 11])  # step 3: both histories move
    assert b.flush_sparse_units() == 6  # was refused (bound 5): the rows were stuck
    assert b.resize([12, 12], [11, 11]) == [True, True]
    b.close()


# -- F7: the write map is valid after the flush only -----------------------------------------

def test_the_write_map_is_refused_between_a_history_move_and_its_flush():
    m = KVCacheManager(sh.sparse_config(max_rewind_len=16))
    c = _cache(m, _toks(), 8)
    b = Batch(m, max_rows=1, max_blocks_per_row=8)
    b.add_kv_cache(c)
    b.publish()
    b.resize([12])
    b.flush_sparse_units()
    w1 = np.array(b.prepare_sparse_write_indices(0))[0, 0]  # unit 2
    b.resize([16], [12])  # next step: history 12 (unit 3 first in flight), not flushed
    with pytest.raises(InvalidStateError, match="flush_sparse_units first"):
        b.prepare_sparse_write_indices(0)
    b.flush_sparse_units()
    w2 = np.array(b.prepare_sparse_write_indices(0))[0, :2]
    assert w2[0] >= 0 and w2[0] != w1  # slot 0 is unit 3 now
    b.resize([16], [8])  # a rewind below the flushed mark
    with pytest.raises(InvalidStateError, match="flush_sparse_units first"):
        b.prepare_sparse_write_indices(0)
    b.flush_sparse_units()
    assert np.array(b.prepare_sparse_write_indices(0))[0, 0] >= 0


# -- F8: a bad buffers argument ----------------------------------------------------------------

@pytest.mark.parametrize("make", [lambda: 5, lambda: [["k"]], lambda: [b"k"], lambda: iter([3])],
                         ids=["int", "nested", "bytes", "iterator"])
def test_a_buffers_argument_that_is_not_roles_is_a_typed_error_naming_it(make):
    m = KVCacheManager(sh.sparse_config())
    c = m.create_kv_cache(None, [])
    assert c.resume()
    b = Batch(m, max_rows=1, max_blocks_per_row=8)
    b.add_kv_cache(c)
    b.publish()
    with pytest.raises(ArgumentTypeError, match="buffers="):
        b.prepare_sparse_write_indices(0, buffers=make())
    with pytest.raises(ArgumentTypeError, match="buffers="):
        b.fetch_sparse_pages(2, np.full((1, 3), -1, np.int32), buffers=make())
    with pytest.raises(ArgumentTypeError, match="buffers="):
        b.fetch_resolved_pages(0, buffers=make())
    assert tuple(b.peek_hit_miss_counter()) == (0, 0)  # nothing resolved
