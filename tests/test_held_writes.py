"""Held background writes (``LevelConfig.write_combine_bytes``): a storage level holds
small background writes of a pool back and writes them as one, and nothing reads or writes
around them: a read of held slots only is served from the held rows; a read of held and
other slots, any write that is not held, ``wait_idle`` and a close write what is held
first; a failed held write leaves its slots unreadable, never stale.

The pools are the reference tier's behind :class:`~kvcm_core.testing.faults.FaultyTier`
(which counts and fails writes); the levels' fingerprint-verified cascades in
``test_levels.py`` run with held writes on, as every level with background writes does by
default.
"""

from __future__ import annotations

import tempfile
import time

import numpy as np
import pytest
from disk_helpers import SB, native, seeded_rows
from hypothesis import example, given, settings
from hypothesis import strategies as st
from kvcm_tier_disk import DiskTier

from kvcm_core import ConfigError, TierIOError
from kvcm_core.config import DEFAULT_WRITE_COMBINE_BYTES, LevelConfig
from kvcm_core.level_io import DeadlinePool, LevelIO, WriteQueueFull
from kvcm_core.testing.faults import FaultPlan, FaultyTier
from kvcm_core.testing.reference import DictTier

ROW = 16  # bytes a slot


def _rows(value: int, n: int = 1) -> np.ndarray:
    return np.full((n, ROW), value, dtype=np.uint8)


def _level(combine: int, depth: int = 8, plan: FaultPlan | None = None
           ) -> tuple[FaultyTier, LevelIO, list[int]]:
    """A tier, a level's I/O with held writes up to ``combine`` bytes, and a list that
    records how many tier writes had run as each read runs."""
    tier = FaultyTier(DictTier(), plan or FaultPlan())
    return tier, LevelIO(2, deadline_s=1.0, write_queue_depth=depth, combine_bytes=combine), []


def _pool(tier: FaultyTier, io: LevelIO, seen: list[int], name: str = "p") -> DeadlinePool:
    inner = tier.create_pool(ROW, 8, name=name)
    read = inner.read

    def spy(slots, dest):
        seen.append(tier.writes)
        return read(slots, dest)

    inner.read = spy  # type: ignore[method-assign]
    return DeadlinePool(io, inner)


def _held_write(io: LevelIO, pool: DeadlinePool, slots: list[int], value: int,
                n: int = 1) -> None:
    """A droppable write (the kind that is held) of ``n`` rows of ``value``."""
    with io.dropping(True):
        pool.write(np.array(slots), _rows(value, n)).wait()


def _read(pool: DeadlinePool, slots: list[int]) -> list[int]:
    out = np.zeros((len(slots), ROW), dtype=np.uint8)
    pool.read(np.array(slots), out).wait()
    return out[:, 0].tolist()


def _close(io: LevelIO, *pools: DeadlinePool) -> None:
    failures, abandoned = io.close([("pools", lambda: [p.close() for p in pools])],
                                   time.monotonic() + 1.0)
    assert failures == [] and abandoned == []


def test_small_background_writes_are_held_until_the_limit_then_written_as_one():
    """Writes below the limit wait, copied (the caller reuses its rows); reaching the limit
    writes the pool's held writes as one write in which a slot held twice has its last
    rows."""
    tier, io, seen = _level(combine=6 * ROW)
    pool = _pool(tier, io, seen)
    mine = _rows(1, 2)
    with io.dropping(True):
        pool.write(np.array([0, 1]), mine).wait()
        mine[:] = 9  # the caller's rows, reused at once: the held copy is unchanged
        pool.write(np.array([2, 3]), _rows(2, 2)).wait()
        assert tier.writes == 0 and io.background_in_flight == 0
        assert io.stats.held_writes == 2
        pool.write(np.array([1, 4]), _rows(3, 2)).wait()  # 96 bytes held: written
    assert io.wait_idle(1.0) and tier.writes == 1 and io.stats.held_writes == 3
    assert _read(pool, [0, 1, 2, 3, 4]) == [1, 3, 2, 2, 3]
    _close(io, pool)


def test_a_write_as_large_as_the_limit_is_not_held():
    tier, io, seen = _level(combine=2 * ROW)
    pool = _pool(tier, io, seen)
    _held_write(io, pool, [0, 1], 5, 2)
    assert io.stats.held_writes == 0 and io.background_in_flight == 1
    assert io.wait_idle(1.0) and tier.writes == 1 and _read(pool, [1]) == [5]
    _close(io, pool)


