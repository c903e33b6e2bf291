"""The shared remote level (docs/remote.md) on real Redis servers started on loopback:
managers in two processes share prefixes; models and tenants never read each other's
pages; a value that is not an intact frame of the block is a miss, never KV; a paused or
killed server costs a deadline, not a stalled step or wrong KV; a manager deletes only
the keys it wrote. Every request runs through the fingerprint engine, which checks every
page it reads."""

from __future__ import annotations

import concurrent.futures as cf
import multiprocessing
import os
import signal
import time

import pytest
from redis_fixtures import fresh_server, lag_budget, need_binaries, session_cluster
from remote_helpers import TPB, config, serve, serve_in_another_process

from kvcm_core import KVCacheManager, KVCacheManagerConfig
from kvcm_core.errors import ConfigError, InvalidArgumentError, InvalidStateError
from kvcm_core.types import ReuseScope

redis = pytest.importorskip("redis", reason="the redis client package is not installed")

PROMPT = list(range(1000, 1000 + 10 * TPB))  # 10 blocks; a lookup of 159 tokens: 9 reusable
REUSABLE = 9 * TPB


def _prompt(seed: int, blocks: int = 10) -> list[int]:
    return [seed * 100_000 + i for i in range(blocks * TPB)]


def _admin(url: str):  # a redis client of the test's own
    return redis.Redis.from_url(url)


def _remote_keys(url: str) -> list[bytes]:
    return sorted(k for k in _admin(url).keys("kvcm:*") if b":alive:" not in k)  # blocks


# -- sharing -------------------------------------------------------------------------------


def _spawn_pool() -> cf.ProcessPoolExecutor:
    return cf.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))


def test_two_processes_share_prefixes_through_a_standalone_server() -> None:
    with fresh_server() as server, _spawn_pool() as pool:
        other = pool.submit(serve_in_another_process, server.url, PROMPT).result(timeout=120)
        assert other["reused"] == 0 and other["written"] == 10
        with KVCacheManager(config(server.url)) as m:
            # pages checked by the fingerprint engine
            assert serve(m, PROMPT) == REUSABLE, m.get_remote_statistics()
            assert m.get_and_reset_iteration_stats().remote_blocks == 9
            st = m.get_remote_statistics()
            assert st.pulled_blocks == 9 and st.corrupt == st.foreign == st.truncated == 0


def test_two_processes_share_prefixes_through_a_cluster() -> None:
    cluster = session_cluster()
    prompt = _prompt(77)
    with _spawn_pool() as pool:
        other = pool.submit(serve_in_another_process, cluster.url, prompt,
                            True).result(timeout=120)
    assert other["written"] == 10 and other["write_failures"] == 0
    with KVCacheManager(config(cluster.url, cluster=True)) as m:
        assert serve(m, prompt) == REUSABLE, m.get_remote_statistics()
        assert m.get_remote_statistics().pulled_blocks == 9


def test_what_one_manager_commits_the_next_reuses_in_the_same_process() -> None:
    with fresh_server() as server:
        with KVCacheManager(config(server.url)) as a, KVCacheManager(config(server.url)) as b:
            assert serve(a, PROMPT) == 0
            assert a.flush_remote(10.0)
            assert b.probe_reuse(None, PROMPT[:-1]) == 0  # local only: nothing there
            assert b.probe_reuse(None, PROMPT[:-1], remote=True) == REUSABLE, \
                b.get_remote_statistics()
            assert serve(b, PROMPT) == REUSABLE, b.get_remote_statistics()
            # Pulled pages are local now: the next lookup needs no round trip.
            lookups = b.get_remote_statistics().lookups
            # (and the partial block b's own request published at close is reused too)
            assert serve(b, PROMPT, rid="again") == len(PROMPT) - 1
            assert b.get_remote_statistics().lookups == lookups


@pytest.mark.parametrize("partial", [True, False])
def test_probe_with_remote_equals_what_create_then_reuses(partial: bool) -> None:
    import numpy as np

    rng = np.random.default_rng(11)
    with fresh_server() as server:
        cfg = config(server.url)
        if not partial:
            cfg = KVCacheManagerConfig.from_dict({**cfg.to_dict(),
                                                  "enable_partial_reuse": False})
        with KVCacheManager(cfg) as a:
            serve(a, PROMPT)
            serve(a, PROMPT[:5 * TPB] + _prompt(9, blocks=4), rid="branch")
            assert a.flush_remote(10.0)
        for trial in range(12):
            cut = int(rng.integers(0, len(PROMPT)))
            tail = rng.integers(0, 50_000, int(rng.integers(0, 3 * TPB))).tolist()
            tokens = (PROMPT if trial % 2 else PROMPT[:5 * TPB] + _prompt(9, 4))[:cut] + tail
            with KVCacheManager(cfg) as b:  # nothing local: everything comes from Redis
                probed = b.probe_reuse(None, tokens, remote=True)
                cache = b.create_kv_cache(None, tokens)
                assert cache.history_length == probed, (cut, len(tail))
                cache.close()


def test_finished_transfers_leave_nothing_behind_in_the_copy_plans() -> None:
    # Every push and pull copies through a staging store made for that transfer; the
    # copy plans kept per pair of stores must not keep those stores (and their plans)
    # alive, transfer after transfer.
    import gc

    from kvcm_core.remote import _Stage

    with fresh_server() as server, KVCacheManager(config(server.url)) as m:
        for i in range(150):
            serve(m, _prompt(1000 + i, blocks=4), answer=2, rid=i)
        assert m.flush_remote(10.0)
        gc.collect()
        alive = sum(1 for o in gc.get_objects() if type(o) is _Stage)
        assert alive <= 64, f"{alive} staging stores of finished transfers still alive"


def test_probe_without_remote_makes_no_round_trip() -> None:
    with fresh_server() as server, KVCacheManager(config(server.url)) as m:
        before = m.get_remote_statistics()
        assert m.probe_reuse(None, PROMPT) == 0
        after = m.get_remote_statistics()
        assert after.probes == before.probes and after.hits == after.misses == 0


