"""Regressions of session 25's hot-path work that its review found: a policy built on the
``lru`` plugin's class keeps choosing and filing its pages itself, and a wrapper set on the
numpy backend instance (tracing, fault injection) still sees every page copy."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from kvcm_eviction_lru.segments import SegmentLruPolicy
from levels_helpers import TPB, Driver, make_manager, tokens


class _CountingPops(SegmentLruPolicy):
    calls = 0

    def pop_victims(self, k):  # type: ignore[no-untyped-def]
        type(self).calls += 1
        return super().pop_victims(k)


class _CappedInserts(SegmentLruPolicy):
    """Files every page at priority 50 at most."""

    def insert_many_checked_by_caller(self, pages, priorities):  # type: ignore[no-untyped-def]
        capped = min(priorities, 50) if isinstance(priorities, int) else \
            np.minimum(priorities, 50)
        super().insert_many_checked_by_caller(pages, capped)


def test_a_subclass_of_the_lru_policy_that_picks_its_own_victims_is_asked_for_them() -> None:
    p = _CountingPops()
    p.insert_many_checked_by_caller(np.arange(6, dtype=np.int64), 10)
    _CountingPops.calls = 0
    pages, runs = p.pop_victim_runs(3)
    assert _CountingPops.calls == 1 and runs is None
    assert list(pages) == [0, 1, 2]


def test_a_subclass_of_the_lru_policy_that_files_its_own_pages_files_runs_itself() -> None:
    p = _CappedInserts()
    p.insert_runs_checked_by_caller(np.arange(4, dtype=np.int64), [(90, 2), (10, 2)])
    assert [p.priority_of(i) for i in range(4)] == [50, 50, 10, 10]


def test_making_room_asks_a_subclassed_lru_policy_of_the_level_for_its_victims(
        tmp_path: Path) -> None:
    m = make_manager([("gpu", 8), ("host", 16)], tmp_path)
    for store in m.storage_levels.stores[0]:
        store.droppable.__class__ = _CountingPops  # (the same state: a subclass's view)
    _CountingPops.calls = 0
    d = Driver(m)
    for i in range(4):
        c = d.create(tokens(6 * TPB, seed=i), match_len=0)
        d.run_to(c)
        c.close()
    assert _CountingPops.calls > 0
    m.shutdown()


def test_a_copy_wrapper_set_on_the_numpy_backend_sees_the_moves_to_pinned_host(
        tmp_path: Path) -> None:
    m = make_manager([("gpu", 8), ("host", 16)], tmp_path)
    real = m.backend.copy_pages_batch
    pages = []

    def wrapped(tasks, stream=None):  # type: ignore[no-untyped-def]
        pages.extend(len(t.pairs) for t in tasks)
        return real(tasks, stream)

    m.backend.copy_pages_batch = wrapped
    d = Driver(m)
    for i in range(4):
        c = d.create(tokens(6 * TPB, seed=i), match_len=0)
        d.run_to(c)
        c.close()
    assert m.get_storage_statistics(1).total - m.get_storage_statistics(1).free > 0
    assert sum(pages) > 0
    m.shutdown()
