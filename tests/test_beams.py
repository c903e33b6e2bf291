"""Beam search: beams fork from beam 0, share its full written blocks, copy the partial
tail and the SSM state, write their own continuations, and only beam 0 publishes.
Fingerprint-verified every step for every beam."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvcm_core import (
    BAD_PAGE_INDEX,
    ArgumentTypeError,
    AttentionLayerConfig,
    Batch,
    BufferConfig,
    InvalidArgumentError,
    InvalidStateError,
    KVCacheManager,
    KVCacheManagerConfig,
    LevelConfig,
    SsmLayerConfig,
)
from kvcm_core.testing.fingerprint import FingerprintEngine, StepWork

TPB = 4


def _manager(tmp: Path | None = None, *, slots: int = 64, hybrid: bool = False,
             levels: int = 1) -> KVCacheManager:
    layers: list[Any] = [AttentionLayerConfig(layer_id=0, buffers=[
        BufferConfig(role="k", size=64), BufferConfig(role="v", size=64)])]
    if hybrid:
        layers += [
            AttentionLayerConfig(layer_id=1, buffers=[BufferConfig(role="kv", size=32)],
                                 sliding_window_size=8, num_sink_tokens=4),
            SsmLayerConfig(layer_id=2, buffers=[BufferConfig(role="state", size=48)]),
        ]
    per_slot = 128 + (32 + 48 if hybrid else 0)
    lv = [LevelConfig(tier="gpu", quota=slots * per_slot)]
    if levels > 1:
        lv.append(LevelConfig(tier="host", quota=8 * slots * per_slot))
    return KVCacheManager(KVCacheManagerConfig(
        tokens_per_block=TPB, layers=layers, levels=lv, max_beam_width=4,
        max_util_for_resume=1.0,
        kernel_backend=os.environ.get("KVCM_TEST_BACKEND", "numpy")))


class BeamDriver:
    """Runs one cache: prefill of a prompt, a fork, then decode steps where each beam
    writes its own tokens; beam 0's tokens are committed."""

    def __init__(self, m: KVCacheManager, prompt: list[int], seed: int = 0,
                 batch: Batch | None = None) -> None:
        self.m = m
        self.batch = batch  # when set, every page table is read from its device tables
        self.engine = FingerprintEngine(m, batch)
        self.rng = np.random.default_rng(seed)
        self.cache = m.create_kv_cache(None, prompt[:-1])
        assert self.cache.resume()
        if batch is not None:
            batch.add_kv_cache(self.cache)
        self.beams = [list(prompt)]

    def step(self, n: int = 1) -> None:
        c = self.cache
        cap = c.history_length + n
        for beam in self.beams:
            while len(beam) < cap:
                beam.append(int(self.rng.integers(0, 1000)))
        assert c.resize(cap)
        work = [StepWork(c, beam, k) for k, beam in enumerate(self.beams)]
        if self.batch is not None:
            self.batch.publish()
        self.engine.step(work)
        c.commit(self.beams[0][c.history_length:cap])
        self.m.check_invariants()

    def prefill(self, upto: int) -> None:
        while self.cache.history_length < upto:
            self.step(min(3, upto - self.cache.history_length))

    def fork(self, width: int) -> bool:
        ok = self.cache.set_beam_width(width)
        if ok:
            h = self.cache.history_length
            while len(self.beams) < width:
                self.beams.append(list(self.beams[0][:h]))
            del self.beams[width:]
        return ok

    def check_all(self) -> None:
        c = self.cache
        if self.batch is not None:
            self.batch.publish()
        self.engine.check([StepWork(c, beam, k) for k, beam in enumerate(self.beams)])


def _prompt(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 1000, n).tolist()


@pytest.mark.parametrize("fork_at", [8, 10])  # on a block boundary, and mid-block
@pytest.mark.parametrize("hybrid", [False, True])
@pytest.mark.parametrize("through_batch", [False, True])
def test_beams_share_written_full_blocks_copy_the_tail_and_write_their_own(
        fork_at, hybrid, through_batch):
    m = _manager(hybrid=hybrid)
    batch = Batch(m, max_rows=2, max_blocks_per_row=16, max_beam_width=4) \
        if through_batch else None
    d = BeamDriver(m, _prompt(6, 1), batch=batch)
    d.prefill(fork_at)
    assert d.fork(3)
    c = d.cache
    assert c.beam_width == 3 and c.beam_fork(2) == fork_at
    d.check_all()
    g = m.get_layer_group_id(0)
    t0, t1 = c.get_base_page_indices(g, 0), c.get_base_page_indices(g, 1)
    shared = fork_at // TPB
    assert (t0[:shared] == t1[:shared]).all()  # written full blocks are shared
    if fork_at % TPB:
        assert t0[shared] != t1[shared]  # the partial tail is a private copy
    for _ in range(9):
        d.step()  # every beam writes its own tokens, checked every step
    t0, t1, t2 = (c.get_base_page_indices(g, k) for k in range(3))
    tail = c.history_length // TPB
    assert len({int(t0[tail]), int(t1[tail]), int(t2[tail])}) == 3
    if batch is not None:
        table = batch.read_page_table(g)[batch.row_of(c)]
        for k, own in enumerate((t0, t1, t2)):
            assert (table[k, : len(own)] == own).all(), "each beam has its row of the table"
        batch.close()
    c.close()
    m.clear_reusable_blocks()
    st = m.get_storage_statistics(0)
    assert st.free == st.total


