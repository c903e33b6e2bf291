"""Batch: stable rows, dirty rows found from page-table versions, publish, index tables,
and the misuse paths (batch.md)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from conftest import (
    TPB,
    bytes_per_slot_round,
    full_layers,
    hybrid_layers,
    make_manager,
    tokens,
    windowed_layers,
)
from hypothesis import given
from hypothesis import strategies as st

from kvcm_core import (
    BAD_PAGE_INDEX,
    ArgumentTypeError,
    Batch,
    IndexMode,
    InvalidArgumentError,
    InvalidStateError,
    KVCacheManager,
    KVCacheManagerConfig,
    LevelConfig,
)
from kvcm_core.testing.engine import EngineLoop, Request


def _active(m: KVCacheManager, toks: list[int], cap: int | None = None) -> Any:
    cache = m.create_kv_cache(None, toks)
    assert cache.resume()
    assert cache.resize(len(toks) if cap is None else cap)
    return cache


def assert_batch_matches_members(b: Batch, m: KVCacheManager) -> None:
    """Every device row equals its member's own tables (BAD padding, BAD empty rows), and
    every registered index table equals the converter applied to the member's table."""
    for g in range(m.num_cache_groups):
        table = b.read_page_table(g)
        counts = b.read_num_blocks(g)
        for r, cache in enumerate(b.members):
            if cache is None:
                assert (table[r] == BAD_PAGE_INDEX).all(), f"empty row {r} group {g}"
                assert counts[r] == 0
                continue
            for beam in range(b.max_beam_width):
                if beam >= cache.beam_width:
                    assert (table[r, beam] == BAD_PAGE_INDEX).all()
                    continue
                own = cache.get_base_page_indices(g, beam)
                assert counts[r] == len(own)
                np.testing.assert_array_equal(table[r, beam, : len(own)], own,
                                              err_msg=f"row {r} group {g} beam {beam}")
                assert (table[r, beam, len(own):] == BAD_PAGE_INDEX).all()
    for layer in m.config.layers:
        for buf in layer.buffers:
            if not b.has_index_table(layer.layer_id, buf.role):
                continue
            g = m.get_buffer_group_id(layer.layer_id, buf.role)
            conv = m.get_page_index_converter(layer.layer_id, buf.role)
            index = b.read_index_table(layer.layer_id, buf.role)
            for r, cache in enumerate(b.members):
                if cache is None:
                    assert (index[r] == BAD_PAGE_INDEX).all()
                    continue
                want = conv.convert(cache.get_base_page_indices(g),
                                    cache.scratch(g) if g in m.scratch_groups else None)
                np.testing.assert_array_equal(index[r, 0, : len(want)], want)


# -- rows and publishing ---------------------------------------------------------------------


def test_publish_uploads_each_members_table_with_bad_padding_and_counts() -> None:
    m = make_manager(full_layers())
    b = Batch(m, max_rows=4, max_blocks_per_row=16)
    a = _active(m, tokens(10, seed=1))
    c = _active(m, tokens(23, seed=2))
    assert b.add_kv_cache(a) == 0
    assert b.add_kv_cache(c, row=3) == 3
    assert a.batch_row == 0 and c.batch_row == 3 and b.row_of(c) == 3
    assert b.publish() == 2
    assert_batch_matches_members(b, m)
    assert b.read_num_blocks(0).tolist() == [3, 0, 0, 6]


def test_publish_uploads_only_rows_whose_page_table_version_moved() -> None:
    m = make_manager(full_layers())
    b = Batch(m, max_rows=4, max_blocks_per_row=16)
    caches = [_active(m, tokens(8, seed=i)) for i in range(3)]
    for c in caches:
        b.add_kv_cache(c)
    assert b.publish() == 3
    assert b.publish() == 0, "nothing changed: nothing is uploaded"
    caches[1].resize(8 + 1)  # a new block: the table changes
    assert b.dirty_rows().tolist() == [1]
    assert b.publish() == 1
    caches[2].resize(8)  # same size: no change
    assert b.publish() == 0
    assert_batch_matches_members(b, m)


def test_history_moving_a_window_marks_the_row_dirty_at_block_boundaries() -> None:
    m = make_manager(windowed_layers(window=8, sinks=4))
    b = Batch(m, max_rows=2, max_blocks_per_row=32)
    toks = tokens(40, seed=5)
    c = _active(m, toks[:8])
    b.add_kv_cache(c)
    b.publish()
    dirty_steps = 0
    for n in range(8, 40):
        c.commit(toks[c.history_length:n])
        c.resize(n + 1, history_length=n)
        dirty_steps += b.publish()
        assert_batch_matches_members(b, m)
    assert 0 < dirty_steps <= 32


