"""Every registered eviction policy through the conformance suite, plus ``lru`` specifics."""

from __future__ import annotations

import pytest
from kvcm_eviction_lru import LruPolicy

from kvcm_core.eviction import MAX_PRIORITY
from kvcm_core.plugins import get_plugin_manager
from kvcm_core.testing.conformance.eviction import EvictionPolicyConformance


class TestEvictionPolicies(EvictionPolicyConformance):
    pass


def test_lru_is_registered_with_priorities_and_lru_order() -> None:
    caps = get_plugin_manager().eviction_policy("lru").capabilities
    assert caps.priorities and caps.lru_order
    assert caps.max_priority == MAX_PRIORITY


def test_lru_rejects_options() -> None:
    with pytest.raises(ValueError, match="capacity"):
        LruPolicy({"capacity": 3})


def test_lru_priority_of_reports_the_bucket_after_set_priority() -> None:
    policy = LruPolicy()
    policy.insert("a", 7)
    policy.set_priority("a", 90)
    assert policy.priority_of("a") == 90
    with pytest.raises(ValueError, match="'b'"):
        policy.priority_of("b")


def test_lru_emptied_lowest_bucket_moves_eviction_to_the_next_one() -> None:
    policy = LruPolicy()
    policy.insert("a", 0)
    policy.insert("b", MAX_PRIORITY)
    policy.insert("c", 50)
    policy.remove("a")
    assert policy.pop_victim() == "c"
    policy.set_priority("b", 0)
    policy.insert("d", 0)
    assert list(policy.victims()) == ["b", "d"]
    assert [policy.pop_victim(), policy.pop_victim(), policy.pop_victim()] == ["b", "d", None]
    assert len(policy) == 0


def test_lru_victims_walks_buckets_lowest_first_each_in_insertion_order() -> None:
    policy = LruPolicy()
    keys = range(1000)
    for key in keys:
        policy.insert(key, key % (MAX_PRIORITY + 1))
    assert list(policy.victims()) == sorted(keys, key=lambda k: (k % (MAX_PRIORITY + 1), k))