def test_only_beam_0_publishes_its_tokens():
    m = _manager()
    d = BeamDriver(m, _prompt(6, 2))
    d.prefill(8)
    assert d.fork(2)
    for _ in range(8):
        d.step()
    beam0, beam1 = list(d.beams[0]), list(d.beams[1])
    d.cache.close()
    assert m.probe_reuse(None, beam0[:16]) == 16
    assert m.probe_reuse(None, beam1[:16]) == 8  # only the shared prefix


def test_dropping_beams_releases_their_pages_and_beam_0_goes_on():
    m = _manager()
    d = BeamDriver(m, _prompt(6, 3))
    d.prefill(10)
    before = m.get_storage_statistics(0).free
    assert d.fork(4)
    for _ in range(5):
        d.step()
    assert d.fork(1)
    assert d.cache.beam_width == 1
    d.step()
    d.check_all()
    assert m.get_storage_statistics(0).free >= before - 2  # beam 0's own growth only
    with pytest.raises(ValueError, match="beam"):
        d.cache.get_base_page_indices(0, 1)


def test_a_fork_that_does_not_fit_returns_false_and_changes_nothing():
    m = _manager(slots=6)
    d = BeamDriver(m, _prompt(6, 4))
    d.prefill(14)  # 4 blocks of 6 used, tail block partial
    stats = m.get_storage_statistics(0).as_dict()
    tables = d.cache.get_base_page_indices(0).copy()
    assert not d.cache.set_beam_width(4)  # 3 tails + growth cannot fit
    assert d.cache.beam_width == 1
    assert m.get_storage_statistics(0).as_dict() == stats
    assert (d.cache.get_base_page_indices(0) == tables).all()
    m.check_invariants()


def test_beams_survive_suspend_and_resume_through_the_host_level_bit_exact(tmp_path):
    m = _manager(tmp_path, slots=12, hybrid=True, levels=2)
    d = BeamDriver(m, _prompt(6, 5))
    d.prefill(10)
    assert d.fork(2)
    for _ in range(3):
        d.step()
    d.cache.suspend()
    # Push the suspended beams' pages to the host with other traffic.
    other = BeamDriver(m, _prompt(6, 6))
    other.prefill(30)
    other.cache.close()
    arena = m.storage_levels.arena
    pids = {p for g in range(m.num_cache_groups) for b in range(d.cache.beam_width)
            for p in d.cache.pages(g, b) if p >= 0}
    levels = {int(arena.level[p]) for p in pids} - {-1}
    assert 1 in levels, levels
    g = m.get_layer_group_id(0)
    assert (d.cache.get_base_page_indices(g, 1) == BAD_PAGE_INDEX).any()
    assert d.cache.resume()
    d.check_all()
    for _ in range(3):
        d.step()
    d.cache.close()
    m.clear_reusable_blocks()
    for lv in range(2):
        st = m.get_storage_statistics(lv)
        assert st.free == st.total


def test_beam_width_is_validated():
    m = _manager()
    c = m.create_kv_cache(None, [])
    with pytest.raises(InvalidStateError):
        c.set_beam_width(2)  # suspended
    assert c.resume()
    for bad in (0, 5):
        with pytest.raises(InvalidArgumentError, match="max_beam_width"):
            c.set_beam_width(bad)
    for bad in (True, "2"):
        with pytest.raises(ArgumentTypeError, match=r"must be an int in 1\.\.4"):
            c.set_beam_width(bad)
    with pytest.raises(ValueError, match="beam"):
        c.beam_fork(1)
    c.close()


