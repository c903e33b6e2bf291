"""Levels (concepts.md §6-8, §10, §11; scenarios.md "Memory pressure and levels").

Pages of suspended requests move GPU -> host -> disk and back through every pair of levels
with tiny quotas; reuse comes from colder levels; the eviction cascade moves victims one
level down and drops only at the last level; held pages are never dropped; failed
operations change nothing; ``manager.resize(level, quota)`` and ``prefetch``; stats and
events. Every byte is checked by the fingerprint engine (levels_helpers.Driver).
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from levels_helpers import (
    Driver,
    Recorder,
    SinkPlugin,
    assert_all_free,
    assert_invariants,
    cache_pages,
    chain,
    close_all,
    level_counts,
    make_manager,
    node_pages,
    page_level,
    page_levels,
    quota,
    snapshot,
    tokens,
)

from kvcm_core import (
    BAD_PAGE_INDEX,
    EventKind,
    InvalidArgumentError,
    InvalidStateError,
    KvcmPluginManager,
)


def attn_pages(cache):
    """Attention pages of a cache (every group but SSM live states)."""
    m = cache.manager
    return [p for g in range(m.num_cache_groups) if not m.life_cycles[g].is_ssm
            for p in cache.pages(g) if p >= 0]


def attn_levels(cache):
    return {page_level(cache.manager, p) for p in attn_pages(cache)}


def table_is_bad(cache, m):
    """Every attention page table entry is BAD (SSM live states may stay on the GPU)."""
    return all(
        all(int(x) == BAD_PAGE_INDEX for x in cache.get_base_page_indices(g))
        for g in range(m.num_cache_groups) if not m.life_cycles[g].is_ssm)


# -- every pair of levels, bit-exact ---------------------------------------------------------


@pytest.mark.parametrize("layout", ["full", "hybrid"])
def test_gpu_to_host_and_back_is_bit_exact(tmp_path, cleanup, layout):
    m = make_manager([("gpu", 8), ("host", 24)], tmp_path, layout=layout)
    cleanup(m)
    d = Driver(m)
    a = d.write(tokens(22, 1))
    assert set(page_levels(a)) == {0}
    # B prefills 8 blocks in one chunk: every attention page of A must leave the GPU.
    b = d.write(tokens(32, 2), chunk=32, suspend=False)
    assert attn_levels(a) == {1}
    assert table_is_bad(a, m)
    b.suspend()
    # Shrinking the GPU to one slot per life cycle pushes whatever is left (SSM states).
    assert m.resize(0, quota(layout, 0, 1))
    assert_invariants(m)
    assert set(page_levels(a)) == {1}
    assert m.resize(0, quota(layout, 0, 8))
    assert_invariants(m)
    # Back: A comes to the GPU from the host, pushing B's pages down.
    assert a.resume()
    assert set(page_levels(a)) == {0}
    d.check(a)
    d.run_to(a)  # and it can go on computing
    a.suspend()
    d.resume_and_verify(b, a)


@pytest.mark.parametrize("layout", ["full", "hybrid"])
def test_host_to_disk_and_back_is_bit_exact(tmp_path, cleanup, layout):
    m = make_manager([("gpu", 8), ("host", 8), ("disk", 40)], tmp_path, layout=layout)
    cleanup(m)
    d = Driver(m)
    a = d.write(tokens(22, 1))
    b = d.write(tokens(32, 2), chunk=32)      # A -> host
    assert attn_levels(a) == {1}
    c = d.write(tokens(32, 3), chunk=32, suspend=False)  # B -> host, A -> disk
    assert attn_levels(a) == {2}
    assert attn_levels(b) == {1}
    assert table_is_bad(a, m) and table_is_bad(b, m)
    c.suspend()
    assert_invariants(m)
    # disk -> host: grow the host, then prefetch.
    assert m.resize(1, quota(layout, 1, 32))
    on_disk = [p for p in cache_pages(a) if page_level(m, p) == 2]
    assert a.prefetch(1) == len(on_disk) > 0
    assert set(page_levels(a)) <= {0, 1} and 1 in page_levels(a)
    assert_invariants(m)
    # host -> GPU for A; then B; then C (each pushes the others down again).
    d.resume_and_verify(a, b, c, a)


def test_gpu_to_disk_directly_and_back_is_bit_exact(tmp_path, cleanup):
    m = make_manager([("gpu", 8), ("disk", 40)], tmp_path)
    cleanup(m)
    d = Driver(m)
    a = d.write(tokens(22, 1))
    b = d.write(tokens(32, 2), chunk=32, suspend=False)
    assert set(page_levels(a)) == {2 - 1}  # level 1 is the disk
    assert m.storage_levels.tiers[1].capabilities.medium.value == "file"
    assert table_is_bad(a, m)
    b.suspend()
    assert a.resume()
    assert set(page_levels(a)) == {0}
    assert level_counts(b, 2) == [2, 6]
    d.check(a)
    d.run_to(a)
    a.suspend()
    # prefetch straight from disk to the GPU (room: A is suspended, B's slots are free)
    assert m.resize(0, quota("full", 0, 16))
    away = sum(1 for lv in page_levels(b) if lv > 0)
    assert b.prefetch(0) == away == 6
    assert set(page_levels(b)) == {0}
    d.resume_and_verify(b, a)


def test_gpu_host_disk_gpu_cycle_is_bit_exact(tmp_path, cleanup):
    """One request's pages: GPU -> host -> disk -> GPU (straight from disk), then again
    GPU -> host -> GPU, checked after every return."""
    m = make_manager([("gpu", 8), ("host", 8), ("disk", 40)], tmp_path)
    cleanup(m)
    d = Driver(m)
    a = d.write(tokens(30, 11), end=25)   # 7 blocks
    n = len(cache_pages(a))
    b = d.write(tokens(32, 12), chunk=32)
    assert level_counts(a, 3) == [0, n, 0]
    c = d.write(tokens(32, 13), chunk=32)
    assert level_counts(a, 3) == [0, 0, n]
    assert a.resume()           # disk -> GPU, pushing C to the host and B to disk
    assert level_counts(a, 3) == [n, 0, 0]
    d.check(a)
    d.run_to(a, 28)
    a.suspend()
    n = len(cache_pages(a))
    assert b.resume()
    d.check(b)
    b.suspend()
    assert 0 not in page_levels(a)
    d.resume_and_verify(a, c, b)


def test_page_table_shows_bad_while_pages_are_away_fresh_table(tmp_path, cleanup):
    m = make_manager([("gpu", 8), ("host", 24)], tmp_path)
    cleanup(m)
    d = Driver(m)
    a = d.write(tokens(22, 1))
    d.write(tokens(32, 2), chunk=32, suspend=False)
    assert set(page_levels(a)) == {1}
    assert table_is_bad(a, m)


def test_page_table_read_before_eviction_shows_bad_after_it(tmp_path, cleanup):
    m = make_manager([("gpu", 8), ("host", 24)], tmp_path)
    cleanup(m)
    d = Driver(m)
    a = d.write(tokens(22, 1))
    before = [int(x) for x in a.get_base_page_indices(0)]
    assert BAD_PAGE_INDEX not in before
    b = d.write(tokens(32, 2), chunk=32, suspend=False)
    assert set(page_levels(a)) == {1}
    mine = {int(m.storage_levels.arena.slot[p]) for p in cache_pages(b)}
    assert not mine & set(int(x) for x in a.get_base_page_indices(0))


@pytest.mark.parametrize("layout", ["full", "hybrid"])
def test_a_created_cache_shows_bad_for_matched_blocks_on_the_host_until_resume(
        tmp_path, cleanup, layout):
    """A new cache whose match sits on the host level (created, not resumed): its page
    tables name no slot for those blocks (a host slot number is no GPU slot); after
    resume they name level-0 slots holding the blocks' KV."""
    m = make_manager([("gpu", 8), ("host", 24)], tmp_path, layout=layout)
    cleanup(m)
    d = Driver(m)
    toks = tokens(22, 1)
    d.write(toks, suspend=False).close()
    filler = d.write(tokens(32, 2), chunk=32)  # pushes the closed request's blocks down
    nodes = chain(m, toks)
    assert len(nodes) == 5
    full = next(g for g, lc in enumerate(m.life_cycles) if not lc.is_ssm and lc.window is None)
    assert {page_level(m, node_pages(m, n)[full]) for n in nodes} == {1}
    c = d.create(toks + tokens(6, 3), match_len=len(toks))
    assert c.history_length == 22
    assert c.status.name == "SUSPENDED"
    attn = [g for g in range(m.num_cache_groups) if not m.life_cycles[g].is_ssm]
    assert {page_level(m, p) for p in c.pages(full) if p >= 0} == {1}
    for g in attn:
        shown = [int(x) for x in c.get_base_page_indices(g)]
        for b, p in enumerate(c.pages(g)):
            if p >= 0 and page_level(m, p) == 0:
                assert shown[b] == int(m.storage_levels.arena.slot[p]), (g, b)
            else:  # absent, or away from the GPU
                assert shown[b] == BAD_PAGE_INDEX, (g, b, p)
    if layout == "full":
        assert table_is_bad(c, m)
    assert c.resume()
    assert set(page_levels(c)) == {0}
    for g in attn:
        stale = set(range(*m.life_cycles[g].stale_range(c.history_length, 4)))
        num_slots = m.stores[0][m.storage_levels.pool_group_of(g)].num_slots
        for b, x in enumerate(int(x) for x in c.get_base_page_indices(g)):
            if b in stale:
                assert x == BAD_PAGE_INDEX, (g, b)
            else:
                assert 0 <= x < num_slots, (g, b, x)
    d.check(c)  # every slot named holds its block's KV
    d.run_to(c)
    c.close()
    filler.close()


