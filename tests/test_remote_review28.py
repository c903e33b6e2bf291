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

from kvcm_core import KVCacheManager, KVCacheManagerConfig
from kvcm_core.errors import ArgumentTypeError, InvalidArgumentError, TierIOError

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


# -- the sentinel's expiry ------------------------------------------------------------------


def _sentinels(url: str) -> list[tuple[bytes, int]]:
    adm = redis.Redis.from_url(url)
    return [(k, adm.pttl(k)) for k in adm.keys("kvcm:*:alive:*")]


def test_the_sentinel_is_never_in_the_store_without_an_expiry_when_a_call_fails(
        monkeypatch) -> None:
    """The sentinel was written with SET, then given its expiry by a second call: when
    that call failed, the key was left without an expiry, believed unset (so not deleted
    at shutdown): a dead manager's key that never expires."""
    with fresh_server() as server:
        m = KVCacheManager(config(server.url))
        try:
            writers = m.remote._writers
            renew = writers.renew_many
            calls: list[int] = []

            def flaky_renew(keys, *, ttl_s, deadline):
                calls.append(len(keys))
                if len(calls) == 1:
                    raise TierIOError("redis: renew of 1 keys ran past its deadline")
                return renew(keys, ttl_s=ttl_s, deadline=deadline)

            monkeypatch.setattr(writers, "renew_many", flaky_renew)
            serve(m, _prompt(1))
            m.flush_remote(10.0)
            (key, ttl), = _sentinels(server.url)
            assert 0 < ttl <= 600_000, (key, ttl)
        finally:
            m.shutdown()
        assert _sentinels(server.url) == []


def test_a_sentinel_write_that_ran_past_its_deadline_is_deleted_at_shutdown() -> None:
    """The write of the sentinel times out on a paused server, which applies it when it
    resumes: the level does not know it set, and deletes it at shutdown all the same."""
    with fresh_server() as server:
        cfg = config(server.url, write_deadline_s=0.2, io_deadline_s=0.05, retry_after_s=0.0)
        with KVCacheManager(cfg) as m:
            os.kill(_pid(server), signal.SIGSTOP)
            try:
                serve(m, _prompt(1))  # the first batch: the sentinel's write runs late
                time.sleep(0.5)
            finally:
                os.kill(_pid(server), signal.SIGCONT)
            assert m.flush_remote(10.0)
            st = m.get_remote_statistics()
            assert st.write_failures == 10 and st.written == 0, st
            time.sleep(0.2)
            assert [ttl > 0 for _, ttl in _sentinels(server.url)] == [True]  # it landed
        assert _sentinels(server.url) == []


# -- one restart, counted once ------------------------------------------------------------


def _served_then_evicted_locally(url: str) -> KVCacheManager:
    """A manager with the GPU as its only local level (32 pages) that served prompt 1 and
    six others (prompt 1's pages evicted locally, every block on the server), its lookups
    asking for 2 blocks at a time."""
    d = config(url, local=("gpu",), max_blocks=2, retry_after_s=0.1).to_dict()
    d["levels"][0]["quota"] = 32 * 512
    m = KVCacheManager(KVCacheManagerConfig.from_dict(d))
    serve(m, _prompt(1))
    for s in range(6):
        serve(m, _prompt(20 + s), rid=s)
    assert m.flush_remote(10.0)
    return m


@pytest.mark.parametrize("call", ["probe", "lookup"])
def test_an_empty_restart_found_by_a_lookup_counts_as_a_restart_not_also_as_a_loss(
        call: str) -> None:
    """docs/remote.md: own_keys_lost is a loss *without* a restart. The lookup that first
    reached the restarted, empty server counted store_restarts, then, missing own keys,
    own_keys_lost as well."""
    with fresh_server() as server:
        with _served_then_evicted_locally(server.url) as m:
            server.restart()  # empty
            if call == "probe":
                m.probe_reuse(None, _prompt(1)[:-1], remote=True)
            else:
                m.create_kv_cache(None, _prompt(1)[:-1]).close()
            assert m.flush_remote(10.0)
            st = m.get_remote_statistics()
            assert (st.store_restarts, st.own_keys_lost) == (1, 0), st
            assert st.own_keys == 0 and st.misses > 0, st


