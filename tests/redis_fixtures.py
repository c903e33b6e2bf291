"""Session-wide Redis servers for the tests (real servers on loopback, stopped at exit);
tests skip with the reason where redis-server or redis-cli cannot be had."""

from __future__ import annotations

import atexit

import pytest

from kvcm_core.testing.redis_server import RedisClusterServers, RedisServer, redis_binaries

_cluster: RedisClusterServers | None = None


def need_binaries() -> None:
    found = redis_binaries()
    if isinstance(found, str):
        pytest.skip(found)


def session_cluster() -> RedisClusterServers:
    """One Redis Cluster for the whole session (do not kill its nodes: use your own)."""
    global _cluster
    need_binaries()
    if _cluster is None:
        _cluster = RedisClusterServers()
        atexit.register(_cluster.stop)
    return _cluster


def fresh_server(maxmemory: int = 0) -> RedisServer:
    """A server of the caller's own (to kill, restart or fill); the caller stops it."""
    need_binaries()
    return RedisServer(maxmemory=maxmemory)