@pytest.mark.parametrize("local", [("gpu",), ("gpu", "disk"), ("gpu", "host", "disk")])
def test_pulled_pages_land_in_the_first_local_level_below_the_gpu_or_on_it(local) -> None:
    with fresh_server() as server:
        with KVCacheManager(config(server.url, local=local)) as a, \
                KVCacheManager(config(server.url, local=local)) as b:
            serve(a, PROMPT)
            assert a.flush_remote(10.0)
            cache = b.create_kv_cache(None, PROMPT[:-1])
            try:
                assert cache.history_length == REUSABLE
                levels = b.get_and_reset_iteration_stats().reused_blocks_by_level
                assert levels[1 if len(local) > 1 else 0] == 9
                b.check_invariants()
            finally:
                cache.close()
            # verified after any onboarding
            assert serve(b, PROMPT) == REUSABLE, b.get_remote_statistics()
            b.check_invariants()


def test_a_sliding_window_model_reuses_remote_blocks_correctly() -> None:
    with fresh_server() as server:
        cfg = config(server.url, window=4 * TPB)
        with KVCacheManager(cfg) as a, KVCacheManager(cfg) as b:
            prompt = _prompt(3, blocks=12)
            serve(a, prompt)
            assert a.flush_remote(10.0)
            assert serve(b, prompt) > 0
            b.check_invariants()


def test_a_blob_codec_on_the_remote_level_round_trips() -> None:
    with fresh_server() as server:
        cfg = config(server.url, level={"blob_codec": "zstd"})
        with KVCacheManager(cfg) as a, KVCacheManager(cfg) as b:
            serve(a, PROMPT)
            assert a.flush_remote(10.0)
            assert serve(b, PROMPT) == REUSABLE, b.get_remote_statistics()


# -- isolation -----------------------------------------------------------------------------


def test_the_same_tokens_under_two_salts_never_cross() -> None:
    with fresh_server() as server:
        with KVCacheManager(config(server.url)) as a, KVCacheManager(config(server.url)) as b:
            serve(a, PROMPT, scope=ReuseScope(salt=1))
            assert a.flush_remote(10.0)
            assert b.probe_reuse(ReuseScope(salt=2), PROMPT[:-1], remote=True) == 0
            assert serve(b, PROMPT, scope=ReuseScope(salt=2)) == 0
            assert serve(b, PROMPT, rid="default", scope=None) == 0
            assert serve(b, PROMPT, rid="salt1", scope=ReuseScope(salt=1)) == REUSABLE, \
                b.get_remote_statistics()


@pytest.mark.parametrize("change", ["page size", "codec"])
def test_the_same_tokens_under_two_layouts_never_cross(change: str) -> None:
    with fresh_server() as server:
        first = config(server.url)
        second = config(server.url, size=512) if change == "page size" else \
            config(server.url, level={"codec": "fp8"})
        with KVCacheManager(first) as a, KVCacheManager(second) as b:
            serve(a, PROMPT)
            assert a.flush_remote(10.0)
            assert b.probe_reuse(None, PROMPT[:-1], remote=True) == 0
            cache = b.create_kv_cache(None, PROMPT[:-1])
            assert cache.history_length == 0
            cache.close()
            st = b.get_remote_statistics()
            assert st.hits == 0 and st.foreign == 0  # other keys: plain misses


# -- integrity -----------------------------------------------------------------------------


def _damage(url: str, how: str, foreign: bytes) -> int:
    """Damage the stored value of block 4 (keys sort by scope, group, block key: find it
    by its frame); returns how many keys were damaged."""
    admin = _admin(url)
    keys = _remote_keys(url)
    assert len(keys) == 10
    # The block key is the frame's key digest: damage whichever key, all are block pages.
    key = keys[4]
    value = admin.get(key)
    if how == "truncated":
        admin.set(key, value[:-100])
    elif how == "corrupt":
        admin.set(key, value[:80] + bytes([value[80] ^ 0xFF]) + value[81:])
    elif how == "not a frame":
        admin.set(key, b"hello, world" * 40)
    else:
        admin.set(key, foreign)
    return 1


@pytest.mark.parametrize("how", ["truncated", "corrupt", "not a frame", "foreign"])
def test_damaged_values_are_counted_and_treated_as_misses_never_as_kv(how: str) -> None:
    with fresh_server() as server:
        with KVCacheManager(config(server.url)) as a, KVCacheManager(config(server.url)) as b:
            serve(a, PROMPT)
            assert a.flush_remote(10.0)
            keys = _remote_keys(server.url)
            # A foreign value: an intact frame of this layout for another block.
            foreign = _admin(server.url).get(keys[0] if keys[4] != keys[0] else keys[1])
            _damage(server.url, how, foreign)
            reused = serve(b, PROMPT)  # every page read is fingerprint-checked
            st = b.get_remote_statistics()
            counter = {"truncated": "truncated", "corrupt": "corrupt",
                       "not a frame": "corrupt", "foreign": "foreign"}[how]
            assert getattr(st, counter) == 1
            assert st.hits == 9 - 1
            # The damaged block and those after it are computed, not reused.
            assert reused < REUSABLE and reused % TPB == 0


# -- faults ------------------------------------------------------------------------------


def test_a_paused_server_costs_one_deadline_then_is_skipped_and_steps_go_on() -> None:
    with fresh_server() as server:
        cfg = config(server.url, io_deadline_s=0.1, retry_after_s=30.0,
                     write_deadline_s=0.2)
        with KVCacheManager(cfg) as a, KVCacheManager(cfg) as b:
            serve(a, PROMPT)
            assert a.flush_remote(10.0)
            pid = server.nodes[0].proc.pid  # type: ignore[union-attr]
            os.kill(pid, signal.SIGSTOP)
            try:
                with lag_budget(0.1) as budget:
                    cache = b.create_kv_cache(None, PROMPT[:-1])
                assert budget.elapsed < budget.limit, budget
                assert cache.history_length == 0  # not read in time: recomputed
                cache.close()
                assert b.get_remote_statistics().read_failures == 1
                # Within retry_after_s the level is skipped: no wait at all.
                with lag_budget(0.0) as budget:
                    assert serve(b, PROMPT, rid="skipped") == 0  # commits queue writes
                assert budget.elapsed < budget.limit + 1.0, budget
                assert b.get_remote_statistics().skipped >= 1
            finally:
                os.kill(pid, signal.SIGCONT)


