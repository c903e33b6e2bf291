"""Storage faults on paths found by ``kvcm soak``: a cold ``manager.resize`` whose page
moves fail (the pages that cannot be moved are dropped, or lost for their holders, and the
resize completes), and making room on the GPU while a write further down fails (the
droppable victims are dropped, never left out of their queue). No slot leaks and nothing
wrong is ever read."""

from __future__ import annotations

from pathlib import Path

from levels_helpers import (
    Driver,
    assert_all_free,
    assert_invariants,
    close_all,
    faulty_disk,
    faulty_tier,
    level_counts,
    make_manager,
    page_levels,
    quota,
    tokens,
)

from kvcm_core import KVCacheManager, TierIOError
from kvcm_core.testing.faults import FaultPlan


def _three_levels(tmp_path: Path) -> tuple[KVCacheManager, FaultPlan, Driver]:
    """GPU (8 blocks), host (4) and a faulty disk (40), with the disk's fault plan."""
    plan = FaultPlan()
    m = make_manager([("gpu", 8), ("host", 4), ("faulty-disk", 40)], tmp_path,
                     pm=faulty_disk(plan))
    return m, plan, Driver(m)


def test_a_cold_resize_whose_moves_fail_drops_or_loses_those_pages_and_completes(
        tmp_path) -> None:
    m, plan, d = _three_levels(tmp_path)
    for i in range(2):
        d.write(tokens(32, 50 + i), chunk=32).close()  # droppable: low disk slots
    held = [d.write(tokens(32, 40 + i), chunk=32) for i in range(3)]  # suspended: above
    d.write(tokens(32, 60), chunk=32).close()  # pushes the last held one to disk too
    assert all(2 in page_levels(c) for c in held) and faulty_tier(m, 2).writes > 0
    disk = m.get_storage_statistics(2)
    plan.fail_all_reads = True  # every page that must move out of a released slot fails
    # 30 of 40 slots: held pages in slots 30..35 must move (droppable ones make room).
    assert m.resize(2, quota("full", 2, 30)), m.last_refusal
    assert_invariants(m)
    assert m.get_storage_statistics(2).total < disk.total
    plan.fail_all_reads = False
    lost = 0
    for cache in held:
        try:
            ok = cache.resume()
        except TierIOError:
            lost += 1
            cache.close()
            continue
        assert ok
        d.check(cache)  # fingerprint-verified: nothing wrong was kept
        cache.suspend()
    assert lost >= 1, "some held page had to move and failed"
    for cache in m.open_caches:
        cache.close()
    assert_all_free(m)
    m.shutdown()


def test_making_room_when_a_write_further_down_fails_drops_the_droppable_victims(
        tmp_path) -> None:
    m, plan, d = _three_levels(tmp_path)
    held = [d.write(tokens(16, 1 + i), chunk=16) for i in range(3)]  # 4 blocks each
    d.write(tokens(32, 9), chunk=32).close()  # 8 droppable blocks fill the GPU
    assert sum(level_counts(c, 3)[1] for c in held) == 4  # the host is full of held pages
    assert m.get_storage_statistics(0).evictable == 8
    plan.fail_all_writes = True  # the host's held pages cannot go down to the disk
    late = d.create(tokens(16, 7))
    assert late.resume(), late.last_refusal  # the GPU victims are dropped instead
    assert_invariants(m)
    d.run_to(late)
    plan.fail_all_writes = False
    d.resume_and_verify(*held)
    late.close()
    close_all(m)
    assert_all_free(m)
    m.shutdown()
