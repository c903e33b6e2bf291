"""The disk tier's blob mode across reopens of a named pool: a reopen rebuilds the index
from the segments, so whatever memory says a slot holds (its blob, or nothing) must be
what the segments say too, after failed writes, shrinks, compactions and smaller reopens.
"""

from __future__ import annotations

import errno
import os
import random

import numpy as np
import pytest
from kvcm_tier_disk import DiskTier

from kvcm_core.errors import TierIOError

SLOT = 600
SEGMENT = 4096


def _tier(path, **options) -> DiskTier:
    return DiskTier(None, {"path": str(path), "mode": "blob", "segment_bytes": SEGMENT,
                           **options})


def _read(pool, slots) -> list[bytes]:
    out = [b""] * len(slots)
    pool.read_blobs(np.asarray(slots), out).wait()
    return out


def _segments(path) -> list[str]:
    return sorted(p for p in os.listdir(path) if ".seg" in p)


class _Faults:
    """Replaces ``os.pwrite``: the ``at``-th call from now (1 = the next) writes only its
    first ``keep`` bytes, then returns short (``raises`` False) or raises ENOSPC, as a disk
    filling up part way through a write does."""

    def __init__(self, monkeypatch) -> None:
        self._real = os.pwrite
        self.at = 0
        self.keep = 0
        self.raises = False
        monkeypatch.setattr(os, "pwrite", self._pwrite)

    def arm(self, at: int = 1, keep: int = 0, raises: bool = False) -> None:
        self.at, self.keep, self.raises = at, keep, raises

    def _pwrite(self, fd, data, offset):
        if self.at:
            self.at -= 1
            if not self.at:
                done = self._real(fd, bytes(data)[:self.keep], offset) if self.keep else 0
                if self.raises:
                    raise OSError(errno.ENOSPC, "No space left on device")
                return done
        return self._real(fd, data, offset)


@pytest.mark.parametrize("raises", [False, True], ids=["short", "enospc"])
def test_a_failed_writes_records_never_come_back_after_a_later_write_and_a_reopen(
        tmp_path, monkeypatch, raises):
    faults = _Faults(monkeypatch)
    tier = _tier(tmp_path / "d", segment_bytes=1 << 20)
    pool = tier.create_pool(SLOT, 8, name="p")
    old = [bytes([i + 1]) * 100 for i in range(4)]
    pool.write_blobs(np.arange(4), old).wait()
    # three of four records land whole, the fourth is cut: the write fails
    faults.arm(keep=3 * 108 + 50, raises=raises)
    with pytest.raises(TierIOError):
        pool.write_blobs(np.array([2, 1, 3, 4]), [b"N" * 100] * 4).wait()
    assert _read(pool, range(5)) == [*old, b""]
    # lands where the failed batch began, covering its first record only
    pool.write_blobs(np.array([1]), [b"L" * 100]).wait()
    want = [old[0], b"L" * 100, old[2], old[3], b""]
    assert _read(pool, range(5)) == want
    tier.close()
    assert _read(_tier(tmp_path / "d").create_pool(SLOT, 8, name="p"), range(5)) == want


def test_a_shrink_whose_tombstones_cannot_be_written_raises_and_changes_nothing(
        tmp_path, monkeypatch):
    faults = _Faults(monkeypatch)
    tier = _tier(tmp_path / "d")
    pool = tier.create_pool(SLOT, 4, name="p")
    blobs = [bytes([i + 1]) * 10 for i in range(4)]
    pool.write_blobs(np.arange(4), blobs).wait()
    faults.arm(keep=8)  # the first of two tombstones only
    with pytest.raises(TierIOError):
        pool.resize(2)
    assert pool.num_slots == 4
    assert _read(pool, range(4)) == blobs
    pool.write_blobs(np.array([0]), [b"after"]).wait()
    tier.close()
    again = _tier(tmp_path / "d").create_pool(SLOT, 4, name="p")
    assert _read(again, range(4)) == [b"after", *blobs[1:]]