def test_an_empty_restart_found_by_the_writer_counts_as_a_restart_not_also_as_a_loss(
        ) -> None:
    """A commit that needs no lookup reaches the restarted server first: the renewal found
    the sentinel gone (own_keys_lost), then the put saw the new run_id (store_restarts)
    and marked the sentinel just written again as unset."""
    with fresh_server() as server:
        with KVCacheManager(config(server.url, retry_after_s=0.1)) as m:
            p = _prompt(1, 4)
            serve(m, p, answer=1)
            assert m.flush_remote(10.0)
            server.restart()  # empty
            time.sleep(0.6)  # past the gap between two renewals of a busy writer
            lookups = m.get_remote_statistics().lookups
            serve(m, p, rid="decode", answer=2 * TPB + 3)  # local: no lookup; commits
            assert m.flush_remote(10.0)
            st = m.get_remote_statistics()
            assert st.lookups == lookups, st
            assert (st.store_restarts, st.own_keys_lost) == (1, 0), st
            assert len(_sentinels(server.url)) == 1


def test_a_flushall_is_still_counted_as_a_loss_once() -> None:
    with fresh_server() as server:
        with _served_then_evicted_locally(server.url) as m:
            redis.Redis.from_url(server.url).flushall()
            m.probe_reuse(None, _prompt(1)[:-1], remote=True)
            assert m.flush_remote(10.0)
            time.sleep(0.2)  # past retry_after_s: a second miss checks the sentinel again
            m.probe_reuse(None, _prompt(1)[:-1], remote=True)
            st = m.get_remote_statistics()
            assert (st.store_restarts, st.own_keys_lost) == (0, 1), st


# -- the sentinel check of a lookup --------------------------------------------------------


def _evicted_but_sentinel(url: str) -> None:
    """Every block key deleted (as Redis's eviction would), the sentinel kept."""
    adm = redis.Redis.from_url(url)
    for k in adm.keys("kvcm:*"):
        if b":alive:" not in k:
            adm.delete(k)


def test_the_sentinel_check_of_a_lookup_has_its_own_deadline_and_keeps_the_connection(
        monkeypatch) -> None:
    """The check of the sentinel after a miss of an own key got what was left of the
    lookup's deadline: with the lookup's answer arriving just in time (a slow link), the
    check ran past its deadline, the tier closed the healthy reader connection, and the
    check, not concluded, was made again by the next lookup: every lookup reconnected."""
    import kvcm_tier_redis

    opened: list[int] = []
    init = kvcm_tier_redis._Plain.__init__

    def counting_init(self, *a, **k):
        opened.append(1)
        init(self, *a, **k)

    monkeypatch.setattr(kvcm_tier_redis._Plain, "__init__", counting_init)
    with fresh_server() as server:
        d = config(server.url, local=("gpu",), max_blocks=2, io_deadline_s=0.5,
                   retry_after_s=30.0).to_dict()
        d["levels"][0]["quota"] = 32 * 512
        with KVCacheManager(KVCacheManagerConfig.from_dict(d)) as m:
            for s in range(8):
                serve(m, _prompt(s), rid=s)  # the first prompts evicted locally
            assert m.flush_remote(10.0)
            tier = m.remote.tier
            get, exists = tier.get_many, tier.exists_many
            checks: list[int] = []

            def slow_link(keys, *, deadline):  # the answer arrives just in time
                out = get(keys, deadline=deadline + 5.0)  # (a loaded machine is slow)
                while time.monotonic() < deadline - 2e-5:
                    pass
                return out

            def counted_exists(keys, *, deadline):
                checks.append(len(keys))
                return exists(keys, deadline=deadline)

            monkeypatch.setattr(tier, "get_many", slow_link)
            monkeypatch.setattr(tier, "exists_many", counted_exists)
            _evicted_but_sentinel(server.url)
            timeouts, connections = tier.timeouts, len(opened)
            for s in range(4):  # within one retry_after_s
                m.create_kv_cache(None, _prompt(s)[:-1]).close()
            st = m.get_remote_statistics()
            assert (tier.timeouts - timeouts, len(opened) - connections) == (0, 0), st
            assert checks == [1], checks  # once per retry_after_s: the sentinel is there
            assert st.read_failures == 0 and st.own_keys_lost == 0 and st.misses >= 8, st


