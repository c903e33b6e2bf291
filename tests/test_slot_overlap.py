"""``level_io._overlap`` (whether two writes or a read and a write share a slot, which
decides whether a read or a write may go ahead of a queued write) gives the answer of a
set intersection for arrays of any size, order, repeats, spread and integer type: small
ones, and large ones spread wide, by a set test; large ones close together (a held write's
flush) through a table of one's range."""

from __future__ import annotations

import numpy as np
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvcm_core import level_io
from kvcm_core.level_io import _overlap

_slots = st.lists(st.integers(0, 5000), max_size=900)


@settings(max_examples=300, deadline=None)
@given(a=_slots, b=_slots, far=st.sampled_from([0, 1, 10**9]),
       dtypes=st.sampled_from([(np.int64, np.int64), (np.int32, np.int64),
                               (np.int64, np.int32)]),
       sort_a=st.booleans(), sort_b=st.booleans())
@example(a=list(range(0, 1000, 2)), b=list(range(1, 1000, 2)), dtypes=(np.int64, np.int64),
         sort_a=True, sort_b=True, far=0)  # interleaved, none shared
@example(a=list(range(0, 1000, 2)), b=[*range(1, 999, 2), 998], dtypes=(np.int64, np.int64),
         sort_a=True, sort_b=True, far=0)  # only the largest slot shared
@example(a=[0, *range(1001, 1600)], b=list(range(0, 1000, 3)), dtypes=(np.int64, np.int64),
         sort_a=False, sort_b=False, far=0)  # only the smallest slot shared
@example(a=list(range(600)), b=[], dtypes=(np.int64, np.int64), sort_a=True, sort_b=True,
         far=0)
@example(a=list(range(600)), b=[599], dtypes=(np.int64, np.int64), sort_a=True, sort_b=True,
         far=10**9)  # shared, the range too wide for a table
def test_overlap_is_a_set_intersection(a, b, dtypes, sort_a, sort_b, far):
    if far:  # one slot far away: the range too wide for a table (or just wide)
        b = [*b, far * 1000]
    x = np.array(sorted(a) if sort_a else a, dtype=dtypes[0])
    y = np.array(sorted(b) if sort_b else b, dtype=np.int64 if far > 1 else dtypes[1])
    want = bool(set(a) & set(b))
    assert _overlap(x, y) is want
    assert _overlap(y, x) is want


def test_large_arrays_close_together_take_the_table_and_others_the_set_test(monkeypatch):
    """Both ways are exercised above: the sizes straddle the threshold."""
    assert level_io._TABLE_OVERLAP <= 900
    calls = []
    real = np.zeros
    monkeypatch.setattr(level_io.np, "zeros", lambda *a, **k: calls.append(a[0]) or real(*a, **k))
    big = np.arange(0, 4000, 4)
    assert _overlap(big, np.arange(1, 4000, 4)) is False
    assert _overlap(big, np.array([8])) is True  # 1001 slots together: the table
    assert calls == [3997, 3997]
    assert _overlap(np.array([5, 6]), np.array([6])) is True  # a few: the set test
    assert _overlap(np.append(big, 10**9), np.array([8])) is True  # spread wide: the set test
    assert calls == [3997, 3997]


def test_arrays_of_other_integer_types_compare_as_numbers():
    """Slots far past int32 beside int32 slots, unsigned beside negative ones."""
    small = np.arange(600, dtype=np.int32)
    far = (2**40 + np.arange(1000)).astype(np.int64)
    assert _overlap(small, far) is False and _overlap(far, small) is False
    assert _overlap(small, np.append(far, 5)) is True
    near = np.arange(2**40 - 300, 2**40 + 300, dtype=np.int64)
    assert _overlap(near, far) is True and _overlap(far, near) is True
    assert _overlap(np.arange(600, dtype=np.uint32), np.arange(-700, -100)) is False
    assert _overlap(np.arange(600, dtype=np.uint64), np.arange(-100, 500)) is True
