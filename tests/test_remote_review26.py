"""The shared remote level's rules found broken by review 26 (each test failed on the code
as reviewed): whose KV a page is (model and shard), repairs of damaged own keys, store
refusals that must not disable the level, deadlines, back-off, the sentinel under LRU
eviction, the own-key count and the write queue's byte bound."""

from __future__ import annotations

import time

import pytest
from redis_fixtures import fresh_server, need_binaries
from remote_helpers import TPB, config, serve

from kvcm_core import KVCacheManager
from kvcm_core.errors import ConfigError, TierIOError

redis = pytest.importorskip("redis", reason="the redis client package is not installed")


def _prompt(seed: int, blocks: int = 10) -> list[int]:
    return [seed * 100_000 + i for i in range(blocks * TPB)]


def _fail_call(monkeypatch, tier, name: str, nth: int, message: str) -> list[int]:
    """``tier.name(keys, deadline=...)`` raises ``TierIOError(message)`` on its ``nth``
    call; returns the list of each call's key count."""
    real = getattr(tier, name)
    calls: list[int] = []

    def call(keys, *, deadline):
        calls.append(len(keys))
        if len(calls) == nth:
            raise TierIOError(message)
        return real(keys, deadline=deadline)

    monkeypatch.setattr(tier, name, call)
    return calls


def _block_keys(url: str) -> list[bytes]:
    return sorted(k for k in redis.Redis.from_url(url).keys("kvcm:*") if b":alive:" not in k)


# -- whose KV a page is: model and shard ----------------------------------------------------


@pytest.mark.parametrize(("a_opts", "b_opts"), [
    ({"shard": "tp0of2-pp0of1"}, {"shard": "tp1of2-pp0of1"}),
    ({"model": "base@r1"}, {"model": "base-finetune@r1"}),
    ({"model": "m:kv-int8"}, {"model": "m:kv-fp8"}),
], ids=["tp-ranks", "fine-tune", "kv-dtype"])
def test_managers_of_one_geometry_but_another_model_or_shard_never_read_each_others_pages(
        a_opts, b_opts) -> None:
    """Geometry cannot tell tensor-parallel rank 0 from rank 1, nor a base model from its
    fine-tune: the required model and shard options go into the layout fingerprint."""
    with fresh_server() as server:
        with KVCacheManager(config(server.url, **a_opts)) as a, \
                KVCacheManager(config(server.url, **b_opts)) as b:
            serve(a, _prompt(1))
            assert a.flush_remote(10.0)
            assert a.remote.fingerprint != b.remote.fingerprint
            assert serve(b, _prompt(1)) == 0
            assert b.get_remote_statistics().hits == 0


def test_managers_of_the_same_model_and_shard_share_pages() -> None:
    with fresh_server() as server:
        cfg = config(server.url, model="m@r1", shard="tp1of2-pp0of1")
        with KVCacheManager(cfg) as a, KVCacheManager(cfg) as b:
            serve(a, _prompt(1))
            assert a.flush_remote(10.0)
            assert a.remote.fingerprint == b.remote.fingerprint
            assert serve(b, _prompt(1)) == 9 * TPB


@pytest.mark.parametrize("name", ["model", "shard"])
@pytest.mark.parametrize("value", [None, "", "  ", 3])
def test_a_remote_level_without_a_model_or_shard_is_refused_naming_the_option(
        name, value) -> None:
    need_binaries()
    with pytest.raises(ConfigError) as info:
        KVCacheManager(config("redis://127.0.0.1:1/0", **{name: value}))
    assert info.value.field == f"levels[2].options.{name}"
    assert "required" in str(info.value)
    assert "would be served as this one's" in str(info.value)



# -- a damaged value under an own key ---------------------------------------------------------