def test_a_read_of_held_slots_only_is_served_from_the_held_rows():
    """A read of slots nobody holds runs at once, leaving the held writes held; a read of
    held slots only is served from their last held rows, with no I/O, still held."""
    tier, io, seen = _level(combine=1 << 20)
    pool = _pool(tier, io, seen)
    pool.write(np.array([0]), _rows(7)).wait()  # not droppable: written now
    with io.dropping(True):
        pool.write(np.array([4]), _rows(1)).wait()
        pool.write(np.array([5, 6]), _rows(2, 2)).wait()
        pool.write(np.array([6]), _rows(3)).wait()  # slot 6 again
    assert tier.writes == 1
    assert _read(pool, [0]) == [7] and seen == [1]
    assert tier.writes == 1 and io.stats.held_writes == 3  # still held
    assert _read(pool, [6, 4, 5, 6]) == [3, 1, 2, 3]
    assert seen == [1] and tier.writes == 1 and io.stats.held_reads == 1  # no I/O
    assert io.wait_idle(1.0) and tier.writes == 2  # then written as one
    assert _read(pool, [4, 5, 6]) == [1, 2, 3] and seen == [1, 2]
    _close(io, pool)


def test_a_read_into_rows_that_are_not_bytes_is_refused_whether_held_or_written():
    """The destination's type is checked before the held rows are looked at: a read of
    held slots refuses a ``float32`` destination as the read of written slots does,
    leaving the destination untouched and the write held."""
    tier, io, seen = _level(combine=1 << 20)
    pool = _pool(tier, io, seen)
    _held_write(io, pool, [3], 200)
    for written in (False, True):
        if written:
            assert io.wait_idle(1.0) and tier.writes == 1
        dest = np.zeros((1, ROW), dtype=np.float32)
        with pytest.raises(ValueError, match="uint8"):
            pool.read(np.array([3]), dest).wait()
        assert not dest.any() and io.stats.held_reads == 0
    assert _read(pool, [3]) == [200]
    _close(io, pool)


def test_a_slot_written_out_reads_from_the_pool_while_other_writes_are_held():
    """Held rows are reused once written out: a slot whose held write has gone out is read
    from the pool, not from the rows another write now holds."""
    tier, io, seen = _level(combine=1 << 20)
    pool = _pool(tier, io, seen)
    _held_write(io, pool, [1], 1)
    assert io.wait_idle(1.0) and tier.writes == 1
    _held_write(io, pool, [2], 2)  # held in the rows slot 1's write used
    assert _read(pool, [1]) == [1] and seen == [1]
    assert _read(pool, [2]) == [2] and seen == [1]
    _close(io, pool)


def test_a_read_of_held_and_other_slots_writes_what_is_held_first():
    tier, io, seen = _level(combine=1 << 20)
    pool = _pool(tier, io, seen)
    pool.write(np.array([0, 1]), _rows(7, 2)).wait()  # not droppable: written now
    _held_write(io, pool, [1], 8)
    assert _read(pool, [0, 1]) == [7, 8]
    assert seen == [2] and io.stats.held_reads == 0  # the held write ran before the read
    _close(io, pool)


def test_a_read_of_another_pools_slots_leaves_held_writes_held():
    tier, io, seen = _level(combine=1 << 20)
    pool, other = _pool(tier, io, seen, "p"), _pool(tier, io, seen, "q")
    other.write(np.array([3]), _rows(4)).wait()
    _held_write(io, pool, [3], 8)
    assert _read(other, [3]) == [4] and tier.writes == 1  # pool's write still held
    assert io.wait_idle(1.0) and tier.writes == 2 and _read(pool, [3]) == [8]
    _close(io, pool, other)


def test_a_write_that_is_not_held_lands_after_the_held_writes_of_its_slots():
    """A held write of a slot followed by a write that is not held (a held page's,
    written before the step goes on): the later rows are the ones that stay."""
    tier, io, seen = _level(combine=1 << 20)
    pool = _pool(tier, io, seen)
    _held_write(io, pool, [3, 2], 1, 2)
    pool.write(np.array([3]), _rows(2)).wait()
    assert tier.writes == 2
    assert io.wait_idle(1.0) and _read(pool, [3, 2]) == [2, 1]
    _close(io, pool)