def test_a_sentinel_check_that_fails_is_not_made_again_within_retry_after_s(
        monkeypatch) -> None:
    """A failed check reset the rate limit: every next lookup that missed an own key
    checked (and, on a slow store, failed) again."""
    with fresh_server() as server:
        d = config(server.url, local=("gpu",), max_blocks=2, retry_after_s=30.0).to_dict()
        d["levels"][0]["quota"] = 32 * 512
        with KVCacheManager(KVCacheManagerConfig.from_dict(d)) as m:
            for s in range(8):
                serve(m, _prompt(s), rid=s)
            assert m.flush_remote(10.0)
            checks: list[int] = []

            def failing_exists(keys, *, deadline):
                checks.append(len(keys))
                raise TierIOError("redis: exists of 1 keys ran past its deadline")

            monkeypatch.setattr(m.remote.tier, "exists_many", failing_exists)
            _evicted_but_sentinel(server.url)
            for s in range(4):
                m.create_kv_cache(None, _prompt(s)[:-1]).close()
            st = m.get_remote_statistics()
            assert checks == [1], (checks, st)
            assert st.own_keys_lost == 0 and st.read_failures == 1, st


def test_a_redis_call_out_of_time_before_it_is_sent_keeps_the_healthy_connection() -> None:
    from kvcm_tier_redis import RedisTier

    with fresh_server() as server:
        tier = RedisTier(None, {"url": server.url})
        try:
            assert tier.put_many([b"k"], [b"v"], deadline=time.monotonic() + 5.0).all()
            conn = tier._plain
            assert conn is not None
            with pytest.raises(TierIOError, match="deadline"):
                tier.get_many([b"k"], deadline=time.monotonic() - 0.001)
            assert tier._plain is conn and tier.timeouts == 1
            assert tier.get_many([b"k"], deadline=time.monotonic() + 5.0) == [b"v"]
            assert tier._plain is conn
        finally:
            tier.close()


# -- a redis tier closed, or a call given up, during a connection's hand-shake --------------


def _clients(adm) -> int:
    return int(adm.info("clients")["connected_clients"])


def test_a_redis_tier_closed_during_a_hand_shake_keeps_no_connection_and_makes_no_call(
        ) -> None:
    """The server paused (its kernel still accepts connections), a put gives up during
    the connection's hand-shake, and the tier is closed: when the server answered, the I/O
    thread stored the new connection on the closed tier and sent the abandoned SET."""
    from kvcm_tier_redis import RedisTier

    with fresh_server() as server:
        adm = redis.Redis.from_url(server.url)
        before = _clients(adm)
        tier = RedisTier(None, {"url": server.url, "connect_timeout_s": 3.0})
        os.kill(_pid(server), signal.SIGSTOP)
        try:
            with pytest.raises(TierIOError, match="deadline"):
                tier.put_many([b"late"], [b"value"], deadline=time.monotonic() + 0.2)
            tier.close()
            time.sleep(0.3)
        finally:
            os.kill(_pid(server), signal.SIGCONT)
        time.sleep(1.0)
        assert tier._plain is None
        assert adm.get(b"kvcm:late") is None, "the abandoned SET ran after close()"
        assert _clients(adm) == before


def test_a_redis_call_given_up_during_a_hand_shake_is_not_made_later() -> None:
    """The caller was told its put failed (deadline): the SET must not run once the
    paused server answers the hand-shake, and the tier serves the next call."""
    from kvcm_tier_redis import RedisTier

    with fresh_server() as server:
        adm = redis.Redis.from_url(server.url)
        tier = RedisTier(None, {"url": server.url, "connect_timeout_s": 3.0})
        try:
            os.kill(_pid(server), signal.SIGSTOP)
            try:
                with pytest.raises(TierIOError, match="deadline"):
                    tier.put_many([b"late"], [b"value"], deadline=time.monotonic() + 0.2)
                time.sleep(0.3)
            finally:
                os.kill(_pid(server), signal.SIGCONT)
            time.sleep(1.0)
            assert adm.get(b"kvcm:late") is None, "a SET its caller gave up on ran later"
            assert tier.put_many([b"next"], [b"v"], deadline=time.monotonic() + 5.0).all()
            assert adm.get(b"kvcm:next") == b"v"
        finally:
            tier.close()


