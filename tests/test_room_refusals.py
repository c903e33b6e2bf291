"""Calls that must make room on the GPU level refuse (``False``, the caller's state as it
was) instead of raising or half-applying when that room cannot be made after all:
- pool groups of different slot sizes can share one colder store, so the room one pool
  group's check counted on may be used by another's;
- a write of held pages to a colder level can fail while the room is being made.
Pages that moved down meanwhile stay there, valid and cached; every surviving page is
checked with the fingerprint engine, and locks and holds are checked against their
owners (by ``check_invariants`` and, where a refusal must change nothing, directly).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from levels_helpers import (
    Driver,
    assert_all_free,
    assert_invariants,
    faulty_disk,
    make_manager,
    page_levels,
    snapshot,
    tokens,
)

from kvcm_core import (
    AttentionLayerConfig,
    BufferConfig,
    KVCacheManager,
    KVCacheManagerConfig,
    LevelConfig,
)
from kvcm_core.testing.faults import FaultPlan

SLOT = 128  # bytes of a slot in each pool group below (K + V)


def _shared_cold_manager() -> KVCacheManager:
    """Two windowed layers whose K/V sizes differ (64+64 and 96+32 bytes): two GPU pool
    groups of 8 slots, one shared host store of 6 slots of 128 bytes."""
    layers = [
        AttentionLayerConfig(layer_id=0, sliding_window_size=64, buffers=[
            BufferConfig(role="k", size=64), BufferConfig(role="v", size=64)]),
        AttentionLayerConfig(layer_id=1, sliding_window_size=96, buffers=[
            BufferConfig(role="k", size=96), BufferConfig(role="v", size=32)]),
    ]
    m = KVCacheManager(KVCacheManagerConfig(
        tokens_per_block=4, kernel_backend="numpy", max_util_for_resume=1.0, layers=layers,
        levels=[LevelConfig(tier="gpu", quota=16 * SLOT + 64),
                LevelConfig(tier="host", quota=6 * SLOT + 64)]))
    assert len(m.stores[0]) == 2 and len(m.stores[1]) == 1, m.stores  # the shared store
    return m


def _lock_counts(m: KVCacheManager, pids: list[int]) -> list[tuple[int, int]]:
    a = m.storage_levels.arena
    return [(int(a.locks[p]), int(a.holds[p])) for p in pids]


def test_a_level_resize_whose_pool_groups_share_a_colder_store_changes_no_size_when_refused():
    """Each pool group alone could place its high pages in the shared host store, both
    cannot: ``resize`` returns False with every GPU pool group at its old size, and the
    suspended request resumes with every byte intact."""
    m = _shared_cold_manager()
    d = Driver(m)
    a = d.write(tokens(32, 1), chunk=8)  # 8 held pages in each GPU pool group
    sizes = [s.num_slots for s in m.stores[0]]
    assert not m.resize(0, 8 * SLOT + 64)  # 4 slots each: 4 + 4 pages for 6 host slots
    assert "cannot be placed" in (m.last_refusal or "")
    assert [s.num_slots for s in m.stores[0]] == sizes
    assert_invariants(m)
    d.resume_and_verify(a)
    a.close()
    assert_all_free(m)


def test_a_cache_resize_refuses_when_another_pool_group_used_the_shared_colder_room():
    """Both pool groups need 5 more slots; the host holds room for one group only. The
    cache keeps its capacity and pages in both groups, the other request's pages moved
    down are intact, and the resize succeeds once the room exists."""
    m = _shared_cold_manager()
    d = Driver(m)
    a = d.write(tokens(28, 1), chunk=8)  # 7 held pages in each GPU pool group
    b = d.create(tokens(24, 2), match_len=0)
    assert b.resume() and d.step(b, 4)  # one page each: the GPU is full
    before = (b.capacity, b.history_length, [list(b.pages(g)) for g in range(2)])
    assert not b.resize(24)
    assert "pool group 1" in (b.last_refusal or "")
    assert (b.capacity, b.history_length, [list(b.pages(g)) for g in range(2)]) == before
    assert_invariants(m)
    d.check(b)
    b.suspend()
    d.resume_and_verify(a)
    a.close()
    d.run_to(b)
    b.close()
    assert_all_free(m)


def test_set_beam_width_refuses_with_no_lock_taken_when_a_held_write_fails(tmp_path: Path):
    """The GPU is full of another request's held pages and the disk refuses every write:
    ``set_beam_width`` returns False and leaves every lock and hold as it was (before
    the fix the shared pages kept an extra lock and a GPU slot was lost for good)."""
    plan = FaultPlan()
    m = make_manager([("gpu", 8), ("faulty-disk", 20)], tmp_path, pm=faulty_disk(plan),
                     max_beam_width=2)
    d = Driver(m)
    a = d.write(tokens(24, 1), chunk=8)  # 6 held GPU pages
    b = d.create(tokens(6, 2), match_len=0)
    assert b.resume() and d.step(b, 6)  # 2 pages: the GPU is full
    pids = [int(p) for p in b.pages(0) if p >= 0]
    locks = _lock_counts(m, pids)
    before = snapshot(m, a, b)
    plan.fail_all_writes = True
    assert not b.set_beam_width(2)
    assert "could not make room" in (b.last_refusal or "")
    assert b.beam_width == 1 and _lock_counts(m, pids) == locks
    assert snapshot(m, a, b) == before  # the failed write moved nothing
    plan.fail_all_writes = False
    d.check(b)
    b.close()
    d.resume_and_verify(a)
    a.close()
    assert_all_free(m)


def test_a_commit_skips_its_best_effort_state_snapshot_when_making_room_fails(
        tmp_path: Path):
    """A hybrid model's commit at a block boundary snapshots the SSM state when there is
    room; with the GPU full of held pages and every disk write failing the snapshot is
    skipped: the commit itself completes (history and committed tokens advance)."""
    plan = FaultPlan()
    m = make_manager([("gpu", 3), ("faulty-disk", 20)], tmp_path, layout="hybrid",
                     pm=faulty_disk(plan))
    d = Driver(m)
    others = [d.write(tokens(6, 10 + i), chunk=3) for i in range(2)]
    b = d.create(tokens(8, 2), match_len=0)
    assert b.resume() and d.step(b, 3) and b.resize(4)
    d.engine.step(d.work(b))
    plan.fail_all_writes = True
    b.commit(d.toks[id(b)][3:4])
    assert (b.history_length, b.num_committed_tokens) == (4, 4)
    assert_invariants(m)
    plan.fail_all_writes = False
    d.run_to(b)
    b.close()
    d.resume_and_verify(*others)
    for c in others:
        c.close()
    assert_all_free(m)


def test_prefetch_moves_the_gpus_droppable_pages_down_rather_than_dropping_them(
        tmp_path: Path):
    """Prefetching a suspended request's pages into a GPU full of droppable pages moves
    those pages to the host, which has free slots: they stay cached, and a request with
    their prefix reuses all of them."""
    m = make_manager([("gpu", 8), ("host", 16)], tmp_path)
    d = Driver(m)
    a = d.write(tokens(24, 1), chunk=8)
    b = d.write(tokens(24, 2), chunk=8)  # pushes part of a to the host
    b.close()  # b's 6 blocks: droppable on the GPU
    assert any(lv > 0 for lv in page_levels(a))
    m.get_and_reset_iteration_stats()
    moved = a.prefetch(0)
    stats = m.get_and_reset_iteration_stats()
    assert moved > 0
    assert stats.groups[0].dropped_blocks == 0
    assert stats.groups[0].offload_blocks == moved
    c = d.create(tokens(24, 2))
    assert c.num_committed_tokens == 23  # all of b's blocks reused, the partial one too
    d.run_to(c)
    c.close()
    d.resume_and_verify(a)
    a.close()
    assert_all_free(m)


def test_check_invariants_names_a_lock_that_no_open_cache_accounts_for(tmp_path: Path):
    """A lock or hold that no open cache's references explain is a slot lost for good:
    ``check_invariants`` names the page (it passes again once the counts agree)."""
    m = make_manager([("gpu", 8)], tmp_path)
    d = Driver(m)
    a = d.write(tokens(12, 1), chunk=4, suspend=False)
    pid = int(a.pages(0)[0])
    arena = m.storage_levels.arena
    arena.locks[pid] += 1
    with pytest.raises(AssertionError, match=f"page {pid} .*1 references"):
        m.check_invariants()
    arena.locks[pid] -= 1
    a.suspend()
    arena.holds[pid] += 1
    with pytest.raises(AssertionError, match=f"page {pid} "):
        m.check_invariants()
    arena.holds[pid] -= 1
    m.check_invariants()
    a.close()
    assert_all_free(m)


def test_prefetch_pushes_no_held_page_down_at_any_level(tmp_path: Path):
    """The GPU's droppable pages make way for a prefetch by moving into the host's free
    slots only: a host full of another suspended request's held pages keeps them (no
    cascade to disk inside a prefetch), and the victims with no free slot below are
    dropped."""
    m = make_manager([("gpu", 8), ("host", 8), ("disk", 40)], tmp_path)
    d = Driver(m)
    a = d.write(tokens(32, 1), chunk=8)
    b = d.write(tokens(32, 2), chunk=8)
    c = d.write(tokens(32, 3), chunk=8, suspend=False)
    c.close()  # c's blocks: droppable on the GPU
    b_levels = page_levels(b)
    assert 1 in b_levels and any(lv > 0 for lv in page_levels(a))
    m.get_and_reset_iteration_stats()
    moved = a.prefetch(0)
    stats = m.get_and_reset_iteration_stats().groups[0]
    assert moved > 0 and page_levels(b) == b_levels
    assert stats.dropped_blocks == moved and stats.offload_blocks == 0  # the host was full
    assert_invariants(m)
    d.resume_and_verify(a, b)
    a.close()
    b.close()
    assert_all_free(m)
