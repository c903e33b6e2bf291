"""Stream order of sparse attention's write-back when a row leaves the batch, checked on the
deferred backend (tests/deferred_backend.py), whose streams are real queues and whose
sparse kernels (resolve, fetch, write-back) are queued like every other kernel.

The engine runs its model on its own stream E. A row that leaves the batch has its units
written back from their device entries to their host pages: after the engine's last writes
of those entries (queued on E) and before any later reader of the host pages (a fetch for a
request that reuses the prefix). With E given, the write-back goes on E; without a stream
(``Batch.close()``, ``remove_kv_cache(cache)``, ``with cache:``) nothing names E, so the
host waits for the device before and after the write-back. ``eager_default`` runs work on
the default stream as soon as it is queued (a GPU may run an idle stream at once): the
schedule in which a default-stream write-back not ordered after E reads stale entries.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from deferred_backend import DeferredBackend, deferred_plugin_manager
from sparse_helpers import PREEMPTING, TPB, UT, requests, sparse_config

from kvcm_core import Batch, KVCacheManager
from kvcm_core.testing.engine import EngineLoop

SPARSE_BUFFERS = [(0, "k"), (0, "v"), (1, "k"), (1, "v"), (2, "kv")]
UNIT = 7  # the unit in flight: tokens 28..31 of the first request


@pytest.fixture
def eager(request: pytest.FixtureRequest) -> Any:
    """Sets ``DeferredBackend.eager_default`` for one test (``indirect`` parameter)."""
    old = DeferredBackend.eager_default
    DeferredBackend.eager_default = request.param
    yield request.param
    DeferredBackend.eager_default = old


def _manager() -> KVCacheManager:
    return KVCacheManager(sparse_config("deferred"), plugin_manager=deferred_plugin_manager())


def _entry(b: Batch, row: int, layer: int, role: str, entry: int) -> tuple[Any, int, int]:
    """(buffer, offset, bytes) of a row's entry in a sparse buffer's cells."""
    c = b.sparse_cells(layer, role)
    at = c.cells.page_start(b.sparse_lease(row) * c.lease_cells + entry // c.units_per_page) \
        + (entry % c.units_per_page) * c.unit_bytes
    return c.cells.buffer, at, c.unit_bytes


def _host_unit(m: KVCacheManager, tables: dict[int, np.ndarray], layer: int, role: str,
               unit: int) -> np.ndarray:
    """The bytes of ``unit`` in the host page of a sparse buffer (``tables``: the cache's
    page indices per group, captured while it was open)."""
    region = m.get_page_region(layer, role)
    per_page = TPB // UT
    unit_bytes = m.buffer_attr(layer, role).size // per_page
    slot = int(tables[m.get_buffer_group_id(layer, role)][unit // per_page])
    at = region.page_start(slot) + (unit % per_page) * unit_bytes
    m.backend.synchronize()
    return region.buffer.host_view()[at : at + unit_bytes].copy()


def _model_writes_unit(m: KVCacheManager, b: Batch, stream: Any, row: int, seed: int
                       ) -> dict[tuple[int, str], np.ndarray]:
    """The model writes the row's first in-flight unit of every sparse buffer into its
    write-map entry, queued on ``stream`` as a kernel would be; returns what it wrote."""
    be = m.backend
    maps = {layer: b.read_sparse_table(layer, "write_map")[row] for layer in (0, 2)}
    rng = np.random.default_rng(seed)
    written = {}
    for layer, role in SPARSE_BUFFERS:
        entry = int(maps[2 if layer == 2 else 0][0])
        assert entry >= 0
        buf, at, n = _entry(b, row, layer, role, entry)
        data = rng.integers(0, 256, n, dtype=np.uint8)
        src = be.alloc_host(n)
        src.host_view()[:] = data
        be.copy_bytes(buf, at, src, 0, n, stream)
        written[(layer, role)] = data
    return written


def _one_step(m: KVCacheManager, stream: Any, toks: list[int]) -> tuple[Any, Batch, dict]:
    """A 28-token request seated and published on ``stream``, grown to 32 (unit 7 in
    flight), the model's write of unit 7 queued on ``stream``, then committed to 32 (block
    1 full and published, unit 7 crossed but not flushed). Returns (cache, batch, what
    the model wrote)."""
    b = Batch(m, max_rows=2, max_blocks_per_row=8)
    cache = m.create_kv_cache(None, toks[:28])
    assert cache.resume(stream) and cache.resize(28, stream=stream)
    assert cache.resize(28, 28, stream=stream)
    b.add_kv_cache(cache)
    b.publish(stream)
    assert b.resize(np.array([32, -1]), stream=stream) == [True, True]
    written = _model_writes_unit(m, b, stream, 0, seed=5)
    cache.commit(toks[:32], stream)
    assert cache.history_length == 32
    return cache, b, written


def _fetch_reused_unit(m: KVCacheManager, b: Batch, stream: Any, toks: list[int],
                       in_place: bool) -> dict[tuple[int, str], np.ndarray]:
    """A new request reusing the 32-token prefix joins ``b`` and fetches unit 7 of every
    sparse buffer on ``stream``; returns each entry's bytes. ``in_place``: the indexer
    writes the selection table on ``stream`` (resolve with ``selected=None``) and
    ``stream`` runs first, before anything it was not made to wait for."""
    be = m.backend
    z = m.create_kv_cache(None, toks[:33])
    assert z.history_length == 32
    assert z.resume(stream)
    b.add_kv_cache(z)
    b.publish(stream)
    sels = {}
    for layer, width in ((0, 4), (2, 3)):
        sel = np.full((2, width), -1, dtype=np.int32)
        sel[0, 0] = UNIT
        sels[layer] = sel
        if in_place:  # (the table's buffer: a view of it would synchronize here)
            src = be.alloc_host(sel.nbytes)
            src.host_view()[:] = sel.view(np.uint8).ravel()
            be.copy_bytes(b._arena().group_of(layer).state["selected"], 0, src, 0,
                          sel.nbytes, stream)
            sels[layer] = None
    b.resolve_sparse_selection(0, sels[0], stream)
    b.fetch_resolved_pages(0, stream=stream)
    b.fetch_resolved_pages(1, stream=stream)
    b.fetch_sparse_pages(2, sels[2], stream=stream)
    if in_place:
        stream.run()  # nothing made it wait for the default stream: a GPU may run it first
    maps = {layer: b.read_sparse_table(layer, "entry_map") for layer in (0, 2)}
    out = {}
    for layer, role in SPARSE_BUFFERS:
        buf, at, n = _entry(b, 0, layer, role, int(maps[2 if layer == 2 else 0][0, 0]))
        out[(layer, role)] = buf.host_view()[at : at + n].copy()
    b.remove_kv_cache(z, stream)
    z.close()
    return out


def _leave(how: str, cache: Any, b: Batch, stream: Any) -> None:
    if how == "batch.close()":
        b.close()
    elif how == "batch.close(stream)":
        b.close(stream)
    elif how == "remove_kv_cache(cache)":
        b.remove_kv_cache(cache)
    elif how == "remove_kv_cache(cache, stream)":
        b.remove_kv_cache(cache, stream)
    else:
        assert how == "with cache"
        with cache:
            pass


LEAVING = ["batch.close()", "batch.close(stream)", "remove_kv_cache(cache)",
           "remove_kv_cache(cache, stream)", "with cache"]


@pytest.mark.parametrize("eager", [False, True], indirect=True)
@pytest.mark.parametrize("record_read", [False, True])
@pytest.mark.parametrize("how", LEAVING)
def test_a_row_leaving_the_batch_writes_back_the_units_the_engine_wrote_on_its_stream(
        how: str, record_read: bool, eager: bool) -> None:
    """The model's write of the in-flight unit is still queued on E when the row leaves:
    the write-back must run after it, whether the removal names E or not (and whether the
    engine recorded a read fence on E or not), so the host pages hold what the model
    wrote, and a request that reuses the prefix fetches exactly that."""
    m = _manager()
    stream = m.backend.create_stream()
    toks = [int(x) for x in np.random.default_rng(0).integers(1, 30000, 40)]
    cache, b, written = _one_step(m, stream, toks)
    tables = {g: cache.get_base_page_indices(g).copy() for g in range(m.num_cache_groups)}
    if record_read:
        b.record_read(stream)
    _leave(how, cache, b, stream)
    for key, data in written.items():
        np.testing.assert_array_equal(_host_unit(m, tables, *key, UNIT), data,
                                      err_msg=f"host page of unit {UNIT}, buffer {key}")
    if cache.batch_seat is not None:
        b.remove_kv_cache(cache, stream)
    cache.close()
    fetched = _fetch_reused_unit(m, Batch(m, max_rows=2, max_blocks_per_row=8), stream, toks,
                                 in_place=False)
    for key, data in written.items():
        np.testing.assert_array_equal(fetched[key], data, err_msg=f"fetched {key}")
    m.shutdown()


@pytest.mark.parametrize("how", ["remove_kv_cache(cache)", "with cache",
                                 "remove_kv_cache(cache, stream)"])
def test_a_fetch_on_the_engines_stream_after_a_removal_reads_the_written_back_units(
        how: str) -> None:
    """The model's writes are done; the row leaves; a request reusing the prefix at once
    has its indexer write the selection in place and resolves and fetches on E, and E runs
    before anything it was not made to wait for. The write-back must be complete (or
    queued ahead on E) by then: the fetch reads the units the model wrote."""
    m = _manager()
    stream = m.backend.create_stream()
    toks = [int(x) for x in np.random.default_rng(0).integers(1, 30000, 40)]
    cache, b, written = _one_step(m, stream, toks)
    joins = Batch(m, max_rows=2, max_blocks_per_row=8)  # made now: its set-up synchronizes
    m.backend.synchronize()  # only the read side is at stake
    if how == "with cache":
        with cache:
            pass
    else:
        _leave(how, cache, b, stream)
        cache.close()
    fetched = _fetch_reused_unit(m, joins, stream, toks, in_place=True)
    for key, data in written.items():
        np.testing.assert_array_equal(fetched[key], data, err_msg=f"fetched {key}")
    m.shutdown()


@pytest.mark.parametrize("eager", [False, True], indirect=True)
@pytest.mark.parametrize("tight", [False, True])
def test_the_sparse_engine_loop_on_its_own_stream_verifies_every_entry_and_page(
        tight: bool, eager: bool) -> None:
    """The engine loop with sparse layers, everything on its own stream (publish, model
    writes, resolve, fetch, checks, flushes, removals), on queued streams: every fetched
    entry and every page read is checked by the fingerprint engine; ``tight`` suspends
    and resumes requests mid-unit across two levels."""
    kw: dict[str, Any] = dict(PREEMPTING) if tight else {}
    m = KVCacheManager(sparse_config("deferred", levels=kw.pop("levels", 1),
                                     quota=kw.pop("quota", 1 << 20),
                                     sparse_host_quota=kw.pop("sparse_host_quota", 1 << 21)),
                       plugin_manager=deferred_plugin_manager())
    loop = EngineLoop(m, chunk_tokens=16, max_batch=4, sparse_seed=3,
                      stream=m.backend.create_stream(), **kw)
    done = loop.run(requests(3, 16 if tight else 12))
    assert len(done) == (16 if tight else 12)
    assert loop.sparse is not None and loop.sparse.checked_entries > 0
    if tight:
        assert m.get_and_reset_iteration_stats().groups[0].offload_blocks > 0
    loop.close()
    m.check_invariants()
    m.shutdown()


def test_a_new_sparse_batch_leaves_no_upload_queued_that_could_overwrite_a_later_one() -> None:
    """The batch's device mirrors (lease table, marks, flush ranges) get their initial
    values by an upload on the default stream. Should one still be queued when the engine
    uploads on its own stream, a GPU may run the initial one last and reset the table: the
    batch's construction leaves nothing queued."""
    m = _manager()
    pending = m.backend.pending()
    b = Batch(m, max_rows=2, max_blocks_per_row=8)
    assert m.backend.pending() <= pending
    b.close()
    m.shutdown()
