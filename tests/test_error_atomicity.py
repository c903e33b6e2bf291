"""A call that fails or is refused changes nothing (semantics: "Refusals and errors"):
the refused first resume of a cache with a reuse choice, a beam fork that fails half-way,
a level resize whose second pool cannot grow, a bad argument met before a refusal, the
last refusal's reason across an error, and token arguments that are no token list."""
from __future__ import annotations

import numpy as np
import pytest
from levels_helpers import (
    PAGE,
    Driver,
    Recorder,
    SinkPlugin,
    assert_all_free,
    assert_invariants,
    close_all,
    faulty_disk,
    make_manager,
    page_levels,
    quota,
    snapshot,
    tokens,
)

import kvcm_core.testing.faults as faults
from kvcm_core import (
    ArgumentTypeError,
    AttentionLayerConfig,
    Batch,
    BufferConfig,
    InvalidArgumentError,
    KVCacheManager,
    KVCacheManagerConfig,
    KvcmPluginManager,
    LevelConfig,
    ReusePolicy,
    TierIOError,
)
from kvcm_core.testing.faults import FaultPlan
from kvcm_core.testing.fingerprint import FingerprintEngine, StepWork


@pytest.fixture
def built(tmp_path):
    """Managers made by ``build(tiers, **kw)`` (a faulty disk as level 2), each closed,
    checked for leaks and shut down at the end (writes to the disk synchronous)."""
    made = []

    def build(tiers=(("gpu", 8), ("host", 8), ("faulty-disk", 24)), **kw):
        plan = FaultPlan()
        kw.setdefault("disk", {"write_queue_depth": 0})  # writes fail where they are made
        m = make_manager(list(tiers), tmp_path / f"m{len(made)}", pm=faulty_disk(plan), **kw)
        made.append(m)
        return m, plan

    yield build
    for m in made:
        close_all(m)
        assert_invariants(m)
        assert_all_free(m)
        m.shutdown()


def _optional_v(policy=ReusePolicy.OPTIONAL):
    """Layer 0's V is OPTIONAL (cache group 1), everything else REQUIRED (group 0)."""
    return [AttentionLayerConfig(layer_id=0, buffers=[
                BufferConfig(role="k", size=PAGE),
                BufferConfig(role="v", size=PAGE, reuse_policy=policy)]),
            AttentionLayerConfig(layer_id=1, buffers=[BufferConfig(role="k", size=PAGE),
                                                      BufferConfig(role="v", size=PAGE)])]


def test_refused_first_resume_keeps_the_declined_optional_claims_and_the_choice_open(
        built, monkeypatch):
    monkeypatch.setitem(__import__("levels_helpers").LAYOUTS, "optional", _optional_v)
    m, plan = built(layout="optional")
    d = Driver(m)
    base = tokens(24, 3)
    d.write(base, chunk=24, suspend=False).close()   # its blocks stay in the tree
    x = d.write(tokens(32, 1), chunk=32)             # suspended: they push base to disk
    y = d.write(tokens(32, 2), chunk=32)
    c = m.create_kv_cache(None, base[:20])
    assert c.reuse_status[1].complete
    assert set(page_levels(c)) == {2}
    plan.fail_all_writes = True                      # making room on level 0 fails
    before = snapshot(m, x, y, c)
    assert c.resume(optional_reuse_groups=[]) is False
    assert c.last_refusal
    assert snapshot(m, x, y, c) == before            # the declined V claims are still held
    plan.fail_all_writes = False
    assert c.resume(optional_reuse_groups=[1])       # the choice was not made: it can change
    assert c.recompute_blocks(1) == []               # V reused, nothing to recompute
    d.toks[id(c)] = list(base[:20])
    d.check(c)