# -- reuse from colder levels ------------------------------------------------------------------


@pytest.mark.parametrize("level", [1, 2])
def test_closed_request_blocks_are_reused_from_a_colder_level(tmp_path, cleanup, level):
    m = make_manager([("gpu", 8), ("host", 8), ("disk", 40)], tmp_path)
    cleanup(m)
    d = Driver(m)
    p_toks = tokens(22, 1)  # 5 full blocks + a partial block of 2 tokens
    d.write(p_toks, suspend=False).close()
    assert_invariants(m)
    # Push the closed request's droppable blocks down one level per filler request.
    fillers = []
    for i in range(level):
        f = d.write(tokens(32, 50 + i), chunk=32)
        fillers.append(f)
    q_toks = p_toks + tokens(10, 3)
    node_levels = []
    # P's chain: its 5 full blocks and the partial block below the last one.
    nodes = chain(m, p_toks)
    assert len(nodes) == 5
    nodes += m.tree.partial_children(nodes[-1])
    for node in nodes:
        for pg in node_pages(m, node):
            if pg >= 0:
                node_levels.append(page_level(m, pg))
    assert node_levels and set(node_levels) == {level}
    probe = m.probe_reuse(None, q_toks[:31])
    assert probe == 22
    m.get_and_reset_iteration_stats()
    q = d.create(q_toks)
    assert q.history_length == probe
    st = m.get_and_reset_iteration_stats()
    assert st.reused_blocks_by_level[level] == 6
    assert sum(st.reused_blocks_by_level) == 6
    assert st.groups[0].reused_full_blocks == 5 and st.groups[0].reused_partial_blocks == 1
    d.run_to(q)  # the first step checks every reused byte
    for f in fillers:
        f.close()
    q.close()
    assert_invariants(m)