def test_compaction_keeps_a_shrinks_tombstone_while_an_older_segment_holds_the_slot(
        tmp_path):
    path = tmp_path / "d"
    tier = _tier(path)
    pool = tier.create_pool(1000, 10, name="p")
    # segment 1 (closed, full): slots 9, 0, 1, 2; it stays mostly live
    pool.write_blobs(np.array([9, 0, 1, 2]), [b"9" * 1000] * 4).wait()
    pool.resize(9)  # a tombstone for slot 9 in segment 2
    for _ in range(5):  # segment 2 fills with dead blobs of slot 3: compacted away
        pool.write_blobs(np.array([3]), [b"3" * 1000]).wait()
    assert "p.kvcm.seg000001" in _segments(path)
    assert "p.kvcm.seg000002" not in _segments(path)
    pool.resize(10)
    assert _read(pool, [9]) == [b""]
    tier.close()
    again = _tier(path).create_pool(1000, 10, name="p")
    assert _read(again, [9, 0, 3]) == [b"", b"9" * 1000, b"3" * 1000]


def test_reopening_with_fewer_slots_drops_the_slots_past_the_end_for_good(tmp_path):
    path = tmp_path / "d"
    tier = _tier(path)
    tier.create_pool(SLOT, 4, name="p").write_blobs(np.array([1, 3]), [b"a", b"b"]).wait()
    tier.close()
    tier = _tier(path)
    assert _read(tier.create_pool(SLOT, 2, name="p"), range(2)) == [b"", b"a"]
    tier.close()
    tier = _tier(path)
    assert _read(tier.create_pool(SLOT, 4, name="p"), range(4)) == [b"", b"a", b"", b""]
    tier.close()


def test_a_write_failing_in_its_quota_compaction_leaves_memory_and_disk_agreeing(
        tmp_path, monkeypatch):
    faults = _Faults(monkeypatch)
    path = tmp_path / "d"
    tier = _tier(path)
    pool = tier.create_pool(1000, 10, name="p")
    a, b = b"a" * 1000, b"b" * 1000
    pool.write_blobs(np.array([9, 0, 1, 2]), [a] * 4).wait()  # segment 1, full
    pool.write_blobs(np.array([9, 3, 4, 5]), [b] * 4).wait()  # segment 2, full
    assert pool.stored_bytes == 8000
    # 3000 more bytes pass the 10000-byte quota: compact everything into a fresh segment
    # 4 (its header is pwrite 1), then write; moving segment 1's blobs (pwrite 2) lands,
    # moving segment 2's (pwrite 3) fails
    faults.arm(at=3, keep=10)
    with pytest.raises(TierIOError):
        pool.write_blobs(np.array([0, 4, 6]), [b"c" * 1000] * 3).wait()
    got = _read(pool, range(10))
    # slot 0's old blob went with segment 1; slot 4's is still in segment 2
    assert got == [b"", a, a, b, b, b, b"", b"", b"", b]
    tier.close()
    assert _read(_tier(path).create_pool(1000, 10, name="p"), range(10)) == got