def test_wait_idle_and_close_write_what_is_held():
    tier, io, seen = _level(combine=1 << 20)
    pool = _pool(tier, io, seen)
    _held_write(io, pool, [1], 1)
    assert io.wait_idle(1.0) and tier.writes == 1
    _held_write(io, pool, [2], 2)
    writes_at_close: list[int] = []
    failures, abandoned = io.close(
        [("pool", lambda: (writes_at_close.append(tier.writes), pool.close()))],
        time.monotonic() + 1.0)
    assert failures == [] and abandoned == []
    assert writes_at_close == [2]  # written before the pool was closed


def test_closing_a_pool_drops_its_held_writes_and_their_bytes():
    """A pool closed with held writes: they are never written (its file is gone), and
    their bytes no longer count towards the limit of the pools still open."""
    tier, io, seen = _level(combine=3 * ROW)
    pool, other = _pool(tier, io, seen, "p"), _pool(tier, io, seen, "q")
    _held_write(io, pool, [0, 1], 1, 2)
    pool.close()
    _held_write(io, other, [0, 1], 2, 2)  # 32 bytes: held, not written
    assert io.wait_idle(1.0) is True and tier.writes == 1  # only other's, at wait_idle
    assert _read(other, [1]) == [2]
    _close(io, other)


def test_a_held_write_that_fails_leaves_its_slots_unreadable_until_written_again():
    plan = FaultPlan()
    tier, io, seen = _level(combine=1 << 20, plan=plan)
    pool = _pool(tier, io, seen)
    plan.fail_writes = {tier.writes + 1}
    with io.dropping(True):
        pool.write(np.array([3]), _rows(1)).wait()
        pool.write(np.array([4]), _rows(2)).wait()
    assert io.wait_idle(1.0) and io.stats.background_failures == 1
    for slot in (3, 4):
        with pytest.raises(TierIOError, match="background write failed"):
            _read(pool, [slot])
    pool.write(np.array([3]), _rows(5)).wait()  # written again
    assert _read(pool, [3]) == [5]
    _close(io, pool)


def test_a_held_write_that_cannot_be_started_leaves_its_slots_unreadable(monkeypatch):
    """Held rows that could not be handed on (no memory for the write, say) are gone: their
    slots read as lost, never as the older bytes still in the pool."""
    tier, io, seen = _level(combine=1 << 20)
    pool = _pool(tier, io, seen)
    pool.write(np.array([2]), _rows(1)).wait()  # older bytes in the pool
    _held_write(io, pool, [2], 2)

    def broken(*args, **kwargs):
        raise MemoryError("no room for the write")

    monkeypatch.setattr(io, "_queue_write", broken)
    with pytest.raises(MemoryError):
        io.flush_held()
    monkeypatch.undo()
    with pytest.raises(TierIOError, match="background write failed"):
        _read(pool, [2])
    _close(io, pool)


def test_close_reports_held_writes_that_cannot_be_started_and_still_closes_every_pool(
        monkeypatch):
    """A close whose held writes cannot be handed on (no memory, say) names that failure
    and goes on: the other pool's held writes are written and every closer runs."""
    tier, io, seen = _level(combine=1 << 20)
    first, second = _pool(tier, io, seen, "a"), _pool(tier, io, seen, "b")
    _held_write(io, first, [1], 1)
    _held_write(io, second, [2], 2)
    queue_write = io._queue_write
    calls = []

    def broken_once(*args, **kwargs):
        calls.append(args[2])
        if len(calls) == 1:
            raise MemoryError("no room for the write")
        return queue_write(*args, **kwargs)

    monkeypatch.setattr(io, "_queue_write", broken_once)
    closed = []
    failures, abandoned = io.close(
        [("pools", lambda: [closed.append(p.close()) for p in (first, second)])],
        time.monotonic() + 1.0)
    assert len(calls) == 2 and abandoned == [] and len(closed) == 2
    assert len(failures) == 1 and "held writes: MemoryError" in failures[0]
    assert tier.writes == 1  # the other pool's held write went out before the closers


@pytest.mark.parametrize("into", [False, True], ids=["write", "write_into"])
def test_a_full_write_queue_still_refuses_a_write_that_would_be_held(into):
    """The queue's bound holds for held writes too: with ``write_queue_depth`` writes in
    flight, a droppable write is refused at once (its victims are dropped), not held; one
    to be filled in place is refused before its fill is called."""
    plan = FaultPlan(slow_s=0.3)
    tier, io, seen = _level(combine=4 * ROW, depth=1, plan=plan)
    pool = _pool(tier, io, seen)
    plan.slow_writes = {tier.writes + 1}
    with io.dropping(True):
        pool.write(np.array([0, 1, 2, 3]), _rows(1, 4)).wait()  # at the limit: in flight
        with pytest.raises(WriteQueueFull):
            if into:
                pool.write_into(np.array([5]), _half_then_fail).wait()  # never called
            else:
                pool.write(np.array([5]), _rows(2)).wait()
    assert io.stats.queue_full_drops == 1 and io.stats.held_writes == 0
    assert io.wait_idle(2.0) and _read(pool, [0]) == [1]
    _close(io, pool)