def test_a_killed_server_means_recompute_and_a_restarted_one_is_used_again() -> None:
    with fresh_server() as server:
        cfg = config(server.url, io_deadline_s=0.2, retry_after_s=0.2)
        with KVCacheManager(cfg) as a, KVCacheManager(cfg) as b:
            serve(a, PROMPT)
            assert a.flush_remote(10.0)
            server.kill()
            with lag_budget(0.2) as budget:
                assert serve(b, PROMPT) == 0
            assert budget.elapsed < budget.limit + 1.0, budget
            assert b.flush_remote(10.0)
            st = b.get_remote_statistics()
            assert st.read_failures + st.skipped >= 1 and st.write_failures >= 1
            server.restart()  # empty: what it held is lost, which is ordinary
            time.sleep(0.3)  # past retry_after_s
            assert serve(a, PROMPT, rid="after") == len(PROMPT) - 1  # a's own local pages
            prompt = _prompt(5)
            assert serve(a, prompt) == 0
            assert a.flush_remote(10.0)
            assert serve(b, prompt) == REUSABLE, b.get_remote_statistics()


def test_maxmemory_evictions_are_ordinary_loss() -> None:
    with fresh_server(maxmemory=1 << 20) as server:
        cfg = config(server.url, size=16384)  # 32 KiB pages
        with KVCacheManager(cfg) as a, KVCacheManager(cfg) as b:
            prompts = [_prompt(s) for s in range(8)]  # 80 pages, 2.5 MiB: some evicted
            for i, p in enumerate(prompts):
                serve(a, p, rid=i)
            assert a.flush_remote(30.0)
            assert len(_remote_keys(server.url)) < 80
            reused = [serve(b, p, rid=i) for i, p in enumerate(prompts)]
            assert all(r % TPB == 0 and r <= REUSABLE for r in reused)
            st = b.get_remote_statistics()
            assert st.misses > 0 and st.corrupt == st.foreign == st.truncated == 0


def test_the_own_key_quota_deletes_only_keys_this_manager_wrote() -> None:
    with fresh_server() as server:
        page = 2 * 256 + 72  # one frame: a cold page (two layers) and the frame around it
        with KVCacheManager(config(server.url)) as other:
            serve(other, _prompt(1))
            assert other.flush_remote(10.0)
        theirs = set(_remote_keys(server.url))
        assert len(theirs) == 10
        with KVCacheManager(config(server.url, quota=12 * page)) as m:
            for s in range(2, 6):
                serve(m, _prompt(s), rid=s)
            assert m.flush_remote(10.0)
            st = m.get_remote_statistics()
            assert st.written == 40 and st.deleted == 40 - 12
            assert st.own_keys == 12 and st.own_bytes <= 12 * page
        left = set(_remote_keys(server.url))
        assert theirs <= left  # never deletes another manager's keys
        assert len(left - theirs) == 12
        with KVCacheManager(config(server.url)) as reader:  # the most recent ones stay
            assert reader.probe_reuse(None, _prompt(5)[:-1], remote=True) == REUSABLE, \
                reader.get_remote_statistics()
            assert reader.probe_reuse(None, _prompt(2)[:-1], remote=True) == 0


def test_a_full_write_queue_drops_writes_and_counts_them() -> None:
    with fresh_server() as server:
        # retry_after_s=0: the writer keeps trying (no failure makes it skip the store);
        # the lookups on the frozen server wait out their (short) io_deadline_s
        cfg = config(server.url, write_queue_blocks=4, write_deadline_s=2.0,
                     retry_after_s=0, io_deadline_s=0.05)
        with KVCacheManager(cfg) as m:
            pid = server.nodes[0].proc.pid  # type: ignore[union-attr]
            os.kill(pid, signal.SIGSTOP)  # the writer waits on its first batch
            try:
                with lag_budget(0.0) as budget:
                    for s in range(3):
                        m.create_kv_cache(None, []).close()
                        serve(m, _prompt(10 + s), rid=s)
                assert budget.elapsed < budget.limit + 1.5, budget  # writes never block
            finally:
                os.kill(pid, signal.SIGCONT)
            assert m.flush_remote(10.0)
            st = m.get_remote_statistics()
            assert st.writes_dropped > 0
            assert st.writes_queued + st.writes_dropped == 30


# -- configuration ---------------------------------------------------------------------------


@pytest.mark.parametrize(("option", "value"), [
    ("io_deadline_s", 0), ("io_deadline_s", "fast"), ("max_blocks", 0),
    ("write_queue_blocks", 1.5), ("write_deadline_s", -1), ("retry_after_s", -0.1),
])
def test_bad_remote_options_raise_config_error_naming_the_option(option, value) -> None:
    need_binaries()
    with pytest.raises(ConfigError) as info:
        KVCacheManager(config("redis://127.0.0.1:1/0", **{option: value}))
    assert info.value.field == f"levels[2].options.{option}"


def test_a_keyed_level_must_be_the_last_and_only_one() -> None:
    base = config("redis://127.0.0.1:1/0").to_dict()
    redis_level = base["levels"][2]
    for levels, field in (([base["levels"][0], redis_level, base["levels"][1]],
                           "levels[1].tier"),
                          ([base["levels"][0], redis_level, redis_level], "levels[2].tier"),
                          ([redis_level], "levels[0].tier")):
        with pytest.raises(ConfigError) as info:
            KVCacheManager(KVCacheManagerConfig.from_dict({**base, "levels": levels}))
        assert info.value.field == field


@pytest.mark.parametrize(("name", "value", "instead"), [
    ("io_deadline_s", 0.01, "options.io_deadline_s"),
    ("io_deadline_s", None, "options.io_deadline_s"),
    ("write_queue_depth", 4, "options.write_queue_blocks"),
    ("write_combine_bytes", 1 << 20, None)])
