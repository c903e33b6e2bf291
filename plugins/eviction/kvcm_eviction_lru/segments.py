"""An LRU over page ids kept as array segments: every batch costs a few NumPy calls
whatever its size, and no Python code runs per page.

Each priority has a queue of *segments*, one per batch that entered it (an insert or a
touch), oldest first; a segment is an int64 array of page ids, oldest first, tagged with a
serial number. ``stamp[page]`` is the serial of the segment holding the page's live entry
(``0``: absent). Removing or touching a page only changes its stamp, so the entry it leaves
behind is dead and skipped when its segment is reached; the queues are rebuilt from their
live entries once dead ones outnumber live ones (amortised O(1) per page). Victims are the
live entries of the lowest non-empty priority, front segment first. The segments that
hold a dead entry are known (by serial), and only those are read when reached: any other
is handed out as it is, with no stamp read (in the trace replay over three levels, all but
about one segment in twenty: pages leave as victims far more often than they are claimed
back).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from kvcm_core.eviction import (
    DEFAULT_PRIORITY,
    MAX_PRIORITY,
    EvictionPolicy,
    PageBatch,
    PriorityBatch,
    check_count,
    check_no_options,
    check_priorities,
)

__all__ = ["SegmentLruPolicy"]

_NPRIO = MAX_PRIORITY + 1
_INT_ONLY = {int}
# Page ids from here on are mapped to internal ids from _BIG up, handed out in order: the
# arrays grow with the number of big ids seen, not with their values (a manager's page
# ids are dense arena ids, recycled: big ones come only past 4M pages).
_BIG = 1 << 22
_COMPACT_SLACK = 4096  # dead entries tolerated before a rebuild is considered
_SMALL = 16  # batches up to this size are checked in plain Python
_FEW_RUNS = 8  # a mixed-priority insert of fewer runs stamps them run by run
_FEW_SEGMENTS = 32  # pages leaving from more runs of segments are sorted to find them


def _runs(pr: np.ndarray) -> list[tuple[int, int, int]]:
    """``(priority, start, stop)`` for each run of equal values of ``pr`` (not empty)."""
    cuts = (np.nonzero(pr[1:] != pr[:-1])[0] + 1).tolist()
    starts = [0, *cuts]
    values = pr[starts].tolist()
    return list(zip(values, starts, [*cuts, len(pr)], strict=True))


def _as_pages(pages: PageBatch) -> np.ndarray:
    if isinstance(pages, np.ndarray):
        if pages.ndim != 1 or pages.dtype.kind not in "iu":
            raise ValueError(f"pages: must be a 1-D integer array, got shape {pages.shape} "
                             f"dtype {pages.dtype}")
        return pages.astype(np.int64, copy=False)
    if isinstance(pages, str | bytes):
        raise ValueError(f"pages: must be a sequence of ints or a 1-D integer array, got "
                         f"{type(pages).__name__}")
    try:
        arr = np.asarray(pages, dtype=np.int64)
    except (TypeError, ValueError, OverflowError):
        raise ValueError(f"pages: must be ints, got {pages!r:.80}") from None
    if arr.ndim != 1:
        raise ValueError(f"pages: must be a flat sequence of ints, got shape {arr.shape}")
    if len(arr) and set(map(type, pages)) != _INT_ONLY:  # a float or str is not a page
        for p in pages:
            if isinstance(p, bool) or not isinstance(p, int | np.integer):
                raise ValueError(f"page {p!r}: pages must be ints")
    return arr


class SegmentLruPolicy(EvictionPolicy):
    """Priority buckets 0..100, least recently used first inside a bucket (see module).

    Args:
        options: must be empty or ``None``.
    """

    def __init__(self, options: Mapping[str, Any] | None = None) -> None:
        check_no_options("lru", options)
        self._stamp = np.zeros(1024, dtype=np.int64)
        self._prio = np.zeros(1024, dtype=np.int8)
        self._queues: list[deque[tuple[int, np.ndarray]]] = [deque() for _ in range(_NPRIO)]
        self._live = [0] * _NPRIO
        # Dead entries per queue (its entries less its live pages), and the serials of the
        # segments that hold any: a pop takes any other segment as it is, reading no stamp
        # (nothing left it since it entered: the usual case).
        self._dead = [0] * _NPRIO
        self._dirty: set[int] = set()
        self._mask = 0  # bit p set <=> priority p holds a live page
        self._serial = 0
        self._entries = 0  # entries in all queues, live or dead
        self._count = 0
        self._to_inner: dict[int, int] = {}  # big page id -> internal id (>= _BIG)
        self._to_outer: dict[int, int] = {}

    # -- helpers

    def _inner(self, arr: np.ndarray, create: bool) -> np.ndarray:
        """Page ids as internal ids: big ids are mapped (``create``: new ones get one;
        else an unknown big id maps to -1, which is never present)."""
        if not len(arr) or int(arr.max()) < _BIG:
            return arr
        out = arr.copy()
        for i in np.flatnonzero(arr >= _BIG).tolist():
            page = int(arr[i])
            inner = self._to_inner.get(page)
            if inner is None:
                if not create:
                    out[i] = -1
                    continue
                inner = _BIG + len(self._to_inner)
                self._to_inner[page] = inner
                self._to_outer[inner] = page
            out[i] = inner
        return out

    def _outer(self, arr: np.ndarray) -> list[int]:
        out = arr.tolist()
        if self._to_outer and len(arr) and int(arr.max()) >= _BIG:
            out = [self._to_outer.get(p, p) for p in out]
        return out

    def reserve(self, num_pages: int) -> None:
        """Size the arrays for page ids below ``num_pages`` now (up to the mapped range),
        so that the first batches of a new manager do not grow them."""
        n = min(int(num_pages), _BIG)
        if n > len(self._stamp):
            self._grow(n)

    def _grow(self, n: int) -> None:
        """The arrays indexed by internal id, ``n`` long (longer than they are)."""
        self._stamp = np.concatenate([self._stamp, np.zeros(n - len(self._stamp), np.int64)])
        self._prio = np.concatenate([self._prio, np.zeros(n - len(self._prio), np.int8)])

    def _fit(self, arr: np.ndarray) -> bool:
        """Check page ids and grow the arrays for the internal ids they will use; True
        when every id is small (its own internal id)."""
        if not len(arr):
            return True
        lo, hi = int(np.minimum.reduce(arr)), int(np.maximum.reduce(arr))
        small = hi < _BIG
        if lo < 0 or hi >= 1 << 31:
            bad = lo if lo < 0 else hi
            raise ValueError(f"page {bad}: page ids must be in 0..2**31-1")
        if hi >= _BIG:  # the internal ids the new big ids will take
            big = arr[arr >= _BIG].tolist()
            known = self._to_inner
            hi = _BIG + len(known) + len({p for p in big if p not in known}) - 1
        if hi >= len(self._stamp):  # doubling (the mapped part alone past _BIG)
            n = max(hi + 1, _BIG + 2 * (hi + 1 - _BIG) if hi >= _BIG else 2 * len(self._stamp))
            self._grow(n)
        return small

    def _present(self, arr: np.ndarray) -> np.ndarray:
        inside = (arr >= 0) & (arr < len(self._stamp))
        out = np.zeros(len(arr), dtype=np.bool_)
        out[inside] = self._stamp[arr[inside]] > 0
        return out

    @staticmethod
    def _first_repeat(arr: np.ndarray) -> int | None:
        if len(arr) < 2:
            return None
        srt = np.sort(arr)
        dup = srt[1:] == srt[:-1]
        if not np.count_nonzero(dup):
            return None
        repeated = set(srt[1:][dup].tolist())
        seen: set[int] = set()
        for p in arr.tolist():  # name the first page that repeats an earlier one
            if p in repeated and p in seen:
                return p
            seen.add(p)
        return None  # pragma: no cover

    def _append(self, arr: np.ndarray,
                prio: int | list[int] | np.ndarray | list[tuple[int, int, int]]) -> None:
        """Enter pages (absent, distinct) as most recent, one segment per priority run:
        ``prio`` is one int, a priority per page, or the runs ``(priority, start, stop)``
        of :func:`_runs`."""
        if type(prio) is int:
            runs = [(prio, 0, len(arr))]
        elif type(prio) is list and prio and type(prio[0]) is tuple:
            runs = prio  # type: ignore[assignment]
        else:
            runs = _runs(np.asarray(prio, dtype=np.int64))
        # One segment per run of equal priority, in order (recency within a priority is
        # kept: its runs enter one after the other).
        for p, a, b in runs:
            seg = arr[a:b].copy()
            self._serial += 1
            self._stamp[seg] = self._serial
            self._prio[seg] = p
            self._queues[p].append((self._serial, seg))
            self._live[p] += b - a
            self._mask |= 1 << p
            self._entries += b - a
        self._count += len(arr)

    def _drop(self, arr: np.ndarray) -> None:
        """Take present, distinct pages out (their entries become dead)."""
        pr = self._prio[arr]
        p0 = int(pr[0])
        if not np.count_nonzero(pr != p0):
            counts = {p0: len(arr)}
        else:
            c = np.bincount(pr.astype(np.intp), minlength=_NPRIO)
            u = np.nonzero(c)[0]
            counts = dict(zip(u.tolist(), c[u].tolist(), strict=True))
        # The segments their entries are in, one per run of equal serials (pages leave in
        # the runs they entered in: a few runs, whatever the number of pages).
        st = self._stamp[arr]
        ends = (st[1:] != st[:-1]).nonzero()[0]
        if len(ends) <= _FEW_SEGMENTS:
            self._dirty.update([*st.take(ends).tolist(), st.item(-1)])
        else:
            self._dirty.update(np.unique(st).tolist())
        live, dead = self._live, self._dead
        for p, c in counts.items():
            live[p] -= c
            dead[p] += c
            if not live[p]:
                self._clear(p)
        self._stamp[arr] = 0
        self._count -= len(arr)

    def _clear(self, p: int) -> None:
        """Empty the queue of priority ``p``, whose entries are all dead."""
        queue, dirty = self._queues[p], self._dirty
        if dirty:
            dirty.difference_update([serial for serial, _ in queue])
        queue.clear()
        self._entries -= self._dead[p]
        self._dead[p] = 0
        self._mask &= ~(1 << p)

    def _maybe_compact(self) -> None:
        if self._entries <= 2 * self._count + _COMPACT_SLACK:
            return
        stamp = self._stamp
        total = 0
        for p, queue in enumerate(self._queues):
            if not queue:
                continue
            live = [s[stamp[s] == serial] for serial, s in queue]
            queue.clear()
            merged = np.concatenate(live) if live else np.empty(0, np.int64)
            if len(merged):
                self._serial += 1
                stamp[merged] = self._serial
                queue.append((self._serial, merged))
            total += len(merged)
            if not len(merged):
                self._mask &= ~(1 << p)
        self._entries = total
        self._dead = [0] * _NPRIO
        self._dirty.clear()

    def _check_absent(self, arr: np.ndarray, inner: np.ndarray) -> None:
        action = "insert"
        here = self._present(inner)
        if here.any():
            raise ValueError(f"cannot {action} page {int(arr[here][0])}: already present")
        rep = self._first_repeat(arr)
        if rep is not None:
            raise ValueError(f"cannot {action} page {rep}: it appears twice in the batch")

    def _check_present(self, arr: np.ndarray, inner: np.ndarray, action: str,
                       unique: bool) -> None:
        here = self._present(inner)
        if not here.all():
            raise ValueError(f"cannot {action} page {int(arr[~here][0])}: not in the policy")
        if unique:
            rep = self._first_repeat(arr)
            if rep is not None:
                raise ValueError(f"cannot {action} page {rep}: it appears twice in the batch")

    # -- the batch contract --------------------------------------------------------------------

    def insert_many(self, pages: PageBatch, priorities: PriorityBatch = DEFAULT_PRIORITY) -> None:
        """Add ``pages`` as the most recently used pages of their priorities, in order.

        Raises:
            ValueError: a page is present or repeated, or a priority is invalid; nothing
                is changed.
        """
        arr = _as_pages(pages)
        n = len(arr)
        if 0 < n <= _SMALL and self._insert_small(arr, priorities):
            return
        if isinstance(priorities, np.ndarray) and priorities.ndim == 1 and \
                priorities.dtype.kind in "iu" and len(priorities) == len(arr) and len(arr):
            # Checked by its runs' values (one per run), kept as runs.
            runs = _runs(priorities.astype(np.int64, copy=False))
            values = [r[0] for r in runs]
            if min(values) < 0 or max(values) > MAX_PRIORITY:
                check_priorities(priorities, len(arr))  # raises, naming the value
            prio: int | np.ndarray | list[int] | list[tuple[int, int, int]] = runs
        else:
            prio = check_priorities(priorities, len(arr))
        if not len(arr):
            return
        if self._fit(arr):  # small ids only: the arrays cover them
            if np.count_nonzero(self._stamp[arr]):
                self._check_absent(arr, arr)
            if len(arr) > 1:
                srt = np.sort(arr)
                if np.count_nonzero(srt[1:] == srt[:-1]):
                    self._check_absent(arr, arr)
            self._append(arr, prio)
            return
        self._check_absent(arr, self._inner(arr, create=False))
        self._append(self._inner(arr, create=True), prio)

    def insert_many_checked_by_caller(self, pages: np.ndarray,
                                      priorities: int | np.ndarray) -> None:
        """:meth:`insert_many` without its checks (the caller promises distinct absent
        ids below 2**31 and valid priorities): only the arrays grow."""
        n = len(pages)
        if not n:
            return
        # (argmax and an index: half the cost of the max reduction on a small batch)
        hi = int(pages[pages.argmax()]) if n > 1 else int(pages[0])
        if hi >= _BIG:  # big ids are mapped: the general path
            self.insert_many(pages, priorities)
            return
        if hi >= len(self._stamp):
            self._fit(pages)
        if n == 1:  # _append of one page, on scalars
            p = priorities if type(priorities) is int else int(priorities[0])
            self._serial += 1
            self._stamp[hi] = self._serial
            self._prio[hi] = p
            self._queues[p].append((self._serial, pages.copy()))
            self._live[p] += 1
            self._mask |= 1 << p
            self._entries += 1
            self._count += 1
            return
        if type(priorities) is int:
            self._append(pages, priorities)
        else:
            self._append_mixed(pages, priorities)

    def _append_mixed(self, arr: np.ndarray, pr: np.ndarray) -> None:
        """:meth:`_append` of distinct absent pages with a priority each (int64): a few
        runs of equal priority enter as a segment each, in order; many (the closes of
        many requests, each with a demoted leaf) as one segment per priority, its pages
        in batch order, built with a few array operations per priority. A queue is its
        pages' order, so the segments one batch adds to one queue may as well be one
        (a Python step per run would cost one per request)."""
        n = len(arr)
        # The last index of each run but the final one (the method: np.flatnonzero adds
        # a ravel and a dispatch).
        ends = (pr[1:] != pr[:-1]).nonzero()[0]
        if not len(ends):
            self._append(arr, int(pr[0]))
            return
        if len(ends) < _FEW_RUNS:  # (victims moved down: a run per priority) a scatter each
            cuts = [e + 1 for e in ends.tolist()]
            values = [*pr.take(ends).tolist(), pr.item(-1)]  # at each run's last index
            counts = [b - a for a, b in zip([0, *cuts], [*cuts, n], strict=True)]
            self._append_runs(arr, zip(values, counts, strict=True))
            return
        # The priorities present: those at each run's end (a run per request: fewer
        # values than pages, and cheaper than a count of every page's).
        prios = set(pr.take(ends).tolist())
        prios.add(pr.item(-1))
        queues, live, stamp, prio = self._queues, self._live, self._stamp, self._prio
        for p in prios:
            seg = arr[pr == p]  # (a copy: no one else holds it)
            self._serial += 1
            stamp[seg] = self._serial
            prio[seg] = p
            queues[p].append((self._serial, seg))
            live[p] += len(seg)
            self._mask |= 1 << p
        self._entries += n
        self._count += n

    def _append_runs(self, arr: np.ndarray, runs: Iterable[tuple[int, int]]) -> None:
        """:meth:`_append` of distinct absent pages by runs ``(priority, count)``: a
        segment per run, the disjoint views of one copy (which no one else holds), with
        a scatter per run and array (a run of one page, as a close's leaf and partial
        blocks make them: a scalar write)."""
        seg = arr.copy()
        stamp, prios, queues, live = self._stamp, self._prio, self._queues, self._live
        serial, mask = self._serial, self._mask
        a = 0
        for p, c in runs:
            serial += 1
            if c == 1:
                page = seg.item(a)
                stamp[page] = serial
                prios[page] = p
                part = seg[a:a + 1]
            else:
                part = seg[a:a + c]
                stamp[part] = serial
                prios[part] = p
            queues[p].append((serial, part))
            live[p] += c
            mask |= 1 << p
            a += c
        self._serial, self._mask = serial, mask
        self._entries += len(arr)
        self._count += len(arr)

    def insert_runs_checked_by_caller(self, pages: np.ndarray,
                                      runs: Sequence[tuple[int, int]]) -> None:
        """:meth:`insert_many_checked_by_caller` with the priorities as runs (see the
        contract): the segments of :meth:`_append_mixed`, without finding the runs."""
        if type(self).insert_many_checked_by_caller is not \
                SegmentLruPolicy.insert_many_checked_by_caller:  # a subclass files its own
            super().insert_runs_checked_by_caller(pages, runs)
            return
        if len(runs) == 1:
            self.insert_many_checked_by_caller(pages, runs[0][0])
            return
        hi = int(pages[pages.argmax()])
        if hi >= _BIG:  # big ids are mapped: the general path
            super().insert_runs_checked_by_caller(pages, runs)
            return
        if hi >= len(self._stamp):
            self._fit(pages)
        self._append_runs(pages, runs)

    def _insert_small(self, arr: np.ndarray, priorities: PriorityBatch) -> bool:
        """:meth:`insert_many` of a few small page ids with plain Python checks (NumPy's
        per-call costs dominate there). False: not that case, nothing done."""
        pl = arr.tolist()
        n = len(pl)
        if type(priorities) is int:
            prl = [priorities] * n
        elif isinstance(priorities, np.ndarray) and priorities.ndim == 1 and \
                priorities.dtype.kind in "iu" and len(priorities) == n:
            prl = priorities.tolist()
        else:
            return False
        if min(prl) < 0 or max(prl) > MAX_PRIORITY or min(pl) < 0 or \
                max(pl) >= min(len(self._stamp), _BIG):
            return False  # the general path raises, grows the arrays or maps big ids
        if len(set(pl)) != n or np.count_nonzero(self._stamp[arr]):
            return False  # the general path names the page
        runs = []  # (priority, start, stop), as _runs makes them
        start = 0
        for i in range(1, n + 1):
            if i == n or prl[i] != prl[start]:
                runs.append((prl[start], start, i))
                start = i
        self._append(arr, runs)
        return True

    def remove_many(self, pages: PageBatch) -> None:
        """Forget ``pages``.

        Raises:
            ValueError: naming the first absent (or repeated) page; nothing is changed.
        """
        arr = _as_pages(pages)
        n = len(arr)
        if not n:
            return
        if n <= _SMALL:  # plain Python checks; anything unusual takes the general path
            pl = arr.tolist()
            if min(pl) >= 0 and max(pl) < min(len(self._stamp), _BIG) and \
                    len(set(pl)) == n and np.count_nonzero(self._stamp[arr]) == n:
                self._drop(arr)
                self._maybe_compact()
                return
        inner = self._inner(arr, create=False)
        self._check_present(arr, inner, "remove", unique=True)
        self._drop(inner)
        self._maybe_compact()

    def remove_many_checked_by_caller(self, pages: np.ndarray) -> None:
        """:meth:`remove_many` without its checks (the caller promises distinct present
        ids below 2**31)."""
        n = len(pages)
        if not n:
            return
        if n == 1:  # _drop of one page, on scalars
            page = int(pages[0])
            if page < _BIG:
                p = int(self._prio[page])
                self._dirty.add(int(self._stamp[page]))
                self._live[p] -= 1
                self._dead[p] += 1
                if not self._live[p]:
                    self._clear(p)
                self._stamp[page] = 0
                self._count -= 1
                self._maybe_compact()
                return
        if int(pages.max()) >= _BIG:  # big ids are mapped: the general path
            self.remove_many(pages)
            return
        self._drop(pages)
        self._maybe_compact()

    def touch_many(self, pages: PageBatch) -> None:
        """Make ``pages`` the most recently used of their priorities, in order (a page
        named twice counts its last use).

        Raises:
            ValueError: naming the first absent page; nothing is changed.
        """
        arr = _as_pages(pages)
        if not len(arr):
            return
        inner = self._inner(arr, create=False)
        self._check_present(arr, inner, "touch", unique=False)
        arr = inner
        if self._first_repeat(arr) is not None:  # keep each page's last use only
            rev = arr[::-1]
            _, first = np.unique(rev, return_index=True)
            arr = rev[np.sort(first)][::-1]
        pr = self._prio[arr].astype(np.int64)
        self._drop(arr)
        p0 = int(pr[0])
        self._append(arr, p0 if not np.count_nonzero(pr != p0) else pr.tolist())
        self._maybe_compact()

    def set_priority_many(self, pages: PageBatch, priorities: PriorityBatch) -> None:
        """Move ``pages`` to ``priorities``, as the most recently used there, in order.

        Raises:
            ValueError: a page is absent or a priority is invalid; nothing is changed.
        """
        arr = _as_pages(pages)
        prio = check_priorities(priorities, len(arr))
        if not len(arr):
            return
        inner = self._inner(arr, create=False)
        self._check_present(arr, inner, "set the priority of", unique=False)
        prios = [prio] * len(arr) if type(prio) is int else list(prio)
        for page, p in zip(inner.tolist(), prios, strict=True):  # in order; repeats allowed
            one = np.array([page], dtype=np.int64)
            self._drop(one)
            self._append(one, p)
        self._maybe_compact()

    def pop_victims(self, k: int) -> np.ndarray:
        """Remove and return up to ``k`` pages (an int64 array): lowest priority first,
        least recently used first inside a priority.

        Raises:
            ValueError: ``k`` is negative or not an int.
        """
        return self._pop(k, None)

    def pop_victim_runs(self, k: int) -> tuple[np.ndarray, list[tuple[int, int]] | None]:
        """:meth:`pop_victims` and the priorities of the pages, as runs ``(priority,
        count)`` (one per priority, in order).

        Raises:
            ValueError: ``k`` is negative or not an int.
        """
        if type(self).pop_victims is not SegmentLruPolicy.pop_victims:
            return self.pop_victims(k), None  # a subclass picks its own victims
        runs: list[tuple[int, int]] = []
        return self._pop(k, runs), runs

    def _pop(self, k: int, runs: list[tuple[int, int]] | None) -> np.ndarray:
        """:meth:`pop_victims`; with ``runs``, a run appended there per priority taken.

        Segments are taken whole, or the front of one, as they are: only one with dead
        entries (in ``_dirty``) is read, for its live ones. A priority whose live pages all
        go leaves at once."""
        if type(k) is not int or k < 0:
            k = check_count(k)
        # The pages taken are stamped absent once, at the end: until then each one's
        # stamp still names the segment it was taken from, which no later step reads.
        out: list[np.ndarray] = []
        queues, live, dead, dirty = self._queues, self._live, self._dead, self._dirty
        stamp = self._stamp
        mask = self._mask
        need = k
        gone = 0  # entries that leave the queues, live or dead
        while need and mask:
            p = (mask & -mask).bit_length() - 1
            queue = queues[p]
            n = live[p]
            if n <= need:  # all of this priority
                if dead[p]:
                    for serial, seg in queue:
                        if serial in dirty:
                            dirty.discard(serial)
                            seg = seg[stamp[seg] == serial]
                        out.append(seg)
                elif len(queue) == 1:
                    out.append(queue[0][1])
                else:
                    out.extend([seg for _, seg in queue])
                gone += n + dead[p]
                queue.clear()
                live[p] = dead[p] = 0
                mask ^= 1 << p
                need -= n
                if runs is not None:
                    runs.append((p, n))
                continue
            # Part of it: the queue holds more live pages than wanted, so need ends at 0.
            live[p] = n - need
            if runs is not None:
                runs.append((p, need))
            while need:
                serial, seg = queue[0]
                if dead[p] and serial in dirty:  # its live entries, from now on
                    dirty.discard(serial)
                    d = len(seg)
                    seg = seg[stamp[seg] == serial]
                    d -= len(seg)
                    dead[p] -= d
                    gone += d
                    if not len(seg):
                        queue.popleft()
                        continue
                    queue[0] = (serial, seg)
                if len(seg) <= need:
                    queue.popleft()
                    out.append(seg)
                    need -= len(seg)
                    gone += len(seg)
                else:
                    out.append(seg[:need])
                    queue[0] = (serial, seg[need:])
                    gone += need
                    need = 0
        self._mask = mask
        self._entries -= gone
        self._count -= k - need
        if not out:
            return np.empty(0, dtype=np.int64)
        got = out[0] if len(out) == 1 else np.concatenate(out)
        stamp[got] = 0
        if self._to_outer and int(got.max()) >= _BIG:
            return np.asarray(self._outer(got), dtype=np.int64)
        return got

    # -- queries -------------------------------------------------------------------------------

    def priority_of(self, page: int) -> int:
        """The priority ``page`` is held at.

        Raises:
            ValueError: ``page`` is absent.
        """
        if page not in self:
            raise ValueError(f"cannot look up page {page}: not in the policy")
        return int(self._prio[self._to_inner.get(int(page), int(page))])

    def __len__(self) -> int:
        return self._count

    def __contains__(self, page: object) -> bool:
        if isinstance(page, bool) or not isinstance(page, int | np.integer):
            return False
        page = int(page)
        if page >= _BIG:
            page = self._to_inner.get(page, -1)
        return 0 <= page < len(self._stamp) and bool(self._stamp[page] > 0)

    def __repr__(self) -> str:
        return f"SegmentLruPolicy({len(self)} pages)"
