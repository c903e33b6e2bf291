"""The v2 and v3 GPU resolve kernels' algorithm (``kvcm_core.sparse.resolve_model``: free
entries by index, then stamps ranked a bitmap window at a time, the sort as fallback; v3
starts its first window at the smallest unpinned stamp and ranks the free entries in the
same pass) gives the reference's bytes: every random case of the sparse conformance suite,
run through a NumPy backend whose resolve is the model, checked against the exact LRU
oracle, with windows wide and narrow so that one window, several windows and the fallback
sort all happen."""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from kvcm_kernels_numpy import NumpyBackend

from kvcm_core.sparse.reference import resolve_views
from kvcm_core.sparse.resolve_model import miss_order, miss_order_v3, resolve_model
from kvcm_core.testing.conformance.sparse import _cases, random_case, run_case
from kvcm_core.testing.sparse_oracle import ResolveRig, drifting_topk


class ModelBackend(NumpyBackend):
    """The numpy backend with the v2 (or v3) model as its resolve; counts the ways rows
    went."""

    def __init__(self, window: int, max_windows: int, variant: str = "v2") -> None:
        super().__init__({})
        self.window, self.max_windows, self.variant = window, max_windows, variant
        self.ways: Counter[str] = Counter()

    def sparse_resolve(self, job: Any, stream: Any = None) -> None:
        self.ways.update(resolve_model(resolve_views(job), job.rows, job.num_selected,
                                       job.working_set_units, job.max_units,
                                       job.unit_tokens, self.window, self.max_windows,
                                       self.variant))


WINDOWS = [(65536, 16), (7, 16), (3, 2), (1, 0)]
VARIANTS = ["v2", "v3"]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("window,max_windows", WINDOWS)
def test_model_is_the_exact_lru_on_random_cases(window: int, max_windows: int,
                                                variant: str) -> None:
    backend = ModelBackend(window, max_windows, variant)
    for seed in range(40):
        case = random_case(np.random.default_rng(seed))
        rig = ResolveRig(backend, case["rows"], case["ns"], case["wsu"], case["mu"], case["ut"])
        try:
            run_case(rig, case)
        finally:
            rig.close()
    ways = backend.ways
    if max_windows == 0:
        assert ways["windows"] == 0 and ways["sort"] > 0
    elif window == 65536:
        assert ways["sort"] == 0 and ways["windows"] > 0
    else:  # narrow windows: some rows need more windows than allowed, some do not
        assert ways["windows"] > 0 and (ways["sort"] > 0 or max_windows == 16)


@pytest.mark.parametrize("variant", VARIANTS)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=_cases())
def test_model_with_narrow_windows_is_the_exact_lru_on_hypothesis_cases(
        case: dict[str, Any], variant: str) -> None:
    backend = ModelBackend(2, 3, variant)
    rig = ResolveRig(backend, case["rows"], case["ns"], case["wsu"], case["mu"], case["ut"])
    try:
        run_case(rig, case)
    finally:
        rig.close()


@pytest.mark.parametrize("variant", VARIANTS)
def test_model_on_a_drifting_top_k_of_2048_takes_one_window_per_row(variant: str) -> None:
    backend = ModelBackend(65536, 16, variant)
    rig = ResolveRig(backend, 2, 2048, 4096, 16384, 4)
    try:
        for sel in drifting_topk(np.random.default_rng(3), 2, 2048, 6000, 6, 0.5):
            rig.resolve(sel)
    finally:
        rig.close()
    assert backend.ways["sort"] == 0 and backend.ways["windows"] > 0


def test_equal_stamps_fall_back_to_the_sort_by_index() -> None:
    """Stamps are distinct in any state a resolve leaves; if two are equal anyway, the
    window would set one bit twice: the model (and kernel) sorts instead."""
    stamp = np.array([5, 3, 5, -1, 9], dtype=np.int64)
    cand = np.array([True, True, True, True, False])
    order, way = miss_order(stamp, cand, 4, 1024, 16)
    assert way == "sort"
    np.testing.assert_array_equal(order, [3, 1, 0, 2])


def test_more_misses_than_candidates_leave_minus_one() -> None:
    order, way = miss_order(np.array([4, -1, 2]), np.array([True, True, False]), 3, 64, 16)
    assert way == "windows"
    order, way = miss_order(np.array([4, -1, -1]), np.array([True, True, True]), 2, 64, 0)
    assert way == "free"
    np.testing.assert_array_equal(order, [1, 2])
    order, way = miss_order(np.array([4, -1, 2]), np.array([True, True, False]), 3, 64, 16)
    np.testing.assert_array_equal(order, [1, 0, -1])


def test_v3_equal_stamps_and_stamps_below_minus_one_fall_back_to_the_sort() -> None:
    stamp = np.array([5, 3, 5, -1, 9], dtype=np.int64)
    cand = np.array([True, True, True, True, False])
    order, way = miss_order_v3(stamp, cand, cand, 4, 1024, 16)
    assert way == "sort"
    np.testing.assert_array_equal(order, [3, 1, 0, 2])
    stamp = np.array([5, -7, 2, -1], dtype=np.int64)
    every = np.ones(4, dtype=bool)
    order, way = miss_order_v3(stamp, every, every, 2, 1024, 16)
    assert way == "sort"
    np.testing.assert_array_equal(order, [1, 3])


def test_v3_first_window_starts_at_the_smallest_unpinned_stamp() -> None:
    """Entry 0 (stamp 0) is a hit (protected, not a candidate) but unpinned: v3's first
    window starts at 0 (v2's at 2), so with windows of 4 or 5 stamps v3 needs a second
    window for stamp 6 (and, allowed one, sorts) where v2 with a window of 5 does not; the
    order is the same either way."""
    stamp = np.array([0, 2, 3, 6, -1], dtype=np.int64)
    unpinned = np.ones(5, dtype=bool)
    cand = np.array([False, True, True, True, True])
    for window, windows_v3 in ((4, 2), (5, 2), (7, 1)):
        o3, way3 = miss_order_v3(stamp, unpinned, cand, 4, window, 1)
        o2, _ = miss_order(stamp, cand, 4, window, 16)
        np.testing.assert_array_equal(o2, [4, 1, 2, 3])
        np.testing.assert_array_equal(o3, o2)
        assert way3 == ("sort" if windows_v3 > 1 else "windows")


def test_v3_with_no_window_allowed_sorts_unless_free_entries_suffice() -> None:
    stamp = np.array([4, -1, -1, 2], dtype=np.int64)
    every = np.ones(4, dtype=bool)
    order, way = miss_order_v3(stamp, every, every, 2, 64, 0)
    assert way == "free"
    np.testing.assert_array_equal(order, [1, 2])
    order, way = miss_order_v3(stamp, every, every, 3, 64, 0)
    assert way == "sort"
    np.testing.assert_array_equal(order, [1, 2, 3])


def test_v3_more_misses_than_candidates_leave_minus_one() -> None:
    order, way = miss_order_v3(np.array([4, -1, 2]), np.ones(3, dtype=bool),
                               np.array([True, True, False]), 3, 64, 16)
    assert way == "windows"
    np.testing.assert_array_equal(order, [1, 0, -1])
