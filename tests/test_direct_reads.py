"""Reads that skip the I/O thread: a storage level with an I/O thread first tries a read on
the caller's thread with ``StoragePool.read_nowait`` (the disk tier: ``preadv2`` with
``RWF_NOWAIT``, page cache only), and only when nothing it must wait for is queued.

The rules checked here: a direct read returns the same bytes as the thread's read; it never
overtakes a queued or running write of a slot it reads; it is never used for a slot whose
background write failed or while the level is stuck; and declining falls back to the
thread's read.
"""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest
from kvcm_tier_disk import DiskTier
from levels_helpers import Driver, assert_all_free, close_all, make_manager, page_levels, tokens
from pool_helpers import PassThroughPool

from kvcm_core import TierIOError
from kvcm_core.level_io import DeadlinePool, IODeadlineError, LevelIO
from kvcm_core.tier import CompletedIO, IOHandle, StoragePool

SB = 64  # slot bytes


def _rows(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, SB), dtype=np.uint8)


@pytest.fixture
def disk(tmp_path):
    # Background writes through the level's thread (so that they stay queued): the
    # tier's own threads (native_writes) are tested in test_native_writes.py.
    tier = DiskTier(None, {"path": str(tmp_path / "d"), "native_writes": False})
    pool = tier.create_pool(SB, 16)
    rows = _rows(1, 0)
    pool.write(np.array([0]), rows).wait()
    if not pool.read_nowait(np.array([0]), np.empty_like(rows)):
        pool.close()
        tier.close()
        pytest.skip("this file system has no page-cache-only reads (RWF_NOWAIT)")
    yield tier, pool
    tier.close()


def _level(pool: StoragePool) -> tuple[LevelIO, DeadlinePool]:
    io = LevelIO(2, deadline_s=1.0, write_queue_depth=8)
    return io, DeadlinePool(io, pool)


def _close(io: LevelIO, pool: DeadlinePool) -> None:
    io.close([("pool", pool.close)], time.monotonic() + 1.0)


def test_a_read_of_cached_file_data_runs_on_the_callers_thread_and_matches(disk):
    _, inner = disk
    io, pool = _level(inner)
    rows = _rows(6, 1)
    pool.write(np.arange(6), rows).wait()  # synchronous, on the thread
    with io.dropping(True):  # background writes of other slots, queued (thread asleep)
        pool.write(np.array([8, 9]), _rows(2, 2)).wait()
    ops = io.stats.operations
    out = np.zeros((3, SB), dtype=np.uint8)
    pool.read(np.array([4, 0, 1]), out).wait()
    np.testing.assert_array_equal(out, rows[[4, 0, 1]])
    assert io.stats.direct_reads == 1
    assert io.stats.operations == ops  # the thread ran nothing for it...
    assert io.background_in_flight == 1  # ...and the queued write is still queued
    assert io.wait_idle(1.0)
    _close(io, pool)


def test_a_read_of_a_slot_with_a_queued_background_write_waits_and_sees_its_rows(disk):
    _, inner = disk
    io, pool = _level(inner)
    pool.write(np.array([3, 4]), _rows(2, 3)).wait()
    newer = _rows(1, 4)
    with io.dropping(True):
        pool.write(np.array([4]), newer).wait()  # queued, not yet on the file
    out = np.zeros((2, SB), dtype=np.uint8)
    pool.read(np.array([3, 4]), out).wait()
    np.testing.assert_array_equal(out[1], newer[0])
    assert io.stats.direct_reads == 0
    _close(io, pool)


class _Switchable(PassThroughPool):
    """A real disk pool whose writes can be made to fail or to block (the fault a test
    needs) while its reads, ``read_nowait`` included, are the disk pool's own."""

    def __init__(self, inner: StoragePool) -> None:
        super().__init__(inner)
        self.fail = False
        self.block: threading.Event | None = None

    def write(self, slots: np.ndarray, source: np.ndarray) -> IOHandle:
        if self.block is not None:
            self.block.wait()
        if self.fail:
            return CompletedIO(TierIOError("injected write failure"))
        return self.inner.write(slots, source)


def test_a_read_of_a_slot_whose_background_write_is_running_waits_for_it(disk):
    """The write being run (a merged batch) counts too: a direct read of its slot could
    return the old rows or half of the new ones."""
    _, inner = disk
    sw = _Switchable(inner)
    io = LevelIO(2, deadline_s=1.0, write_queue_depth=2)  # a write wakes the thread
    pool = DeadlinePool(io, sw)
    pool.write(np.array([2, 3]), _rows(2, 30)).wait()  # the old rows, on the file
    newer = _rows(1, 31)
    sw.block = threading.Event()
    with io.dropping(True):
        pool.write(np.array([2]), newer).wait()  # running, blocked before the file
    threading.Timer(0.05, sw.block.set).start()
    out = np.zeros((1, SB), dtype=np.uint8)
    pool.read(np.array([2]), out).wait()
    np.testing.assert_array_equal(out[0], newer[0])
    assert io.stats.direct_reads == 0
    other = np.zeros((1, SB), dtype=np.uint8)
    pool.read(np.array([3]), other).wait()  # nothing running now: direct
    assert io.stats.direct_reads == 1
    _close(io, pool)


