"""Batches of hybrid models (full attention, sliding windows with sinks, SSM) on error
paths (session 27's review): a commit interrupted while it waits for the batch's readers
changes nothing; an SSM snapshot does not wait for them at all; an interrupted resize of a
row with beams leaves no beam partly grown; Batch.resize never replaces a row's exception
with its publish's; a history given without a capacity moves the history; mixed bools are
refused."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from conftest import hybrid_layers, make_manager, tokens
from test_batch import assert_batch_matches_members

import kvcm_core.batch as batch_mod
from kvcm_core import (
    ArgumentTypeError,
    AttentionLayerConfig,
    Batch,
    BufferConfig,
    KVCacheManager,
    KVCacheManagerConfig,
    LevelConfig,
    SsmLayerConfig,
)

TPB = 4
TOKS = [int(t) for t in np.random.default_rng(0).integers(1, 3000, 64)]


class _Interrupt(BaseException):
    """An injected interrupt (not a KeyboardInterrupt: that would stop pytest)."""


def _manager(ssm: bool = False, beams: int = 1) -> KVCacheManager:
    layers: list[Any] = [
        AttentionLayerConfig(layer_id=0, buffers=[BufferConfig(role="k", size=64)]),
        AttentionLayerConfig(layer_id=1, buffers=[BufferConfig(role="k", size=32)],
                             sliding_window_size=8, num_sink_tokens=4)]
    if ssm:
        layers.append(SsmLayerConfig(layer_id=2, buffers=[BufferConfig(role="s", size=48)]))
    return KVCacheManager(KVCacheManagerConfig(
        tokens_per_block=TPB, layers=layers, levels=[LevelConfig(tier="gpu", quota=64 * 96)],
        commit_min_snapshot=ssm, max_beam_width=beams, max_rewind_len=16,
        kernel_backend="numpy"))


def _interrupt_the_next_poll(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The host's next wait for a batch's reader fence raises (where a Ctrl-C lands)."""
    calls: list[int] = []
    real = batch_mod._poll

    def poll(event: Any) -> None:
        calls.append(1)
        monkeypatch.setattr(batch_mod, "_poll", real)
        raise _Interrupt("while the host waits for the reader fence")

    monkeypatch.setattr(batch_mod, "_poll", poll)
    return calls


def _rows_match(b: Batch, m: KVCacheManager) -> None:
    b.publish()
    assert_batch_matches_members(b, m)


def _nothing_leaks(m: KVCacheManager) -> None:
    for c in m.open_caches:
        c.close()
    m.clear_reusable_blocks()
    st = m.get_storage_statistics(0)
    assert st.free == st.total, f"{st.total - st.free} slots leaked"


def test_a_rebase_at_commit_interrupted_while_waiting_for_readers_changes_nothing(
        monkeypatch: pytest.MonkeyPatch) -> None:
    m = _manager()
    b = Batch(m, max_rows=2, max_blocks_per_row=8)
    a, c = m.create_kv_cache(None, []), m.create_kv_cache(None, [])  # no match: both compute
    for x in (a, c):
        assert x.resume() and x.resize(8)
        b.add_kv_cache(x)
    a.commit(TOKS[:8])  # a publishes blocks 0 and 1
    c.commit(TOKS[:3])
    b.publish()
    b.record_read()  # the step's kernels read c's row
    before = (c.page_table_version, [c.get_base_page_indices(g).tolist() for g in (0, 1)])
    calls = _interrupt_the_next_poll(monkeypatch)
    with pytest.raises(_Interrupt):
        c.commit(TOKS[3:8])  # c's blocks are in the tree: it rebases onto a's pages
    assert calls
    assert (c.page_table_version, [c.get_base_page_indices(g).tolist() for g in (0, 1)]) \
        == before
    m.check_invariants()
    _rows_match(b, m)
    b.close()
    _nothing_leaks(m)


