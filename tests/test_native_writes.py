"""Background writes on the tier's own threads (``StoragePool.write_behind``): the disk
tier hands them to glibc's AIO threads, which never take Python's interpreter lock, and
the storage level's I/O thread is not involved.

The rules checked here: the data lands and reads back; a closed pool's file outlives its
writes; a read, a synchronous write or a resize of a slot waits for its write on the tier's
threads; a failed write marks its slots (a later read is a lost block, never old data); a
write past the deadline makes the level stuck and it recovers; shutdown lists such a write
as abandoned and closes the pool only after it; a write behind a queued job of the level's
thread goes through that thread, in order.
"""

from __future__ import annotations

import errno
import os
import threading
import time

import numpy as np
import pytest
from disk_helpers import SB, native, seeded_rows, wait_written
from kvcm_tier_disk import DiskTier
from pool_helpers import PassThroughPool

from kvcm_core import InvalidStateError, TierIOError
from kvcm_core.level_io import DeadlinePool, IODeadlineError, LevelIO
from kvcm_core.tier import CompletedIO, StoragePool, WriteBehind


@pytest.fixture
def tier(tmp_path):
    t = DiskTier(None, {"path": str(tmp_path / "d")})
    yield t
    t.close()

# -- the disk tier's write_behind ----------------------------------------------------------


@native
def test_a_write_behind_lands_and_reads_back_in_any_slot_order(tier):
    pool = tier.create_pool(SB, 32)
    rows = seeded_rows(6, 1)
    slots = np.array([9, 3, 4, 5, 20, 0])
    handle = pool.write_behind(slots, rows)
    assert handle is not None
    wait_written(handle)
    assert handle.error() is None
    out = np.zeros_like(rows)
    pool.read(slots, out).wait()
    np.testing.assert_array_equal(out, rows)


def test_native_writes_off_or_unavailable_declines(tmp_path):
    t = DiskTier(None, {"path": str(tmp_path / "d"), "native_writes": False})
    try:
        assert t.create_pool(SB, 4).write_behind(np.array([0]), seeded_rows(1, 2)) is None
    finally:
        t.close()


@native
def test_a_write_behind_refuses_bad_arguments_like_write(tier):
    pool = tier.create_pool(SB, 4)
    with pytest.raises(ValueError, match="only once"):
        pool.write_behind(np.array([1, 1]), seeded_rows(2, 3))
    with pytest.raises(ValueError, match="only once"):
        pool.write_behind(np.array([0, 1, 1, 2]), seeded_rows(4, 3))
    with pytest.raises(ValueError):
        pool.write_behind(np.array([4]), seeded_rows(1, 3))
    with pytest.raises(ValueError):
        pool.write_behind(np.array([0]), np.zeros((1, SB + 1), dtype=np.uint8))
    with pytest.raises(ValueError, match="uint8"):
        pool.write_behind(np.array([1]), seeded_rows(1, 3).astype(np.int16))
    pool.close()
    with pytest.raises(InvalidStateError):
        pool.write_behind(np.array([0]), seeded_rows(1, 3))


@native
def test_a_write_behind_refuses_an_out_of_range_slot_anywhere_in_any_order(tier):
    pool = tier.create_pool(SB, 8)
    for slots in ([3, -1, 5], [8, 0], [0, 2**63 - 1, -5, 5], [7, 6, 9, 1]):
        with pytest.raises(ValueError, match="out of range") as raised:
            pool.write_behind(np.array(slots, dtype=np.int64), seeded_rows(len(slots), 3))
        bad = min(slots) if min(slots) < 0 else max(slots)
        assert f"slot {bad} " in str(raised.value)  # the same words as write's


@native
def test_writes_behind_of_any_slot_pattern_land_in_their_slots(tier):
    pool = tier.create_pool(SB, 64)
    patterns = [[0], [63], [5, 6, 7, 8], [9, 11, 13], [20, 21, 30, 31, 32, 40],
                [50, 49, 48, 60, 2, 3], list(range(64))[::-1],
                [12, 11], [1, 3, 2, 4], [30, 32, 31, 33, 34]]  # a run's span, not in order
    for seed, slots in enumerate(patterns):
        rows = seeded_rows(len(slots), 40 + seed)
        handle = pool.write_behind(np.array(slots), rows)
        wait_written(handle)
        assert handle.error() is None
        out = np.zeros_like(rows)
        pool.read(np.array(slots), out).wait()
        np.testing.assert_array_equal(out, rows)


@native
def test_a_write_behind_to_a_bad_descriptor_reports_its_failure(tier):
    pool = tier.create_pool(SB, 4)
    fd = pool._fd
    saved = os.dup(fd)
    ro = os.open(os.devnull, os.O_RDONLY)
    os.dup2(ro, fd)  # the pool's descriptor now refuses writes
    try:
        handle = pool.write_behind(np.array([1, 3]), seeded_rows(2, 4))
        wait_written(handle)
        assert handle.error() == (f"pwrite at offset {pool.data_offset + SB}: "
                                  f"{os.strerror(errno.EBADF)}")
    finally:
        os.dup2(saved, fd)
        os.close(saved)
        os.close(ro)


