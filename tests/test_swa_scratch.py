"""SWA scratch pages for chunked prefill (concepts.md §5, docs/semantics.md "SWA scratch
pages"). Every test that runs a model runs it through the fingerprint engine, which writes
caches with scratch blocks layer by layer and checks each layer's reads right after
writing it, so an aliased or misplaced scratch page fails at once."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from conftest import (
    BAD_PAGE_INDEX,
    PAGE,
    Driver,
    assert_invariants,
    kv,
    make_config,
    snapshot_state,
    tokens,
    tree_page,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcm_core import (
    AttentionLayerConfig,
    Batch,
    BufferConfig,
    ConfigError,
    KVCacheManager,
    SwaScratchConfig,
)
from kvcm_core.layout import PageIndexConverter, StorageLayout
from kvcm_core.lifecycle import LifeCycleRegistry
from kvcm_core.scratch import ScratchDesc, scratch_slots_needed, validate_scratch_layout
from kvcm_core.testing.engine import EngineLoop, Request
from kvcm_core.testing.fingerprint import StepWork

W, SINKS = 8, 4  # window and sink tokens of the windowed layers (TPB = 4)


def swa_model(n_windowed: int = 3, extra: dict[int, list[BufferConfig]] | None = None,
              full: bool = True) -> list[Any]:
    """A full-attention layer 0 (optional) and windowed layers 1..n with K and V."""
    layers: list[Any] = []
    if full:
        layers.append(AttentionLayerConfig(layer_id=0, buffers=kv(PAGE)))
    for lid in range(1, n_windowed + 1):
        bufs = kv(PAGE) + list((extra or {}).get(lid, []))
        layers.append(AttentionLayerConfig(layer_id=lid, buffers=bufs, sliding_window_size=W,
                                           num_sink_tokens=SINKS))
    return layers


def scratch_cfg(spb: int = 2, slots: int = 4) -> SwaScratchConfig:
    return SwaScratchConfig(scratch_pages_per_block=spb, max_scratch_slots=slots)


def windowed_group(m: KVCacheManager) -> int:
    (g,) = m.scratch_groups
    return g


def prefill(d: Driver, cache: Any, end: int, chunk: int, on_resize: Any = None) -> None:
    """Chunked prefill through the fingerprint engine (check, layer-by-layer write)."""
    toks = d.toks[id(cache)]
    while cache.history_length < end:
        hist = cache.history_length
        cap = min(end, hist + chunk)
        assert cache.resize(cap)
        if on_resize is not None:
            on_resize(cache)
        d.engine.step([StepWork(cache, toks)])
        cache.commit(toks[hist:cap])
        assert_invariants(d.m)


# -- the whole feature through the engine -----------------------------------------------


def run_prompt(managers: Any, scratch: SwaScratchConfig | None, prompt: int = 240,
               chunk: int = 40) -> tuple[int, int, list[ScratchDesc]]:
    m = managers(swa_model(), swa_scratch=scratch)
    d = Driver(m)
    toks = tokens(prompt + 20, seed=3)
    cache = d.create(toks)
    assert cache.resume()
    peak = 0
    descs: list[ScratchDesc] = []

    def watch(c: Any) -> None:
        nonlocal peak
        peak = max(peak, m.get_storage_statistics(0).unavailable)
        for g in range(m.num_cache_groups):
            desc = c.scratch(g)
            if desc is not None:
                descs.append(desc)

    prefill(d, cache, prompt, chunk, watch)
    d.run_to(cache, prompt + 20, chunk=1)  # decode: no scratch
    d.check(cache)
    cache.close()
    return peak, d.engine.checked_pages, descs


def test_chunked_prefill_with_scratch_uses_fewer_gpu_slots_at_peak_and_verifies_every_layer(
        managers: Any) -> None:
    peak_plain, _, none = run_prompt(managers, None)
    peak_scratch, checked, descs = run_prompt(managers, scratch_cfg())
    assert none == []
    assert descs, "the chunks had scratch blocks"
    assert peak_scratch < peak_plain, (peak_scratch, peak_plain)
    assert checked > 0


@pytest.mark.parametrize("index_tables", [False, True])
def test_engine_loop_with_scratch_runs_concurrent_requests_verified_with_invariants_each_step(
        managers: Any, index_tables: bool) -> None:
    """Pages are read through a Batch; with ``index_tables`` the scratch layers' pages are
    addressed through the batch's converted tables (scratch blocks included)."""
    m = managers(swa_model(), swa_scratch=scratch_cfg())
    loop = EngineLoop(m, chunk_tokens=32, max_batch=4, index_tables=index_tables)
    reqs = [Request(i, tokens(150 + 13 * i, seed=10 + i), prompt_len=130 + 13 * i)
            for i in range(4)]
    loop.run(reqs, on_step=lambda _r: assert_invariants(m))
    assert all(r.done for r in reqs)