@native
def test_a_disk_levels_read_from_the_page_cache_sees_its_held_writes(tmp_path):
    """The disk tier reads on the caller's thread from the page cache when nothing it must
    wait for is queued. A read of held slots only gets their held rows; one of held and
    other slots writes what is held first: either way a slot held twice reads as its last
    rows, never as the older bytes on file."""
    tier = DiskTier(None, {"path": str(tmp_path / "d")})
    inner = tier.create_pool(SB, 64)
    io = LevelIO(2, deadline_s=1.0, write_queue_depth=8, combine_bytes=1 << 20)
    pool = DeadlinePool(io, inner)
    old = seeded_rows(64, 1)
    pool.write(np.arange(64), old).wait()  # not droppable: on file now
    if not inner.read_nowait(np.array([0]), np.empty((1, SB), dtype=np.uint8)):
        _close(io, pool)
        tier.close()
        pytest.skip("this file system has no page-cache-only reads (RWF_NOWAIT)")
    new = seeded_rows(4, 2)
    with io.dropping(True):
        pool.write(np.array([9, 3]), new[:2]).wait()
        pool.write(np.array([3, 40]), new[2:]).wait()  # slot 3 again
    assert io.stats.held_writes == 2
    out = np.zeros((3, SB), dtype=np.uint8)
    pool.read(np.array([40, 3, 9]), out).wait()  # all held: from the held rows
    np.testing.assert_array_equal(out, new[[3, 2, 0]])
    assert io.stats.held_reads == 1 and io.stats.direct_reads == 0
    pool.read(np.array([3, 4]), out[:2]).wait()  # held and not: written first
    np.testing.assert_array_equal(out[:2], np.stack([new[2], old[4]]))
    assert io.wait_idle(2.0) and io.stats.direct_writes >= 1
    pool.read(np.array([9, 40, 5]), out).wait()
    np.testing.assert_array_equal(out, np.stack([new[0], new[3], old[5]]))
    _close(io, pool)
    tier.close()


@native
def test_a_direct_read_of_unheld_slots_of_a_pool_with_held_writes_leaves_them_held(tmp_path):
    """One look at the held rows (``LevelIO.read_direct``) tells a read of slots that no
    held write writes from one that needs them written first: the first reads on the
    caller's thread and leaves the held writes held; the second writes them first."""
    tier = DiskTier(None, {"path": str(tmp_path / "d")})
    inner = tier.create_pool(SB, 64)
    io = LevelIO(2, deadline_s=1.0, write_queue_depth=8, combine_bytes=1 << 20)
    pool = DeadlinePool(io, inner)
    old = seeded_rows(64, 3)
    pool.write(np.arange(64), old).wait()
    if not inner.read_nowait(np.array([0]), np.empty((1, SB), dtype=np.uint8)):
        _close(io, pool)
        tier.close()
        pytest.skip("this file system has no page-cache-only reads (RWF_NOWAIT)")
    new = seeded_rows(2, 4)
    with io.dropping(True):
        pool.write(np.array([20, 21]), new).wait()
    assert io.stats.held_writes == 1
    out = np.zeros((3, SB), dtype=np.uint8)
    pool.read(np.array([7, 6, 30]), out).wait()  # none held: direct, still held after
    np.testing.assert_array_equal(out, old[[7, 6, 30]])
    assert io.stats.direct_reads == 1 and io._held
    pool.read(np.array([21, 6, 5]), out).wait()  # one held: written first
    np.testing.assert_array_equal(out, np.stack([new[1], old[6], old[5]]))
    assert not io._held
    assert io.wait_idle(2.0)
    _close(io, pool)
    tier.close()