@pytest.mark.parametrize("how", ["corrupt", "truncated", "foreign"])
def test_a_damaged_value_under_an_own_key_is_written_again_when_the_block_is_recomputed(
        how: str) -> None:
    """A damaged or foreign value is a miss: the block is recomputed, and so written again
    (over the damaged value), as after a plain miss, not skipped as 'known stored'."""
    with fresh_server() as server:
        adm = redis.Redis.from_url(server.url)
        cfg = config(server.url, local=("gpu",), size=16384)  # 32 pages fit locally
        prompt = _prompt(1)
        with KVCacheManager(cfg) as a:
            serve(a, prompt)
            assert a.flush_remote(10.0)
            keys = _block_keys(server.url)
            other = adm.get(keys[0])
            for k in keys:
                v = adm.get(k)
                adm.set(k, {"corrupt": v[:80] + bytes([v[80] ^ 1]) + v[81:],
                            "truncated": v[:-100],
                            "foreign": other if k != keys[0] else adm.get(keys[1])}[how])
            for s in range(2, 6):  # push the prompt out of the GPU level
                serve(a, _prompt(s), rid=s)
            assert serve(a, prompt, rid="again") == 0  # damaged: recomputed
            assert a.flush_remote(10.0)
            for s in range(6, 10):
                serve(a, _prompt(s), rid=s)
            assert serve(a, prompt, rid="third") == 9 * TPB, a.get_remote_statistics()


# -- what an ACL or a renamed command refuses ----------------------------------------------


def test_a_user_whose_acl_refuses_info_can_still_use_the_level() -> None:
    """INFO only tells restarts apart: refused, the connection is used all the same."""
    with fresh_server() as server:
        adm = redis.Redis.from_url(server.url)
        adm.execute_command("ACL", "SETUSER", "kv", "on", ">pw", "~*", "+@all", "-info")
        url = f"redis://kv:pw@127.0.0.1:{server.port}/0"
        with KVCacheManager(config(url)) as a, KVCacheManager(config(url)) as b:
            serve(a, _prompt(1))
            assert a.flush_remote(10.0)
            assert a.get_remote_statistics().written == 10, a.get_remote_statistics()
            assert serve(b, _prompt(1)) == 9 * TPB
            assert a.remote.tier.store_instances() == {}


def test_a_user_whose_acl_refuses_unlink_still_deletes_past_the_quota() -> None:
    with fresh_server() as server:
        adm = redis.Redis.from_url(server.url)
        adm.execute_command("ACL", "SETUSER", "kv", "on", ">pw", "~*", "+@all", "-unlink")
        url = f"redis://kv:pw@127.0.0.1:{server.port}/0"
        page = 2 * 256 + 72
        with KVCacheManager(config(url, quota=12 * page)) as m:
            for s in range(2, 5):
                serve(m, _prompt(s), rid=s)
                assert m.flush_remote(10.0)
            st = m.get_remote_statistics()
            assert st.deleted == 18 and st.own_keys == 12, st
            assert len(_block_keys(server.url)) == 12


def test_a_user_whose_acl_refuses_pexpire_still_writes_and_reads_the_level() -> None:
    """The sentinel is renewed with PEXPIRE before write batches: a store that refuses the
    command (an ACL, rename-command) keeps the sentinel without expiry, and every write
    still lands (before, each batch failed)."""
    with fresh_server() as server:
        adm = redis.Redis.from_url(server.url)
        adm.execute_command("ACL", "SETUSER", "kv", "on", ">pw", "~*", "+@all", "-pexpire")
        url = f"redis://kv:pw@127.0.0.1:{server.port}/0"
        with KVCacheManager(config(url)) as m:
            for s in range(2, 5):
                serve(m, _prompt(s), rid=s)
                assert m.flush_remote(10.0)
            st = m.get_remote_statistics()
            assert st.write_failures == 0 and st.written > 0, st
            assert len(_block_keys(server.url)) == st.written
        with KVCacheManager(config(url)) as other:  # and another manager reads them
            assert serve(other, _prompt(2), rid=9) > 0


# -- deadlines -------------------------------------------------------------------------------


@pytest.mark.parametrize(("option", "value"), [
    ("io_deadline_s", float("inf")), ("io_deadline_s", 1e300), ("io_deadline_s", float("nan")),
    ("write_deadline_s", float("inf")), ("retry_after_s", float("inf")),
    ("retry_after_s", 1e300)])
def test_an_infinite_or_huge_deadline_is_refused_as_a_config_error(option, value) -> None:
    """No thread can wait past threading.TIMEOUT_MAX: such a deadline raised a raw
    OverflowError from the first lookup, or failed every write and the shutdown."""
    with fresh_server() as server:
        with pytest.raises(ConfigError) as info:
            m = KVCacheManager(config(server.url, **{option: value}))
            try:  # what happened instead: OverflowError from the first call that waits
                serve(m, _prompt(1))
                m.flush_remote(5.0)
            finally:
                m.shutdown()
        assert info.value.field == f"levels[2].options.{option}"
        assert value != value or "TIMEOUT_MAX" in str(info.value)  # nan: not > 0


