"""The ``lru`` eviction policy: least recently used first, within priority buckets.

Keys live in one of ``MAX_PRIORITY + 1`` buckets (one per priority). A bucket is a dict,
whose insertion order is its LRU order (oldest first); a touch moves a key to the end. The
lowest priority is evicted first, and inside a bucket the least recently used key. A
bitmask of the non-empty buckets finds the lowest one in O(1) (``mask & -mask``), so every
operation is O(1).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator, Mapping
from typing import Any

from kvcm_core import hookimpl
from kvcm_core.eviction import DEFAULT_PRIORITY, MAX_PRIORITY, EvictionPolicy, check_priority
from kvcm_core.records import EvictionPolicyCapabilities, EvictionPolicySpec

__all__ = ["CAPABILITIES", "LruPolicy"]

CAPABILITIES = EvictionPolicyCapabilities(
    priorities=True, max_priority=MAX_PRIORITY, lru_order=True
)


class LruPolicy(EvictionPolicy):
    """Priority buckets 0..100, least recently used first inside a bucket.

    Args:
        options: must be empty or ``None``; the policy takes no options.

    Raises:
        ValueError: an option was given.
    """

    def __init__(self, options: Mapping[str, Any] | None = None) -> None:
        if options:
            raise ValueError(f"lru eviction policy takes no options; got {sorted(options)}")
        self._buckets: list[dict[Hashable, None]] = [{} for _ in range(MAX_PRIORITY + 1)]
        self._priority_of: dict[Hashable, int] = {}
        self._nonempty = 0  # bit p set <=> bucket p holds a key

    def _add(self, key: Hashable, priority: int) -> None:
        self._buckets[priority][key] = None
        self._priority_of[key] = priority
        self._nonempty |= 1 << priority

    def _drop(self, key: Hashable) -> int:
        priority = self._priority_of.pop(key)
        bucket = self._buckets[priority]
        del bucket[key]
        if not bucket:
            self._nonempty &= ~(1 << priority)
        return priority

    def _priority(self, key: Hashable, action: str) -> int:
        try:
            return self._priority_of[key]
        except KeyError:
            raise ValueError(f"cannot {action} key {key!r}: not in the policy") from None

    def insert(self, key: Hashable, priority: int = DEFAULT_PRIORITY) -> None:
        """Add ``key`` as the most recently used key of ``priority``.

        Raises:
            ValueError: ``key`` is already present, or ``priority`` is not in 0..100.
        """
        check_priority(priority)
        if key in self._priority_of:
            raise ValueError(
                f"cannot insert key {key!r}: already present (priority {self._priority_of[key]})"
            )
        self._add(key, priority)

    def remove(self, key: Hashable) -> None:
        """Forget ``key``.

        Raises:
            ValueError: ``key`` is absent.
        """
        self._priority(key, "remove")
        self._drop(key)

    def touch(self, key: Hashable) -> None:
        """Make ``key`` the most recently used key of its priority.

        Raises:
            ValueError: ``key`` is absent.
        """
        priority = self._priority(key, "touch")
        bucket = self._buckets[priority]
        del bucket[key]
        bucket[key] = None

    def set_priority(self, key: Hashable, priority: int) -> None:
        """Move ``key`` to ``priority``, as the most recently used key there.

        Raises:
            ValueError: ``key`` is absent, or ``priority`` is not in 0..100.
        """
        check_priority(priority)
        self._priority(key, "set the priority of")
        self._drop(key)
        self._add(key, priority)

    def pop_victim(self) -> Hashable | None:
        """Remove and return the least recently used key of the lowest priority, or
        ``None`` when the policy is empty."""
        if not self._nonempty:
            return None
        lowest = (self._nonempty & -self._nonempty).bit_length() - 1
        key = next(iter(self._buckets[lowest]))
        self._drop(key)
        return key

    def victims(self) -> Iterator[Hashable]:
        """Keys in eviction order, lazily; the policy must not change while iterating."""
        mask = self._nonempty
        while mask:
            low = mask & -mask
            yield from self._buckets[low.bit_length() - 1]
            mask ^= low

    def priority_of(self, key: Hashable) -> int:
        """The priority ``key`` is held at.

        Raises:
            ValueError: ``key`` is absent.
        """
        return self._priority(key, "look up")

    def __len__(self) -> int:
        return len(self._priority_of)

    def __contains__(self, key: object) -> bool:
        return key in self._priority_of

    def __repr__(self) -> str:
        return f"LruPolicy({len(self)} keys)"


@hookimpl
def kvcm_eviction_policies() -> Iterator[EvictionPolicySpec]:
    """Register the ``lru`` policy."""
    yield EvictionPolicySpec(
        name="lru",
        factory=LruPolicy,
        description="Least recently used first, inside priority buckets 0..100 (lowest first)",
        capabilities=CAPABILITIES,
    )
