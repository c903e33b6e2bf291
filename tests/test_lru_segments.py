"""The ``lru`` policy's array segments: many small segments in a row (a close's leaf and
partial blocks each enter one) are popped in exact LRU order, dead entries skipped."""

import random

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    rule,
    run_state_machine_as_test,
)
from kvcm_eviction_lru import segments
from kvcm_eviction_lru.segments import SegmentLruPolicy


def _reference_pop(order: dict[int, list[int]], k: int) -> list[int]:
    out: list[int] = []
    for p in sorted(order):
        while order[p] and len(out) < k:
            out.append(order[p].pop(0))
    return out


def test_runs_of_small_segments_pop_in_lru_order_skipping_dead_entries():
    rng = random.Random(7)
    policy = SegmentLruPolicy()
    order: dict[int, list[int]] = {}
    next_id = 0
    for _ in range(400):
        op = rng.random()
        if op < 0.55:  # a small batch (one or two pages, often one priority)
            n = rng.choice([1, 1, 1, 2, 3])
            pages = list(range(next_id, next_id + n))
            next_id += n
            prios = [rng.choice([0, 1, 1, 35]) for _ in pages]
            policy.insert_many(np.asarray(pages, dtype=np.int64),
                               np.asarray(prios, dtype=np.int64))
            for pg, pr in zip(pages, prios, strict=True):
                order.setdefault(pr, []).append(pg)
        elif op < 0.75:  # remove or touch some: dead entries stay in old segments
            live = [pg for q in order.values() for pg in q]
            if not live:
                continue
            chosen = rng.sample(live, min(len(live), rng.randint(1, 3)))
            if rng.random() < 0.5:
                policy.remove_many(np.asarray(chosen, dtype=np.int64))
                for q in order.values():
                    q[:] = [pg for pg in q if pg not in chosen]
            else:
                policy.touch_many(np.asarray(chosen, dtype=np.int64))
                for q in order.values():
                    moved = [pg for pg in chosen if pg in q]
                    q[:] = [pg for pg in q if pg not in chosen] + moved
        else:
            k = rng.randint(1, 12)
            got = policy.pop_victims(k).tolist()
            assert got == _reference_pop(order, k)
        assert len(policy) == sum(len(q) for q in order.values())
    assert policy.pop_victims(10**6).tolist() == _reference_pop(order, 10**6)
    assert len(policy) == 0


def test_one_page_checked_by_caller_calls_keep_the_state_and_order_of_the_batch_calls():
    # insert/remove_many_checked_by_caller of one page run on scalars: the same queues,
    # counts and victims as insert_many/remove_many of that page.
    rng = random.Random(11)
    fast, general = SegmentLruPolicy(), SegmentLruPolicy()
    present: list[int] = []
    for step in range(600):
        if present and rng.random() < 0.4:
            page = present.pop(rng.randrange(len(present)))
            fast.remove_many_checked_by_caller(np.array([page], dtype=np.int64))
            general.remove_many(np.array([page], dtype=np.int64))
        else:
            page = rng.choice([rng.randrange(3000), (1 << 22) + rng.randrange(50)])
            if page in present:
                continue
            prio = rng.choice([0, 1, 35, 100])
            arg = prio if rng.random() < 0.5 else np.array([prio], dtype=np.int64)
            fast.insert_many_checked_by_caller(np.array([page], dtype=np.int64), arg)
            general.insert_many(np.array([page], dtype=np.int64), prio)
            present.append(page)
        if step % 97 == 0:
            k = rng.randrange(1, 8)
            got = fast.pop_victims(k).tolist()
            assert got == general.pop_victims(k).tolist()
            present = [p for p in present if p not in got]
        assert len(fast) == len(general)
    assert fast.pop_victims(10_000).tolist() == general.pop_victims(10_000).tolist()


