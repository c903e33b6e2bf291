"""What a close does with each of its pages (KVCache.close, Store.unlock_all; docs/
internals.md "The lookup walk", last paragraph): committed pages nobody else locks become
evictable, pages another request still locks stay unavailable, uncommitted ones are freed,
a suspended request's held pages are released the same way, and the trailing partial block
is published only when there is one. Checked through the level's slot counts
(``free + evictable + unavailable == total``) and through what a later lookup reuses.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from conftest import full_layers, tokens
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcm_core.storage import PageArena, Store

TPB = 4


def counts(m: Any) -> tuple[int, int, int]:
    st = m.get_storage_statistics(0)
    assert st.free + st.evictable + st.unavailable == st.total
    return st.free, st.evictable, st.unavailable


def run(m: Any, toks: list[int], extra_blocks: int = 0) -> Any:
    """A request that commits ``toks`` with ``extra_blocks`` more blocks of room."""
    c = m.create_kv_cache(None, toks)
    assert c.resume() and c.resize(len(toks) + extra_blocks * TPB)
    c.commit(toks[c.history_length:])
    return c


def test_close_of_the_only_owner_makes_its_committed_pages_evictable(managers):
    m = managers(full_layers(), slots=32)
    c = run(m, tokens(5 * TPB))
    assert counts(m) == (27, 0, 5)
    c.close()
    assert counts(m) == (27, 5, 0)
    assert m.probe_reuse(None, tokens(5 * TPB)) == 5 * TPB


def test_close_frees_the_pages_it_never_committed(managers):
    m = managers(full_layers(), slots=32)
    c = run(m, tokens(3 * TPB), extra_blocks=4)
    assert counts(m) == (25, 0, 7)
    c.close()
    assert counts(m) == (29, 3, 0)


def test_close_leaves_pages_another_request_locks_unavailable(managers):
    m = managers(full_layers(), slots=32)
    prefix = tokens(4 * TPB)
    run(m, prefix).close()
    b = run(m, prefix + tokens(2 * TPB, seed=1))
    c = run(m, prefix + tokens(3 * TPB, seed=2))
    assert b.stats.reused_blocks == c.stats.reused_blocks == 4
    assert counts(m) == (32 - 9, 0, 9)  # 4 shared, 2 + 3 private
    b.close()
    assert counts(m) == (23, 2, 7)  # b's own blocks evictable, the prefix still c's
    c.close()
    assert counts(m) == (23, 9, 0)
    assert m.probe_reuse(None, prefix + tokens(2 * TPB, seed=1)) == 6 * TPB


def test_close_of_a_suspended_request_releases_its_held_pages(managers):
    m = managers(full_layers(), slots=32)
    c = run(m, tokens(4 * TPB), extra_blocks=2)
    c.suspend()
    c.close()
    free, evictable, unavailable = counts(m)
    assert (evictable, unavailable) == (4, 0)
    assert free == 28


def test_close_publishes_a_trailing_partial_block_and_nothing_for_a_full_one(managers):
    m = managers(full_layers(), slots=32)
    ten = tokens(10)  # two full blocks and 2 tokens
    run(m, ten).close()
    assert m.probe_reuse(None, ten + tokens(3, seed=9)) == 10
    eight = tokens(8, seed=4)
    run(m, eight).close()
    nodes = m.tree.num_nodes
    assert m.probe_reuse(None, eight + tokens(3, seed=9)) == 8
    run(m, eight).close()  # everything reused: no new node
    assert m.tree.num_nodes == nodes


def test_close_twice_changes_nothing_the_second_time(managers):
    m = managers(full_layers(), slots=32)
    c = run(m, tokens(3 * TPB))
    c.close()
    before = counts(m)
    version = c.page_table_version
    c.close()
    assert counts(m) == before
    assert c.page_table_version == version


def test_close_of_a_request_whose_every_page_another_locks_releases_none(managers):
    m = managers(full_layers(), slots=32)
    prefix = tokens(4 * TPB)
    a = run(m, prefix)
    b = m.create_kv_cache(None, prefix)
    assert b.resume() and b.resize(len(prefix))
    assert b.stats.reused_blocks == 4
    b.close()
    assert counts(m) == (28, 0, 4)  # still a's
    a.close()
    assert counts(m) == (28, 4, 0)


# -- Store.unlock_all against the general rule ------------------------------------------------

class _Pool:
    slot_bytes = 8
    num_slots = 64


def _store_with(rows: list[tuple[int, int, int, int]]) -> tuple[Any, np.ndarray]:
    """A store whose pages have these ``(locks, holds, node, priority)``: none is in a
    queue (each is locked, or a test's subject with its counts as given)."""
    from kvcm_eviction_lru.segments import SegmentLruPolicy

    store = Store(0, 1, 0, [_Pool()], SegmentLruPolicy, False, PageArena())
    pids = store.take(0, len(rows))
    a = store.arena
    for pid, (locks, holds, node, prio) in zip(pids.tolist(), rows, strict=True):
        a.locks[pid], a.holds[pid], a.node[pid], a.priority[pid] = locks, holds, node, prio
    return store, pids


def _state(store: Any, pids: np.ndarray) -> tuple:
    a = store.arena
    return (a.locks[pids].tolist(), a.holds[pids].tolist(), a.store[pids].tolist(),
            store.num_free, store.held.pop_victims(99).tolist(),
            store.droppable.pop_victims(99).tolist())


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 4), st.integers(0, 1),
                          st.sampled_from([-1, 3, 255, 256, 65535, 2**24 - 1]),
                          st.sampled_from([0, 35, 100])), min_size=1, max_size=40),
       st.booleans(), st.booleans())