def test_a_writer_failure_of_any_kind_leaves_the_batch_to_be_written_again(
        monkeypatch) -> None:
    """A batch the writer could not write (whatever failed) is not believed stored: the
    block computed again is written again."""
    with fresh_server() as server:
        cfg = config(server.url, local=("gpu",), size=16384)
        with KVCacheManager(cfg) as a:
            real = a.remote._writers.put_many
            failing = [True]

            def broken(keys, values, *, deadline):
                if failing[0]:
                    raise RuntimeError("a bug in a tier (injected)")
                return real(keys, values, deadline=deadline)

            monkeypatch.setattr(a.remote._writers, "put_many", broken)
            serve(a, _prompt(1))
            assert a.flush_remote(10.0)
            assert _block_keys(server.url) == []
            assert a.get_remote_statistics().write_failures == 10
            failing[0] = False
            for s in range(2, 6):  # push the prompt out of the GPU level
                serve(a, _prompt(s), rid=s)
            assert serve(a, _prompt(1), rid="again") == 0
            assert a.flush_remote(10.0)
            assert len(_block_keys(server.url)) == 50


# -- skipping after a failure ----------------------------------------------------------------


def test_flush_remote_returns_when_the_store_is_down_with_retry_after_zero() -> None:
    """An own-key check that cannot reach the store is retried no sooner than 50 ms later
    (the writer spun on a dead store), and flush_remote waits for one attempt of it."""
    with fresh_server() as server:
        cfg = config(server.url, local=("gpu",), retry_after_s=0, io_deadline_s=0.5)
        with KVCacheManager(cfg) as a:
            serve(a, _prompt(1))
            assert a.flush_remote(10.0)
            server.restart()  # empty: the next call sees a new run_id: an own-key check
            a.probe_reuse(None, [7] * 40, remote=True)
            server.kill()
            errors = a.remote._writers.errors
            assert a.flush_remote(3.0), "flush_remote never returned while the store was down"
            assert a.remote._writers.errors - errors < 20, "the writer spun on a dead store"


def test_a_store_that_refuses_writes_but_serves_reads_is_still_read() -> None:
    with fresh_server() as server:
        adm = redis.Redis.from_url(server.url)
        with KVCacheManager(config(server.url)) as a:
            for s in range(4):
                serve(a, _prompt(s), rid=s)
            assert a.flush_remote(10.0)
        adm.config_set("min-replicas-to-write", 1)  # SET: -NOREPLICAS; GET served
        with KVCacheManager(config(server.url)) as b:
            reused = []
            for s in range(4):
                reused.append(serve(b, _prompt(s) + [9] * (2 * TPB), rid=s))
                b.flush_remote(5.0)
            st = b.get_remote_statistics()
            assert all(r >= 9 * TPB for r in reused), (reused, st)
            assert st.skipped == 0 and st.write_failures > 0, st


# -- the sentinel ------------------------------------------------------------------------------


def _sentinels(url: str) -> list[bytes]:
    return [k for k in redis.Redis.from_url(url).keys("kvcm:*") if b":alive:" in k]


def test_the_sentinel_survives_ordinary_lru_eviction() -> None:
    """Redis evicting under maxmemory is an ordinary loss: the sentinel, renewed with
    every write batch (a use for allkeys-lru), is not among the keys evicted first, so a
    miss of an evicted own key is not taken for a flushed store. (Redis's LRU clock counts
    seconds: the writes are spread over a few, as a store's turnover is in service.)"""
    with fresh_server(maxmemory=4 << 20) as server:
        cfg = config(server.url, size=16384, retry_after_s=0.0)
        with KVCacheManager(cfg) as a:
            for s in range(24):  # 240 pages of 32 KiB into a 4 MiB store, 4 prompts a second
                if s and not s % 4:
                    time.sleep(1.1)
                serve(a, _prompt(s), rid=s)
                assert a.flush_remote(30.0)
            assert redis.Redis.from_url(server.url).info("stats")["evicted_keys"] > 0
            assert _sentinels(server.url), "sentinel evicted"
            for s in range(5):
                a.probe_reuse(None, _prompt(s) + _prompt(900 + s, 2), remote=True)
            st = a.get_remote_statistics()
            assert st.misses > 0 and st.own_keys_lost == 0, st