def test_an_ssm_snapshot_at_commit_does_not_wait_for_the_batchs_readers(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The snapshot page is in no batch table: dropping its lock needs no reader fence
    (it used to wait on the host, and an interrupt there left the page locked for good)."""
    m = _manager(ssm=True)
    b = Batch(m, max_rows=1, max_blocks_per_row=8)
    c = m.create_kv_cache(None, [])
    assert c.resume() and c.resize(8)
    b.add_kv_cache(c)
    b.publish()
    b.record_read()
    real = batch_mod._poll
    calls = _interrupt_the_next_poll(monkeypatch)
    c.commit(TOKS[:8])  # ends on a block boundary: the SSM state is snapshotted
    assert not calls
    monkeypatch.setattr(batch_mod, "_poll", real)
    m.check_invariants()
    assert m.probe_reuse(None, TOKS[:9]) == 8  # the snapshot is published
    b.close()
    _nothing_leaks(m)


@pytest.mark.parametrize("interrupt_at", [1, 2, 3, 4])
@pytest.mark.parametrize("retry", [12, 20])
def test_an_interrupted_resize_of_a_row_with_beams_grows_no_beam_part_way(
        monkeypatch: pytest.MonkeyPatch, interrupt_at: int, retry: int) -> None:
    """Beams take their new pages one after the other: an interrupt between them leaves
    the row as it was (cache.capacity says so), and resizing it again, as docs/batch.md
    says, leaks nothing."""
    m = _manager(beams=2)
    b = Batch(m, max_rows=2, max_blocks_per_row=16, max_beam_width=2)
    c = m.create_kv_cache(None, [])
    assert c.resume() and c.resize(8)
    c.commit(TOKS[:8])
    assert c.set_beam_width(2)
    b.add_kv_cache(c)
    b.publish()
    tables = [c.get_base_page_indices(g, beam).tolist() for g in (0, 1) for beam in (0, 1)]
    L = m.storage_levels
    real = L.take
    n = {"calls": 0}

    def take(*args: Any, **kw: Any) -> Any:
        n["calls"] += 1
        if n["calls"] == interrupt_at:
            raise _Interrupt("while the row takes its pages")
        return real(*args, **kw)

    monkeypatch.setattr(L, "take", take)
    with pytest.raises(_Interrupt):
        b.resize([20, -1])
    monkeypatch.setattr(L, "take", real)
    assert c.capacity == 8
    assert [c.get_base_page_indices(g, beam).tolist() for g in (0, 1) for beam in (0, 1)] \
        == tables
    m.check_invariants()
    assert b.resize([retry, -1]) == [True, True]
    assert c.capacity == retry
    m.check_invariants()
    _rows_match(b, m)
    assert b.resize([12, -1], [10, -1]) == [True, True]  # a rewind
    m.check_invariants()
    b.close()
    _nothing_leaks(m)


def test_batch_resize_lets_a_rows_exception_through_when_the_publish_cannot_run() -> None:
    """A member grown past the batch's rows behind its back (this call would shrink it
    back) makes the closing publish refuse: the row's own exception propagates, never the
    publish's."""
    m = make_manager(hybrid_layers())
    b = Batch(m, max_rows=3, max_blocks_per_row=8)
    calls = {"n": 0}

    def cb(block: int) -> int:
        calls["n"] += 1
        if calls["n"] > 100:
            raise _Interrupt("in row 1's priority callback")
        return 35

    rows = []
    for i, prio in enumerate([None, cb, None]):
        c = m.create_kv_cache(None, tokens(8, seed=i), priority_callback=prio)
        assert c.resume() and c.resize(8)
        b.add_kv_cache(c, row=i)
        rows.append(c)
    b.publish()
    assert rows[2].resize(8 * 4 + 4)  # past max_blocks_per_row, behind the batch's back
    calls["n"] = 1000
    with pytest.raises(_Interrupt):
        b.resize([12, 16, 8])
    assert rows[0].capacity == 12 and rows[1].capacity == 8
    assert rows[2].resize(8)
    _rows_match(b, m)
    m.check_invariants()


def test_a_history_without_a_capacity_moves_the_history_and_keeps_the_capacity() -> None:
    """Speculative decoding: drafted tokens rejected, capacity kept. A history the row's
    cache.resize would refuse is refused, naming the row."""
    from kvcm_core import InvalidArgumentError

    m = _manager()
    b = Batch(m, max_rows=2, max_blocks_per_row=8)
    c = m.create_kv_cache(None, [])
    assert c.resume() and c.resize(12)
    c.commit(TOKS[:8])
    b.add_kv_cache(c)
    assert c.resize(12, 11)
    with pytest.raises(InvalidArgumentError, match=r"history_length=99"):
        b.resize([-1, -1], [99, -1])
    assert c.history_length == 11 and c.capacity == 12
    assert b.resize([-1, -1], [9, -1]) == [True, True]
    assert c.history_length == 9 and c.capacity == 12
    _rows_match(b, m)
    b.close()
    _nothing_leaks(m)


def test_batch_resize_refuses_a_bool_among_ints() -> None:
    m = _manager()
    b = Batch(m, max_rows=2, max_blocks_per_row=8)
    c = m.create_kv_cache(None, [])
    assert c.resume() and c.resize(4)
    b.add_kv_cache(c)
    with pytest.raises(ArgumentTypeError, match="capacities"):
        b.resize([8, True])
    with pytest.raises(ArgumentTypeError, match="history_lengths"):
        b.resize([8, -1], [False, -1])
    assert c.capacity == 4
    b.close()
    _nothing_leaks(m)


@pytest.mark.parametrize(("rows", "beams", "blocks"), [
    (1 << 16, 1, 1 << 16), (1 << 40, 2, 1 << 40), (3, 1 << 62, 1 << 62)])
def test_a_batch_whose_tables_cannot_be_indexed_is_refused_naming_the_sizes(
        rows: int, beams: int, blocks: int) -> None:
    """Sizes whose table has more entries than an int32 index reaches: an
    InvalidArgumentError naming them, before anything is allocated (the byte count used
    to wrap around in int64, then allocations failed with raw errors)."""
    from kvcm_core import InvalidArgumentError

    m = _manager(beams=1)
    with pytest.raises(InvalidArgumentError, match=f"max_rows={rows} x max_beam_width="
                       f"{beams} x max_blocks_per_row={blocks}"):
        Batch(m, max_rows=rows, max_blocks_per_row=blocks, max_beam_width=beams)
    Batch(m, max_rows=64, max_blocks_per_row=1024, max_beam_width=2).close()  # fits
    m.shutdown()