def test_rows_are_stable_seats_move_carries_the_row_and_remove_leaves_a_hole() -> None:
    m = make_manager(full_layers())
    b = Batch(m, max_rows=3, max_blocks_per_row=8)
    a, c = _active(m, tokens(6, seed=1)), _active(m, tokens(9, seed=2))
    b.add_kv_cache(a)
    b.add_kv_cache(c)
    b.publish()
    b.move(a, 2)
    assert b.row_of(a) == 2 and a.batch_row == 2 and b.members[0] is None
    assert b.publish() == 2  # the old row empties, the new one fills
    assert_batch_matches_members(b, m)
    assert b.remove_kv_cache(c) == 1
    assert c.batch_row is None
    b.publish()
    assert_batch_matches_members(b, m)
    assert b.add_kv_cache(c) == 0, "the first empty row"


def _address(view: Any) -> int:
    """The first byte of a zero-copy table (device or host)."""
    iface = getattr(view, "__cuda_array_interface__", None)
    if iface is None:
        iface = view.__array_interface__
    return int(iface["data"][0])


def test_table_addresses_never_change_across_publishes() -> None:
    m = make_manager(full_layers())
    b = Batch(m, max_rows=2, max_blocks_per_row=8)
    view = b.page_table(0)
    ptr = _address(view)
    c = _active(m, tokens(5))
    b.add_kv_cache(c)
    b.publish()
    c.resize(20)
    b.publish()
    assert _address(b.page_table(0)) == ptr
    np.testing.assert_array_equal(b.read_page_table(0)[0, 0, :5], c.get_base_page_indices(0))
    if isinstance(view, np.ndarray):  # the numpy backend: the view is the table itself
        assert view.shape == (2, 1, 8) and view.dtype == np.int32
        np.testing.assert_array_equal(view[0, 0, :5], c.get_base_page_indices(0))


def test_batch_resize_resizes_by_row_publishes_once_and_fails_rows_on_their_own() -> None:
    m = make_manager(full_layers(), slots=12)
    b = Batch(m, max_rows=3, max_blocks_per_row=12)
    a, c = _active(m, tokens(4, seed=1)), _active(m, tokens(4, seed=2))
    b.add_kv_cache(a, row=0)
    b.add_kv_cache(c, row=2)
    ok = b.resize([8, 99, -1])  # row 1 is empty: ignored
    assert ok == [True, True, True]
    assert a.capacity == 8 and c.capacity == 4
    assert b.dirty_rows().tolist() == [], "resize publishes"
    ok = b.resize([8, -1, 12 * TPB])  # row 2 cannot grow to 12 blocks (8 slots left)
    assert ok == [True, True, False]
    assert c.capacity == 4, "a failed row rolls back"
    assert_batch_matches_members(b, m)


@pytest.mark.parametrize("exc", [ValueError, KeyboardInterrupt])
def test_a_row_whose_resize_raises_stops_batch_resize_and_the_batch_is_published(
        exc: type[BaseException]) -> None:
    """docs/batch.md: the raising row is unchanged, rows before it stay resized (and rows
    grown together on the fast path, which go first), and the batch is published before
    the exception propagates."""
    m = make_manager(full_layers(), slots=24)
    b = Batch(m, max_rows=3, max_blocks_per_row=12)
    boom = {"on": False}

    def cb(block: int) -> int:
        if boom["on"]:
            raise exc("callback")
        return 50

    first = _active(m, tokens(4, seed=1))
    raising = m.create_kv_cache(None, tokens(4, seed=2), priority_callback=cb)
    assert raising.resume() and raising.resize(4)
    last = _active(m, tokens(4, seed=3))
    for r, c in enumerate((first, raising, last)):
        b.add_kv_cache(c, row=r)
    b.publish()
    boom["on"] = True
    with pytest.raises(exc, match="callback"):
        b.resize([4 * TPB, 4 * TPB, 4 * TPB])
    boom["on"] = False
    assert (first.capacity, raising.capacity) == (4 * TPB, 4)
    assert last.capacity == 4 * TPB, "grown together with the first row (fast path)"
    assert b.dirty_rows().tolist() == [], "the rows resized were published"
    b.wait_ready()
    assert_batch_matches_members(b, m)
    m.check_invariants()
    assert b.resize([-1, 4 * TPB, 4 * TPB]) == [True, True, True]
    assert_batch_matches_members(b, m)


