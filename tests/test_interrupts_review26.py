"""Interrupts and plugin errors in the middle of an operation (session 26's review).

Each test injects a ``KeyboardInterrupt`` (or a device error) at one point a review found
unsafe, then checks what the engine developer relies on: the manager's invariants, every
KV byte (the fingerprint engine), and that closing everything frees every slot."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import kvcm_eviction_lru.segments as lru_segments
import kvcm_kernels_numpy as numpy_kernels
import pytest
from deferred_backend import DeferredEvent, DeferredStream, deferred_plugin_manager
from levels_helpers import (
    Driver,
    SinkPlugin,
    assert_all_free,
    assert_invariants,
    close_all,
    make_manager,
    quota,
    tokens,
)

import kvcm_core.batch as batch_mod
import kvcm_core.levels as levels_mod
from kvcm_core import Batch, EventSink, KvcmPluginManager


class _Injected(BaseException):
    """The injected interrupt: like ``KeyboardInterrupt``, no ``Exception`` (nothing may
    swallow it), but one that cannot stop the test session if it escapes."""


def _arm(monkeypatch: pytest.MonkeyPatch, owner: Any, name: str, times: int = 1,
         when: Any = None) -> dict[str, int]:
    """Make ``owner.name`` raise :class:`_Injected` on its next ``times`` calls for which
    ``when(*args)`` holds (always without ``when``)."""
    real = getattr(owner, name)
    left = {"n": times}

    def wrapped(*args: Any, **kw: Any) -> Any:
        if left["n"] and (when is None or when(*args)):
            left["n"] -= 1
            raise _Injected(f"injected into {name}")
        return real(*args, **kw)

    monkeypatch.setattr(owner, name, wrapped)
    return left


def _deferred_manager(tiers: list[tuple[str, int]], tmp_path: Path,
                      monkeypatch: pytest.MonkeyPatch) -> Any:
    """A manager on the tests' deferred backend: copies queue on streams and run when
    something waits, as on a GPU (fences on)."""
    monkeypatch.setenv("KVCM_TEST_BACKEND", "deferred")
    m = make_manager(tiers, tmp_path, pm=deferred_plugin_manager())
    monkeypatch.delenv("KVCM_TEST_BACKEND")
    assert m.storage_levels.mover.fences.enabled
    return m


# -- a move whose fence cannot be recorded ----------------------------------------------------


@pytest.mark.parametrize("failures", [1, 2], ids=["record-fails", "record-fails-twice"])
def test_a_move_whose_fence_cannot_be_recorded_never_lets_its_copy_land_in_reused_slots(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failures: int) -> None:
    """A resume's onboard copies are queued, then recording their fence fails: the GPU
    slots the move gives back must not be written by those copies after another request
    took them (failing twice: no event at all can be recorded, the host waits instead)."""
    m = _deferred_manager([("gpu", 8), ("host", 16)], tmp_path, monkeypatch)
    d = Driver(m)
    a = d.write(tokens(32, 1), chunk=32)
    b = d.write(tokens(32, 2), chunk=32)  # a's pages go to the host
    b.close()
    onboard = m.storage_levels.mover.fences.streams()[1]
    _arm(monkeypatch, DeferredEvent, "record", failures,
         when=lambda ev, stream=None: stream is onboard)
    with pytest.raises(_Injected):
        a.resume()
    monkeypatch.undo()
    assert_invariants(m)
    c = d.write(tokens(32, 3), chunk=32, suspend=False)  # into the GPU slots given back
    m.backend.synchronize()  # anything still queued runs now
    d.check(c)
    c.suspend()
    d.resume_and_verify(a)
    close_all(m)
    assert_all_free(m)


# -- Batch.resize's batched path --------------------------------------------------------------


def _batch(m: Any, rows: int) -> tuple[Batch, list[Any]]:
    b = Batch(m, max_rows=rows, max_blocks_per_row=8)
    caches = []
    for i in range(rows):
        c = m.create_kv_cache(None, tokens(7, i))
        assert c.resume() and c.resize(8)
        b.add_kv_cache(c)
        caches.append(c)
    b.publish()
    return b, caches


def _tables_match(b: Batch, caches: list[Any]) -> None:
    b.publish()
    counts = b.read_num_blocks(0).ravel().tolist()
    table = b.read_page_table(0)
    L = caches[0].manager.storage_levels
    for r, c in enumerate(caches):
        assert counts[r] == c.num_blocks, (r, counts[r], c.num_blocks)
        slots = [int(L.arena.slot[p]) for p in c.pages(0)]
        assert table[r, 0, : len(slots)].tolist() == slots, r


def _close_batch(m: Any, b: Batch, caches: list[Any]) -> None:
    """Every row out, every cache and the batch closed: then every slot is free."""
    for c in caches:
        b.remove_kv_cache(c)
        c.close()
    b.close()
    assert_all_free(m)


def test_an_interrupt_while_a_batch_resize_waits_for_the_last_upload_leaves_no_stale_table(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The batched path waits for the last upload before it writes the staging rows: an
    interrupt there must not leave rows marked clean whose new blocks never reached the
    device table (kernels would read wrong pages)."""
    m = make_manager([("gpu", 16)], tmp_path)
    b, caches = _batch(m, 2)
    _arm(monkeypatch, batch_mod, "_poll")
    with pytest.raises(_Injected):
        b.resize([12, 12])
    monkeypatch.undo()
    assert_invariants(m)
    _tables_match(b, caches)
    assert b.resize([12, 12])
    _tables_match(b, caches)
    _close_batch(m, b, caches)


