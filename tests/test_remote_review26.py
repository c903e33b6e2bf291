"""The shared remote level's rules found broken by review 26 (each test failed on the code
as reviewed): whose KV a page is (model and shard), repairs of damaged own keys, store
refusals that must not disable the level, deadlines, back-off, the sentinel under LRU
eviction, the own-key count and the write queue's byte bound."""

from __future__ import annotations

import pytest
from redis_fixtures import fresh_server, need_binaries
from remote_helpers import TPB, config, serve

from kvcm_core import KVCacheManager
from kvcm_core.errors import ConfigError

redis = pytest.importorskip("redis", reason="the redis client package is not installed")


def _prompt(seed: int, blocks: int = 10) -> list[int]:
    return [seed * 100_000 + i for i in range(blocks * TPB)]


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
