"""Fast paths of the host-to-disk page move and of disk reads (``level_io``, the disk
tier, ``frame``, ``migration``): each keeps the checks and the results of the general path.

The rules checked here: a storage level's ``write`` and ``read`` still refuse bad slots and
rows at the call, background or not; the level's own entry into the disk pool
(``_write_behind_checked``; ``write_behind`` called directly checks everything, see
``test_native_writes.py``) skips only the
slot check its caller made, only while that check covers the pool, and only for the disk
pool's own ``write_behind``; a write behind of one request reports its failure like one of
several; page-cache reads of slots in any order (repeats included) give the thread's rows;
the CRC-32C of many rows is one CRC per row; the kept view of a host pool's pages follows
a pool that moved.
"""

from __future__ import annotations

import errno
import os
import time

import kvcm_tier_disk
import numpy as np
import pytest
from disk_helpers import SB, native, seeded_rows, wait_written
from kvcm_tier_disk import DiskPool, DiskTier
from levels_helpers import Driver, make_manager, tokens

from kvcm_core import InvalidArgumentError, InvalidStateError, TierIOError
from kvcm_core.frame import FrameBook, FrameFormat
from kvcm_core.level_io import DeadlinePool, LevelIO
from kvcm_core.tier import DevicePool, check_slots


@pytest.fixture
def tier(tmp_path):
    t = DiskTier(None, {"path": str(tmp_path / "d")})
    yield t
    t.close()


@pytest.fixture
def level(tier):
    io = LevelIO(2, deadline_s=1.0, write_queue_depth=8)
    pool = DeadlinePool(io, tier.create_pool(SB, 16))
    yield io, pool
    io.close([("pool", pool.close)], time.monotonic() + 1.0)


# -- the public checks of a storage level -----------------------------------------------------


@pytest.mark.parametrize("droppable", [True, False])
@pytest.mark.parametrize("slots", [[16], [-1], [3, 2**40], [0, -7, 5]])
def test_a_levels_write_refuses_bad_slots_at_the_call(level, droppable, slots):
    io, pool = level
    with io.dropping(droppable), pytest.raises(InvalidArgumentError, match="out of range"):
        pool.write(np.array(slots, dtype=np.int64), seeded_rows(len(slots), 1))
    assert io.background_in_flight == 0 and io.stats.operations == 0  # nothing queued


def test_a_levels_synchronous_write_refuses_bad_rows(level):
    _, pool = level
    with pytest.raises(ValueError, match=r"must be \(2, 64\)"):
        pool.write(np.array([1, 2]), seeded_rows(2, 2, SB - 1)).wait()


def test_a_levels_background_write_of_bad_rows_never_lands_and_its_slots_read_as_lost(level):
    io, pool = level
    pool.write(np.array([1]), seeded_rows(1, 3)).wait()  # good rows first
    with io.dropping(True):  # as before: the pool refuses them where they are written
        pool.write(np.array([1, 2]), seeded_rows(2, 4, SB - 1)).wait()
    assert io.wait_idle(1.0)
    assert io.stats.background_failures == 1 and io.stats.direct_writes == 0
    with pytest.raises(TierIOError, match="background write failed"):
        pool.read(np.array([1]), np.zeros((1, SB), dtype=np.uint8)).wait()


def test_a_levels_read_refuses_bad_slots_and_rows(level):
    _, pool = level
    with pytest.raises(InvalidArgumentError, match="slot 16 out of range"):
        pool.read(np.array([3, 16]), np.zeros((2, SB), dtype=np.uint8))
    with pytest.raises(ValueError, match=r"must be \(1, 64\)"):
        pool.read(np.array([3]), np.zeros((1, SB + 1), dtype=np.uint8)).wait()


# -- the disk pool's write behind: public and level entries -----------------------------------


@native
def test_the_levels_background_write_checks_its_slots_once(level, monkeypatch):
    io, pool = level
    seen = []

    def counted(p, slots):
        seen.append(type(p).__name__)
        return check_slots(p, slots)

    monkeypatch.setattr(kvcm_tier_disk, "check_slots", counted)
    monkeypatch.setattr("kvcm_core.level_io.check_slots", counted)
    rows = seeded_rows(5, 5)
    with io.dropping(True):
        pool.write(np.array([9, 3, 4, 5, 12]), rows).wait()
    assert io.wait_idle(2.0) and io.stats.direct_writes == 1
    assert seen == ["DeadlinePool"]  # the disk pool took the level's checked slots
    out = np.zeros_like(rows)
    pool.read(np.array([9, 3, 4, 5, 12]), out).wait()
    np.testing.assert_array_equal(out, rows)


