"""A named disk pool is opened by one tier at a time: the tier that opens it holds an
exclusive ``flock`` until the pool (or the tier) closes, and another tier with the same
``path``, in this process or another, is refused with ``TierIOError`` and changes nothing.
Slot pools lock their pool file, blob pools a ``<pool file>.lock`` beside their segments.
Anonymous pools (the manager's cold levels) take no lock."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import kvcm_tier_disk
import numpy as np
import pytest
from conftest import open_fds
from kvcm_tier_disk import DiskTier

from kvcm_core.errors import TierIOError

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc")

SB = 64  # slot bytes
MODES = ["slot", "blob"]
_RULE = "in use by another disk tier.*a named pool is opened by one tier at a time"


def _directory(tmp_path: Path) -> Path:
    """A private (0700) directory for the tiers' files."""
    path = tmp_path / "d"
    path.mkdir(mode=0o700)
    return path


def _tier(path: Path, mode: str) -> DiskTier:
    return DiskTier(None, {"path": str(path), "mode": mode, "segment_bytes": 4096})


def _row(value: int) -> np.ndarray:
    return np.full((1, SB), value, dtype=np.uint8)


def _write(pool, slot: int, value: int) -> None:
    pool.write(np.array([slot]), _row(value)).wait()


def _read(pool, slot: int) -> int:
    """The byte slot ``slot`` is filled with (each test writes whole rows of one value)."""
    out = np.zeros((1, SB), dtype=np.uint8)
    pool.read(np.array([slot]), out).wait()
    assert len(set(out[0].tolist())) == 1, "a row mixes two writes"
    return int(out[0, 0])


def _open_fds() -> set[str]:
    return set(open_fds())


def _pool_fds(pool) -> list[int]:
    """The descriptors a freshly opened named pool holds (its file, or its lock file)."""
    fd = getattr(pool, "_fd", None)
    return [fd] if fd is not None else [pool._lock_fd, *pool._fds.values()]


def _files(path: Path) -> dict[str, bytes]:
    """The named pools' files in ``path`` (owner directories left out) and their bytes."""
    return {p.name: p.read_bytes() for p in path.iterdir()
            if not p.name.startswith("kvcm-owner-")}