# -- the index arithmetic ---------------------------------------------------------------


def ref_index(b: int, table: np.ndarray, scale: int, offset: int, spb: int,
              desc: ScratchDesc | None) -> int:
    """The scalar restatement of the rule: scratch block at position p of its range goes
    to slot ids[p*spb // scale], sub-page (p*spb % scale + offset) % scale."""
    if desc is not None and desc.begin <= b < desc.end:
        first = (b - desc.begin) * spb
        slot = desc.slot_ids[first // scale]
        return slot * scale + (first % scale + offset) % scale
    if table[b] == BAD_PAGE_INDEX:
        return BAD_PAGE_INDEX
    return int(table[b]) * scale + offset


LAYOUTS = {
    # name: (model layers, spb)
    "equal_scale": (swa_model(4), 2),
    "unequal_membership": (swa_model(4, extra={1: [BufferConfig(role="x", size=32)],
                                                2: [BufferConfig(role="x", size=32)],
                                                3: [BufferConfig(role="x", size=32)]}), 2),
    "spb_not_dividing_scale": (swa_model(3), 4),
}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_index_arithmetic_matches_scalar_rule_and_never_aliases_within_a_block_or_layer(
        managers: Any, name: str) -> None:
    layers, spb = LAYOUTS[name]
    m = managers(layers, swa_scratch=scratch_cfg(spb, slots=5))
    g = windowed_group(m)
    nblocks = m.scratch_max_blocks[g]
    rng = np.random.default_rng(1)
    nb = nblocks + 9
    begin = 3
    desc = ScratchDesc(begin, begin + nblocks, tuple(rng.permutation(40)[:5].tolist()), spb)
    table = rng.integers(0, 50, nb).astype(np.int32)
    table[[0, 2, nb - 1]] = BAD_PAGE_INDEX
    table[begin : begin + nblocks] = BAD_PAGE_INDEX
    owners: dict[tuple[int, int], set[tuple[int, str, int]]] = {}
    for (lid, role), group in m.buffer_grouping.items():
        if group != g:
            continue
        conv = m.get_page_index_converter(lid, role)
        assert conv.scratch_pages_per_block == spb
        got = conv.convert(table, desc)
        assert got.dtype == np.int32 and got.shape == (nb,)
        for b in range(nb):
            assert got[b] == ref_index(b, table, conv.scale, conv.offset, spb, desc), (lid, b)
        # the manager's kernel backend runs the same conversion (cupy/cuda on a GPU run)
        assert np.array_equal(conv.convert(table, desc, backend=m.backend), got)
        assert np.array_equal(conv.convert(np.stack([table, table]), desc, backend=m.backend),
                              np.stack([got, got]))
        assert got[0] == got[2] == got[nb - 1] == BAD_PAGE_INDEX  # BAD stays BAD
        pool = m.buffer_attr(lid, role).pool
        for b in range(desc.begin, desc.end):
            idx = int(got[b])
            assert idx // conv.scale in desc.slot_ids  # inside the descriptor's slots
            owners.setdefault((pool, idx), set()).add((lid, role, b))
    assert owners
    for who in owners.values():
        blocks = [b for _, _, b in who]
        layers_ = [lid for lid, _, _ in who]
        # No two layers (or buffers) of one block, no two blocks of one layer share one.
        assert len(set(blocks)) == len(blocks) or len(who) == 1, who
        assert len(set(layers_)) == len(layers_), who


def test_index_arithmetic_without_scratch_is_the_plain_conversion(managers: Any) -> None:
    m = managers(swa_model(), swa_scratch=scratch_cfg())
    conv = m.get_page_index_converter(0, "k")  # full attention: no scratch
    assert conv.scratch_pages_per_block == 0
    table = np.array([3, BAD_PAGE_INDEX, 0, 7], dtype=np.int32)
    want = m.backend.convert_page_indices(table, conv.scale, conv.offset, 1)
    assert conv.convert(table).tolist() == np.asarray(want).tolist()
    with pytest.raises(ValueError, match="not in an SWA scratch group"):
        conv.convert(table, ScratchDesc(0, 2, (1,), 2))
    wconv = PageIndexConverter(6, 2, 2, scratch_pages_per_block=2)
    got = wconv.convert(np.array([BAD_PAGE_INDEX, 4], dtype=np.int32),
                        ScratchDesc(0, 1, (9,), 2))
    # expansion 2: whole pages (3 a slot, the buffer at page 1) expand to 2 units each
    assert got.tolist() == [(9 * 3 + 1) * 2, (9 * 3 + 1) * 2 + 1, 4 * 6 + 2, 4 * 6 + 3]


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(counts=st.lists(st.integers(1, 4), min_size=1, max_size=7),
       spb=st.sampled_from([1, 2, 4, 8]))
def test_layout_validation_is_exact_refused_iff_a_layer_would_alias(counts: list[int],
                                                                    spb: int) -> None:
    """Layers with ``counts[i]`` equal-size buffers in one pool: the configuration is
    accepted exactly when no two scratch blocks of one layer share a sub-page."""
    layers = [AttentionLayerConfig(
        layer_id=i, sliding_window_size=W,
        buffers=[BufferConfig(role=f"b{j}", size=PAGE) for j in range(n)])
        for i, n in enumerate(counts)]
    cfg = make_config(layers, tpb=8, swa_scratch=scratch_cfg(spb))
    registry = LifeCycleRegistry(cfg)
    layout = StorageLayout(registry)
    scale = sum(counts)
    try:
        validate_scratch_layout(cfg, registry, layout)
        refused = None
    except ConfigError as exc:
        assert exc.field == "swa_scratch.scratch_pages_per_block"
        refused = exc.rule
    if spb > scale:
        assert refused is not None and "sub-pages per slot" in refused
        return
    nblocks = 3 * scale  # several periods
    desc = ScratchDesc(0, nblocks, tuple(range(scratch_slots_needed(nblocks, spb, [scale]))),
                       spb)
    table = np.full(nblocks, BAD_PAGE_INDEX, dtype=np.int32)
    alias = False
    offset = 0
    for n in counts:
        seen: set[int] = set()
        for j in range(n):
            conv = PageIndexConverter(scale, offset + j, 1, spb)
            for idx in conv.convert(table, desc).tolist():
                alias |= idx in seen
                seen.add(idx)
        offset += n
    assert (refused is not None) == alias, (counts, spb, refused)
    if refused is not None:
        assert "layer_id=" in refused


# -- layouts ----------------------------------------------------------------------------


def test_unequal_group_membership_pools_with_different_scales_share_slot_ids_and_verify(
        managers: Any) -> None:
    layers, spb = LAYOUTS["unequal_membership"]
    m = managers(layers, swa_scratch=scratch_cfg(spb, slots=4))
    g = windowed_group(m)
    assert sorted(m.scratch_scales[g]) == [3, 8]  # K/V of 4 layers; x of 3 layers
    d = Driver(m)
    cache = d.create(tokens(200, seed=5))
    assert cache.resume()
    seen = []

    def watch(c: Any) -> None:
        desc = c.scratch(g)
        if desc is not None:
            seen.append(desc)
            assert len(desc.slot_ids) >= max(-(-desc.num_blocks * spb // s) for s in (3, 8))

    prefill(d, cache, 190, 40, watch)
    assert seen
    d.check(cache)


def test_spb_not_dividing_scale_blocks_crossing_a_slot_boundary_stay_in_their_slot_and_verify(
        managers: Any) -> None:
    layers, spb = LAYOUTS["spb_not_dividing_scale"]
    m = managers(layers, swa_scratch=scratch_cfg(spb, slots=4))
    g = windowed_group(m)
    (scale,) = m.scratch_scales[g]
    assert scale == 6 and scale % spb
    # block 1 of a range: nominal sub-pages [4, 8) cross the end of the 6-page slot
    assert (1 * spb) % scale + spb > scale
    d = Driver(m)
    cache = d.create(tokens(220, seed=6))
    assert cache.resume()
    seen = []
    prefill(d, cache, 200, 44, lambda c: seen.append(c.scratch(g)))
    assert any(s is not None and s.num_blocks >= 2 for s in seen)
    d.check(cache)


def test_max_scratch_slots_caps_scratch_blocks_and_the_rest_get_ordinary_pages(
        managers: Any) -> None:
    m = managers(swa_model(), swa_scratch=scratch_cfg(2, slots=1))
    g = windowed_group(m)
    assert m.scratch_max_blocks[g] == 3  # 6 sub-pages a slot, 2 a block
    d = Driver(m)
    cache = d.create(tokens(200, seed=7))
    assert cache.resume()

    def watch(c: Any) -> None:
        desc = c.scratch(g)
        assert desc is not None and desc.num_blocks == 3 and len(desc.slot_ids) == 1
        table = c.get_base_page_indices(g)
        hist = c.history_length
        # blocks after the range that will be stale anyway still get their own page
        assert table[desc.end] != BAD_PAGE_INDEX and desc.end * 4 >= hist

    prefill(d, cache, 160, 40, watch)
    d.check(cache)


# -- rules ------------------------------------------------------------------------------


def test_scratch_steps_are_verified_after_a_resize_moved_the_gpu_pools(managers: Any) -> None:
    # A resize of level 0 reallocates its pools; the fingerprint engine's layer-by-layer
    # path (caches with scratch blocks) must address pages at the pools' new bases.
    m = managers(swa_model(), swa_scratch=scratch_cfg())
    d = Driver(m)
    before = m.get_mem_pool_base_address(1, "k")
    level0 = m.get_storage_statistics(0).total_bytes
    assert m.resize(0, 2 * level0)
    assert m.get_mem_pool_base_address(1, "k") != before
    cache = d.create(tokens(200, seed=8))
    assert cache.resume()
    seen: list[bool] = []
    prefill(d, cache, 120, 40, on_resize=lambda c: seen.append(
        any(c.scratch(g) is not None for g in range(m.num_cache_groups))))
    assert any(seen)  # chunks with scratch blocks went through the layer-by-layer path
    d.check(cache)


def test_max_rewind_len_keeps_blocks_a_rewind_could_need_out_of_scratch(managers: Any) -> None:
    rewind = 12
    m = managers(swa_model(), swa_scratch=scratch_cfg(), max_rewind_len=rewind)
    g = windowed_group(m)
    d = Driver(m)
    toks = tokens(300, seed=8)
    cache = d.create(toks)
    assert cache.resume()
    cache.stop_committing()  # speculative decoding style: rewinds stay possible
    prefill(d, cache, 80, 40)
    assert cache.resize(120)
    desc = cache.scratch(g)
    assert desc is not None
    # stale at 120 - 12 = 108: blocks below (108 + 1 - 8) // 4 = 25 only
    assert desc.end == (120 - rewind + 1 - W) // 4 == 25
    d.engine.step([StepWork(cache, toks)])
    cache.commit(toks[80:120])
    # Rewind as far as allowed: the window at 108 must still be there, verified.
    assert cache.resize(130, history_length=120 - rewind)
    d.engine.step([StepWork(cache, toks)])
    cache.commit(toks[108:130])
    assert_invariants(m)
    prefill(d, cache, 200, 40)
    d.check(cache)


def test_without_rewind_more_blocks_become_scratch(managers: Any) -> None:
    m = managers(swa_model(), swa_scratch=scratch_cfg())
    g = windowed_group(m)
    d = Driver(m)
    cache = d.create(tokens(200, seed=8))
    assert cache.resume()
    prefill(d, cache, 80, 40)
    assert cache.resize(120)
    desc = cache.scratch(g)
    assert desc is not None and (desc.begin, desc.end) == (20, (120 + 1 - W) // 4)
    assert all(cache.scratch(other) is None for other in range(m.num_cache_groups)
               if other != g)


def test_sink_blocks_and_blocks_holding_history_are_never_scratch(managers: Any) -> None:
    m = managers(swa_model(), swa_scratch=scratch_cfg())
    g = windowed_group(m)
    d = Driver(m)
    toks = tokens(200, seed=9)
    cache = d.create(toks)
    assert cache.resume()
    assert cache.resize(40)
    desc = cache.scratch(g)
    assert desc is not None and desc.begin == SINKS // 4  # block 0 holds the sinks
    d.engine.step([StepWork(cache, toks)])
    cache.commit(toks[:40])
    assert cache.scratch(g) is None  # history moved: the step's scratch pages are spent
    assert cache.resize(42)  # 2 tokens: 40..41 in block 10; nothing becomes stale by 42
    assert cache.scratch(g) is None
    d.engine.step([StepWork(cache, toks)])
    cache.commit(toks[40:42])
    assert cache.resize(90)  # block 10 holds history (40, 41): not scratch
    desc = cache.scratch(g)
    assert desc is not None and desc.begin == 11
    d.engine.step([StepWork(cache, toks)])
    cache.commit(toks[42:90])
    d.check(cache)


def test_scratch_slots_are_locked_in_the_accounting_identity_and_all_free_after_close(
        managers: Any) -> None:
    m = managers(swa_model(), swa_scratch=scratch_cfg())
    g = windowed_group(m)
    store = m.storage_levels.gpu_store(g)
    d = Driver(m)
    cache = d.create(tokens(200, seed=11))
    assert cache.resume()

    def watch(c: Any) -> None:
        desc = c.scratch(g)
        table = np.asarray(c.get_base_page_indices(g))
        owned = int((table != BAD_PAGE_INDEX).sum())
        # this cache's window pages, kept (stale, retained) pages and its scratch slots
        mine = sum(p >= 0 for p in c.pages(g)) + len(c.scratch_page_ids(g))
        locked = store.num_slots - store.num_free - len(store.droppable) - len(store.held)
        assert locked == mine >= owned + (len(desc.slot_ids) if desc else 0)
        for sid in desc.slot_ids if desc else ():
            pid = store.page_at(sid)
            assert pid >= 0 and m.storage_levels.arena.locks[pid] == 1
        assert_invariants(m)

    prefill(d, cache, 180, 40, watch)
    cache.close()
    assert_invariants(m)
    # the managers fixture checks that close + clear_reusable_blocks frees every slot


def test_suspend_releases_scratch_slots_and_resume_continues_verified(managers: Any) -> None:
    m = managers(swa_model(), swa_scratch=scratch_cfg())
    g = windowed_group(m)
    store = m.storage_levels.gpu_store(g)
    d = Driver(m)
    toks = tokens(260, seed=12)
    cache = d.create(toks)
    assert cache.resume()
    prefill(d, cache, 120, 40)
    held = len(cache.scratch_page_ids(g))
    assert held > 0  # kept across steps for reuse
    free = store.num_free
    cache.suspend()
    assert store.num_free == free + held and cache.scratch_page_ids(g) == []
    assert_invariants(m)
    assert cache.resume()
    d.check(cache)
    prefill(d, cache, 200, 40)
    # Suspended right after a resize (a preempted request): the step's scratch is gone.
    assert cache.resize(240)
    assert cache.scratch(g) is not None
    cache.suspend()
    assert cache.scratch_page_ids(g) == []
    assert_invariants(m)
    assert cache.resume()
    assert cache.resize(240)
    d.engine.step([StepWork(cache, toks)])
    cache.commit(toks[200:240])
    d.check(cache)
    cache.close()
    assert_invariants(m)


def test_scratch_slots_are_released_once_a_step_needs_none(managers: Any) -> None:
    m = managers(swa_model(), swa_scratch=scratch_cfg())
    g = windowed_group(m)
    d = Driver(m)
    cache = d.create(tokens(200, seed=13))
    assert cache.resume()
    prefill(d, cache, 120, 40)
    assert cache.scratch_page_ids(g)
    d.run_to(cache, 121, chunk=1)  # a decode step: no scratch block
    assert cache.scratch_page_ids(g) == []
    assert_invariants(m)


def windowed_only(n: int = 3) -> list[Any]:
    return swa_model(n, full=False)


def test_resize_that_cannot_get_scratch_slots_returns_false_with_nothing_changed(
        managers: Any) -> None:
    # 5 slots: a 40-token first chunk needs block 0 (sinks), blocks 8, 9 and
    # ceil(7 * 2 / 6) = 3 scratch slots for blocks 1..7: 6 slots.
    m = managers(windowed_only(), slots=5, swa_scratch=scratch_cfg())
    g = windowed_group(m)
    d = Driver(m)
    toks = tokens(100, seed=14)
    cache = d.create(toks)
    assert cache.resume()
    before = snapshot_state(m, cache)
    assert not cache.resize(40)
    assert snapshot_state(m, cache) == before
    assert cache.scratch(g) is None and not cache.scratch_page_ids(g)
    assert_invariants(m)
    # A smaller chunk fits; then growing it past what scratch can provide fails cleanly.
    assert cache.resize(24)
    desc = cache.scratch(g)
    before = snapshot_state(m, cache)
    assert not cache.resize(40)
    assert snapshot_state(m, cache) == before and cache.scratch(g) == desc
    d.engine.step([StepWork(cache, toks)])
    cache.commit(toks[:24])
    d.check(cache)


def test_scratch_makes_a_chunk_fit_that_ordinary_pages_would_not(managers: Any) -> None:
    m_plain = managers(windowed_only(), slots=6)
    c = m_plain.create_kv_cache(None, [])
    assert c.resume() and not c.resize(40)  # needs 10 slots
    c.close()
    m = managers(windowed_only(), slots=6, swa_scratch=scratch_cfg())
    d = Driver(m)
    toks = tokens(100, seed=15)
    cache = d.create(toks, match_len=0)
    assert cache.resume()
    prefill(d, cache, 40, 40)
    d.check(cache)


def test_commit_over_scratch_blocks_publishes_nothing_for_them_and_reuse_still_verifies(
        managers: Any) -> None:
    m = managers(swa_model(), swa_scratch=scratch_cfg())
    g = windowed_group(m)
    full = m.get_buffer_group_id(0, "k")
    d = Driver(m)
    toks = tokens(200, seed=16)
    cache = d.create(toks)
    assert cache.resume()
    scratch_blocks: set[int] = set()

    def watch(c: Any) -> None:
        desc = c.scratch(g)
        if desc is not None:
            scratch_blocks.update(range(desc.begin, desc.end))

    prefill(d, cache, 200, 40, watch)
    cache.close()
    assert scratch_blocks
    for b in sorted(scratch_blocks):
        assert tree_page(m, toks, b, g) is None  # never published: no page
        assert tree_page(m, toks, b, full) is not None  # the block itself is committed
    # A later request with the same prompt reuses what the tree holds, verified.
    again = d.create(toks)
    assert again.history_length > 0
    assert again.resume()
    d.check(again)
    prefill(d, again, 200, 40)
    d.check(again)
    again.close()


# -- configuration errors ---------------------------------------------------------------


def test_config_error_spb_larger_than_the_sub_pages_of_a_slot_names_the_field() -> None:
    layers = [AttentionLayerConfig(layer_id=7, buffers=kv(PAGE), sliding_window_size=W)]
    with pytest.raises(ConfigError) as err:
        KVCacheManager(make_config(layers, swa_scratch=scratch_cfg(4)))
    assert err.value.field == "swa_scratch.scratch_pages_per_block"
    assert "2 pages" in err.value.rule


def test_config_error_aliasing_layout_names_the_field_and_the_layer() -> None:
    # pool of 5 sub-pages (K/V, K/V, K): three blocks start in slot 0 and the third
    # one's sub-pages wrap onto the first one's for a two-buffer layer.
    layers = [*swa_model(2, full=False), AttentionLayerConfig(
        layer_id=9, buffers=[BufferConfig(role="k", size=PAGE)], sliding_window_size=W,
        num_sink_tokens=SINKS)]
    with pytest.raises(ConfigError) as err:
        KVCacheManager(make_config(layers, swa_scratch=scratch_cfg(2)))
    assert err.value.field == "swa_scratch.scratch_pages_per_block"
    assert "layers[0] (layer_id=1)" in err.value.rule and "alias" in err.value.rule


def test_config_error_layer_with_more_buffers_than_spb_names_the_layer() -> None:
    layers = swa_model(2, extra={2: [BufferConfig(role="ks", size=PAGE)]}, full=False)
    with pytest.raises(ConfigError) as err:
        KVCacheManager(make_config(layers, swa_scratch=scratch_cfg(2)))
    assert err.value.field == "swa_scratch.scratch_pages_per_block"
    assert "layers[1] (layer_id=2) has 3 buffers" in err.value.rule


def test_a_second_resize_in_one_step_reshapes_scratch_and_still_verifies(managers: Any) -> None:
    m = managers(swa_model(), swa_scratch=scratch_cfg())
    g = windowed_group(m)
    d = Driver(m)
    toks = tokens(200, seed=17)
    cache = d.create(toks)
    assert cache.resume()
    prefill(d, cache, 40, 40)
    assert cache.resize(100)
    wide = cache.scratch(g)
    assert cache.resize(64)  # the engine shrank the chunk: fewer blocks are stale by 64
    narrow = cache.scratch(g)
    assert wide is not None and narrow is not None and narrow.end < wide.end
    table = cache.get_base_page_indices(g)
    assert all(table[b] != BAD_PAGE_INDEX for b in range(narrow.end, cache.num_blocks))
    d.engine.step([StepWork(cache, toks)])
    cache.commit(toks[40:64])
    prefill(d, cache, 120, 40)
    d.check(cache)
    assert_invariants(m)


def test_a_commit_short_of_the_chunk_lists_lost_scratch_blocks_for_recompute(
        managers: Any) -> None:
    m = managers(swa_model(), swa_scratch=scratch_cfg())
    g = windowed_group(m)
    d = Driver(m)
    toks = tokens(200, seed=18)
    cache = d.create(toks)
    assert cache.resume()
    assert cache.resize(80)
    desc = cache.scratch(g)
    assert desc is not None
    d.engine.step([StepWork(cache, toks)])
    cache.commit(toks[:50])  # history 50 still needs blocks of the spent scratch range
    assert cache.resize(60)
    lost = cache.recompute_blocks(g)
    assert lost and all(desc.begin <= b < desc.end and b * 4 < 50 for b in lost)
    table = cache.get_base_page_indices(g)
    assert all(table[b] != BAD_PAGE_INDEX for b in lost)
    assert_invariants(m)


@pytest.mark.parametrize("commit_to", [41, 42], ids=["one_token", "two_tokens"])
def test_scratch_turning_off_at_a_commit_inside_a_block_moves_the_version_and_the_batch_row(
        managers: Any, commit_to: int) -> None:
    # A commit that stays inside a block releases no page, but scratch() turns to None:
    # the batch's row must be rebuilt, or its index tables keep naming scratch sub-pages.
    from test_batch import assert_batch_matches_members

    m = managers(swa_model(), swa_scratch=scratch_cfg())
    g = windowed_group(m)
    b = Batch(m, max_rows=1, max_blocks_per_row=32)
    for layer in m.config.layers:
        b.register_index_table(layer.layer_id, "k")
    d = Driver(m)
    toks = tokens(200, seed=21)
    cache = d.create(toks)
    assert cache.resume()
    b.add_kv_cache(cache)
    prefill(d, cache, 40, 40)
    assert b.resize(np.array([120])) == [True]
    assert cache.scratch(g) is not None
    d.engine.step([StepWork(cache, toks)])
    version = cache.page_table_version
    cache.commit(toks[40:commit_to])
    assert cache.scratch(g) is None
    assert cache.page_table_version != version
    assert b.dirty_rows().tolist() == [0]
    b.publish()
    assert_batch_matches_members(b, m)
    b.remove_kv_cache(cache)