@native
def test_the_checked_entry_checks_slots_again_unless_the_check_covers_the_pool(tier):
    pool = tier.create_pool(SB, 16)
    rows = seeded_rows(2, 7)
    handle = pool._write_behind_checked(check_slots(pool, np.array([14, 15])), rows, 16)
    wait_written(handle)
    assert handle.error() is None
    out = np.zeros_like(rows)
    pool.read(np.array([14, 15]), out).wait()
    np.testing.assert_array_equal(out, rows)
    pool.resize(8)  # slots checked against 16 are no longer all in this pool
    with pytest.raises(InvalidArgumentError, match="slot 14 out of range"):
        pool._write_behind_checked(np.array([3, 14], dtype=np.int64), rows, 16)
    with pytest.raises(ValueError, match=r"must be \(2, 64\)"):  # rows: always checked
        pool._write_behind_checked(np.array([3, 4], dtype=np.int64), rows[:, 1:], 8)
    with pytest.raises(ValueError, match="only once"):  # repeats: always checked
        pool._write_behind_checked(np.array([4, 3, 4], dtype=np.int64), seeded_rows(3, 7), 8)
    pool.close()
    with pytest.raises(InvalidStateError):
        pool._write_behind_checked(np.array([0], dtype=np.int64), rows[:1], 8)


@native
def test_the_checked_entry_goes_through_a_subclass_own_write_behind(tier):
    calls = []

    class Counting(DiskPool):
        def write_behind(self, slots, source):
            calls.append(np.asarray(slots).tolist())
            return super().write_behind(slots, source)

    pool = tier.create_pool(SB, 8)
    pool.__class__ = Counting
    handle = pool._write_behind_checked(np.array([1, 2], dtype=np.int64), seeded_rows(2, 8), 8)
    wait_written(handle)
    assert calls == [[1, 2]] and handle.error() is None


@native
@pytest.mark.parametrize("slots", [[2], [4, 5, 6], [1, 3]])
def test_a_failed_write_behind_of_one_or_more_requests_names_its_first_offset(tier, slots):
    pool = tier.create_pool(SB, 8)
    fd = pool._fd
    saved = os.dup(fd)
    ro = os.open(os.devnull, os.O_RDONLY)
    os.dup2(ro, fd)  # the pool's descriptor now refuses writes
    try:
        handle = pool.write_behind(np.array(slots), seeded_rows(len(slots), 9))
        wait_written(handle)
        assert handle.error() == (f"pwrite at offset {pool.data_offset + slots[0] * SB}: "
                                  f"{os.strerror(errno.EBADF)}")
    finally:
        os.dup2(saved, fd)
        os.close(saved)
        os.close(ro)


# -- reads from the page cache ----------------------------------------------------------------


@pytest.fixture
def cached(tmp_path):
    tier = DiskTier(None, {"path": str(tmp_path / "c"), "native_writes": False})
    pool = tier.create_pool(SB, 512)
    rows = seeded_rows(512, 10)
    pool.write(np.arange(512), rows).wait()
    if not pool.read_nowait(np.array([0]), np.empty((1, SB), dtype=np.uint8)):
        tier.close()
        pytest.skip("this file system has no page-cache-only reads (RWF_NOWAIT)")
    yield tier, pool, rows
    tier.close()


def test_page_cache_reads_of_slots_in_any_order_give_their_rows(cached):
    _, pool, rows = cached
    rng = np.random.default_rng(11)
    runs = np.concatenate([np.arange(10, 60), np.arange(100, 140), np.arange(300, 330)])
    for slots in (rng.permutation(runs),  # 120 runs as given, 3 in slot order
                  np.array([7, 7, 3, 500, 3, 8]),  # repeats
                  np.array([40, 39, 38, 37])):
        out = np.zeros((len(slots), SB), dtype=np.uint8)
        assert pool.read_nowait(slots, out)
        np.testing.assert_array_equal(out, rows[slots])


