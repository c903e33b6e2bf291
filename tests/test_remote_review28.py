"""The shared remote level's rules found broken by review 28 (each test failed on the code
as reviewed), on real Redis servers started on loopback: writes that land after their
deadline stay under the quota, a closed tier leaves no connection and runs no abandoned
call, flush_remote checks its timeout, the sentinel check of a lookup has a deadline of
its own, one restart is counted once, and the sentinel never lives without an expiry."""

from __future__ import annotations

import concurrent.futures as cf
import math
import os
import signal
import time

import pytest
from redis_fixtures import fresh_server
from remote_helpers import TPB, config, serve

from kvcm_core import KVCacheManager
from kvcm_core.errors import ArgumentTypeError, InvalidArgumentError

redis = pytest.importorskip("redis", reason="the redis client package is not installed")


def _prompt(seed: int, blocks: int = 10) -> list[int]:
    return [seed * 100_000 + i for i in range(blocks * TPB)]


def _pid(server) -> int:
    return server.nodes[0].proc.pid  # type: ignore[union-attr]


# -- flush_remote(timeout_s) ----------------------------------------------------------------


@pytest.mark.parametrize(("value", "error", "rule"), [
    ("5", ArgumentTypeError, "must be seconds"),
    (True, ArgumentTypeError, "must be seconds"),
    (float("nan"), InvalidArgumentError, "must be seconds >= 0"),
    (-1.0, InvalidArgumentError, "must be seconds >= 0"),
], ids=["str", "bool", "nan", "negative"])
def test_flush_remote_refuses_a_bad_timeout_with_a_typed_error_naming_it(
        value, error, rule) -> None:
    """While writes are queued (the server paused), a bad ``timeout_s`` raised a raw
    ``TypeError`` from threading's internals (and was accepted silently when nothing was
    queued)."""
    with fresh_server() as server:
        with KVCacheManager(config(server.url, write_deadline_s=5.0, io_deadline_s=0.05)) as m:
            for paused in (False, True):
                if paused:
                    os.kill(_pid(server), signal.SIGSTOP)
                try:
                    serve(m, _prompt(1 + paused), rid=paused)
                    with pytest.raises(error) as info:
                        m.flush_remote(value)
                finally:
                    os.kill(_pid(server), signal.SIGCONT)
                assert str(info.value).startswith("timeout_s=") and rule in str(info.value)
                assert m.flush_remote(10.0)


@pytest.mark.parametrize("value", [math.inf, 1e300, 10 ** 400], ids=["inf", "1e300", "huge-int"])
def test_flush_remote_takes_inf_or_more_than_a_thread_can_wait_as_no_limit(value) -> None:
    """``flush_remote(float("inf"))`` (a natural "wait for ever") raised a raw
    ``OverflowError`` while writes were queued."""
    with fresh_server() as server:
        with KVCacheManager(config(server.url, write_deadline_s=5.0, io_deadline_s=0.05)) as m:
            os.kill(_pid(server), signal.SIGSTOP)
            try:
                serve(m, _prompt(1))
                with cf.ThreadPoolExecutor(1) as pool:
                    done = pool.submit(m.flush_remote, value)
                    time.sleep(0.3)
                    assert not done.done()  # waiting: the writes are still queued
                    os.kill(_pid(server), signal.SIGCONT)
                    assert done.result(timeout=30.0) is True
            finally:
                os.kill(_pid(server), signal.SIGCONT)
            assert m.get_remote_statistics().written == 10