def test_a_slot_whose_background_write_failed_is_never_read_directly(disk):
    _, inner = disk
    sw = _Switchable(inner)
    io, pool = _level(sw)
    pool.write(np.array([5]), _rows(1, 5)).wait()  # good data on the file
    sw.fail = True
    with io.dropping(True):
        pool.write(np.array([5]), _rows(1, 6)).wait()  # fails in the background
    assert io.wait_idle(1.0) and io.stats.background_failures == 1
    with pytest.raises(TierIOError, match="background write failed"):
        pool.read(np.array([5]), np.zeros((1, SB), dtype=np.uint8)).wait()  # not the old
    assert io.stats.direct_reads == 0
    _close(io, pool)


def test_a_stuck_level_refuses_reads_at_once_even_of_cached_data(disk):
    _, inner = disk
    sw = _Switchable(inner)
    io = LevelIO(2, deadline_s=0.05, write_queue_depth=2)  # a write wakes the thread
    pool = DeadlinePool(io, sw)
    rows = _rows(2, 7)
    pool.write(np.array([0, 1]), rows).wait()
    sw.block = threading.Event()
    with io.dropping(True):
        pool.write(np.array([9]), _rows(1, 8)).wait()  # running, blocked
    time.sleep(0.1)  # past the deadline: the level is stuck, nothing else is queued
    t0 = time.monotonic()
    with pytest.raises(IODeadlineError, match="stuck"):
        pool.read(np.array([0]), np.zeros((1, SB), dtype=np.uint8)).wait()
    assert time.monotonic() - t0 < 0.05 and io.stats.direct_reads == 0
    sw.block.set()
    assert io.wait_idle(1.0)
    out = np.zeros((2, SB), dtype=np.uint8)
    pool.read(np.array([0, 1]), out).wait()  # recovered: a direct read again
    np.testing.assert_array_equal(out, rows)
    assert io.stats.direct_reads == 1
    _close(io, pool)


def test_a_declined_direct_read_falls_back_to_the_thread(disk):
    _, inner = disk
    sw = _Switchable(inner)
    sw.read_nowait = lambda slots, dest: False  # type: ignore[method-assign]
    io, pool = _level(sw)
    rows = _rows(3, 10)
    pool.write(np.arange(3), rows).wait()
    ops = io.stats.operations
    out = np.zeros((3, SB), dtype=np.uint8)
    pool.read(np.array([2, 1, 0]), out).wait()
    np.testing.assert_array_equal(out, rows[::-1])
    assert io.stats.operations == ops + 1 and io.stats.direct_reads == 0
    _close(io, pool)


def test_resumes_from_a_disk_level_read_directly_and_every_byte_checks(tmp_path):
    m = make_manager([("gpu", 8), ("host", 8), ("disk", 40)], tmp_path)
    try:
        d = Driver(m)
        a = d.write(tokens(30, 11), end=25)  # suspended, then pushed to disk by b and c
        d.write(tokens(32, 12), chunk=32)
        d.write(tokens(32, 13), chunk=32)
        assert set(page_levels(a)) == {2}
        io = m.storage_levels.io[2]
        assert io is not None and io.wait_idle(1.0)
        d.resume_and_verify(a)  # fingerprint-checks every page it brought back
        if _nowait_here(tmp_path):
            assert io.stats.direct_reads >= 1
        close_all(m)
        assert_all_free(m)
    finally:
        m.shutdown()


def _nowait_here(tmp_path) -> bool:
    """Whether the file system under ``tmp_path`` serves page-cache-only reads."""
    tier = DiskTier(None, {"path": str(tmp_path / "probe")})
    try:
        pool = tier.create_pool(SB, 1)
        pool.write(np.array([0]), _rows(1, 0)).wait()
        return pool.read_nowait(np.array([0]), np.empty((1, SB), dtype=np.uint8))
    finally:
        tier.close()


def test_a_file_system_without_page_cache_only_reads_is_read_through_the_thread():
    """tmpfs refuses RWF_NOWAIT: the pool stops trying after the first refusal, and the
    level's reads still return the right rows, through its thread."""
    import shutil
    import tempfile

    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm here")
    base = tempfile.mkdtemp(prefix="kvcm-test-", dir="/dev/shm")
    try:
        tier = DiskTier(None, {"path": os.path.join(base, "d")})
        inner = tier.create_pool(SB, 8)
        rows = _rows(4, 20)
        inner.write(np.arange(4), rows).wait()
        if inner.read_nowait(np.array([0]), np.empty((1, SB), dtype=np.uint8)):
            tier.close()
            pytest.skip("this /dev/shm serves page-cache-only reads")
        assert inner._nowait is False  # refused once: never tried again
        io, pool = _level(inner)
        out = np.zeros((2, SB), dtype=np.uint8)
        pool.read(np.array([3, 1]), out).wait()
        np.testing.assert_array_equal(out, rows[[3, 1]])
        assert io.stats.direct_reads == 0 and io.stats.operations == 1
        _close(io, pool)
        tier.close()
    finally:
        shutil.rmtree(base, ignore_errors=True)
