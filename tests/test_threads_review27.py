"""Threads, second look (session 27's review): every per-step call of a Batch and the
batch-growth hooks of a cache are refused from another thread before they change anything;
a documented statistic read from a monitoring thread changes nothing; a manager dropped
without shutdown() releases its I/O threads, files and directories; a disk write on
glibc's AIO threads keeps its memory alive however its owner goes away."""

from __future__ import annotations

import gc
import os
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from conftest import open_fds
from disk_helpers import native
from kvcm_tier_disk import aio
from sparse_helpers import requests, sparse_config

from kvcm_core import (
    AttentionLayerConfig,
    BufferConfig,
    InvalidStateError,
    KVCacheManager,
    KVCacheManagerConfig,
    LevelConfig,
)
from kvcm_core.level_io import LevelIO
from kvcm_core.testing.engine import EngineLoop
from kvcm_core.tier import CompletedIO, StoragePool


def _from_another_thread(fn: Callable[[], Any]) -> BaseException | None:
    out: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as exc:  # judged by the caller
            out.append(exc)

    t = threading.Thread(target=run, name="intruder")
    t.start()
    t.join()
    return out[0] if out else None


def test_a_batchs_sparse_calls_and_reader_fence_are_refused_from_another_thread() -> None:
    m = KVCacheManager(sparse_config())
    loop = EngineLoop(m, chunk_tokens=16, max_batch=4, sparse_seed=0)
    for r in requests(0, 6):
        loop.submit(r)
    for _ in range(3):
        loop.step()  # this thread owns the manager now
    b = loop.batch
    assert b is not None
    sel = np.zeros((b.max_rows, 3), dtype=np.int32)

    def state() -> tuple[Any, ...]:
        return (b.peek_hit_miss_counter(), b.read_sparse_table(2, "entry_map").tobytes(),
                b.read_sparse_table(2, "miss_unit").tobytes())

    calls = {
        "resolve_sparse_selection": lambda: b.resolve_sparse_selection(2, sel),
        "fetch_resolved_pages": lambda: b.fetch_resolved_pages(2),
        "fetch_sparse_pages": lambda: b.fetch_sparse_pages(2, sel),
        "flush_sparse_units": b.flush_sparse_units,
        "record_read": b.record_read,
        "wait_readers": b.wait_readers,
    }
    for name, call in calls.items():
        before = state()
        exc = _from_another_thread(call)
        assert isinstance(exc, InvalidStateError) and "intruder" in str(exc), (name, exc)
        assert state() == before, f"{name} changed the batch before it was refused"
    while not loop.idle:  # the owner carries on, every page checked
        loop.step()
    loop.close()
    m.check_invariants()
    m.shutdown()


def test_a_caches_batch_growth_hooks_are_refused_from_another_thread() -> None:
    m = KVCacheManager(sparse_config())
    c = m.create_kv_cache(None, [])
    assert c.resume() and c.resize(8)
    capacity, pages = c.capacity, c.get_base_page_indices(1).tolist()
    for call in (lambda: c.batch_growth(64), lambda: c.batch_grow(64, [])):
        exc = _from_another_thread(call)
        assert isinstance(exc, InvalidStateError), exc
        assert c.capacity == capacity and c.get_base_page_indices(1).tolist() == pages
    c.close()
    m.check_invariants()
    m.shutdown()


class _SlowPool(StoragePool):
    slot_bytes, num_slots = 64, 8

    def write(self, slots: np.ndarray, source: np.ndarray) -> CompletedIO:
        return CompletedIO()

    def read(self, slots: np.ndarray, dest: np.ndarray) -> CompletedIO:
        return CompletedIO()

    def resize(self, n: int) -> None:
        self.num_slots = n

    def close(self) -> None:
        pass


def test_reading_background_in_flight_changes_nothing_so_any_thread_may() -> None:
    """The scheduler's queue of background writes is its own: a monitoring thread that
    reads the documented count pops nothing (it used to reap the queue, racing the
    scheduler's own reap: an IndexError inside a write, or a broken queue bound)."""
    io = LevelIO(1, 5.0, write_queue_depth=4, combine_bytes=0)
    pool = _SlowPool()
    try:
        for i in range(3):
            io.background(None, "w", pool, np.array([i]), np.ones((1, 64), np.uint8),
                          checked=8)
        end = time.monotonic() + 10
        while io.background_in_flight:
            assert time.monotonic() < end, "the writes never finished"
            time.sleep(0.001)
        queued = len(io._background)  # the finished writes the scheduler has not reaped
        assert queued == 3
        assert io.background_in_flight == 0 and len(io._background) == queued
    finally:
        io.close([], time.monotonic() + 5)