def _child_env() -> dict[str, str]:
    """The environment of a child python that imports the modules this test imports."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}


@pytest.mark.parametrize("mode", MODES)
def test_a_second_tier_cannot_open_a_named_pool_another_tier_holds_and_changes_nothing(
        tmp_path, mode):
    path = _directory(tmp_path)
    first, second = _tier(path, mode), _tier(path, mode)
    pool = first.create_pool(SB, 4, name="shared")
    _write(pool, 0, 5)
    _write(pool, 3, 6)
    files, fds = _files(path), _open_fds()
    with pytest.raises(TierIOError, match=_RULE) as info:
        second.create_pool(SB, 4, name="shared")
    assert "'shared'" in str(info.value) and str(path / "shared.kvcm") in str(info.value)
    assert _open_fds() == fds, "the refused open left a descriptor open"
    assert _files(path) == files, "the refused open changed the pool's files"
    assert [_read(pool, 0), _read(pool, 3)] == [5, 6]
    _write(pool, 1, 7)  # the holder goes on as before
    assert _read(pool, 1) == 7
    assert second.create_pool(SB, 4, name="other").num_slots == 4  # other names are free
    first.close()
    second.close()


@pytest.mark.parametrize("how", ["pool.close", "tier.close"])
@pytest.mark.parametrize("mode", MODES)
def test_a_named_pool_its_tier_closed_opens_in_another_tier_with_its_data(
        tmp_path, mode, how):
    path = _directory(tmp_path)
    first, second = _tier(path, mode), _tier(path, mode)
    pool = first.create_pool(SB, 4, name="shared")
    _write(pool, 2, 9)
    with pytest.raises(TierIOError, match=_RULE):
        second.create_pool(SB, 4, name="shared")
    if how == "pool.close":
        pool.close()
    else:
        first.close()
    reopened = second.create_pool(SB, 4, name="shared")
    assert _read(reopened, 2) == 9
    _write(reopened, 0, 4)
    third = _tier(path, mode)  # now the second tier holds it
    with pytest.raises(TierIOError, match=_RULE):
        third.create_pool(SB, 4, name="shared")
    for tier in (first, second, third):
        tier.close()


@pytest.mark.parametrize("mode", MODES)
def test_a_failed_open_of_a_named_pool_holds_no_lock(tmp_path, mode):
    path = _directory(tmp_path)
    maker = _tier(path, mode)
    _write(maker.create_pool(SB, 4, name="p"), 0, 1)
    maker.close()
    first, second = _tier(path, mode), _tier(path, mode)
    fds = _open_fds()
    with pytest.raises(ValueError, match="slot"):  # stored with slots of SB bytes
        first.create_pool(2 * SB, 4, name="p")
    assert _open_fds() == fds
    pool = second.create_pool(SB, 4, name="p")  # the failed open let its lock go
    assert _read(pool, 0) == 1
    with pytest.raises(TierIOError, match=_RULE):
        first.create_pool(SB, 4, name="p")
    first.close()
    second.close()


@pytest.mark.parametrize("mode", MODES)
def test_a_tier_that_loses_the_race_for_a_file_it_just_created_leaves_it_to_the_winner(
        tmp_path, mode, monkeypatch):
    # The loser created the pool file (slot mode) or lock file (blob mode) with O_EXCL,
    # but the winner opened and locked it before the loser's flock: the loser is refused
    # and deletes nothing; the winner takes the empty slot pool file as a new pool.
    path = _directory(tmp_path)
    winner, loser = _tier(path, mode), _tier(path, mode)
    won = []
    real_open = DiskTier._open_file

    def open_then_lose_the_race(tier, fname, label):
        fd, created = real_open(tier, fname, label)
        if tier is loser and created:
            won.append(winner.create_pool(SB, 4, name="raced"))
        return fd, created

    monkeypatch.setattr(DiskTier, "_open_file", open_then_lose_the_race)
    fds = _open_fds()
    with pytest.raises(TierIOError, match=_RULE):
        loser.create_pool(SB, 4, name="raced")
    monkeypatch.undo()
    (pool,) = won
    assert _open_fds() - fds == {str(fd) for fd in _pool_fds(pool)}
    _write(pool, 3, 8)
    assert _read(pool, 3) == 8
    pool.close()
    reopened = loser.create_pool(SB, 4, name="raced")
    assert _read(reopened, 3) == 8
    winner.close()
    loser.close()


def test_a_pool_file_its_failed_creator_deleted_is_not_locked_by_a_tier_that_opened_it(
        tmp_path, monkeypatch):
    # The late tier opened the file while its creator was preparing it; the creator then
    # failed (a full disk) and deleted it. Locking the deleted file would give the late
    # tier a pool no other tier can see, so it is refused and a new open makes a new file.
    path = _directory(tmp_path)
    creator, late = _tier(path, "slot"), _tier(path, "slot")
    opened = []

    def full_disk(fd, size):
        opened.append(late._open_file("p.kvcm", "disk pool 'p'"))
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(kvcm_tier_disk, "_set_size", full_disk)
    with pytest.raises(TierIOError, match="No space left"):
        creator.create_pool(SB, 4, name="p")
    monkeypatch.undo()
    ((fd, created),) = opened
    assert not created and not (path / "p.kvcm").exists()
    with pytest.raises(TierIOError, match="was deleted by the disk tier that held it"):
        late._hold(fd, "p.kvcm", "disk pool 'p'")
    with pytest.raises(OSError, match="Bad file descriptor"):
        os.fstat(fd)  # closed by the refusal
    pool = late.create_pool(SB, 4, name="p")
    _write(pool, 0, 2)
    assert _read(pool, 0) == 2 and (path / "p.kvcm").exists()
    creator.close()
    late.close()


@pytest.mark.parametrize("mode", MODES)
def test_closing_a_named_blob_or_slot_pool_whose_descriptor_fails_still_releases_its_lock(
        tmp_path, mode, monkeypatch):
    path = _directory(tmp_path)
    first, second = _tier(path, mode), _tier(path, mode)
    pool = first.create_pool(SB, 4, name="p")
    _write(pool, 0, 3)
    with pytest.raises(TierIOError, match=_RULE):
        second.create_pool(SB, 4, name="p")
    real_close = os.close

    def close_reports_eio(fd):  # as Linux does: the descriptor is gone all the same
        real_close(fd)
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "close", close_reports_eio)
    with pytest.raises(TierIOError, match="Input/output error"):
        pool.close()
    monkeypatch.undo()
    assert _read(second.create_pool(SB, 4, name="p"), 0) == 3
    first.close()
    second.close()


_CHILD = textwrap.dedent("""
    import sys
    import numpy as np
    from kvcm_tier_disk import DiskTier
    from kvcm_core.errors import TierIOError
    path, mode, hold = sys.argv[1], sys.argv[2], sys.argv[3] == "hold"
    tier = DiskTier(None, {"path": path, "mode": mode})
    try:
        pool = tier.create_pool(64, 4, name="shared")
    except TierIOError as exc:
        print("refused", exc, flush=True)
    else:
        pool.write(np.array([1]), np.full((1, 64), 7, np.uint8)).wait()
        print("opened", flush=True)
        if hold:  # until the parent says so
            sys.stdin.readline()
    tier.close()
