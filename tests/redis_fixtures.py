"""Session-wide Redis servers for the tests (real servers on loopback, stopped at exit);
tests skip with the reason where redis-server or redis-cli cannot be had."""

from __future__ import annotations

import atexit
import contextlib
import threading
import time
from collections.abc import Iterator

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
        # A long node timeout: on a loaded CI machine a node that misses its heartbeats for
        # the failover tests' 1 s would be voted out, and for a moment two nodes would
        # claim the same slots. Nobody kills this cluster's nodes, so no test waits on it.
        _cluster = RedisClusterServers(node_timeout_ms=15000)
        atexit.register(_cluster.stop)
    return _cluster


def fresh_server(maxmemory: int = 0) -> RedisServer:
    """A server of the caller's own (to kill, restart or fill); the caller stops it."""
    need_binaries()
    return RedisServer(maxmemory=maxmemory)


class LagBudget:
    """How long a block took, against ``base`` seconds plus the slack a deadline gets:
    :data:`~kvcm_core.testing.conformance.keyed.DEADLINE_SLACK_S` and twice the worst
    scheduler lag seen meanwhile (a thread that sleeps 5 ms at a time measures how late it
    wakes). On a loaded machine the process itself runs late; a call that honours its
    deadline is late by no more than that."""

    def __init__(self, base: float) -> None:
        self.base = base
        self.lag = 0.0
        self.elapsed = 0.0

    @property
    def limit(self) -> float:
        from kvcm_core.testing.conformance.keyed import DEADLINE_SLACK_S

        return self.base + DEADLINE_SLACK_S + 2 * self.lag

    def __repr__(self) -> str:
        return (f"LagBudget(elapsed={self.elapsed:.3f}s, limit={self.limit:.3f}s: "
                f"base {self.base}s, worst scheduler lag {self.lag:.3f}s)")


@contextlib.contextmanager
def lag_budget(base: float) -> Iterator[LagBudget]:
    """Time the block (see :class:`LagBudget`); the caller asserts on the result."""
    budget = LagBudget(base)
    stop = threading.Event()

    def probe() -> None:
        while not stop.is_set():
            t = time.monotonic()
            time.sleep(0.005)
            budget.lag = max(budget.lag, time.monotonic() - t - 0.005)

    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    start = time.monotonic()
    try:
        yield budget
    finally:
        budget.elapsed = time.monotonic() - start
        stop.set()
        thread.join()