def _disk_manager(path: str) -> KVCacheManager:
    kv = [BufferConfig(role="k", size=64), BufferConfig(role="v", size=64)]
    return KVCacheManager(KVCacheManagerConfig(
        tokens_per_block=4, kernel_backend="numpy",
        layers=[AttentionLayerConfig(layer_id=0, buffers=kv)],
        levels=[LevelConfig(tier="gpu", quota=4 * 1024),
                LevelConfig(tier="disk", quota=16 << 20, write_combine_bytes=0,
                            options={"path": path, "native_writes": False})]))


def _kvcm_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith(("kvcm-io", "kvcm-release"))}


def test_a_manager_dropped_without_shutdown_releases_its_threads_files_and_directories(
        tmp_path: Any) -> None:
    d = str(tmp_path / "disk")
    before_fds = len(open_fds())
    before_threads = _kvcm_threads()

    def use_and_drop(i: int) -> weakref.ref[KVCacheManager]:
        m = _disk_manager(d)
        for j in range(20):  # pages go down to the disk level (its I/O thread starts)
            c = m.create_kv_cache(None, [])
            assert c.resume() and c.resize(16)
            c.commit(list(range(1000 * i + 16 * j, 1000 * i + 16 * j + 16)))
            c.close()
        c = m.create_kv_cache(None, list(range(1000 * i, 1000 * i + 16)))  # read back
        c.close()
        assert any(t.name.startswith("kvcm-io") for t in _kvcm_threads() - before_threads)
        return weakref.ref(m)

    refs = [use_and_drop(i) for i in range(3)]
    gc.collect()
    assert all(r() is None for r in refs)
    end = time.monotonic() + 30
    while _kvcm_threads() - before_threads:
        assert time.monotonic() < end, f"left running: {_kvcm_threads() - before_threads}"
        time.sleep(0.01)
    assert len(open_fds()) == before_fds
    assert os.listdir(d) == []  # every owner directory (and its pool files) removed


def test_shutdown_detaches_the_release_so_a_shut_manager_is_released_once(tmp_path: Any
                                                                          ) -> None:
    m = _disk_manager(str(tmp_path / "disk"))
    m.shutdown()
    before = _kvcm_threads()
    del m
    gc.collect()
    assert not {t for t in _kvcm_threads() - before if t.name == "kvcm-release"}


@native
def test_a_dropped_unfinished_native_write_keeps_its_memory_until_glibc_is_done(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The rows and control blocks of a write on glibc's AIO threads outlive a handle
    dropped unfinished (an owner collected without shutdown): glibc would otherwise store
    its status into, and read rows from, freed memory. Once the write is done, a later
    write's look releases them."""
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        rows = np.full((64, 1 << 16), 7, dtype=np.uint8)
        kept = weakref.ref(rows)
        handle = aio.NativeWrite(fd, [0], [aio.data_address(rows)], [rows.nbytes], rows)
        del handle, rows
        gc.collect()
        assert kept() is not None, "the rows were freed while glibc may still read them"
        monkeypatch.setattr(aio, "_prune_at", 0)  # every new write looks at the others
        small = np.zeros(8, dtype=np.uint8)
        end = time.monotonic() + 10
        while kept() is not None:
            assert time.monotonic() < end, "a finished write was never released"
            h = aio.NativeWrite(fd, [1 << 23], [aio.data_address(small)], [8], small)
            while not h.done():
                time.sleep(0.0005)
            gc.collect()
    finally:
        os.close(fd)


def test_an_error_before_a_job_runs_fails_that_job_and_the_level_thread_goes_on(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Anything the level's thread raises around a job (its wait for earlier writes on the
    tier's threads included) is handed to that job: a background write's slots read as
    failed, a call raises, and the thread takes the next job (it used to die, leaving the
    level refusing every operation for good)."""
    from kvcm_core import TierIOError

    io = LevelIO(1, 5.0, write_queue_depth=4, combine_bytes=0)
    pool = _SlowPool()
    real = io._await_native
    fail = {"n": 2}

    def flaky(after: int) -> None:
        if fail["n"]:
            fail["n"] -= 1
            raise MemoryError("no memory for the merge")
        real(after)

    monkeypatch.setattr(io, "_await_native", flaky)
    try:
        io.background(None, "w", pool, np.array([3]), np.ones((1, 64), np.uint8), checked=8)
        with pytest.raises(MemoryError):  # handed to the caller as it was raised
            io.call(lambda: None, "a read", "read")
        ran: list[int] = []
        io.call(lambda: ran.append(1), "the next", "read")  # the thread is alive
        assert ran == [1] and io.thread_alive and io.stats.background_failures == 1
        with pytest.raises(TierIOError, match="not written"):
            io.call(lambda: io.check_readable(pool, np.array([3])), "read slot 3", "read")
    finally:
        io.close([], time.monotonic() + 5)
