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
import pytest
from conftest import assert_invariants, full_layers, hybrid_layers, make_manager, tokens
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
    num_slots = 128  # (more than any example takes: 12 closes of up to 6 pages, 40 rows)


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
    """However often closes insert what earlier ones queued (once ``FLUSH_RELEASED_AT``
    pages wait), the droppable policy ends with the same pages in the same order as with one
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
                store.flush_if_due()  # as a close does, before it changes anything
                store.unlock_all(pids[start:start + size][::-1].copy())
                start += size
                assert store._released_n < at + size
            orders.append(_state(store, pids))
    finally:
        storage.FLUSH_RELEASED_AT = default
    assert orders[0] == orders[1]


class _Refused(Exception):
    """A policy's insert that fails (a bug, or an interrupt landing inside it)."""


@pytest.mark.parametrize("layers", ["full", "hybrid"])
def test_a_close_whose_due_flush_is_refused_changes_nothing_and_can_be_retried(
        layers, monkeypatch):
    """A close inserts earlier closes' queued releases first, once the bound is reached;
    when a store's policy refuses that insert, the close raises having changed nothing
    (the request still ACTIVE, every page still locked by it, the invariants intact), and
    a retry closes it. With several stores (hybrid: attention, window and SSM groups) the
    flush must not run between two stores' releases, or the pages of the stores released
    before it would be released twice."""
    import kvcm_core.storage as storage

    make = full_layers if layers == "full" else hybrid_layers
    tried = 0
    for refusing in range(len(make_manager(make(), slots=64).storage_levels.stores[0])):
        m = make_manager(make(), slots=64)
        run(m, tokens(4 * TPB, seed=1)).close()  # queues releases on every GPU store
        b = run(m, tokens(4 * TPB, seed=2))
        stores = m.storage_levels.stores[0]
        if not stores[refusing]._released_n:  # (b's allocations inserted this one's)
            continue
        tried += 1
        held = [list(p) for p in b._pages]

        def refuse(*args: Any, **kw: Any) -> None:
            raise _Refused("the policy refused the insert")

        monkeypatch.setattr(storage, "FLUSH_RELEASED_AT", 1)
        monkeypatch.setattr(stores[refusing]._droppable, "insert_many_checked_by_caller",
                            refuse)
        with pytest.raises(_Refused):
            b.close()
        monkeypatch.undo()
        assert b.status.name == "ACTIVE"
        assert [list(p) for p in b._pages] == held
        assert_invariants(m)
        b.close()
        assert b.status.name == "CLOSED"
        assert_invariants(m)
    assert tried == (1 if layers == "full" else 2)  # (hybrid: one store had none queued)


def test_a_batch_resize_that_fails_gives_back_its_fresh_pages_without_the_policy(
        monkeypatch):
    """Batch.resize's error path hands back the pages no row got (Levels.release_locked):
    uncommitted, they are freed there and then, with no call into the eviction policy, so
    a policy that would refuse an insert at that moment (earlier closes' releases queued
    past the bound) leaks nothing and does not replace the original error."""
    import kvcm_core.storage as storage
    from kvcm_core import Batch

    m = make_manager(full_layers(), slots=64)
    run(m, tokens(4 * TPB, seed=1)).close()  # releases queued on the GPU store
    batch = Batch(m, max_rows=4, max_blocks_per_row=32)
    x, y = run(m, tokens(2 * TPB, seed=2)), run(m, tokens(2 * TPB, seed=3))
    batch.add_kv_cache(x)
    batch.add_kv_cache(y)
    batch.publish()
    store = m.storage_levels.stores[0][0]
    assert store._released_n
    real_grow = type(y).batch_grow

    def grow(self: Any, *args: Any, **kw: Any) -> Any:
        if self is y:
            raise _Refused("row 1's growth failed")
        return real_grow(self, *args, **kw)

    def refuse(*args: Any, **kw: Any) -> None:
        raise AssertionError("the policy was called on an error path")

    monkeypatch.setattr(type(y), "batch_grow", grow)
    monkeypatch.setattr(store._droppable, "insert_many_checked_by_caller", refuse)
    monkeypatch.setattr(storage, "FLUSH_RELEASED_AT", 1)
    with pytest.raises(_Refused, match="row 1"):
        batch.resize([6 * TPB, 6 * TPB, -1, -1])
    monkeypatch.undo()
    assert_invariants(m)
