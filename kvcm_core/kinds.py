"""Per-kind life-cycle behaviour: one class per kind of life cycle.

A :class:`~kvcm_core.lifecycle.LifeCycle` says what a cache group is; its kind says how a
request's pages of that group behave: which blocks a prefix match claims, which blocks
become stale (and are released) as history grows, and how the group's page table is
built. :func:`make_kind` picks the class; the cache asks the kind instead of branching on
windows and SSM state.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence

import numpy as np

from kvcm_core.backend import BAD_PAGE_INDEX
from kvcm_core.lifecycle import LifeCycle
from kvcm_core.radix import PrefixTree
from kvcm_core.storage import PageArena

__all__ = ["FullAttention", "LifeCycleKind", "PageList", "SlidingWindow", "SsmState", "make_kind",
           "page_ids", "page_list", "pages_of"]

#: A cache's page ids of one group, per block (``-1``: none): a typed array of int64, not a
#: list. A close turns it into a NumPy array with one copy of contiguous memory; a list's
#: items are int objects spread over the heap, and reading them cost a cache miss each
#: (about 40% of a decode request's close, measured on 2026-12-06).
PageList = array


def page_list(items: Iterable[int] = ()) -> PageList:
    """A new :data:`PageList` of ``items``."""
    return array("q", items)


def pages_of(ids: np.ndarray) -> PageList:
    """A new :data:`PageList` of the page ids in ``ids`` (any integer dtype)."""
    out = array("q")
    out.frombytes(np.ascontiguousarray(ids, dtype=np.int64).tobytes())
    return out


def page_ids(pages: Sequence[int]) -> np.ndarray:
    """Page ids (a PageList, a list, a tuple) as a new int64 NumPy array. Always a copy: a
    view of a PageList would pin its buffer (no append while the view lives) and change
    with it."""
    return np.array(pages, dtype=np.int64)


_MINUS_ONE = array("q", [-1])

_NO_STALE = (0, 0)


class LifeCycleKind:
    """Behaviour shared by attention kinds (one page per block).

    Args:
        group: the cache group id.
        lc: its life cycle.
        tpb: tokens per block.
    """

    is_ssm = False
    windowed = False

    def __init__(self, group: int, lc: LifeCycle, tpb: int) -> None:
        self.group = group
        self.lc = lc
        self.tpb = tpb

    def stale_range(self, history: int) -> tuple[int, int]:
        """Blocks ``[start, end)`` no read at position ``history`` needs."""
        return self.lc.stale_range(history, self.tpb)

    def table_key(self, history: int) -> tuple[int, int]:
        """The part of the page table that depends on history (cache key)."""
        return self.stale_range(history)

    def claim(self, tree: PrefixTree, nodes: np.ndarray, end: int) -> PageList:
        """Page ids a match ending at ``end`` offers, per block (``-1``: none or stale)."""
        nb = -(-end // self.tpb)
        pages = pages_of(tree.pages[nodes[:nb], self.group])
        start, stop = self.stale_range(end)
        if stop > start:
            pages[start:stop] = _MINUS_ONE * (stop - start)
        return pages

    def releasable(self, pages: Sequence[int], keep: int, released_to: int) -> range:
        """Blocks whose pages may go once history reaches ``keep`` (none by default)."""
        return range(0)

    def table(self, pages: Sequence[int], history: int, nb: int, arena: PageArena) -> np.ndarray:
        """Slot ids of the blocks ``[0, nb)`` on level 0 (``BAD_PAGE_INDEX`` elsewhere)."""
        p = np.asarray(pages[:nb], dtype=np.int64)
        table = np.full(nb, BAD_PAGE_INDEX, dtype=np.int32)
        if len(p):
            # p == -1 reads the last row; the mask discards it.
            ok = (p >= 0) & (arena.level[p] == 0)
            table[: len(p)] = np.where(ok, arena.slot[p], BAD_PAGE_INDEX)
        start, stop = self.stale_range(history)
        if stop > start:
            table[start:stop] = BAD_PAGE_INDEX
        return table


class FullAttention(LifeCycleKind):
    """Full attention: every block is needed at every step; nothing is ever stale."""

    def stale_range(self, history: int) -> tuple[int, int]:
        return _NO_STALE

    def table_key(self, history: int) -> tuple[int, int]:
        return _NO_STALE

    def claim(self, tree: PrefixTree, nodes: np.ndarray, end: int) -> PageList:
        nb = -(-end // self.tpb)
        return pages_of(tree.pages[nodes[:nb], self.group])


class SlidingWindow(LifeCycleKind):
    """A sliding window with sink blocks: blocks between the sinks and the window are
    stale and released as history grows."""

    windowed = True

    def releasable(self, pages: Sequence[int], keep: int, released_to: int) -> range:
        start, stop = self.stale_range(keep)
        return range(max(start, released_to), min(stop, len(pages)))


class SsmState(LifeCycleKind):
    """Recurrent state: one live page per request, shown at block ``history // tpb``;
    a match is served only by a snapshot taken exactly at its endpoint."""

    is_ssm = True

    def claim(self, tree: PrefixTree, nodes: np.ndarray, end: int) -> list[int]:
        if not end:
            return []
        nid = int(nodes[(end - 1) // self.tpb])
        pid = int(tree.pages[nid, self.group])
        return [pid] if pid >= 0 and tree.end(nid) == end else []

    def state_table(self, live: int, history: int, nb: int, arena: PageArena) -> np.ndarray:
        table = np.full(nb, BAD_PAGE_INDEX, dtype=np.int32)
        b = history // self.tpb
        if live >= 0 and arena.level[live] == 0 and b < nb:
            table[b] = arena.slot[live]
        return table


def make_kind(group: int, lc: LifeCycle, tpb: int) -> LifeCycleKind:
    if lc.is_ssm:
        return SsmState(group, lc, tpb)
    if lc.window is None:
        return FullAttention(group, lc, tpb)
    return SlidingWindow(group, lc, tpb)
