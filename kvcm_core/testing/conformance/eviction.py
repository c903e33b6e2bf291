"""Conformance tests for eviction policies.

A hypothesis state machine drives random inserts, removes, touches, priority changes and
pops against a reference model of the ordering contract and checks, after every step, what
every policy must keep: ``len`` and ``in`` agree with the model, ``victims()`` yields each
present key exactly once and starts with the key ``pop_victim`` returns, misuse raises
``ValueError`` and changes nothing. With ``capabilities.priorities`` lower priorities come
first; with ``capabilities.lru_order`` the whole order must be least recently used first
inside each priority.

Subclass to run it for one policy::

    from kvcm_core.testing.conformance.eviction import EvictionPolicyConformance

    class TestMyPolicy(EvictionPolicyConformance):
        plugin_name = "mine"
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Hashable, Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from kvcm_core.eviction import DEFAULT_PRIORITY, EvictionPolicy
from kvcm_core.records import EvictionPolicyCapabilities
from kvcm_core.testing.conformance import ConformanceBase

__all__ = ["EvictionPolicyConformance"]

_MACHINE_SETTINGS = settings(
    max_examples=60,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)

# A small key space, so inserts collide with present keys and removes miss absent ones.
_keys = st.integers(0, 15)


class _Reference:
    """The ordering contract as data: key -> (priority, time of last use)."""

    def __init__(self, caps: EvictionPolicyCapabilities) -> None:
        self.caps = caps
        self.entries: dict[Hashable, tuple[int, int]] = {}
        self._clock = itertools.count()

    def use(self, key: Hashable, priority: int) -> None:
        self.entries[key] = (priority, next(self._clock))

    def rank(self, key: Hashable) -> tuple[int, ...]:
        """Sort key of the exact order an ``lru_order`` policy must follow."""
        priority, used = self.entries[key]
        return (priority, used) if self.caps.priorities else (used,)

    def lru_order(self) -> list[Hashable]:
        return sorted(self.entries, key=self.rank)


def _machine(
    factory: Callable[[Any], EvictionPolicy], caps: EvictionPolicyCapabilities
) -> type[RuleBasedStateMachine]:
    """A state machine class driving a fresh policy from ``factory`` against the model."""
    priorities = st.integers(0, caps.max_priority)
    bad_priorities = st.sampled_from([-1, caps.max_priority + 1, 2.5, "low", None])

    class PolicyMachine(RuleBasedStateMachine):
        @initialize()
        def start(self) -> None:
            self.policy = factory({})
            self.model = _Reference(caps)

        def _unchanged_after_value_error(self, call: Callable[[], object]) -> None:
            before = list(self.policy.victims())
            with pytest.raises(ValueError):
                call()
            assert list(self.policy.victims()) == before, "a failed call changed the order"

        @rule(key=_keys, priority=priorities)
        def insert(self, key: int, priority: int) -> None:
            if key in self.model.entries:
                self._unchanged_after_value_error(lambda: self.policy.insert(key, priority))
            else:
                self.policy.insert(key, priority)
                self.model.use(key, priority)

        @rule(key=_keys)
        def insert_at_default_priority(self, key: int) -> None:
            if key in self.model.entries:
                self._unchanged_after_value_error(lambda: self.policy.insert(key))
            else:
                self.policy.insert(key)
                self.model.use(key, DEFAULT_PRIORITY)

        @rule(key=_keys, priority=bad_priorities)
        def insert_with_bad_priority(self, key: int, priority: Any) -> None:
            self._unchanged_after_value_error(lambda: self.policy.insert(key, priority))

        @rule(key=_keys)
        def remove(self, key: int) -> None:
            if key in self.model.entries:
                self.policy.remove(key)
                del self.model.entries[key]
            else:
                self._unchanged_after_value_error(lambda: self.policy.remove(key))

        @rule(key=_keys)
        def touch(self, key: int) -> None:
            if key in self.model.entries:
                self.policy.touch(key)
                self.model.use(key, self.model.entries[key][0])
            else:
                self._unchanged_after_value_error(lambda: self.policy.touch(key))

        @rule(key=_keys, priority=priorities)
        def set_priority(self, key: int, priority: int) -> None:
            if key in self.model.entries:
                self.policy.set_priority(key, priority)
                self.model.use(key, priority)
            else:
                self._unchanged_after_value_error(lambda: self.policy.set_priority(key, priority))

        @precondition(lambda self: self.model.entries)
        @rule(data=st.data())
        def set_bad_priority(self, data: st.DataObject) -> None:
            present = data.draw(st.sampled_from(list(self.model.entries)))
            bad: Any = data.draw(bad_priorities)
            self._unchanged_after_value_error(lambda: self.policy.set_priority(present, bad))

        @rule()
        def pop_victim(self) -> None:
            first = next(iter(self.policy.victims()), None)
            victim = self.policy.pop_victim()
            if not self.model.entries:
                assert victim is None
                return
            assert victim in self.model.entries, f"pop_victim returned {victim!r}, not present"
            assert victim == first, "pop_victim disagrees with the head of victims()"
            if caps.priorities:
                lowest = min(p for p, _ in self.model.entries.values())
                assert self.model.entries[victim][0] == lowest, "a lower priority was skipped"
            if caps.lru_order:
                assert victim == self.model.lru_order()[0]
            del self.model.entries[victim]
            assert victim not in self.policy

        @invariant()
        def agrees_with_the_model(self) -> None:
            if not hasattr(self, "policy"):
                return
            assert len(self.policy) == len(self.model.entries)
            for key in range(16):
                assert (key in self.policy) == (key in self.model.entries)
            order = list(self.policy.victims())
            assert len(order) == len(set(order)) == len(self.model.entries)
            assert set(order) == set(self.model.entries)
            if caps.priorities:
                ranks = [self.model.entries[k][0] for k in order]
                assert ranks == sorted(ranks), f"priorities out of order: {ranks}"
            if caps.lru_order:
                assert order == self.model.lru_order()

    return PolicyMachine


class EvictionPolicyConformance(ConformanceBase):
    """Checks an eviction policy's ordering contract against a reference model."""

    kvcm_kind = "eviction_policy"

    @pytest.fixture
    def policy(self, kvcm_plugin_spec: Any) -> EvictionPolicy:
        """A fresh, empty policy built with default options."""
        return kvcm_plugin_spec.factory({})

    def test_policy_matches_reference_model_under_random_operations(
        self, kvcm_plugin_spec: Any
    ) -> None:
        machine = _machine(kvcm_plugin_spec.factory, kvcm_plugin_spec.capabilities)
        run_state_machine_as_test(machine, settings=_MACHINE_SETTINGS)

    def test_empty_policy_has_no_victim(self, policy: EvictionPolicy) -> None:
        assert len(policy) == 0
        assert policy.pop_victim() is None
        assert list(policy.victims()) == []

    def test_victims_is_a_lazy_iterator_that_removes_nothing(self, policy: EvictionPolicy) -> None:
        for key in range(5):
            policy.insert(key)
        victims = policy.victims()
        assert isinstance(victims, Iterator)
        next(victims)
        assert len(policy) == 5

    def test_misuse_raises_value_error_naming_the_key_or_value(
        self, policy: EvictionPolicy, kvcm_plugin_spec: Any
    ) -> None:
        policy.insert(4242)
        with pytest.raises(ValueError, match="4242"):
            policy.insert(4242)
        for call in (policy.remove, policy.touch):
            with pytest.raises(ValueError, match="777"):
                call(777)
        with pytest.raises(ValueError, match="777"):
            policy.set_priority(777, 1)
        too_high = kvcm_plugin_spec.capabilities.max_priority + 1
        with pytest.raises(ValueError, match=str(too_high)):
            policy.insert(1, too_high)
        with pytest.raises(ValueError, match="-3"):
            policy.set_priority(4242, -3)
        assert list(policy.victims()) == [4242]

    def test_priorities_from_zero_to_max_priority_are_accepted(
        self, policy: EvictionPolicy, kvcm_plugin_spec: Any
    ) -> None:
        top = kvcm_plugin_spec.capabilities.max_priority
        policy.insert("top", top)
        policy.insert("bottom", 0)
        assert len(policy) == 2

    def test_lower_priority_is_evicted_first_and_default_is_35(
        self, policy: EvictionPolicy, kvcm_plugin_spec: Any
    ) -> None:
        if not kvcm_plugin_spec.capabilities.priorities:
            pytest.skip("policy declares no priorities")
        policy.insert("high", DEFAULT_PRIORITY + 1)
        policy.insert("default")
        policy.insert("low", DEFAULT_PRIORITY - 1)
        policy.touch("low")  # a use never lifts a key above a higher priority
        assert list(policy.victims()) == ["low", "default", "high"]
        policy.set_priority("high", 0)
        assert [policy.pop_victim() for _ in range(4)] == ["high", "low", "default", None]

    def test_least_recently_used_is_evicted_first_within_a_priority(
        self, policy: EvictionPolicy, kvcm_plugin_spec: Any
    ) -> None:
        if not kvcm_plugin_spec.capabilities.lru_order:
            pytest.skip("policy declares no LRU order")
        for key in range(1, 6):
            policy.insert(key, 50)
        policy.touch(2)
        policy.touch(1)
        policy.set_priority(4, 50)  # counts as a use
        assert list(policy.victims()) == [3, 5, 2, 1, 4]
        policy.remove(5)
        policy.insert(5, 50)
        assert [policy.pop_victim() for _ in range(5)] == [3, 2, 1, 4, 5]