@native
def test_closing_a_pool_waits_for_its_writes_behind(tmp_path):
    path = str(tmp_path / "d")
    t = DiskTier(None, {"path": path})
    rows = seeded_rows(200, 5)
    pool = t.create_pool(SB, 256, name="kept")
    pool.write_behind(np.arange(200), rows)
    pool.close()  # at once: the file must still receive every row
    t.close()
    t2 = DiskTier(None, {"path": path})
    try:
        again = t2.create_pool(SB, 256, name="kept")
        out = np.zeros_like(rows)
        again.read(np.arange(200), out).wait()
        np.testing.assert_array_equal(out, rows)
    finally:
        t2.close()


# -- the level's rules, with a write on the tier's threads held back -----------------------


class _Held(WriteBehind):
    """A write behind that finishes only once ``go`` is set (then writes for real)."""

    def __init__(self, pool: StoragePool, slots: np.ndarray, rows: np.ndarray,
                 go: threading.Event, fail: str | None) -> None:
        self.pool, self.slots, self.rows = pool, slots.copy(), rows.copy()
        self.go, self.fail, self.landed = go, fail, False

    def done(self) -> bool:
        if not self.go.is_set():
            return False
        if not self.landed and self.fail is None:
            self.pool.write(self.slots, self.rows).wait()
        self.landed = True
        return True

    def error(self) -> str | None:
        return self.fail


class _HeldPool(PassThroughPool):
    """A real disk pool whose writes behind are held until ``go`` is set."""

    def __init__(self, inner: StoragePool) -> None:
        super().__init__(inner)
        self.go = threading.Event()
        self.fail: str | None = None

    def write_behind(self, slots: np.ndarray, source: np.ndarray) -> WriteBehind:
        return _Held(self.inner, slots, source, self.go, self.fail)


@pytest.fixture
def held(tier):
    inner = tier.create_pool(SB, 16)
    hp = _HeldPool(inner)
    io = LevelIO(2, deadline_s=1.0, write_queue_depth=8)
    pool = DeadlinePool(io, hp)
    yield io, pool, hp
    hp.go.set()
    io.close([("pool", pool.close)], time.monotonic() + 2.0)


def _behind(io: LevelIO, pool: DeadlinePool, slots, rows) -> None:
    with io.dropping(True):
        assert isinstance(pool.write(np.asarray(slots), rows), CompletedIO)


def test_a_read_of_a_slot_written_behind_waits_for_the_write(held):
    io, pool, hp = held
    pool.write(np.array([2]), seeded_rows(1, 10)).wait()  # synchronous: the old rows
    newer = seeded_rows(1, 11)
    _behind(io, pool, [2], newer)
    assert io.background_in_flight == 1 and io.stats.operations == 1
    threading.Timer(0.05, hp.go.set).start()
    out = np.zeros((1, SB), dtype=np.uint8)
    pool.read(np.array([2]), out).wait()
    np.testing.assert_array_equal(out, newer)
    assert io.stats.direct_writes == 1 and io.stats.direct_reads == 0


def test_a_synchronous_write_of_the_same_slot_lands_after_the_write_behind(held):
    io, pool, hp = held
    _behind(io, pool, [5], seeded_rows(1, 12))
    last = seeded_rows(1, 13)
    threading.Timer(0.05, hp.go.set).start()
    pool.write(np.array([5]), last).wait()  # held pages: on the level's thread, after it
    out = np.zeros((1, SB), dtype=np.uint8)
    pool.read(np.array([5]), out).wait()
    np.testing.assert_array_equal(out, last)


def test_a_failed_write_behind_makes_its_slots_lost_never_old(held):
    io, pool, hp = held
    pool.write(np.array([7]), seeded_rows(1, 14)).wait()
    hp.fail = "injected"
    _behind(io, pool, [7], seeded_rows(1, 15))
    hp.go.set()
    assert io.wait_idle(1.0)
    assert io.stats.background_failures == 1 and io.stats.direct_writes == 0
    with pytest.raises(TierIOError, match="background write failed"):
        pool.read(np.array([7]), np.zeros((1, SB), dtype=np.uint8)).wait()


def test_a_write_behind_past_the_deadline_makes_the_level_stuck_until_it_finishes(tier):
    inner = tier.create_pool(SB, 16)
    hp = _HeldPool(inner)
    io = LevelIO(2, deadline_s=0.05, write_queue_depth=8)
    pool = DeadlinePool(io, hp)
    rows = seeded_rows(1, 16)
    pool.write(np.array([0]), rows).wait()
    _behind(io, pool, [9], seeded_rows(1, 17))
    time.sleep(0.1)
    assert io.stuck() is not None
    t0 = time.monotonic()
    with pytest.raises(IODeadlineError, match="stuck"):
        pool.read(np.array([0]), np.zeros((1, SB), dtype=np.uint8)).wait()
    assert time.monotonic() - t0 < 0.05
    hp.go.set()
    assert io.stuck() is None  # recovered once the write finished
    out = np.zeros((1, SB), dtype=np.uint8)
    pool.read(np.array([0]), out).wait()
    np.testing.assert_array_equal(out, rows)
    io.close([("pool", pool.close)], time.monotonic() + 1.0)


