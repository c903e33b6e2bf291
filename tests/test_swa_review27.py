"""Review 27: the sliding window with SWA scratch pages when a commit stops short of a
chunk or a suspend interrupts a step (docs/semantics.md "SWA scratch pages", docs/engine.md
steps 2 and 3). The rules:

- a block whose scratch page a short commit spent gets a fresh page at the resize or
  resume where history (or a rewind) needs it again, and is listed by
  ``recompute_blocks`` from then on;
- a resume after a suspend in the middle of a step gives the step's scratch blocks no
  page (the next resize makes them scratch again);
- ``pages_needed`` bounds what the resize takes (scratch slots, refilled blocks);
- a resize no level 0 could ever serve is refused at once, windowed layers only too.

Every test that runs a model runs it through the fingerprint engine, which recomputes
exactly what ``recompute_blocks`` lists: a block that lost its KV and is not listed
fails the check."""

from __future__ import annotations

import time
from typing import Any

import pytest
from conftest import (
    BAD_PAGE_INDEX,
    PAGE,
    Driver,
    assert_all_free,
    assert_invariants,
    kv,
    make_manager,
    snapshot_state,
    tokens,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcm_core import AttentionLayerConfig, InvalidArgumentError, KVCacheManager, SwaScratchConfig
from kvcm_core.testing.fingerprint import StepWork

W, SINKS = 8, 4  # window and sink tokens of the windowed layers (TPB = 4)


def swa_model(full: bool = True, sinks: int = SINKS) -> list[Any]:
    """A full-attention layer 0 (optional) and windowed layers 1..3."""
    layers: list[Any] = [AttentionLayerConfig(layer_id=0, buffers=kv(PAGE))] if full else []
    return layers + [AttentionLayerConfig(layer_id=i, buffers=kv(PAGE), sliding_window_size=W,
                                          num_sink_tokens=sinks) for i in (1, 2, 3)]


def scratch_cfg(slots: int = 4) -> SwaScratchConfig:
    return SwaScratchConfig(scratch_pages_per_block=2, max_scratch_slots=slots)


def windowed_group(m: KVCacheManager) -> int:
    (g,) = m.scratch_groups
    return g


def step(d: Driver, cache: Any, commit_to: int | None = None) -> None:
    """Recompute what the cache lists, run the step, commit up to ``commit_to``
    (default: the capacity)."""
    toks = d.toks[id(cache)]
    d.engine.recompute([StepWork(cache, toks)])
    d.engine.step([StepWork(cache, toks)])
    known = cache.history_length
    end = cache.capacity if commit_to is None else commit_to
    if end > known:
        cache.commit(toks[known:end])
    assert_invariants(d.m)


def free_of(m: KVCacheManager, g: int) -> int:
    return m.storage_levels.gpu_store(g).num_free


# -- 1. suspend/resume after a short commit -------------------------------------------


def _scratch_cache(managers: Any, seed: int, capacity: int, **create: Any
                   ) -> tuple[Any, int, Driver, list[int], Any]:
    """A manager of the windowed model with SWA scratch, its windowed group, a driver, 200
    tokens and a resumed cache of them resized to ``capacity`` (the step's chunk)."""
    m = managers(swa_model(), swa_scratch=scratch_cfg())
    d = Driver(m)
    toks = tokens(200, seed=seed)
    cache = d.create(toks, **create)
    assert cache.resume()
    assert cache.resize(capacity)
    return m, windowed_group(m), d, toks, cache


def test_resume_after_a_short_commit_lists_the_blocks_whose_scratch_pages_were_spent(
        managers: Any) -> None:
    m, g, d, toks, cache = _scratch_cache(managers, 18, 80)
    desc = cache.scratch(g)
    assert desc is not None and (desc.begin, desc.end) == (1, 13)
    d.engine.step([StepWork(cache, toks)])
    cache.commit(toks[:50])  # history 50 needs blocks 10..12, which were scratch
    cache.suspend()  # preempted before the next resize
    assert cache.resume()
    lost = cache.recompute_blocks(g)
    assert lost == [10, 11, 12]
    table = cache.get_base_page_indices(g)
    assert all(table[b] != BAD_PAGE_INDEX for b in lost)
    d.engine.recompute([StepWork(cache, toks)])
    d.check(cache)  # every page history needs holds its tokens
    assert cache.resize(90)
    step(d, cache)
    d.check(cache)
    assert_invariants(m)


def test_a_short_commit_then_suspend_keeps_close_from_publishing_a_tail_it_lost(
        managers: Any) -> None:
    # The lost blocks hold nothing until the engine's next step: the cache is "unwritten"
    # from the resume that gave them pages until the next commit.
    _m, g, d, toks, cache = _scratch_cache(managers, 19, 80)
    d.engine.step([StepWork(cache, toks)])
    cache.commit(toks[:50])
    cache.suspend()
    assert cache.resume()
    assert cache.recompute_blocks(g)
    cache.close()
    # A new request over the same prompt reuses only what was written.
    again = d.create(toks[:60])
    assert again.resume()
    d.engine.recompute([StepWork(again, toks)])
    d.check(again)


# -- 2. a rewind into blocks whose scratch pages were spent -----------------------------


def rewind_case(managers: Any) -> tuple[Any, Driver, Any, int, list[int]]:
    """Window 8, 1 sink token, ``max_rewind_len=7``: ``resize(49)`` makes blocks [1, 7)
    scratch, the commit stops at 15, and the next resize refills what history 15 needs."""
    m = managers(swa_model(full=False, sinks=1), max_rewind_len=7,
                 swa_scratch=scratch_cfg(slots=2))
    g = windowed_group(m)
    d = Driver(m)
    toks = tokens(100, seed=1)
    c = d.create(toks, match_len=0)
    assert c.resume()
    assert c.resize(49)
    desc = c.scratch(g)
    assert desc is not None and (desc.begin, desc.end) == (1, 7)
    d.engine.step([StepWork(c, toks)])
    c.commit(toks[:15])  # short of the chunk
    assert c.resize(15)
    listed = c.recompute_blocks(g)
    assert listed == [2, 3]
    d.engine.recompute([StepWork(c, toks)])
    d.check(c)
    return m, d, c, g, listed


def test_a_rewind_whose_window_reads_a_spent_scratch_block_gives_it_a_page_and_lists_it(
        managers: Any) -> None:
    m, d, c, g, _ = rewind_case(managers)
    # The rewind is allowed ([max(12, 15 - 7), 15]); the window at 13 reads block 1.
    c.check_resize(16, history_length=13)
    assert c.resize(16, history_length=13)
    table = c.get_base_page_indices(g)
    assert table[1] != BAD_PAGE_INDEX
    assert 1 in c.recompute_blocks(g)
    step(d, c)
    d.check(c)
    assert_invariants(m)


def test_a_refused_rewind_into_spent_scratch_blocks_changes_nothing(managers: Any) -> None:
    m, d, c, g, _ = rewind_case(managers)
    # Fill level 0 with another cache, so the page block 1 needs cannot be had.
    other = m.create_kv_cache(None, [])
    assert other.resume()
    n = 0
    while other.resize((n + 1) * 4):
        n += 1
    before = snapshot_state(m, c)
    assert not c.resize(16, history_length=13)
    assert snapshot_state(m, c) == before
    assert c.get_base_page_indices(g)[1] == BAD_PAGE_INDEX
    other.close()
    assert c.resize(16, history_length=13)
    step(d, c)
    d.check(c)


# -- 3. suspend in the middle of a step --------------------------------------------------


def test_resume_after_a_suspend_mid_step_needs_no_page_for_the_steps_scratch_blocks(
        managers: Any) -> None:
    # 6 slots: a 40-token chunk fits only thanks to scratch (10 blocks).
    m = managers(swa_model(full=False), slots=6, swa_scratch=scratch_cfg())
    g = windowed_group(m)
    d = Driver(m)
    toks = tokens(100, seed=15)
    c = d.create(toks, match_len=0)
    assert c.resume()
    assert c.resize(40)
    desc = c.scratch(g)
    assert desc is not None and (desc.begin, desc.end) == (1, 8)
    c.suspend()  # preempted before the step ran
    # Its three pages are on the GPU: resume takes nothing, resize(40) its 3 scratch slots.
    assert c.pages_needed() == {g: 3}
    free = free_of(m, g)
    assert c.resume(), c.last_refusal
    assert free_of(m, g) == free
    table = c.get_base_page_indices(g)
    assert [int(table[b]) for b in range(1, 8)] == [BAD_PAGE_INDEX] * 7
    assert c.scratch(g) is None  # back at the next resize, which the step calls first
    assert c.pages_needed() == {g: 3}
    assert c.resize(40)
    assert free_of(m, g) == free - 3
    again = c.scratch(g)
    assert again is not None and (again.begin, again.end) == (1, 8)
    step(d, c)
    d.check(c)
    assert_invariants(m)


def test_pages_needed_of_a_suspended_cache_counts_what_resume_and_the_resize_take(
        managers: Any) -> None:
    m, g, d, _toks, c = _scratch_cache(managers, 16, 40, match_len=0)
    step(d, c)
    assert c.resize(100)  # scratch [10, 23)
    c.suspend()
    for cap in (None, 100, 64, 120):
        need = c.pages_needed(cap).get(g, 0)
        before = free_of(m, g)
        assert c.resume()
        assert c.resize(100 if cap is None else cap)
        taken = before - free_of(m, g)
        assert taken <= need, (cap, taken, need)
        assert c.resize(100)
        c.suspend()
    assert c.resume() and c.resize(100)
    step(d, c)
    d.check(c)


# -- 4. pages_needed with spent scratch pages --------------------------------------------


def test_pages_needed_counts_spent_scratch_blocks_the_next_resize_gives_pages(
        managers: Any) -> None:
    m, g, d, toks, c = _scratch_cache(managers, 18, 64, match_len=0)
    d.engine.step([StepWork(c, toks)])
    c.commit(toks[:50])
    need = c.pages_needed(c.capacity).get(g, 0)
    before = free_of(m, g)
    assert c.resize(c.capacity)
    taken = before - free_of(m, g)
    assert taken > 0 and taken <= need, (taken, need)
    step(d, c)
    d.check(c)


# -- 5. an impossible resize of a model with windowed layers only -------------------------


@pytest.mark.parametrize("scratch", [False, True], ids=["plain", "scratch"])
def test_a_resize_no_level_0_could_hold_is_refused_at_once_with_windowed_layers_only(
        managers: Any, scratch: bool) -> None:
    m = managers(swa_model(full=False), slots=16,
                 swa_scratch=scratch_cfg() if scratch else None)
    c = m.create_kv_cache(None, [])
    assert c.resume()
    before = snapshot_state(m, c)
    t0 = time.perf_counter()
    assert not c.resize(10**12)  # was a list per new block first: MemoryError
    assert time.perf_counter() - t0 < 0.1
    assert "level 0 holds 16 slots in all" in (c.last_refusal or "")
    assert snapshot_state(m, c) == before
    assert c.resize(40)  # a size that fits still does


# -- the property ----------------------------------------------------------------------

OPS = st.tuples(st.sampled_from(["chunk", "short", "short", "suspend", "rewind", "stop"]),
                st.integers(1, 60), st.integers(0, 1000))


@settings(max_examples=80, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(ops=st.lists(OPS, min_size=1, max_size=30), rewind=st.sampled_from([0, 4, 7, 12]),
       slots=st.sampled_from([1, 2, 4]), full=st.booleans(),
       sinks=st.sampled_from([1, 4, 5]), pool=st.sampled_from([None, 14]))
def test_property_short_commits_suspends_and_rewinds_with_scratch_always_verify(
        ops: list[tuple[str, int, int]], rewind: int, slots: int, full: bool,
        sinks: int, pool: int | None) -> None:
    """Random chunks, commits short of them, suspends (mid-step too), resumes and rewinds:
    every page history needs holds its tokens once the engine recomputes what
    ``recompute_blocks`` lists after each resize and resume; a refused call changes
    nothing; ``pages_needed`` bounds what a resize takes; every slot is free at the end."""
    m = make_manager(swa_model(full, sinks), max_rewind_len=rewind, slots=pool,
                     swa_scratch=scratch_cfg(slots))
    d = Driver(m)
    toks = tokens(400, seed=len(ops))
    c = d.create(toks, match_len=0)
    try:
        g = windowed_group(m)
        assert c.resume()
        for op, n, x in ops:
            if op == "suspend":
                if c.status.name == "ACTIVE":
                    c.suspend()
                else:
                    before = snapshot_state(m, c)
                    if not c.resume():  # a tight pool: refused, nothing changed
                        assert snapshot_state(m, c) == before
                        continue
                    d.engine.recompute([StepWork(c, toks)])
                    d.check(c)
                assert_invariants(m)
                continue
            if c.status.name != "ACTIVE":
                continue
            if op == "stop":
                c.stop_committing()
                continue
            h = c.history_length
            hist = None
            if op == "rewind":  # back into what resize allows (not forward)
                lo = max(c.num_committed_tokens, c.capacity - rewind)
                if lo > h:
                    continue
                hist = lo + x % (h - lo + 1)
                h = hist
            cap = min(len(toks) - 1, h + n)
            if cap < h:
                continue
            need = c.pages_needed(cap).get(g, 0)
            before_free = free_of(m, g)
            before = snapshot_state(m, c)
            try:
                ok = c.resize(cap, history_length=hist)
            except InvalidArgumentError:
                assert snapshot_state(m, c) == before
                continue
            if not ok:
                assert snapshot_state(m, c) == before
                continue
            if not full:  # the windowed group has the pool group to itself
                assert before_free - free_of(m, g) <= need
            commit_to = cap if op != "short" else h + x % (cap - h + 1)
            step(d, c, commit_to)  # (its check reads every page the step reads)
            if commit_to == cap:  # else lost blocks wait for the next resize or resume
                d.check(c)
        if c.status.name == "ACTIVE" or c.resume():
            assert c.resize(c.history_length)
            d.engine.recompute([StepWork(c, toks)])
            d.check(c)
        c.close()
        assert_all_free(m)
    finally:
        c.close()  # (a failure above: shutdown needs every cache closed)
        m.shutdown()
