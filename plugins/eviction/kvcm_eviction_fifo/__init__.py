"""The ``fifo`` eviction policy: first in, first out, within priority buckets.

A page is evicted in the order it entered its priority: a use (``touch``) does not reorder
it, a priority change re-enters it at the end of its new priority. Lower priorities are
evicted first. It is written one page at a time, as a
:class:`~kvcm_core.eviction.PerPagePolicy`, and so also shows the adapter: the base class
validates each batch and calls these per-page hooks.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Mapping
from typing import Any

from kvcm_core import hookimpl
from kvcm_core.eviction import MAX_PRIORITY, PerPagePolicy, check_no_options
from kvcm_core.records import EvictionPolicyCapabilities, EvictionPolicySpec

__all__ = ["CAPABILITIES", "FifoPolicy"]

CAPABILITIES = EvictionPolicyCapabilities(
    priorities=True, max_priority=MAX_PRIORITY, lru_order=False
)


class FifoPolicy(PerPagePolicy):
    """Priority buckets 0..100, oldest insertion first inside a bucket.

    Args:
        options: must be empty or ``None``; the policy takes no options.

    Raises:
        ValueError: an option was given.
    """

    def __init__(self, options: Mapping[str, Any] | None = None) -> None:
        check_no_options("fifo", options)
        # OrderedDict: popitem(last=False) is O(1), where a plain dict's first key gets
        # slower with every key deleted before it.
        self._buckets: list[OrderedDict[int, None]] = [
            OrderedDict() for _ in range(MAX_PRIORITY + 1)
        ]
        self._priority_of: dict[int, int] = {}
        self._nonempty = 0  # bit p set <=> bucket p holds a page

    # The base class calls these only with valid arguments.

    def insert(self, page: int, priority: int) -> None:
        self._buckets[priority][page] = None
        self._priority_of[page] = priority
        self._nonempty |= 1 << priority

    def remove(self, page: int) -> None:
        priority = self._priority_of.pop(page)
        bucket = self._buckets[priority]
        del bucket[page]
        if not bucket:
            self._nonempty &= ~(1 << priority)

    def touch(self, page: int) -> None:
        pass  # first in, first out: a use changes nothing

    def set_priority(self, page: int, priority: int) -> None:
        self.remove(page)
        self.insert(page, priority)

    def pop_victim(self) -> int | None:
        if not self._nonempty:
            return None
        lowest = (self._nonempty & -self._nonempty).bit_length() - 1
        page, _ = self._buckets[lowest].popitem(last=False)
        del self._priority_of[page]
        if not self._buckets[lowest]:
            self._nonempty &= ~(1 << lowest)
        return page

    def __len__(self) -> int:
        return len(self._priority_of)

    def __contains__(self, page: object) -> bool:
        return page in self._priority_of

    def __repr__(self) -> str:
        return f"FifoPolicy({len(self)} pages)"


@hookimpl
def kvcm_eviction_policies() -> Iterator[EvictionPolicySpec]:
    """Register the ``fifo`` policy."""
    yield EvictionPolicySpec(
        name="fifo",
        factory=FifoPolicy,
        description="First in, first out (uses do not reorder), inside priority buckets 0..100",
        capabilities=CAPABILITIES,
    )