# -- eviction cascade --------------------------------------------------------------------------


def test_cascade_moves_droppable_blocks_down_and_drops_only_at_the_last_level(
        tmp_path, cleanup):
    m = make_manager([("gpu", 4), ("host", 4), ("disk", 4)], tmp_path)
    cleanup(m)
    d = Driver(m)
    reqs = [tokens(16, 100 + i) for i in range(5)]  # 4 full blocks each
    m.get_and_reset_iteration_stats()
    for i, t in enumerate(reqs):
        # One priority for every block (plain LRU; without a callback each request's leaf
        # block would go first, see the next test).
        d.write(t, suspend=False, priority_callback=lambda b: 35).close()
        assert_invariants(m)
        st = m.get_and_reset_iteration_stats()
        # Request i's blocks are on the GPU, request i-1's on the host, i-2's on disk.
        for j in range(i + 1):
            age = i - j
            want = 16 if age <= 2 else 0
            assert m.probe_reuse(None, reqs[j]) == want, (i, j)
            if age <= 2:
                levels = {page_level(m, node_pages(m, n)[0]) for n in chain(m, reqs[j])}
                assert levels == {age}, (i, j, levels)
        # Nothing is dropped before the disk is full.
        assert st.groups[0].dropped_blocks == (4 if i >= 3 else 0), (i, st)
        assert st.groups[0].offload_blocks == 4 * min(i, 2), (i, st)
    assert m.get_storage_statistics(2).evictable == 4