def test_batch_resize_refuses_more_new_tokens_than_max_total_input_tokens() -> None:
    m = make_manager(full_layers())
    b = Batch(m, max_rows=2, max_blocks_per_row=16, max_total_input_tokens=10)
    a, c = _active(m, tokens(4, seed=1)), _active(m, tokens(4, seed=2))
    b.add_kv_cache(a)
    b.add_kv_cache(c)
    assert a.history_length == 0 and c.history_length == 0
    with pytest.raises(InvalidArgumentError, match="max_total_input_tokens=10"):
        b.resize([6, 6])  # 6 + 6 new tokens (nothing in history yet)
    assert a.capacity == 4 and c.capacity == 4, "nothing changed"
    assert b.resize([5, 5]) == [True, True]


# -- index tables ----------------------------------------------------------------------------


@pytest.mark.parametrize("layers", [full_layers(), hybrid_layers()], ids=["full", "hybrid"])
def test_index_tables_are_the_converter_applied_to_each_row_bad_kept(layers: list[Any]) -> None:
    m = make_manager(layers)
    b = Batch(m, max_rows=3, max_blocks_per_row=16)
    c = _active(m, tokens(14, seed=3))
    b.add_kv_cache(c, row=1)
    for layer in layers:
        for buf in layer.buffers:
            b.register_index_table(layer.layer_id, buf.role)
    b.publish()
    assert_batch_matches_members(b, m)
    index = b.read_index_table(0, "v")
    assert (index[0] == BAD_PAGE_INDEX).all(), "BAD is never folded to 0"
    b.register_index_table(0, "v", IndexMode.PER_LAYER)
    own = c.get_base_page_indices(m.get_buffer_group_id(0, "v"))
    per_layer = b.read_index_table(0, "v", IndexMode.PER_LAYER)
    np.testing.assert_array_equal(per_layer[1, 0, : len(own)], own)
    assert b.register_index_table(0, "v") is not None, "registering again is harmless"


def test_index_table_must_be_registered_and_name_a_real_buffer() -> None:
    m = make_manager(full_layers())
    b = Batch(m, max_rows=1, max_blocks_per_row=4)
    with pytest.raises(InvalidArgumentError, match="register_index_table first"):
        b.index_table(0, "k")
    with pytest.raises(InvalidArgumentError, match="no such buffer"):
        b.register_index_table(7, "k")
    with pytest.raises(InvalidArgumentError, match="IndexMode"):
        b.register_index_table(0, "k", mode="sideways")


# -- misuse ----------------------------------------------------------------------------------


def test_misuse_is_refused_with_typed_errors_and_changes_nothing() -> None:
    m = make_manager(full_layers())
    other = make_manager(full_layers())
    b = Batch(m, max_rows=2, max_blocks_per_row=4)
    foreign = _active(other, tokens(4))
    with pytest.raises(InvalidArgumentError, match="another manager"):
        b.add_kv_cache(foreign)
    suspended = m.create_kv_cache(None, tokens(4, seed=9))
    with pytest.raises(InvalidStateError, match="SUSPENDED"):
        b.add_kv_cache(suspended)
    a = _active(m, tokens(4, seed=1))
    b.add_kv_cache(a)
    with pytest.raises(InvalidArgumentError, match="already seated in row 0 of this batch"):
        b.add_kv_cache(a)
    b2 = Batch(m, max_rows=1, max_blocks_per_row=4)
    with pytest.raises(InvalidArgumentError, match="another batch"):
        b2.add_kv_cache(a)
    with pytest.raises(InvalidStateError, match="remove_kv_cache before suspend"):
        a.suspend()
    with pytest.raises(InvalidStateError, match="remove_kv_cache before close"):
        a.close()
    wide = _active(m, tokens(4, seed=2), cap=5 * TPB)
    with pytest.raises(InvalidArgumentError, match="max_blocks_per_row=4"):
        b.add_kv_cache(wide)
    c = _active(m, tokens(4, seed=3))
    with pytest.raises(InvalidArgumentError, match="row=0: taken"):
        b.add_kv_cache(c, row=0)
    with pytest.raises(InvalidArgumentError, match=r"row=5: must be in 0\.\.1"):
        b.add_kv_cache(c, row=5)
    with pytest.raises(ArgumentTypeError, match="row=True"):
        b.add_kv_cache(c, row=True)
    b.add_kv_cache(c)
    d = _active(m, tokens(4, seed=4))
    with pytest.raises(InvalidArgumentError, match="the batch is full"):
        b.add_kv_cache(d)
    with pytest.raises(InvalidArgumentError, match="not seated in this batch"):
        b.remove_kv_cache(d)
    with pytest.raises(InvalidArgumentError, match="must have max_rows=2 entries"):
        b.resize([4])
    with pytest.raises(ArgumentTypeError, match="must hold ints"):
        b.resize([4.5, 4.0])
    assert [x is y for x, y in zip(b.members, [a, c], strict=True)] == [True, True]
    b.remove_kv_cache(a)
    a.suspend()  # allowed once removed
    with pytest.raises(InvalidArgumentError, match="max_rows=0: must be >= 1"):
        Batch(m, max_rows=0, max_blocks_per_row=4)
    with pytest.raises(ArgumentTypeError, match="must be a KVCacheManager"):
        Batch(object(), max_rows=1, max_blocks_per_row=4)


