"""The eviction-policy contract: an ordering of evictable pages.

One policy instance exists per (level, pool group). Keys are page handles (ints) chosen by
the core. Priorities run from 0 to ``max_priority`` (100); lower priorities are evicted
first; ``DEFAULT_PRIORITY`` is 35. Every operation is O(1) or O(log n).
"""

from __future__ import annotations

import abc
from collections.abc import Hashable, Iterator

__all__ = ["DEFAULT_PRIORITY", "MAX_PRIORITY", "EvictionPolicy", "check_priority"]

DEFAULT_PRIORITY = 35
MAX_PRIORITY = 100


def check_priority(priority: int) -> int:
    """Return ``priority`` if it is an int in ``0..MAX_PRIORITY``, else raise ValueError."""
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise ValueError(f"priority={priority!r}: must be an int in 0..{MAX_PRIORITY}")
    if not 0 <= priority <= MAX_PRIORITY:
        raise ValueError(f"priority={priority}: must be in 0..{MAX_PRIORITY}")
    return priority


class EvictionPolicy(abc.ABC):
    """Orders evictable keys; the next victim is the first in that order."""

    @abc.abstractmethod
    def insert(self, key: Hashable, priority: int = DEFAULT_PRIORITY) -> None:
        """Add ``key`` as most recently used in its priority (ValueError if present)."""

    @abc.abstractmethod
    def remove(self, key: Hashable) -> None:
        """Forget ``key`` (ValueError if absent)."""

    @abc.abstractmethod
    def touch(self, key: Hashable) -> None:
        """Record a use of ``key`` (ValueError if absent)."""

    @abc.abstractmethod
    def set_priority(self, key: Hashable, priority: int) -> None:
        """Move ``key`` to ``priority`` as most recently used there."""

    @abc.abstractmethod
    def pop_victim(self) -> Hashable | None:
        """Remove and return the next victim, or ``None`` when empty."""

    @abc.abstractmethod
    def victims(self) -> Iterator[Hashable]:
        """Keys in eviction order, without removing them (lazy)."""

    @abc.abstractmethod
    def __len__(self) -> int: ...

    @abc.abstractmethod
    def __contains__(self, key: object) -> bool: ...