def test_a_close_unlocks_each_page_as_the_general_rule_does(rows, no_holds, long_chain):
    """Whatever the counts (the only lock, others' locks on any subset, suspended
    owners, uncommitted pages, node ids whose bytes hold 0xff), unlock_all leaves the
    counts, the freed slots and both queues, in order, exactly as ``change(pids, -1, 0)``
    (the rule for one owner's release) does; also for chains longer than its column of
    ones (``long_chain``: one of three pages stands in for 8192)."""
    import kvcm_core.storage as storage

    if no_holds:  # the usual close: no suspended owner
        rows = [(locks, 0, node, prio) for locks, _, node, prio in rows]
    general, pids = _store_with(rows)
    fast, same = _store_with(rows)
    assert pids.tolist() == same.tolist()
    order = pids[::-1].copy()  # a close's order: deepest block first
    general.change(order, -1, 0)
    ones = storage._ONES
    try:
        if long_chain:
            storage._ONES = ones[:3]
            storage._ONE_LOCK = storage._ONES.tobytes()
        fast.unlock_all(order)
    finally:
        storage._ONES, storage._ONE_LOCK = ones, ones.tobytes()
    assert _state(fast, pids) == _state(general, pids)


@settings(max_examples=100, deadline=None)
@given(closes=st.lists(st.tuples(st.integers(1, 6), st.sampled_from([0, 35, 100])),
                       min_size=1, max_size=12),
       bound=st.integers(1, 8))
def test_closes_flush_their_queued_pages_at_the_bound_in_release_order(closes, bound):
    """However often closes insert what earlier ones queued (every ``FLUSH_RELEASED_AT``
    pages), the droppable policy ends with the same pages in the same order as with one
    insert at the end, and no close leaves more than the bound plus its own pages queued."""
    import kvcm_core.storage as storage

    rows = [(1, 0, 5 + i, prio) for i, (size, prio) in enumerate(closes) for _ in range(size)]
    orders = []
    default = storage.FLUSH_RELEASED_AT
    try:
        for at in (10**9, bound):
            storage.FLUSH_RELEASED_AT = at
            store, pids = _store_with(rows)
            start = 0
            for size, _ in closes:
                store.unlock_all(pids[start:start + size][::-1].copy())
                start += size
                assert store._released_n < at + size
            orders.append(_state(store, pids))
    finally:
        storage.FLUSH_RELEASED_AT = default
    assert orders[0] == orders[1]
