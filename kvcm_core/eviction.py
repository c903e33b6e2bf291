"""The eviction-policy contract: a batch-first ordering of evictable pages.

One policy instance exists per (level, pool group). It orders the pages that may leave
that store; the core asks it for victims in batches. Pages are integer ids chosen by the
core (non-negative, below ``2**31``). Priorities run from 0 to ``MAX_PRIORITY`` (100);
lower priorities are evicted first; ``DEFAULT_PRIORITY`` is 35.

Every method takes a whole batch: ``pages`` is a list (or other sequence) of Python ints or
a 1-D integer NumPy array. A batch means the same as the per-page calls made one after the
other in its order, except that it is all or nothing: a policy validates the whole batch
first and raises ``ValueError`` (naming the offending page or value) before changing
anything. Policies return Python ints. Each operation costs O(1) or O(log n) amortised per
page, in one Python call per batch.

Authors who prefer to write one page at a time subclass :class:`PerPagePolicy`, which
implements the batch methods (validation included) over per-page hooks.
"""

from __future__ import annotations

import abc
import operator
from collections.abc import Container, Mapping, Sequence
from typing import Any, TypeAlias

import numpy as np

from kvcm_core.errors import InvalidArgumentError

__all__ = [
    "DEFAULT_PRIORITY",
    "MAX_PRIORITY",
    "EvictionPolicy",
    "PageBatch",
    "PerPagePolicy",
    "PriorityBatch",
    "check_count",
    "check_new_pages",
    "check_present_pages",
    "check_priorities",
    "check_priority",
    "page_list",
]

DEFAULT_PRIORITY = 35
MAX_PRIORITY = 100

#: A batch of pages: a sequence of Python ints or a 1-D integer NumPy array.
PageBatch: TypeAlias = "Sequence[int] | np.ndarray"
#: Priorities of a batch: one int for every page, or one per page (sequence or 1-D array).
PriorityBatch: TypeAlias = "int | Sequence[int] | np.ndarray"


# -- validation helpers (shared by the built-in policies; free for plugin authors) ---------


def check_priority(priority: int, max_priority: int = MAX_PRIORITY) -> int:
    """Return ``priority`` if it is an int in ``0..max_priority``, else raise ValueError.

    NumPy integer scalars are accepted and returned as Python ints; bools are refused.
    """
    if isinstance(priority, bool | np.bool_) or not isinstance(priority, int | np.integer):
        raise InvalidArgumentError(f"priority={priority!r}: must be an int in 0..{max_priority}")
    if not 0 <= priority <= max_priority:
        raise InvalidArgumentError(f"priority={priority}: must be in 0..{max_priority}")
    return int(priority)


