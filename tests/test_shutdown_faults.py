"""``shutdown()`` on a failing (read-only) file system: it closes everything it can, then
raises ``TierIOError`` (never a bare ``OSError``) listing each failure; the manager is shut
down all the same and a second ``shutdown()`` is a no-op."""

from __future__ import annotations

import errno
import os
import shutil

import pytest
from levels_helpers import Driver, faulty_disk, faulty_tier, make_manager, tokens

from kvcm_core import InvalidStateError, TierIOError
from kvcm_core.testing.faults import FaultPlan


def test_shutdown_on_a_read_only_file_system_raises_tier_io_error_and_is_never_half_shut(
        tmp_path) -> None:
    plan = FaultPlan()
    fds = len(os.listdir("/proc/self/fd"))
    m = make_manager([("gpu", 8), ("host", 8), ("faulty-disk", 16)], tmp_path,
                     pm=faulty_disk(plan))
    tier = faulty_tier(m, 2)
    assert tier.plan is plan
    d = Driver(m)
    for i in range(4):
        d.write(tokens(32, i), chunk=32).close()
    plan.fail_close = True
    with pytest.raises(TierIOError, match=r"EROFS|read-only") as info:
        m.shutdown()
    message = str(info.value)
    assert "level 2 tier" in message and "pool" in message, message
    assert type(info.value) is TierIOError
    assert m.is_shut_down
    assert len(os.listdir("/proc/self/fd")) == fds, "a file or the directory stayed open"
    m.shutdown()  # a no-op
    with pytest.raises(InvalidStateError, match="shut down"):
        m.create_kv_cache(None, tokens(8))


def test_a_real_disk_level_on_a_read_only_file_system_shuts_down_with_tier_io_error(
        tmp_path, monkeypatch) -> None:
    fds = len(os.listdir("/proc/self/fd"))
    m = make_manager([("gpu", 8), ("host", 8), ("disk", 16)], tmp_path)
    d = Driver(m)
    for i in range(4):
        d.write(tokens(32, 20 + i), chunk=32).close()
    owner = m.storage_levels.tiers[2].owner_directory

    def read_only(*args: object, **kwargs: object) -> None:
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(os, "unlink", read_only)
    monkeypatch.setattr(shutil, "rmtree", read_only)
    with pytest.raises(TierIOError, match="Read-only file system") as info:
        m.shutdown()
    assert type(info.value) is TierIOError and owner in str(info.value)
    assert m.is_shut_down and len(os.listdir("/proc/self/fd")) == fds
    m.shutdown()  # a no-op
    monkeypatch.undo()
    # What could not be removed is swept by the next start (its lock was released).
    again = make_manager([("gpu", 8), ("host", 8), ("disk", 16)], tmp_path)
    assert again.storage_levels.tiers[2].swept.directories == (owner,)
    again.shutdown()
