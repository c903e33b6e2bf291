"""Every registered eviction policy through the conformance suite, plus what is specific to
``lru``, ``fifo``, the ``PerPagePolicy`` adapter and the validation helpers."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from kvcm_eviction_fifo import FifoPolicy
from kvcm_eviction_lru import LruPolicy

from kvcm_core.eviction import (
    DEFAULT_PRIORITY,
    MAX_PRIORITY,
    EvictionPolicy,
    PerPagePolicy,
    check_count,
    check_priorities,
    check_priority,
    page_list,
)
from kvcm_core.plugins import get_plugin_manager
from kvcm_core.testing.conformance.eviction import EvictionPolicyConformance, popped


class TestEvictionPolicies(EvictionPolicyConformance):
    pass


def test_lru_and_fifo_are_registered_with_their_capabilities() -> None:
    pm = get_plugin_manager()
    lru = pm.eviction_policy("lru").capabilities
    assert lru.priorities and lru.lru_order and lru.max_priority == MAX_PRIORITY
    fifo = pm.eviction_policy("fifo").capabilities
    assert fifo.priorities and not fifo.lru_order and fifo.max_priority == MAX_PRIORITY
    assert isinstance(pm.eviction_policy("fifo").factory({}), PerPagePolicy)


@pytest.mark.parametrize("factory", [LruPolicy, FifoPolicy])
def test_policies_reject_options(factory: Any) -> None:
    with pytest.raises(ValueError, match="capacity"):
        factory({"capacity": 3})


# -- lru ----------------------------------------------------------------------------------


def test_lru_priority_of_reports_the_bucket_after_set_priority() -> None:
    policy = LruPolicy()
    policy.insert_many([1], 7)
    policy.set_priority_many([1], 90)
    assert policy.priority_of(1) == 90
    with pytest.raises(ValueError, match="2"):
        policy.priority_of(2)


def test_lru_emptied_lowest_bucket_moves_eviction_to_the_next_one() -> None:
    policy = LruPolicy()
    policy.insert_many([1, 2, 3], [0, MAX_PRIORITY, 50])
    policy.remove_many([1])
    assert popped(policy, 1) == [3]
    policy.set_priority_many([2], 0)
    policy.insert_many([4], 0)
    assert popped(policy, 3) == [2, 4]
    assert len(policy) == 0 and popped(policy, 3) == []


def test_lru_pops_walk_buckets_lowest_first_each_in_insertion_order() -> None:
    policy = LruPolicy()
    pages = list(range(1000))
    policy.insert_many(pages, [page % (MAX_PRIORITY + 1) for page in pages])
    expected = sorted(pages, key=lambda p: (p % (MAX_PRIORITY + 1), p))
    got: list[int] = []
    for k in (1, 5, 37, 200, 1000):
        got += popped(policy, k)
    assert got == expected


def test_lru_set_priority_with_a_repeated_page_applies_in_order() -> None:
    policy = LruPolicy()
    policy.insert_many([1, 2, 3], 50)
    policy.set_priority_many([1, 2, 1], [10, 10, 60])  # 1 ends at 60, after 3
    assert policy.priority_of(1) == 60
    assert popped(policy, 3) == [2, 3, 1]


def test_lru_draining_a_large_bucket_in_small_batches_stays_linear() -> None:
    # Plain-dict buckets rescan the dead front entries on every pop (quadratic); this
    # would take seconds with them.
    policy = LruPolicy()
    policy.insert_many(range(200_000))
    out: list[int] = []
    while len(policy):
        out += popped(policy, 4)
    assert out == list(range(200_000))


# -- fifo ---------------------------------------------------------------------------------


def test_fifo_touch_does_not_reorder_and_set_priority_reenters_at_the_end() -> None:
    policy = FifoPolicy()
    policy.insert_many([1, 2, 3, 4], 50)
    policy.touch_many([1, 2])
    assert popped(policy, 1) == [1]
    policy.set_priority_many([2], 50)
    policy.insert_many([5], 10)
    assert popped(policy, 10) == [5, 3, 4, 2]


# -- the adapter --------------------------------------------------------------------------


class _Recording(PerPagePolicy):
    """A last-in-first-out per-page policy that records every hook call."""

    max_priority = 9

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.stack: list[int] = []

    def insert(self, page: int, priority: int) -> None:
        self.calls.append(("insert", page, priority))
        self.stack.append(page)

    def remove(self, page: int) -> None:
        self.calls.append(("remove", page))
        self.stack.remove(page)

    def touch(self, page: int) -> None:
        self.calls.append(("touch", page))

    def set_priority(self, page: int, priority: int) -> None:
        self.calls.append(("set_priority", page, priority))

    def pop_victim(self) -> int | None:
        return np.int64(self.stack.pop()) if self.stack else None  # type: ignore[return-value]

    def __len__(self) -> int:
        return len(self.stack)

    def __contains__(self, page: object) -> bool:
        return page in self.stack


def test_per_page_policy_calls_hooks_in_batch_order_with_python_ints() -> None:
    policy = _Recording()
    policy.insert_many(np.array([4, 5, 6], dtype=np.int32), [1, 2, 3])
    policy.touch_many([6, 4, 6])
    policy.set_priority_many(np.array([5]), 9)
    policy.remove_many((4,))
    assert policy.calls == [
        ("insert", 4, 1), ("insert", 5, 2), ("insert", 6, 3),
        ("touch", 6), ("touch", 4), ("touch", 6),
        ("set_priority", 5, 9), ("remove", 4),
    ]
    assert all(type(arg) is int for call in policy.calls for arg in call[1:])
    victims = popped(policy, 5)
    assert victims == [6, 5] and all(type(v) is int for v in victims)


@pytest.mark.parametrize(
    "call",
    [
        lambda p: p.insert_many([7, 8, 1], 1),
        lambda p: p.insert_many([7, 8, 7]),
        lambda p: p.insert_many([7, 8], [1, 10]),  # above this policy's max_priority
        lambda p: p.remove_many([2, 9]),
        lambda p: p.remove_many([2, 2]),
        lambda p: p.touch_many([1, 9]),
        lambda p: p.set_priority_many([1, 9], 0),
        lambda p: p.pop_victims(-2),
    ],
)
def test_per_page_policy_validates_the_whole_batch_before_any_hook(call: Any) -> None:
    policy = _Recording()
    policy.insert_many([1, 2, 3], DEFAULT_PRIORITY // 10)
    policy.calls.clear()
    with pytest.raises(ValueError):
        call(policy)
    assert policy.calls == [] and policy.stack == [1, 2, 3]


def test_eviction_policy_contract_is_abstract() -> None:
    with pytest.raises(TypeError):
        EvictionPolicy()  # type: ignore[abstract]
    with pytest.raises(TypeError):
        PerPagePolicy()  # type: ignore[abstract]


# -- validation helpers -------------------------------------------------------------------


def test_check_priorities_returns_one_int_when_all_equal() -> None:
    assert check_priorities(7, 3) == 7
    assert check_priorities([7, 7, 7], 3) == 7
    assert check_priorities(np.array([7, 7], dtype=np.uint8), 2) == 7
    assert check_priorities([1, 2], 2) == [1, 2]
    got = check_priorities(np.array([1, 2]), 2)
    assert got == [1, 2] and all(type(p) is int for p in got)  # type: ignore[union-attr]
    assert check_priorities([np.int64(4), np.int64(5)], 2) == [4, 5]
    assert check_priorities(np.int16(3), 9) == 3


@pytest.mark.parametrize(
    ("priorities", "text"),
    [
        (101, "101"), (-1, "-1"), (True, "True"), (2.5, "2.5"), ("x", "x"), (None, "None"),
        ([1, 101], "101"), ([1, False], "False"), ([1], "1 given"),
        (np.array([3, 101]), "101"), (np.array([-4, 3]), "-4"),
        (np.array([1.0, 2.0]), "float"), (np.array([True, False]), "bool"),
        (np.array([[1, 2]]), "1-D"),
    ],
)
def test_check_priorities_names_what_is_wrong(priorities: Any, text: str) -> None:
    with pytest.raises(ValueError, match=text):
        check_priorities(priorities, 2)


def test_scalar_helpers() -> None:
    assert check_priority(0) == 0 and check_priority(MAX_PRIORITY) == MAX_PRIORITY
    assert check_count(np.int32(3)) == 3 and check_count(0) == 0
    for bad in (-1, 1.5, True, "3"):
        with pytest.raises(ValueError):
            check_count(bad)
    pages = [1, 2]
    assert page_list(pages) is pages
    assert page_list(range(3)) == [0, 1, 2] and page_list((4,)) == [4]
    assert type(page_list(np.array([5], dtype=np.uint32))[0]) is int
    with pytest.raises(ValueError, match="1-D"):
        page_list(np.zeros((1, 1), dtype=np.int64))
    with pytest.raises(ValueError, match="sequence"):
        page_list(5)  # type: ignore[arg-type]