def test_a_keyed_level_refuses_the_level_io_settings_it_would_ignore(name, value, instead
                                                                     ) -> None:
    """A keyed level's lookup deadline and write queue are its options; the I/O-thread
    settings of LevelConfig would be silently ignored there, so they are refused, naming
    the option to set instead."""
    cfg = config("redis://127.0.0.1:1/0").to_dict()
    cfg["levels"][2][name] = value
    with pytest.raises(ConfigError) as info:
        KVCacheManager(KVCacheManagerConfig.from_dict(cfg))
    assert info.value.field == f"levels[2].{name}"
    assert "does not apply to a keyed" in str(info.value)
    if instead:
        assert instead in str(info.value)


def test_manager_resize_of_the_keyed_level_is_refused_as_a_level_the_manager_lacks() -> None:
    """The keyed level is sized by its store (``quota`` counts own keys), not by
    ``manager.resize``: its index is refused like a level the manager does not have."""
    with KVCacheManager(config("redis://127.0.0.1:1/0")) as m:
        with pytest.raises(InvalidArgumentError, match=r"level=2: must be in 0\.\.1"):
            m.resize(2, 1 << 20)


def test_remote_calls_without_a_keyed_level_raise_invalid_state() -> None:
    cfg = config("redis://127.0.0.1:1/0").to_dict()
    cfg["levels"] = cfg["levels"][:2]
    with KVCacheManager(KVCacheManagerConfig.from_dict(cfg)) as m:
        with pytest.raises(InvalidStateError, match="keyed"):
            m.get_remote_statistics()
        with pytest.raises(InvalidStateError, match="keyed"):
            m.flush_remote()
        assert m.probe_reuse(None, PROMPT, remote=True) == 0  # local levels only


def test_an_unreachable_server_at_construction_is_no_error_and_lookups_skip_it() -> None:
    need_binaries()
    with KVCacheManager(config("redis://127.0.0.1:1/0", retry_after_s=60.0)) as m:
        with lag_budget(0.0) as budget:
            assert serve(m, PROMPT) == 0
        assert budget.elapsed < budget.limit + 1.0, budget
        assert m.get_remote_statistics().skipped >= 1


def test_a_killed_cluster_primary_means_recompute_never_wrong_kv_nor_a_late_call() -> None:
    need_binaries()
    from kvcm_core.testing.redis_server import RedisClusterServers

    # A node timeout of 3 s: with 1 s a live primary that misses its heartbeats on a
    # loaded machine is voted out too.
    with RedisClusterServers(node_timeout_ms=3000) as cluster:
        cfg = config(cluster.url, cluster=True, io_deadline_s=0.2, retry_after_s=0.1,
                     write_deadline_s=0.5)
        with KVCacheManager(cfg) as a, KVCacheManager(cfg) as b:
            prompts = [_prompt(20 + s) for s in range(6)]
            for i, p in enumerate(prompts):
                serve(a, p, rid=i)
            assert a.flush_remote(10.0)
            cluster.wait_replicated()  # replication to the replicas is asynchronous
            cluster.kill_port(cluster.primary_ports()[0])
            reused = []
            for i, p in enumerate(prompts):  # during the failover: verified, each in time
                with lag_budget(0.2) as budget:
                    cache = b.create_kv_cache(None, p[:-1], id=f"probe{i}")
                cache.close()
                assert budget.elapsed < budget.limit, budget
                reused.append(serve(b, p, rid=i))
            assert all(r % TPB == 0 and r <= REUSABLE for r in reused)
            cluster.wait_failover(3)
            deadline = time.monotonic() + 20
            for k in range(1000):  # the tier finds the new primary: new prefixes are shared
                fresh = _prompt(40 + k)  # (a write that failed is not retried: new ones)
                serve(a, fresh, rid=f"fresh{k}")
                a.flush_remote(10.0)
                # A new manager reaches the cluster through a live node (the URL's is dead).
                live = f"redis://127.0.0.1:{cluster.primary_ports()[0]}/0"
                with KVCacheManager(config(live, cluster=True)) as c:
                    if c.probe_reuse(None, fresh[:-1], remote=True) == REUSABLE:
                        assert serve(c, fresh) == REUSABLE, c.get_remote_statistics()
                        break
                assert time.monotonic() < deadline, a.get_remote_statistics()
                time.sleep(0.2)
            st = b.get_remote_statistics()
            assert st.corrupt == st.foreign == st.truncated == 0


def test_shutdown_finishes_the_queued_writes() -> None:
    with fresh_server() as server:
        with KVCacheManager(config(server.url)) as a:
            serve(a, PROMPT)  # no flush: shutdown (the with block) must finish the queue
        with KVCacheManager(config(server.url)) as b:
            assert serve(b, PROMPT) == REUSABLE, b.get_remote_statistics()


def test_keys_are_namespaced_by_layout_fingerprint_and_scope() -> None:
    with fresh_server() as server:
        with KVCacheManager(config(server.url)) as a, \
                KVCacheManager(config(server.url, size=512)) as other:
            serve(a, PROMPT[:2 * TPB + 1], scope=ReuseScope(salt=1))
            serve(a, PROMPT[:2 * TPB + 1], rid="s2", scope=ReuseScope(salt=2))
            serve(other, PROMPT[:2 * TPB + 1], rid="o", scope=ReuseScope(salt=1))
            for m in (a, other):
                assert m.flush_remote(10.0)
            assert a.remote.fingerprint != other.remote.fingerprint
            keys = [k.split(b":") for k in _remote_keys(server.url)]
            assert len(keys) == 6  # 2 blocks x (2 scopes + 1 other layout)
            by_layout = {}
            for _ns, layout, scope, group, block in keys:
                by_layout.setdefault(layout, set()).add(scope)
                assert group == b"0" and len(block) == 64
            # One layout, two scopes; the other layout, one scope: never the same key.
            assert len(by_layout[a.remote.fingerprint.hex().encode()]) == 2
            assert len(by_layout[other.remote.fingerprint.hex().encode()]) == 1