def test_the_sentinel_expires_unless_renewed_so_a_dead_manager_leaves_none_for_good(
        ) -> None:
    with fresh_server() as server:
        adm = redis.Redis.from_url(server.url)
        with KVCacheManager(config(server.url)) as a:
            serve(a, _prompt(1))
            assert a.flush_remote(10.0)
            (key,) = _sentinels(server.url)
            ttl = adm.pttl(key)
            assert 0 < ttl <= 600_000, ttl
            adm.pexpire(key, 100_000)
            time.sleep(0.6)  # the sentinel is renewed at most twice a second
            serve(a, _prompt(2), rid=2)  # a write batch renews it
            assert a.flush_remote(10.0)
            assert adm.pttl(key) > 100_000
            assert a.get_remote_statistics().own_keys_lost == 0


def test_a_flush_is_seen_by_the_next_write_batch_through_the_sentinel() -> None:
    with fresh_server() as server:
        adm = redis.Redis.from_url(server.url)
        with KVCacheManager(config(server.url)) as a:
            serve(a, _prompt(1))
            assert a.flush_remote(10.0)
            adm.flushall()
            time.sleep(0.6)  # the sentinel is renewed at most twice a second
            serve(a, _prompt(2), rid=2)
            assert a.flush_remote(10.0)
            st = a.get_remote_statistics()
            assert st.own_keys_lost == 1 and st.own_keys == 10, st
            assert len(_sentinels(server.url)) == 1


@pytest.mark.parametrize("cluster", [False, True], ids=["standalone", "cluster"])
def test_the_redis_tier_renews_keys_that_exist_and_reports_those_that_do_not(
        cluster: bool) -> None:
    from kvcm_tier_redis import RedisTier
    from redis_fixtures import session_cluster

    ctx = session_cluster() if cluster else fresh_server()
    url = ctx.url
    tier = RedisTier(None, {"url": url, "cluster": cluster,
                            "namespace": f"renew{time.monotonic_ns()}"})
    try:
        keys = [b"a{x}", b"b{x}"]
        tier.put_many(keys[:1], [b"v"], deadline=time.monotonic() + 5)
        assert tier.renew_many(keys, ttl_s=30.0,
                               deadline=time.monotonic() + 5).tolist() == [True, False]
        assert tier.renew_many([], ttl_s=1.0, deadline=time.monotonic() + 5).tolist() == []
        with pytest.raises(ValueError, match="ttl_s"):
            tier.renew_many(keys, ttl_s=0, deadline=time.monotonic() + 5)
        client = (redis.RedisCluster if cluster else redis.Redis).from_url(url)
        ttl = client.pttl(tier.options.get("namespace").encode() + b":a{x}")
        assert 0 < ttl <= 30_000, ttl
        tier.renew_many(keys[:1], ttl_s=0.05, deadline=time.monotonic() + 5)
        time.sleep(0.2)
        assert tier.get_many(keys[:1], deadline=time.monotonic() + 5) == [None]
    finally:
        tier.close()
        if not cluster:
            ctx.stop()


# -- the own-key count ---------------------------------------------------------------------------


def test_own_keys_whose_quota_delete_failed_stay_counted_and_are_deleted_later(
        monkeypatch) -> None:
    """A failed quota delete leaves the keys in the store: they stay counted as own (and
    are the first victims of the next delete), so the quota still bounds the manager's
    bytes in the store."""
    with fresh_server() as server:
        page = 2 * 256 + 72
        with KVCacheManager(config(server.url, quota=12 * page, retry_after_s=0.0)) as m:
            calls = _fail_call(monkeypatch, m.remote._writers, "delete_many", 1,
                               "redis: delete failed (injected)")
            for s in range(2, 6):
                serve(m, _prompt(s), rid=s)
                assert m.flush_remote(10.0)
            st = m.get_remote_statistics()
            stored = len(_block_keys(server.url))
            assert calls[0] > 0 and len(calls) > 1
            assert stored == st.own_keys == 12, (stored, st)
            assert st.own_bytes == 12 * page


