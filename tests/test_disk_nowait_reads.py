"""Page-cache-only reads of the disk tier (``DiskPool.read_nowait``, through
``kvcm_tier_disk.aio.read_nowait``: ``preadv2`` with ``RWF_NOWAIT``), whatever the order of
the slots: in slot order, one run named from the top down (how a level usually names the
slots of an onboard), or scattered, repeats included.

The rules checked here: a read that comes back gives exactly the rows the thread's read
gives; a read of data not in the page cache is declined (False, never a wait for the
device) and a level then reads through its I/O thread, with the right rows; where the
platform has no such call the pool declines and stops trying, and the level's reads go to
its thread.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import time

import numpy as np
import pytest
from disk_helpers import SB, seeded_rows
from hypothesis import given, settings
from hypothesis import strategies as st
from kvcm_tier_disk import DiskTier, aio

from kvcm_core.level_io import DeadlinePool, LevelIO

SLOTS = 512
PAGE_SB = 4096  # slots of a page each: a run of slots is a run of file pages
_LIBC = ctypes.CDLL(None, use_errno=True)


@pytest.fixture(scope="module")
def cached(tmp_path_factory):
    tier = DiskTier(None, {"path": str(tmp_path_factory.mktemp("c") / "c"),
                           "native_writes": False})
    pool = tier.create_pool(SB, SLOTS)
    rows = seeded_rows(SLOTS, 3)
    pool.write(np.arange(SLOTS), rows).wait()
    if not pool.read_nowait(np.array([0]), np.empty((1, SB), dtype=np.uint8)):
        tier.close()
        pytest.skip("this file system has no page-cache-only reads (RWF_NOWAIT)")
    yield pool, rows
    tier.close()


def _runs(draw_runs: list[tuple[int, int, bool]]) -> np.ndarray:
    """Slots as runs ``(first, length, downwards)``, concatenated as drawn."""
    parts = []
    for first, length, down in draw_runs:
        run = np.arange(first, min(first + length, SLOTS))
        parts.append(run[::-1] if down else run)
    return np.concatenate(parts)


@settings(max_examples=150, deadline=None)
@given(runs=st.lists(st.tuples(st.integers(0, SLOTS - 1), st.integers(1, 40), st.booleans()),
                     min_size=1, max_size=8))
def test_a_page_cache_read_of_slots_in_any_order_gives_their_rows(cached, runs):
    """Runs up or down, overlapping or repeated: the rows of the slots as named, the same
    as the pool's ordinary read gives."""
    pool, rows = cached
    slots = _runs(runs)
    out = np.zeros((len(slots), SB), dtype=np.uint8)
    if pool.read_nowait(slots, out):  # (declined only past the limits on runs, bytes)
        np.testing.assert_array_equal(out, rows[slots])
    ref = np.zeros_like(out)
    pool.read(slots, ref).wait()
    np.testing.assert_array_equal(ref, rows[slots])


@pytest.mark.parametrize("slots", [
    np.arange(100, 140), np.arange(139, 99, -1), np.array([200, 201, 202, 90, 91, 5]),
    np.array([105, 104, 103, 100, 99, 101, 105])])
def test_a_page_cache_read_gives_the_rows_for_every_slot_type(cached, slots):
    pool, rows = cached
    for dtype in (np.int32, np.int64, np.uint32, np.uint64):
        out = np.zeros((len(slots), SB), dtype=np.uint8)
        assert pool.read_nowait(slots.astype(dtype), out)
        np.testing.assert_array_equal(out, rows[slots])


@pytest.mark.parametrize("bad", [[3, 2, 1, -1], [SLOTS, SLOTS - 1], [1, 0, -1],
                                 [7, 3, SLOTS], [-5, 3, 9], [SLOTS + 1, SLOTS]])
def test_a_page_cache_read_of_a_slot_out_of_range_is_declined(cached, bad):
    """Bad slots, in a run downwards too, are left to the ordinary read to refuse."""
    pool, _ = cached
    slots = np.array(bad)
    assert not pool.read_nowait(slots, np.zeros((len(slots), SB), dtype=np.uint8))


@pytest.mark.parametrize(("slots", "calls"), [
    (np.array([60, 59, 58, 50, 49, 48, 47]), 1),  # runs downwards, close: one span
    (np.array([60, 61, 55, 56, 57, 54]), 1),  # close, not in order: one span
    (np.array([300, 299, 10, 9]), 2),  # far apart: a call per run
    (np.array([9, 10, 30, 31]), 2)])  # in slot order: a call per run, no copy