@pytest.mark.parametrize("uncut", [False, True], ids=["cut", "uncut"])
@pytest.mark.parametrize("seed", range(40))
def test_reads_and_reopens_agree_with_a_byte_model_through_failed_writes(
        tmp_path, monkeypatch, seed, uncut):
    """Random writes (some failing part way), shrinks, grows and reopens of other sizes:
    a failed write leaves each of its slots with its old blob, nothing, or (when only the
    compaction after it failed) its new blob; other slots keep theirs; and a reopen reads
    back exactly what the pool read before it. ``uncut``: the truncate that cuts a failed
    append off fails too, at random (the segment is sealed instead)."""
    rng = random.Random(seed)
    faults = _Faults(monkeypatch)
    cut = _NoTruncate(monkeypatch, times=0)
    path = tmp_path / "d"
    tier = _tier(path)
    n = rng.choice([1, 3, 8])
    pool = tier.create_pool(SLOT, n, name="m")
    model: dict[int, bytes] = {}
    over = False
    try:
        for step in range(60):
            op = rng.choice(["write"] * 5 + ["resize", "reopen"])
            fail = rng.random() < 0.3
            if fail:
                faults.arm(at=rng.randint(1, 4), keep=rng.randrange(0, 2 * SLOT),
                           raises=rng.random() < 0.5)
                cut.times = int(uncut and rng.random() < 0.7)
            if op == "write" and pool.num_slots:
                slots = rng.sample(range(pool.num_slots), rng.randint(1, pool.num_slots))
                blobs = [bytes([step % 256, s]) * rng.randint(0, SLOT // 2) for s in slots]
                try:
                    pool.write_blobs(np.asarray(slots), blobs).wait()
                except TierIOError:
                    assert fail
                    # its records may have landed with only the compaction after failing
                    for s, new, got in zip(slots, blobs, _read(pool, slots), strict=True):
                        assert got in (model.get(s, b""), b"", new), (seed, step)
                        model[s] = got
                else:
                    model.update(zip(slots, blobs, strict=True))
                    over = False
            elif op == "resize":
                size = rng.choice([0, 1, max(0, pool.num_slots - 2), pool.num_slots + 3])
                old = pool.num_slots
                try:
                    pool.resize(size)
                except TierIOError:  # a shrink whose tombstones or compaction failed
                    assert fail and size < old and pool.num_slots == old
                    # it kept its size; a dropped slot holds its old blob or nothing
                    for s, got in zip(range(size, old), _read(pool, range(size, old)),
                                      strict=True):
                        assert got in (model.get(s, b""), b""), (seed, step)
                        model[s] = got
                    over = True
                else:  # a grow's housekeeping compaction may fail unseen
                    over = over and fail and size >= old
                model = {s: b for s, b in model.items() if s < pool.num_slots}
            elif op == "reopen":
                size = rng.choice([pool.num_slots, max(0, pool.num_slots - 2),
                                   pool.num_slots + 2])
                faults.arm(0)
                over = False
                tier.close()
                tier = _tier(path)
                pool = tier.create_pool(SLOT, size, name="m")
                model = {s: b for s, b in model.items() if s < size}
            faults.arm(0)
            cut.times = 0
            # a resize failing in its compaction (or a grow's, unseen) may leave dead
            # bytes over the quota until a write, resize or reopen succeeds
            assert over or pool.stored_bytes <= pool.num_slots * SLOT, (seed, step, op)
            want = [model.get(s, b"") for s in range(pool.num_slots)]
            assert _read(pool, range(pool.num_slots)) == want, (seed, step, op)
    finally:
        tier.close()


class _NoTruncate:
    """Replaces ``os.ftruncate``: the next ``times`` calls raise ``err`` (then it works)."""

    def __init__(self, monkeypatch, times: int = 1, err: int = errno.EIO) -> None:
        self._real = os.ftruncate
        self.times, self.err, self.calls = times, err, 0
        monkeypatch.setattr(os, "ftruncate", self._ftruncate)

    def _ftruncate(self, fd, length):
        self.calls += 1
        if self.times:
            self.times -= 1
            raise OSError(self.err, os.strerror(self.err))
        return self._real(fd, length)


def _four_blobs(path):
    """A blob tier at ``path`` (1 MiB segments), a pool of 8 slots and the blobs written
    to its slots 0..3 (100 bytes each)."""
    tier = _tier(path, segment_bytes=1 << 20)
    pool = tier.create_pool(SLOT, 8, name="p")
    old = [bytes([i + 1]) * 100 for i in range(4)]
    pool.write_blobs(np.arange(4), old).wait()
    return tier, pool, old


@pytest.mark.parametrize("err", [errno.EIO, errno.ENOSPC, errno.EPERM])
@pytest.mark.parametrize("raises", [False, True], ids=["short", "enospc"])
def test_an_append_that_cannot_be_cut_back_loses_nothing_stored_and_never_comes_back(
        tmp_path, monkeypatch, raises, err):
    """A failed append whose torn bytes cannot be truncated away: the write is a
    TierIOError, every earlier blob still reads (now and after a reopen), the torn
    records never do, and the pool writes on."""
    faults = _Faults(monkeypatch)
    path = tmp_path / "d"
    tier, pool, old = _four_blobs(path)
    pool.write_blobs(np.array([0]), [b"R" * 50]).wait()  # slot 0 rewritten in the segment
    cut = _NoTruncate(monkeypatch, err=err)
    # two of three records land whole (slots 2 and 5), the third is cut: the write fails
    faults.arm(keep=2 * 108 + 30, raises=raises)
    with pytest.raises(TierIOError):
        pool.write_blobs(np.array([2, 5, 3]), [b"N" * 100] * 3).wait()
    assert cut.calls >= 1
    want = [b"R" * 50, *old[1:], b"", b"", b"", b""]
    assert _read(pool, range(8)) == want
    pool.write_blobs(np.array([6]), [b"after"]).wait()  # the pool writes on
    want[6] = b"after"
    assert _read(pool, range(8)) == want
    tier.close()
    again = _tier(path, segment_bytes=1 << 20)
    assert _read(again.create_pool(SLOT, 8, name="p"), range(8)) == want
    again.close()


class _Script:
    """Replaces ``os.pwrite``: each call takes the next entry of ``plan`` (an int k:
    write only the first k bytes and return short; ``"fail"``: raise EIO; ``None``: the
    real call); calls past the plan are real."""

    def __init__(self, monkeypatch) -> None:
        self._real = os.pwrite
        self.plan: list = []
        monkeypatch.setattr(os, "pwrite", self._pwrite)

    def _pwrite(self, fd, data, offset):
        step = self.plan.pop(0) if self.plan else None
        if step == "fail":
            raise OSError(errno.EIO, "Input/output error")
        if step is None:
            return self._real(fd, data, offset)
        return self._real(fd, bytes(data)[:step], offset)


def test_a_segment_that_can_be_neither_cut_back_nor_sealed_takes_no_more_writes(
        tmp_path, monkeypatch):
    """Neither the truncate nor the seal of a torn segment works: writes are refused
    (TierIOError, nothing appended) until one does; reads go on; after the repair the
    pool writes again and a reopen reads exactly what the pool read."""
    script = _Script(monkeypatch)
    path = tmp_path / "d"
    tier, pool, old = _four_blobs(path)
    cut = _NoTruncate(monkeypatch, times=4)
    # slot 5's record lands whole, slot 1's is cut; then the seal fails
    script.plan = [108 + 30, "fail"]
    with pytest.raises(TierIOError):
        pool.write_blobs(np.array([5, 1]), [b"N" * 100] * 2).wait()
    for _ in range(2):  # each write retries the truncate and the seal, which fail
        script.plan = ["fail"]
        with pytest.raises(TierIOError, match="torn"):
            pool.write_blobs(np.array([6]), [b"refused"]).wait()
        assert not script.plan, "a refused write appended nothing (it never got that far)"
    with pytest.raises(TierIOError, match="torn"):  # a shrink's tombstones too
        script.plan = ["fail"]
        pool.resize(2)
    assert cut.calls == 4 and pool.num_slots == 8
    want = [*old, b"", b"", b"", b""]
    assert _read(pool, range(8)) == want
    # the fifth truncate works: the segment is whole again and takes the write
    pool.write_blobs(np.array([6]), [b"after"]).wait()
    want[6] = b"after"
    assert _read(pool, range(8)) == want
    tier.close()
    again = _tier(path, segment_bytes=1 << 20)
    assert _read(again.create_pool(SLOT, 8, name="p"), range(8)) == want
    again.close()


def test_a_torn_segment_sealed_at_close_reads_back_without_its_torn_records(
        tmp_path, monkeypatch):
    """Truncate and seal fail at the failed write; the seal works at close: a reopen
    reads every earlier blob and not the torn record."""
    script = _Script(monkeypatch)
    path = tmp_path / "d"
    tier, pool, old = _four_blobs(path)
    _NoTruncate(monkeypatch, times=100)
    script.plan = [108 + 30, "fail"]
    with pytest.raises(TierIOError):
        pool.write_blobs(np.array([2, 1]), [b"N" * 100] * 2).wait()
    tier.close()
    again = _tier(path, segment_bytes=1 << 20)
    assert _read(again.create_pool(SLOT, 8, name="p"), range(8)) == [*old, *[b""] * 4]
    again.close()