def test_page_cache_reads_still_decline_many_runs_and_bad_slots(cached):
    _, pool, _ = cached
    scattered = np.random.default_rng(12).permutation(np.arange(0, 512, 4))  # 128 runs
    assert not pool.read_nowait(scattered, np.zeros((len(scattered), SB), dtype=np.uint8))
    for bad in ([5, 512], [-1, 4]):
        assert not pool.read_nowait(np.array(bad), np.zeros((2, SB), dtype=np.uint8))


def test_a_levels_read_of_unordered_slots_runs_on_the_callers_thread(cached):
    _, inner, rows = cached
    io = LevelIO(2, deadline_s=1.0, write_queue_depth=8)
    pool = DeadlinePool(io, inner)
    slots = np.random.default_rng(13).permutation(np.arange(200, 300))
    out = np.zeros((len(slots), SB), dtype=np.uint8)
    pool.read(slots, out).wait()
    np.testing.assert_array_equal(out, rows[slots])
    assert io.stats.direct_reads == 1 and io.stats.operations == 0
    io.close([], time.monotonic() + 1.0)


# -- frames and the mover ---------------------------------------------------------------------


def test_frame_records_of_a_wrap_are_its_keys_and_sequence_numbers():
    book = FrameBook(FrameFormat(1, bytes(16)), 64, 8)
    slots = np.array([40, 3, 17, 9, 60, 2], dtype=np.int32)
    keys = seeded_rows(6, 15, 32)
    frames = book.wrap(slots, seeded_rows(6, 16, 8), keys)
    np.testing.assert_array_equal(book.keys[slots], keys)
    assert book.seqs[slots].tolist() == list(range(1, 7))
    assert book.check(slots, frames).all()
    one = book.wrap(np.array([5, 6, 7, 8, 10]), seeded_rows(5, 17, 8), keys[:1])  # one key, 5 pages
    np.testing.assert_array_equal(book.keys[[5, 6, 7, 8, 10]], np.repeat(keys[:1], 5, 0))
    assert book.check(np.array([5, 6, 7, 8, 10]), one).all()


def test_the_kept_view_of_host_pages_follows_a_pool_that_moved(tmp_path, cleanup):
    m = make_manager([("gpu", 8), ("host", 8), ("disk", 32)], tmp_path)
    cleanup(m)
    d = Driver(m)
    mover = m.storage_levels.mover
    caches = [d.write(tokens(24, seed)) for seed in range(4)]  # pages pushed host to disk
    pool = m.stores[1][0].pools[0]
    assert isinstance(pool, DevicePool) and mover._host  # a view was kept
    before = pool.buffer
    mover.forget_plans = lambda: None  # keep the views over the resize
    assert m.resize(1, m.levels[1].quota * 2)
    assert pool.buffer is not before  # the host pool moved: the kept view must not serve
    kept = dict(mover._host)
    caches.pop(0).close()
    caches.pop(0).close()
    caches += [d.write(tokens(24, seed)) for seed in range(4, 9)]  # host to disk again
    assert mover._host != kept  # a view of the new buffer
    d.resume_and_verify(*caches)  # every page read back as written
    for cache in caches:
        cache.close()


@native
def test_a_wrapper_forwarding_attributes_keeps_its_own_write_behind(tier):
    calls = []

    class Forwarding(DeadlinePool):  # forwards unknown attributes to the disk pool
        def write_behind(self, slots, source):
            calls.append(np.asarray(slots).tolist())
            return self.inner_pool.write_behind(slots, source)

    inner_io = LevelIO(3, deadline_s=None)
    wrapped = Forwarding(inner_io, tier.create_pool(SB, 16))
    assert callable(wrapped._write_behind_checked)  # reachable through __getattr__ ...
    io = LevelIO(2, deadline_s=1.0, write_queue_depth=8)
    pool = DeadlinePool(io, wrapped)
    rows = seeded_rows(2, 18)
    with io.dropping(True):
        pool.write(np.array([6, 7]), rows).wait()
    assert io.wait_idle(2.0) and io.stats.direct_writes == 1
    assert calls == [[6, 7]]  # ... but the level went through the wrapper's write_behind
    out = np.zeros_like(rows)
    pool.read(np.array([6, 7]), out).wait()
    np.testing.assert_array_equal(out, rows)
    io.close([("pool", pool.close)], time.monotonic() + 1.0)
