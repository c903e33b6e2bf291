"""The disk tier's error paths and life cycle (review 24): a failed blob-mode resize keeps
the pool's size, a full disk fails a blob pool only with ``TierIOError``, close releases
every descriptor however deleting fails, reopens leave no empty segments, a forked child
holds none of its parent's files, a relative ``path`` survives a ``chdir``, pool names
never share a file, and a failed batched wait is a ``TierIOError``."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import attrs
import levels_helpers
import numpy as np
import pytest
from conftest import open_fds
from kvcm_tier_disk import DiskTier, aio, file_name
from kvcm_tier_disk.blob import _RECORD, _SEG_MAGIC, _TOMBSTONE, BlobDiskPool
from levels_helpers import Driver, make_manager, tokens
from test_disk_blob_reopen import SEGMENT, _read, _segments, _tier
from test_failed_construction import _fds_under

from kvcm_core.errors import TierIOError

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc")

# The blob tier of these tests (4 KiB segments) and the open files under a folder: as
# the reopen and construction tests use them.
_open_under = _fds_under
def _only_tombstones_or_header(data) -> bool:
    raw = bytes(data)
    if raw.startswith(_SEG_MAGIC):
        return True
    if not raw or len(raw) % _RECORD.size:
        return False
    return all(_RECORD.unpack_from(raw, at)[1] == _TOMBSTONE
               for at in range(0, len(raw), _RECORD.size))


class _FullAfterTombstones:
    """Replaces ``os.pwrite`` while armed: segment headers and tombstones land, every other
    write (a blob record: the compaction's moves) fails with ENOSPC, as a disk with just
    enough room for the small records does."""

    def __init__(self, monkeypatch) -> None:
        self._real = os.pwrite
        self.armed = False
        self.refused = 0
        monkeypatch.setattr(os, "pwrite", self._pwrite)

    def _pwrite(self, fd, data, offset):
        if self.armed and not _only_tombstones_or_header(data):
            self.refused += 1
            raise OSError(errno.ENOSPC, "No space left on device")
        return self._real(fd, data, offset)


# -- B1: a failed blob-mode resize keeps the pool's size ---------------------------------


def test_a_blob_shrink_failing_in_its_compaction_keeps_the_old_size_and_every_kept_blob(
        tmp_path, monkeypatch):
    full = _FullAfterTombstones(monkeypatch)
    path = tmp_path / "d"
    tier = _tier(path)
    pool = tier.create_pool(1000, 40, name="p")
    blobs = [bytes([i]) * 1000 for i in range(40)]
    for i in range(40):  # ten full segments of four blobs each
        pool.write_blobs(np.array([i]), [blobs[i]]).wait()
    full.armed = True
    with pytest.raises(TierIOError, match="resize from 40 to 20 slots failed"):
        pool.resize(20)  # tombstones land, the compaction for the smaller quota fails
    assert full.refused
    assert pool.num_slots == 40
    got = _read(pool, range(40))
    assert got[:20] == blobs[:20]  # every kept slot keeps its blob
    assert all(g in (b"", blobs[i + 20]) for i, g in enumerate(got[20:]))
    full.armed = False
    assert pool.write_blobs(np.array([30]), [b"y" * 10]).wait() is None  # no crash
    assert _read(pool, [30]) == [b"y" * 10]
    got[30] = b"y" * 10
    tier.close()
    again = _tier(path)
    assert _read(again.create_pool(1000, 40, name="p"), range(40)) == got
    again.close()


def test_a_blob_grow_never_fails_when_its_housekeeping_compaction_does(tmp_path,
                                                                        monkeypatch):
    tier = _tier(tmp_path / "d")
    pool = tier.create_pool(1000, 8)
    pool.write_blobs(np.arange(4), [b"a" * 1000] * 4).wait()  # segment 1, full
    real = os.pwrite

    def moves_fail(fd, data, offset):  # slot 3's blob cannot be moved (ENOSPC)
        if b"a" * 1000 in bytes(data):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", moves_fail)
    with pytest.raises(TierIOError):  # the blobs land; moving slot 3 out of segment 1 fails
        pool.write_blobs(np.array([0, 1, 2]), [b"b" * 10] * 3).wait()
    pool.resize(12)  # its compaction of the mostly dead segment 1 fails: unseen
    assert pool.num_slots == 12
    monkeypatch.undo()
    assert _read(pool, [0, 3, 11]) == [b"b" * 10, b"a" * 1000, b""]
    tier.close()


@pytest.mark.parametrize("deadline", [True, False], ids=["deadline", "no-deadline"])
def test_a_manager_resize_of_a_blob_level_failing_on_a_full_disk_keeps_the_level_usable(
        tmp_path, monkeypatch, deadline):
    if not deadline:
        real = levels_helpers.make_levels

        def make_levels(*args, **kwargs):
            return [attrs.evolve(level, io_deadline_s=None, write_queue_depth=None)
                    if level.tier == "disk" else level for level in real(*args, **kwargs)]

        monkeypatch.setattr(levels_helpers, "make_levels", make_levels)
    m = make_manager([("gpu", 8), ("disk", 24)], tmp_path,
                     disk={"mode": "blob", "segment_bytes": SEGMENT})
    try:
        d = Driver(m)
        caches = [d.write(tokens(32, 100 + i), chunk=32) for i in range(3)]
        store = m.storage_levels.stores[1][0]
        pool = store.pools[0]
        inner = getattr(pool, "inner_pool", pool)
        assert isinstance(inner, BlobDiskPool)
        for c in caches[1:]:
            c.close()
        full = _FullAfterTombstones(monkeypatch)
        full.armed = True
        assert m.resize(1, pool.slot_bytes * 12) is False
        full.armed = False
        assert full.refused
        assert store.num_slots == inner.num_slots == 24
        for i in range(6):  # push pages to the disk level, into its high slots too
            d.write(tokens(32, 200 + i), chunk=32).close()
        d.resume_and_verify(caches[0])
    finally:
        for cache in m.open_caches:
            cache.close()
        m.shutdown()


# -- B2: a full disk fails a blob pool with TierIOError only -------------------------------


def _no_space(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def test_creating_a_blob_pool_on_a_full_disk_raises_no_bare_os_error(tmp_path, monkeypatch):
    tier = _tier(tmp_path / "d")
    before = len(open_fds())
    monkeypatch.setattr(os, "pwrite", _no_space)
    try:  # a blob pool holds nothing yet: it may start, its first write then fails
        pool = tier.create_pool(100, 4)
    except TierIOError:
        pool = None
    if pool is not None:
        with pytest.raises(TierIOError, match="No space left"):
            pool.write_blobs(np.array([0]), [b"x"]).wait()
        pool.close()
    monkeypatch.undo()
    assert len(open_fds()) == before
    assert _segments(tier.owner_directory) == []
    tier.close()


def test_reopening_a_blob_pool_with_fewer_slots_on_a_full_disk_raises_tier_io_error(
        tmp_path, monkeypatch):
    path = tmp_path / "d"
    tier = _tier(path)
    tier.create_pool(100, 4, name="p").write_blobs(np.array([1, 3]), [b"a", b"b"]).wait()
    tier.close()
    files = {f: (path / f).read_bytes() for f in _segments(path)}
    tier = _tier(path)
    before = len(open_fds())
    monkeypatch.setattr(os, "pwrite", _no_space)
    with pytest.raises(TierIOError, match="No space left"):
        tier.create_pool(100, 2, name="p")  # slot 3's tombstone cannot be written
    monkeypatch.undo()
    assert len(open_fds()) == before
    assert {f: (path / f).read_bytes() for f in _segments(path)} == files
    assert _read(tier.create_pool(100, 4, name="p"), range(4)) == [b"", b"a", b"", b"b"]
    tier.close()


# -- B3: close releases every descriptor however deleting fails ----------------------------


def test_closing_blob_pools_whose_files_cannot_be_deleted_closes_every_descriptor(
        tmp_path, monkeypatch):
    tier = _tier(tmp_path / "d")
    pool = tier.create_pool(1000, 16)
    for i in range(16):  # four segment files
        pool.write_blobs(np.array([i]), [b"z" * 1000]).wait()
    owner = tier.owner_directory
    assert len(_segments(owner)) >= 3 and len(_open_under(owner)) >= 4  # + the lock

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(os, "unlink", read_only)
    with pytest.raises(TierIOError, match="Read-only file system") as info:
        tier.close()
    for name in _segments(owner):
        assert name in str(info.value)  # every file that could not be deleted is named
    monkeypatch.undo()
    assert _open_under(owner) == [], "close left descriptors open"
    pool.close()  # closed already: a no-op
    tier.close()


# -- B4: reopens leave no empty segment ---------------------------------------------------


def test_reopening_a_named_blob_pool_adds_no_segment_file_or_descriptor(tmp_path):
    path = tmp_path / "d"
    tier = _tier(path)
    tier.create_pool(100, 1000, name="P").write_blobs(np.array([0]), [b"a" * 100]).wait()
    tier.close()
    first = _segments(path)
    for _ in range(5):
        tier = _tier(path)
        pool = tier.create_pool(100, 1000, name="P")
        assert _read(pool, [0]) == [b"a" * 100]
        assert len(_open_under(path / "P.kvcm.seg")) == len(first)
        # and the lock file that keeps other tiers out while it is open
        assert _open_under(path / "P.kvcm.lock") == [str(path / "P.kvcm.lock")]
        tier.close()
    assert _segments(path) == first


def test_a_closed_segment_holding_nothing_is_deleted_by_the_next_write(tmp_path):
    path = tmp_path / "d"
    tier = _tier(path)
    tier.create_pool(100, 10, name="P").write_blobs(np.array([0]), [b"a" * 100]).wait()
    tier.close()
    (segment,) = _segments(path)
    header = (path / segment).read_bytes()[:64]
    for n in (2, 3):  # as earlier versions left at each reopen: a header, nothing else
        empty = path / f"P.kvcm.seg{n:06d}"
        empty.write_bytes(header)
        empty.chmod(0o600)
    tier = _tier(path)
    pool = tier.create_pool(100, 10, name="P")
    pool.write_blobs(np.array([1]), [b"b" * 100]).wait()
    assert _segments(path) == [segment, "P.kvcm.seg000004"]
    assert _read(pool, [0, 1]) == [b"a" * 100, b"b" * 100]
    tier.close()


# -- B5: a forked child holds none of its parent's files ---------------------------------

_FORKING = textwrap.dedent("""
    import json, os, sys, time
    import numpy as np
    from kvcm_tier_disk import DiskTier
    from kvcm_core.errors import InvalidStateError
    path, report = sys.argv[1], sys.argv[2]
    tier = DiskTier(None, {"path": path, "mode": sys.argv[3]})
    pool = tier.create_pool(64, 4)
    named = tier.create_pool(64, 4, name="n")
    for p in (pool, named):
        if sys.argv[3] == "blob":
            p.write_blobs(np.array([0]), [b"x"]).wait()
        else:
            p.write(np.array([0]), np.ones((1, 64), np.uint8)).wait()
    pid = os.fork()
    if pid == 0:  # a helper that knows nothing about kvcm, then one that tries
        refused = []
        for use in (lambda: tier.create_pool(64, 4), lambda: pool.resize(8),
                    lambda: named.resize(8)):
            try:
                use()
            except InvalidStateError as exc:
                refused.append("forked" in str(exc))
        tier.close()  # a no-op: the parent's owner directory stays
        held = [os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")
                if os.path.exists(f"/proc/self/fd/{fd}")]
        with open(report + ".tmp", "w") as f:
            json.dump({"refused": refused, "held": [h for h in held if path in h]}, f)
        os.rename(report + ".tmp", report)
        time.sleep(60)
        os._exit(0)
    print(pid, tier.owner_directory, flush=True)
    time.sleep(120)
""")


@pytest.mark.parametrize("mode", ["slot", "blob"])
def test_a_forked_child_holds_no_lock_or_file_of_its_parents_disk_tier(tmp_path, mode):
    path, report = tmp_path / "d", tmp_path / "report.json"
    parent = subprocess.Popen([sys.executable, "-c", _FORKING, str(path), str(report), mode],
                              stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    line = parent.stdout.readline().split()
    assert line, "the parent did not start"
    helper, owner = int(line[0]), line[1]
    try:
        for _ in range(300):
            if report.exists():
                break
            time.sleep(0.05)
        result = json.loads(report.read_text())
        assert result["refused"] == [True, True, True]
        assert result["held"] == [], "the child kept the parent's files open"
        assert os.path.isdir(owner), "the child's close removed its parent's directory"
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=30)
        tier = DiskTier(None, {"path": str(path)})  # the helper still lives
        try:
            assert tier.swept.directories == (owner,)
        finally:
            tier.close()
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait(timeout=30)
        os.kill(helper, signal.SIGKILL)
    assert not os.path.exists(owner)
    # a named blob pool's lock file stays (see kvcm_tier_disk: one tier at a time)
    assert sorted(os.listdir(path)) in (["n.kvcm"], ["n.kvcm.lock", "n.kvcm.seg000001"])


# -- B6: a relative path survives a chdir ------------------------------------------------


def test_a_relative_path_is_fixed_at_start_so_close_after_a_chdir_removes_its_directory(
        tmp_path, monkeypatch):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    monkeypatch.chdir(tmp_path / "a")
    tier = DiskTier(None, {"path": "kv"})
    tier.create_pool(64, 4)
    assert os.path.isabs(tier.directory) and os.path.isabs(tier.owner_directory)
    monkeypatch.chdir(tmp_path / "b")
    tier.close()
    assert os.listdir(tmp_path / "a" / "kv") == []


# -- B7: two names never share a file ----------------------------------------------------


def test_two_different_pool_names_never_share_a_file(tmp_path):
    changed = "pool/x"
    looks_changed = file_name(changed)[: -len(".kvcm")]  # a plain, already safe name
    assert file_name(looks_changed) != file_name(changed)
    assert file_name("plain-name_1.2") == "plain-name_1.2.kvcm"  # plain names keep theirs
    tier = DiskTier(None, {"path": str(tmp_path / "d")})
    a = tier.create_pool(16, 4, name=changed)
    a.write(np.arange(4), np.full((4, 16), 7, np.uint8)).wait()
    b = tier.create_pool(16, 4, name=looks_changed)  # its own file, not a's
    out = np.ones((4, 16), np.uint8)
    b.read(np.arange(4), out).wait()
    assert not out.any()
    tier.close()


# -- suspected: a failed wait of a batched submission -------------------------------------


@pytest.mark.skipif(not aio.available(), reason="no native AIO here")
@pytest.mark.parametrize("slots", [[0, 2, 4], [4, 2, 0]], ids=["in-order", "unordered"])
@pytest.mark.parametrize("write", [True, False], ids=["write", "read"])
def test_a_batched_submission_whose_wait_fails_is_a_tier_io_error(tmp_path, monkeypatch,
                                                                  slots, write):
    tier = DiskTier(None, {"path": str(tmp_path / "d")})
    pool = tier.create_pool(16, 8)

    def wait_fails(ctx, cbs):
        raise OSError(errno.EFAULT, "Bad address")

    monkeypatch.setattr(aio, "_run", wait_fails)
    rows = np.ones((3, 16), np.uint8)
    handle = pool.write(np.array(slots), rows) if write else pool.read(np.array(slots), rows)
    with pytest.raises(TierIOError, match="Bad address"):
        handle.wait()
    monkeypatch.undo()
    tier.close()