""")


@pytest.mark.parametrize("mode", MODES)
def test_a_named_pool_is_refused_to_a_tier_of_another_process_while_one_holds_it(
        tmp_path, mode):
    path = _directory(tmp_path)
    tier = _tier(path, mode)
    pool = tier.create_pool(SB, 4, name="shared")
    _write(pool, 0, 3)
    child = subprocess.run([sys.executable, "-c", _CHILD, str(path), mode, "try"],
                           capture_output=True, text=True, env=_child_env(), timeout=120)
    assert child.returncode == 0, child.stderr
    assert child.stdout.startswith("refused") and "'shared'" in child.stdout
    assert "one tier at a time" in child.stdout
    assert [_read(pool, 0), _read(pool, 1)] == [3, 0]
    tier.close()

    # the other way round: the child holds it, then lets it go by closing its tier
    holder = subprocess.Popen([sys.executable, "-c", _CHILD, str(path), mode, "hold"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                              env=_child_env())
    try:
        assert holder.stdout is not None and holder.stdin is not None
        assert holder.stdout.readline() == "opened\n"
        tier = _tier(path, mode)
        with pytest.raises(TierIOError, match=_RULE):
            tier.create_pool(SB, 4, name="shared")
        holder.stdin.write("\n")
        holder.stdin.flush()
        assert holder.wait(timeout=120) == 0
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait(timeout=30)
    pool = tier.create_pool(SB, 4, name="shared")
    assert [_read(pool, 0), _read(pool, 1)] == [3, 7]
    tier.close()


_FORKING = textwrap.dedent("""
    import json, os, sys
    from kvcm_tier_disk import DiskTier
    from kvcm_core.errors import TierIOError

    def attempt(path, mode):
        tier = DiskTier(None, {"path": path, "mode": mode})
        try:
            tier.create_pool(64, 4, name="n")
            return "opened"
        except TierIOError as exc:
            return "refused" if "one tier at a time" in str(exc) else str(exc)
        finally:
            tier.close()

    path, mode = sys.argv[1], sys.argv[2]
    tier = DiskTier(None, {"path": path, "mode": mode})
    pool = tier.create_pool(64, 4, name="n")
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # its copies of the parent's descriptors are closed: the lock stays
        os.close(read)
        os.write(write, attempt(path, mode).encode())
        os._exit(0)
    os.close(write)
    in_child = os.read(read, 1000).decode()
    os.waitpid(pid, 0)
    after_child = attempt(path, mode)  # the child's copies are all gone now
    pool.close()
    print(json.dumps([in_child, after_child, attempt(path, mode)]))
    tier.close()
""")


@pytest.mark.parametrize("mode", MODES)
def test_a_forked_child_cannot_open_its_parents_named_pool_nor_release_its_lock(
        tmp_path, mode):
    path = _directory(tmp_path)
    run = subprocess.run([sys.executable, "-c", _FORKING, str(path), mode],
                         capture_output=True, text=True, env=_child_env(), timeout=120)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout) == ["refused", "refused", "opened"]


@pytest.mark.parametrize("mode", MODES)
def test_anonymous_pools_of_two_tiers_on_one_path_work_side_by_side_without_a_lock_file(
        tmp_path, mode):
    path = _directory(tmp_path)
    first, second = _tier(path, mode), _tier(path, mode)
    pools = [first.create_pool(SB, 4), second.create_pool(SB, 4)]
    for value, pool in enumerate(pools, start=1):
        _write(pool, 0, value)
    assert [_read(pool, 0) for pool in pools] == [1, 2]
    assert _files(path) == {}, "an anonymous pool put a file in path itself"
    first.close()
    second.close()