def test_a_closed_requests_leaf_block_is_the_first_victim_on_every_level(tmp_path, cleanup):
    # Default priorities: each closed request's deepest full block (its leaf) is evicted
    # before the older request's other blocks, on the GPU and again on the host.
    m = make_manager([("gpu", 4), ("host", 4), ("disk", 4)], tmp_path)
    cleanup(m)
    d = Driver(m)
    reqs = [tokens(16, 100 + i) for i in range(3)]  # 4 full blocks each
    for t in reqs:
        d.write(t, suspend=False).close()
        assert_invariants(m)
    # R0: its leaf left the host first, then (LRU) its blocks from the deepest; R1's leaf
    # arrived on the host after R0's leaf had gone and left it first too.
    lv = [[page_level(m, node_pages(m, n)[0]) for n in chain(m, r)] for r in reqs]
    assert lv == [[1, 2, 2, 2], [1, 1, 1, 2], [0, 0, 0, 0]], lv
    assert all(m.probe_reuse(None, r) == 16 for r in reqs)  # nothing dropped yet


def test_a_batch_larger_than_the_next_level_still_moves_what_fits(tmp_path, cleanup):
    m = make_manager([("gpu", 8), ("host", 4), ("disk", 16)], tmp_path)
    cleanup(m)
    d = Driver(m)
    r1 = tokens(28, 1)
    d.write(r1, chunk=28, suspend=False).close()  # 7 droppable blocks on the GPU
    assert m.probe_reuse(None, r1) == 28
    m.get_and_reset_iteration_stats()
    d.write(tokens(28, 2), chunk=28, suspend=False).close()  # needs 7 GPU slots
    st = m.get_and_reset_iteration_stats()
    # Host and disk were empty (20 free slots): nothing had to be dropped.
    assert st.groups[0].dropped_blocks == 0, st
    assert m.probe_reuse(None, r1) > 0


def test_held_pages_survive_any_pressure_at_the_last_level(tmp_path, cleanup):
    m = make_manager([("gpu", 8), ("host", 8), ("disk", 8)], tmp_path)
    cleanup(m)
    d = Driver(m)
    a = d.write(tokens(16, 1))                      # 4 blocks, held
    d.write(tokens(32, 2), chunk=32, suspend=False).close()  # A -> host
    assert set(page_levels(a)) == {1}
    m.get_and_reset_iteration_stats()
    for i in range(8):                              # lots of closed traffic
        d.write(tokens(28, 200 + i), chunk=28, suspend=False).close()
        assert_invariants(m)
        assert len(cache_pages(a)) == 4 and all(page_level(m, p) >= 0 for p in cache_pages(a))
    assert 2 in page_levels(a)  # pushed down to the last level, never dropped
    st = m.get_and_reset_iteration_stats()
    assert st.groups[0].dropped_blocks > 0
    # On the disk, A's held pages are unavailable (they cannot move further).
    disk = m.get_storage_statistics(2)
    assert disk.unavailable == page_levels(a).count(2)
    d.resume_and_verify(a)


def _fill_every_level_with_held_pages(m, d):
    """Three suspended 8-block requests on 8 (+ extra) / 8 / 8 slots: one per level."""
    reqs = [d.write(tokens(32, 300 + i), chunk=32) for i in range(3)]
    assert [set(page_levels(r)) for r in reqs] == [{2}, {1}, {0}]
    for lv in range(1, 3):
        assert m.get_storage_statistics(lv).free == 0
    return reqs