def test_a_write_behind_seen_past_its_deadline_is_one_background_miss_not_a_write_miss(tier):
    inner = tier.create_pool(SB, 16)
    hp = _HeldPool(inner)
    io = LevelIO(2, deadline_s=0.05, write_queue_depth=8)
    pool = DeadlinePool(io, hp)
    _behind(io, pool, [9], seeded_rows(1, 18))
    time.sleep(0.1)
    out = np.zeros((1, SB), dtype=np.uint8)
    for _ in range(2):  # refused at once, twice: each a fast fail, the write counted once
        with pytest.raises(IODeadlineError, match="stuck"):
            pool.read(np.array([0]), out).wait()
    st = io.stats
    assert (st.background_misses, st.fast_fails, st.read_misses, st.write_misses) == \
        (1, 2, 0, 0), st.as_dict()
    hp.go.set()
    assert io.wait_idle(1.0) and io.stats.background_misses == 1
    assert io.stats.direct_writes == 1  # late, but written
    io.close([("pool", pool.close)], time.monotonic() + 1.0)


def test_shutdown_lists_an_unfinished_write_behind_and_closes_the_pool_after_it(tier):
    inner = tier.create_pool(SB, 16)
    hp = _HeldPool(inner)
    io = LevelIO(2, deadline_s=0.05, write_queue_depth=8)
    pool = DeadlinePool(io, hp)
    _behind(io, pool, [3], seeded_rows(1, 18))  # the level's thread never started
    closed = threading.Event()

    def close() -> None:
        pool.close()
        closed.set()

    failures, abandoned = io.close([("pool", close)], time.monotonic() + 0.05)
    assert not failures and any("on the tier's threads" in a for a in abandoned)
    assert not closed.is_set()  # the file stays open while the write may still land
    hp.go.set()
    assert closed.wait(2.0)


def test_a_write_behind_queued_after_a_job_of_the_levels_thread_goes_through_it(held):
    io, pool, _ = held
    gate = threading.Event()
    io.call_later(gate.wait, "a slow job")  # the level's thread is busy, then queued
    rows = seeded_rows(1, 19)
    _behind(io, pool, [4], rows)  # must not overtake the queued job
    assert io.stats.direct_writes == 0 and io.background_in_flight == 1
    gate.set()
    assert io.wait_idle(1.0)
    out = np.zeros((1, SB), dtype=np.uint8)
    pool.read(np.array([4]), out).wait()
    np.testing.assert_array_equal(out, rows)
    assert io.stats.direct_writes == 0  # written by the level's thread


def test_a_slot_written_behind_again_before_the_first_write_finished_goes_in_order(held):
    io, pool, hp = held
    _behind(io, pool, [6], seeded_rows(1, 20))  # held back on the tier's threads
    last = seeded_rows(1, 21)
    _behind(io, pool, [6], last)  # the same slot: through the level's thread, after it
    assert io.stats.direct_writes == 0
    threading.Timer(0.05, hp.go.set).start()
    assert io.wait_idle(2.0)
    out = np.zeros((1, SB), dtype=np.uint8)
    pool.read(np.array([6]), out).wait()
    np.testing.assert_array_equal(out, last)
    assert io.stats.direct_writes == 1  # the first; the second went through the thread


@native
def test_a_levels_background_writes_run_without_its_thread_and_read_back(tier):
    io = LevelIO(2, deadline_s=1.0, write_queue_depth=8)
    pool = DeadlinePool(io, tier.create_pool(SB, 16))
    rows = seeded_rows(4, 22)
    source = rows.copy()
    _behind(io, pool, [8, 1, 2, 3], source)
    source[:] = 0  # the caller may reuse its rows at once
    assert io.wait_idle(2.0)
    assert io.stats.direct_writes == 1 and not io.thread_alive  # the thread never started
    out = np.zeros_like(rows)
    pool.read(np.array([8, 1, 2, 3]), out).wait()
    np.testing.assert_array_equal(out, rows)
    io.close([("pool", pool.close)], time.monotonic() + 1.0)


@native
def test_a_background_write_naming_a_slot_twice_keeps_its_last_row_as_before(tier):
    io = LevelIO(2, deadline_s=1.0, write_queue_depth=8)
    pool = DeadlinePool(io, tier.create_pool(SB, 16))
    rows = seeded_rows(2, 23)
    source = rows.copy()
    _behind(io, pool, [5, 5], source)  # write_behind refuses it: the level's thread writes
    source[:] = 0  # ... a copy: the caller may reuse its rows at once
    assert io.wait_idle(2.0) and io.stats.direct_writes == 0
    out = np.zeros((1, SB), dtype=np.uint8)
    pool.read(np.array([5]), out).wait()
    np.testing.assert_array_equal(out[0], rows[1])
    io.close([("pool", pool.close)], time.monotonic() + 1.0)