def test_mixed_priority_batches_from_the_manager_keep_exact_lru_order_per_priority():
    # The manager's moves insert victims with a priority each, in runs ([0.., 1.., 35..]
    # and every other shape): one copy shared by the runs' segments must order, pop and
    # compact exactly like one insert per page.
    rng = random.Random(11)
    policy = SegmentLruPolicy()
    order: dict[int, list[int]] = {}
    next_id = 0
    for _ in range(300):
        op = rng.random()
        if op < 0.5:
            n = rng.randint(1, 40)
            pages = np.arange(next_id, next_id + n, dtype=np.int64)
            next_id += n
            prios = np.sort(np.asarray([rng.choice([0, 1, 35, 35, 50]) for _ in range(n)]))
            if rng.random() < 0.3:
                rng.shuffle(prios)  # runs in any order, a priority in several runs
            policy.insert_many_checked_by_caller(pages, prios.astype(np.int64))
            for pg, pr in zip(pages.tolist(), prios.tolist(), strict=True):
                order.setdefault(pr, []).append(pg)
        elif op < 0.7:
            live = [pg for q in order.values() for pg in q]
            if live:
                chosen = rng.sample(live, min(len(live), rng.randint(1, 20)))
                policy.remove_many_checked_by_caller(np.asarray(chosen, dtype=np.int64))
                for q in order.values():
                    q[:] = [pg for pg in q if pg not in chosen]
        else:
            k = rng.randint(1, 60)
            assert policy.pop_victims(k).tolist() == _reference_pop(order, k)
        assert len(policy) == sum(len(q) for q in order.values())
    assert policy.pop_victims(10**6).tolist() == _reference_pop(order, 10**6)


def test_big_page_ids_grow_the_arrays_with_their_number_not_by_quadrupling():
    """Ids from 2**22 on are mapped to internal ids in order: the second one must not
    quadruple the arrays (it took them from 4M to 16M entries, 150 MB per policy)."""
    policy = SegmentLruPolicy()
    policy.insert_many([5, 1 << 22 | 5])
    first = len(policy._stamp)
    policy.insert_many([(1 << 31) - 1])
    policy.insert_many(np.arange(1 << 23, (1 << 23) + 1000, dtype=np.int64))
    assert len(policy._stamp) <= first + 2 * 1002
    assert sorted(policy.pop_victims(2000))[:2] == [5, 1 << 22 | 5]


def _check_internals(policy: SegmentLruPolicy) -> None:
    """The bookkeeping a pop trusts instead of reading stamps: per queue, its live and
    dead entries counted; a segment is in ``_dirty`` exactly when it holds a dead entry
    (one that is not, taken as it is, would hand out an absent page); the mask names
    the priorities with live pages; ``_entries`` counts every entry."""
    stamp = policy._stamp
    entries = 0
    serials = set()
    for p, queue in enumerate(policy._queues):
        live = 0
        for serial, seg in queue:
            alive = int(np.count_nonzero(stamp[seg] == serial))
            assert (alive < len(seg)) == (serial in policy._dirty), (p, serial)
            live += alive
            entries += len(seg)
            serials.add(serial)
        assert live == policy._live[p]
        assert sum(len(s) for _, s in queue) - live == policy._dead[p]
        assert bool(policy._mask >> p & 1) == (live > 0)
        assert live or not queue
    assert policy._dirty <= serials
    assert entries == policy._entries