def test_pages_written_under_another_key_rule_are_never_read(monkeypatch) -> None:
    """The layout fingerprint names the block-key rule (``sha256-prefix``): what a manager
    of the former rule (recorded as ``sha256``) wrote lies under another namespace. (The
    block keys themselves are this rule's here: the fingerprint alone keeps them apart.)"""
    import kvcm_core.remote as remote_mod

    with fresh_server() as server:
        monkeypatch.setattr(remote_mod, "KEY_HASH", "sha256")
        with KVCacheManager(config(server.url)) as old:
            serve(old, PROMPT)
            assert old.flush_remote(10.0)
            old_layout = old.remote.fingerprint
        monkeypatch.undo()
        assert len(_remote_keys(server.url)) == 10
        with KVCacheManager(config(server.url)) as new:
            assert new.remote.fingerprint != old_layout
            assert serve(new, PROMPT) == 0
            assert new.get_remote_statistics().pulled_blocks == 0
            assert new.flush_remote(10.0)
        with KVCacheManager(config(server.url)) as again:
            # this rule's pages are shared
            assert serve(again, PROMPT) == REUSABLE, again.get_remote_statistics()


def test_a_lookup_asks_for_at_most_max_blocks_past_the_local_match() -> None:
    with fresh_server() as server:
        with KVCacheManager(config(server.url)) as a, \
                KVCacheManager(config(server.url, max_blocks=3)) as b:
            serve(a, PROMPT)
            assert a.flush_remote(10.0)
            assert b.probe_reuse(None, PROMPT[:-1], remote=True) == 3 * TPB
            assert serve(b, PROMPT) == 3 * TPB
            assert b.get_remote_statistics().pulled_blocks == 3


def test_blocks_read_from_the_remote_level_are_not_written_back() -> None:
    with fresh_server() as server:
        with KVCacheManager(config(server.url)) as a, KVCacheManager(config(server.url)) as b:
            serve(a, PROMPT)  # 10 full blocks once the answer is committed
            assert a.flush_remote(10.0)
            longer = PROMPT + _prompt(8, blocks=2)
            assert serve(b, longer) == len(PROMPT)  # all 10 blocks pulled
            assert b.flush_remote(10.0)
            st = b.get_remote_statistics()
            assert st.pulled_blocks == 10
            assert st.writes_queued == 2  # only the blocks b computed itself


# -- ordering: the shared level reads pages after the engine wrote them ---------------------


def test_a_commit_on_the_engines_stream_stores_the_kv_written_there_not_older_bytes() -> None:
    """On a backend whose streams are real queues (the deferred test backend), an engine
    writes a prompt's KV on its own stream and commits at once, without waiting. The
    shared level reads the published pages after that stream's work, so another
    manager that pulls the prefix reads exactly the KV written (checked by the
    fingerprint engine); read on another stream, it would store the pages' old bytes."""
    from deferred_backend import deferred_plugin_manager

    from kvcm_core.testing.fingerprint import FingerprintEngine, StepWork

    with fresh_server() as server:
        cfg = KVCacheManagerConfig.from_dict({**config(server.url).to_dict(),
                                              "kernel_backend": "deferred"})
        with KVCacheManager(cfg, plugin_manager=deferred_plugin_manager()) as writer:
            stream = writer.backend.create_stream()
            engine = FingerprintEngine(writer)
            engine.stream = stream
            cache = writer.create_kv_cache(None, [])
            assert cache.resume(stream) and cache.resize(len(PROMPT), stream=stream)
            engine.write([StepWork(cache, PROMPT)])  # queued on the engine's stream
            cache.commit(PROMPT, stream)
            assert writer.flush_remote(30.0)
            assert writer.get_remote_statistics().written == 10
            cache.close()
        with KVCacheManager(config(server.url)) as reader:
            # every pulled page checked
            assert serve(reader, PROMPT) == REUSABLE, reader.get_remote_statistics()


# -- a server that restarts empty ----------------------------------------------------------


def _stored_sizes(url: str) -> dict[bytes, int]:
    admin = _admin(url)
    return {k: admin.strlen(k) for k in admin.keys("kvcm:*") if b":alive:" not in k}


def test_after_a_restart_that_lost_the_store_own_keys_and_bytes_are_what_it_holds() -> None:
    """The server restarts empty (no persistence): once the level has reached it again,
    it counts as its own only keys the store holds, and their bytes exactly."""
    with fresh_server() as server:
        with KVCacheManager(config(server.url, retry_after_s=0.1)) as a:
            serve(a, PROMPT)
            assert a.flush_remote(10.0)
            assert a.get_remote_statistics().own_keys == 10
            server.restart()  # --save '' --appendonly no: everything is gone
            assert _stored_sizes(server.url) == {}
            # a probe reaches the new server (reads only): nothing of the old is counted
            assert a.probe_reuse(None, _prompt(2), remote=True) == 0
            assert a.flush_remote(10.0)
            st = a.get_remote_statistics()
            assert (st.own_keys, st.own_bytes) == (0, 0)
            assert st.store_restarts == 1
            serve(a, _prompt(3), rid="after")  # and it carries on writing
            assert a.flush_remote(10.0)
            st = a.get_remote_statistics()
            stored = _stored_sizes(server.url)
            assert st.own_keys == len(stored) == 10
            assert st.own_bytes == sum(stored.values())


def test_after_a_restart_that_lost_the_store_blocks_committed_again_are_stored_again() -> None:
    """A manager that wrote a prompt's blocks before the server restarted empty must not
    go on believing the store holds them: when it computes them again it writes them."""
    with fresh_server() as server:
        cfg = config(server.url, local=("gpu",), max_blocks=2, retry_after_s=0.1)
        d = cfg.to_dict()
        d["levels"][0]["quota"] = 32 * 512  # 32 pages: six other prompts evict the first
        with KVCacheManager(KVCacheManagerConfig.from_dict(d)) as a:
            serve(a, PROMPT)
            for s in range(6):
                serve(a, _prompt(20 + s), rid=s)
            assert a.flush_remote(10.0)
            server.restart()
            # nothing local, and the lookup asks for 2 blocks only: the other 8 are
            # computed and committed without having been looked up
            assert serve(a, PROMPT, rid="again") == 0
            assert a.flush_remote(10.0)
        with KVCacheManager(config(server.url)) as b:
            assert b.probe_reuse(None, PROMPT[:-1], remote=True) == REUSABLE, \
                b.get_remote_statistics()


