"""What an engine developer following docs/engine.md met in session 25's review: a Batch row
asked past its table is an error naming the row (never a ``False`` whose reason is another
call's), a row's bad capacity names the row, and a resume of an active cache checks its
OPTIONAL choice instead of ignoring it."""

from __future__ import annotations

import pytest
from conftest import TPB, full_layers, make_manager, tokens
from test_batch import _active, assert_batch_matches_members

from kvcm_core import Batch, InvalidArgumentError


def test_a_batch_row_resized_past_max_blocks_per_row_is_an_error_naming_the_row() -> None:
    m = make_manager(full_layers(), slots=32)
    b = Batch(m, max_rows=3, max_blocks_per_row=4)
    a, c = _active(m, tokens(4, seed=1)), _active(m, tokens(4, seed=2))
    b.add_kv_cache(a, row=0)
    b.add_kv_cache(c, row=2)
    # A shortage elsewhere first, so that a stale reason could show.
    with pytest.raises(InvalidArgumentError,
                       match=rf"capacities\[2\]={5 * TPB}: needs 5 blocks, past this "
                             r"batch's max_blocks_per_row=4"):
        b.resize([2 * TPB, -1, 5 * TPB])
    assert a.capacity == 4 and c.capacity == 4, "nothing changed"
    assert c.last_refusal is None
    assert b.resize([2 * TPB, -1, 4 * TPB]) == [True, True, True]
    assert_batch_matches_members(b, m)


@pytest.mark.parametrize("with_histories", [False, True])
def test_a_batch_rows_bad_capacity_is_refused_naming_the_row_and_its_cache(
        with_histories: bool) -> None:
    m = make_manager(full_layers(), slots=32)
    b = Batch(m, max_rows=3, max_blocks_per_row=8)
    caches = [_active(m, tokens(20, seed=s)) for s in range(3)]
    for r, cache in enumerate(caches):
        cache.commit(tokens(20, seed=r))
        b.add_kv_cache(cache, row=r)
    hist = [-1, -1, -1] if with_histories else None
    with pytest.raises(InvalidArgumentError,
                       match=rf"row 1 \(cache {caches[1].id!r}\): capacity=10: must be >= "
                             r"history_length \(20\)"):
        b.resize([24, 10, 24], hist)
    assert [c.capacity for c in caches] == [20, 20, 20]


def test_resume_of_an_active_cache_checks_the_optional_choice_it_is_given() -> None:
    m = make_manager(full_layers(), slots=16)  # REQUIRED groups: [] is the only choice
    c = m.create_kv_cache(None, tokens(8, seed=1))
    assert c.resume(optional_reuse_groups=[])
    for bad, match in (("zz", "must be a sequence"), ([99], "first resume")):
        with pytest.raises((InvalidArgumentError, TypeError, ValueError), match=match):
            c.resume(optional_reuse_groups=bad)
    assert c.resume(optional_reuse_groups=[])  # the choice it made: accepted
    assert c.resume()
    c.close()