# -- the fingerprint engine and a lossy shared level -------------------------------------------


def _typed_config(url: str, **level: object):
    """Two layers of bf16 k and v pages (a lossy codec encodes them) and an exact scale."""
    from remote_helpers import BACKEND

    from kvcm_core import KVCacheManagerConfig

    page = 32 * TPB
    layers = [{"layer_id": i, "buffers": [
        {"role": "k", "size": page, "dtype": "bf16", "group_size": 32},
        {"role": "v", "size": page, "dtype": "bf16", "group_size": 32},
        {"role": "scale", "size": page, "dtype": "bf16", "exact": True}]} for i in range(2)]
    return KVCacheManagerConfig.from_dict({
        "tokens_per_block": TPB, "layers": layers, "kernel_backend": BACKEND,
        "levels": [{"tier": "gpu", "quota": "1MiB"}, {"tier": "host", "quota": "1MiB"},
                   {"tier": "redis", "quota": "64MiB", **level,
                    "options": {"url": url, "model": "typed", "shard": "0",
                                "io_deadline_s": 5.0}}]})


def test_the_fingerprint_engine_allows_for_a_lossy_codec_on_the_shared_level_only() -> None:
    with fresh_server() as server:
        cfg = _typed_config(server.url, codec="fp8")
        with KVCacheManager(cfg) as a, KVCacheManager(cfg) as b:
            serve(a, _prompt(1))
            assert a.flush_remote(10.0)
            assert serve(b, _prompt(1)) == 9 * TPB  # checked within fp8's error bound


# -- the write queue's byte bound ------------------------------------------------------------------


def test_the_write_queue_is_bounded_in_bytes_too_and_drops_what_is_past_it() -> None:
    """write_queue_blocks alone let the queue hold 4096 pages of any size (8 GiB of 2 MiB
    pages): write_queue_bytes bounds their bytes."""
    import os
    import signal

    with fresh_server() as server:
        cold = 2 * 256  # a page of this configuration's cache group, before its frame
        cfg = config(server.url, write_queue_bytes=4 * cold, write_deadline_s=2.0,
                     retry_after_s=0, io_deadline_s=0.05)
        with KVCacheManager(cfg) as m:
            pid = server.nodes[0].proc.pid  # type: ignore[union-attr]
            os.kill(pid, signal.SIGSTOP)  # the writer waits on its first call
            try:
                for s in range(3):
                    serve(m, _prompt(10 + s), rid=s)
            finally:
                os.kill(pid, signal.SIGCONT)
            assert m.flush_remote(10.0)
            st = m.get_remote_statistics()
            assert st.writes_queued + st.writes_dropped == 30, st
            assert 4 <= st.writes_queued <= 8, st  # one batch taken by the writer, one queued


@pytest.mark.parametrize("value", [0, -1, 1.5, True, "1GiB"])
def test_a_bad_write_queue_bytes_is_refused_naming_the_option(value) -> None:
    need_binaries()
    with pytest.raises(ConfigError) as info:
        KVCacheManager(config("redis://127.0.0.1:1/0", write_queue_bytes=value))
    assert info.value.field == "levels[2].options.write_queue_bytes"
    assert "int >= 1" in str(info.value)


# -- smaller rules --------------------------------------------------------------------------------


def test_a_redis_url_whose_database_is_no_number_is_refused_naming_the_option() -> None:
    need_binaries()
    with pytest.raises(ConfigError) as info:
        KVCacheManager(config("redis://127.0.0.1:1/notanumber"))
    assert info.value.field == "levels[2].options.url"
    assert "must be a number" in str(info.value)


@pytest.mark.parametrize(("option", "value"), [("namespace", "a b"), ("pipeline_bytes", 0),
                                               ("colour", "red")])
def test_a_redis_option_error_names_the_level_it_was_written_in(option, value) -> None:
    need_binaries()
    with pytest.raises(ConfigError) as info:
        KVCacheManager(config("redis://127.0.0.1:1/0", **{option: value}))
    assert info.value.field == f"levels[2].options.{option}"
    assert "(tier 'redis')" in str(info.value)


