"""Crash safety of the disk level: each manager's files live in an owner directory holding
an ``flock``-ed lock file; a process killed with ``kill -9`` leaves files that the next disk
tier started in the same place sweeps (and reports); a live owner's files are never
touched; a failed construction, a full file system included, leaves no descriptor, file or
directory behind."""

from __future__ import annotations

import errno
import logging
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import kvcm_tier_disk
import pytest
from conftest import open_fds

from kvcm_core import (
    AttentionLayerConfig,
    BufferConfig,
    ConfigError,
    KVCacheManager,
    KVCacheManagerConfig,
    LevelConfig,
    TierIOError,
)
from kvcm_core.plugins import get_plugin_manager

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc")

_CHILD = textwrap.dedent("""
    import json, sys, time
    from kvcm_core import (AttentionLayerConfig, BufferConfig, KVCacheManager,
                           KVCacheManagerConfig, LevelConfig)
    options = json.loads(sys.argv[1])
    cfg = KVCacheManagerConfig(
        tokens_per_block=4,
        layers=[AttentionLayerConfig(layer_id=0, buffers=[BufferConfig(role="k", size=64)])],
        levels=[LevelConfig(tier="gpu", quota="1MiB"),
                LevelConfig(tier="disk", quota="4MiB", options=options)],
        kernel_backend="numpy")
    m = KVCacheManager(cfg)
    print(m.storage_levels.tiers[1].owner_directory, flush=True)
    time.sleep(120)
""")


def _config(options: dict[str, object], quota: str = "4MiB") -> KVCacheManagerConfig:
    return KVCacheManagerConfig(
        tokens_per_block=4,
        layers=[AttentionLayerConfig(layer_id=0, buffers=[BufferConfig(role="k", size=64)])],
        levels=[LevelConfig(tier="gpu", quota="1MiB"),
                LevelConfig(tier="disk", quota=quota, options=options)],
        kernel_backend="numpy")


def _start_child(options: dict[str, object], env: dict[str, str] | None = None
                 ) -> tuple[subprocess.Popen[str], Path]:
    import json

    child = subprocess.Popen([sys.executable, "-c", _CHILD, json.dumps(options)],
                             stdout=subprocess.PIPE, text=True, env=env)
    assert child.stdout is not None
    line = child.stdout.readline().strip()
    assert line, "the child did not start its manager"
    return child, Path(line)


def _kill(child: subprocess.Popen[str]) -> None:
    child.send_signal(signal.SIGKILL)
    child.wait(timeout=30)


def _disk_tier(options: dict[str, object]):
    return get_plugin_manager().tier("disk").factory(None, options)


def _fds() -> int:
    return len(open_fds())


def test_a_killed_managers_disk_files_are_swept_by_the_next_start(tmp_path, caplog) -> None:
    path = tmp_path / "disk"
    child, owner = _start_child({"path": str(path)})
    try:
        assert owner.parent == path and (owner / "lock").exists()
        leftovers = [p for p in owner.iterdir() if p.name != "lock"]
        assert leftovers and sum(p.stat().st_size for p in leftovers) >= 4 << 20
        live = _disk_tier({"path": str(path)})  # the owner is alive: nothing is swept
        assert live.swept.directories == () and owner.exists()
        live.close()
    finally:
        _kill(child)
    assert owner.exists(), "kill -9 left the preallocated files (what this test is about)"
    with caplog.at_level(logging.WARNING, logger="kvcm.disk"):
        m = KVCacheManager(_config({"path": str(path)}))
    tier = m.storage_levels.tiers[1]
    assert tier.swept.directories == (str(owner),) and tier.swept.nbytes >= 4 << 20
    assert not owner.exists()
    assert "removed 1 directories left by dead processes" in caplog.text
    m.shutdown()
    assert list(path.iterdir()) == [], "shutdown removes this manager's owner directory"


def test_a_killed_managers_private_directory_is_swept_and_a_clean_one_removed_at_shutdown(
        tmp_path, monkeypatch) -> None:
    tmp = tmp_path / "tmp"
    tmp.mkdir(mode=0o700)
    child, private = _start_child({}, env={**os.environ, "TMPDIR": str(tmp)})
    _kill(child)
    assert private.parent == tmp and private.name.startswith("kvcm-disk-")
    assert private.exists()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    m = KVCacheManager(_config({}))
    tier = m.storage_levels.tiers[1]
    assert tier.swept.directories == (str(private),) and not private.exists()
    mine = Path(tier.directory)
    assert mine.parent == tmp and mine.exists()
    m.shutdown()
    assert not mine.exists() and list(tmp.iterdir()) == []


def test_two_live_tiers_sharing_a_path_never_sweep_each_other(tmp_path) -> None:
    first = _disk_tier({"path": str(tmp_path)})
    pool = first.create_pool(4096, 8)
    second = _disk_tier({"path": str(tmp_path)})
    assert second.swept.directories == ()
    assert os.path.exists(pool.path)
    first.close()
    second.close()
    assert list(tmp_path.iterdir()) == []


def _no_space(*args: object, **kwargs: object) -> None:
    raise OSError(errno.ENOSPC, "No space left on device")


@pytest.mark.parametrize(("where", "name", "error"), [
    (os, "posix_fallocate", TierIOError),          # preallocating a pool file
    (kvcm_tier_disk, "make_owner_directory", ConfigError),  # the owner directory
    (kvcm_tier_disk, "OwnerLock", ConfigError),    # its lock file
], ids=["pool-file", "owner-directory", "lock-file"])
def test_a_disk_path_on_a_full_file_system_leaks_nothing_per_failed_attempt(
        tmp_path, monkeypatch, where, name, error) -> None:
    monkeypatch.setattr(where, name, _no_space)
    before = _fds()
    for _ in range(3):
        with pytest.raises(error, match="No space left"):
            KVCacheManager(_config({"path": str(tmp_path)}, quota="64MiB"))
    assert _fds() == before, "each failed attempt leaked descriptors"
    assert list(tmp_path.iterdir()) == [], "a failed attempt left files or directories"