def test_beam_fork_with_ssm_state_and_priorities_takes_a_priority_for_the_state_copy(
        built):
    m, _ = built(tiers=(("gpu", 16), ("host", 8)), layout="hybrid", max_beam_width=2)
    d = Driver(m)
    c = m.create_kv_cache(None, [], priority_callback=lambda block: 50)
    d.toks[id(c)] = tokens(20, 1)
    d.run_to(c, 10)
    assert c.set_beam_width(2)                       # was: KeyError(-1), pages leaked
    assert c.beam_width == 2
    assert_invariants(m)


def test_beam_fork_failing_half_way_releases_what_it_took(built, monkeypatch):
    m, _ = built(tiers=(("gpu", 16), ("host", 8)), layout="hybrid", max_beam_width=3)
    d = Driver(m)
    c = m.create_kv_cache(None, [])
    d.toks[id(c)] = tokens(22, 1)
    d.run_to(c, 10)
    before = snapshot(m, c)
    version = c.page_table_version
    calls = {"n": 0}
    real = type(m.storage_levels).copy_blocks

    def copy_blocks(self, *args, **kw):  # the second beam's state copy fails
        calls["n"] += 1
        if calls["n"] == 4:
            raise TierIOError("injected: a copy failed")
        return real(self, *args, **kw)

    monkeypatch.setattr(type(m.storage_levels), "copy_blocks", copy_blocks)
    with pytest.raises(TierIOError):
        c.set_beam_width(3)
    assert calls["n"] == 4
    assert c.beam_width == 1
    assert c.page_table_version == version
    assert snapshot(m, c) == before
    assert_invariants(m)


@pytest.mark.parametrize("factor", [2.0, 0.5], ids=["grow", "shrink"])
def test_level_resize_whose_second_pool_fails_leaves_every_store_at_its_size(
        built, monkeypatch, factor):
    m, _ = built(layout="hybrid")                    # the disk level has three stores
    d = Driver(m)
    c = d.write(tokens(20, 1))
    sizes = [s.num_slots for s in m.stores[2]]
    pools = [[p.num_slots for p in s.pools] for s in m.stores[2]]
    before = snapshot(m, c)
    calls = {"n": 0}
    real = faults.FaultyStoragePool.resize

    def resize(self, num_slots):
        calls["n"] += 1
        if calls["n"] == 2:
            raise TierIOError("injected: [Errno 28] No space left on device")
        return real(self, num_slots)

    monkeypatch.setattr(faults.FaultyStoragePool, "resize", resize)
    assert m.resize(2, int(m.config.levels[2].quota * factor)) is False
    assert "kept its size" in m.last_refusal
    assert [s.num_slots for s in m.stores[2]] == sizes
    assert [[p.num_slots for p in s.pools] for s in m.stores[2]] == pools
    assert snapshot(m, c) == before
    monkeypatch.setattr(faults.FaultyStoragePool, "resize", real)
    d.resume_and_verify(c)


@pytest.mark.parametrize("history", [-1, 2.5, "x", 999])
def test_bad_history_length_is_an_error_even_when_the_capacity_would_be_refused(
        built, history):
    m, _ = built(tiers=(("gpu", 4), ("host", 8)))
    c = m.create_kv_cache(None, [])
    assert c.resume() and c.resize(8)
    with pytest.raises((InvalidArgumentError, ArgumentTypeError)):
        c.resize(100, history)                       # 100 tokens never fit 4 slots


@pytest.mark.parametrize("bad", ["x", 5, [99], [True]])
def test_bad_reuse_choice_is_an_error_even_when_the_resume_would_be_refused(built, bad):
    m, _ = built(tiers=(("gpu", 4), ("host", 8)))
    b = m.create_kv_cache(None, [])
    assert b.resume() and b.resize(8)
    b.suspend()
    a = m.create_kv_cache(None, [])
    assert a.resume() and a.resize(16)               # level 0 full: b's resume is refused
    assert b.resume() is False
    with pytest.raises((InvalidArgumentError, ArgumentTypeError)):
        b.resume(optional_reuse_groups=bad)