def check_priorities(
    priorities: PriorityBatch, n: int, max_priority: int = MAX_PRIORITY
) -> int | list[int]:
    """Validate the priorities of a batch of ``n`` pages.

    Args:
        priorities: one int for all pages, or a sequence or 1-D integer array of ``n``.
        n: the number of pages in the batch.
        max_priority: the highest priority accepted.

    Returns:
        One Python int when every page gets the same priority (a scalar, or a batch whose
        items are all equal: the fast path of most policies), else a list of ``n`` Python
        ints.

    Raises:
        ValueError: a priority is not an int in ``0..max_priority`` (naming it), or the
            batch does not have ``n`` items.

    Arrays are checked vectorised (dtype, then one ``min`` and one ``max``); lists with
    C-level passes (item types, ``min``, ``max``), never a Python loop unless to name the
    offending value.
    """
    kind = type(priorities)
    if kind is int:  # the common cases first: a plain int, a list
        if 0 <= priorities <= max_priority:  # type: ignore[operator]
            return priorities  # type: ignore[return-value]
        return check_priority(priorities, max_priority)  # type: ignore[arg-type]
    items: Any
    if kind is list:
        items = priorities
        if len(items) == 1 == n:
            p = items[0]
            if type(p) is int and 0 <= p <= max_priority:
                return p
            return check_priority(p, max_priority)
    elif isinstance(priorities, np.ndarray):
        if priorities.ndim == 0:
            return check_priority(priorities.item(), max_priority)
        if priorities.ndim != 1 or priorities.dtype.kind not in "iu":
            raise InvalidArgumentError(
                f"priorities: must be a 1-D integer array, got shape {priorities.shape} "
                f"dtype {priorities.dtype}"
            )
        _check_length(len(priorities), n)
        if n == 0:
            return DEFAULT_PRIORITY
        lo, hi = int(priorities.min()), int(priorities.max())
        if lo < 0 or hi > max_priority:
            bad = priorities[(priorities < 0) | (priorities > max_priority)][0]
            raise InvalidArgumentError(f"priority={int(bad)}: must be in 0..{max_priority}")
        return lo if lo == hi else priorities.tolist()  # type: ignore[no-any-return]
    elif isinstance(priorities, str | bytes):
        raise InvalidArgumentError(f"priority={priorities!r}: must be an int in 0..{max_priority}")
    elif isinstance(priorities, bool | np.integer) or not isinstance(priorities, Sequence):
        return check_priority(priorities, max_priority)  # type: ignore[arg-type]
    else:
        items = list(priorities)
    _check_length(len(items), n)  # type: ignore[arg-type]
    if n == 0:
        return DEFAULT_PRIORITY
    if set(map(type, items)) != _INT_ONLY:  # type: ignore[arg-type]
        for item in items:  # type: ignore[union-attr]
            check_priority(item, max_priority)  # raises on the first bad one
        items = [int(p) for p in items]  # type: ignore[union-attr]  # NumPy integer scalars
    lo, hi = min(items), max(items)
    if lo < 0 or hi > max_priority:
        check_priority(lo if lo < 0 else hi, max_priority)
    return lo if lo == hi else items  # type: ignore[return-value]


_INT_ONLY = {int}


def _check_length(got: int, n: int) -> None:
    if got != n:
        raise InvalidArgumentError(f"priorities: {got} given for a batch of {n} pages")


def page_list(pages: PageBatch) -> list[int]:
    """``pages`` as a list of Python ints.

    A list of Python ints is returned as it is (nothing is copied); a 1-D integer NumPy
    array through ``tolist()``; another sequence (tuple, range) through ``list()``. Items
    must be ints (NumPy integers are converted): a float, a string or a bool is refused,
    never truncated or parsed.

    Raises:
        ValueError: an array that is not 1-D or not of an integer dtype, or an item that
            is not an int.
    """
    if type(pages) is list:
        return _ints(pages)
    if isinstance(pages, np.ndarray):
        if pages.ndim != 1 or pages.dtype.kind not in "iu":
            raise InvalidArgumentError(
                f"pages: must be a 1-D integer array, got shape {pages.shape} "
                f"dtype {pages.dtype}"
            )
        return pages.tolist()  # type: ignore[no-any-return]
    if isinstance(pages, str | bytes) or not isinstance(pages, Sequence):
        raise InvalidArgumentError(f"pages: must be a sequence of ints or a 1-D integer array, got "
                         f"{type(pages).__name__}")
    return _ints(list(pages))


def _ints(pages: list[Any]) -> list[int]:
    if not pages or set(map(type, pages)) == _INT_ONLY:
        return pages
    for p in pages:
        if isinstance(p, bool) or not isinstance(p, int | np.integer):
            raise InvalidArgumentError(f"page {p!r}: pages must be ints")
    return [int(p) for p in pages]


def check_no_options(name: str, options: Mapping[str, Any] | None) -> None:
    """Raise ValueError when a policy that takes no options was given some."""
    if options:
        raise InvalidArgumentError(f"{name} eviction policy takes no options; got "
                                   f"{sorted(options)}")


def check_count(k: Any) -> int:
    """Return ``k`` (the number of victims asked for) as an int >= 0, else raise ValueError."""
    if isinstance(k, bool | np.bool_) or not isinstance(k, int | np.integer):
        raise InvalidArgumentError(f"k={k!r}: must be an int >= 0")
    if k < 0:
        raise InvalidArgumentError(f"k={k}: must be >= 0")
    return int(k)


def check_new_pages(pages: Sequence[int], present: Container[int], action: str = "insert") -> None:
    """Raise ValueError naming the first page of ``pages`` that is already in ``present``
    or repeats an earlier page of the batch (a Python loop: the slow path, or errors)."""
    seen: set[int] = set()
    for page in pages:
        if page in present:
            raise InvalidArgumentError(f"cannot {action} page {page}: already present")
        if page in seen:
            raise InvalidArgumentError(f"cannot {action} page {page}: it appears twice in the "
                                       "batch")
        seen.add(page)