def test_held_writes_of_several_pools_count_against_the_write_queue():
    """Each pool holding writes is a batch to come: with ``write_queue_depth`` of them in
    flight or held, a droppable write for yet another pool is refused, so no flush ever
    puts more than ``write_queue_depth`` batches in flight."""
    plan = FaultPlan(slow_s=0.3, slow_all=True)
    tier, io, seen = _level(combine=5 * ROW, depth=2, plan=plan)
    pools = [_pool(tier, io, seen, f"p{k}") for k in range(3)]
    with io.dropping(True):
        pools[0].write(np.array([0]), _rows(1)).wait()
        pools[1].write(np.array([0]), _rows(2)).wait()
        pools[0].write(np.array([1]), _rows(3)).wait()  # a pool already holding: taken
        with pytest.raises(WriteQueueFull):
            pools[2].write(np.array([0]), _rows(4)).wait()
        assert io.stats.held_writes == 3 and io.stats.queue_full_drops == 1
        pools[1].write(np.array([1, 2]), _rows(5, 2)).wait()  # 5 rows: both pools written
        assert io.background_in_flight == 2
    plan.slow_all = False
    assert io.wait_idle(2.0)
    assert _read(pools[0], [0, 1]) == [1, 3] and _read(pools[1], [0, 1]) == [2, 5]
    _close(io, *pools)


def test_a_write_after_the_level_is_closed_fails_instead_of_being_held():
    tier, io, seen = _level(combine=1 << 20)
    pool = _pool(tier, io, seen)
    _close(io)
    with io.dropping(True), pytest.raises(TierIOError, match="after shutdown"):
        pool.write(np.array([1]), _rows(1)).wait()
    assert io.stats.held_writes == 0


_SLOTS = 8


class _FillFailed(Exception):
    pass


def _copier(rows: np.ndarray):
    def fill(out: np.ndarray) -> None:
        out[...] = rows
    return fill


