"""A manager whose construction fails releases everything it had built: the tiers of the
levels before the failing one (their files, descriptors and threads) and the backend."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from conftest import open_fds

from kvcm_core import (
    AttentionLayerConfig,
    BufferConfig,
    ConfigError,
    KVCacheManager,
    KVCacheManagerConfig,
    LevelConfig,
)


def _open_fds() -> int:
    return len(open_fds())


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc/self/fd")
def test_a_later_levels_config_error_leaves_no_descriptor_or_file_behind(
        tmp_path: Path) -> None:
    cfg = KVCacheManagerConfig(
        tokens_per_block=4,
        layers=[AttentionLayerConfig(layer_id=0, buffers=[BufferConfig(role="k", size=64)])],
        levels=[LevelConfig(tier="gpu", quota="1MiB"),
                LevelConfig(tier="disk", quota="8MiB", options={"path": str(tmp_path)}),
                LevelConfig(tier="disk", quota="1MiB", options={"bogus": 1})],
        kernel_backend="numpy")
    before = _open_fds()
    for _ in range(3):
        with pytest.raises(ConfigError, match="bogus"):
            KVCacheManager(cfg)
    assert _open_fds() == before, "each failed attempt leaked descriptors"
    assert list(tmp_path.iterdir()) == []


def _fds_under(path: Path) -> list[str]:
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(str(path)):
            out.append(target)
    return out


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc/self/fd")
def test_a_bad_remote_level_leaves_no_descriptor_or_file_behind(tmp_path: Path) -> None:
    # The descriptors checked are the earlier levels' (their files under tmp_path): a
    # count of all descriptors would see sockets that earlier tests' threads close later.
    pytest.importorskip("redis", reason="the redis client package is not installed")
    cfg = KVCacheManagerConfig(
        tokens_per_block=4,
        layers=[AttentionLayerConfig(layer_id=0, buffers=[BufferConfig(role="k", size=64)])],
        levels=[LevelConfig(tier="gpu", quota="1MiB"),
                LevelConfig(tier="disk", quota="8MiB", options={"path": str(tmp_path)}),
                LevelConfig(tier="redis", quota="1MiB",
                            options={"url": "redis://127.0.0.1:1/0", "model": "m",
                                     "shard": "0", "bogus": 1})],
        kernel_backend="numpy")
    for _ in range(3):
        with pytest.raises(ConfigError, match="bogus"):
            KVCacheManager(cfg)
    assert _fds_under(tmp_path) == []
    assert list(tmp_path.iterdir()) == []