def test_resume_that_cannot_make_room_returns_false_and_changes_nothing(tmp_path, cleanup):
    m = make_manager([("gpu", 8), ("host", 8), ("disk", 8)], tmp_path)
    cleanup(m)
    d = Driver(m)
    r1, r2, r3 = _fill_every_level_with_held_pages(m, d)
    before = snapshot(m, r1, r2, r3)
    stats_before = repr(m.storage_levels.stats)
    assert r1.resume() is False  # its pages are on disk; the GPU's would have to go there
    assert r2.resume() is False
    assert snapshot(m, r1, r2, r3) == before
    assert repr(m.storage_levels.stats) == stats_before
    assert_invariants(m)
    # r3 is on the GPU already: it resumes.
    d.resume_and_verify(r3)
    # Close r3: its pages become droppable and are dropped to make room for r1.
    r3.close()
    d.resume_and_verify(r1, r2)


def test_cache_resize_that_cannot_make_room_returns_false_and_changes_nothing(
        tmp_path, cleanup):
    m = make_manager([("gpu", 9), ("host", 8), ("disk", 8)], tmp_path)
    cleanup(m)
    d = Driver(m)
    x = d.create(tokens(12, 9))
    assert x.resume()
    assert d.step(x, 4)  # one locked GPU page
    held = _fill_every_level_with_held_pages(m, d)
    assert m.get_storage_statistics(0).free == 0
    before = snapshot(m, x, *held)
    assert d.step(x, 4) is False
    assert snapshot(m, x, *held) == before
    d.check(x)
    x.close()
    r1, r2, r3 = held
    d.resume_and_verify(r3)
    r3.close()  # (r2 and r1 could not swap with held pages on the levels below)
    d.resume_and_verify(r2, r1)


def test_manager_resize_that_cannot_place_held_pages_returns_false(tmp_path, cleanup):
    m = make_manager([("gpu", 8), ("host", 8), ("disk", 8)], tmp_path)
    cleanup(m)
    d = Driver(m)
    held = _fill_every_level_with_held_pages(m, d)
    before = snapshot(m, *held)
    for level in range(3):
        assert m.resize(level, quota("full", level, 4)) is False, level
        assert snapshot(m, *held) == before
        assert_invariants(m)
    d.resume_and_verify(held[2])


# -- manager.resize and prefetch -------------------------------------------------------------


def test_manager_resize_is_refused_while_a_cache_is_active(tmp_path, cleanup):
    m = make_manager([("gpu", 8), ("host", 8), ("disk", 8)], tmp_path)
    cleanup(m)
    d = Driver(m)
    a = d.write(tokens(10, 1), suspend=False)
    before = snapshot(m, a)
    for level in range(3):
        with pytest.raises(InvalidStateError):
            m.resize(level, quota("full", level, 4))
    assert snapshot(m, a) == before
    with pytest.raises(InvalidArgumentError, match="level=3"):
        m.resize(3, 1 << 20)
    a.suspend()
    assert m.resize(0, quota("full", 0, 4))
    assert m.get_storage_statistics(0).total == 4
    d.resume_and_verify(a)


@pytest.mark.parametrize("layout", ["full", "hybrid"])
def test_shrink_every_level_resume_fails_grow_prefetch_both_resume(tmp_path, cleanup,
                                                                    layout):
    m = make_manager([("gpu", 8), ("host", 8), ("disk", 8)], tmp_path, layout=layout)
    cleanup(m)
    d = Driver(m)
    a = d.write(tokens(22, 1))   # 6 blocks
    b = d.write(tokens(22, 2))   # pushes 4 of A to the host
    assert set(page_levels(b)) == {0}
    assert 1 in page_levels(a)
    # Shrink the GPU to 1 slot per life cycle: pages cascade to host and disk.
    assert m.resize(0, quota(layout, 0, 1))
    assert_invariants(m)
    # Then the host to 4: the rest moves to disk.
    assert m.resize(1, quota(layout, 1, 4))
    assert_invariants(m)
    lv = page_levels(a) + page_levels(b)
    assert {0, 1, 2} <= set(lv) or {1, 2} <= set(lv)
    # The disk cannot shrink below the held pages on it (last level: nothing moves).
    before = snapshot(m, a, b)
    on_disk = sum(1 for x in lv if x == 2)
    assert m.resize(2, quota(layout, 2, 1)) is False
    assert snapshot(m, a, b) == before
    assert m.resize(2, quota(layout, 2, 8))  # same size: fine
    # A resume must fail now (6 blocks > 1 GPU slot) and change nothing.
    assert a.resume() is False
    assert b.resume() is False
    assert snapshot(m, a, b) == before
    assert on_disk > 0
    # Grow again and prefetch disk -> host.
    assert m.resize(0, quota(layout, 0, 8))
    assert m.resize(1, quota(layout, 1, 16))
    assert_invariants(m)
    moved = a.prefetch(1) + b.prefetch(1)
    assert moved == on_disk
    assert 2 not in page_levels(a) + page_levels(b)
    assert_invariants(m)
    d.resume_and_verify(a, b)
    assert a.resume()
    d.run_to(a)
    a.close()
    d.resume_and_verify(b)