def test_resume_counts_a_page_shared_by_beams_once():
    """A page shared by several beams takes one level-0 slot: ``resume`` counts it once
    against ``max_util_for_resume`` (13 distinct pages fit 20 slots, though the beams
    hold 33 references)."""
    layers = [AttentionLayerConfig(layer_id=0, buffers=[BufferConfig(role="k", size=64)])]
    m = KVCacheManager(KVCacheManagerConfig(
        tokens_per_block=TPB, layers=layers,
        levels=[LevelConfig(tier="gpu", quota=20 * 64), LevelConfig(tier="host", quota=1 << 16)],
        kernel_backend=os.environ.get("KVCM_TEST_BACKEND", "numpy"), max_beam_width=3,
        max_util_for_resume=1.0))
    e = FingerprintEngine(m)
    t = list(range(1, 100))
    c = m.create_kv_cache(None, [])
    assert c.resume()
    assert c.resize(40)
    e.step([StepWork(c, t)])
    c.commit(t[:40])  # 10 full blocks, then 3 beams share them
    assert c.set_beam_width(3)
    beams = [t] + [t[:40] + [200 + i] * 10 for i in range(2)]
    assert c.resize(41)
    e.step([StepWork(c, b, k) for k, b in enumerate(beams)])
    c.commit(t[40:41])
    assert len(set(c.page_ids())) == 13
    c.suspend()
    assert c.resume(), c.last_refusal
    e.check([StepWork(c, b, k) for k, b in enumerate(beams)])
    m.check_invariants()
    c.close()
    m.shutdown()


def _rewind_manager(slots: int = 1 << 10) -> KVCacheManager:
    layers = [AttentionLayerConfig(layer_id=0, buffers=[BufferConfig(role="k", size=64)]),
              AttentionLayerConfig(layer_id=1, buffers=[BufferConfig(role="k", size=128)],
                                   sliding_window_size=8)]
    return KVCacheManager(KVCacheManagerConfig(
        tokens_per_block=TPB, layers=layers,
        levels=[LevelConfig(tier="gpu", quota=slots * 192)], max_rewind_len=8,
        max_beam_width=3, kernel_backend=os.environ.get("KVCM_TEST_BACKEND", "numpy")))


@pytest.mark.parametrize("history", [4, 5, 6, 8])
def test_a_rewind_below_the_fork_gives_each_beam_its_own_pages_to_write(history):
    """Beams share beam 0's blocks below the fork; a rewind of history below it (within
    ``max_rewind_len``) makes every beam write those blocks again: each beam gets its own
    page for them (a copy of the tokens still below history), and its fork moves down to
    the new history. Shared pages are never written."""
    m = _rewind_manager()
    e = FingerprintEngine(m)
    t = list(range(1, 40))
    c = m.create_kv_cache(None, [])
    assert c.resume()
    c.stop_committing()  # speculative style: keep rewinds possible
    assert c.resize(9)
    e.step([StepWork(c, t)])
    assert c.resize(9, history_length=9)
    assert c.set_beam_width(3)  # fork at 9: blocks 0 and 1 shared
    assert c.resize(10, history_length=history)
    assert c.history_length == history
    assert [c.beam_fork(k) for k in (1, 2)] == [history, history]
    beams = [t[:history] + [100 * (k + 2) + i for i in range(10)] for k in range(3)]
    for g in range(m.num_cache_groups):
        tables = [list(c.get_base_page_indices(g, k)) for k in range(3)]
        for b in range(history // TPB, 3):  # blocks written again: one page per beam
            pages = [tab[b] for tab in tables if tab[b] != BAD_PAGE_INDEX]
            assert len(set(pages)) == len(pages), (g, b, tables)
    e.step([StepWork(c, bm, k) for k, bm in enumerate(beams)])  # checks [0, history)
    assert c.resize(10, history_length=10)
    e.check([StepWork(c, bm, k) for k, bm in enumerate(beams)])
    m.check_invariants()
    c.close()
    m.clear_reusable_blocks()
    st = m.get_storage_statistics(0)
    assert st.free == st.total
    m.shutdown()


def test_a_rewind_below_the_fork_that_cannot_unshare_returns_false_and_changes_nothing():
    m = _rewind_manager(slots=7)
    e = FingerprintEngine(m)
    t = list(range(1, 40))
    c = m.create_kv_cache(None, [])
    assert c.resume()
    c.stop_committing()
    assert c.resize(9)
    e.step([StepWork(c, t)])
    assert c.resize(9, history_length=9)
    assert c.set_beam_width(2)  # 3 + 1 pages of the full group, of 7
    other = m.create_kv_cache(None, [])
    assert other.resume()
    assert other.resize(12)  # 3 more: 7 of 7
    tables = [list(c.get_base_page_indices(0, k)) for k in range(2)]
    assert not c.resize(9, history_length=2)  # beam 1 would need its own block 0 and 1
    assert "cannot provide" in c.last_refusal
    assert c.history_length == 9 and c.beam_fork(1) == 9
    assert [list(c.get_base_page_indices(0, k)) for k in range(2)] == tables
    m.check_invariants()
    other.close()
    assert c.resize(9, history_length=2)
    assert c.beam_fork(1) == 2
    m.check_invariants()
    c.close()
    m.shutdown()
