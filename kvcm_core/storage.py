"""Pages, slots and their states, in arrays.

A page is one slot at one level holding one (block, life cycle). Every page of a manager
is a row of the :class:`PageArena`, named by an integer page id (``pid``) that stays the
same while the page moves between levels; caches and the prefix tree hold page ids. Its
state follows from who references it:

- ``LOCKED``: an active request needs it on the GPU (``locks > 0``). Never moves or drops.
- ``HELD``: only suspended requests (or pending reuse claims) reference it
  (``holds > 0``). May move to a colder level, never dropped.
- ``DROPPABLE``: committed (``node >= 0``: in the prefix tree) and unreferenced. May move
  down, or be dropped at the last level.
- otherwise the page is freed at once (an uncommitted page nobody references).

A :class:`Store` holds the slots of one pool group at one level: a free-slot stack, the
slot -> page map and two eviction-policy instances (droppable pages, held pages), so
``free + evictable + unavailable == total`` can be read off counts. Every operation takes
many pages at once; state transitions are computed on arrays.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from kvcm_core.errors import OutOfPagesError, TierIOError
from kvcm_core.eviction import DEFAULT_PRIORITY, EvictionPolicy
from kvcm_core.idstack import IdStack, blank_rows, grown_rows

if TYPE_CHECKING:
    from kvcm_core.frame import FrameBook
    from kvcm_core.tier import Pool

__all__ = ["NO_PAGE", "PageArena", "PageState", "StorageStatistics", "Store"]

try:  # NumPy's C count itself: np.count_nonzero adds a dispatch of about 0.1 us a call,
    # which a close (a handful of counts) notices.
    from numpy._core.multiarray import count_nonzero as _count
except ImportError:  # pragma: no cover - NumPy 1.x
    _count = np.count_nonzero

NO_PAGE = -1
#: Pages that closes may queue for the droppable policy before the next close inserts
#: them (``Store.flush_if_due``): a bound on the deferred work, which also keeps a flush's
#: temporary arrays small enough for the allocator to reuse (one flush of the closes of
#: hundreds of requests pays a page fault per 4 KiB of each of its temporaries).
FLUSH_RELEASED_AT = 4096
#: A lock column of ones as long as the longest chain a close handles in one go, and its
#: bytes (``Store.unlock_all``: a byte compare costs a fraction of a ufunc call).
_ONES = np.ones(8192, dtype=np.int32)
_ONE_LOCK = _ONES.tobytes()
_subtract = np.subtract
#: The bytes of a node column's ``-1`` (no node). Found anywhere in a column's bytes (even
#: across two values), it sends a close to the exact test; absent, no value is ``-1``.
_NO_NODE = np.array([-1], dtype=np.int32).tobytes()
#: Calls on one page take scalar paths (the same rules without array operations; a test
#: turns them off to compare).
_ONE_BY_ONE = True


class PageState(enum.Enum):
    LOCKED = "locked"
    HELD = "held"
    DROPPABLE = "droppable"
    FREE = "free"


class StorageStatistics:
    """Counts of one level (summed over pool groups), in slots and bytes."""

    __slots__ = ("evictable", "free", "level", "total", "total_bytes", "unavailable",
                 "used_bytes")

    def __init__(self, level: int) -> None:
        self.level = level
        self.total = self.free = self.evictable = self.unavailable = 0
        self.total_bytes = self.used_bytes = 0

    def as_dict(self) -> dict[str, int]:
        return {k: getattr(self, k) for k in self.__slots__}

    def __repr__(self) -> str:
        return f"StorageStatistics({self.as_dict()})"


class PageArena:
    """Every page of a manager: one row per page id, grown by doubling.

    Attributes (arrays indexed by page id):
        store: index of the :class:`Store` holding it (``-1``: lost, no data).
        slot: its slot in that store.
        group: its cache group (life cycle).
        locks, holds: reference counts of active and suspended owners.
        node: prefix-tree node once committed, else ``-1``.
        priority: eviction priority (0..100).
        reused: claimed by a request other than its writer.
        demoted: its priority was lowered at its writer's close (a leaf block,
            ``KVCache._demote_leaf``) until another request shares it. Like every column,
            reset when the id is handed out again.
    """

    #: Columns of the row array, and a free page's row.
    FIELDS = ("store", "slot", "group", "locks", "holds", "node", "priority", "reused", "level",
              "demoted")
    _BLANK = (-1, -1, 0, 0, 0, -1, DEFAULT_PRIORITY, 0, -1, 0)

    def __init__(self, capacity: int = 1024) -> None:
        capacity = max(16, capacity)
        # One int32 row per page: a new page's row is written with one assignment.
        self._rows = blank_rows(self._BLANK, capacity)
        self._bind()
        self._free = IdStack(capacity)
        self.live = 0

    def _bind(self) -> None:
        rows = self._rows
        self.store, self.slot, self.group, self.locks, self.holds, self.node, \
            self.priority, self.reused, self.level, self.demoted = \
            (rows[:, i] for i in range(10))

    @property
    def capacity(self) -> int:
        return len(self._rows)

    def _grow(self, need: int) -> None:
        old = self.capacity
        self._rows = grown_rows(self._rows, self._BLANK, need)
        new = self.capacity
        self._bind()
        self._free.grow(old, new)

    def reserve(self, n: int) -> None:
        """Room for ``n`` pages without growing."""
        if n > self.capacity:
            self._grow(n - self.capacity)

    def alloc_one(self, row: tuple[int, ...]) -> int:
        if not self._free.count:
            self._grow(1)
        pid = self._free.pop_one()
        self._rows[pid] = row
        self.live += 1
        return pid

    def alloc(self, n: int, row: tuple[int, ...] | None = None) -> np.ndarray:
        """``n`` fresh page ids, their rows set to ``row`` (default: a blank row)."""
        if n > self._free.count:
            self._grow(n - self._free.count)
        pids = self._free.pop(n)
        self.live += n
        self._rows[pids] = self._BLANK if row is None else np.asarray(row, dtype=np.int32)
        return pids

    def release(self, pids: np.ndarray) -> None:
        """Forget pages (no owner, not in the tree, slot already given back). Their rows
        are rewritten when the ids are handed out again."""
        n = len(pids)
        if not n:
            return
        self.store[pids] = -1
        self.level[pids] = -1
        self._free.push(pids)
        self.live -= n

    def state(self, pid: int) -> PageState:
        if self.locks[pid]:
            return PageState.LOCKED
        if self.holds[pid]:
            return PageState.HELD
        if self.node[pid] >= 0:
            return PageState.DROPPABLE
        return PageState.FREE

    def describe(self, pid: int) -> str:
        return (f"page {pid} (group {self.group[pid]}, level {self.level[pid]}, slot "
                f"{self.slot[pid]}, {self.state(pid).name}, locks={self.locks[pid]}, "
                f"holds={self.holds[pid]})")


#: By default a level with a level below moves down 1/EVICT_AHEAD_SHARE of its slots
#: more than it needs whenever it makes room, at most EVICT_AHEAD_MAX pages
#: (``LevelConfig.evict_ahead``).
EVICT_AHEAD_SHARE = 256
EVICT_AHEAD_MAX = 32


class Store:
    """Slots of one pool group at one level: pools, free slots, pages, eviction order.

    Args:
        index: the store's index among all stores of the manager.
        level: level index.
        pool_group: pool group id at that level (a cold group id below level 0).
        pools: the tier's pools (one per slot size; one pool for cold levels).
        make_policy: builds an eviction-policy instance.
        last_level: pages here cannot move further down (held pages are not evictable).
        arena: the manager's page arena.
    """

    def __init__(self, index: int, level: int, pool_group: int, pools: list[Pool],
                 make_policy: Callable[[], EvictionPolicy], last_level: bool,
                 arena: PageArena) -> None:
        self.index = index
        self.level = level
        self.pool_group = pool_group
        self.pools = pools
        self.num_slots = pools[0].num_slots
        self.slot_bytes = sum(p.slot_bytes for p in pools)
        self.last_level = last_level
        self.arena = arena
        self.below: Store | None = None  # where evicted pages go (set by the levels room)
        #: ``LevelConfig.evict_ahead`` (None: :data:`EVICT_AHEAD_SHARE` of the slots, at
        #: most :data:`EVICT_AHEAD_MAX`); see :attr:`ahead`.
        self.evict_ahead: int | None = None
        #: Key and write sequence per slot of a framed (persistent) store, else None.
        self.frames: FrameBook | None = None
        # Pop from the end: low slot ids first, which keeps shrinking cheap.
        self._free = IdStack(self.num_slots)
        self._pid = np.full(self.num_slots, NO_PAGE, dtype=np.int64)
        self._droppable = make_policy()
        self.held = make_policy()
        # Pages released by closes, not yet in the droppable policy: they enter it in one
        # batch, in release order, when anything next reads or changes the queue (or a
        # close finds FLUSH_RELEASED_AT of them queued).
        self._released: list[np.ndarray] = []
        self._released_n = 0  # pages in _released
        #: Pages that left this store other than by moving (freed or lost): a caller
        #: holding popped victims across other work reads it to know whether they are all
        #: still here.
        self.departures = 0

    @property
    def droppable(self) -> EvictionPolicy:
        """The queue of unreferenced committed pages (least recently released first)."""
        if self._released:
            self._flush_released()
        return self._droppable

    def flush_if_due(self) -> None:
        """Insert the queued releases once :data:`FLUSH_RELEASED_AT` pages wait. A close
        calls it (through ``Levels.flush_due_releases``) before it changes anything, so a
        policy that refuses the insert leaves the close undone and safe to retry; never
        from ``unlock_all``, which may run after another store's pages were released."""
        if self._released_n >= FLUSH_RELEASED_AT:
            self._flush_released()

    def _flush_released(self) -> None:
        batches = self._released
        pids = batches[0] if len(batches) == 1 else np.concatenate(batches)
        _insert(self._droppable, pids, self.arena.priority[pids])
        self._released = []  # (after: a policy that refuses the insert keeps them queued)
        self._released_n = 0

    # -- counting ------------------------------------------------------------------------

    @property
    def ahead(self) -> int:
        """Droppable pages a :meth:`Levels.make_room` of this store moves down beyond
        those it needs: ``evict_ahead``, or 1/:data:`EVICT_AHEAD_SHARE` of the slots up
        to :data:`EVICT_AHEAD_MAX` by default; 0 on the last level (its victims are
        dropped, never ahead of need)."""
        if self.below is None:
            return 0
        if self.evict_ahead is not None:
            return self.evict_ahead
        return min(self.num_slots // EVICT_AHEAD_SHARE, EVICT_AHEAD_MAX)

    @property
    def num_free(self) -> int:
        return self._free.count

    @property
    def num_evictable(self) -> int:
        """Slots that can be freed here: droppable pages, and held ones if they can move."""
        return self.num_droppable + (0 if self.last_level else len(self.held))

    @property
    def num_droppable(self) -> int:
        """Droppable pages, the queued releases included (reads only: a statistics poll
        from another thread must not change the queue)."""
        return len(self._droppable) + self._released_n

    @property
    def num_locked(self) -> int:
        return self.num_slots - self._free.count - self.num_droppable - len(self.held)

    def free_slots(self) -> np.ndarray:
        return self._free.values()

    def page_at(self, slot: int) -> int:
        return int(self._pid[slot])

    def pages(self) -> np.ndarray:
        """Page ids of every occupied slot, in slot order."""
        return self._pid[self._pid >= 0]

    def __repr__(self) -> str:
        return f"Store(L{self.level} pg{self.pool_group}, {self._free.count}/{self.num_slots} free)"

    # -- slots ---------------------------------------------------------------------------

    def take(self, group: int, n: int, locks: int = 1) -> np.ndarray:
        """``n`` new pages of ``group`` in free slots, each with ``locks`` locks (the
        caller made room)."""
        if n > self._free.count:
            raise OutOfPagesError(
                f"level {self.level} pool group {self.pool_group}: {n} slots wanted, "
                f"{self._free.count} free")
        if n == 1:
            return np.array([self.take_one(group, locks)], dtype=np.int64)
        a = self.arena
        pids = a.alloc(n, (self.index, -1, group, locks, 0, -1, DEFAULT_PRIORITY, 0,
                           self.level, 0))
        slots = self._free.pop(n)
        self._pid[slots] = pids
        a.slot[pids] = slots
        return pids

    def take_one(self, group: int, locks: int = 1) -> int:
        """One new page (see :meth:`take`): the decode step's scalar bookkeeping."""
        if not self._free.count:
            raise OutOfPagesError(
                f"level {self.level} pool group {self.pool_group}: 1 slot wanted, 0 free")
        slot = self._free.pop_one()
        pid = self.arena.alloc_one((self.index, slot, group, locks, 0, -1, DEFAULT_PRIORITY,
                                    0, self.level, 0))
        self._pid[slot] = pid
        return pid

    def reserve_slots(self, n: int) -> np.ndarray:
        """Take ``n`` free slots for incoming pages (see :meth:`settle`)."""
        return self._free.pop(n)

    def unreserve_slots(self, slots: np.ndarray) -> None:
        self._give_back(slots)

    def settle(self, pids: np.ndarray, slots: np.ndarray, droppable: bool = False,
               locked: bool = False, runs: list[tuple[int, int]] | None = None) -> None:
        """Pages that arrived in reserved ``slots`` (moved from another store);
        ``droppable``: the caller knows they are all droppable; ``locked``: the caller
        knows they are all locked (they enter no queue); ``runs``: droppable pages'
        priorities as runs ``(priority, count)``, where the caller has them (victims
        popped with :meth:`EvictionPolicy.pop_victim_runs`: a queued page is filed at
        its arena priority)."""
        a = self.arena
        if len(pids) == 1 and _ONE_BY_ONE:  # the same on scalars
            pid, slot = pids[0], slots[0]
            self._pid[slot] = pid
            a.store[pid] = self.index
            a.slot[pid] = slot
            a.level[pid] = self.level
        else:
            self._pid[slots] = pids
            a.store[pids] = self.index
            # (Cast first: a scatter of int64 values into the int32 column casts slowly.)
            a.slot[pids] = slots.astype(np.int32)
            a.level[pids] = self.level
        if droppable:
            if runs is not None:
                self.droppable.insert_runs_checked_by_caller(pids, runs)
            else:
                _insert(self.droppable, pids, a.priority[pids])
        elif not locked:
            self._enter(pids)

    def vacate(self, pids: np.ndarray, queued: bool = True,
               slots: np.ndarray | None = None) -> None:
        """Pages that left this store (moved elsewhere): out of its queues (unless popped
        already: ``queued`` False), slots free (``slots``: their slots here, if the caller
        has them)."""
        if queued:
            self._leave(pids)
        if slots is None:
            slots = self.arena.slot[pids]
        if len(slots) == 1 and _ONE_BY_ONE:
            self._pid[slots[0]] = NO_PAGE
        else:
            self._pid[slots] = NO_PAGE
        self._give_back(slots)

    def requeue(self, pids: np.ndarray) -> None:
        """Pages popped from a queue that stay here after all."""
        if len(pids):
            self._enter(pids)

    def forget(self, pids: np.ndarray) -> None:
        """Pages whose data is lost: out of the queues, slots free; their ids live on
        (``store == -1``) until their owners let go."""
        self._leave(pids)
        a = self.arena
        slots = a.slot[pids]
        self._pid[slots] = NO_PAGE
        self._give_back(slots)
        self.departures += len(pids)
        a.store[pids] = -1
        a.slot[pids] = -1
        a.level[pids] = -1

    def _give_back(self, slots: np.ndarray) -> None:
        self._free.push(slots)

    def free_pages(self, pids: np.ndarray) -> None:
        """Unreferenced pages out of the tree and out of the queues: slots and ids freed."""
        if not len(pids):
            return
        a = self.arena
        slots = a.slot[pids]
        self._pid[slots] = NO_PAGE
        self._give_back(slots)
        self.departures += len(pids)
        a.release(pids)

    # -- state transitions ------------------------------------------------------------------
    # Queue membership follows the counts: held queue iff locks == 0 and holds > 0;
    # droppable queue iff locks == holds == 0 and node >= 0; otherwise in no queue.

    def _leave(self, pids: np.ndarray) -> None:
        a = self.arena
        if len(pids) == 1 and _ONE_BY_ONE:  # the same rules on scalars
            pid = pids[0]
            if a.locks[pid] != 0:
                return
            if a.holds[pid] > 0:
                self.held.remove_many_checked_by_caller(pids)
            elif a.node[pid] >= 0:
                self.droppable.remove_many_checked_by_caller(pids)
            return
        free = a.locks[pids] == 0
        nfree = _count(free)
        if not nfree:
            return
        p = pids if nfree == len(pids) else pids[free]
        held = a.holds[p] > 0
        nheld = _count(held)
        if nheld == len(held):
            self.held.remove_many_checked_by_caller(p)
            return
        if nheld:
            self.held.remove_many_checked_by_caller(p[held])
            p = p[~held]
        p = p[a.node[p] >= 0]
        if len(p):
            self.droppable.remove_many_checked_by_caller(p)

    def _enter(self, pids: np.ndarray) -> None:
        """Pages whose counts just changed: into their queue, or freed."""
        a = self.arena
        if len(pids) == 1 and _ONE_BY_ONE:  # the same rules on scalars
            pid = pids[0]
            if a.locks[pid] != 0:
                return
            if a.holds[pid] > 0:
                self.held.insert_many_checked_by_caller(pids, int(a.priority[pid]))
            elif a.node[pid] >= 0:
                self.droppable.insert_many_checked_by_caller(pids, int(a.priority[pid]))
            else:
                self.free_pages(pids)
            return
        free = a.locks[pids] == 0
        nfree = _count(free)
        if not nfree:
            return
        p = pids if nfree == len(pids) else pids[free]
        held = a.holds[p] > 0
        nheld = _count(held)
        if nheld == len(held):  # all held: none is left for the rest
            _insert(self.held, p, a.priority[p])
            return
        if nheld:
            h = p[held]
            _insert(self.held, h, a.priority[h])
            p = p[~held]
        committed = a.node[p] >= 0
        d = p[committed]
        if len(d):
            _insert(self.droppable, d, a.priority[d])
        if _count(committed) != len(committed):
            self.free_pages(p[~committed])

    def change(self, pids: np.ndarray, dlocks: int, dholds: int) -> None:
        """Add ``dlocks`` / ``dholds`` to every page (ids unique) and requeue them."""
        if not len(pids):
            return
        self._leave(pids)
        a = self.arena
        if dlocks:
            a.locks[pids] += dlocks
        if dholds:
            a.holds[pids] += dholds
        self._enter(pids)

    def unlock_all(self, pids: np.ndarray) -> None:
        """A close: one owner lets go of its locked pages (ids unique). Pages other owners
        still lock lose one lock; of the rest, committed ones become droppable (in the
        given order: least recent first) and the others are freed."""
        n = len(pids)
        if not n:
            return
        a = self.arena
        # A close costs a few array operations whatever its length, and a ufunc call on a
        # small array costs several gathers: the tests below are byte compares and counts.
        if _count(a.holds[pids]):
            self.change(pids, -1, 0)  # suspended owners too
            return
        locks = a.locks[pids]
        if locks.tobytes() == _ONE_LOCK[:4 * n]:  # the usual close: the only lock of each
            a.locks[pids] = 0
        else:
            if _count(locks) != n:
                self.change(pids, -1, 0)  # a page it did not lock: the general rule
                return
            # Others lock some (a shared prefix): each loses one lock (in place: the
            # gather's copy; an array of ones, not the scalar 1, spares the ufunc the
            # promotion of a Python int).
            if n <= len(_ONES):
                _subtract(locks, _ONES[:n], out=locks)
            else:
                locks -= 1
            a.locks[pids] = locks
            z = n - _count(locks)
            if not z:
                return
            # Others lock a prefix of the chain, which comes last here (deepest block
            # first): the pages to release are then the first z.
            pids = pids[:z] if not _count(locks[:z]) else pids[locks == 0]
        node = a.node[pids]
        if _NO_NODE not in node.tobytes():  # all committed (a byte search: no ufunc)
            self._released.append(pids)  # see droppable
            self._released_n += len(pids)
            return
        committed = node >= 0
        d = pids[committed]
        if len(d):
            self._released.append(d)
            self._released_n += len(d)
        self.free_pages(pids[~committed])

    def unpublish(self, pids: np.ndarray) -> np.ndarray:
        """Detach pages from the tree; unreferenced ones are freed. Returns those freed."""
        a = self.arena
        unref = (a.locks[pids] == 0) & (a.holds[pids] == 0) & (a.node[pids] >= 0)
        gone = pids[unref]
        if len(gone):
            self.droppable.remove_many(gone)
        a.node[pids] = -1
        self.free_pages(gone)
        return gone

    # -- resizing ------------------------------------------------------------------------------

    def _resize_pools(self, new: int) -> None:
        """Every pool to ``new`` slots, or (an error) each back to its old size and the
        error raised. A pool that cannot go back keeps what it has when that is more
        slots than the store uses (harmless); fewer raises :class:`TierIOError`."""
        old = self.num_slots
        done: list[Pool] = []
        try:
            for pool in self.pools:
                pool.resize(new)
                done.append(pool)
        except BaseException as exc:
            for pool in reversed(done):
                try:
                    pool.resize(old)
                except Exception as again:
                    if new < old:
                        raise TierIOError(
                            f"level {self.level} pool group {self.pool_group}: a pool "
                            f"shrank to {new} slots and cannot grow back to {old} ({again}) "
                            f"after another failed ({exc})") from exc
            raise

    def grow(self, new: int) -> None:
        """Grow to ``new`` slots; an error (a pool that cannot grow) changes nothing."""
        old = self.num_slots
        self._resize_pools(new)
        if self.frames is not None:
            self.frames.resize(new)
        self._pid = np.concatenate([self._pid, np.full(new - old, NO_PAGE, np.int64)])
        self._free.grow(old, new)
        self.num_slots = new

    def high_pages(self, new: int) -> np.ndarray:
        """Pages in slots ``>= new`` (to move before a shrink to ``new`` slots)."""
        tail = self._pid[new:]
        return tail[tail >= 0]

    def relocate(self, pid: int, slot: int) -> int:
        """Point ``pid`` at free ``slot`` (its data was copied there); returns the old
        slot, now free."""
        a = self.arena
        old = int(a.slot[pid])
        self._free.discard(slot)
        self._pid[slot] = pid
        self._pid[old] = NO_PAGE
        a.slot[pid] = slot
        self._give_back(np.array([old], dtype=np.int64))
        return old

    def shrink(self, new: int) -> None:
        """Drop slots ``>= new`` (all free); an error (a pool that cannot shrink) changes
        nothing."""
        self._resize_pools(new)
        if self.frames is not None:
            self.frames.resize(new)
        self._free.keep_below(new)
        self._pid = self._pid[:new].copy()
        self.num_slots = new

    # -- statistics ------------------------------------------------------------------------------

    def statistics(self, into: StorageStatistics) -> None:
        # Read each count once, so a reader on another thread gets a consistent snapshot
        # of this store (free + evictable + unavailable == total) while it changes.
        total = self.num_slots
        free = self._free.count
        evictable = self.num_evictable
        if free + evictable > total:  # torn read across a resize: clamp, keep the identity
            evictable = max(0, total - free)
            free = min(free, total)
        into.total += total
        into.free += free
        into.evictable += evictable
        into.unavailable += total - free - evictable
        into.total_bytes += total * self.slot_bytes
        into.used_bytes += (total - free) * self.slot_bytes

    def check(self, level: int) -> None:
        """Internal invariants of this store (tests and debugging)."""
        a = self.arena
        free = self._free.values()
        seen = np.bincount(free, minlength=self.num_slots) if len(free) else np.zeros(
            self.num_slots, dtype=np.int64)
        if len(free) and seen.max() > 1:
            raise AssertionError(f"L{level} pg{self.pool_group}: duplicate free slots")
        occupied = np.flatnonzero(self._pid >= 0)
        if seen[occupied].any():
            raise AssertionError(f"L{level} pg{self.pool_group}: slot both free and owned")
        if len(occupied) + len(free) != self.num_slots:
            raise AssertionError(f"L{level} pg{self.pool_group}: a slot neither free nor owned")
        pids = self._pid[occupied]
        if (a.slot[pids] != occupied).any() or (a.store[pids] != self.index).any() or (
                a.level[pids] != level).any():
            raise AssertionError(f"L{level} pg{self.pool_group}: a page filed under a wrong slot")
        locked = a.locks[pids] > 0
        held = ~locked & (a.holds[pids] > 0)
        droppable = ~locked & ~held & (a.node[pids] >= 0)
        loose = ~locked & ~held & ~droppable
        if loose.any():
            raise AssertionError(
                f"unreferenced uncommitted {a.describe(int(pids[loose][0]))} not freed")
        for pid in pids[held].tolist():
            if pid not in self.held:
                raise AssertionError(f"held {a.describe(pid)} missing from the held queue")
        priority_of = getattr(self.droppable, "priority_of", None)
        for pid in pids[droppable].tolist():
            if pid not in self.droppable:
                raise AssertionError(f"{a.describe(pid)} missing from the droppable queue")
            # Moves file popped victims at the priorities the queue held them at (see
            # settle): those of the arena.
            if priority_of is not None and priority_of(pid) != a.priority[pid]:
                raise AssertionError(f"{a.describe(pid)} queued at priority "
                                     f"{priority_of(pid)}, not {a.priority[pid]}")
        if int(droppable.sum()) != len(self.droppable) or int(held.sum()) != len(self.held):
            raise AssertionError("eviction queues hold pages of other states")


def _insert(policy: EvictionPolicy, pids: np.ndarray, prios: np.ndarray) -> None:
    """Insert pages in order: one int priority when they share one (the policies' fast
    path), else the priorities of each page."""
    p0 = int(prios[0])
    if len(pids) == 1 or not _count(prios != p0):
        policy.insert_many_checked_by_caller(pids, p0)
    else:
        policy.insert_many_checked_by_caller(pids, prios.astype(np.int64))


def group_by_store(arena: PageArena, pids: np.ndarray) -> list[tuple[int, np.ndarray]]:
    """``(store index, pids)`` batches, in first-seen order within each store."""
    if not len(pids):
        return []
    stores = arena.store[pids]
    first = stores[0]
    if not np.count_nonzero(stores != first):
        return [(int(first), pids)]
    out = []
    for s in dict.fromkeys(stores.tolist()):
        out.append((s, pids[stores == s]))
    return out