def test_a_call_that_raises_keeps_the_last_refusal(built):
    m, _ = built(tiers=(("gpu", 4), ("host", 8)))
    c = m.create_kv_cache(None, [])
    assert c.resume() and c.resize(8)
    assert c.resize(100) is False
    reason = c.last_refusal
    assert reason
    with pytest.raises(InvalidArgumentError):
        c.resize(-1)
    assert c.last_refusal == reason
    with pytest.raises(InvalidArgumentError):
        c.set_beam_width(0)
    assert c.last_refusal == reason
    assert c.resize(12)
    assert c.last_refusal is None                    # a success clears it


@pytest.mark.parametrize("row", [99, -1, "x", 1.0, True])
def test_mark_dirty_of_a_row_the_batch_lacks_is_refused_and_publish_still_works(
        built, row):
    m, _ = built(tiers=(("gpu", 8), ("host", 8)))
    batch = Batch(m, max_rows=4, max_blocks_per_row=8)
    c = m.create_kv_cache(None, [])
    assert c.resume() and c.resize(8)
    batch.add_kv_cache(c)
    with pytest.raises((InvalidArgumentError, ArgumentTypeError)):
        batch.mark_dirty(row)
    batch.publish()
    batch.mark_dirty(0)
    assert batch.publish() == 1
    batch.remove_kv_cache(c)
    batch.close()


@pytest.mark.parametrize("bad", [{5: 0, 6: 0}, {5, 6}, "ab", b"ab", (t for t in [5, 6])],
                         ids=["dict", "set", "str", "bytes", "generator"])
def test_tokens_that_are_no_token_list_are_refused_everywhere(built, bad):
    m, _ = built(tiers=(("gpu", 8), ("host", 8)))
    with pytest.raises(ArgumentTypeError):
        m.create_kv_cache(None, bad)
    with pytest.raises(ArgumentTypeError):
        m.probe_reuse(None, bad)
    c = m.create_kv_cache(None, [])
    assert c.resume() and c.resize(8)
    with pytest.raises(ArgumentTypeError):
        c.commit(bad)
    assert c.num_committed_tokens == 0


def _beams_in_a_batch(width=3, window=True):
    """A seated cache with ``width`` beams forked at history 9 (full attention and, with
    ``window``, a windowed group); returns (manager, batch, cache)."""
    layers = [AttentionLayerConfig(layer_id=0, buffers=[BufferConfig(role="k", size=64)])]
    if window:
        layers.append(AttentionLayerConfig(layer_id=1, buffers=[
            BufferConfig(role="k", size=128)], sliding_window_size=8))
    m = KVCacheManager(KVCacheManagerConfig(
        tokens_per_block=4, layers=layers, levels=[LevelConfig(tier="gpu", quota=64 * 192)],
        max_rewind_len=8, max_beam_width=width, kernel_backend="numpy"))
    batch = Batch(m, max_rows=2, max_blocks_per_row=16, max_beam_width=width)
    engine = FingerprintEngine(m, batch)
    c = m.create_kv_cache(None, [])
    assert c.resume()
    batch.add_kv_cache(c)
    c.stop_committing()
    assert c.resize(9)
    batch.publish()
    engine.step([StepWork(c, list(range(1, 40)))])
    assert c.resize(9, history_length=9)
    assert c.set_beam_width(width)
    batch.publish()
    return m, batch, c


def _tables(c, groups):
    return [[c.get_base_page_indices(g, b).tolist() for b in range(c.beam_width)]
            for g in range(groups)]


