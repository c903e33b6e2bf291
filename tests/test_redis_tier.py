"""The redis tier against real servers on loopback: options, namespaces, pipelining, and the
faults a shared store brings (a killed or frozen server, ``maxmemory`` evictions, a cluster
primary failing over). Every call returns by its deadline; nothing wrong is ever returned."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from redis_fixtures import fresh_server, lag_budget, need_binaries

from kvcm_core.errors import ConfigError, TierIOError

pytest.importorskip("redis", reason="the redis client package is not installed")
from kvcm_tier_redis import RedisTier


def _keys(n: int) -> list[bytes]:
    run = uuid.uuid4().bytes
    return [run + i.to_bytes(4, "little") for i in range(n)]


def _soon(seconds: float = 5.0) -> float:
    return time.monotonic() + seconds


def _timed(call, budget: float):  # test helper
    """Run ``call(deadline)`` with ``budget`` seconds and assert it returned in time: by
    the deadline plus the slack of :func:`~redis_fixtures.lag_budget`, which grows with
    the scheduler lag measured during the call (on a loaded machine the test process
    itself runs late; a tier that keeps its deadlines is late by no more than that)."""
    result: list = []
    error: list[BaseException] = []
    with lag_budget(budget) as timing:
        try:
            result.append(call(time.monotonic() + budget))
        except BaseException as exc:  # re-raised after the timing check
            error.append(exc)
    assert timing.elapsed < timing.limit, timing
    if error:
        raise error[0]
    return result[0]


@pytest.mark.parametrize(("options", "field"), [
    ({}, "redis.options.url"),
    ({"url": "http://127.0.0.1:1"}, "redis.options.url"),
    ({"url": "redis://127.0.0.1:1", "cluster": "yes"}, "redis.options.cluster"),
    ({"url": "redis://127.0.0.1:1", "namespace": "a b"}, "redis.options.namespace"),
    ({"url": "redis://127.0.0.1:1", "connect_timeout_s": 0}, "redis.options.connect_timeout_s"),
    ({"url": "redis://127.0.0.1:1", "pipeline_bytes": 0}, "redis.options.pipeline_bytes"),
    ({"url": "redis://127.0.0.1:1", "colour": "red"}, "redis.options.colour"),
    ({"url": "redis://127.0.0.1:99999/0"}, "redis.options.url"),  # port out of range
    ({"url": "redis://127.0.0.1:notaport/0"}, "redis.options.url"),
    ({"url": "redis://[::1/0"}, "redis.options.url"),  # a broken IPv6 host
])
def test_bad_options_raise_config_error_naming_the_option(options: dict, field: str) -> None:
    with pytest.raises(ConfigError) as info:
        RedisTier(None, options)
    assert info.value.field == field


def test_a_connection_is_kept_when_the_process_has_more_than_1024_files_open() -> None:
    """Inference servers hold many descriptors: a connection whose descriptor is past
    1024 is still checked for staleness (no reconnection per call)."""
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 2048:
        pytest.skip(f"the open-files limit ({hard}) is below 2048")
    resource.setrlimit(resource.RLIMIT_NOFILE, (2048, hard))
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    try:
        with fresh_server() as server:
            tier = RedisTier(None, {"url": server.url})
            try:
                admin = __import__("redis").Redis.from_url(server.url)
                before = admin.info("stats")["total_connections_received"]
                for key in _keys(50):
                    tier.put_many([key], [b"x" * 64], deadline=_soon())
                opened = admin.info("stats")["total_connections_received"] - before - 1
                assert opened <= 1, f"{opened} connections for 50 calls"
            finally:
                tier.close()
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_namespaces_keep_two_deployments_apart() -> None:
    with fresh_server() as server:
        a = RedisTier(None, {"url": server.url, "namespace": "model-a"})
        b = RedisTier(None, {"url": server.url, "namespace": "model-b"})
        try:
            keys = _keys(2)
            a.put_many(keys, [b"a0", b"a1"], deadline=_soon())
            assert b.get_many(keys, deadline=_soon()) == [None, None]
            assert b.delete_many(keys, deadline=_soon()) == 0
            assert a.get_many(keys, deadline=_soon()) == [b"a0", b"a1"]
        finally:
            a.close()
            b.close()


def test_batches_larger_than_one_pipeline_keep_every_value_in_order() -> None:
    with fresh_server() as server:
        tier = RedisTier(None, {"url": server.url, "pipeline_bytes": 1000})
        try:
            rng = np.random.default_rng(5)
            values = [rng.integers(0, 256, int(n), dtype=np.uint8).tobytes()
                      for n in rng.integers(1, 700, 50)]
            keys = _keys(len(values))
            assert tier.put_many(keys, values, deadline=_soon()).all()
            assert tier.get_many(keys, deadline=_soon()) == values
            assert tier.exists_many(keys, deadline=_soon()).all()
            assert tier.delete_many(keys, deadline=_soon()) == len(keys)
        finally:
            tier.close()


def test_a_killed_server_fails_calls_within_the_deadline_and_a_restart_recovers() -> None:
    with fresh_server() as server:
        tier = RedisTier(None, {"url": server.url})
        try:
            keys = _keys(3)
            tier.put_many(keys, [b"x", b"y", b"z"], deadline=_soon())
            server.kill()
            for call in (lambda d: tier.get_many(keys, deadline=d),
                         lambda d: tier.put_many(keys, [b"1", b"2", b"3"], deadline=d),
                         lambda d: tier.exists_many(keys, deadline=d)):
                with pytest.raises(TierIOError):
                    _timed(call, 0.5)
            assert tier.errors + tier.timeouts >= 3
            server.restart()  # empty: what was stored is gone, which is ordinary loss
            assert _timed(lambda d: tier.get_many(keys, deadline=d), 2.0) == [None] * 3
            tier.put_many(keys[:1], [b"again"], deadline=_soon())
            assert tier.get_many(keys[:1], deadline=_soon()) == [b"again"]
        finally:
            tier.close()


def test_a_frozen_server_times_out_at_the_deadline_and_the_tier_carries_on() -> None:
    with fresh_server() as server:
        tier = RedisTier(None, {"url": server.url})
        try:
            keys = _keys(2)
            tier.put_many(keys, [b"a", b"b"], deadline=_soon())
            pid = server.nodes[0].proc.pid  # type: ignore[union-attr]
            os.kill(pid, signal.SIGSTOP)
            try:
                with pytest.raises(TierIOError, match="deadline"):
                    _timed(lambda d: tier.get_many(keys, deadline=d), 0.4)
                assert tier.timeouts == 1
            finally:
                os.kill(pid, signal.SIGCONT)
            assert _timed(lambda d: tier.get_many(keys, deadline=d), 3.0) == [b"a", b"b"]
        finally:
            tier.close()


def test_a_server_that_accepts_but_never_answers_fails_the_connection_within_its_timeout(
        ) -> None:
    # The connection's hand-shake (AUTH, SELECT, INFO) keeps the connect timeout: a
    # listener that never answers cannot hold a thread of the tier for ever.
    import socket
    import threading

    from kvcm_tier_redis import _Plain

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    port = silent.getsockname()[1]
    outcome: list[BaseException | None] = []

    def connect() -> None:
        try:
            _Plain({"host": "127.0.0.1", "port": port}, 0.5, ConnectionError)
            outcome.append(None)
        except BaseException as exc:  # the outcome is asserted below
            outcome.append(exc)

    try:
        t0 = time.monotonic()
        worker = threading.Thread(target=connect, daemon=True)
        worker.start()
        worker.join(10)
        assert not worker.is_alive(), "the hand-shake waited for ever"
        assert isinstance(outcome[0], OSError), outcome
        assert time.monotonic() - t0 < 5
    finally:
        silent.close()


def test_maxmemory_evictions_are_ordinary_loss_never_wrong_values() -> None:
    with fresh_server(maxmemory=4 << 20) as server:
        tier = RedisTier(None, {"url": server.url})
        try:
            keys = _keys(64)
            values = [bytes([i]) * (256 << 10) for i in range(64)]  # 16 MiB into 4 MiB
            for lo in range(0, 64, 8):
                tier.put_many(keys[lo:lo + 8], values[lo:lo + 8], deadline=_soon())
            got = tier.get_many(keys, deadline=_soon())
            assert any(v is None for v in got), "the server should have evicted keys"
            assert any(v is not None for v in got)
            for v, want in zip(got, values, strict=True):
                assert v is None or v == want
        finally:
            tier.close()


@contextlib.contextmanager
def _replicated_cluster() -> Iterator[tuple[Any, RedisTier, list[bytes], list[bytes]]]:
    """A cluster (node timeout 3 s: with 1 s a live primary that misses its heartbeats on
    a loaded machine is voted out too) and a tier that wrote 200 keys, every replica
    caught up (replication is asynchronous). Yields (cluster, tier, keys, values)."""
    need_binaries()
    from kvcm_core.testing.redis_server import RedisClusterServers

    with RedisClusterServers(node_timeout_ms=3000) as cluster:
        tier = RedisTier(None, {"url": cluster.url, "cluster": True})
        keys = _keys(200)
        values = [k * 3 for k in keys]
        assert tier.put_many(keys, values, deadline=_soon()).all()
        cluster.wait_replicated()
        yield cluster, tier, keys, values


def test_a_cluster_primary_failing_over_costs_calls_not_correctness() -> None:
    with _replicated_cluster() as (cluster, tier, keys, values):
        try:
            cluster.kill_port(cluster.primary_ports()[0])
            outcomes = []
            for _ in range(10):  # calls during the failover: each in time, never wrong
                try:
                    got = _timed(lambda d: tier.get_many(keys, deadline=d), 0.5)
                except TierIOError:
                    outcomes.append("error")
                    continue
                outcomes.append("ok")
                assert all(v is None or v == w for v, w in zip(got, values, strict=True))
            cluster.wait_failover(3)
            deadline = time.monotonic() + 15
            history: list[str] = []
            while True:  # the client finds the new primary again: the whole result is
                try:      # back (a partial result is no recovery yet, as an error isn't)
                    got = tier.get_many(keys, deadline=_soon(1.0))
                    assert all(v is None or v == w for v, w in zip(got, values, strict=True))
                    found = sum(v is not None for v in got)
                    history.append(f"{found} found")
                    if found >= len(keys) * 0.9:
                        break
                except TierIOError as exc:
                    history.append(f"error: {exc}")
                assert time.monotonic() < deadline, f"the tier never recovered: {history}"
                time.sleep(0.1)
            fresh = _keys(20)
            deadline = time.monotonic() + 15
            history = []
            while True:  # a key of a slot the client still maps to the dead primary
                try:      # fails once; the client then reads the cluster's map again
                    ok = tier.put_many(fresh, fresh, deadline=_soon())
                    history.append(f"{int(ok.sum())} written")
                    if ok.all():
                        break
                except TierIOError as exc:
                    history.append(f"error: {exc}")
                assert time.monotonic() < deadline, f"writes never recovered: {history}"
                time.sleep(0.1)
            assert tier.get_many(fresh, deadline=_soon()) == fresh
        finally:
            tier.close()


def test_after_a_graceful_cluster_failover_moved_replies_fail_the_call_and_every_key_comes_back(
) -> None:
    """``CLUSTER FAILOVER`` on a replica: the old primary stays up as a replica and answers
    ``-MOVED`` for its former slots. Such a reply is a topology change, not a miss: the call
    fails (counted), the client re-reads the slot map, and within a few calls every key is
    readable and writable again (a tier that kept ``-MOVED`` as a per-key miss never saw
    a third of its keys again)."""
    with _replicated_cluster() as (cluster, tier, keys, values):
        try:
            cluster.failover_gracefully(cluster.replica_of(cluster.primary_ports()[0]))
            errors_before = tier.errors
            history = []
            for _ in range(5):  # a few calls: the first may fail, then all keys are back
                try:
                    got = tier.get_many(keys, deadline=_soon())
                    ok = tier.put_many(keys, values, deadline=_soon())
                except TierIOError as exc:
                    history.append(f"error: {exc}")
                    time.sleep(0.1)
                    continue
                assert all(v is None or v == w for v, w in zip(got, values, strict=True))
                found = sum(v is not None for v in got)
                history.append(f"{found} read, {int(ok.sum())} written")
                if found == len(keys) and ok.all():
                    break
                time.sleep(0.1)
            else:
                raise AssertionError(f"the tier never recovered: {history}")
            assert tier.errors > errors_before, \
                f"the -MOVED replies were not counted as an error: {history}"
            fresh = _keys(50)
            assert tier.put_many(fresh, fresh, deadline=_soon()).all()
            assert tier.get_many(fresh, deadline=_soon()) == fresh
            assert tier.exists_many(keys, deadline=_soon()).all()
        finally:
            tier.close()


def test_a_readonly_reply_fails_the_call_but_a_wrongtype_reply_is_only_that_keys_miss() -> None:
    """A standalone server turned replica answers ``-READONLY`` to writes: the topology
    changed, the call fails (counted). A key holding another type answers ``-WRONGTYPE``:
    that key is a miss and the call goes on."""
    import redis

    with fresh_server() as server, fresh_server() as other:
        tier = RedisTier(None, {"url": server.url})
        admin = redis.Redis(host="127.0.0.1", port=server.port)
        try:
            keys = _keys(3)
            assert tier.put_many(keys, keys, deadline=_soon()).all()
            admin.delete(b"kvcm:" + keys[1])
            admin.lpush(b"kvcm:" + keys[1], b"x")
            assert tier.get_many(keys, deadline=_soon()) == [keys[0], None, keys[2]]
            assert tier.errors == 0
            admin.replicaof("127.0.0.1", other.port)
            with pytest.raises(TierIOError, match="READONLY"):
                tier.put_many(keys, keys, deadline=_soon())
            assert tier.errors == 1
        finally:
            tier.close()


@contextlib.contextmanager
def _busy_script(port: int) -> Iterator[None]:
    """A Lua busy loop on the server on ``port`` (from another connection) for the block:
    with ``busy-reply-threshold`` at 50 ms, the server then answers ``-BUSY`` to every
    other command until the script is killed at the end of the block."""
    import redis

    admin = redis.Redis(host="127.0.0.1", port=port)
    admin.config_set("busy-reply-threshold", 50)

    def loop() -> None:
        try:
            redis.Redis(host="127.0.0.1", port=port).eval("while true do end", 0)
        except redis.RedisError:  # killed at the end of the block
            pass

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    deadline = time.monotonic() + 10
    while True:  # until the server answers -BUSY
        try:
            admin.ping()
        except redis.exceptions.BusyLoadingError:
            raise
        except redis.ResponseError as exc:
            if "BUSY" in str(exc):
                break
            raise
        assert time.monotonic() < deadline, "the server never answered -BUSY"
        time.sleep(0.05)
    try:
        yield
    finally:
        deadline = time.monotonic() + 10
        while t.is_alive():
            try:
                admin.script_kill()
            except redis.ResponseError:  # NOTBUSY: not running yet or any more
                pass
            t.join(0.2)
            assert time.monotonic() < deadline, "the busy script could not be killed"
        admin.close()


def _busy_fails_every_call(tier: RedisTier, keys: list[bytes], busy_port: int) -> None:
    """While the server at ``busy_port`` answers ``-BUSY``, exists, get and put each fail
    (TierIOError, counted in ``errors``) instead of reporting keys absent; afterwards
    every key is back."""
    assert tier.put_many(keys, keys, deadline=_soon()).all()
    with _busy_script(busy_port):
        for name, call in (
                ("exists", lambda: tier.exists_many(keys, deadline=_soon(2.0))),
                ("get", lambda: tier.get_many(keys, deadline=_soon(2.0))),
                ("put", lambda: tier.put_many(keys, keys, deadline=_soon(2.0)))):
            errors = tier.errors
            with pytest.raises(TierIOError, match="BUSY"):
                result = call()
                raise AssertionError(f"{name} during -BUSY returned {result!r}")
            assert tier.errors == errors + 1, name
    assert tier.exists_many(keys, deadline=_soon()).all()
    assert tier.get_many(keys, deadline=_soon()) == keys


def test_a_busy_server_fails_every_call_instead_of_reporting_keys_absent() -> None:
    """A server running a long Lua script answers ``-BUSY`` to every command: it cannot
    say whether a key is there, so get, exists and put fail (counted in ``errors``), and
    never report the keys absent (a remote level would forget its own keys); once the
    script is killed every key is back."""
    with fresh_server() as server:
        tier = RedisTier(None, {"url": server.url})
        try:
            _busy_fails_every_call(tier, _keys(5), server.port)
        finally:
            tier.close()


def test_a_busy_cluster_primary_fails_the_call_instead_of_reporting_keys_absent() -> None:
    """The same through the ``redis`` client package (a cluster): a primary answering
    ``-BUSY`` fails get, exists and put."""
    need_binaries()
    from kvcm_core.testing.redis_server import RedisClusterServers

    with RedisClusterServers(node_timeout_ms=15000) as cluster:
        tier = RedisTier(None, {"url": cluster.url, "cluster": True})
        try:
            _busy_fails_every_call(tier, _keys(60), cluster.primary_ports()[0])  # all primaries
        finally:
            tier.close()


def test_an_ask_reply_for_a_migrating_slot_is_that_keys_miss_and_the_call_goes_on() -> None:
    """A slot being migrated: its old primary answers ``-ASK`` for a key it does not hold.
    Re-reading the slot map cannot help (the slot is still the old primary's), so that key
    is a miss or a refused write, the other keys are served, and nothing is counted as an
    error (a tier that failed the call switched its level off for a whole reshard)."""
    need_binaries()
    import redis
    from redis.crc import key_slot

    from kvcm_core.testing.redis_server import RedisClusterServers

    with RedisClusterServers(node_timeout_ms=15000) as cluster:
        tier = RedisTier(None, {"url": cluster.url, "cluster": True})
        try:
            keys = _keys(30)
            assert tier.put_many(keys, keys, deadline=_soon()).all()
            absent = _keys(1)[0]
            slot = key_slot(b"kvcm:" + absent)
            primaries = cluster.primary_ports()
            nodes = {p: redis.Redis(host="127.0.0.1", port=p) for p in primaries}

            def reply(port: int) -> str:
                try:
                    return repr(nodes[port].execute_command("GET", b"kvcm:" + absent))
                except redis.ResponseError as exc:
                    return type(exc).__name__

            owner = next(p for p in primaries if reply(p) == "None")
            target = next(p for p in primaries if p != owner)
            target_id = cluster.cli(target, "cluster", "myid").strip()
            assert "OK" in cluster.cli(owner, "cluster", "setslot", str(slot), "migrating",
                                       target_id)
            assert reply(owner) == "AskError"
            errors = tier.errors
            got = tier.get_many([*keys, absent], deadline=_soon())
            assert got == [*keys, None]
            assert tier.exists_many([*keys, absent], deadline=_soon()).tolist() == \
                [True] * len(keys) + [False]
            assert tier.put_many([*keys, absent], [*keys, absent],
                                 deadline=_soon()).tolist() == [True] * len(keys) + [False]
            assert tier.errors == errors
            assert "OK" in cluster.cli(owner, "cluster", "setslot", str(slot), "stable")
            assert tier.put_many([absent], [absent], deadline=_soon()).all()
            assert tier.get_many([absent], deadline=_soon()) == [absent]
            for n in nodes.values():
                n.close()
        finally:
            tier.close()


def test_a_password_and_a_database_in_the_url_are_honoured() -> None:
    import redis

    with fresh_server() as server:
        admin = redis.Redis(host="127.0.0.1", port=server.port)
        admin.config_set("requirepass", "s3cret")
        url = f"redis://:s3cret@127.0.0.1:{server.port}/2"
        tier = RedisTier(None, {"url": url})
        wrong = RedisTier(None, {"url": f"redis://:nope@127.0.0.1:{server.port}/2"})
        try:
            keys = _keys(2)
            assert tier.put_many(keys, [b"a", b"b"], deadline=_soon()).all()
            assert tier.get_many(keys, deadline=_soon()) == [b"a", b"b"]
            db2 = redis.Redis(host="127.0.0.1", port=server.port, db=2, password="s3cret")
            assert db2.dbsize() == 2  # stored in database 2, not 0
            with pytest.raises(TierIOError):
                wrong.get_many(keys, deadline=_soon())
        finally:
            tier.close()
            wrong.close()


def _run_id(url: str) -> str:
    return __import__("redis").Redis.from_url(url).info("server")["run_id"]


def test_store_instances_name_the_server_process_and_change_when_it_restarts() -> None:
    """The tier records the run_id of the server behind each connection it opens: a
    restart (empty) shows as a new run_id at the same address, and the keys it lost read
    as clean misses."""
    with fresh_server() as server:
        tier = RedisTier(None, {"url": server.url})
        try:
            keys = _keys(2)
            tier.put_many(keys, [b"a", b"b"], deadline=_soon())
            where = f"127.0.0.1:{server.port}"
            assert tier.store_instances() == {where: _run_id(server.url)}
            before = tier.store_instances()[where]
            server.restart()
            assert tier.get_many(keys, deadline=_soon()) == [None, None]
            after = tier.store_instances()
            assert after == {where: _run_id(server.url)} and after[where] != before
        finally:
            tier.close()


def test_store_instances_of_a_cluster_name_every_primary_reached() -> None:
    from redis_fixtures import session_cluster

    cluster = session_cluster()
    tier = RedisTier(None, {"url": cluster.url, "cluster": True})
    try:
        keys = _keys(64)  # spread over every primary
        assert tier.put_many(keys, [b"v"] * 64, deadline=_soon()).all()
        seen = tier.store_instances()
        for port in cluster.primary_ports():
            url = f"redis://127.0.0.1:{port}/0"
            assert seen.get(f"127.0.0.1:{port}") == _run_id(url), port
        tier.delete_many(keys, deadline=_soon())
    finally:
        tier.close()


def test_servers_started_for_tests_die_with_the_process_that_started_them() -> None:
    """A test run killed by SIGTERM runs no cleanup: its redis-servers (in their own
    session) must not outlive it (Linux: PR_SET_PDEATHSIG)."""
    import subprocess
    import sys

    need_binaries()
    if not sys.platform.startswith("linux"):
        pytest.skip("parent-death signals are Linux's")
    code = ("import sys, time\n"
            "from kvcm_core.testing.redis_server import RedisServer\n"
            "s = RedisServer()\n"
            "print(s.nodes[0].proc.pid, s._workdir, flush=True)\n"
            "time.sleep(60)\n")
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                              text=True, env=os.environ.copy())
    server_pid, workdir = None, None
    try:
        pid, workdir = parent.stdout.readline().split()  # type: ignore[union-attr]
        server_pid = int(pid)
        os.kill(server_pid, 0)  # running
        parent.send_signal(signal.SIGTERM)
        parent.wait(10)
        deadline = time.monotonic() + 5
        while True:
            try:
                os.kill(server_pid, 0)
            except ProcessLookupError:
                break  # gone (reaped by init after the SIGKILL)
            with open(f"/proc/{server_pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    break  # killed, not yet reaped
            assert time.monotonic() < deadline, "the redis-server outlived its parent"
            time.sleep(0.05)
    finally:
        parent.kill()
        parent.wait()
        if server_pid is not None:
            try:
                os.kill(server_pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if workdir is not None:
            import shutil

            shutil.rmtree(workdir, ignore_errors=True)
