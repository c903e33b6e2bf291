"""Evicting ahead (``LevelConfig.evict_ahead``).

A level that has a level below moves ``evict_ahead`` droppable pages down beyond those it
needs whenever it must make room, so that the next small allocations find free slots and
pages go down in fewer, larger batches. Rules checked: exactly that many more move (never
more than the droppable pages), and they stay cached below (every byte reusable, checked
by the fingerprint engine); the last level drops only what it needs; ``0`` moves only what
is needed; the default is 1/256 of a level's slots, at most 32; a level resized keeps the
rule; bad values get a ``ConfigError`` naming the field. (The property test of
``test_levels.py`` runs random workloads over three levels with and without it.)
"""

from __future__ import annotations

import attrs
import pytest
from levels_helpers import (
    LAYOUTS,
    TPB,
    Driver,
    assert_invariants,
    faulty_disk,
    faulty_tier,
    make_levels,
    make_manager,
    page_levels,
    quota,
    tokens,
)

from kvcm_core import ConfigError, KVCacheManager, KVCacheManagerConfig, LevelConfig
from kvcm_core.storage import EVICT_AHEAD_MAX, EVICT_AHEAD_SHARE
from kvcm_core.testing.faults import FaultPlan


def fill_with_closed_requests(d, n, length, seed):
    """Requests written and closed: their committed blocks stay cached (droppable)."""
    out = []
    for i in range(n):
        t = tokens(length, seed + i)
        d.write(t, suspend=False).close()
        out.append(t)
    return out


def moved(m):
    stats = m.get_and_reset_iteration_stats()
    return (sum(g.offload_blocks for g in stats.groups),
            sum(g.dropped_blocks for g in stats.groups))


@pytest.mark.parametrize("ahead", [0, 1, 3])
def test_a_level_with_a_level_below_moves_evict_ahead_more_pages_down_and_they_stay_reusable(
        tmp_path, cleanup, ahead):
    m = make_manager([("gpu", 16), ("host", 64)], tmp_path, evict_ahead=ahead)
    cleanup(m)
    d = Driver(m)
    written = fill_with_closed_requests(d, 4, 4 * TPB, seed=100)  # 16 cached pages
    gpu = m.stores[0][0]
    assert gpu.num_free == 0 and gpu.ahead == ahead
    reuse = [m.probe_reuse(None, t[:-1]) for t in written]
    m.get_and_reset_iteration_stats()
    # A new request of 2 blocks: 2 pages needed, ``ahead`` more go down with them.
    c = d.create(tokens(2 * TPB, 999))
    assert c.resume() and c.resize(2 * TPB)
    assert moved(m) == (2 + ahead, 0)
    assert gpu.num_free == ahead
    # Nothing was lost: every prompt still finds its whole prefix, now partly on host.
    assert [m.probe_reuse(None, t[:-1]) for t in written] == reuse
    c.close()
    # The next request fits in the free slots: nothing moves.
    if ahead >= 1:
        c = d.create(tokens(TPB, 998))
        assert c.resume() and c.resize(TPB)
        assert moved(m) == (0, 0)
        c.close()
    # Every byte of every prompt reads back (onboarded from host where it went).
    for t, r in zip(written, reuse, strict=True):
        c = d.create(t)
        assert c.resume() and c.history_length == r > 0
        d.check(c)
        c.close()
    assert_invariants(m)


def test_evict_ahead_never_moves_more_than_the_droppable_pages(tmp_path, cleanup):
    m = make_manager([("gpu", 16), ("host", 64)], tmp_path, evict_ahead=10)
    cleanup(m)
    d = Driver(m)
    active = d.write(tokens(12 * TPB, 5), suspend=False)  # 12 pages held by a live cache
    fill_with_closed_requests(d, 1, 4 * TPB, seed=200)  # 4 droppable
    m.get_and_reset_iteration_stats()
    c = d.create(tokens(TPB, 300))
    assert c.resume() and c.resize(TPB)
    assert moved(m) == (4, 0)  # the 4 droppable pages, not 1 + 10
    assert m.stores[0][0].num_free == 3
    assert set(page_levels(active)) == {0}
    d.check(active)
    c.close()
    active.close()
    assert_invariants(m)


@pytest.mark.parametrize("nlevels", [1, 2])
def test_the_last_level_drops_only_what_it_needs_whatever_evict_ahead_says(
        tmp_path, cleanup, nlevels):
    m = make_manager([("gpu", 16), ("host", 8)][:nlevels], tmp_path, evict_ahead=5)
    cleanup(m)
    d = Driver(m)
    fill_with_closed_requests(d, 8, 4 * TPB, seed=400)  # 32 pages: more than fits
    gpu, last = m.stores[0][0], m.stores[-1][0]
    assert last.ahead == 0 and last.num_free == 0
    need = gpu.num_free + 1  # one page more than is free on the GPU
    m.get_and_reset_iteration_stats()
    c = d.create(tokens(need * TPB, 500))
    assert c.resume() and c.resize(need * TPB)
    if nlevels == 1:
        assert moved(m) == (0, 1)  # the GPU is the last level: 1 dropped, not 6
    else:
        assert moved(m) == (6, 6)  # 1 + 5 go down; the host drops just room for them
    c.close()
    assert_invariants(m)