@pytest.mark.parametrize("k", [1, 2, 3, 4])
@pytest.mark.parametrize("via_batch", [False, True], ids=["cache", "batch"])
def test_rewind_below_forks_interrupted_in_a_copy_leaks_no_page_and_the_row_matches(
        monkeypatch, k, via_batch):
    m, batch, c = _beams_in_a_batch()
    version = c.page_table_version
    real = m.backend.copy_pages_batch
    calls = {"n": 0}

    def copy(tasks, stream=None):  # the k-th device copy is interrupted
        calls["n"] += 1
        if calls["n"] == k:
            raise KeyboardInterrupt("injected")
        return real(tasks, stream)

    monkeypatch.setattr(m.backend, "copy_pages_batch", copy)
    with pytest.raises(KeyboardInterrupt):
        if via_batch:
            batch.resize([10, -1], [5, -1])
        else:
            c.resize(10, history_length=5)
    monkeypatch.setattr(m.backend, "copy_pages_batch", real)
    m.check_invariants()                             # no page without its owner
    assert c.page_table_version != version           # a seated row is marked again
    if via_batch:
        assert batch.dirty_rows().tolist() == []     # published before it propagated
        table = batch.read_page_table(0)[0]
        for b in range(3):
            mine = c.get_base_page_indices(0, b)
            assert table[b, :len(mine)].tolist() == mine.tolist()
    batch.remove_kv_cache(c)
    c.close()
    batch.close()
    m.clear_reusable_blocks()
    st = m.get_storage_statistics(0)
    assert st.free == st.total
    m.shutdown()


def test_interrupt_while_a_release_waits_for_readers_changes_nothing(monkeypatch):
    m, batch, c = _beams_in_a_batch(width=2, window=False)
    assert batch.resize([16, -1])[0]
    batch.record_read()
    before = (c.capacity, _tables(c, 1), c.page_table_version)
    real = batch.wait_readers

    def wait():  # Ctrl-C while a kernel still reads the row (a GPU's poll loop)
        monkeypatch.setattr(batch, "wait_readers", real)
        raise KeyboardInterrupt("injected")

    monkeypatch.setattr(batch, "wait_readers", wait)
    with pytest.raises(KeyboardInterrupt):
        batch.resize([12, -1])                       # shrink: both beams release block 3
    m.check_invariants()
    assert (c.capacity, _tables(c, 1)) == before[:2]
    batch.remove_kv_cache(c)
    c.close()
    batch.close()
    m.shutdown()


@pytest.mark.parametrize("beam", [False, 0.0, "0", None])
def test_beam_argument_that_is_no_int_is_a_type_error_even_when_it_equals_zero(built, beam):
    m, _ = built(tiers=(("gpu", 8), ("host", 8)))
    c = m.create_kv_cache(None, [])
    assert c.resume() and c.resize(8)
    with pytest.raises(ArgumentTypeError):
        c.get_base_page_indices(0, beam)
    assert c.get_base_page_indices(0, np.int64(0)).tolist() == \
        c.get_base_page_indices(0, 0).tolist()


def test_level_resize_that_fits_is_not_refused_after_one_store_freed_another(tmp_path):
    """Making room in one store of a level drops blocks whose pages in the other stores
    (other life cycles) sat in the slots those give up: the shortfall is counted again,
    or the resize is refused after dropping blocks (and an identical one then succeeds)."""
    rec = Recorder()
    pm = KvcmPluginManager()
    pm.register(SinkPlugin(rec), name="rec")
    m = make_manager([("gpu", 4), ("host", 2), ("disk", 4)], tmp_path, layout="hybrid", pm=pm)
    d = Driver(m)
    for seed in range(4):  # four closed requests, the older ones pushed down to the disk
        d.write(tokens(16, seed), suspend=False).close()
    assert m.resize(2, quota("hybrid", 2, 1)), m.last_refusal
    assert [s.num_slots for s in m.stores[2]] == [1] * len(m.stores[2])
    assert_invariants(m)
    m.shutdown()