def test_slots_close_together_not_in_order_are_read_in_one_call(cached, monkeypatch, slots,
                                                                calls):
    """Slots not in slot order whose span holds at most twice as many slots are one call
    (the rows between them read and left); others a call per run."""
    pool, rows = cached
    seen = []
    real = aio.read_nowait

    def spy(fd, offsets, addresses, sizes):
        seen.append(len(offsets))
        return real(fd, offsets, addresses, sizes)

    monkeypatch.setattr(aio, "read_nowait", spy)
    out = np.zeros((len(slots), SB), dtype=np.uint8)
    assert pool.read_nowait(slots, out)
    np.testing.assert_array_equal(out, rows[slots])
    assert seen == [calls]


# -- data not in the page cache ---------------------------------------------------------------


@pytest.fixture
def uncached(tmp_path):
    tier = DiskTier(None, {"path": str(tmp_path / "u"), "native_writes": False})
    pool = tier.create_pool(PAGE_SB, 256)
    rows = seeded_rows(256, 4, PAGE_SB)
    pool.write(np.arange(256), rows).wait()
    if not pool.read_nowait(np.array([0]), np.empty((1, PAGE_SB), dtype=np.uint8)):
        tier.close()
        pytest.skip("this file system has no page-cache-only reads (RWF_NOWAIT)")
    yield tier, pool, rows
    tier.close()


