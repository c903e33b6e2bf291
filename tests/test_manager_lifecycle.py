"""The request lifecycle on one (GPU) level, life cycles and pool layout, statistics and
events (concepts.md §2-5, 7, 11, 12; scenarios.md "Memory pressure", "Concurrency and
lifecycle"). Every request step goes through the fingerprint engine.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import pytest
from conftest import (
    PAGE,
    Driver,
    assert_invariants,
    full_layers,
    hybrid_layers,
    kv,
    page_holds,
    snapshot_state,
    table,
    tokens,
    tree_node,
    tree_page,
    windowed_layers,
)

from kvcm_core import (
    BAD_PAGE_INDEX,
    AttentionLayerConfig,
    BlockEvent,
    BufferConfig,
    CacheStatus,
    EventKind,
    EventSink,
    KVCacheManager,
    KvcmPluginManager,
    ReusePolicy,
    ReuseScope,
    SsmLayerConfig,
    hookimpl,
)

# -- the three lengths and page tables ---------------------------------------------------


def test_lengths_keep_committed_le_history_le_capacity_and_commit_whole_blocks(managers):
    m = managers(full_layers(), slots=32)
    d = Driver(m)
    t = tokens(27)
    c = d.create(t)
    assert (c.status, c.capacity, c.history_length, c.num_committed_tokens) == (
        CacheStatus.SUSPENDED, 0, 0, 0)
    assert c.resume()
    assert c.status is CacheStatus.ACTIVE
    for n in (5, 3, 1, 8, 1, 1, 1, 7):
        hist = c.history_length
        assert c.resize(hist + n)
        assert c.num_blocks == -(-(hist + n) // 4)
        assert len(table(c, 0)) == c.num_blocks
        d.engine.step([d_work(d, c)])
        c.commit(t[hist : hist + n])
        assert c.num_committed_tokens <= c.history_length <= c.capacity
        assert c.history_length == hist + n
        assert c.num_committed_tokens == (hist + n) // 4 * 4  # full blocks only
        assert_invariants(m)
    c.close()
    assert c.status is CacheStatus.CLOSED


def d_work(d: Driver, c):
    from kvcm_core.testing.fingerprint import StepWork

    return StepWork(c, d.toks[id(c)])


def test_capacity_may_shrink_dropping_tail_blocks(managers):
    m = managers(full_layers(), slots=32)
    d = Driver(m)
    t = tokens(30)
    c = d.create(t)
    d.run_to(c, 9)
    assert c.resize(24)
    assert c.num_blocks == 6
    used = m.get_storage_statistics(0).unavailable
    assert c.resize(10)  # the speculative room is given back
    assert c.num_blocks == 3
    assert m.get_storage_statistics(0).unavailable == used - 3
    d.run_to(c, 20, chunk=3)
    c.close()


def test_sliding_window_stale_blocks_are_bad_once_history_passes_them(managers):
    window, sinks, tpb = 8, 4, 4
    m = managers(windowed_layers(window=window, sinks=sinks), slots=64)
    d = Driver(m)
    t = tokens(40)
    c = d.create(t)
    assert c.resume()
    for _ in range(40):
        assert d.step(c, 1)
        h = c.history_length
        start = min(-(-h // tpb), 1)
        stop = max(start, (h + 1 - window) // tpb)
        tab = table(c, 0)
        for b, slot in enumerate(tab):
            if start <= b < stop:
                assert slot == BAD_PAGE_INDEX, (h, b, tab)
            else:
                assert slot != BAD_PAGE_INDEX, (h, b, tab)
    # Stale pages are no longer locked by the request: only sink + window blocks are.
    st = m.get_storage_statistics(0)
    assert st.unavailable == sum(1 for x in table(c, 0) if x != BAD_PAGE_INDEX)
    d.check(c)
    c.close()


def test_ssm_state_page_lives_at_block_history_div_tpb(managers):
    m = managers(hybrid_layers(), slots=32)
    d = Driver(m)
    ssm_g = m.get_layer_group_id(3)
    t = tokens(21)
    c = d.create(t)
    assert c.resume()
    slots = set()
    for n in (3, 1, 4, 6, 7):
        assert c.resize(c.history_length + n)
        tab = table(c, ssm_g)
        live = c.history_length // 4
        assert [b for b, x in enumerate(tab) if x != BAD_PAGE_INDEX] == [live]
        slots.add(tab[live])
        d.engine.step([d_work(d, c)])
        hist = c.history_length
        c.commit(t[hist : hist + n])
    assert len(slots) == 1  # one live state page, updated in place
    c.close()


def test_suspend_and_resume_keep_the_kv(managers):
    m = managers(hybrid_layers(), slots=32)
    d = Driver(m)
    t = tokens(30)
    c = d.create(t)
    d.run_to(c, 13)
    before = [table(c, g) for g in range(m.num_cache_groups)]
    c.suspend()
    assert c.status is CacheStatus.SUSPENDED
    c.suspend()  # suspending twice is harmless
    st = m.get_storage_statistics(0)
    assert st.unavailable == sum(sum(x != BAD_PAGE_INDEX for x in tab) for tab in before)
    assert c.resume()
    assert c.resume()  # resuming an active cache is a no-op
    assert [table(c, g) for g in range(m.num_cache_groups)] == before
    d.run_to(c, 30)
    c.close()


def test_speculative_room_then_history_moved_forward_by_resize(managers):
    m = managers(full_layers(), slots=32, max_rewind_len=4)
    d = Driver(m)
    t = tokens(20)
    c = d.create(t)
    d.run_to(c, 10)
    drafts = [*t[:10], t[10], t[11], 777, 778, *t[14:]]
    d.toks[id(c)] = drafts
    assert c.resize(14)
    d.engine.step([d_work(d, c)])  # drafts written at 10..13
    d.toks[id(c)] = t
    assert c.resize(15, history_length=12)  # two drafts accepted, two rejected
    assert c.history_length == 12
    d.engine.step([d_work(d, c)])  # checks 0..11, writes 12..14
    c.commit(t[10:15])
    assert c.history_length == 15
    d.run_to(c, 20)
    c.close()


# -- memory pressure ---------------------------------------------------------------------


def test_failed_resize_changes_nothing_says_why_then_succeeds_after_another_cache_closes(
        managers):
    m = managers(full_layers(), slots=10)
    d = Driver(m)
    a = d.create(tokens(32, seed=1))
    d.run_to(a, 32, chunk=8)  # 8 of 10 slots locked
    b = d.create(tokens(16, seed=2))
    d.run_to(b, 4)  # 9 of 10
    m.get_and_reset_iteration_stats()
    before = snapshot_state(m, a, b)
    assert b.last_refusal is None
    assert not b.resize(12)  # needs 2 more blocks, 1 free, nothing evictable
    assert b.last_refusal == (  # last_refusal: which level and pool group ran short, and why
        "resize: level 0 pool group 0 cannot provide 2 more pages (1 free, 0 evictable, 0 "
        "held by suspended caches, 9 locked by active caches, of 10; nothing can be moved "
        "out)")
    assert snapshot_state(m, a, b) == before
    assert not b.resize(13, history_length=4)
    assert snapshot_state(m, a, b) == before
    stats = m.get_and_reset_iteration_stats()
    assert all(g.dropped_blocks == 0 and g.intra_device_copies == 0 for g in stats.groups)
    d.check(a, b)
    a.close()
    assert_invariants(m)
    assert d.step(b, 8)  # evicts a's committed blocks as needed
    assert b.last_refusal is None  # a success clears it
    d.run_to(b, 16)
    b.close()


def test_request_larger_than_the_gpu_level_fails_cleanly(managers):
    m = managers(full_layers(), slots=10)
    d = Driver(m)
    warm = tokens(12, seed=5)
    d.run(warm)
    assert m.probe_reuse(None, warm[:11]) == 11
    big = d.create(tokens(60, seed=6))
    assert big.resume()
    before = snapshot_state(m, big)
    assert not big.resize(41)  # 11 blocks > 10 slots
    assert snapshot_state(m, big) == before
    assert m.probe_reuse(None, warm[:11]) == 11  # nothing was evicted for it
    d.run_to(big, 40, chunk=8)  # exactly the level: evicts the warm blocks
    assert m.probe_reuse(None, warm[:11]) == 0
    big.close()


def test_suspended_request_pages_are_held_and_cannot_be_evicted(managers):
    m = managers(full_layers(), slots=10)
    d = Driver(m)
    done = d.run(tokens(8, seed=1))  # 2 droppable blocks
    a = d.create(tokens(20, seed=2))
    d.run_to(a, 20)  # 5 blocks
    a.suspend()
    st = m.get_storage_statistics(0)
    assert (st.free, st.evictable, st.unavailable) == (3, 2, 5)
    b = d.create(tokens(40, seed=3))
    assert b.resume()
    assert not b.resize(24)  # 6 blocks: 3 free + 2 droppable are not enough
    assert d.step(b, 20)  # 5 blocks: the droppable ones are evicted, a's held ones stay
    assert m.probe_reuse(None, d.toks[id(done)][:7]) == 0
    assert not b.resize(24)
    b.suspend()
    assert a.resume()
    d.check(a)  # a's KV survived
    d.run_to(a, 20)
    a.close()
    assert b.resume()
    d.run_to(b, 40, chunk=4)
    b.close()


def test_resume_refused_over_max_util_changes_nothing_and_names_the_limit(managers):
    m = managers(full_layers(), slots=10, max_util_for_resume=0.5)
    d = Driver(m)
    a = d.create(tokens(16, seed=1))
    d.run_to(a, 16)  # 4 of 10 locked
    t = tokens(10, seed=2)
    d.run(t)
    b = d.create([*t, 1, 2], match_len=10)  # holds 3 reused pages: 4 + 3 > 5
    before = snapshot_state(m, a, b)
    assert not b.resume()
    assert b.last_refusal == (
        "resume: level 0 pool group 0 would have 7 of 10 slots locked, over "
        "max_util_for_resume=0.5 (5 slots)")
    assert snapshot_state(m, a, b) == before
    assert b.status is CacheStatus.SUSPENDED
    a.close()
    assert b.resume()
    assert b.last_refusal is None
    d.run_to(b, 12)
    b.close()


def test_engine_loop_finishes_a_request_that_already_holds_its_pages(managers):
    from kvcm_core.testing.engine import EngineLoop, Request

    m = managers(full_layers(), slots=16)
    b = tokens(33, seed=2)
    loop = EngineLoop(m, chunk_tokens=1, max_batch=2)
    loop.run([Request("warm", b[:2], 2)])  # b's first 2 tokens are reusable
    # a (8 blocks) and b (9 blocks) cannot both be resident (17 > 16), but a alone can
    # finish with the pages it holds, then b.
    loop.run([Request("a", tokens(31, seed=1), 1), Request("b", b, 3)])
    assert {r.id for r in loop.finished} == {"warm", "a", "b"}


# -- eviction ------------------------------------------------------------------------------


def _low_first(block: int) -> int:
    return 0 if block == 0 else 100


def test_evicting_a_full_attention_page_invalidates_the_subtree_below(managers):
    m = managers(full_layers(), slots=8)
    d = Driver(m)
    t = tokens(20, seed=1)
    d.run(t, priority_callback=_low_first)  # 5 droppable blocks, block 0 evicted first
    assert m.probe_reuse(None, t[:19]) == 19
    m.get_and_reset_iteration_stats()
    b = d.create(tokens(16, seed=2))
    d.run_to(b, 16)  # needs 4 slots: 3 free, then block 0 dropped with its subtree
    assert m.probe_reuse(None, t[:19]) == 0
    assert tree_node(m, t, 4) is None
    stats = m.get_and_reset_iteration_stats()
    assert stats.groups[0].dropped_blocks == 5
    st = m.get_storage_statistics(0)
    assert (st.free, st.unavailable) == (4, 4)
    b.close()


def test_evicting_a_window_page_keeps_the_subtree_but_a_sink_page_does_not(managers):
    m = managers(windowed_layers(window=8, sinks=4), slots=12)
    d = Driver(m)
    t = tokens(32, seed=1)
    d.run(t, priority_callback=lambda b: 0 if b == 2 else (1 if b == 0 else 100))
    assert m.probe_reuse(None, t[:31]) == 31
    b = d.create(tokens(20, seed=2))
    d.run_to(b, 20)  # 5 slots: 4 free + the window page of block 2
    assert tree_page(m, t, 2, 0) is None
    assert tree_page(m, t, 7, 0) is not None
    assert m.probe_reuse(None, t[:31]) == 31  # endpoint 31 does not need block 2
    c = d.create(tokens(4, seed=3))
    d.run_to(c, 4)  # 1 slot: the sink page of block 0 goes, and with it everything
    assert m.probe_reuse(None, t[:31]) == 0
    assert tree_node(m, t, 4) is None
    b.close()
    c.close()


def test_eviction_takes_stale_ancestors_but_never_a_suspended_request_held_pages(managers):
    m = managers(windowed_layers(window=8, sinks=4), slots=12)
    d = Driver(m)
    t = tokens(32, seed=1)
    d.run(t)  # 8 droppable blocks
    # b reuses endpoint 31: it holds sink block 0 and window blocks 6, 7 (7 is partial);
    # stale blocks 1..5 stay droppable ancestors of what b holds.
    b = d.create([*t, 5, 6], match_len=31)
    assert b.history_length == 31
    st = m.get_storage_statistics(0)
    assert (st.free, st.evictable, st.unavailable) == (4, 5, 3)
    c = d.create(tokens(40, seed=2))
    assert c.resume()
    assert not c.resize(40)  # 10 blocks > 4 free + 5 droppable
    assert c.resize(36)  # 9 blocks: every droppable page goes, none of b's
    assert all(tree_page(m, t, k, 0) is None for k in range(1, 6))
    assert tree_page(m, t, 0, 0) is not None and tree_page(m, t, 6, 0) is not None
    d.engine.step([d_work(d, c)])
    c.close()
    assert m.probe_reuse(None, t[:31]) == 31
    d.run_to(b, 33, chunk=1)  # b's reused pages still hold t's KV
    b.close()


# -- manager-wide operations -------------------------------------------------------------


def test_shutdown_and_clear_refused_while_caches_are_open_and_change_nothing(managers):
    from kvcm_core import InvalidStateError

    m = managers(full_layers(), slots=16)
    d = Driver(m)
    done = tokens(9, seed=1)
    d.run(done)
    c = d.create(tokens(10, seed=2))
    d.run_to(c, 10)
    before = snapshot_state(m, c)
    with pytest.raises(InvalidStateError, match="open"):
        m.shutdown()
    with pytest.raises(InvalidStateError, match="open"):
        m.clear_reusable_blocks()
    assert snapshot_state(m, c) == before
    assert m.probe_reuse(None, done[:8]) == 8
    d.run_to(c, 10)
    d.check(c)
    c.close()
    m.clear_reusable_blocks()
    assert m.probe_reuse(None, done[:8]) == 0
    st = m.get_storage_statistics(0)
    assert st.free == st.total
    m.shutdown()
    m.shutdown()  # idempotent
    with pytest.raises(InvalidStateError):
        m.create_kv_cache(None, [1, 2, 3])
    with pytest.raises(InvalidStateError):
        m.probe_reuse(None, [1, 2, 3])


def test_close_is_idempotent_and_releases_every_page(managers):
    m = managers(hybrid_layers(), slots=16)
    d = Driver(m)
    c = d.create(tokens(14))
    d.run_to(c, 14)
    c.close()
    after = snapshot_state(m)
    c.close()
    assert snapshot_state(m) == after
    assert m.num_open_caches == 0
    st = m.get_storage_statistics(0)
    assert st.unavailable == 0
    s = d.create(tokens(14, seed=2))
    s.close()  # a never-resumed cache closes too
    s.close()
    assert_invariants(m)


# -- life cycles, pools and addresses ---------------------------------------------------------


def _order_layers() -> list:
    def att(lid, window=None, sinks=0, policy=ReusePolicy.REQUIRED, size=PAGE):
        return AttentionLayerConfig(layer_id=lid, buffers=kv(size), sliding_window_size=window,
                                    num_sink_tokens=sinks, reuse_policy=policy)

    return [
        att(0, window=16),
        att(1),
        SsmLayerConfig(layer_id=2, buffers=[BufferConfig(role="state", size=48)]),
        att(3, window=8, sinks=4),
        att(4, window=8),
        att(5, policy=ReusePolicy.OPTIONAL),
        AttentionLayerConfig(layer_id=6, buffers=[BufferConfig(role="k", size=0)]),
        SsmLayerConfig(layer_id=7, buffers=[BufferConfig(role="state", size=48)],
                       reuse_policy=ReusePolicy.PRIVATE),
        SsmLayerConfig(layer_id=8, buffers=[BufferConfig(role="state", size=48)]),
        att(9, window=8, sinks=4, policy=ReusePolicy.SINK_REQUIRED_ONLY),
        att(10, window=8, sinks=8),
    ]


def test_life_cycles_register_in_the_deterministic_order(managers):
    m = managers(_order_layers())
    assert [lc.describe() for lc in m.life_cycles] == [
        "ssm/REQUIRED",
        "ssm/PRIVATE",
        "full/REQUIRED",
        "full/OPTIONAL",
        "window=8,sinks=0b/REQUIRED",
        "window=8,sinks=1b/REQUIRED",
        "window=8,sinks=1b/SINK_REQUIRED_ONLY",
        "window=8,sinks=2b/REQUIRED",
        "window=16,sinks=0b/REQUIRED",
    ]
    assert m.get_layer_group_id(2) == m.get_layer_group_id(8) == 0
    assert 6 not in m.layer_grouping  # a layer of size-0 buffers registers nothing
    reversed_m = managers(list(reversed(_order_layers())))
    assert [lc.describe() for lc in reversed_m.life_cycles] == [
        lc.describe() for lc in m.life_cycles]


def test_pool_groups_share_by_slot_sizes_and_pool_policy(managers):
    def att(lid, window=None, sinks=0, policy=ReusePolicy.REQUIRED, size=PAGE):
        return AttentionLayerConfig(layer_id=lid, buffers=kv(size), sliding_window_size=window,
                                    num_sink_tokens=sinks, reuse_policy=policy)

    m = managers([
        att(0),
        att(1, window=8, sinks=4, policy=ReusePolicy.SINK_REQUIRED_ONLY),
        att(2, window=16),
        att(3, policy=ReusePolicy.OPTIONAL),
        att(4, policy=ReusePolicy.PRIVATE),
        att(5, window=8, size=2 * PAGE),
    ])
    pg = {lid: m.buffer_attr(lid, "k").pool_group for lid in range(6)}
    assert pg[0] == pg[1] == pg[2]  # REQUIRED and SINK_REQUIRED_ONLY of one shape
    assert len({pg[0], pg[3], pg[4], pg[5]}) == 4
    descs = {d["id"]: d for d in m.pool_group_descs}
    assert descs[pg[0]]["policy"] == "REQUIRED"
    assert descs[pg[0]]["slot_sizes"] == [2 * PAGE]  # K and V coalesced in one slot
    assert len(descs[pg[0]]["cache_groups"]) == 3
    assert descs[pg[5]]["slot_sizes"] == [4 * PAGE]


def _places(m: KVCacheManager) -> list[tuple[int, str]]:
    return sorted(m.buffer_grouping)


@pytest.mark.parametrize("layers", [hybrid_layers(), full_layers()], ids=["hybrid", "full"])
def test_addresses_strides_and_index_converters_agree_with_the_written_pages(managers, layers):
    m = managers(layers, slots=16)
    d = Driver(m)
    t = tokens(22)
    c = d.create(t)
    d.run_to(c, 22)
    for layer_id, role in _places(m):
        attr = m.buffer_attr(layer_id, role)
        base = m.get_mem_pool_base_address(layer_id, role)
        stride = m.get_page_stride(layer_id, role)
        region = m.get_page_region(layer_id, role)
        conv = m.get_page_index_converter(layer_id, role)
        pool_base = base - attr.offset
        assert region.buffer.ptr + region.offset == base and region.stride == stride
        assert 0 <= attr.offset and attr.offset + attr.size <= stride
        tab = table(c, attr.group)
        lc = m.life_cycles[attr.group]
        for b, slot in enumerate(tab):
            if slot == BAD_PAGE_INDEX:
                continue
            addr = base + slot * stride
            assert region.buffer.ptr + region.page_start(slot) == addr
            assert pool_base + (slot * conv.scale + conv.offset) * attr.size == addr
            if not lc.is_ssm and (b + 1) * 4 <= c.history_length:
                assert page_holds(m, layer_id, role, slot, t, b, 4, address=addr)
    # Buffers sharing a pool never overlap inside a slot.
    spans: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for layer_id, role in _places(m):
        a = m.buffer_attr(layer_id, role)
        spans.setdefault((a.pool_group, a.pool), []).append((a.offset, a.offset + a.size))
    for ranges in spans.values():
        ranges.sort()
        assert all(x[1] <= y[0] for x, y in itertools.pairwise(ranges))
    c.close()


def test_split_layer_has_buffer_level_lookups_only(managers):
    from kvcm_core import ConfigError

    m = managers([
        AttentionLayerConfig(layer_id=0, buffers=[
            BufferConfig(role="k", size=PAGE),
            BufferConfig(role="k_scale", size=PAGE, reuse_policy=ReusePolicy.PRIVATE)]),
        AttentionLayerConfig(layer_id=1, buffers=kv()),
    ])
    with pytest.raises(ConfigError, match="split layer"):
        m.get_layer_group_id(0)
    with pytest.raises(ConfigError):
        _ = m.layer_grouping
    assert m.get_layer_group_id(1) == m.get_buffer_group_id(0, "k")
    assert m.get_buffer_group_id(0, "k_scale") != m.get_buffer_group_id(0, "k")
    assert m.buffer_grouping[(0, "k_scale")] == m.get_buffer_group_id(0, "k_scale")
    # The split layer still runs: its REQUIRED buffer's pages are reused, the PRIVATE
    # buffer gets fresh pages (never published, so never reused).
    d = Driver(m)
    t = tokens(9)
    d.run(t)
    assert m.probe_reuse(None, t[:8]) == 8
    c = m.create_kv_cache(None, t[:8])
    assert c.stats.reused_blocks == 2
    assert c.resume()
    private = table(c, m.get_buffer_group_id(0, "k_scale"))
    assert BAD_PAGE_INDEX not in private and len(set(private)) == 2
    assert c.stats.newly_allocated_blocks == 2
    c.close()


# -- statistics --------------------------------------------------------------------------------


def test_request_and_iteration_stats_count_reused_and_missed_blocks(managers):
    m = managers(full_layers(), slots=32)
    d = Driver(m)
    t = tokens(20)
    d.run(t)
    m.get_and_reset_iteration_stats()
    prompt = t[:18] + tokens(7, seed=4)  # 25 tokens, 24 looked up
    c = d.create(prompt)
    assert c.history_length == 18
    # 4 full blocks + 1 partial reused; blocks 5 of ceil(24 / 4) = 6 covered -> 1 missed.
    assert c.stats.reused_blocks == 5
    assert c.stats.missed_blocks == 1
    assert c.stats.allocated_blocks == 5
    assert c.stats.newly_allocated_blocks == 0
    stats = m.get_and_reset_iteration_stats()
    g = stats.groups[0]
    assert (g.reused_full_blocks, g.reused_partial_blocks, g.missed_blocks) == (4, 1, 1)
    assert (stats.lookups, stats.lookup_tokens, stats.hit_tokens) == (1, 24, 18)
    d.run_to(c, 25)
    assert c.stats.newly_allocated_blocks == 3  # the partial copy, blocks 5 and 6
    again = m.get_and_reset_iteration_stats()
    assert again.groups[0].intra_device_copies == 1
    assert again.lookups == 0
    c.close()
    fresh = d.create(tokens(9, seed=7))
    assert (fresh.stats.reused_blocks, fresh.stats.missed_blocks) == (0, 2)
    fresh.close()


def test_storage_statistics_identity_holds_through_a_request(managers):
    m = managers(hybrid_layers(), slots=20)
    d = Driver(m)
    c = d.create(tokens(30))
    assert c.resume()
    while c.history_length < 30:
        d.step(c, 3)
        st = m.get_storage_statistics(0)
        assert st.free + st.evictable + st.unavailable == st.total
        assert st.used_bytes <= st.total_bytes
    c.close()
    st = m.get_storage_statistics(0)
    assert st.unavailable == 0 and st.evictable > 0


# -- events ----------------------------------------------------------------------------------


class _Recorder(EventSink):
    def __init__(self) -> None:
        self.events: list[BlockEvent] = []

    def on_events(self, events: Sequence[BlockEvent]) -> None:
        self.events.extend(events)


class _SinkPlugin:
    def __init__(self, sink: EventSink) -> None:
        self.sink = sink

    @hookimpl
    def kvcm_event_sinks(self, config):
        return [self.sink]


def _recorded_manager() -> tuple[KVCacheManager, _Recorder]:
    """A GPU-only manager of full-attention layers whose events a recorder sink keeps."""
    from conftest import make_config

    rec = _Recorder()
    pm = KvcmPluginManager(autoload=True)
    pm.register(_SinkPlugin(rec), name="test-recorder")
    return KVCacheManager(make_config(full_layers(), quota=16 * 4 * PAGE),
                          plugin_manager=pm), rec


def test_a_chains_first_block_has_no_parent_key(managers):
    # BlockEvent.parent_key is None at the root: the first block of every chain (of any
    # scope, a lone partial block included) names no parent, never the scope root's digest.
    m, rec = _recorded_manager()
    d = Driver(m)
    d.run(tokens(9, seed=1))
    d.run(tokens(3, seed=2), scope=ReuseScope(lora_id=2))
    m.flush_events()
    announced = {e.block_key for e in rec.events}
    firsts = [e for e in rec.events if e.parent_key not in announced]
    assert len(firsts) == 2
    assert all(e.parent_key is None for e in firsts)
    m.shutdown()


def test_shutdown_announces_every_cached_block_removed(managers):
    # At shutdown every level's blocks go with the manager: a router must not keep
    # believing them cached. One REMOVED event per cached block and group, on the level
    # it was on, children before their parents.
    m, rec = _recorded_manager()
    d = Driver(m)
    d.run(tokens(10, seed=1))
    d.run(tokens(13, seed=2), scope=ReuseScope(lora_id=2))
    m.flush_events()
    cached = {e.block_key for e in rec.events if e.kind is EventKind.STORED} - \
        {e.block_key for e in rec.events if e.kind is EventKind.REMOVED}
    assert len(cached) == 7
    rec.events.clear()
    m.shutdown()
    assert all(e.kind is EventKind.REMOVED and e.level == 0 for e in rec.events)
    assert len(rec.events) == len(cached)
    assert {e.block_key for e in rec.events} == cached
    seen: set[str] = set()
    for e in rec.events:  # deepest first: no parent announced before its child
        assert e.block_key not in seen
        seen.add(e.block_key)
        assert e.parent_key is None or e.parent_key not in seen


def test_block_events_deliver_stored_and_removed(managers):
    m, rec = _recorded_manager()
    d = Driver(m)
    t = tokens(10)
    d.run(t)
    m.get_and_reset_iteration_stats()  # flushes
    stored = [e for e in rec.events if e.kind is EventKind.STORED]
    assert len(stored) == 3  # blocks 0, 1 and the partial block 2
    assert all(e.group == 0 and e.level == 0 and e.medium == "device" for e in stored)
    full = [e for e in stored if not e.block_key.startswith("partial")]
    assert [e.token_ids for e in full] == [tuple(t[0:4]), tuple(t[4:8])]
    assert full[1].parent_key == full[0].block_key
    assert full[0].parent_key is None  # a chain's first block: no parent block
    assert stored[-1].parent_key == full[1].block_key  # the partial block's parent
    assert full[0].block_key == m.tree.key(tree_node(m, t, 4)).hex()
    assert rec.events[-1].token_ids == tuple(t[8:10])
    rec.events.clear()
    m.clear_reusable_blocks()
    removed = [e for e in rec.events if e.kind is EventKind.REMOVED]
    assert {e.block_key for e in removed} == {e.block_key for e in stored}
    assert all(e.kind is EventKind.REMOVED for e in rec.events)
    m.shutdown()