def check_present_pages(
    pages: Sequence[int], present: Container[int], action: str, unique: bool
) -> None:
    """Raise ValueError naming the first page of ``pages`` that is not in ``present`` or,
    with ``unique``, repeats an earlier page of the batch (it is gone by then)."""
    seen: set[int] = set()
    for page in pages:
        if page not in present:
            raise InvalidArgumentError(f"cannot {action} page {page!r}: not in the policy")
        if unique:
            if page in seen:
                raise InvalidArgumentError(f"cannot {action} page {page}: it appears twice in the "
                                           "batch")
            seen.add(page)


# -- the contract --------------------------------------------------------------------------


class EvictionPolicy(abc.ABC):
    """Orders evictable pages; ``pop_victims`` removes them in that order.

    A policy's order must be a function of the calls it received (no randomness, no
    clocks): the conformance suite replays calls to compare states.
    """

    @abc.abstractmethod
    def insert_many(self, pages: PageBatch, priorities: PriorityBatch = DEFAULT_PRIORITY) -> None:
        """Add ``pages``, each as the most recently used page of its priority, in order
        (the first of the batch is the least recent of the batch).

        Args:
            pages: new pages (ints or a 1-D integer array).
            priorities: one int for all, or one per page (sequence or array).

        Raises:
            ValueError: a page is already present or appears twice in the batch, a
                priority is not an int in ``0..max_priority``, or the lengths differ;
                nothing is changed.
        """

    def insert_many_checked_by_caller(self, pages: np.ndarray,
                                      priorities: int | np.ndarray) -> None:
        """:meth:`insert_many` for a batch the core built: an int64 array of distinct page
        ids in ``0..2**31-1`` none of which is present, and one int priority or an int64
        array of them, all in ``0..max_priority``. A policy may skip its argument checks
        here (the core never breaks these promises); the default runs
        :meth:`insert_many`. The result must be the same as :meth:`insert_many`'s."""
        self.insert_many(pages, priorities)

    @abc.abstractmethod
    def remove_many(self, pages: PageBatch) -> None:
        """Forget ``pages``.

        Raises:
            ValueError: naming the first page that is absent (or repeated in the batch);
                nothing is changed.
        """

    def remove_many_checked_by_caller(self, pages: np.ndarray) -> None:
        """:meth:`remove_many` for a batch the core built: an int64 array of distinct page
        ids in ``0..2**31-1``, every one present. A policy may skip its argument checks
        here (the core never breaks these promises); the default runs
        :meth:`remove_many`. The result must be the same as :meth:`remove_many`'s."""
        self.remove_many(pages)

    @abc.abstractmethod
    def touch_many(self, pages: PageBatch) -> None:
        """Record a use of each page, in order: each becomes the most recently used page of
        its priority (a page may appear more than once; its last use counts).

        Raises:
            ValueError: naming the first absent page; nothing is changed.
        """

    @abc.abstractmethod
    def set_priority_many(self, pages: PageBatch, priorities: PriorityBatch) -> None:
        """Move each page to its new priority as the most recently used page there, in
        order (the same priority counts as a use).

        Raises:
            ValueError: a page is absent or a priority is invalid; nothing is changed.
        """

    @abc.abstractmethod
    def pop_victims(self, k: int) -> list[int] | np.ndarray:
        """Remove and return up to ``k`` pages in eviction order (lowest priority first,
        then the policy's order inside a priority), as a list of ints or a 1-D integer
        NumPy array (cheaper for array-backed policies). Fewer when the policy holds
        fewer; empty for ``k == 0`` or an empty policy.

        Raises:
            ValueError: ``k`` is negative or not an int.
        """

    def pop_victim_runs(self, k: int) -> tuple[list[int] | np.ndarray,
                                               list[tuple[int, int]] | None]:
        """:meth:`pop_victims`, with the priorities the pages were held at as runs
        ``(priority, count)`` in the order of the pages (counts summing to their number),
        or None where the policy does not tell (the default). The core moving popped
        pages to a colder level files them there at those priorities without reading
        them again."""
        return self.pop_victims(k), None

    def insert_runs_checked_by_caller(self, pages: np.ndarray,
                                      runs: Sequence[tuple[int, int]]) -> None:
        """:meth:`insert_many_checked_by_caller` with the priorities as runs ``(priority,
        count)``: the first ``count`` pages at the first priority, and so on (counts of
        at least 1 summing to ``len(pages)``). The default expands them."""
        if len(runs) == 1:
            self.insert_many_checked_by_caller(pages, int(runs[0][0]))
            return
        self.insert_many_checked_by_caller(pages, np.repeat(
            np.asarray([p for p, _ in runs], dtype=np.int64), [c for _, c in runs]))

    def reserve(self, num_pages: int) -> None:
        """A hint, given once when the manager is built: page ids will mostly be below
        ``num_pages`` (the page arena's size). A policy that keeps arrays indexed by
        page id may size them now rather than grow them under load; it must behave the
        same either way. The default ignores it."""
        return None

    @abc.abstractmethod
    def __len__(self) -> int: ...

    @abc.abstractmethod
    def __contains__(self, page: object) -> bool: ...