class _SegmentMachine(RuleBasedStateMachine):
    """Random inserts (every entry point: checked, by the caller, by runs), removals and
    touches of runs of pages or scattered ones, priority moves, and pops of any size
    (a priority in part or whole, segments split): the victims are exactly the
    reference's (lowest priority first, least recently used first inside one), the runs
    of ``pop_victim_runs`` name their priorities, and the internals stay consistent."""

    def __init__(self) -> None:
        super().__init__()
        self.policy = SegmentLruPolicy()
        self.order: dict[int, list[int]] = {}
        self.next_id = 0

    def _present(self) -> list[int]:
        return [pg for p in sorted(self.order) for pg in self.order[p]]

    def _forget(self, pages: list[int]) -> None:
        gone = set(pages)
        for q in self.order.values():
            q[:] = [pg for pg in q if pg not in gone]

    def _new(self, n: int, big: bool) -> list[int]:
        base = (1 << 22) + 7 if big else 0
        pages = list(range(base + self.next_id, base + self.next_id + n))
        self.next_id += n
        return pages

    @rule(data=st.data(), n=st.integers(1, 40),
          how=st.sampled_from(["many", "checked", "runs"]), big=st.booleans())
    def insert(self, data: st.DataObject, n: int, how: str, big: bool) -> None:
        pages = self._new(n, big and how == "many")
        runs = []
        left = n
        while left:
            c = data.draw(st.integers(1, left))
            runs.append((data.draw(st.sampled_from([0, 1, 35, 35, 100])), c))
            left -= c
        prios = [p for p, c in runs for _ in range(c)]
        arr = np.asarray(pages, dtype=np.int64)
        if how == "many":
            self.policy.insert_many(arr, np.asarray(prios, dtype=np.int64))
        elif how == "checked":
            self.policy.insert_many_checked_by_caller(
                arr, prios[0] if len(runs) == 1 else np.asarray(prios, dtype=np.int64))
        else:
            self.policy.insert_runs_checked_by_caller(arr, runs)
        for pg, p in zip(pages, prios, strict=True):
            self.order.setdefault(p, []).append(pg)

    @rule(data=st.data(), checked=st.booleans(), touch=st.booleans())
    def remove_or_touch(self, data: st.DataObject, checked: bool, touch: bool) -> None:
        present = self._present()
        if not present:
            return
        if data.draw(st.booleans()):  # a run of neighbours (pages leave as they entered)
            a = data.draw(st.integers(0, len(present) - 1))
            chosen = present[a:a + data.draw(st.integers(1, 50))]
        else:
            chosen = data.draw(st.lists(st.sampled_from(present), min_size=1, max_size=60,
                                        unique=True))
        arr = np.asarray(chosen, dtype=np.int64)
        if touch:
            self.policy.touch_many(arr)
            moved = {pg: p for p, q in self.order.items() for pg in q if pg in set(chosen)}
            self._forget(chosen)
            for pg in chosen:
                self.order[moved[pg]].append(pg)
        else:
            if checked and max(chosen) < 1 << 22:
                self.policy.remove_many_checked_by_caller(arr)
            else:
                self.policy.remove_many(arr)
            self._forget(chosen)

    @rule(data=st.data())
    def set_priority(self, data: st.DataObject) -> None:
        present = self._present()
        if not present:
            return
        chosen = data.draw(st.lists(st.sampled_from(present), min_size=1, max_size=5,
                                    unique=True))
        p = data.draw(st.sampled_from([0, 1, 35, 100]))
        self.policy.set_priority_many(chosen, p)
        self._forget(chosen)
        self.order.setdefault(p, []).extend(chosen)

    @rule(k=st.integers(0, 120), with_runs=st.booleans())
    def pop(self, k: int, with_runs: bool) -> None:
        expected = _reference_pop(self.order, k)
        if with_runs:
            got, runs = self.policy.pop_victim_runs(k)
            assert runs is not None and sum(c for _, c in runs) == len(expected)
            assert all(c >= 1 for _, c in runs)
            prios = [p for p, c in runs for _ in range(c)]
            assert len(set(prios)) == len(runs) and prios == sorted(prios)
        else:
            got = self.policy.pop_victims(k)
        assert got.tolist() == expected

    @invariant()
    def consistent(self) -> None:
        assert len(self.policy) == sum(len(q) for q in self.order.values())
        _check_internals(self.policy)


_MACHINE_SETTINGS = settings(max_examples=150, stateful_step_count=40, deadline=None,
                             suppress_health_check=[HealthCheck.too_slow])


def test_pops_follow_the_reference_and_the_bookkeeping_holds_under_random_calls():
    run_state_machine_as_test(_SegmentMachine, settings=_MACHINE_SETTINGS)


def test_the_same_when_the_queues_are_rebuilt_often(monkeypatch):
    # (Rebuilds drop every dead entry and start new segments: the bookkeeping restarts.)
    monkeypatch.setattr(segments, "_COMPACT_SLACK", 8)
    run_state_machine_as_test(_SegmentMachine, settings=_MACHINE_SETTINGS)


def test_reserve_sizes_the_arrays_once_and_changes_no_order():
    """``reserve`` (the manager's hint: the page arena's size) sizes the arrays up front,
    so that the batches that follow never grow them, and the policy answers exactly as
    one that grew them on the way."""
    rng = random.Random(5)
    a, b = SegmentLruPolicy(), SegmentLruPolicy()
    a.reserve(6000)
    grown = a._stamp
    assert len(grown) >= 6000
    pages = np.array(rng.sample(range(6000), 3000), dtype=np.int64)
    prios = np.array([rng.choice([10, 50, 50, 50]) for _ in pages], dtype=np.int64)
    for p in (a, b):
        p.insert_many_checked_by_caller(pages, prios)
        p.remove_many(pages[::7])
        p.touch_many(np.delete(pages, np.arange(0, len(pages), 7))[::5][:100])
    assert a._stamp is grown  # never grown again
    for k in (1, 40, 500, 5000):
        assert a.pop_victims(k).tolist() == b.pop_victims(k).tolist()
    a.reserve(100)  # smaller than it is: nothing changes
    assert a._stamp is grown


def test_a_manager_reserves_each_levels_droppable_queue_for_its_page_arena(monkeypatch):
    from kvcm_core.bench.manager import make_manager

    seen: list[int] = []
    real = SegmentLruPolicy.reserve
    monkeypatch.setattr(SegmentLruPolicy, "reserve",
                        lambda self, n: seen.append(n) or real(self, n))
    m = make_manager(16, 5000)
    try:
        assert seen == [m.storage_levels.arena.capacity] and seen[0] >= 5000
    finally:
        m.shutdown()