def test_publish_is_refused_while_the_stream_captures_a_graph(monkeypatch: Any) -> None:
    m = make_manager(full_layers())
    b = Batch(m, max_rows=1, max_blocks_per_row=4)
    b.add_kv_cache(_active(m, tokens(4)))
    monkeypatch.setattr(b.backend, "is_capturing", lambda stream=None: True)
    with pytest.raises(InvalidStateError, match="graph capture"):
        b.publish()
    assert len(b.dirty_rows()) == 1, "the row stays dirty"


def test_wait_ready_refuses_unpublished_changes() -> None:
    m = make_manager(full_layers())
    b = Batch(m, max_rows=1, max_blocks_per_row=8)
    c = _active(m, tokens(4))
    b.add_kv_cache(c)
    with pytest.raises(InvalidStateError, match="publish first"):
        b.wait_ready()
    b.publish()
    b.wait_ready()
    c.resize(9)
    with pytest.raises(InvalidStateError, match="publish first"):
        b.wait_ready()


def test_a_closed_batch_refuses_work_and_frees_its_rows() -> None:
    m = make_manager(full_layers())
    c = _active(m, tokens(4))
    with Batch(m, max_rows=1, max_blocks_per_row=8) as b:
        b.add_kv_cache(c)
    assert c.batch_row is None
    c.close()
    with pytest.raises(InvalidStateError, match="closed"):
        b.publish()


# -- properties ------------------------------------------------------------------------------

_OPS = st.lists(st.tuples(st.sampled_from(["add", "remove", "move", "grow", "commit",
                                           "batch_resize", "publish"]),
                          st.integers(0, 5), st.integers(1, 12)),
                min_size=1, max_size=40)


@given(ops=_OPS, hybrid=st.booleans())
def test_random_membership_resizes_commits_moves_keep_every_row_equal_to_its_member(
        ops: list[tuple[str, int, int]], hybrid: bool) -> None:
    layers = hybrid_layers() if hybrid else full_layers()
    m = make_manager(layers, slots=40)
    b = Batch(m, max_rows=4, max_blocks_per_row=12)
    b.register_index_table(0, "k")
    prompts = [tokens(48, seed=s % 3) for s in range(6)]  # shared prefixes across caches
    caches: list[Any] = []
    try:
        for op, i, n in ops:
            seated = [c for c in b.members if c is not None]
            if op == "add" and len(seated) < b.max_rows:
                c = m.create_kv_cache(None, prompts[i][: n * 2])
                if c.resume() and c.resize(max(c.history_length, n * 2)):
                    caches.append(c)
                    b.add_kv_cache(c)
                else:
                    c.close()
            elif op == "remove" and seated:
                c = seated[i % len(seated)]
                b.remove_kv_cache(c)
                c.close()
            elif op == "move" and seated:
                empty = [r for r, c in enumerate(b.members) if c is None]
                if empty:
                    b.move(seated[i % len(seated)], empty[n % len(empty)])
            elif op == "grow" and seated:
                c = seated[i % len(seated)]
                c.resize(min(c.capacity + n, 12 * TPB))
            elif op == "commit" and seated:
                c = seated[i % len(seated)]
                p = prompts[caches.index(c) % len(prompts)] if c in caches else None
                if p is not None and c.history_length < c.capacity <= len(p):
                    c.commit(p[c.history_length: c.capacity])  # history moves with it
            elif op == "batch_resize":
                caps = [-1 if c is None else min(c.capacity + n, 12 * TPB)
                        for c in b.members]
                b.resize(caps)
                assert_batch_matches_members(b, m)
            else:
                b.publish()
                assert_batch_matches_members(b, m)
        b.publish()
        assert_batch_matches_members(b, m)
    finally:
        b.close()
        for c in caches:
            c.close()
        m.check_invariants()


