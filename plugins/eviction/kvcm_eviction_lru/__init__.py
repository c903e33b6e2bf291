"""The ``lru`` eviction policy: least recently used first, within priority buckets.

Pages live in one of ``MAX_PRIORITY + 1`` buckets (one per priority); an index maps each
page to its priority, and a bitmask of the non-empty buckets finds the lowest one in O(1)
(``mask & -mask``). The lowest priority is evicted first, and inside a bucket the least
recently used page.

A bucket is a queue made of two plain dicts (a dict keeps insertion order, and its bulk
operations run in C):

- ``recent``: the newer pages, oldest first. Inserts and uses append here.
- ``older``: the older pages, *newest first*, so that the next victim is the last entry and
  ``dict.popitem()`` takes it in O(1). When ``older`` runs dry, ``recent`` is moved into it
  reversed (each page moves at most once per use: amortised O(1)).

Every page of ``older`` is older than every page of ``recent``, so the bucket's LRU order is
``reversed(older)`` then ``recent``. (One ordered dict popped from the front would not do:
CPython never compacts a dict on deletion, so each later ``iter`` rescans the dead front
entries, O(n) per pop. An ``OrderedDict`` avoids that but is 1.5 to 2x slower to fill.)

Each batch is a handful of C-level passes (``dict.fromkeys``, ``dict.update``, ``map`` over
bound methods, ``itertools.islice``), with fast paths for one shared priority and for a
single page; no Python loop runs per page.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Mapping
from itertools import islice, repeat
from typing import Any

from kvcm_core import hookimpl
from kvcm_core.eviction import (
    DEFAULT_PRIORITY,
    MAX_PRIORITY,
    EvictionPolicy,
    PageBatch,
    PriorityBatch,
    check_count,
    check_new_pages,
    check_no_options,
    check_present_pages,
    check_priorities,
    page_list,
)
from kvcm_core.records import EvictionPolicyCapabilities, EvictionPolicySpec

__all__ = ["CAPABILITIES", "LruPolicy"]

CAPABILITIES = EvictionPolicyCapabilities(
    priorities=True, max_priority=MAX_PRIORITY, lru_order=True
)

_consume = deque(maxlen=0).extend  # runs an iterator to its end, in C
_fromkeys = dict.fromkeys
_popitem = dict.popitem
_MISSING: Any = object()


class LruPolicy(EvictionPolicy):
    """Priority buckets 0..100, least recently used first inside a bucket.

    Args:
        options: must be empty or ``None``; the policy takes no options.

    Raises:
        ValueError: an option was given.
    """

    def __init__(self, options: Mapping[str, Any] | None = None) -> None:
        check_no_options("lru-dict", options)
        n = MAX_PRIORITY + 1
        self._recent: list[dict[int, Any]] = [{} for _ in range(n)]  # oldest first
        self._older: list[dict[int, Any]] = [{} for _ in range(n)]  # newest first
        self._index: dict[int, int] = {}  # page -> priority
        self._mask = 0  # bit p set <=> bucket p holds a page

    # -- internals (arguments already validated) --------------------------------------------

    def _link(self, pages: list[int], prio: int | list[int]) -> None:
        """Append new, distinct ``pages`` to their buckets and the index."""
        if type(prio) is int:
            new = _fromkeys(pages, prio)
            self._index.update(new)
            self._recent[prio].update(new)
            self._mask |= 1 << prio
            return
        # Mixed priorities: a plain loop beats map() over unbound dict methods here.
        self._index.update(zip(pages, prio, strict=True))
        recents = self._recent
        for page, p in zip(pages, prio, strict=True):
            recents[p][page] = None
        mask = self._mask
        for p in set(prio):
            mask |= 1 << p
        self._mask = mask

    def _unlink(self, pages: list[int] | dict[int, Any], prios: list[int]) -> None:
        """Take distinct ``pages`` out of their buckets ``prios`` (not out of the index),
        clearing the bits of buckets left empty."""
        first = prios[0]
        if prios.count(first) == len(prios):
            recent, older = self._recent[first], self._older[first]
            if not older:
                if len(recent) == len(pages):
                    recent.clear()
                else:
                    _consume(map(recent.pop, pages))
            elif list(map(recent.pop, pages, repeat(_MISSING))).count(_MISSING):
                _consume(map(older.pop, pages, repeat(None)))
            if not recent and not older:
                self._mask &= ~(1 << first)
            return
        recents, olders = self._recent, self._older
        for page, p in zip(pages, prios, strict=True):
            if recents[p].pop(page, _MISSING) is _MISSING:
                del olders[p][page]
        mask = self._mask
        for p in set(prios):
            if not recents[p] and not olders[p]:
                mask &= ~(1 << p)
        self._mask = mask

    def _pop_index(self, pages: list[int], action: str) -> list[int]:
        """Take distinct, present ``pages`` out of the index and return their priorities;
        on an absent or repeated page, restore the index and raise ValueError."""
        index = self._index
        prios: list[int] = []
        try:
            prios.extend(map(index.pop, pages))
        except (KeyError, TypeError):
            index.update(zip(pages, prios, strict=False))  # put back what was taken
            check_present_pages(pages, index, action, unique=True)
            raise  # pragma: no cover - check_present_pages raised
        return prios

    def _priorities(self, pages: list[int], action: str) -> list[int]:
        """The priorities of present ``pages`` (ValueError naming the first absent one)."""
        try:
            return list(map(self._index.__getitem__, pages))
        except (KeyError, TypeError):
            check_present_pages(pages, self._index, action, unique=False)
            raise  # pragma: no cover - check_present_pages raised

    # -- the batch contract -----------------------------------------------------------------

    def insert_many(self, pages: PageBatch, priorities: PriorityBatch = DEFAULT_PRIORITY) -> None:
        """Add ``pages`` as the most recently used pages of their priorities, in order.

        Raises:
            ValueError: a page is present or repeated, or a priority is invalid; nothing
                is changed.
        """
        pages = page_list(pages)
        if type(priorities) is int and 0 <= priorities <= MAX_PRIORITY:
            prio: int | list[int] = priorities
        else:
            prio = check_priorities(priorities, len(pages))
        index = self._index
        if type(prio) is int:
            if len(pages) == 1:
                page = pages[0]
                if page in index:
                    check_new_pages(pages, index)
                index[page] = prio
                self._recent[prio][page] = None
                self._mask |= 1 << prio
            elif pages:
                new = _fromkeys(pages, prio)
                if len(new) != len(pages) or not index.keys().isdisjoint(new):
                    check_new_pages(pages, index)
                index.update(new)
                self._recent[prio].update(new)
                self._mask |= 1 << prio
        else:
            if len(_fromkeys(pages)) != len(pages) or not index.keys().isdisjoint(pages):
                check_new_pages(pages, index)
            self._link(pages, prio)

    def remove_many(self, pages: PageBatch) -> None:
        """Forget ``pages``.

        Raises:
            ValueError: naming the first absent (or repeated) page; nothing is changed.
        """
        if type(pages) is not list or len(pages) != 1 or type(pages[0]) is not int:
            pages = page_list(pages)  # (a list of ints as it is; a bool or float refused)
        if len(pages) == 1:
            page = pages[0]
            try:
                p = self._index.pop(page)
            except (KeyError, TypeError):
                check_present_pages(pages, self._index, "remove", unique=True)
                raise  # pragma: no cover
            recent, older = self._recent[p], self._older[p]
            if recent.pop(page, _MISSING) is _MISSING:
                del older[page]
            if not recent and not older:
                self._mask &= ~(1 << p)
        elif pages:
            self._unlink(pages, self._pop_index(pages, "remove"))

    def touch_many(self, pages: PageBatch) -> None:
        """Make each page the most recently used of its priority, in order (a repeated
        page: its last use counts).

        Raises:
            ValueError: naming the first absent page; nothing is changed.
        """
        if type(pages) is not list or len(pages) != 1 or type(pages[0]) is not int:
            pages = page_list(pages)  # (a list of ints as it is; a bool or float refused)
        if len(pages) == 1:
            page = pages[0]
            try:
                p = self._index[page]
            except (KeyError, TypeError):
                check_present_pages(pages, self._index, "touch", unique=False)
                raise  # pragma: no cover
            recent = self._recent[p]
            if recent.pop(page, _MISSING) is _MISSING:
                del self._older[p][page]
            recent[page] = None
            return
        if not pages:
            return
        index = self._index
        p = index.get(pages[0])
        uses: dict[int, Any] | None = None
        if p is not None and index.get(pages[-1]) == p:
            # Likely one priority. Fast paths: every page in one half of that bucket.
            uses = _fromkeys(pages)
            if len(uses) != len(pages):  # repeats: keep each page's last use, in order
                uses = _fromkeys(reversed(_fromkeys(reversed(pages))))
            recent = self._recent[p]
            if uses.keys() <= recent.keys():
                _consume(map(recent.pop, uses))
                recent.update(uses)
                return
            older = self._older[p]
            if uses.keys() <= older.keys():
                _consume(map(older.pop, uses))
                recent.update(uses)
                return
        prios = self._priorities(pages, "touch")  # raises naming the first absent page
        first = prios[0]
        if prios.count(first) == len(prios):  # one priority, both halves of its bucket
            if uses is None:
                uses = _fromkeys(pages)
                if len(uses) != len(pages):
                    uses = _fromkeys(reversed(_fromkeys(reversed(pages))))
            recent, older = self._recent[first], self._older[first]
            if not older:
                _consume(map(recent.pop, uses))
            elif list(map(recent.pop, uses, repeat(_MISSING))).count(_MISSING):
                _consume(map(older.pop, uses, repeat(None)))
            recent.update(uses)
            return
        # Mixed priorities: one page at a time, in order (repeats included); no bucket
        # empties.
        recents, olders = self._recent, self._older
        for page, p in zip(pages, prios, strict=True):
            recent = recents[p]
            if recent.pop(page, _MISSING) is _MISSING:
                del olders[p][page]
            recent[page] = None

    def set_priority_many(self, pages: PageBatch, priorities: PriorityBatch) -> None:
        """Move each page to its priority as the most recently used page there, in order.

        Raises:
            ValueError: a page is absent or a priority is invalid; nothing is changed.
        """
        if type(pages) is not list or len(pages) != 1 or type(pages[0]) is not int:
            pages = page_list(pages)  # (a list of ints as it is; a bool or float refused)
        prio = check_priorities(priorities, len(pages))
        if not pages:
            return
        old = self._priorities(pages, "set the priority of")
        if len(_fromkeys(pages)) == len(pages):
            self._unlink(pages, old)
            self._link(pages, prio)  # overwrites the index entries
            return
        # A page repeated: one at a time, so that its last occurrence wins.
        prios = [prio] * len(pages) if type(prio) is int else prio
        for page, p in zip(pages, prios, strict=True):
            self._unlink([page], [self._index[page]])
            self._link([page], p)

    def pop_victims(self, k: int) -> list[int]:
        """Remove and return up to ``k`` pages: lowest priority first, least recently used
        first inside a priority.

        Raises:
            ValueError: ``k`` is negative or not an int.
        """
        if type(k) is not int or k < 0:
            k = check_count(k)
        mask = self._mask
        if not k or not mask:
            return []
        if k == 1:
            p = (mask & -mask).bit_length() - 1
            older = self._older[p]
            if older:
                page = older.popitem()[0]
                if not older and not self._recent[p]:
                    self._mask = mask & ~(1 << p)
                del self._index[page]
                return [page]
        out: list[int] = []
        while k and mask:
            low = mask & -mask
            p = low.bit_length() - 1
            older = self._older[p]
            if not older:
                recent = self._recent[p]
                if len(recent) <= k:  # the whole bucket
                    out += recent
                    k -= len(recent)
                    recent.clear()
                    mask ^= low
                    continue
                older = self._older[p] = _fromkeys(reversed(recent))
                recent.clear()
            if len(older) <= k:
                out += reversed(older)
                k -= len(older)
                older.clear()
                if not self._recent[p]:
                    mask ^= low
            else:
                out += islice(reversed(older), k)
                _consume(map(_popitem, repeat(older, k)))
                k = 0
        self._mask = mask
        _consume(map(self._index.pop, out))
        return out

    # -- queries ----------------------------------------------------------------------------

    def priority_of(self, page: int) -> int:
        """The priority ``page`` is held at.

        Raises:
            ValueError: ``page`` is absent.
        """
        try:
            return self._index[page]
        except KeyError:
            raise ValueError(f"cannot look up page {page}: not in the policy") from None

    def __len__(self) -> int:
        return len(self._index)

    def __contains__(self, page: object) -> bool:
        return page in self._index

    def __repr__(self) -> str:
        return f"LruPolicy({len(self)} pages)"


@hookimpl
def kvcm_eviction_policies() -> Iterator[EvictionPolicySpec]:
    """Register ``lru`` (array segments: cheapest for the batches a manager makes) and
    ``lru-dict`` (dicts: cheapest for batches of a few pages). Both order alike."""
    from kvcm_eviction_lru.segments import SegmentLruPolicy

    yield EvictionPolicySpec(
        name="lru",
        factory=SegmentLruPolicy,
        description="Least recently used first, inside priority buckets 0..100 (lowest "
        "first); array segments, a few NumPy calls per batch",
        capabilities=CAPABILITIES,
    )
    yield EvictionPolicySpec(
        name="lru-dict",
        factory=LruPolicy,
        description="Least recently used first, inside priority buckets 0..100 (lowest "
        "first); dicts, fastest for batches of a few pages",
        capabilities=CAPABILITIES,
    )
