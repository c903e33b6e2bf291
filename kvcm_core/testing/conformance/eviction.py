"""Conformance tests for eviction policies (the batch-first contract).

Every policy must: take batches as lists, tuples, ranges or 1-D integer NumPy arrays and
give back Python ints; pop at most ``k`` victims (all of them when ``k`` exceeds its
length, none for ``k == 0``); keep ``len`` and ``in`` right; and refuse misuse (a page
inserted twice or repeated in a batch, an absent page, a bad priority or ``k``) with a
``ValueError`` naming the page or value, changing nothing. "Nothing" is checked by draining
the policy and a twin that never saw the bad call, and comparing the two orders; a policy's
order must therefore be a function of the calls it received.

A hypothesis state machine drives random batches of inserts, removes, touches, priority
changes and pops against a reference model, and after every step drains a replayed twin to
check the whole order. Tests gate on the declared capabilities, never on names: with
``priorities`` lower priorities are evicted first; with ``lru_order`` the order inside a
priority is exactly least recently used first (insertion, ``touch_many`` and
``set_priority_many`` count as uses, in batch order). A policy without ``lru_order`` is not
checked for any order inside a priority.

Subclass to run it for one policy::

    from kvcm_core.testing.conformance.eviction import EvictionPolicyConformance

    class TestMyPolicy(EvictionPolicyConformance):
        plugin_name = "mine"
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
    run_state_machine_as_test,
)

from kvcm_core.eviction import DEFAULT_PRIORITY, EvictionPolicy
from kvcm_core.records import EvictionPolicyCapabilities
from kvcm_core.testing.conformance import ConformanceBase

__all__ = ["EvictionPolicyConformance", "as_victim_list", "popped"]

_MACHINE_SETTINGS = settings(
    max_examples=60,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)

#: The largest page id the core may use.
_TOP_PAGE = 2**31 - 1
#: A small page space, so inserts collide with present pages and removes miss absent ones;
#: the largest page id is in it.
_PAGES = [*range(12), _TOP_PAGE]
_pages = st.sampled_from(_PAGES)
_batches = st.lists(_pages, max_size=5)
#: How a batch of pages is passed.
_FORMS: dict[str, Callable[[list[int]], Any]] = {
    "list": list,
    "tuple": tuple,
    "int64": lambda p: np.array(p, dtype=np.int64),
    "int32": lambda p: np.array(p, dtype=np.int32),
    "uint32": lambda p: np.array(p, dtype=np.uint32),
    "list-of-int64": lambda p: [np.int64(x) for x in p],
}
_forms = st.sampled_from(sorted(_FORMS))


def as_victim_list(victims: Any) -> list[int]:
    """What ``pop_victims`` returned, checked (a list of ints or a 1-D integer array) and
    made a list of Python ints."""
    if isinstance(victims, np.ndarray):
        assert victims.ndim == 1 and victims.dtype.kind in "iu", (
            f"pop_victims gave an array of shape {victims.shape} dtype {victims.dtype}")
        return victims.tolist()
    assert isinstance(victims, list), f"pop_victims gave a {type(victims).__name__}"
    assert all(type(v) is int for v in victims), f"not Python ints: {victims!r}"
    return victims


def popped(policy: EvictionPolicy, k: int) -> list[int]:
    """``policy.pop_victims(k)`` as a checked list of ints."""
    return as_victim_list(policy.pop_victims(k))


def _drain(policy: EvictionPolicy) -> list[int]:
    """Pop every page of ``policy``, in eviction order."""
    n = len(policy)
    order = popped(policy, n + 1)
    assert len(order) == n, f"pop_victims({n + 1}) gave {len(order)} pages of {n}"
    assert len(policy) == 0 and popped(policy, 1) == []
    assert all(type(page) is int for page in order), f"not Python ints: {order!r}"
    return order


class _Reference:
    """The ordering contract as data: page -> (priority, time of last use)."""

    def __init__(self, caps: EvictionPolicyCapabilities) -> None:
        self.caps = caps
        self.entries: dict[int, tuple[int, int]] = {}
        self._clock = itertools.count()

    def use(self, page: int, priority: int) -> None:
        self.entries[page] = (priority, next(self._clock))

    def lru_order(self) -> list[int]:
        """The exact order of an ``lru_order`` policy."""
        if self.caps.priorities:
            return sorted(self.entries, key=lambda p: self.entries[p])
        return sorted(self.entries, key=lambda p: self.entries[p][1])

    def check_victims(self, victims: list[int], k: int) -> None:
        """Check ``victims`` popped by ``pop_victims(k)`` and forget them."""
        assert all(type(v) is int for v in victims), f"not Python ints: {victims!r}"
        assert len(victims) == min(k, len(self.entries)), (
            f"pop_victims({k}) gave {len(victims)} pages; {len(self.entries)} were present"
        )
        assert len(set(victims)) == len(victims), f"a page popped twice: {victims}"
        if self.caps.lru_order:
            assert victims == self.lru_order()[:k], (
                f"victims {victims}, expected {self.lru_order()[:k]}"
            )
        for victim in victims:
            assert victim in self.entries, f"popped page {victim} was not present"
            if self.caps.priorities:
                lowest = min(p for p, _ in self.entries.values())
                assert self.entries[victim][0] == lowest, (
                    f"page {victim} (priority {self.entries[victim][0]}) popped while "
                    f"priority {lowest} was present"
                )
            del self.entries[victim]

    def check_order(self, order: list[int]) -> None:
        """Check a full drain ``order`` against the model (which is left unchanged)."""
        assert sorted(order) == sorted(self.entries), (
            f"drained {sorted(order)}, expected {sorted(self.entries)}"
        )
        if self.caps.priorities:
            ranks = [self.entries[page][0] for page in order]
            assert ranks == sorted(ranks), f"priorities out of order: {ranks}"
        if self.caps.lru_order:
            assert order == self.lru_order()


def _machine(
    factory: Callable[[Any], EvictionPolicy], caps: EvictionPolicyCapabilities
) -> type[RuleBasedStateMachine]:
    """A state machine class driving a fresh policy from ``factory`` against the model."""
    top = caps.max_priority
    # Mostly a few shared priorities, so that buckets hold several pages.
    priorities = st.one_of(
        st.sampled_from([0, min(DEFAULT_PRIORITY, top), top]), st.integers(0, top)
    )
    bad_scalars = st.sampled_from([-1, top + 1, 2.5, "low", None, True])

    @st.composite
    def priority_batches(draw: st.DrawFn, n: int) -> Any:
        """One int, or one priority per page as a list or an integer array."""
        kind = draw(st.sampled_from(["int", "list", "array"]))
        if kind == "int":
            return draw(priorities)
        items = draw(st.lists(priorities, min_size=n, max_size=n))
        return items if kind == "list" else np.array(items, dtype=np.int64)

    @st.composite
    def bad_priority_batches(draw: st.DrawFn, n: int) -> Any:
        """Priorities a policy must refuse for a batch of ``n`` pages."""
        kind = draw(st.sampled_from(["scalar", "item", "array-item", "float-array", "length"]))
        if kind == "scalar" or (kind in ("item", "array-item") and n == 0):
            return draw(bad_scalars)
        if kind == "float-array":
            return np.full(n, 1.0)
        if kind == "length":
            return [DEFAULT_PRIORITY] * (n + 1)
        items: list[Any] = draw(st.lists(priorities, min_size=n, max_size=n))
        where = draw(st.integers(0, n - 1))
        if kind == "item":
            items[where] = draw(bad_scalars)
            return items
        items[where] = draw(st.sampled_from([-1, top + 1]))
        return np.array(items, dtype=np.int64)

    def per_page(prio: Any, n: int) -> list[int]:
        return [int(prio)] * n if np.ndim(prio) == 0 else [int(p) for p in prio]

    class PolicyMachine(RuleBasedStateMachine):
        @initialize()
        def start(self) -> None:
            self.policy = factory({})
            self.model = _Reference(caps)
            self.log: list[tuple[str, tuple[Any, ...]]] = []

        # -- helpers ------------------------------------------------------------------------

        def _call(self, method: str, *args: Any) -> Any:
            result = getattr(self.policy, method)(*args)
            self.log.append((method, args))
            return result

        def _replayed(self) -> EvictionPolicy:
            """A fresh policy given every successful call so far."""
            twin = factory({})
            for method, args in self.log:
                getattr(twin, method)(*args)
            return twin

        def _refused(self, method: str, *args: Any) -> None:
            """``method(*args)`` raises ValueError and changes nothing."""
            before = len(self.policy)
            with pytest.raises(ValueError):
                getattr(self.policy, method)(*args)
            assert len(self.policy) == before, f"a failed {method} changed len"
            assert _drain(self.policy) == _drain(self._replayed()), (
                f"a failed {method}{args!r} changed the order"
            )
            self.policy = self._replayed()

        # -- rules --------------------------------------------------------------------------

        @rule(pages=_batches, form=_forms, data=st.data())
        def insert_many(self, pages: list[int], form: str, data: st.DataObject) -> None:
            prio = data.draw(priority_batches(len(pages)))
            batch = _FORMS[form](pages)
            if len(set(pages)) < len(pages) or any(p in self.model.entries for p in pages):
                self._refused("insert_many", batch, prio)
                return
            self._call("insert_many", batch, prio)
            for page, p in zip(pages, per_page(prio, len(pages)), strict=True):
                self.model.use(page, p)

        @rule(pages=_batches)
        def insert_many_at_default_priority(self, pages: list[int]) -> None:
            if len(set(pages)) < len(pages) or any(p in self.model.entries for p in pages):
                self._refused("insert_many", pages)
                return
            self._call("insert_many", pages)
            for page in pages:
                self.model.use(page, DEFAULT_PRIORITY)

        @rule(pages=_batches, data=st.data())
        def insert_many_with_bad_priorities(self, pages: list[int], data: st.DataObject) -> None:
            fresh = [p for p in dict.fromkeys(pages) if p not in self.model.entries]
            self._refused("insert_many", fresh, data.draw(bad_priority_batches(len(fresh))))

        @rule(pages=_batches, form=_forms)
        def remove_many(self, pages: list[int], form: str) -> None:
            batch = _FORMS[form](pages)
            if len(set(pages)) < len(pages) or any(p not in self.model.entries for p in pages):
                self._refused("remove_many", batch)
                return
            self._call("remove_many", batch)
            for page in pages:
                del self.model.entries[page]

        @rule(pages=_batches, form=_forms)
        def touch_many(self, pages: list[int], form: str) -> None:
            batch = _FORMS[form](pages)
            if any(p not in self.model.entries for p in pages):
                self._refused("touch_many", batch)
                return
            self._call("touch_many", batch)
            for page in pages:  # repeats allowed: the last use counts
                self.model.use(page, self.model.entries[page][0])

        @rule(data=st.data(), form=_forms)
        def touch_many_present(self, data: st.DataObject, form: str) -> None:
            present = sorted(self.model.entries)
            if present:
                self.touch_many(data.draw(st.lists(st.sampled_from(present), max_size=6)), form)

        @rule(pages=_batches, form=_forms, data=st.data())
        def set_priority_many(self, pages: list[int], form: str, data: st.DataObject) -> None:
            prio = data.draw(priority_batches(len(pages)))
            batch = _FORMS[form](pages)
            if any(p not in self.model.entries for p in pages):
                self._refused("set_priority_many", batch, prio)
                return
            self._call("set_priority_many", batch, prio)
            for page, p in zip(pages, per_page(prio, len(pages)), strict=True):
                self.model.use(page, p)

        @rule(data=st.data())
        def set_priority_many_with_bad_priorities(self, data: st.DataObject) -> None:
            present = sorted(self.model.entries)
            pages = data.draw(st.lists(st.sampled_from(present), max_size=3)) if present else []
            self._refused("set_priority_many", pages, data.draw(bad_priority_batches(len(pages))))

        @rule(k=st.integers(0, 7))
        def pop_victims(self, k: int) -> None:
            victims = as_victim_list(self._call("pop_victims", k))
            self.model.check_victims(victims, k)
            assert not any(v in self.policy for v in victims)

        @rule(k=st.sampled_from([-1, -5, 1.0, "2", None]))
        def pop_victims_with_bad_k(self, k: Any) -> None:
            self._refused("pop_victims", k)

        # -- invariants ---------------------------------------------------------------------

        @invariant()
        def agrees_with_the_model(self) -> None:
            if not hasattr(self, "policy"):
                return
            assert len(self.policy) == len(self.model.entries)
            for page in _PAGES:
                assert (page in self.policy) == (page in self.model.entries), page
            self.model.check_order(_drain(self._replayed()))

        def teardown(self) -> None:
            if hasattr(self, "policy"):
                self.model.check_order(_drain(self.policy))

    return PolicyMachine


def _populate(policy: EvictionPolicy, top: int) -> None:
    """A fixed history used by tests that compare a policy with its twin."""
    policy.insert_many([10, 11, 12, 13], [20, DEFAULT_PRIORITY, DEFAULT_PRIORITY, top])
    policy.touch_many([11])
    policy.insert_many(np.array([14, 15]))
    policy.set_priority_many([13], 0)
    policy.insert_many(range(16, 20), 0)


def _misuse_cases(top: int) -> list[tuple[str, Callable[[EvictionPolicy], Any], str]]:
    """(id, bad call, text the error must contain) for a policy after ``_populate``."""
    return [
        ("insert-present", lambda p: p.insert_many([20, 11, 21]), "11"),
        ("insert-present-array", lambda p: p.insert_many(np.array([20, 19])), "19"),
        ("insert-repeated", lambda p: p.insert_many([20, 21, 20]), "20"),
        ("insert-repeated-array", lambda p: p.insert_many(np.array([30, 30], np.int32)), "30"),
        ("insert-priority-high", lambda p: p.insert_many([20], top + 1), str(top + 1)),
        ("insert-priority-negative", lambda p: p.insert_many([20, 21], -1), "-1"),
        ("insert-priority-float", lambda p: p.insert_many([20], 2.5), "2.5"),
        ("insert-priority-bool", lambda p: p.insert_many([20], True), "True"),
        ("insert-priority-str", lambda p: p.insert_many([20], "low"), "low"),
        ("insert-priority-none", lambda p: p.insert_many([20], None), "None"),
        ("insert-priority-list-item", lambda p: p.insert_many([20, 21], [1, top + 1]),
         str(top + 1)),
        ("insert-priority-list-float", lambda p: p.insert_many([20, 21], [1, 2.5]), "2.5"),
        ("insert-priority-array-item", lambda p: p.insert_many([20, 21], np.array([5, -3])),
         "-3"),
        ("insert-priority-float-array", lambda p: p.insert_many([20, 21], np.array([1.0, 2.0])),
         "priorit"),
        ("insert-priority-length", lambda p: p.insert_many([20, 21], [1]), "priorit"),
        ("insert-empty-bad-priority", lambda p: p.insert_many([], top + 1), str(top + 1)),
        ("insert-2d-array", lambda p: p.insert_many(np.array([[20, 21]])), "pages"),
        ("insert-float-array", lambda p: p.insert_many(np.array([20.0])), "pages"),
        ("insert-float-page", lambda p: p.insert_many([20, 21.7]), "21.7"),
        ("insert-float-page-tuple", lambda p: p.insert_many((20, 21.7)), "21.7"),
        ("insert-str-page-tuple", lambda p: p.insert_many(("20",)), "'20'"),
        ("insert-bool-page", lambda p: p.insert_many([True]), "True"),
        ("remove-float-page", lambda p: p.remove_many((10.0,)), "10.0"),
        # In a list too: True and 10.0 hash like the ints 1 and 10 (never taken for them)
        ("remove-float-page-list", lambda p: p.remove_many([10.0]), "10.0"),
        ("remove-bool-page-list", lambda p: p.remove_many([True]), "True"),
        ("touch-bool-page-list", lambda p: p.touch_many([True]), "True"),
        ("touch-float-page-list", lambda p: p.touch_many([11, 12.0]), "12.0"),
        ("set-priority-bool-page-list", lambda p: p.set_priority_many([True], 0), "True"),
        ("set-priority-float-page-list", lambda p: p.set_priority_many([10.0], 0), "10.0"),
        ("touch-str-page", lambda p: p.touch_many(["11"]), "'11'"),
        ("remove-absent", lambda p: p.remove_many([10, 77]), "77"),
        ("remove-absent-array", lambda p: p.remove_many(np.array([15, 78])), "78"),
        ("remove-repeated", lambda p: p.remove_many([12, 10, 12]), "12"),
        ("touch-absent", lambda p: p.touch_many([11, 77, 12]), "77"),
        ("touch-absent-array", lambda p: p.touch_many(np.array([79], np.uint32)), "79"),
        ("set-priority-absent", lambda p: p.set_priority_many([10, 77], 1), "77"),
        ("set-priority-high", lambda p: p.set_priority_many([10], top + 1), str(top + 1)),
        ("set-priority-negative-item", lambda p: p.set_priority_many([10, 11], [1, -3]), "-3"),
        ("set-priority-length", lambda p: p.set_priority_many([10, 11], [1]), "priorit"),
        ("pop-negative", lambda p: p.pop_victims(-1), "-1"),
        ("pop-float", lambda p: p.pop_victims(2.0), "2.0"),
    ]


_MISUSE_IDS = [case[0] for case in _misuse_cases(100)]


class EvictionPolicyConformance(ConformanceBase):
    """Checks an eviction policy's batch contract against a reference model."""

    kvcm_kind = "eviction_policy"

    @pytest.fixture
    def policy(self, kvcm_plugin_spec: Any) -> EvictionPolicy:
        """A fresh, empty policy built with default options."""
        return kvcm_plugin_spec.factory({})

    @pytest.fixture
    def caps(self, kvcm_plugin_spec: Any) -> EvictionPolicyCapabilities:
        return kvcm_plugin_spec.capabilities  # type: ignore[no-any-return]

    # -- the model ----------------------------------------------------------------------------

    def test_policy_matches_reference_model_under_random_batches(
        self, kvcm_plugin_spec: Any
    ) -> None:
        machine = _machine(kvcm_plugin_spec.factory, kvcm_plugin_spec.capabilities)
        run_state_machine_as_test(machine, settings=_MACHINE_SETTINGS)

    def test_checked_by_caller_entry_points_order_exactly_like_the_checked_ones(
        self, kvcm_plugin_spec: Any
    ) -> None:
        """The core's unchecked entry points give the same order as ``insert_many`` and
        ``remove_many`` for the valid batches the core builds (ids distinct, absent for
        an insert and present for a removal, priorities in range), interleaved with
        partial pops."""
        rng = random.Random(7)
        max_p = kvcm_plugin_spec.capabilities.max_priority
        for trial in range(30):
            a, b = kvcm_plugin_spec.factory({}), kvcm_plugin_spec.factory({})
            free = list(range(1000 if trial % 3 else 1 << 22, (1000 if trial % 3 else
                                                               1 << 22) + 400))
            rng.shuffle(free)
            live: list[int] = []
            for _ in range(12):
                n = rng.choice([1, 3, 16, 17, 40])
                pages = np.asarray([free.pop() for _ in range(min(n, len(free)))],
                                   dtype=np.int64)
                if not len(pages):
                    break
                prios: int | np.ndarray = rng.randrange(max_p + 1)
                if rng.random() < 0.5:
                    prios = np.asarray([rng.choice([0, 35, max_p]) for _ in pages],
                                       dtype=np.int64)
                a.insert_many(pages, prios)
                b.insert_many_checked_by_caller(pages, prios)
                live += pages.tolist()
                if live and rng.random() < 0.3:
                    gone = rng.sample(live, min(len(live), rng.choice([1, 5, 17, 40])))
                    a.remove_many(gone)
                    b.remove_many_checked_by_caller(np.asarray(gone, dtype=np.int64))
                    live = [p for p in live if p not in gone]
                    free += gone
                k = rng.randrange(0, 8)
                got_a, got_b = popped(a, k), popped(b, k)
                assert got_a == got_b
                live = [p for p in live if p not in got_a]
                free += got_a
            assert popped(a, len(a)) == popped(b, len(b))

    def test_victim_runs_and_run_inserts_order_exactly_like_the_plain_calls(
        self, kvcm_plugin_spec: Any
    ) -> None:
        """``pop_victim_runs`` pops what ``pop_victims`` pops, and its runs (where the
        policy gives them) name the priorities the pages were inserted at;
        ``insert_runs_checked_by_caller`` orders like ``insert_many`` with the runs
        expanded."""
        rng = random.Random(11)
        max_p = kvcm_plugin_spec.capabilities.max_priority
        for trial in range(30):
            a, b = kvcm_plugin_spec.factory({}), kvcm_plugin_spec.factory({})
            base = 1000 if trial % 3 else 1 << 22
            free = list(range(base, base + 400))
            rng.shuffle(free)
            prio_of: dict[int, int] = {}
            for _ in range(12):
                counts = [rng.choice([1, 2, 7, 16]) for _ in range(rng.choice([1, 2, 3]))]
                if sum(counts) > len(free):
                    break
                runs = [(rng.choice([0, 10, 35, max_p]), c) for c in counts]
                pages = np.asarray([free.pop() for _ in range(sum(counts))], dtype=np.int64)
                prios = [p for p, c in runs for _ in range(c)]
                a.insert_many(pages, prios)
                b.insert_runs_checked_by_caller(pages, runs)
                prio_of.update(zip(pages.tolist(), prios, strict=True))
                k = rng.randrange(0, 12)
                got_a = popped(a, k)
                got, got_runs = b.pop_victim_runs(k)
                got_b = as_victim_list(got)
                assert got_a == got_b
                if got_runs is not None:
                    assert sum(c for _, c in got_runs) == len(got_b)
                    assert all(c >= 1 for _, c in got_runs)
                    assert [p for p, c in got_runs for _ in range(c)] == \
                        [prio_of[page] for page in got_b]
                free += got_a
            assert popped(a, len(a)) == popped(b, len(b))

    # -- shape of the calls -------------------------------------------------------------------

    def test_empty_policy_has_no_victims(self, policy: EvictionPolicy) -> None:
        assert len(policy) == 0
        assert 0 not in policy
        assert popped(policy, 0) == []
        assert popped(policy, 5) == []

    def test_empty_batches_change_nothing(self, policy: EvictionPolicy) -> None:
        policy.insert_many([])
        policy.insert_many(np.array([], dtype=np.int64), np.array([], dtype=np.int64))
        policy.insert_many([7], 3)
        for call in (policy.remove_many, policy.touch_many):
            call([])
            call(np.array([], dtype=np.int32))
        policy.set_priority_many([], 5)
        policy.set_priority_many([], [])
        assert len(policy) == 1 and popped(policy, 3) == [7]

    def test_pop_victims_of_zero_returns_nothing_and_changes_nothing(
        self, policy: EvictionPolicy
    ) -> None:
        policy.insert_many([1, 2, 3])
        assert popped(policy, 0) == []
        assert len(policy) == 3 and 1 in policy

    def test_pop_victims_returns_at_most_k_then_the_rest(self, policy: EvictionPolicy) -> None:
        policy.insert_many(range(10))
        first = popped(policy, 4)
        assert len(first) == 4 and len(policy) == 6
        assert not any(page in policy for page in first)
        rest = popped(policy, 100)
        assert sorted(first + rest) == list(range(10))
        assert len(policy) == 0 and popped(policy, 100) == []

    @pytest.mark.parametrize("form", sorted(_FORMS))
    def test_every_batch_form_is_accepted_and_python_ints_come_back(
        self, policy: EvictionPolicy, form: str
    ) -> None:
        as_batch = _FORMS[form]
        policy.insert_many(as_batch([5, 6, 7, 8, _TOP_PAGE]), np.array([1, 2, 3, 4, 5]))
        policy.touch_many(as_batch([6, 5]))
        policy.set_priority_many(as_batch([7]), [9])
        policy.remove_many(as_batch([8]))
        assert len(policy) == 4
        assert all(page in policy for page in (5, 6, 7, _TOP_PAGE)) and 8 not in policy
        victims = as_victim_list(policy.pop_victims(np.int64(10)))  # type: ignore[arg-type]
        assert sorted(victims) == [5, 6, 7, _TOP_PAGE]
        assert all(type(v) is int for v in victims)

    def test_priorities_from_zero_to_max_priority_are_accepted(
        self, policy: EvictionPolicy, caps: EvictionPolicyCapabilities
    ) -> None:
        policy.insert_many([1], caps.max_priority)
        policy.insert_many([2, 3], [0, caps.max_priority])
        policy.insert_many(np.array([4]), np.array([0], dtype=np.uint8))
        policy.set_priority_many([1, 2], np.array([0, caps.max_priority]))
        assert len(policy) == 4

    # -- misuse -------------------------------------------------------------------------------

    @pytest.mark.parametrize("case", _MISUSE_IDS)
    def test_misuse_raises_value_error_naming_the_value_and_changes_nothing(
        self, kvcm_plugin_spec: Any, case: str
    ) -> None:
        top = kvcm_plugin_spec.capabilities.max_priority
        (call, text) = {c[0]: c[1:] for c in _misuse_cases(top)}[case]
        policy, twin = kvcm_plugin_spec.factory({}), kvcm_plugin_spec.factory({})
        _populate(policy, top)
        _populate(twin, top)
        with pytest.raises(ValueError) as info:
            call(policy)
        assert text in str(info.value), f"{info.value} does not name {text!r}"
        assert len(policy) == len(twin)
        assert _drain(policy) == _drain(twin), "a failed call changed the order"

    def test_a_page_repeated_in_a_batch_is_refused_and_nothing_is_inserted(
        self, policy: EvictionPolicy
    ) -> None:
        with pytest.raises(ValueError, match="3"):
            policy.insert_many([1, 2, 3, 4, 3])
        assert len(policy) == 0 and not any(p in policy for p in range(5))
        policy.insert_many([1, 2])
        with pytest.raises(ValueError, match="2"):
            policy.remove_many([2, 2])
        assert len(policy) == 2 and 2 in policy

    # -- order --------------------------------------------------------------------------------

    def test_lower_priority_is_evicted_first_and_default_is_35(
        self, policy: EvictionPolicy, caps: EvictionPolicyCapabilities
    ) -> None:
        if not caps.priorities:
            pytest.skip("policy declares no priorities")
        policy.insert_many([1], DEFAULT_PRIORITY + 1)
        policy.insert_many([2])
        policy.insert_many([3], DEFAULT_PRIORITY - 1)
        policy.touch_many([3])  # a use never lifts a page above a higher priority
        assert popped(policy, 1) == [3]
        policy.set_priority_many([1], 0)
        assert popped(policy, 5) == [1, 2]

    def test_a_mixed_batch_is_evicted_by_priority(
        self, policy: EvictionPolicy, caps: EvictionPolicyCapabilities
    ) -> None:
        if not caps.priorities:
            pytest.skip("policy declares no priorities")
        priorities = [50, 10, 50, 10, 0, 50, caps.max_priority]
        policy.insert_many(range(1, 8), priorities)
        victims = popped(policy, 7)
        assert victims[0] == 5 and set(victims[1:3]) == {2, 4}
        assert set(victims[3:6]) == {1, 3, 6} and victims[6] == 7
        if caps.lru_order:
            assert victims == [5, 2, 4, 1, 3, 6, 7]

    def test_a_batch_enters_in_order_least_recent_first(
        self, policy: EvictionPolicy, caps: EvictionPolicyCapabilities
    ) -> None:
        if not caps.lru_order:
            pytest.skip("policy declares no LRU order")
        policy.insert_many([9, 3, 7], 50)
        policy.insert_many(np.array([1, 8]), [50, 50])
        assert popped(policy, 2) == [9, 3]
        assert popped(policy, 10) == [7, 1, 8]

    def test_touch_many_makes_pages_most_recent_in_batch_order(
        self, policy: EvictionPolicy, caps: EvictionPolicyCapabilities
    ) -> None:
        if not caps.lru_order:
            pytest.skip("policy declares no LRU order")
        policy.insert_many(range(1, 7), [50, 50, 50, 50, 60, 60])
        policy.touch_many([2, 1, 5])
        policy.touch_many(np.array([3, 2, 3]))  # a repeat: the last use counts
        policy.remove_many([4])
        policy.insert_many([4], 50)
        assert popped(policy, 6) == [1, 2, 3, 4, 6, 5]

    def test_uses_and_removals_after_partial_pops_keep_the_order(
        self, policy: EvictionPolicy, caps: EvictionPolicyCapabilities
    ) -> None:
        # Partial pops leave a policy mid-way through a bucket: later uses and removals
        # must still find every page, wherever it is kept. (The comments give the lru
        # order; a policy without lru_order may have popped other pages, which the
        # later calls then leave out.)
        model = _Reference(caps)
        low, high = 5, min(caps.max_priority, 60)
        pages, prios = list(range(1, 21)), [low] * 10 + [high] * 10

        def do(method: str, *args: Any) -> None:
            if method != "insert_many":  # without lru_order other pages may be gone
                args = ([p for p in args[0] if p in model.entries], *args[1:])
            getattr(policy, method)(*args)
            if method == "insert_many" or method == "set_priority_many":
                batch, p = args
                for page, q in zip(batch, [p] * len(batch) if isinstance(p, int) else p,
                                   strict=True):
                    model.use(page, q)
            elif method == "touch_many":
                for page in args[0]:
                    model.use(page, model.entries[page][0])
            elif method == "remove_many":
                for page in args[0]:
                    del model.entries[page]

        do("insert_many", pages, prios)  # low: 1..10, high: 11..20
        model.check_victims(popped(policy, 3), 3)  # 1, 2, 3
        do("touch_many", [7, 5])  # low: 4 6 8 9 10 7 5
        do("touch_many", [6])  # low: 4 8 9 10 7 5 6
        do("touch_many", [5, 10])  # one page used since the pops, one not: 4 8 9 7 6 5 10
        do("remove_many", [9])
        do("remove_many", [4, 8])  # low: 7 6 5 10
        model.check_victims(popped(policy, 2), 2)  # 7, 6
        do("touch_many", [15, 5, 12])  # both priorities in one batch
        do("remove_many", [11, 10, 19])  # both priorities in one batch
        model.check_victims(popped(policy, 4), 4)  # 5, 13, 14, 16
        do("insert_many", [30, 31], [high, low])
        do("set_priority_many", [20, 12], low)
        do("touch_many", [17])
        model.check_victims(popped(policy, 1), 1)  # 31
        do("touch_many", [18, 20])
        model.check_victims(popped(policy, 100), 100)

    def test_set_priority_many_moves_pages_as_most_recent(
        self, policy: EvictionPolicy, caps: EvictionPolicyCapabilities
    ) -> None:
        if not caps.priorities:
            pytest.skip("policy declares no priorities")
        policy.insert_many(range(1, 6), 50)
        policy.set_priority_many([4, 2], [10, 10])
        policy.set_priority_many([3], 90)
        assert set(popped(policy, 2)) == {2, 4}
        if caps.lru_order:
            policy.set_priority_many([5, 1, 5], 50)  # the same priority counts as a use
            assert popped(policy, 3) == [1, 5, 3]
        else:
            assert set(popped(policy, 2)) == {1, 5}
            assert popped(policy, 2) == [3]

    def test_large_batches_keep_the_order(
        self, policy: EvictionPolicy, caps: EvictionPolicyCapabilities
    ) -> None:
        rng = random.Random(1234)
        n = 5000
        pages = rng.sample(range(1, 1 << 31), n)
        prios = [rng.choice([0, 10, DEFAULT_PRIORITY, caps.max_priority]) for _ in range(n)]
        model = _Reference(caps)
        policy.insert_many(np.array(pages[:2000], dtype=np.int64), np.array(prios[:2000]))
        policy.insert_many(pages[2000:], prios[2000:])
        for page, p in zip(pages, prios, strict=True):
            model.use(page, p)
        touched = rng.sample(pages, 1500)
        policy.touch_many(touched)
        for page in touched:
            model.use(page, model.entries[page][0])
        gone = rng.sample(pages, 1000)
        policy.remove_many(np.array(gone, dtype=np.int64))
        for page in gone:
            del model.entries[page]
        for k in (1, 16, 256, 777, 0, 5000):
            model.check_victims(popped(policy, k), k)
        assert len(policy) == len(model.entries) == 0

    def test_contains_and_len_follow_the_batches(self, policy: EvictionPolicy) -> None:
        policy.insert_many(range(0, 100, 2))
        policy.remove_many(range(0, 20, 2))
        assert len(policy) == 40
        assert all((page in policy) == (page % 2 == 0 and 20 <= page < 100) for page in range(120))

