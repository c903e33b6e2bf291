"""``order_in_batches``: the batch order that moves issued on the copy streams rely on (a
batch whose slots ascend on both sides is copied as one run)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcm_core.migration import order_in_batches, sort_in_batches


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 50), max_size=70), st.integers(1, 20))
def test_order_in_batches_sorts_each_batch_stably_and_keeps_batches_in_place(values, per):
    # (and sort_in_batches gives the same values without the permutation)
    x = np.asarray(values, dtype=np.int32)
    o = order_in_batches(x, per)
    assert sorted(o.tolist()) == list(range(len(x)))  # a permutation
    for lo in range(0, len(x), per):
        hi = min(len(x), lo + per)
        part = o[lo:hi]
        assert sorted(part.tolist()) == list(range(lo, hi))  # batch k stays batch k
        keys = [(int(x[i]), int(i)) for i in part]
        assert keys == sorted(keys)  # ascending, ties in their original order
    assert sort_in_batches(x, per).tolist() == x[o].tolist()