def _served_then_evicted_locally(url: str) -> KVCacheManager:
    """A manager with the GPU as its only local level (32 pages) that served PROMPT and
    six other prompts (PROMPT's pages evicted locally, every block on the server), its
    lookups asking for 2 blocks at a time."""
    cfg = config(url, local=("gpu",), max_blocks=2, retry_after_s=0.1).to_dict()
    cfg["levels"][0]["quota"] = 32 * 512
    m = KVCacheManager(KVCacheManagerConfig.from_dict(cfg))
    serve(m, PROMPT)
    for s in range(6):
        serve(m, _prompt(20 + s), rid=s)
    assert m.flush_remote(10.0)
    return m


def test_after_a_flushall_blocks_committed_again_are_stored_again() -> None:
    """``FLUSHALL`` empties the store without a restart (the server keeps its ``run_id``):
    a lookup that misses a key the manager wrote makes it act as after a restart, so when
    it computes the prompt again it writes every block, not only those it looked up."""
    with fresh_server() as server:
        admin = _admin(server.url)
        with _served_then_evicted_locally(server.url) as a:
            run_id = admin.info("server")["run_id"]
            admin.flushall()
            assert admin.info("server")["run_id"] == run_id  # no restart to be seen
            # nothing local, and the lookup asks for 2 blocks only: the other 8 are
            # computed and committed without having been looked up
            assert serve(a, PROMPT, rid="again") == 0
            assert a.flush_remote(10.0)
            st = a.get_remote_statistics()
            assert st.store_restarts == 0 and st.own_keys_lost >= 1, st
        with KVCacheManager(config(server.url)) as b:
            assert b.probe_reuse(None, PROMPT[:-1], remote=True) == REUSABLE, \
                (b.get_remote_statistics(), st)


def test_an_ordinary_loss_of_own_keys_forgets_only_the_keys_missed_not_every_key() -> None:
    """Redis evicting under ``maxmemory`` (here: every block key deleted, the manager's
    sentinel key left) is an ordinary loss: a lookup that misses own keys forgets those,
    and the level neither counts a wholesale loss nor checks every own key against the
    store (which, once a second, would flood a busy store with EXISTS calls)."""
    with fresh_server() as server:
        admin = _admin(server.url)
        with _served_then_evicted_locally(server.url) as a:
            before = a.get_remote_statistics()
            blocks = _remote_keys(server.url)
            assert len(blocks) == before.own_keys and admin.delete(*blocks) == len(blocks)
            assert serve(a, PROMPT, rid="again") == 0
            assert a.flush_remote(10.0)
            st = a.get_remote_statistics()
            assert st.own_keys_lost == 0, st
            # the two keys looked up were forgotten and written again, no other
            assert st.own_keys == before.own_keys and st.written == before.written + 2, \
                (before, st)
            assert len([k for k in admin.keys("kvcm:*") if b":alive:" in k]) == 1
        assert not [k for k in admin.keys("kvcm:*") if b":alive:" in k]  # deleted at shutdown


def test_after_a_restart_that_kept_the_store_its_own_keys_are_still_counted() -> None:
    """The server restarts with its data (persistence): the level checks its own keys,
    finds them all and counts them as before."""
    with fresh_server() as server:
        with KVCacheManager(config(server.url, retry_after_s=0.1)) as a:
            serve(a, PROMPT)
            assert a.flush_remote(10.0)
            before = a.get_remote_statistics()
            server.restart(keep_data=True)
            stored = _stored_sizes(server.url)
            assert len(stored) == 10
            assert a.probe_reuse(None, _prompt(2), remote=True) == 0  # reaches it again
            assert a.flush_remote(10.0)
            st = a.get_remote_statistics()
            assert st.store_restarts == 1
            assert (st.own_keys, st.own_bytes) == (before.own_keys, before.own_bytes) \
                == (10, sum(stored.values()))


# -- ordering: the shared level's own copies wait for the levels' issued copies -------------
#
# The remote level copies with a Mover of its own, which does not know the fences of the
# levels' asynchronous moves (kvcm_core/fences.py): before it writes pulled pages into
# local slots, or reads committed pages out of GPU slots, the host waits for the issued
# copies that last touched those slots. On the deferred test backend a queued copy runs
# only when something needs its result, so a missing wait shows up as wrong KV every time.

BLOCK = 2 * 256  # bytes of one block of config()'s model (two layers of 256 bytes)


def _deferred(url: str, gpu: int, host: int) -> KVCacheManager:
    """A manager on the deferred backend with ``gpu`` and ``host`` blocks of local levels
    and the redis level at ``url``."""
    from deferred_backend import deferred_plugin_manager

    cfg = config(url).to_dict()
    cfg["kernel_backend"] = "deferred"
    cfg["max_util_for_resume"] = 1.0
    cfg["levels"][0]["quota"] = gpu * BLOCK
    cfg["levels"][1]["quota"] = host * BLOCK
    return KVCacheManager(KVCacheManagerConfig.from_dict(cfg),
                          plugin_manager=deferred_plugin_manager())


def _tokens(seed: int, blocks: int = 4) -> list[int]:
    import numpy as np

    return np.random.default_rng(seed).integers(0, 50_000, blocks * TPB).tolist()


def _write_remote(url: str, prompt: list[int]) -> None:
    """A first manager (numpy) serves ``prompt``: its full blocks are on the server."""
    with KVCacheManager(config(url)) as writer:
        serve(writer, prompt)
        assert writer.flush_remote(10.0)


def _slots(m: KVCacheManager, cache) -> tuple[set[int], set[int]]:
    """``(levels, slots)`` of a cache's pages."""
    import numpy as np

    a = m.storage_levels.arena
    pages = np.asarray(cache._all_pages(), dtype=np.int64)
    return set(a.level[pages].tolist()), set(a.slot[pages].tolist())