def test_create_kv_cache_and_probe_reuse_take_a_deque_of_tokens_like_a_list() -> None:
    import collections

    with fresh_server() as server:
        with KVCacheManager(config(server.url)) as a, KVCacheManager(config(server.url)) as b:
            serve(a, _prompt(1))
            assert a.flush_remote(10.0)
            tokens = collections.deque(_prompt(1)[:-1])
            assert b.probe_reuse(None, tokens, remote=True) == 9 * TPB
            for m in (b, a):  # pulled from the store, and local
                cache = m.create_kv_cache(None, tokens)
                reused = cache.history_length
                cache.close()
                cache = m.create_kv_cache(None, list(tokens))
                assert reused == cache.history_length >= 9 * TPB
                cache.close()
        cfg = config(server.url).to_dict()
        cfg["levels"] = cfg["levels"][:2]  # no remote level
        from kvcm_core import KVCacheManagerConfig
        with KVCacheManager(KVCacheManagerConfig.from_dict(cfg)) as m:
            m.create_kv_cache(None, collections.deque(range(40))).close()


# -- a lookup larger than one part -----------------------------------------------------------------


def test_a_lookup_cut_short_by_its_deadline_uses_the_blocks_that_arrived_and_skips_nothing(
        monkeypatch) -> None:
    """A large lookup is read in parts; a part that runs late (or fails) after the first
    arrived ends it with the blocks read so far, and lookups are not switched off: the
    store answered (one long prompt made every request skip the level)."""
    import kvcm_core.remote as remote_module

    monkeypatch.setattr(remote_module, "_LOOKUP_PART_BYTES", 3 * (2 * 256 + 72),
                        raising=False)  # 3 frames a part
    with fresh_server() as server:
        with KVCacheManager(config(server.url)) as a, KVCacheManager(config(server.url)) as b:
            serve(a, _prompt(1))
            serve(a, _prompt(2), rid=2)
            assert a.flush_remote(10.0)
            calls = _fail_call(monkeypatch, b.remote.tier, "get_many", 2,
                               "redis: get of 3 keys ran past its deadline (injected)")
            cache = b.create_kv_cache(None, _prompt(1)[:-1])
            assert cache.history_length == 3 * TPB
            cache.close()
            st = b.get_remote_statistics()
            assert calls == [3, 3] and st.read_failures == 1 and st.hits == 3, st
            cache = b.create_kv_cache(None, _prompt(2)[:-1])  # not skipped
            assert cache.history_length == 9 * TPB
            cache.close()
            assert b.get_remote_statistics().skipped == 0


@pytest.mark.parametrize("field", ["codec", "blob_codec"])
def test_a_shared_level_naming_no_installed_codec_is_a_config_error_naming_the_field(
        field) -> None:
    with fresh_server() as server:
        with pytest.raises(ConfigError) as info:
            KVCacheManager(config(server.url, level={field: "nosuch"}))
        assert info.value.field == f"levels[2].{field}" and info.value.value == "nosuch"



def test_shutdown_with_a_writer_stuck_past_its_deadlines_abandons_the_queue_and_counts_it(
        monkeypatch) -> None:
    """A store call that ignores its deadline: shutdown waits a bounded time (each queued
    batch's write and sentinel renewal), then gives the queued writes up, counted in
    ``writes_dropped``, instead of closing the connections under a writer that would
    drop them unsaid."""
    import threading

    with fresh_server() as server:
        m = KVCacheManager(config(server.url, write_deadline_s=0.2))
        release = threading.Event()
        stuck = threading.Event()

        def put_many(keys, values, *, deadline):
            stuck.set()
            release.wait(30)  # past every deadline
            return [False] * len(keys)

        monkeypatch.setattr(m.remote._writers, "put_many", put_many)
        try:
            serve(m, _prompt(2), rid=2)
            assert stuck.wait(10)  # the writer holds the first batch
            for s in range(3, 6):
                serve(m, _prompt(s), rid=s)
            dropped = m.get_remote_statistics().writes_dropped
            t0 = time.monotonic()
            m.shutdown()
            took = time.monotonic() - t0
        finally:
            release.set()
        st = m.get_remote_statistics()
        assert took < 10, took
        assert st.writes_dropped - dropped >= 3 * 9, st  # the three later prompts' blocks