def test_a_hand_shake_a_caller_gave_up_on_is_finished_and_serves_the_next_call() -> None:
    """On a link where the hand-shake alone takes longer than a call's deadline, each call
    that gave up shut the hand-shake down: no call ever found a connection made. Only
    close() may shut a hand-shake down."""
    from kvcm_tier_redis import RedisTier

    with fresh_server() as server:
        tier = RedisTier(None, {"url": server.url, "connect_timeout_s": 3.0})
        opening = tier._opening_socket

        def slow(sock) -> None:  # a slow link: the hand-shake takes 0.3 s
            opening(sock)
            time.sleep(0.3)

        tier._opening_socket = slow  # type: ignore[method-assign]
        try:
            with pytest.raises(TierIOError, match="deadline"):
                tier.get_many([b"k"], deadline=time.monotonic() + 0.1)
            time.sleep(0.6)  # the hand-shake ends
            assert tier._plain is not None
            assert tier.get_many([b"k"], deadline=time.monotonic() + 0.1) == [None]
        finally:
            tier.close()


# -- a write batch applied after its deadline -------------------------------------------------


def _block_bytes(url: str) -> int:
    adm = redis.Redis.from_url(url)
    return sum(adm.strlen(k) for k in adm.keys("kvcm:*") if b":alive:" not in k)


def test_a_write_batch_applied_after_its_deadline_stays_under_the_own_key_quota() -> None:
    """A batch that ran past write_deadline_s on a paused server was counted as failed
    and its keys not as own, but the server applied it when it resumed: those keys stayed
    in the store outside the quota, which never deleted them."""
    with fresh_server() as server:
        quota = 4 * 700  # 4 pages (2 layers x 256 B, framed)
        cfg = config(server.url, quota=quota, write_deadline_s=0.2, retry_after_s=0.0,
                     io_deadline_s=0.05)
        with KVCacheManager(cfg) as m:
            serve(m, _prompt(1))
            assert m.flush_remote(10.0)
            os.kill(_pid(server), signal.SIGSTOP)
            try:
                serve(m, _prompt(2))  # its batches go out and run past their deadline
                assert m.flush_remote(10.0)
                time.sleep(0.3)
            finally:
                os.kill(_pid(server), signal.SIGCONT)
            time.sleep(0.3)  # the server applies what it received
            failed = m.get_remote_statistics().write_failures
            assert failed > 0
            for s in range(3, 8):  # more writes: the quota deletes what it counts
                serve(m, _prompt(s), rid=s)
                assert m.flush_remote(10.0)
            st = m.get_remote_statistics()
            stored = _block_bytes(server.url)
            assert stored <= quota, (stored, st)
            assert st.own_bytes <= quota and st.own_bytes >= stored, (stored, st)


@pytest.mark.parametrize("how", ["hand-shake", "refused"])
def test_a_failed_write_batch_unsent_or_refused_is_not_counted_as_own(how) -> None:
    """A batch that never reached the store (its connection's hand-shake ran past the
    deadline) or that the server refused whole (-NOREPLICAS to every SET) was counted as
    own ("maybe stored"), first to go: the quota then deleted the same keys written by
    another manager, which this one never wrote."""
    with fresh_server() as server:
        adm = redis.Redis.from_url(server.url)

        def blocks() -> set[bytes]:
            return {k for k in adm.keys("kvcm:*") if b":alive:" not in k}

        cfg = config(server.url, quota=14 * 700, write_deadline_s=0.2, retry_after_s=0.0,
                     io_deadline_s=0.05)
        with KVCacheManager(cfg) as a, KVCacheManager(config(server.url)) as b:
            serve(a, _prompt(1))
            assert a.flush_remote(10.0)
            if how == "hand-shake":
                os.kill(_pid(server), signal.SIGSTOP)
                a.remote._writers._drop_plain()  # (an idle timeout): a new connection
                try:
                    serve(a, _prompt(2, 4), rid=2)
                    assert a.flush_remote(10.0)
                finally:
                    os.kill(_pid(server), signal.SIGCONT)
            else:
                adm.config_set("min-replicas-to-write", 1)
                serve(a, _prompt(2, 4), rid=2)
                assert a.flush_remote(10.0)
                adm.config_set("min-replicas-to-write", 0)
            time.sleep(0.3)
            assert a.get_remote_statistics().write_failures > 0
            before = blocks()
            serve(b, _prompt(2, 4), rid="b")  # b writes the same blocks
            assert b.flush_remote(10.0)
            theirs = blocks() - before
            assert len(theirs) == 4
            serve(a, _prompt(3), rid=3)  # a's quota deletes its own keys
            assert a.flush_remote(10.0)
            assert a.get_remote_statistics().deleted > 0
            assert theirs <= blocks(), "a's quota deleted keys only b wrote"