def _in_flight(m: KVCacheManager, store, slots) -> bool:
    """Whether an issued copy that last touched one of ``store``'s ``slots`` is still
    queued (the race each test below sets up)."""
    fences = m.storage_levels.mover.fences
    seqs = {int(fences.of(store)[s]) for s in slots}
    return any(seq in fences.events and not fences.events[seq][1].query() for seq in seqs)


def test_a_pull_into_host_slots_an_issued_onboard_still_reads_waits_for_that_onboard() -> None:
    """Request A is resumed: its pages' onboard (host to GPU) is issued on the onboard
    stream and its host slots are freed at once, fenced. Without any synchronisation, a
    request B whose prefix is only on the server is created: the pull lands B's pages in
    exactly those host slots. The pull must wait for A's onboard, else A's GPU pages
    receive B's bytes when the onboard runs."""
    from kvcm_core.testing.fingerprint import FingerprintEngine, StepWork

    prompt_b = _prompt(31, blocks=5)[: 4 * TPB + 1]  # a lookup of 4 full blocks
    with fresh_server() as server:
        _write_remote(server.url, prompt_b)
        with _deferred(server.url, gpu=4, host=8) as m:
            stream = m.backend.create_stream()
            engine = FingerprintEngine(m)
            engine.stream = stream
            a, c = m.create_kv_cache(None, []), m.create_kv_cache(None, [])
            ta, tc = _tokens(1), _tokens(2)
            for cache, toks in ((a, ta), (c, tc)):  # c pushes a to the host level
                assert cache.resume(stream) and cache.resize(len(toks), stream=stream)
                engine.write([StepWork(cache, toks)])
                cache.commit(toks, stream)
                cache.suspend()
            levels, a_host = _slots(m, a)
            assert levels == {1}
            assert a.resume(stream)  # c pushed down again, a's onboard issued, not run
            assert _slots(m, a)[0] == {0}
            assert _in_flight(m, m.storage_levels.stores[1][0], a_host)
            b = m.create_kv_cache(None, prompt_b[:-1])  # pulls 4 pages into the host level
            assert b.history_length == 4 * TPB
            assert m.get_remote_statistics().pulled_pages == 4
            levels, b_host = _slots(m, b)
            assert levels == {1} and b_host == a_host  # the slots a's onboard reads
            engine.check([StepWork(a, ta)])  # after what the stream waits for: a's onboard
            a.close()
            assert b.resume(stream)  # B's pulled pages hold B's KV too
            engine.check([StepWork(b, prompt_b[: 4 * TPB])])
            m.check_invariants()
            for cache in (b, c):
                cache.close()


def test_a_pull_into_host_slots_an_issued_eviction_still_writes_waits_for_that_eviction(
        ) -> None:
    """Request X commits and closes; Y (not committed yet) needs the GPU, so X's cached
    pages move to the host level: the eviction is issued, still to write the host slots.
    A pull for B needs the host level's room: X's pages there are dropped and B's land in
    their slots. The pull must wait for the eviction, else the eviction, run later,
    overwrites B's pulled pages with X's bytes."""
    from kvcm_core.testing.fingerprint import FingerprintEngine, StepWork

    prompt_b = _prompt(32, blocks=5)[: 4 * TPB + 1]
    with fresh_server() as server:
        _write_remote(server.url, prompt_b)
        with _deferred(server.url, gpu=4, host=4) as m:
            stream = m.backend.create_stream()
            engine = FingerprintEngine(m)
            engine.stream = stream
            x, y = m.create_kv_cache(None, []), m.create_kv_cache(None, [])
            tx, ty = _tokens(3), _tokens(4)
            assert x.resume(stream) and x.resize(len(tx), stream=stream)
            engine.write([StepWork(x, tx)])
            x.commit(tx, stream)
            x.close()  # its pages stay cached on the GPU, droppable
            assert y.resume(stream) and y.resize(len(ty), stream=stream)
            engine.write([StepWork(y, ty)])  # no commit: nothing makes the host wait
            y.suspend()
            host = m.storage_levels.stores[1][0]
            assert host.num_slots == 4 and host.num_free == 0  # X's pages, ...
            assert _in_flight(m, host, range(4))  # ... their eviction still queued
            b = m.create_kv_cache(None, prompt_b[:-1])  # X's pages dropped, B's pulled
            assert b.history_length == 4 * TPB
            assert m.get_remote_statistics().pulled_pages == 4
            assert _slots(m, b)[0] == {1}
            y.close()
            assert b.resume(stream)
            engine.check([StepWork(b, prompt_b[: 4 * TPB])])
            m.check_invariants()
            b.close()


def test_a_pull_into_gpu_slots_waits_for_the_engines_queued_writes_to_those_slots() -> None:
    """The GPU is the only local level, so a pull lands in level 0. Request X's last step
    is queued on the engine's stream and X closes without committing it: its GPU slots
    are freed while that write is still queued. ``create_kv_cache`` (which takes no
    stream) pulls B's prefix into exactly those slots: the pull must wait for the
    device's queued work, else X's write, run later, overwrites B's pulled pages."""
    from deferred_backend import deferred_plugin_manager

    from kvcm_core.testing.fingerprint import FingerprintEngine, StepWork

    prompt_b = _prompt(33, blocks=5)[: 4 * TPB + 1]
    with fresh_server() as server:
        with KVCacheManager(config(server.url, local=("gpu",))) as writer:
            serve(writer, prompt_b)
            assert writer.flush_remote(10.0)
        cfg = config(server.url, local=("gpu",)).to_dict()
        cfg["kernel_backend"] = "deferred"
        cfg["max_util_for_resume"] = 1.0
        cfg["levels"][0]["quota"] = 4 * BLOCK
        with KVCacheManager(KVCacheManagerConfig.from_dict(cfg),
                            plugin_manager=deferred_plugin_manager()) as m:
            stream = m.backend.create_stream()
            engine = FingerprintEngine(m)
            engine.stream = stream
            x = m.create_kv_cache(None, [])
            tx = _tokens(5)
            assert x.resume(stream) and x.resize(len(tx), stream=stream)
            x_slots = _slots(m, x)[1]
            engine.write([StepWork(x, tx)])  # X's last step, queued on the stream
            x.close()  # not committed: its GPU slots are free, the write still queued
            assert m.backend.pending()
            b = m.create_kv_cache(None, prompt_b[:-1])  # pulls 4 pages into the GPU
            assert b.history_length == 4 * TPB
            assert m.get_remote_statistics().pulled_pages == 4
            assert _slots(m, b) == ({0}, x_slots)  # the slots X's queued write targets
            assert b.resume(stream)
            engine.check([StepWork(b, prompt_b[: 4 * TPB])])
            m.check_invariants()
            b.close()