def test_a_batch_resize_whose_fence_handover_fails_leaks_no_page(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The batched path takes every row's pages at once, then the engine's stream waits
    for the copies that made room: when that wait fails, the pages no row got yet are
    given back."""
    m = _deferred_manager([("gpu", 8), ("host", 8)], tmp_path, monkeypatch)
    d = Driver(m)
    d.write(tokens(16, 9), chunk=16).close()  # droppable pages: the take makes room
    b, caches = _batch(m, 2)

    def in_wait_all(*_: Any) -> bool:
        return any(f.function == "wait_all" for f in inspect.stack()[:6])

    _arm(monkeypatch, DeferredStream, "wait_event", when=in_wait_all)
    with pytest.raises(_Injected):
        b.resize([12, 12])
    monkeypatch.undo()
    assert_invariants(m)
    _tables_match(b, caches)
    _close_batch(m, b, caches)


# -- pools and snapshots ----------------------------------------------------------------------


def test_a_pool_resize_interrupted_while_its_copy_is_queued_keeps_every_page_readable(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The host pool's resize queues the copy of the kept bytes into its new memory and
    waits for it: an interrupt in that wait must not free memory the copy still writes
    (on a GPU: a write into freed device memory)."""
    m = _deferred_manager([("gpu", 8), ("host", 16)], tmp_path, monkeypatch)
    d = Driver(m)
    a = d.write(tokens(32, 1), chunk=32)
    d.write(tokens(32, 2), chunk=32)  # a's pages go to the host

    def in_pool_resize(*_: Any) -> bool:
        return any(f.function == "resize" and "kvcm_tier_gpu" in f.filename
                   for f in inspect.stack()[:3])

    _arm(monkeypatch, DeferredStream, "synchronize", when=in_pool_resize)
    with pytest.raises(_Injected):
        m.resize(1, quota("full", 1, 20))
    monkeypatch.undo()
    assert_invariants(m)
    d.resume_and_verify(a)
    close_all(m)
    assert_all_free(m)


def test_a_failed_snapshot_copy_at_commit_leaks_no_page(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A commit of a hybrid (SSM) model takes a page for the state snapshot and copies the
    live state into it: a device error in that copy gives the page back."""
    m = make_manager([("gpu", 8)], tmp_path, layout="hybrid")
    d = Driver(m)
    c = d.create(tokens(16, 1))
    assert c.resume() and c.resize(8)
    d.engine.step(d.work(c))
    _arm(monkeypatch, numpy_kernels.NumpyBackend, "copy_pages_batch")
    with pytest.raises(_Injected):
        c.commit(d.toks[id(c)][:8])
    monkeypatch.undo()
    assert_invariants(m)
    c.close()
    assert_all_free(m)


# -- event sinks ------------------------------------------------------------------------------


class _InterruptingSink(EventSink):
    def __init__(self, at_batch: int) -> None:
        self.at, self.n = at_batch, 0

    def on_events(self, events: Any) -> None:
        self.n += 1
        if self.n == self.at:
            raise _Injected(f"injected into the sink's batch {self.at}")


def _sink_workload(m: Any, d: Driver) -> None:
    caches = []
    for i in range(6):  # shared prefixes, three levels, evictions on every one
        toks = tokens(12, 100) + tokens(12, i) if i % 2 else tokens(24, i)
        caches.append(d.write(toks, chunk=8))
        if len(caches) > 2:  # two suspended requests hold pages, the rest is cached
            caches.pop(0).close()
    for c in caches:
        d.resume_and_verify(c)
        c.close()


@pytest.mark.parametrize("layout", ["full", "hybrid"])
def test_an_event_sink_interrupt_at_any_batch_leaves_the_manager_consistent(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, layout: str) -> None:
    """Sinks get batches once 256 events are queued: a sink's interrupt (it propagates) at
    any batch must find the operation that queued the events done, never half way (a
    dropped page's slot not yet freed, say). With a batch of one event every event is
    such a point."""
    monkeypatch.setattr(levels_mod, "_EVENT_BATCH", 1)
    points = 0
    for at in range(1, 2000):
        pm = KvcmPluginManager()
        sink = _InterruptingSink(at)
        pm.register(SinkPlugin(sink), name="sink")
        m = make_manager([("gpu", 8), ("host", 2), ("disk", 12)], tmp_path / str(at),
                         pm=pm, layout=layout)
        d = Driver(m)
        try:
            _sink_workload(m, d)
        except _Injected:
            points += 1
            assert_invariants(m)
            for c in m.open_caches:
                if c.status.name == "ACTIVE":
                    c.suspend()
            close_all(m)
            assert_all_free(m)
            m.shutdown()
            continue
        assert sink.n < at  # the workload ran out of batches: every point was tried
        sink.at = 0
        m.shutdown()
        break
    else:
        pytest.fail("the workload queued more batches than the test tries")
    assert points > 20


# -- eviction policies ------------------------------------------------------------------------


def test_a_refused_insert_of_released_pages_keeps_them_queued(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Closes queue their pages for the droppable queue, inserted when it is next used:
    a policy that refuses that insert must not lose them from every queue."""
    m = make_manager([("gpu", 8), ("host", 4)], tmp_path)
    d = Driver(m)
    d.write(tokens(16, 1), chunk=16, suspend=False).close()  # an active close: queued
    assert m.stores[0][0].num_droppable == 4

    def flushing(*_: Any) -> bool:
        return any(f.function == "_flush_released" for f in inspect.stack()[:6])

    _arm(monkeypatch, lru_segments.SegmentLruPolicy, "insert_many_checked_by_caller",
         when=flushing)
    with pytest.raises(_Injected):
        d.write(tokens(20, 2), chunk=20)
    monkeypatch.undo()
    assert_invariants(m)
    close_all(m)
    again = d.create(tokens(16, 1))  # the first request's blocks are still cached
    assert again.resume()
    d.check(again)
    again.close()
    assert_all_free(m)