def test_default_evict_ahead_is_a_256th_of_the_level_up_to_32(tmp_path, cleanup):
    for n in [100, 1000, 20000]:
        m = make_manager([("gpu", n), ("host", 64)], tmp_path / str(n))
        cleanup(m)
        want = min(n // EVICT_AHEAD_SHARE, EVICT_AHEAD_MAX)
        assert m.stores[0][0].ahead == want
        assert m.stores[1][0].ahead == 0  # the last level
    assert (EVICT_AHEAD_SHARE, EVICT_AHEAD_MAX) == (256, 32)  # as the docs say


def test_a_resized_level_follows_the_default_share(tmp_path, cleanup):
    m = make_manager([("gpu", 1024), ("host", 64)], tmp_path)
    cleanup(m)
    assert m.stores[0][0].ahead == 4
    assert m.resize(0, quota("full", 0, 2048))
    assert m.stores[0][0].ahead == 8
    m2 = make_manager([("gpu", 1024), ("host", 64)], tmp_path / "fixed", evict_ahead=2)
    cleanup(m2)
    assert m2.resize(0, quota("full", 0, 2048))
    assert m2.stores[0][0].ahead == 2  # an explicit value stays


@pytest.mark.parametrize("bad", [-1, True, 1.5, "3"])
def test_a_bad_evict_ahead_is_a_config_error_naming_the_field(tmp_path, bad):
    with pytest.raises(ConfigError) as info:
        LevelConfig(tier="host", quota=1 << 20, evict_ahead=bad)
    assert info.value.field == "LevelConfig.evict_ahead"
    assert info.value.value is bad


def test_evict_ahead_round_trips_through_plain_data(tmp_path):
    levels = make_levels("full", [("gpu", 16), ("host", 64)], tmp_path, evict_ahead=7)
    cfg = KVCacheManagerConfig(tokens_per_block=TPB, layers=LAYOUTS["full"](), levels=levels)
    back = KVCacheManagerConfig.from_dict(cfg.to_dict())
    assert [lv.evict_ahead for lv in back.levels] == [7, 7]
    assert back == cfg


# -- ahead only into room the level below has (review 28) ----------------------------------


def _one_slot_after_a_full_gpu(m, d, held_blocks):
    """A suspended request of ``held_blocks`` pages pushed below by one that took the
    whole GPU (16 slots) and closed: 16 droppable GPU pages; then a request that needs
    one GPU slot. Returns (offloaded, dropped, the suspended request's page levels)."""
    a = d.write(tokens(held_blocks * TPB, 1))
    b = d.create(tokens(16 * TPB, 2))
    d.run_to(b)
    b.close()
    assert set(page_levels(a)) == {1}
    m.get_and_reset_iteration_stats()
    c = d.create(tokens(TPB, 3))
    assert c.resume() and c.resize(TPB)
    got = (*moved(m), page_levels(a))
    c.close()
    assert a.resume()
    d.check(a)
    a.close()
    assert_invariants(m)
    return got


@pytest.mark.parametrize("ahead", [0, 5])
def test_evict_ahead_drops_nothing_when_the_level_below_is_full_of_held_pages(
        tmp_path, cleanup, ahead):
    m = make_manager([("gpu", 16), ("host", 8)], tmp_path, evict_ahead=ahead)
    cleanup(m)
    offloaded, dropped, _ = _one_slot_after_a_full_gpu(m, Driver(m), 8)
    assert (offloaded, dropped) == (0, 1)  # the one needed; the 5 ahead stay cached


@pytest.mark.parametrize("ahead", [0, 5])
def test_evict_ahead_never_pushes_held_pages_of_the_level_below_further_down(
        tmp_path, cleanup, ahead):
    m = make_manager([("gpu", 16), ("host", 8), ("disk", 32)], tmp_path, evict_ahead=ahead)
    cleanup(m)
    *_, levels = _one_slot_after_a_full_gpu(m, Driver(m), 8)
    assert levels.count(2) == 1  # one held page made room for the one page needed


@pytest.mark.parametrize("mode", ["failed write", "full write queue"])
def test_pages_taken_ahead_that_no_level_took_stay_cached(tmp_path, cleanup, mode):
    plan = FaultPlan()
    levels = make_levels("full", [("gpu", 16), ("faulty-disk", 64)], tmp_path,
                         {"write_queue_depth": 0 if mode == "failed write" else 1}, 5)
    levels[1] = attrs.evolve(levels[1], write_combine_bytes=0)
    m = KVCacheManager(KVCacheManagerConfig(
        tokens_per_block=TPB, layers=LAYOUTS["full"](), levels=levels,
        kernel_backend="numpy", max_util_for_resume=1.0), plugin_manager=faulty_disk(plan))
    cleanup(m)
    d = Driver(m)
    written = fill_with_closed_requests(d, 4, 4 * TPB, seed=100)  # a full GPU
    if mode == "failed write":
        plan.fail_all_writes = True
    else:  # one background write held in flight: the next write finds the queue full
        plan.hold = True
        d.write(tokens(TPB, 7), suspend=False).close()
        i = 0
        while m.stores[0][0].num_free:
            d.write(tokens(TPB, 20 + i), suspend=False).close()
            i += 1
    m.get_and_reset_iteration_stats()
    try:
        c = d.create(tokens(TPB, 3))
        assert c.resume() and c.resize(TPB)
        assert moved(m) == (0, 1)  # one dropped for the slot needed, none for the 5 ahead
        c.close()
    finally:
        plan.hold = False
        plan.fail_all_writes = False
        if mode != "failed write":
            faulty_tier(m, 1).release()
    assert_invariants(m)
    assert sum(m.probe_reuse(None, t[:-1]) > 0 for t in written) >= 3