def test_a_commit_reads_pages_after_the_onboard_that_filled_them_whatever_its_stream(
        ) -> None:
    """Request C's KV was written (and waited for) before C was suspended uncommitted; D
    pushes C's pages to the host level; C is resumed on the engine's stream (the onboard
    issued, that stream made to wait) and then commits with no stream: the KV was written
    long ago. The shared level reads C's GPU pages on the default stream, which waited for
    nothing: it must wait for the onboard that fills them, else it stores the slots' older
    bytes (D's) under C's keys, and a second manager pulling C's prefix reads wrong KV."""
    from kvcm_core.testing.fingerprint import FingerprintEngine, StepWork

    with fresh_server() as server:
        tc, td = _tokens(5), _tokens(6)
        with _deferred(server.url, gpu=4, host=8) as m:
            stream = m.backend.create_stream()
            engine = FingerprintEngine(m)
            engine.stream = stream
            c, d = m.create_kv_cache(None, []), m.create_kv_cache(None, [])
            assert c.resume(stream) and c.resize(len(tc), stream=stream)
            engine.write([StepWork(c, tc)])
            stream.synchronize()  # C's KV is written
            c.suspend()  # not committed yet
            assert d.resume(stream) and d.resize(len(td), stream=stream)  # C pushed down
            engine.write([StepWork(d, td)])
            d.commit(td, stream)
            d.suspend()
            levels, _ = _slots(m, c)
            assert levels == {1}
            assert c.resume(stream)  # D pushed down, C's onboard issued, not run
            levels, c_gpu = _slots(m, c)
            assert levels == {0} and _in_flight(m, m.storage_levels.stores[0][0], c_gpu)
            c.commit(tc)  # the shared level reads C's pages for writing
            assert m.flush_remote(10.0)
            assert m.get_remote_statistics().written == 8
            for cache in (c, d):
                cache.close()
        with KVCacheManager(config(server.url)) as reader:
            assert serve(reader, [*tc, 7]) == 4 * TPB  # every pulled page checked


def test_a_blob_codec_raising_a_plain_error_on_read_is_a_miss_not_an_untyped_error() -> None:
    """A third-party blob codec breaking its contract (a ValueError from decode, not
    CorruptPageError): the shared level's copy counts as corrupt and the request
    recomputes; nothing untyped reaches the engine."""
    from codec_helpers import broken_blob_codec

    pm, _ = broken_blob_codec(998, decode_fails=True)
    with fresh_server() as server:
        cfg = config(server.url, level={"blob_codec": "broken"})
        with KVCacheManager(cfg, plugin_manager=pm) as a, \
                KVCacheManager(cfg, plugin_manager=pm) as b:
            serve(a, PROMPT)
            assert a.flush_remote(10.0)
            assert serve(b, PROMPT) == 0, b.get_remote_statistics()
            b.check_invariants()


def _image(name: bytes) -> bytes:  # a multimodal item's digest
    import hashlib

    return hashlib.sha256(name).digest()


@pytest.mark.parametrize("at", [0, 3, 9])
def test_a_multimodal_prompt_shares_every_full_block_through_the_shared_level(at: int) -> None:
    """Blocks holding an image's digest, and those after it, are written at commit and
    pulled at create like plain ones (their keys chain through the digest): another manager
    reuses all of them, each page fingerprint-checked; another image at the same place
    shares only the blocks before it."""
    plain = list(range(1000, 1000 + 9 * TPB))
    prompt = plain[: at * TPB] + [_image(b"cat")] * TPB + plain[at * TPB :]  # 10 blocks
    other = plain[: at * TPB] + [_image(b"dog")] * TPB + plain[at * TPB :]
    with fresh_server() as server:
        with KVCacheManager(config(server.url)) as a, KVCacheManager(config(server.url)) as b:
            assert serve(a, prompt) == 0
            assert a.flush_remote(10.0)
            assert a.get_remote_statistics().written == 10  # every full block
            assert b.probe_reuse(None, prompt[:-1], remote=True) == REUSABLE
            before = b.get_remote_statistics().hits
            assert serve(b, prompt, rid="b") == REUSABLE  # 9 blocks, image and past it
            assert b.get_remote_statistics().hits - before == 9
            assert serve(b, other, rid="c") == at * TPB  # the other image is not the cat


def test_a_local_match_holding_an_image_is_extended_from_the_shared_level() -> None:
    """A prompt whose locally matched prefix holds an image looks the blocks after the
    match up on the shared level (multi-turn chat with an early image)."""
    prompt = [_image(b"an image")] * TPB + list(range(1000, 1000 + 9 * TPB))
    with fresh_server() as server:
        with KVCacheManager(config(server.url)) as a, KVCacheManager(config(server.url)) as b:
            assert serve(a, prompt) == 0
            assert a.flush_remote(10.0)
            serve(b, prompt[: 2 * TPB + 1], answer=0)  # local: the image's block, one plain
            assert 2 * TPB <= b.probe_reuse(None, prompt[:-1]) < 3 * TPB  # (a partial block)
            assert b.probe_reuse(None, prompt[:-1], remote=True) == REUSABLE
            before = b.get_remote_statistics().hits
            assert serve(b, prompt, rid="b") == REUSABLE
            st = b.get_remote_statistics()
            assert st.lookups >= 1 and st.hits - before == 7, st  # blocks 2..8 pulled