# -- the fingerprint engine through a Batch ---------------------------------------------------


@pytest.mark.parametrize(("layers", "reuses"), [(full_layers(), True),
                                               (windowed_layers(), True),
                                               (hybrid_layers(), False)],
                         ids=["full", "windowed", "hybrid"])
def test_engine_loop_reads_every_page_through_the_batch_and_fingerprints_hold(
        layers: list[Any], reuses: bool) -> None:
    m = make_manager(layers, slots=48)
    loop = EngineLoop(m, chunk_tokens=8, max_batch=4)
    assert loop.batch is not None and loop.engine.batch is loop.batch
    system = tokens(16, seed=7)  # two prefill chunks: SSM snapshots land on its end
    reqs = [Request(id=f"r{i}", tokens=system + tokens(20, seed=i), prompt_len=28)
            for i in range(8)]
    published = []
    original = loop.batch.publish

    def counting(stream: Any = None) -> int:
        published.append(original(stream))
        return published[-1]

    loop.batch.publish = counting  # type: ignore[method-assign]
    loop.run(reqs, on_step=lambda _: m.check_invariants())
    assert len(loop.finished) == 8
    assert loop.engine.checked_pages > 0 and sum(published) > 0
    if reuses:  # (an SSM layer reuses only where a snapshot sits exactly at the match end)
        assert sum(r.reused for r in reqs) > 0, "the shared prefix was reused"
    loop.close()


def test_batch_resize_grows_rows_together_and_stages_them_in_place_like_a_restage() -> None:
    """Decode through Batch.resize: rows that cross a block boundary get their pages from
    one allocation and are staged in place; a row changed behind the batch's back and a
    row with a priority callback take the per-row path. Every step the device rows equal
    what each member's own tables say."""
    m = make_manager(full_layers(), slots=200)
    b = Batch(m, max_rows=6, max_blocks_per_row=40)
    b.register_index_table(1, "k")
    caches = [_active(m, tokens(4 + i, seed=i)) for i in range(5)]
    cb = m.create_kv_cache(None, tokens(6, seed=9), priority_callback=lambda blk: 10)
    assert cb.resume() and cb.resize(6)
    caches.append(cb)
    for c in caches:
        b.add_kv_cache(c)
    b.publish()
    for step in range(3 * TPB + 1):
        if step == 5:
            caches[2].resize(caches[2].capacity + TPB)  # behind the batch's back
        caps = [c.capacity + 1 for c in caches]
        assert b.resize(caps) == [True] * 6
        assert [c.capacity for c in caches] == caps
        assert not len(b.dirty_rows()), "resize published every change"
        assert_batch_matches_members(b, m)
    m.check_invariants()


def test_batch_resize_clears_last_refusal_of_rows_it_grows() -> None:
    m = make_manager(full_layers(), slots=6)
    b = Batch(m, max_rows=1, max_blocks_per_row=8)
    c = _active(m, tokens(4))
    b.add_kv_cache(c)
    assert not c.resize(7 * TPB) and c.last_refusal is not None
    assert b.resize([TPB + 1]) == [True]
    assert c.last_refusal is None, "a success through the batch clears the reason"


@pytest.mark.parametrize("release", ["shrink", "windowed_history"])
def test_a_seated_cache_waits_for_the_batchs_readers_before_it_releases_pages(
        release: str, monkeypatch: Any) -> None:
    """Pages a kernel may still read through the published table are released only after
    the batch's reader fence (the GPU test holds a real fence open)."""
    layers = full_layers() if release == "shrink" else windowed_layers(window=8, sinks=4)
    m = make_manager(layers)
    b = Batch(m, max_rows=1, max_blocks_per_row=32)
    toks = tokens(60, seed=3)
    c = _active(m, toks[:40])
    b.add_kv_cache(c)
    b.publish()
    b.record_read()
    waits = []
    real = b.wait_readers
    monkeypatch.setattr(b, "wait_readers", lambda: (waits.append(m.stores[0][0].num_free),
                                                     real()))
    free_before = m.stores[0][0].num_free
    if release == "shrink":
        assert c.resize(10)
    else:
        c.commit(toks[:40])  # history moves past the window: old blocks go stale
        assert c.resize(44)
    assert waits and waits[0] == free_before, "waited before any page was released"
    assert m.stores[0][0].num_free > free_before or release != "shrink"