class PerPagePolicy(EvictionPolicy):
    """Adapts a per-page policy to the batch contract.

    Subclasses implement ``insert``, ``remove``, ``touch``, ``set_priority``,
    ``pop_victim``, ``__len__`` and ``__contains__``; this base class implements the batch
    methods: it validates the whole batch (pages present or absent as needed, no
    duplicates where they are not allowed, priorities in ``0..max_priority``), then calls
    the hook once per page, in order. Hooks are therefore only ever called with valid
    arguments and need not check them (a Python ``int`` page, a Python ``int`` priority).

    ``max_priority`` (class attribute, default ``MAX_PRIORITY``) bounds the priorities
    accepted; keep it equal to the ``max_priority`` the record's capabilities declare.
    """

    max_priority: int = MAX_PRIORITY

    # -- hooks ------------------------------------------------------------------------------

    @abc.abstractmethod
    def insert(self, page: int, priority: int) -> None:
        """Add ``page`` (absent) at ``priority``."""

    @abc.abstractmethod
    def remove(self, page: int) -> None:
        """Forget ``page`` (present)."""

    @abc.abstractmethod
    def touch(self, page: int) -> None:
        """Record a use of ``page`` (present)."""

    @abc.abstractmethod
    def set_priority(self, page: int, priority: int) -> None:
        """Move ``page`` (present) to ``priority``."""

    @abc.abstractmethod
    def pop_victim(self) -> int | None:
        """Remove and return the next victim, or ``None`` when empty."""

    # -- the batch contract -----------------------------------------------------------------

    def insert_many(self, pages: PageBatch, priorities: PriorityBatch = DEFAULT_PRIORITY) -> None:
        pages = page_list(pages)
        prio = check_priorities(priorities, len(pages), self.max_priority)
        check_new_pages(pages, self)
        insert = self.insert
        if type(prio) is int:
            for page in pages:
                insert(page, prio)
        else:
            for page, p in zip(pages, prio, strict=True):  # type: ignore[arg-type]
                insert(page, p)

    def remove_many(self, pages: PageBatch) -> None:
        pages = page_list(pages)
        check_present_pages(pages, self, "remove", unique=True)
        for page in pages:
            self.remove(page)

    def touch_many(self, pages: PageBatch) -> None:
        pages = page_list(pages)
        check_present_pages(pages, self, "touch", unique=False)
        for page in pages:
            self.touch(page)

    def set_priority_many(self, pages: PageBatch, priorities: PriorityBatch) -> None:
        pages = page_list(pages)
        prio = check_priorities(priorities, len(pages), self.max_priority)
        check_present_pages(pages, self, "set the priority of", unique=False)
        prios: list[int] = [prio] * len(pages) if isinstance(prio, int) else prio
        for page, p in zip(pages, prios, strict=True):
            self.set_priority(page, p)

    def pop_victims(self, k: int) -> list[int]:
        k = check_count(k)
        out: list[int] = []
        pop = self.pop_victim
        while len(out) < k:
            page = pop()
            if page is None:
                break
            out.append(operator.index(page))
        return out