def test_suspend_with_the_host_full_works_and_pages_go_to_disk(tmp_path, cleanup):
    m = make_manager([("gpu", 8), ("host", 8), ("disk", 24)], tmp_path)
    cleanup(m)
    d = Driver(m)
    x = d.write(tokens(32, 1), chunk=32)
    y = d.write(tokens(32, 2), chunk=32)       # X -> host (host now full of held pages)
    assert set(page_levels(x)) == {1}
    assert m.get_storage_statistics(1).free == 0
    a = d.write(tokens(28, 3), chunk=28, suspend=False)  # Y -> host, X -> disk
    assert m.get_storage_statistics(1).free == 0
    a.suspend()  # the host is full: suspending must still work (pages stay on the GPU)
    assert set(page_levels(a)) == {0}
    assert_invariants(m)
    b = d.write(tokens(32, 4), chunk=32, suspend=False)  # A leaves the GPU
    assert 0 not in page_levels(a)
    b.suspend()
    d.resume_and_verify(a, x, y, b)


def test_suspend_with_a_full_last_level_host_keeps_pages_and_fails_cleanly(tmp_path,
                                                                           cleanup):
    m = make_manager([("gpu", 8), ("host", 4)], tmp_path)
    cleanup(m)
    d = Driver(m)
    x = d.write(tokens(16, 1))
    d.write(tokens(32, 2), chunk=32, suspend=False).close()  # X -> host: full, held
    assert set(page_levels(x)) == {1}
    assert m.get_storage_statistics(1).unavailable == 4
    a = d.write(tokens(28, 3), chunk=28, suspend=False)
    a.suspend()
    assert set(page_levels(a)) == {0}
    b = d.create(tokens(20, 4))
    assert b.resume()
    before = snapshot(m, a, b, x)
    assert d.step(b, 8) is False  # A's held pages cannot go anywhere
    assert snapshot(m, a, b, x) == before
    b.close()
    d.resume_and_verify(a)
    a.close()
    d.resume_and_verify(x)


# -- stats and events --------------------------------------------------------------------------


def test_offload_onboard_stats_and_moved_events(tmp_path, cleanup):
    rec = Recorder()
    pm = KvcmPluginManager()
    pm.register(SinkPlugin(rec), name="recorder")
    m = make_manager([("gpu", 8), ("host", 8), ("disk", 40)], tmp_path, pm=pm)
    cleanup(m)
    d = Driver(m)
    cold = m.storage_levels.cold_key_of[0][1]
    assert cold == m.stores[0][0].slot_bytes  # raw codec: the concatenated slot
    a = d.write(tokens(22, 1))      # 5 committed blocks + 1 uncommitted tail
    m.get_and_reset_iteration_stats()
    rec.events.clear()
    b = d.write(tokens(32, 2), chunk=32)
    c = d.write(tokens(32, 3), chunk=32)
    st = m.get_and_reset_iteration_stats()
    g = st.groups[0]
    # A: 6 pages GPU -> host -> disk; B: 8 pages GPU -> host.
    assert g.offload_blocks == 6 + 6 + 8
    assert g.offload_bytes == g.offload_blocks * cold
    assert g.onboard_blocks == 0 and g.onboard_bytes == 0
    moved = [e for e in rec.events if e.kind is EventKind.MOVED]
    # Only committed blocks are in the tree and have events: A 5 x 2 moves, B 8.
    assert len(moved) == 5 * 2 + 8
    assert all(e.level == e.from_level + 1 for e in moved)
    assert {(e.from_level, e.level, e.medium) for e in moved} == {
        (0, 1, "host"), (1, 2, "file")}
    a_keys = {e.block_key for e in moved if e.level == 2}
    assert len(a_keys) == 5
    rec.events.clear()
    assert a.resume()
    st = m.get_and_reset_iteration_stats()
    g = st.groups[0]
    assert g.onboard_blocks == 6
    assert g.onboard_bytes == 6 * cold
    up = [e for e in rec.events if e.kind is EventKind.MOVED and e.level == 0]
    assert {e.block_key for e in up} == a_keys
    assert all(e.from_level == 2 and e.medium == "device" for e in up)
    d.check(a)
    a.suspend()
    del c, b


