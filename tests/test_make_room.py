"""Making room ahead: ``KVCacheManager.make_room`` and ``KVCache.pages_needed``.

An engine sums what its step's caches will take (``pages_needed``) and frees it on level 0
once (``make_room``), so the pages pushed out go down in one batch per level instead of
one per ``resize``. Rules checked: the room made is what was asked where it can be made;
what moves is cached pages (every byte still reusable, checked by the fingerprint
engine), never pages of active caches; a ``resize`` or ``resume`` after ``make_room
(pages_needed(...))`` pushes nothing out; bad input gets typed errors and changes
nothing; the engine loop gives the same hits and bytes with and without it.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from levels_helpers import (
    TPB,
    Driver,
    assert_all_free,
    assert_invariants,
    close_all,
    make_manager,
    page_levels,
    tokens,
)

from kvcm_core import ArgumentTypeError, InvalidArgumentError, InvalidStateError


def free_slots(m):
    return [s.num_free for s in m.stores[0]]


def fill_gpu_with_cached_pages(m, d, n_requests, length, seed=0):
    """Requests written then closed: their committed blocks stay cached on level 0."""
    written = []
    for i in range(n_requests):
        toks = tokens(length, seed + i)
        c = d.write(toks, suspend=False)
        c.close()
        written.append(toks)
    return written


@pytest.mark.parametrize("layout", ["full", "hybrid"])
def test_make_room_frees_the_slots_asked_by_moving_cached_pages_down(tmp_path, cleanup,
                                                                     layout):
    m = make_manager([("gpu", 16), ("host", 64)], tmp_path, layout=layout)
    cleanup(m)
    d = Driver(m)
    written = fill_gpu_with_cached_pages(m, d, 6, 6 * TPB)
    before = free_slots(m)
    want = {g: 6 for g in range(m.num_cache_groups)}
    per_pg = [0] * len(m.stores[0])
    for g, n in want.items():
        per_pg[m.storage_levels.pool_group_of(g)] += n
    assert any(f < n for f, n in zip(before, per_pg, strict=True)), "nothing to free"
    reuse = [m.probe_reuse(None, t[:-1]) for t in written]
    assert all(r > 0 for r in reuse)
    m.get_and_reset_iteration_stats()
    assert m.make_room(want)
    assert all(f >= n for f, n in zip(free_slots(m), per_pg, strict=True))
    stats = m.get_and_reset_iteration_stats()
    assert sum(g.offload_blocks for g in stats.groups) > 0
    assert sum(g.dropped_blocks for g in stats.groups) == 0  # moved down, not dropped
    assert_invariants(m)
    # Every request written is still reused as much as before, and its bytes are right.
    for toks, r in zip(written, reuse, strict=True):
        c = d.create(toks)
        assert c.history_length == r
        assert c.resume()
        d.check(c)
        c.close()


def test_make_room_never_moves_pages_of_active_caches(tmp_path, cleanup):
    m = make_manager([("gpu", 16), ("host", 64)], tmp_path)
    cleanup(m)
    d = Driver(m)
    active = d.write(tokens(10 * TPB, 7), suspend=False)
    fill_gpu_with_cached_pages(m, d, 2, 3 * TPB, seed=20)
    mine = active.page_ids()
    # More than every unlocked slot: refused, and nothing moves (all or nothing).
    before = free_slots(m)
    assert not m.make_room({0: 16})
    assert free_slots(m) == before
    # Every unlocked slot: the cached pages go down, the active cache's pages stay.
    assert m.make_room({0: 16 - len(mine)})
    assert free_slots(m)[0] == 16 - len(mine)
    assert active.page_ids() == mine
    assert set(page_levels(active)) == {0}
    d.check(active)
    assert_invariants(m)


def test_make_room_frees_nothing_when_enough_is_free(tmp_path, cleanup):
    m = make_manager([("gpu", 16), ("host", 64)], tmp_path)
    cleanup(m)
    d = Driver(m)
    fill_gpu_with_cached_pages(m, d, 1, 3 * TPB)
    m.get_and_reset_iteration_stats()
    n = free_slots(m)[0]
    assert m.make_room({0: n})
    assert m.make_room({})
    stats = m.get_and_reset_iteration_stats()
    assert sum(g.offload_blocks + g.dropped_blocks for g in stats.groups) == 0


@pytest.mark.parametrize("pages, error", [
    ([(0, 1)], ArgumentTypeError),
    ({0: 1.5}, ArgumentTypeError),
    ({0: True}, ArgumentTypeError),
    ({"0": 1}, ArgumentTypeError),
    ({0: -1}, InvalidArgumentError),
    ({99: 1}, InvalidArgumentError),
    ({-1: 1}, InvalidArgumentError),
])
def test_make_room_rejects_bad_input_with_a_typed_error_and_moves_nothing(
        tmp_path, cleanup, pages, error):
    m = make_manager([("gpu", 8), ("host", 32)], tmp_path)
    cleanup(m)
    d = Driver(m)
    fill_gpu_with_cached_pages(m, d, 2, 3 * TPB)
    before = free_slots(m)
    with pytest.raises(error) as info:
        m.make_room(pages)
    assert "pages" in str(info.value)
    assert free_slots(m) == before


def test_pages_needed_of_a_closed_cache_is_refused(tmp_path, cleanup):
    m = make_manager([("gpu", 8), ("host", 32)], tmp_path)
    cleanup(m)
    d = Driver(m)
    c = d.create(tokens(3 * TPB))
    c.close()
    with pytest.raises(InvalidStateError):
        c.pages_needed()


@pytest.mark.parametrize("bad", [-1, 1.0, "8", True])
def test_pages_needed_rejects_a_capacity_that_is_not_a_count(tmp_path, cleanup, bad):
    m = make_manager([("gpu", 8), ("host", 32)], tmp_path)
    cleanup(m)
    c = Driver(m).create(tokens(3 * TPB))
    assert c.resume()
    with pytest.raises((ArgumentTypeError, InvalidArgumentError)):
        c.pages_needed(bad)


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(layout=st.sampled_from(["full", "hybrid"]),
       cached=st.integers(1, 5), length=st.integers(1, 12 * TPB),
       grow=st.integers(1, 12 * TPB), seed=st.integers(0, 1000))
def test_resize_after_making_the_room_pages_needed_says_pushes_nothing_out(
        tmp_path_factory, layout, cached, length, grow, seed):
    m = make_manager([("gpu", 24), ("host", 96)], tmp_path_factory.mktemp("m"),
                     layout=layout)
    try:
        d = Driver(m)
        fill_gpu_with_cached_pages(m, d, cached, 5 * TPB, seed=seed)
        toks = tokens(length + grow, seed + 100)
        c = d.create(toks)
        assert c.resume()
        d.run_to(c, length)
        cap = length + grow
        need = c.pages_needed(cap)
        assert all(n > 0 for n in need.values())
        if not m.make_room(need):
            return  # not enough unlocked pages: resize would refuse or preempt anyway
        m.get_and_reset_iteration_stats()
        assert c.resize(cap)
        stats = m.get_and_reset_iteration_stats()
        assert sum(g.offload_blocks + g.dropped_blocks for g in stats.groups) == 0
        d.run_to(c)
        assert_invariants(m)
    finally:
        close_all(m)
        assert_all_free(m)
        m.shutdown()


@pytest.mark.parametrize("layout", ["full", "hybrid"])
def test_resume_after_making_the_room_pages_needed_says_pushes_nothing_out(
        tmp_path, cleanup, layout):
    m = make_manager([("gpu", 16), ("host", 64)], tmp_path, layout=layout)
    cleanup(m)
    d = Driver(m)
    c = d.write(tokens(8 * TPB, 3))
    fill_gpu_with_cached_pages(m, d, 2, 8 * TPB, seed=30)
    # Room for everything: droppable pages go down first, then held ones (c's).
    assert m.make_room({g: 16 for g in range(m.num_cache_groups)})
    assert set(page_levels(c)) == {1}
    fill_gpu_with_cached_pages(m, d, 2, 8 * TPB, seed=40)
    need = c.pages_needed()
    cold = sum(1 for lv in page_levels(c) if lv > 0)
    assert sum(need.values()) >= cold
    assert m.make_room(need)
    m.get_and_reset_iteration_stats()
    assert c.resume()
    stats = m.get_and_reset_iteration_stats()
    assert sum(g.offload_blocks + g.dropped_blocks for g in stats.groups) == 0
    assert sum(g.onboard_blocks for g in stats.groups) >= cold
    d.check(c)


def test_pages_needed_of_a_suspended_cache_asked_for_less_still_counts_what_resume_fills(
        tmp_path, cleanup):
    # A capacity below the cache's length takes nothing more, but resume still brings
    # every cold page up and fills every block the cache lacks (here a partially
    # matched last block, copied at resume): the count never drops below that; a larger
    # capacity adds exactly its new blocks (full attention: one page per block).
    m = make_manager([("gpu", 16), ("host", 64)], tmp_path, layout="full",
                     enable_partial_reuse=True)
    cleanup(m)
    d = Driver(m)
    base = tokens(9 * TPB, 7)
    d.write(base, suspend=False).close()
    partial = d.create(base[:8 * TPB + 2] + tokens(3 * TPB, 8))
    assert partial.history_length == 8 * TPB + 2
    lacking = {g: 1 for g in range(m.num_cache_groups)}
    assert partial.pages_needed() == lacking
    assert partial.pages_needed(TPB) == lacking
    free = free_slots(m)
    assert partial.resume()
    assert free_slots(m) == [f - 1 for f in free]  # the one block it lacked
    d.run_to(partial)
    partial.close()
    c = d.write(tokens(8 * TPB, 3))
    fill_gpu_with_cached_pages(m, d, 2, 8 * TPB, seed=30)
    assert m.make_room({g: 16 for g in range(m.num_cache_groups)})
    cold = sum(1 for lv in page_levels(c) if lv > 0)
    assert cold > 0
    now = c.pages_needed()
    assert sum(now.values()) == cold
    assert c.pages_needed(TPB) == now
    assert c.pages_needed(8 * TPB) == now
    more = c.pages_needed(10 * TPB)
    assert more == {g: n + 2 for g, n in now.items()}
    assert m.make_room(c.pages_needed(TPB))
    m.get_and_reset_iteration_stats()
    assert c.resume()
    stats = m.get_and_reset_iteration_stats()
    assert sum(g.offload_blocks + g.dropped_blocks for g in stats.groups) == 0
    assert sum(g.onboard_blocks for g in stats.groups) == cold
    d.check(c)


@pytest.mark.parametrize("layout", ["full", "hybrid"])
def test_engine_loop_making_room_ahead_keeps_every_byte_and_every_request(tmp_path, layout):
    # Shared prefixes under pressure on a small GPU level: the loop makes room once per
    # step (room_ahead, on by default), checks every page every step, and finishes
    # every request; the room it made moved pages down, and the run without it reuses
    # no more.
    import numpy as np

    from kvcm_core.testing.engine import EngineLoop, Request

    def run(room_ahead):
        m = make_manager([("gpu", 24), ("host", 96)], tmp_path / f"{layout}{room_ahead}",
                         layout=layout)
        calls = []
        make_room = m.make_room
        m.make_room = lambda pages, stream=None: calls.append(dict(pages)) or make_room(
            pages, stream)
        rng = np.random.default_rng(5)
        prefixes = [tokens(6 * TPB, s) for s in range(3)]
        reqs = []
        for i in range(24):
            prompt = prefixes[i % 3] + rng.integers(1, 30000, int(rng.integers(1, 12))).tolist()
            reqs.append(Request(i, prompt + tokens(int(rng.integers(1, 10)), 100 + i),
                                len(prompt)))
        loop = EngineLoop(m, chunk_tokens=2 * TPB, max_batch=6, room_ahead=room_ahead)
        done = loop.run(reqs, max_steps=5000, on_step=lambda _: assert_invariants(m))
        assert sorted(r.id for r in done) == list(range(24))
        loop.close()
        m.clear_reusable_blocks()
        assert_all_free(m)
        m.shutdown()
        return calls, sum(r.reused for r in reqs)

    calls, reused = run(True)
    assert calls and all(all(n > 0 for n in c.values()) for c in calls)
    none, reused_without = run(False)
    assert not none
    assert reused > 0 and reused >= reused_without
