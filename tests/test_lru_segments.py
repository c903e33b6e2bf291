"""The ``lru`` policy's array segments: many small segments in a row (a close's leaf and
partial blocks each enter one) are popped in exact LRU order, dead entries skipped."""

import random

import numpy as np
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