# -- a property test -------------------------------------------------------------------------

_OPS = st.lists(
    st.tuples(st.sampled_from(["new"] * 3 + ["step"] * 6 + ["suspend"] * 3
                              + ["resume", "close", "mresize", "prefetch"]),
              st.integers(0, 7), st.integers(1, 12)),
    min_size=10, max_size=60)

#: Totals over the examples of the last run (to check the workload really moves pages).
PROP_TOTALS: dict[str, int] = {}


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture,
                                 HealthCheck.too_slow])
@given(ops=_OPS, layout=st.sampled_from(["full", "full", "hybrid"]),
       ahead=st.sampled_from([None, None, 1, 3]))
def test_random_workloads_over_three_levels(tmp_path_factory, ops, layout, ahead):
    tmp = tmp_path_factory.mktemp("prop")
    m = make_manager([("gpu", 6), ("host", 5), ("disk", 8)], tmp, layout=layout,
                     evict_ahead=ahead)
    d = Driver(m)
    prompts = [tokens(24, 7000 + i % 4) for i in range(8)]  # shared prefixes repeat
    open_caches = []
    serial = 0
    try:
        for op, k, n in ops:
            if op == "new":
                t = prompts[k % len(prompts)][: 8 + n] + tokens(6, 9000 + serial)
                serial += 1
                want = m.probe_reuse(None, t[: len(t) - 1])
                c = d.create(t)
                assert c.history_length == want
                open_caches.append(c)
            elif not open_caches:
                continue
            else:
                c = open_caches[k % len(open_caches)]
                if op == "step":
                    if c.status.name != "ACTIVE":
                        before = snapshot(m, *open_caches)
                        if not c.resume():
                            assert snapshot(m, *open_caches) == before
                            continue
                    if c.history_length < len(d.toks[id(c)]):
                        before = snapshot(m, *open_caches)
                        if not d.step(c, n):
                            assert snapshot(m, *open_caches) == before
                    d.check(c)
                elif op == "suspend":
                    if c.status.name == "ACTIVE":
                        c.suspend()
                elif op == "resume":
                    before = snapshot(m, *open_caches)
                    if c.resume():
                        d.check(c)
                    else:
                        assert snapshot(m, *open_caches) == before
                elif op == "close":
                    c.close()
                    open_caches.remove(c)
                elif op == "prefetch":
                    if c.status.name == "SUSPENDED":
                        c.prefetch(k % 2)
                elif op == "mresize":
                    for x in open_caches:
                        if x.status.name == "ACTIVE":
                            x.suspend()
                    level = k % 3
                    slots = [6, 5, 8][level] + (n % 5) - 2
                    before = snapshot(m, *open_caches)
                    if not m.resize(level, quota(layout, level, max(1, slots))):
                        assert snapshot(m, *open_caches) == before
            assert_invariants(m)
            for lv in range(3):
                for s in m.stores[lv]:
                    for p in s.pages():
                        assert m.storage_levels.arena.locks[p] == 0 or lv == 0
        # Everything left verifies, one at a time.
        for c in open_caches:
            if c.status.name == "ACTIVE":
                c.suspend()
        for c in open_caches:
            if c.resume():
                d.check(c)
                c.suspend()
        close_all(m)
        stats = m.get_and_reset_iteration_stats()
        for key, v in (("offload", sum(g.offload_blocks for g in stats.groups)),
                       ("onboard", sum(g.onboard_blocks for g in stats.groups)),
                       ("dropped", sum(g.dropped_blocks for g in stats.groups)),
                       ("reused_cold", sum(stats.reused_blocks_by_level[1:]))):
            PROP_TOTALS[key] = PROP_TOTALS.get(key, 0) + v
        assert_all_free(m)
    finally:
        if not m.is_shut_down:
            close_all(m)
            m.shutdown()