def _resident(pool, slots) -> int:
    """How many of ``slots`` have their file page in the page cache (``mincore``, which
    reads nothing: a page-cache-only read of an absent page may start reading it in)."""
    size = pool.data_offset + (int(np.max(slots)) + 1) * PAGE_SB
    # (copy-on-write: a writable buffer for ctypes; nothing is written or read)
    with mmap.mmap(pool._fd, size, access=mmap.ACCESS_COPY) as mm:
        vec = (ctypes.c_ubyte * (-(-size // mmap.PAGESIZE)))()
        view = ctypes.c_char.from_buffer(mm)  # (the mapping's address; nothing is read)
        try:
            failed = _LIBC.mincore(ctypes.c_void_p(ctypes.addressof(view)),
                                   ctypes.c_size_t(size), vec)
        finally:
            del view  # (a live export keeps the mapping from closing)
        if failed:
            pytest.skip("mincore is not available here")
        pages = (pool.data_offset + np.asarray(slots) * PAGE_SB) // mmap.PAGESIZE
        return sum(vec[p] & 1 for p in pages.tolist())


def _drop_cache(pool, slots=(128,)) -> None:
    """Write the file back and drop its pages from the page cache, until none of
    ``slots`` is there in two looks 20 ms apart (a page still being read in, say by the
    readahead a declined read started, may not count as there yet and cannot be dropped:
    drop again once it is); skips where they stay (a file system that ignores the
    advice)."""
    fd = pool._fd
    clean = 0
    for _ in range(60):
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        clean = clean + 1 if not _resident(pool, slots) else 0
        if clean == 2:
            return
        time.sleep(0.02)
    pytest.skip("the file's pages stayed in the page cache (POSIX_FADV_DONTNEED)")


def _declined_once_uncached(pool, slots, tries: int = 10) -> bool:
    """Whether a page-cache-only read of ``slots`` is declined right after they were
    dropped from the page cache. A readahead still in flight (the fixture's read started
    one) can bring a slot back between the drop and the read under load (seen once in a
    run beside other work, 2026-12-06): the read then succeeds, rightly, so drop and try
    again, a few times; a pool that never declines still fails."""
    for _ in range(tries):
        _drop_cache(pool, slots)
        out = np.zeros((len(slots), PAGE_SB), dtype=np.uint8)
        if not pool.read_nowait(slots, out):
            return True
    return False


@pytest.mark.skipif(not hasattr(os, "RWF_NOWAIT"), reason="Linux preadv2 flags only")
@pytest.mark.parametrize("slots", [
    np.array([40]), np.arange(40, 48), np.arange(47, 39, -1), np.array([60, 10, 11, 200]),
    np.array([10, 11, 12, 100, 101])])
def test_a_read_of_data_not_in_the_page_cache_is_declined_and_goes_to_the_thread(
        uncached, slots):
    """The page-cache-only read never waits for the device: it says no (False), and the
    level then reads through its I/O thread and still gives the right rows."""
    _, inner, rows = uncached
    assert _declined_once_uncached(inner, slots)
    assert inner._nowait  # declined for now, not given up
    io = LevelIO(2, deadline_s=5.0, write_queue_depth=8)
    pool = DeadlinePool(io, inner)
    try:
        # Every read gives the right rows. One whose slots were still out of the page cache
        # goes through the thread; on a fast disk (this VM's virtual one) the readahead a
        # declined read starts can land between the drop and the read, which is then
        # served on the caller's thread: drop and read again, a few times.
        through_thread = False
        for _ in range(10):
            _drop_cache(inner, slots)
            direct, ops = io.stats.direct_reads, io.stats.operations
            out = np.zeros((len(slots), PAGE_SB), dtype=np.uint8)
            pool.read(slots, out).wait()
            np.testing.assert_array_equal(out, rows[slots])
            direct, ops = io.stats.direct_reads - direct, io.stats.operations - ops
            assert (direct, ops) in ((0, 1), (1, 0))  # one read, served once
            if ops:
                through_thread = True
                break
        assert through_thread
    finally:
        io.close([], time.monotonic() + 1.0)


@pytest.mark.skipif(not hasattr(os, "RWF_NOWAIT"), reason="Linux preadv2 flags only")
def test_a_span_read_is_declined_when_a_slot_between_is_not_in_the_page_cache(uncached):
    """Slots close together are read as one span: the slots between them count as the
    rest do, so a page between them that is not in the page cache declines the read (it
    never waits for the device)."""
    _, pool, rows = uncached
    fd = pool._fd
    if pool.data_offset % PAGE_SB:
        pytest.skip("slots are not whole file pages here")
    out = np.zeros((2, PAGE_SB), dtype=np.uint8)
    declined = False
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # no readahead: only what is read
    try:
        # The declined read starts reading slot 11 in, and this VM's virtual disk can
        # finish that within the call (the read then succeeds, rightly, with the right
        # rows): set the state up again and retry, a few times.
        for _ in range(10):
            _drop_cache(pool, (10, 11, 12))
            for slot in (12, 10):  # (a look at slot 11 would start reading it in)
                assert len(os.pread(fd, PAGE_SB, pool.data_offset + slot * PAGE_SB)) == PAGE_SB
            assert pool.read_nowait(np.array([10]), out[:1])  # cached
            assert pool.read_nowait(np.array([12]), out[:1])
            if not pool.read_nowait(np.array([12, 10]), out):
                declined = True
                break
            np.testing.assert_array_equal(out, rows[[12, 10]])
        assert declined
        os.pread(fd, PAGE_SB, pool.data_offset + 11 * PAGE_SB)
        assert pool.read_nowait(np.array([12, 10]), out)  # all of the span cached now
        np.testing.assert_array_equal(out, rows[[12, 10]])
    finally:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_NORMAL)


def test_without_the_call_the_pool_declines_stops_trying_and_the_level_reads_on_its_thread(
        tmp_path, monkeypatch):
    """A platform without ``preadv2`` (``aio.read_nowait`` gives None): declined, never
    tried again, and the level's reads go through its thread with the right rows."""
    monkeypatch.setattr(aio._kernel, "nowait_ok", False)
    assert aio.read_nowait(0, [0], [0], [1]) is None
    tier = DiskTier(None, {"path": str(tmp_path / "n"), "native_writes": False})
    inner = tier.create_pool(SB, 64)
    rows = seeded_rows(64, 5)
    inner.write(np.arange(64), rows).wait()
    for slots in (np.array([3]), np.array([9, 8, 7]), np.array([30, 1, 2])):
        assert not inner.read_nowait(slots, np.zeros((len(slots), SB), dtype=np.uint8))
    assert inner._nowait is False
    io = LevelIO(2, deadline_s=5.0, write_queue_depth=8)
    pool = DeadlinePool(io, inner)
    slots = np.array([20, 19, 18, 40])
    out = np.zeros((4, SB), dtype=np.uint8)
    pool.read(slots, out).wait()
    np.testing.assert_array_equal(out, rows[slots])
    assert io.stats.direct_reads == 0 and io.stats.operations == 1
    io.close([], time.monotonic() + 1.0)
    tier.close()
