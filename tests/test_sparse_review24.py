"""Sparse attention rules a review found broken: a rewind's units in flight count from
the rewound history, the write-back bound holds every step within
``max_total_input_tokens``, selection ids past int32 are unused (never wrapped into real
units), and a refused fused fetch or selection changes nothing."""
from __future__ import annotations

import numpy as np
import pytest
import sparse_helpers as sh

from kvcm_core import Batch, InvalidArgumentError, KVCacheManager


def _grown(history: int, max_rewind_len: int | None = None) -> tuple[KVCacheManager, Batch]:
    """One seated cache grown to ``history`` in 8-token steps, flushed every step."""
    kw = {} if max_rewind_len is None else {"max_rewind_len": max_rewind_len}
    m = KVCacheManager(sh.sparse_config(**kw))
    b = Batch(m, max_rows=1, max_blocks_per_row=8)
    c = m.create_kv_cache(None, [])
    assert c.resume()
    b.add_kv_cache(c)
    b.publish()
    for h in range(0, history, 8):
        b.resize([h + 8])
        b.flush_sparse_units()
        b.resize([h + 8], [h + 8])
        b.flush_sparse_units()
    return m, b


def _done(m: KVCacheManager, b: Batch) -> None:
    for cache in b.members:
        if cache is not None:
            b.remove_kv_cache(cache)
            cache.close()
    b.close()
    m.shutdown()


def test_a_rewind_that_puts_too_many_units_in_flight_is_refused():
    m, b = _grown(32, max_rewind_len=64)
    cache = b.members[0]
    with pytest.raises(InvalidArgumentError, match="in flight"):
        b.resize([32], [4])  # units 1..7 in flight: more than working_set - selected
    assert (cache.history_length, cache.capacity) == (32, 32)
    sel = np.array([[20, 21, 22]], np.int32)
    b.fetch_sparse_pages(2, sel)  # the batch still resolves
    _done(m, b)


def test_every_row_adding_tokens_across_a_unit_boundary_fits_the_write_back_bound():
    m = KVCacheManager(sh.sparse_config())
    rows, total = 4, 8
    b = Batch(m, max_rows=rows, max_blocks_per_row=8, max_total_input_tokens=total)
    for i in range(rows):
        c = m.create_kv_cache(None, [100 * i + j + 1 for j in range(3)])
        assert c.resume() and c.resize(3) and c.resize(3, 3)  # history 3: a unit's last
        b.add_kv_cache(c)
    b.publish()
    b.resize([5] * rows)  # 2 tokens a row, 8 in all: each row crosses into a new unit
    b.resize([5] * rows, [5] * rows)
    assert b.flush_sparse_units() > 0  # was refused: "exceeds the write-back bound"
    _done(m, b)


@pytest.mark.parametrize("dtype", [np.int64, np.uint64])
def test_selection_ids_past_int32_are_unused_not_wrapped(dtype):
    m, b = _grown(32)
    sel = np.array([[2**32 + 5, 2**33 + 1, 2**40]], dtype=dtype)
    b.fetch_sparse_pages(2, sel)
    assert b.read_sparse_table(2, "entry_map").tolist() == [[-1, -1, -1]]
    assert tuple(b.peek_hit_miss_counter()) == (0, 0)
    _done(m, b)


def test_fused_fetch_with_an_unknown_buffer_role_is_refused_before_it_resolves():
    m, b = _grown(16)
    sel = np.array([[0, 1, 2]], np.int32)
    with pytest.raises(InvalidArgumentError, match="nope"):
        b.fetch_sparse_pages(2, sel, buffers="nope")
    assert tuple(b.peek_hit_miss_counter()) == (0, 0)
    b.fetch_sparse_pages(2, sel)  # not left awaiting a fetch
    _done(m, b)


def test_a_refused_selection_keeps_the_last_fetches_to_wait_for():
    m, b = _grown(8)
    s2 = m.backend.create_stream()
    b.fetch_sparse_pages(2, np.array([[0, 1, -1]], np.int32), stream=s2)
    group = b._sparse.group_of(2)
    before = list(group.fetched)
    with pytest.raises(InvalidArgumentError):
        b.resolve_sparse_selection(2, np.zeros((1, 2), np.int32))
    assert group.fetched == before
    _done(m, b)


def test_a_rewind_by_cache_resize_of_a_seated_row_is_refused_at_publish():
    m, b = _grown(32, max_rewind_len=64)
    cache = b.members[0]
    assert cache.resize(32, 4)  # the same capacity, history rewound below the flushed mark
    with pytest.raises(InvalidArgumentError, match="in flight"):
        b.publish()
    _done(m, b)


def test_fused_fetch_takes_its_buffer_roles_from_any_iterable():
    m, b = _grown(32)
    copied = []
    real = m.backend.sparse_copy

    def spy(job, stream=None):
        if not job.flush:
            copied.append(len(job.buffers))
        return real(job, stream)

    m.backend.sparse_copy = spy
    b.fetch_sparse_pages(2, np.array([[20, 21, 22]], np.int32),
                         buffers=(r for r in ["kv"]))  # a generator: read once
    assert copied == [1]
    _done(m, b)