def test_where_pexpire_is_refused_the_sentinel_written_with_an_expiry_keeps_none() -> None:
    """The sentinel is written with its expiry (SET ... PX) before the level knows that
    the server refuses PEXPIRE; renewals then cannot push the expiry back, so the key
    must keep none (docs/remote.md), or it expires under a live manager (a false loss)."""
    with fresh_server() as server:
        adm = redis.Redis.from_url(server.url)
        adm.execute_command("ACL", "SETUSER", "kv", "on", ">pw", "~*", "+@all", "-pexpire")
        url = f"redis://kv:pw@127.0.0.1:{server.port}/0"
        with KVCacheManager(config(url)) as m:
            serve(m, _prompt(1))
            assert m.flush_remote(10.0)
            time.sleep(0.6)  # past the gap between two renewals of a busy writer
            serve(m, _prompt(2), rid=2)  # its batch renews the sentinel: PEXPIRE refused
            assert m.flush_remote(10.0)
            assert [ttl for _, ttl in _sentinels(server.url)] == [-1]
            st = m.get_remote_statistics()
            assert st.write_failures == 0 and st.own_keys_lost == 0, st


def test_where_pexpire_and_persist_are_refused_the_live_sentinel_never_expires(
        monkeypatch) -> None:
    """The sentinel, written with SET ... PX before the refusal of PEXPIRE was known, kept
    its expiry where PERSIST was refused too (an allow-list ACL), or the one PERSIST call
    failed: it expired under the live manager, which took that for a flush."""
    import kvcm_core.remote as remote

    monkeypatch.setattr(remote, "_SENTINEL_TTL_S", 2.0)
    with fresh_server() as server:
        adm = redis.Redis.from_url(server.url)
        adm.execute_command("ACL", "SETUSER", "kv", "on", ">pw", "~*", "+@all", "-pexpire",
                            "-persist")
        url = f"redis://kv:pw@127.0.0.1:{server.port}/0"
        with KVCacheManager(config(url, retry_after_s=0.0)) as m:
            serve(m, _prompt(1))
            assert m.flush_remote(10.0)
            time.sleep(0.6)  # past the gap between two renewals of a busy writer
            serve(m, _prompt(2), rid=2)  # its batch renews the sentinel: PEXPIRE refused
            assert m.flush_remote(10.0)
            assert [ttl for _, ttl in _sentinels(server.url)] == [-1]
            time.sleep(2.5)  # past the expiry it was written with
            serve(m, _prompt(3), rid=3)
            assert m.flush_remote(10.0)
            assert len(_sentinels(server.url)) == 1
            st = m.get_remote_statistics()
            assert st.own_keys_lost == 0 and st.write_failures == 0, st


@pytest.mark.parametrize("ttl", [math.inf, 1e300, 10 ** 400, math.nan, 0.0],
                         ids=["inf", "1e300", "huge-int", "nan", "zero"])
def test_a_redis_put_expiring_or_renewal_refuses_a_non_finite_or_huge_ttl_with_a_typed_error(
        ttl) -> None:
    """``ttl_s=inf`` raised a raw OverflowError, and 1e300 reached the server as PX 10^303,
    whose error reply failed the call and dropped the healthy connection."""
    from kvcm_tier_redis import RedisTier

    with fresh_server() as server:
        tier = RedisTier(None, {"url": server.url})
        try:
            assert tier.put_many([b"k"], [b"v"], deadline=time.monotonic() + 5.0).all()
            conn = tier._plain
            for call in (lambda: tier.put_expiring_many([b"k"], [b"v"], ttl_s=ttl,
                                                        deadline=time.monotonic() + 5.0),
                         lambda: tier.renew_many([b"k"], ttl_s=ttl,
                                                 deadline=time.monotonic() + 5.0)):
                with pytest.raises(InvalidArgumentError, match=r"^ttl_s="):
                    call()
            assert tier._plain is conn and tier.errors == 0
        finally:
            tier.close()