def _half_then_fail(out: np.ndarray) -> None:
    out[: max(1, len(out) // 2)] = 0xEE  # garbage where the rows were lent
    raise _FillFailed


def test_a_write_filled_in_place_is_held_and_a_fill_that_fails_holds_nothing():
    """``write_into`` of a droppable write that would be held lends the held rows: what
    the fill writes there is held (read back from them, then written as one); a fill
    that raises leaves nothing held, and the slots read as before. A write that would
    not be held (not droppable) is filled into rows of its own and written at once."""
    tier, io, seen = _level(combine=1 << 20)
    pool = _pool(tier, io, seen)
    pool.write_into(np.array([0]), _copier(_rows(7))).wait()  # not droppable: written now
    assert tier.writes == 1 and io.stats.held_writes == 0
    with io.dropping(True):
        pool.write_into(np.array([4, 5]), _copier(_rows(1, 2))).wait()
        assert tier.writes == 1 and io.stats.held_writes == 1
        with pytest.raises(_FillFailed):
            pool.write_into(np.array([5, 6]), _half_then_fail)
        assert io.stats.held_writes == 1
        pool.write_into(np.array([6]), _copier(_rows(3))).wait()
    assert _read(pool, [4, 5, 6]) == [1, 1, 3] and io.stats.held_reads == 1
    assert io.wait_idle(1.0) and tier.writes == 2
    assert _read(pool, [0, 4, 5, 6]) == [7, 1, 1, 3]
    _close(io, pool)


# Mostly droppable writes and reads of a few slots, so that writes are held, slots are
# held twice, and reads meet held, written and refused slots; now and then a write that
# is not held, or wait_idle (which writes what is held).
_OPS = st.lists(st.tuples(
    st.sampled_from(["held"] * 3 + ["into"] * 2 + ["badfill"] + ["read"] * 4 + ["sync"] +
                    ["idle"] * 2),
    st.integers(0, 1),
    st.lists(st.integers(0, _SLOTS - 1), min_size=1, max_size=4, unique=True)),
    min_size=1, max_size=60)


@settings(max_examples=200, deadline=None)
@given(ops=_OPS, combine_rows=st.sampled_from([2, 3, 6, 1 << 14]),
       depth=st.integers(1, 4), disk=st.booleans())
# A slot's held rows reused by another slot once written out; a slot held twice; a read of
# held and written slots from the page cache; a write too large to hold after a held one;
# a slot held twice written out through glibc's AIO.
@example(ops=[("held", 0, [1]), ("idle", 0, [0]), ("held", 0, [2]), ("read", 0, [1])],
         combine_rows=1 << 14, depth=2, disk=False)
@example(ops=[("held", 0, [1]), ("held", 0, [1, 2]), ("read", 0, [1])],
         combine_rows=1 << 14, depth=2, disk=False)
@example(ops=[("sync", 0, [1]), ("held", 0, [1]), ("read", 0, [1, 3])],
         combine_rows=1 << 14, depth=2, disk=True)
@example(ops=[("held", 0, [1]), ("held", 0, [1, 2, 3]), ("read", 0, [1])],
         combine_rows=2, depth=4, disk=False)
@example(ops=[("held", 0, [1]), ("held", 0, [1]), ("idle", 0, [0]), ("read", 0, [1])],
         combine_rows=1 << 14, depth=2, disk=True)
def test_every_read_returns_the_last_rows_written_to_each_slot(ops, combine_rows, depth,
                                                                disk):
    """Random mixes of droppable (held) writes, some filled in place (``write_into``, one
    kind failing half way, which must leave every slot as it was), writes that are not
    held, reads and
    ``wait_idle`` over two pools of one level, on the reference tier (the level's thread)
    or the disk tier (glibc's AIO and page-cache reads where available): every read
    returns each slot's last written rows. A droppable write refused by a full queue
    leaves its slots unknown (their pages are dropped, never read)."""
    width = SB if disk else ROW
    with tempfile.TemporaryDirectory() as where:
        tier = DiskTier(None, {"path": where}) if disk else DictTier()
        io = LevelIO(2, deadline_s=5.0, write_queue_depth=depth,
                     combine_bytes=combine_rows * width)
        pools = [DeadlinePool(io, tier.create_pool(width, _SLOTS)) for _ in range(2)]
        last: list[dict[int, int]] = [{}, {}]  # slot -> value (absent: unknown)
        value = 0
        try:
            for kind, k, slots in ops:
                arr = np.array(slots, dtype=np.int64)
                if kind == "idle":
                    assert io.wait_idle(5.0)
                elif kind == "read":
                    out = np.zeros((len(arr), width), dtype=np.uint8)
                    pools[k].read(arr, out).wait()
                    got = out[:, :8].copy().view(np.uint64)[:, 0].tolist()
                    for slot, v in zip(slots, got, strict=True):
                        if slot in last[k]:
                            assert v == last[k][slot], (kind, k, slot)
                else:
                    rows = np.zeros((len(arr), width), dtype=np.uint8)
                    vals = np.arange(value + 1, value + 1 + len(arr), dtype=np.uint64)
                    value += len(arr)
                    rows[:, :8] = vals.view(np.uint8).reshape(len(arr), 8)
                    with io.dropping(kind != "sync"):
                        try:
                            if kind == "held":
                                pools[k].write(arr, rows).wait()
                            elif kind == "into":  # framed in place, as the core's moves do
                                pools[k].write_into(arr, _copier(rows)).wait()
                            elif kind == "badfill":  # fails half way: nothing is written
                                with pytest.raises(_FillFailed):
                                    pools[k].write_into(arr, _half_then_fail).wait()
                                continue
                            else:
                                pools[k].write(arr, rows).wait()
                        except WriteQueueFull:
                            for slot in slots:
                                last[k].pop(slot, None)
                            continue
                    last[k].update(zip(slots, vals.tolist(), strict=True))
            assert io.wait_idle(5.0)
            for k, pool in enumerate(pools):  # and once everything has landed
                known = sorted(last[k])
                if known:
                    out = np.zeros((len(known), width), dtype=np.uint8)
                    pool.read(np.array(known), out).wait()
                    assert out[:, :8].copy().view(np.uint64)[:, 0].tolist() == \
                        [last[k][s] for s in known]
        finally:
            _close(io, *pools)
            if disk:
                tier.close()


def test_held_writes_default_to_one_mib_where_there_are_background_writes():
    assert LevelConfig(tier="disk", quota=1 << 20).background_combine_bytes == \
        DEFAULT_WRITE_COMBINE_BYTES == 1 << 20
    assert LevelConfig(tier="disk", quota=1 << 20, io_deadline_s=None
                       ).background_combine_bytes == 0
    assert LevelConfig(tier="disk", quota=1 << 20, write_queue_depth=0
                       ).background_combine_bytes == 0
    assert LevelConfig(tier="disk", quota=1 << 20, write_combine_bytes=0
                       ).background_combine_bytes == 0


@pytest.mark.parametrize("kw", [
    {"write_combine_bytes": -1},
    {"write_combine_bytes": 1.5},
    {"write_combine_bytes": "1MiB"},
    {"write_queue_depth": 0, "write_combine_bytes": 4096},
    {"io_deadline_s": None, "write_combine_bytes": 4096},
])
def test_a_bad_write_combine_bytes_is_refused_naming_the_field(kw):
    with pytest.raises(ConfigError) as info:
        LevelConfig(tier="disk", quota=1 << 20, **kw)
    assert info.value.field == "LevelConfig.write_combine_bytes"