def test_a_chosen_optional_group_counts_a_reused_partial_block_as_partial(tmp_path):
    layers = [AttentionLayerConfig(layer_id=0, buffers=[
        BufferConfig(role="k", size=PAGE),
        BufferConfig(role="v", size=PAGE, reuse_policy=ReusePolicy.OPTIONAL)])]
    m = KVCacheManager(KVCacheManagerConfig(
        tokens_per_block=4, layers=layers, kernel_backend="numpy",
        levels=[LevelConfig(tier="gpu", quota=32 * PAGE * 2)]))
    d = Driver(m)
    t = tokens(20, 1)
    d.write(t[:10], suspend=False, match_len=0).close()  # 2 full blocks, 2 tokens partial
    m.get_and_reset_iteration_stats()
    b = m.create_kv_cache(None, t[:10])
    policies = [lc.policy for lc in m.life_cycles]
    required, optional = policies.index(ReusePolicy.REQUIRED), \
        policies.index(ReusePolicy.OPTIONAL)
    assert b.resume(optional_reuse_groups=[optional])
    groups = m.get_and_reset_iteration_stats().groups
    for g in (required, optional):
        assert (groups[g].reused_full_blocks, groups[g].reused_partial_blocks) == (2, 1), g
    b.close()
    m.shutdown()


def test_level0_resize_whose_second_pool_runs_out_of_memory_is_refused_with_nothing_changed(
        built, monkeypatch):
    import kvcm_tier_gpu
    m, _ = built(tiers=(("gpu", 8), ("host", 8)), layout="hybrid")
    d = Driver(m)
    c = d.write(tokens(20, 1))
    sizes = [s.num_slots for s in m.stores[0]]
    before = snapshot(m, c)
    real = kvcm_tier_gpu.MemoryPool.resize
    calls = {"n": 0}

    def resize(self, n):
        calls["n"] += 1
        if calls["n"] == 2:
            raise MemoryError
        return real(self, n)

    monkeypatch.setattr(kvcm_tier_gpu.MemoryPool, "resize", resize)
    assert m.resize(0, m.config.levels[0].quota * 2) is False
    assert "MemoryError" in m.last_refusal
    assert [s.num_slots for s in m.stores[0]] == sizes
    assert snapshot(m, c) == before


def test_declined_pages_dropped_during_an_interrupted_first_resume_shrink_the_offer(
        built, monkeypatch):
    monkeypatch.setitem(__import__("levels_helpers").LAYOUTS, "optional", _optional_v)
    m, _ = built(tiers=(("gpu", 8), ("host", 2), ("faulty-disk", 2)), layout="optional")
    d = Driver(m)
    base = tokens(24, 3)
    d.write(base, chunk=24, suspend=False).close()
    d.write(tokens(16, 1), chunk=32)
    c = m.create_kv_cache(None, base[:20])
    assert c.reuse_status[1].complete
    levels = type(m.storage_levels)
    real = levels.fill

    def fill(self, *args, **kw):  # the room is made (declined pages dropped), then Ctrl-C
        monkeypatch.setattr(levels, "fill", real)
        raise KeyboardInterrupt

    monkeypatch.setattr(levels, "fill", fill)
    with pytest.raises(KeyboardInterrupt):
        c.resume(optional_reuse_groups=[])
    assert_invariants(m)
    lost = [b for b, p in enumerate(c.pages(1)) if p < 0]
    assert lost, "the scenario must drop a declined page"
    assert not c.reuse_status[1].complete            # the offer says what is left
    with pytest.raises(InvalidArgumentError, match="incomplete"):
        c.resume(optional_reuse_groups=[1])
    assert c.resume(optional_reuse_groups=[])
    assert sorted(c.recompute_blocks(1)) == list(range(5))


def test_a_bug_in_a_pool_resize_is_not_taken_for_a_refusal(built, monkeypatch):
    import kvcm_tier_gpu
    m, _ = built(tiers=(("gpu", 8), ("host", 8)), layout="hybrid")

    def resize(self, n):
        raise AssertionError("a broken invariant")

    monkeypatch.setattr(kvcm_tier_gpu.MemoryPool, "resize", resize)
    with pytest.raises(AssertionError):
        m.resize(0, m.config.levels[0].quota * 2)