# -- Batch.resize: checked before anything changes, ordered on the caller's stream ---------


def _two_committed_rows(m: KVCacheManager, b: Batch, toks: list[int]) -> list[Any]:
    """Two active caches that committed ``toks``, seated in ``b``, published."""
    caches = []
    for _ in range(2):
        c = _active(m, [], cap=len(toks))
        c.commit(toks)
        b.add_kv_cache(c)
        caches.append(c)
    b.publish()
    return caches


@pytest.mark.parametrize("layers", [full_layers(), hybrid_layers()], ids=["fast", "per_row"])
def test_batch_resize_refuses_a_bad_row_before_changing_any_row(layers: list[Any]) -> None:
    m = make_manager(layers)
    b = Batch(m, max_rows=2, max_blocks_per_row=16)
    caches = _two_committed_rows(m, b, tokens(20, seed=4))
    before = [(c.capacity, c.page_table_version) for c in caches]
    free = [s.num_free for s in m.stores[0]]
    with pytest.raises(InvalidArgumentError, match="must be >= history_length"):
        b.resize(np.array([30, 10]))  # row 1: capacity below its history
    with pytest.raises(InvalidArgumentError, match="history_length=25"):
        b.resize(np.array([30, 30]), np.array([-1, 25]))  # row 1: history past capacity
    assert [(c.capacity, c.page_table_version) for c in caches] == before
    assert [s.num_free for s in m.stores[0]] == free
    assert b.dirty_rows().tolist() == []
    b.wait_ready()
    assert_batch_matches_members(b, m)


def test_batch_resize_refuses_a_row_whose_beam_width_grew_behind_the_batch_first() -> None:
    """A member widened past ``max_beam_width`` by a direct ``set_beam_width`` makes the
    resize refuse before any row changes (its row is resized here, so only its blocks
    are left to the resize's own check: its beams are not)."""
    m = make_manager(full_layers(), max_beam_width=2)
    b = Batch(m, max_rows=2, max_blocks_per_row=16, max_beam_width=1)
    caches = _two_committed_rows(m, b, tokens(8, seed=5))
    assert caches[1].set_beam_width(2)  # behind the batch's back
    before = [(c.capacity, c.num_blocks) for c in caches]
    with pytest.raises(InvalidArgumentError, match="beam width 2"):
        b.resize(np.array([12, 12]))
    assert [(c.capacity, c.num_blocks) for c in caches] == before


@pytest.mark.parametrize("layers", [full_layers(), hybrid_layers()], ids=["fast", "per_row"])
def test_batch_resize_orders_pages_pushed_down_against_the_callers_stream(
        layers: list[Any], monkeypatch: Any) -> None:
    unit = bytes_per_slot_round(layers)
    m = KVCacheManager(KVCacheManagerConfig(
        tokens_per_block=TPB, layers=layers, kernel_backend="numpy",
        levels=[LevelConfig(tier="gpu", quota=12 * unit + unit // 2),
                LevelConfig(tier="host", quota=1 << 16)]))
    L = m.storage_levels
    monkeypatch.setattr(L.mover.fences, "enabled", True)  # on a device backend, always
    calls: list[tuple[str, Any]] = []
    for name in ("begin", "end", "make_room"):
        orig = getattr(L, name)
        monkeypatch.setattr(L, name, lambda *a, _n=name, _f=orig: (
            calls.append((_n, a[0] if _n != "make_room" else None)), _f(*a))[1])
    toks = tokens(120, seed=6)
    filler = _active(m, [], cap=40)  # level 0 full of pages that can move down
    filler.commit(toks[:40])
    filler.suspend()
    b = Batch(m, max_rows=1, max_blocks_per_row=16)
    c = _active(m, [], cap=4)
    c.commit(toks[100:104])
    b.add_kv_cache(c)
    b.publish()
    stream = m.backend.create_stream()
    calls.clear()
    assert b.resize(np.array([40]), stream=stream) == [True]
    names = [n for n, _ in calls]
    assert "make_room" in names, "the test must push pages down"
    assert names[0] == "begin" and names[-1] == "end"
    assert all(s is stream for n, s in calls if n != "make_room")
    assert_batch_matches_members(b, m)
