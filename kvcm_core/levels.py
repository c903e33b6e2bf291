"""The levels room: every store of every level, and everything that moves pages.

:class:`Levels` builds the tiers' pools into :class:`~kvcm_core.storage.Store` objects (one
per level and pool group; cold levels, each with its own page codec, group life cycles
by ``(pool policy, cold page size on each cold level)``), and owns what happens to pages
there: taking new ones, reference transitions, victim picking and make-room cascades,
moves between levels (through the :class:`~kvcm_core.migration.Mover`), onboarding, drops
and the invalidation of subtrees they imply, lost pages, events, statistics and the epoch
that page tables read.
:class:`~kvcm_core.cache.KVCache` uses it through these verbs only.

Eviction is all-or-nothing: :meth:`Levels.room` says from counts alone whether a store can
free ``n`` slots (droppable victims first, then held ones where a colder level can take
them, skipping a level too small for them), and :meth:`Levels.make_room` then frees them.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from kvcm_core.backend import CopyTask, KernelBackend, Stream, copy_pairs
from kvcm_core.codec import PageCodec, PageLayout
from kvcm_core.config import KVCacheManagerConfig
from kvcm_core.errors import (
    ArgumentTypeError,
    ConfigError,
    CorruptPageError,
    InvalidArgumentError,
    OutOfPagesError,
    TierIOError,
)
from kvcm_core.events import BlockEvent, EventKind
from kvcm_core.eviction import DEFAULT_PRIORITY, EvictionPolicy
from kvcm_core.frame import (
    KEY_BYTES,
    FrameBook,
    FrameCheckFailed,
    LevelFrames,
    page_key,
    page_key_rows,
)
from kvcm_core.layout import StorageLayout
from kvcm_core.level_io import LevelIO, WriteQueueFull
from kvcm_core.lifecycle import LifeCycle
from kvcm_core.migration import Mover, order_in_batches, sort_in_batches
from kvcm_core.radix import NO_NODE, PrefixTree
from kvcm_core.sparse.storage import SparseHostPool, level0_slots
from kvcm_core.stats import IterationStats
from kvcm_core.storage import PageArena, StorageStatistics, Store, group_by_store

try:  # NumPy's C count itself (np.count_nonzero adds a dispatch)
    from numpy._core.multiarray import count_nonzero as _count
except ImportError:  # pragma: no cover - NumPy 1.x
    _count = np.count_nonzero
from kvcm_core.tier import DevicePool, Tier
from kvcm_core.types import CacheGroupId, pool_reuse_policy

__all__ = ["Levels"]

_EVENT_BATCH = 256
#: An asynchronous move is queued in about this many batches (each with its event), at
#: least this many bytes each: an onboard into slots an eviction freed waits only for the
#: eviction batches that freed them, so both directions of the link work at once.
_MOVE_BATCHES = 8
_MOVE_BATCH_BYTES = 16 << 20
_RESERVE_LIMIT = 1 << 20  # pages / nodes allocated up front at most
#: frame_keys fills up to this many keyless rows one by one (more: as arrays).
_FEW_KEYLESS = 8
_ZERO_KEY = bytes(KEY_BYTES)



#: What a pool's resize raises when it cannot take its new size: a storage failure, no
#: host or device memory (CuPy's and torch's out-of-memory errors are MemoryError and
#: RuntimeError). Anything else (a bug) propagates.
_POOL_FAILURES = (TierIOError, MemoryError, OSError, RuntimeError)


def _why(exc: BaseException) -> str:
    """An exception as a short reason: its message, or its type when it has none (a bare
    ``MemoryError``)."""
    return str(exc) or type(exc).__name__

class Levels:
    """Stores, tiers and page movement of one manager (see module docstring).

    Args:
        config: the manager configuration.
        layout: the GPU pool groups.
        life_cycles: the cache groups' life cycles.
        backend: the kernel backend.
        tiers: one built tier per level.
        codecs: each level's page codec (None on level 0).
        make_policy: builds an eviction-policy instance.
        tree: the prefix tree (drops remove its nodes).
        sinks: event sinks.
        frames: per level, how its pages are framed (None: not framed; see
            :mod:`kvcm_core.frame`); empty: no level is.
    """

    def __init__(self, config: KVCacheManagerConfig, layout: StorageLayout,
                 life_cycles: Sequence[LifeCycle], backend: KernelBackend,
                 tiers: list[Tier], codecs: Sequence[PageCodec | None],
                 make_policy: Callable[[], EvictionPolicy], tree: PrefixTree,
                 sinks: list[Any], frames: Sequence[LevelFrames | None] = ()) -> None:
        self.config = config
        self.layout = layout
        self.life_cycles = life_cycles
        self.backend = backend
        self.tiers = tiers
        self.codecs = list(codecs)
        self.tree = tree
        self.sinks = sinks
        # Each sink's name in event_sink_errors: its class's, "#2", "#3"... on later sinks
        # of a class of the same name (each counted and warned about on its own).
        self._sink_names: list[str] = []
        for sink in sinks:
            name = type(sink).__name__
            k = sum(n.split("#")[0] == name for n in self._sink_names)
            self._sink_names.append(name if not k else f"{name}#{k + 1}")
        self.frames = list(frames) or [None] * len(config.levels)
        if any(f is not None for f in self.frames):
            tree.keep_key_rows()  # (frame_keys reads them)
        self.arena = PageArena()
        self.epoch = 0  # bumped whenever a page moves: page tables read it
        #: Ids of pages lost to a failed frame check that owners still reference (so a
        #: ``resume`` can say CorruptPageError rather than a plain I/O loss).
        self.corrupt_ids: set[int] = set()
        #: The last storage failure of a move (its message names the cause).
        self.last_io_error: TierIOError | None = None
        self.resize_failure: str | None = None  # why the last resize_level returned False
        ngroups = len(life_cycles)
        self.stats = IterationStats.empty(ngroups, len(config.levels))
        self.event_sink_errors: dict[str, int] = {}
        self._events: list[BlockEvent] = []
        self._pg_of = [int(layout.group_to_pool_group[CacheGroupId(g)])
                       for g in range(ngroups)]
        self._pg_array = np.asarray(self._pg_of, dtype=np.int64)
        self.layouts: list[PageLayout] = [pg.page_layout() for pg in layout.pool_groups]
        #: Per pool group, the pages of one asynchronous move batch by bytes (see _move).
        self._batch_pages = [_MOVE_BATCH_BYTES // max(lay.page_bytes, 1)
                             for lay in self.layouts]
        self._move_bytes: dict[tuple[int, int], int] = {}  # (group, level) -> cold_bytes
        # Dropping a page of these invalidates the subtree below its block: every block of
        # full-attention constraining groups, the sink blocks of windowed ones.
        self._inval_all = np.array([not lc.is_ssm and lc.window is None and
                                    lc.constrains_block(0) for lc in life_cycles] or [False])
        self._inval_sinks = np.array([
            lc.num_sink_blocks if not lc.is_ssm and lc.window is not None and
            lc.constrains_block(0) else 0 for lc in life_cycles] or [0])
        nlevels = len(config.levels)
        self.stores: list[list[Store]] = [[]]
        slots = level0_slots(layout, config)
        for pg, n in zip(layout.pool_groups, slots, strict=True):
            # Sparse pools: level 0, but in pinned host memory under their own quota.
            pools = [_allocate(
                functools.partial(SparseHostPool, backend, size, n, f"L0-pg{pg.id}-sparse{k}"),
                "sparse_host_quota", config.sparse_host_quota) if pg.sparse else _allocate(
                functools.partial(tiers[0].create_pool, size, n, name=f"L0-pg{pg.id}-pool{k}"),
                "levels[0].quota", config.levels[0].quota)
                for k, size in enumerate(pg.slot_sizes)]
            self._add_store(0, pg.id, pools, make_policy, nlevels == 1)
        # Cold grouping: (pool policy, cold page size), independent of the GPU grouping;
        # where cold levels' codecs give different sizes, (pool policy, size on level 1,
        # size on level 2, ...): a cold group is the same set of life cycles on every level.
        # Where cold levels' codecs differ, a move between them transcodes with the pool
        # group's layout: then groups of different layouts never share a cold store (the
        # same sizes on every level are not enough).
        self.cold_key_of: list[tuple[Any, ...]] = []
        cold_keys: dict[tuple[Any, ...], list[int]] = {}
        transcodes = self._transcodes = len({id(c) for c in self.codecs[1:]
                                             if c is not None}) > 1
        if nlevels > 1:
            for g in range(ngroups):
                lay = self.layouts[self._pg_of[g]]
                sizes = [c.cold_page_size(lay) for c in self.codecs[1:] if c is not None]
                key = (pool_reuse_policy(life_cycles[g].policy),
                       *(sizes[:1] if len(set(sizes)) == 1 else sizes),
                       *((lay,) if transcodes else ()))
                self.cold_key_of.append(key)
                cold_keys.setdefault(key, []).append(g)
        self.cold_keys = list(cold_keys)
        self._cold_index = [self.cold_keys.index(k) for k in self.cold_key_of]
        #: Per level, its I/O thread (storage levels; None elsewhere): see
        #: :mod:`kvcm_core.level_io`.
        self.io: list[LevelIO | None] = [None] * nlevels
        for li in range(1, nlevels):
            self.stores.append([])
            lc = config.levels[li]
            io = LevelIO(li, lc.io_deadline_s, lc.background_write_depth,
                         lc.background_combine_bytes)
            for ci, n in enumerate(self.cold_slots(li, lc.quota)):
                # Unnamed: kvcm does not persist its tree, so cold files are private to
                # this manager (two managers never share a file).
                cold = self.cold_size(ci, li)
                pool = _allocate(functools.partial(
                    tiers[li].create_pool, self.slot_bytes(li, cold), n),
                    f"levels[{li}].quota", lc.quota)
                wrapped = io.wrap(pool)
                if wrapped is not pool:
                    self.io[li] = io
                    pool = wrapped
                self._add_store(li, ci, [pool], make_policy, li == nlevels - 1)
                framing = self.frames[li]
                if framing is not None:
                    self.stores[li][-1].frames = FrameBook(framing.format, n, cold,
                                                           framing.blob)
        # Each store's pages go to exactly one store below: a GPU pool group's life cycles
        # share one cold page size, and cold groups keep their index on every cold level.
        for pg in layout.pool_groups:
            if nlevels > 1:
                first = pg.life_cycles[0]
                self.stores[0][pg.id].below = self.stores[1][self._cold_index[first]]
        for li in range(1, nlevels - 1):
            for ci, store in enumerate(self.stores[li]):
                store.below = self.stores[li + 1][ci]
        self.all_stores = [s for level in self.stores for s in level]
        for store in self.all_stores:
            store.evict_ahead = config.levels[store.level].evict_ahead
        # Built after the pools: a pool that fails to build leaves no mover (staging
        # memory, streams) behind; the manager closes the tiers, and so their pools.
        self.mover = Mover(backend, self.codecs)
        # Whether a move pairs its slots into runs first (see _in_runs).
        self._pair_runs = backend.capabilities.run_copies
        # Every slot holds at most one page and every committed page one node: size the
        # arrays once (up to a bound) rather than grow them under load.
        total = sum(s.num_slots for s in self.all_stores)
        self.arena.reserve(min(total + 64, _RESERVE_LIMIT))
        tree.reserve(min(total + 64, _RESERVE_LIMIT))
        for store in self.all_stores:  # (the droppable queues take every page in turn)
            store.droppable.reserve(self.arena.capacity)

    def _add_store(self, level: int, pg: int, pools: list[Any],
                   make_policy: Callable[[], EvictionPolicy], last: bool) -> None:
        index = sum(len(s) for s in self.stores)
        self.stores[level].append(Store(index, level, pg, pools, make_policy, last, self.arena))

    def cold_size(self, ci: int, level: int) -> int:
        """Bytes of a cold page of cold group ``ci`` on cold level ``level``."""
        key = self.cold_keys[ci]
        sizes = key[1:-1] if self._transcodes else key[1:]  # (after them: the layout)
        return int(sizes[0] if len(sizes) == 1 else sizes[level - 1])

    def slot_bytes(self, level: int, page_bytes: int) -> int:
        """Bytes of a cold level's slot for cold pages of ``page_bytes``: a framed level
        adds the frame (and room for a blob codec's worst case)."""
        framing = self.frames[level]
        return page_bytes if framing is None else framing.slot_bytes(page_bytes)

    def cold_slots(self, level: int, quota: int) -> list[int]:
        """Slots per cold group for a cold level's quota (shares by slot bytes, frames
        included)."""
        sizes = [self.slot_bytes(level, self.cold_size(ci, level))
                 for ci in range(len(self.cold_keys))]
        weights = [size * sum(1 for k in self.cold_key_of if k == key)
                   for key, size in zip(self.cold_keys, sizes, strict=True)]
        total = sum(weights)
        slots = [int(quota * w / total) // size
                 for size, w in zip(sizes, weights, strict=True)]
        for ci, n in enumerate(slots):
            if n < 1:
                raise ConfigError(
                    f"levels[{level}].quota", quota,
                    f"too small: cold group {ci} ({sizes[ci]} bytes per page) "
                    "gets no slot")
        return slots

    # -- lookups ----------------------------------------------------------------------------------

    def check_level(self, level: object, name: str = "level") -> int:
        """``level`` as an int, or the typed error naming it (public calls take levels)."""
        n = len(self.stores)
        if isinstance(level, bool) or not isinstance(level, int | np.integer):
            raise ArgumentTypeError(f"{name}={level!r}: must be an int in 0..{n - 1}")
        if not 0 <= level < n:
            raise InvalidArgumentError(f"{name}={level!r}: must be in 0..{n - 1}")
        return int(level)

    def gpu_store(self, group: int) -> Store:
        return self.stores[0][self._pg_of[group]]

    def cold_store(self, level: int, group: int) -> Store:
        return self.stores[level][self._cold_index[group]]

    def store_of(self, pid: int) -> Store:
        return self.all_stores[int(self.arena.store[pid])]

    def pool_group_of(self, group: int) -> int:
        return self._pg_of[group]

    def pool_groups_of(self, groups: np.ndarray) -> np.ndarray:
        """:meth:`pool_group_of` for an array of cache groups."""
        return self._pg_array[groups]

    def cold_bytes(self, group: int, level: int = 1) -> int:
        """Bytes of ``group``'s cold page on cold ``level`` (its GPU page bytes without
        cold levels)."""
        if not self.cold_key_of:
            return self.layouts[self._pg_of[group]].page_bytes
        return self.cold_size(self._cold_index[group], level)

    def medium(self, level: int) -> str:
        return self.tiers[level].capabilities.medium.value

    def statistics(self, level: int) -> StorageStatistics:
        stats = StorageStatistics(level)
        for store in self.stores[level]:
            store.statistics(stats)
        return stats

    def reset_stats(self) -> IterationStats:
        out = self.stats
        self.stats = IterationStats.empty(len(self.life_cycles), len(self.config.levels))
        return out

    # -- references -------------------------------------------------------------------------------

    def change(self, pids: np.ndarray, dlocks: int, dholds: int) -> None:
        """Add ``dlocks`` / ``dholds`` to pages (ids unique) and requeue them; pages lost
        to a storage failure are forgotten once their last owner lets go."""
        if not len(pids):
            return
        for s, batch in group_by_store(self.arena, pids):
            if s >= 0:
                self.all_stores[s].change(batch, dlocks, dholds)
                continue
            a = self.arena
            a.locks[batch] += dlocks
            a.holds[batch] += dholds
            gone = batch[(a.locks[batch] == 0) & (a.holds[batch] == 0)]
            a.release(gone)
            if self.corrupt_ids:
                self.corrupt_ids.difference_update(gone.tolist())

    def claim(self, pids: np.ndarray, dlocks: int = 0, dholds: int = 1) -> None:
        """A request shares committed pages it did not write (ids unique): a match at
        create (one hold each), a rebase at commit (one lock). A leaf block demoted at
        its writer's close (the ``demoted`` column: see ``PageArena``) is shared now and
        gets the default priority back, for good."""
        a = self.arena
        demoted = a.demoted[pids]
        if demoted.any():  # before the hold, so that a held queue gets the new priority
            back = pids[demoted != 0]
            a.priority[back] = DEFAULT_PRIORITY
            a.demoted[back] = 0
        self.change(pids, dlocks, dholds)

    def flush_due_releases(self) -> None:
        """The closes' queued releases of each GPU store (where locked pages are) into its
        droppable policy once ``FLUSH_RELEASED_AT`` wait: see :meth:`Store.flush_if_due`."""
        for s in self.stores[0]:
            s.flush_if_due()

    def release_locked(self, pids: np.ndarray) -> None:
        """Owners let go of pages they locked once (a close): see :meth:`Store.unlock_all`."""
        for s, batch in group_by_store(self.arena, pids):
            if s >= 0:
                self.all_stores[s].unlock_all(batch)
            else:
                self.change(batch, -1, 0)

    # -- streams of public calls --------------------------------------------------------

    def begin(self, stream: Stream | None) -> None:
        """A public call on the engine's ``stream`` that may move pages starts (see
        :mod:`kvcm_core.fences`)."""
        fences = self.mover.fences
        if fences.enabled:
            fences.begin(stream)

    def end(self, stream: Stream | None, wait: bool = True) -> None:
        """The call returns: ``stream`` waits for the copies still in flight (``wait=False``:
        it does not, as after a prefetch, whose copies the next resume waits for)."""
        fences = self.mover.fences
        if fences.enabled:
            fences.end(stream, wait)

    # -- taking pages -----------------------------------------------------------------------------

    def can_take(self, needs: Mapping[int, int], extra: Mapping[int, int] | None = None) -> bool:
        """Whether level 0 can provide ``needs[pool group]`` new slots (``extra``: slots
        that the caller will release first, becoming free or droppable)."""
        for pg, n in needs.items():
            store = self.stores[0][pg]
            more = (extra or {}).get(pg, 0)
            if n > store.num_free + store.num_droppable + more and \
                    not self.room(store, n - more):
                return False
        return True

    def make_room_for(self, needs: Mapping[int, int]) -> None:
        """Make room on level 0 for ``needs[pool group]`` new slots, in every pool group,
        before the caller changes anything: pool groups can share a colder store, so room
        that :meth:`can_take` counted for one may be used by another's.

        Raises:
            OutOfPagesError: a pool group's room could not be made (pages that moved down
                meanwhile stay there, valid and cached).
        """
        for pg, n in needs.items():
            store = self.stores[0][pg]
            if n > store.num_free:
                self.make_room(store, n)

    def take(self, group: int, n: int, priorities: np.ndarray | None = None) -> np.ndarray:
        """``n`` new level-0 pages of ``group``, locked once, making room as needed."""
        store = self.gpu_store(group)
        if n > store.num_free:
            self.make_room(store, n)
        pids = store.take(group, n)
        if priorities is not None:
            self.arena.priority[pids] = priorities
        return pids

    def take_one(self, group: int) -> int:
        """One new level-0 page of ``group``, locked once (see :meth:`take`)."""
        store = self.gpu_store(group)
        if not store.num_free:
            self.make_room(store, 1)
        return store.take_one(group)

    # -- making room ------------------------------------------------------------------------------

    def room(self, store: Store, n: int) -> bool:
        """Whether :meth:`make_room` ``(store, n)`` would succeed (no side effects)."""
        k = n - store.num_free
        if k <= 0:
            return True
        nd = store.num_droppable
        if k <= nd:
            return True
        if store.last_level or k - nd > len(store.held):
            return False
        return self.held_target(store, k - nd) is not None

    def held_target(self, store: Store, n: int) -> Store | None:
        """The warmest colder store that can take ``n`` held pages at once: held pages
        skip a level too small for them rather than block."""
        target = store.below
        while target is not None:
            if self.room(target, n):
                return target
            target = target.below
        return None

    def capacity(self, store: Store, limit: int) -> int:
        """The most free slots (up to ``limit``) ``store`` can offer."""
        if self.room(store, limit):
            return limit
        lo, hi = min(limit, store.num_free), limit - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.room(store, mid):
                lo = mid
            else:
                hi = mid - 1
        return lo

    def make_room(self, store: Store, n: int) -> None:
        """Free slots until ``store`` has ``n`` free: victims move down as far as a colder
        level can take them (making room there first); droppable victims no level can
        take are dropped, the least recently used first.

        Raises:
            OutOfPagesError: not enough can be freed (nothing was changed), or a write of
                held pages to a colder level failed (pages that did move stay moved).
        """
        k = n - store.num_free
        if k <= 0:
            return
        if not self.room(store, n):
            raise OutOfPagesError(
                f"level {store.level} pool group {store.pool_group}: need {k} more slots; "
                f"{len(store.droppable)} droppable and {len(store.held)} held pages cannot "
                "free them")
        nd = min(k, len(store.droppable))
        nh = k - nd
        if store.last_level:
            self.drop(store, np.asarray(store.droppable.pop_victims(nd), dtype=np.int64))
            return
        if nh:
            target = self.held_target(store, nh)
            assert target is not None
            self.make_room(target, nh)
            held = np.asarray(store.held.pop_victims(nh), dtype=np.int64)
            try:
                unmoved = self._move(store, held, target, queued=False)
            except BaseException:  # an interrupt: those still here go back to their queue
                store.requeue(held[self.arena.store[held] == store.index])
                raise
            if len(unmoved):
                store.requeue(unmoved)
                raise OutOfPagesError(
                    f"level {store.level} pool group {store.pool_group}: could not free "
                    f"{k} slots (a write of held pages to the next level failed)")
        # Droppable victims go down where colder levels have room (the most recently used
        # first), and are dropped only when no colder level can take them. Making room
        # below may invalidate (and free) popped victims: those no longer filed here are
        # skipped (no page ids are handed out meanwhile, so a freed id stays freed).
        # A level with a level below frees a few more (``evict_ahead``): the next small
        # allocations then find free slots, and pages go down in fewer, larger batches;
        # only as many as the level below takes without moving its held pages (a
        # suspended request's) down.
        need = n - store.num_free
        ahead = store.ahead
        if ahead:
            below = store.below
            assert below is not None  # (ahead is 0 on the last level)
            ahead = max(0, min(ahead, below.num_free + below.num_droppable - need))
        want = min(need + ahead, len(store.droppable))
        # With the victims' priority runs where the policy tells them: the pages that move
        # are filed below at those priorities (their arena priorities) without a reread.
        popped, runs = store.droppable.pop_victim_runs(want) if want > 0 else ((), None)
        victims = np.asarray(popped, dtype=np.int64)
        here = store.index
        a = self.arena
        target = store.below
        try:
            while target is not None and len(victims):
                keep = self.capacity(target, len(victims))
                if keep:
                    mark = store.departures
                    try:
                        self.make_room(target, keep)
                    except OutOfPagesError:
                        # A write further down failed: drop these victims rather than
                        # leave them popped out of their queue (they are droppable).
                        victims = victims[a.store[victims] == here]
                        break
                    if store.departures != mark:  # pages of this store were freed or lost
                        victims = victims[a.store[victims] == here]
                        runs = None
                    keep = min(keep, len(victims), target.num_free)
                    cut = len(victims) - keep
                    head, tail = _split_runs(runs, cut)
                    failed = self._move(store, victims[cut:], target, queued=False,
                                        droppable=True, runs=tail)
                    if len(failed):
                        victims, runs = np.concatenate([victims[:cut], failed]), None
                    else:
                        victims, runs = victims[:cut], head
                target = target.below
        except BaseException:  # an interrupt: the victims still here go back to their queue
            store.requeue(victims[a.store[victims] == here])
            raise
        # A corrupt page met on the way took the droppable pages below it along. Victims
        # taken ahead of need that no level took (a failed or refused write) stay cached.
        if len(victims):
            left = victims[a.store[victims] == here]
            short = max(0, n - store.num_free)
            store.requeue(left[short:])
            self.drop(store, left[:short])
        if store.num_free < n:
            raise OutOfPagesError(
                f"level {store.level} pool group {store.pool_group}: could not free {k} "
                "slots (a write of held pages to the next level failed)")

    # -- moving -----------------------------------------------------------------------------------

    def _move(self, src: Store, pids: np.ndarray, dst: Store, queued: bool = True,
              stream: Stream | None = None, droppable: bool = False,
              lock: bool = False, runs: list[tuple[int, int]] | None = None) -> np.ndarray:
        """Move pages of ``src`` into free slots of ``dst``; returns the pages that could
        not be moved (I/O failure: they stay where they were, out of the queues when
        ``queued`` is False). ``droppable``: the pages are known droppable (victims
        popped from that queue), so they enter ``dst``'s droppable queue directly.
        ``lock``: the pages are held and unlocked; those that arrive trade one hold for a
        lock on the way (a resume's onboard: they never enter ``dst``'s queues).
        ``runs``: droppable pages' priorities as runs (see :meth:`Store.settle`)."""
        if not len(pids):
            return pids
        reserved = slots = dst.reserve_slots(len(pids))
        a = self.arena
        try:
            pg = self._pg_of[int(a.group[pids[0]])]
            layout = self.layouts[pg]
            keys = self.frame_keys(pids) if dst.frames is not None else None
            # int64: indexing with int32 slots costs a conversion per use (vacate, a copy)
            old = a.slot[pids].astype(np.int64)
            io = self.io[dst.level]
            mover = self.mover
            per = max(-(-len(pids) // _MOVE_BATCHES), self._batch_pages[pg])
            issue = mover.can_issue(src, dst)
            if issue and dst.level == 0:  # batch k takes the slots eviction batch k freed
                slots = mover.fences.order(dst, slots)
            if issue:
                # Both sides ascending within each batch (see _in_runs); slots[i] is
                # pids[i]'s.
                o = order_in_batches(old, per)
                ordered = sort_in_batches(slots, per)
                slots = np.empty_like(ordered)
                slots[o] = ordered
            elif self._pair_runs and (keys is None or src.level == 0 or
                                      self.codecs[src.level] is not self.codecs[dst.level]):
                slots = _in_runs(slots, old, per)
            # (Between framed cold levels of one codec the copy is one gather whatever the
            # pairing, and its write is put in slot order by the storage pool (the disk
            # tier, or the level's held writes when flushed); a backend whose copies cost
            # the same in any order says so, run_copies False: _in_runs would sort for
            # nothing.)
            if issue:
                # Issued, not waited for (kvcm_core.fences): slots freed here are fenced.
                mover.issue(layout, src, old[o], dst, ordered, per)
            elif io is None:
                self.mover.copy(layout, src, old, dst, slots, stream, keys)
            else:
                with io.dropping(droppable):
                    self.mover.copy(layout, src, old, dst, slots, stream, keys)
        except WriteQueueFull:  # the level is busy: these cached copies are dropped
            dst.unreserve_slots(slots)
            return pids
        except TierIOError as exc:
            dst.unreserve_slots(slots)
            self.stats.io_failures += 1
            self.last_io_error = exc
            return pids
        except FrameCheckFailed as exc:
            good = np.ones(len(pids), dtype=bool)
            good[exc.positions] = False
            try:
                self.discard_corrupt(src, pids[~good], queued)
            except BaseException:  # a sink's interrupt: nothing arrived in dst
                dst.unreserve_slots(reserved)
                raise
            # Dropping a corrupt page frees the droppable pages below it: some good ones.
            keep = good & (a.store[pids] == src.index)
            dst.unreserve_slots(slots[~keep])
            pids, slots, old = pids[keep], slots[keep], old[keep]
            runs = None  # (they counted the pages dropped)
            if not len(pids):
                return pids
        except BaseException:  # an interrupt (or a bug): the pages stay where they were
            dst.unreserve_slots(reserved)
            raise
        src.vacate(pids, queued=queued, slots=old)
        if lock:
            a.locks[pids] += 1
            a.holds[pids] -= 1
        dst.settle(pids, slots, droppable, locked=lock, runs=runs)  # locked: no _enter
        self.epoch += 1
        self._count_moves(pids, src.level, dst.level)
        return pids[:0]

    def frame_keys(self, pids: np.ndarray) -> np.ndarray:
        """The 32-byte block keys (``uint8 [n, 32]``) that frames of these pages carry."""
        if len(pids) == 1:  # the same key, on scalars
            pid = int(pids[0])
            nid = int(self.arena.node[pid])
            key = self.tree.key(nid) if nid >= 0 else None
            return np.frombuffer(key if key is not None else page_key(None, pid),
                                 dtype=np.uint8).reshape(1, KEY_BYTES)
        # One gather of key rows (the tree keeps them for a manager with a framed level);
        # partial or uncommitted blocks (a row of zeros) get a key from the page id.
        rows = self.tree.key_rows_of(self.arena.node[pids])
        # The rows of zeros, found by a byte search for 32 zero bytes (a batch has a few,
        # its partial tails; array operations, a reduction over every row above all, cost
        # several times more). The first match is where the first zero row starts, or
        # earlier: only the row starting at or after it can be the first zero row, and
        # the search goes on past that row. Past _FEW_KEYLESS of them, every row is
        # tested at once.
        blob = bytearray(rows)  # (a copy; the keys are filled in there, bytes each)
        at = blob.find(_ZERO_KEY)
        keyless: Any = []
        while at >= 0:
            i = -(-at // KEY_BYTES)  # the first row starting at or after the match
            start = i * KEY_BYTES
            if blob.startswith(_ZERO_KEY, start):
                keyless.append(i)
                if len(keyless) > _FEW_KEYLESS:
                    keyless = np.flatnonzero(~rows.view(np.uint64).any(axis=1))
                    rows[keyless] = page_key_rows(pids[keyless])
                    return rows
            at = blob.find(_ZERO_KEY, start + KEY_BYTES)
        if not keyless:
            return rows
        for i in keyless:
            blob[i * KEY_BYTES : (i + 1) * KEY_BYTES] = page_key(None, int(pids[i]))
        return np.frombuffer(blob, dtype=np.uint8).reshape(len(pids), KEY_BYTES)

    def discard_corrupt(self, store: Store, pids: np.ndarray, queued: bool = True) -> None:
        """Pages of ``store`` whose frame failed its check: counted, and out of the tree
        with everything below them. Unreferenced ones are dropped; referenced ones are
        lost (their owners keep a dead reference, and ``resume`` says which block).
        ``queued`` False: they were popped from their queue."""
        if not len(pids):
            return
        self.stats.corrupt_pages += len(pids)
        a = self.arena
        owned = (a.locks[pids] > 0) | (a.holds[pids] > 0)
        if not owned.all():
            self.drop(store, pids[~owned], queued=queued)
        # One by one, each marked before lose() delivers its events (a sink's interrupt
        # there leaves the rest popped, as the caller expects, and resume names the block).
        for pid in pids[owned].tolist():
            if a.store[pid] == store.index:
                if not queued:
                    store.requeue(np.array([pid], dtype=np.int64))  # lose() unqueues it
                self.corrupt_ids.add(pid)
                self.lose(pid)

    def _count_moves(self, pids: np.ndarray, from_level: int, to_level: int) -> None:
        if len(self.life_cycles) == 1:
            groups, g0, single = pids, 0, True  # one cache group: nothing to split
        else:
            groups = self.arena.group[pids]
            g0 = int(groups[0])
            single = not np.count_nonzero(groups != g0)
        level = max(from_level, to_level)
        for g in [g0] if single else np.unique(groups).tolist():
            n = len(pids) if single else int((groups == g).sum())
            gstats = self.stats.groups[g]
            size = self._move_bytes.get((g, level))
            if size is None:
                size = self._move_bytes[(g, level)] = self.cold_bytes(g, level)
            nbytes = n * size
            if to_level > from_level:
                gstats.offload_blocks += n
                gstats.offload_bytes += nbytes
            else:
                gstats.onboard_blocks += n
                gstats.onboard_bytes += nbytes
        if self.sinks:
            nodes = self.arena.node[pids]
            for pid, nid in zip(pids.tolist(), nodes.tolist(), strict=True):
                if nid >= 0:
                    self.event(EventKind.MOVED, nid, int(self.arena.group[pid]), to_level,
                               from_level=from_level)
            self.deliver_due()

    def move(self, pids: np.ndarray, dst: Store, stream: Stream | None = None) -> np.ndarray:
        """Move unlocked pages (one store) to ``dst``, which has room. Returns failures."""
        return self._move(self.store_of(int(pids[0])), pids, dst, True, stream)

    def onboard(self, pids: np.ndarray, stream: Stream | None = None,
                lock: bool = False) -> None:
        """Move held pages of colder levels to level 0 (room must exist). ``lock``: each
        page that arrives trades one hold for a lock (what a resume does next anyway,
        without passing through level 0's queues); pages that fail keep their hold.

        Raises:
            TierIOError: a page could not be read; it is forgotten (dropped from the tree,
                slot freed) and the others that were read stay on level 0.
            CorruptPageError: a page failed its frame check; it is forgotten likewise
                (``pages`` names the lost pages).
        """
        if not len(pids):
            return
        a = self.arena
        if len(pids) == 1:  # the same key, on scalars
            pid = pids[0]
            keys: Any = [int(a.store[pid]) * 1024 + self._pg_of[int(a.group[pid])]]
            uniform = True
        else:
            key = a.store[pids].astype(np.int64) * 1024 + self._pg_array[a.group[pids]]
            uniform = not _count(key != key[0])  # the usual case: one source store
            keys = [int(key[0])] if uniform else dict.fromkeys(key.tolist())
        for k in keys:
            batch = pids if uniform else pids[key == k]
            src = self.all_stores[k // 1024]
            failed = self._move(src, batch, self.stores[0][k % 1024], True, stream,
                                lock=lock)
            gone = a.store[batch] < 0
            if _count(gone):
                lost = batch[gone]
                raise CorruptPageError(
                    f"{len(lost)} pages read from level {src.level} failed their frame "
                    "check; they are dropped from the prefix tree and must be recomputed",
                    pages=tuple(lost.tolist()))
            if len(failed):
                for pid in failed.tolist():
                    self.lose(pid)
                cause = self.last_io_error
                raise TierIOError(
                    f"reading {len(failed)} pages from level {src.level} failed ({cause}); "
                    "they are dropped from the prefix tree and must be recomputed") from cause

    def fill(self, group: int, dst: np.ndarray, src: np.ndarray,
             stream: Stream | None = None) -> None:
        """Copy the data of source pages (any level) into level-0 pages ``dst``, leaving
        the sources where they are.

        Raises:
            TierIOError: a source on a storage level could not be read (or missed its
                I/O deadline); the sources of that level are lost (out of the tree).
            CorruptPageError: a source failed its frame check (it is lost; ``pages``
                names it).
        """
        if not len(dst):
            return
        a = self.arena
        layout = self.layouts[self._pg_of[group]]
        gpu = self.gpu_store(group)
        stores = a.store[src]
        for s in dict.fromkeys(stores.tolist()):
            sel = stores == s
            store = self.all_stores[s]
            try:
                self.mover.copy(layout, store, a.slot[src[sel]], gpu, a.slot[dst[sel]],
                                stream)
            except FrameCheckFailed as exc:
                bad = src[sel][exc.positions]
                self.discard_corrupt(store, bad)
                raise CorruptPageError(str(exc), pages=tuple(bad.tolist())) from exc
            except TierIOError as exc:
                # Lost like a failed onboard: out of the tree (a block whose slot can never
                # be read again must not be reused again and again).
                self.stats.io_failures += 1
                lost = list(dict.fromkeys(src[sel].tolist()))
                for pid in lost:
                    if a.store[pid] == s:
                        self._lose_unmovable(store, pid)
                raise TierIOError(
                    f"reading {len(lost)} pages from level {store.level} failed ({exc}); "
                    "they are dropped from the prefix tree and must be recomputed") from exc
            n = int(sel.sum())
            if store.level == 0:
                self.stats.groups[group].intra_device_copies += n
            else:
                self.stats.groups[group].onboard_blocks += n
                self.stats.groups[group].onboard_bytes += n * self.cold_bytes(group,
                                                                              store.level)

    def copy_blocks(self, group: int, dst: np.ndarray, src: np.ndarray,
                    stream: Stream | None = None) -> None:
        """Copy level-0 pages of ``group`` (``dst[i]`` from ``src[i]``) in every pool."""
        if not len(dst):
            return
        a = self.arena
        pairs = copy_pairs(a.slot[dst], a.slot[src])
        tasks = []
        store = self.gpu_store(group)
        for pool in store.pools:
            assert isinstance(pool, DevicePool)
            tasks.append(CopyTask(pool.region, pool.region, pool.slot_bytes, pairs))
        fences = self.mover.fences
        parts = ((store, pairs[:, 0]), (store, pairs[:, 1]))
        if fences.events:
            fences.wait_device(stream or self.backend.default_stream, parts)
        self.backend.copy_pages_batch(tasks, stream)
        if fences.enabled:
            fences.record(stream or self.backend.default_stream, parts)
        self.stats.groups[group].intra_device_copies += len(dst)

    def wait_pages(self, stream: Stream | None, pids: np.ndarray) -> None:
        """``stream`` (None: the default stream) waits for the copies still touching these
        pages' slots (e.g. an onboard bringing a page in for another request)."""
        fences = self.mover.fences
        if not fences.events or not len(pids):
            return
        a = self.arena
        parts = [(self.all_stores[s], a.slot[batch])
                 for s, batch in group_by_store(a, pids) if s >= 0]
        fences.wait_device(stream or self.backend.default_stream, parts)

    def prefetch(self, pids: np.ndarray, level: int) -> int:
        """Move pages up to ``level`` where room exists without pushing held pages
        anywhere: droppable pages there make way, moving into free slots of the next
        colder level (the most recently used first) and dropped where there are none."""
        a = self.arena
        moved = 0
        for s, batch in group_by_store(a, pids):
            batch = batch[a.store[batch] == s]  # room made for an earlier batch moves pages
            by_dst: dict[int, list[int]] = {}
            for pid in batch.tolist():
                g = int(a.group[pid])
                dst = self.gpu_store(g) if level == 0 else self.cold_store(level, g)
                by_dst.setdefault(dst.index, []).append(pid)
            for d, plist in by_dst.items():
                dst = self.all_stores[d]
                take = np.asarray(plist[: dst.num_free + len(dst.droppable)], dtype=np.int64)
                if not len(take):
                    continue
                if len(take) > dst.num_free:
                    self._make_way(dst, len(take) - dst.num_free)
                    # Dropping a victim may have taken pages of this batch along.
                    take = take[a.store[take] == s]
                take = take[: dst.num_free]
                if not len(take):
                    continue
                self._move(self.all_stores[s], take, dst)
                moved += int(np.count_nonzero(a.store[take] == dst.index))
        return moved

    def _make_way(self, store: Store, k: int) -> None:
        """Free ``k`` slots of ``store`` from its droppable pages without a cascade: the
        most recently used go to free slots of the next colder store, the rest (and those
        whose move fails) are dropped."""
        victims = np.asarray(store.droppable.pop_victims(k), dtype=np.int64)
        below = store.below
        here = self.arena.store
        if below is not None and below.num_free and len(victims):
            cut = max(0, len(victims) - below.num_free)
            try:
                failed = self._move(store, victims[cut:], below, queued=False,
                                    droppable=True)
            except BaseException:  # an interrupt: the victims still here are requeued
                store.requeue(victims[here[victims] == store.index])
                raise
            victims = np.concatenate([victims[:cut], failed])
        victims = victims[here[victims] == store.index]
        if len(victims):
            self.drop(store, victims)

    # -- dropping ---------------------------------------------------------------------------------

    def drop(self, store: Store, pids: np.ndarray, queued: bool = False) -> None:
        """Remove droppable pages of ``store`` from the tree and free their slots
        (``queued``: still in the droppable queue). A page every longer match needs
        takes the subtree below its block with it."""
        if not len(pids):
            return
        if queued:
            store.droppable.remove_many(pids)
        a = self.arena
        tree = self.tree
        nodes = a.node[pids].astype(np.int64)
        groups = a.group[pids].astype(np.int64)
        tree.pages[nodes, groups] = -1
        a.node[pids] = NO_NODE
        self._count_drops(groups, a.reused[pids])
        if self.sinks:
            level = store.level
            for nid, g in zip(nodes.tolist(), groups.tolist(), strict=True):
                self.event(EventKind.REMOVED, nid, g, level)
        store.free_pages(pids)
        inval = self._inval_all[groups] | (tree.ordinal[nodes] < self._inval_sinks[groups])
        cand = nodes[inval]
        # Page-less chains go first (a batch of victims is usually a chain's tail), so
        # only nodes that keep children below them invalidate a subtree.
        tree.collect(nodes)
        if len(cand):
            cand = cand[(tree.nchildren[cand] > 0) & tree.live(cand)]
            for nid in cand.tolist():
                self.invalidate_below(nid)
                tree.collect(np.array([nid], dtype=np.int64))
        self.deliver_due()

    def _count_drops(self, groups: np.ndarray, reused: np.ndarray) -> None:
        g0 = int(groups[0])
        if len(self.life_cycles) == 1 or not np.count_nonzero(groups != g0):
            gstats = self.stats.groups[g0]
            gstats.dropped_blocks += len(groups)
            gstats.dropped_before_reuse += len(groups) - int(np.count_nonzero(reused))
            return
        for g in np.unique(groups).tolist():
            sel = groups == g
            gstats = self.stats.groups[g]
            gstats.dropped_blocks += int(sel.sum())
            gstats.dropped_before_reuse += int((sel & (reused == 0)).sum())

    def invalidate_below(self, nid: int) -> None:
        """Detach every node below ``nid``: droppable pages freed, referenced ones become
        private to their holders."""
        tree = self.tree
        a = self.arena
        below = tree.subtree(nid)
        if not below:
            return
        nodes = np.asarray(below, dtype=np.int64)
        pages = tree.pages[nodes]
        for g in range(pages.shape[1]):
            col = pages[:, g]
            have = col >= 0
            if not have.any():
                continue
            pids = col[have]
            if self.sinks:
                for n, pid in zip(nodes[have].tolist(), pids.tolist(), strict=True):
                    self.event(EventKind.REMOVED, n, g, int(a.level[pid]))
            loose = (a.locks[pids] == 0) & (a.holds[pids] == 0)
            a.node[pids[~loose]] = NO_NODE
            gone = pids[loose]
            if len(gone):
                self._count_drops(np.full(len(gone), g), a.reused[gone])
                for s, batch in group_by_store(a, gone):
                    store = self.all_stores[s]
                    # Victims popped by a make-room cascade above are in no queue.
                    popped = np.fromiter((p not in store.droppable for p in batch.tolist()),
                                         np.bool_, len(batch))
                    a.node[batch[popped]] = NO_NODE
                    store.free_pages(batch[popped])
                    store.unpublish(batch[~popped])
        for child in tree.children(nid):
            tree.detach(child)

    def unpublish_node(self, nid: int) -> None:
        """Take every page out of a node (superseded partial block) and remove it."""
        tree = self.tree
        a = self.arena
        for g in range(tree.num_groups):
            pid = int(tree.pages[nid, g])
            if pid < 0:
                continue
            tree.pages[nid, g] = -1
            self.event(EventKind.REMOVED, nid, g, int(a.level[pid]))
            self.store_of(pid).unpublish(np.array([pid], dtype=np.int64))
        tree.detach(nid)
        self.deliver_due()

    def lose(self, pid: int) -> None:
        """A page whose data cannot be read: forget it everywhere (its holders keep a
        dead reference and must recompute)."""
        a = self.arena
        tree = self.tree
        nid = int(a.node[pid])
        g = int(a.group[pid])
        store = self.store_of(pid)
        # Out of its queue first: the store tells droppable pages by their node.
        store.forget(np.array([pid], dtype=np.int64))
        if nid >= 0:
            tree.pages[nid, g] = -1
            a.node[pid] = NO_NODE
            self.event(EventKind.REMOVED, nid, g, store.level)
            lc = self.life_cycles[g]
            if not lc.is_ssm and lc.constrains_block(int(tree.ordinal[nid])) and (
                    lc.window is None or tree.ordinal[nid] < lc.num_sink_blocks):
                self.invalidate_below(nid)
            tree.collect(np.array([nid], dtype=np.int64))
        self.epoch += 1
        self.deliver_due()

    def publish_one(self, pid: int, nid: int, group: int) -> None:
        """Commit one referenced page into tree node ``nid``."""
        self.tree.pages[nid, group] = pid
        self.arena.node[pid] = nid
        if self.sinks:
            self.event(EventKind.STORED, nid, group, int(self.arena.level[pid]),
                       self.tree.block_tokens(nid))
            self.deliver_due()

    def publish(self, pids: np.ndarray, nodes: np.ndarray, group: int,
                tokens: Sequence[tuple[int, ...]] | None = None) -> None:
        """Commit referenced pages of ``group`` into tree ``nodes``."""
        self.tree.pages[nodes, group] = pids
        self.arena.node[pids] = nodes
        if self.sinks:
            levels = self.arena.level[pids].tolist()
            for i, (nid, lv) in enumerate(zip(nodes.tolist(), levels, strict=True)):
                self.event(EventKind.STORED, nid, group, lv,
                           tokens[i] if tokens is not None else self.tree.block_tokens(nid))
            self.deliver_due()

    def clear(self) -> None:
        """Drop every droppable page (no cache is open)."""
        for store in self.all_stores:
            while len(store.droppable):
                self.drop(store, np.asarray(store.droppable.pop_victims(
                    len(store.droppable)), dtype=np.int64))
        self.tree.clear()
        self.flush_events()

    # -- events -----------------------------------------------------------------------------------

    def event(self, kind: EventKind, nid: int, group: int, level: int,
              token_ids: tuple[int, ...] = (), from_level: int | None = None) -> None:
        """Queue a block event. Queued only: the operation that queued it delivers the
        queue once its bookkeeping is done (:meth:`deliver_due`), so that a sink's
        interrupt never lands between two steps of it."""
        if not self.sinks:
            return
        tree = self.tree
        key = tree.key(nid)
        parent = int(tree.parent[nid])
        # A chain's first block has no parent block: its parent node is the scope root,
        # whose digest no event announces (vLLM's BlockStored: parent hash None).
        pkey = tree.key(parent) if parent >= 0 and tree.ordinal[parent] >= 0 else None
        self._events.append(BlockEvent(
            kind=kind, block_key=key.hex() if key else f"partial:{nid:x}",
            parent_key=pkey.hex() if pkey else None, group=group, level=level,
            medium=self.medium(level), token_ids=token_ids, from_level=from_level))

    def deliver_due(self) -> None:
        """Deliver the queued events once they are a batch (:data:`_EVENT_BATCH`): called
        where an operation that queued some has finished its bookkeeping."""
        if len(self._events) >= _EVENT_BATCH:
            self.flush_events()

    def removed_at_shutdown(self) -> None:
        """A REMOVED event for every block still cached, on the level it is on, deepest
        block first: at shutdown every level's pages go with the manager (no cache is
        open). The tree itself is left as it is. Queued only: :meth:`close` delivers
        them, so a sink that raises cannot stop the rest of a shutdown."""
        if not self.sinks:
            return
        tree = self.tree
        ordinal = tree.ordinal
        nodes = np.flatnonzero(ordinal >= 0)
        nodes = nodes[np.argsort(-ordinal[nodes], kind="stable")]
        level = self.arena.level
        for nid, row in zip(nodes.tolist(), tree.pages[nodes].tolist(), strict=True):
            for g, pid in enumerate(row):
                if pid >= 0:
                    self.event(EventKind.REMOVED, nid, g, int(level[pid]))

    def flush_events(self) -> None:
        """Deliver pending events. A sink that raises never disturbs the manager: the
        batch is counted in ``event_sink_errors`` and a warning names the sink once."""
        if not self._events:
            return
        batch, self._events = self._events, []
        interrupt: BaseException | None = None
        for sink, name in zip(self.sinks, self._sink_names, strict=True):
            try:
                sink.on_events(batch)
            except Exception as exc:  # a sink's failure must not break the engine's step
                if name not in self.event_sink_errors:
                    warnings.warn(f"kvcm event sink {name} raised {type(exc).__name__}: "
                                  f"{exc}; its events are dropped and counted",
                                  RuntimeWarning, stacklevel=3)
                self.event_sink_errors[name] = self.event_sink_errors.get(name, 0) + 1
            except BaseException as exc:  # an interrupt: the other sinks get the batch,
                interrupt = interrupt or exc  # then it goes on
        if interrupt is not None:
            raise interrupt

    # -- quotas -----------------------------------------------------------------------------------

    def resize_level(self, level: int, slots: list[int]) -> bool:
        """Give the stores of ``level`` these slot counts (every cache suspended), moving
        pages out of released slots. False, sizes unchanged, when they cannot fit (room
        made first stays made). A page whose move fails (storage read or write) is lost,
        as a failed read at resume loses it: dropped from the tree, its holders must
        recompute."""
        self.resize_failure = None
        try:
            return self._resize_level(level, slots)
        finally:
            self.mover.forget_plans()  # pools may have been reallocated

    def _resize_level(self, level: int, slots: list[int]) -> bool:
        stores = self.stores[level]
        if level == 0:
            # The moves out of released GPU slots read what the engine wrote there on
            # any of its streams (a quota resize is rare: the host waits for everything).
            self.backend.synchronize()
        self.mover.fences.synchronize()  # pools may be reallocated: no copy in flight
        plans = []
        for store, new in zip(stores, slots, strict=True):
            nhigh = len(store.high_pages(new))
            free_low = int((store.free_slots() < new).sum())
            short = nhigh - free_low
            if short > 0 and not self.room(store, store.num_free + short):
                return False
            plans.append((store, new, short))
        # All the room first, then the sizes: pool groups can share a colder store, so a
        # later store may find the room the plan counted on taken by an earlier one. Then
        # nothing is resized (pages that moved down stay there, valid).
        for store, new, _ in plans:
            # Counted again: making room in one store drops blocks whose pages in
            # another (another life cycle) were in the slots it gives up.
            short = len(store.high_pages(new)) - int((store.free_slots() < new).sum())
            if short > 0:
                if not self.room(store, store.num_free + short):
                    return False
                try:
                    self.make_room(store, store.num_free + short)
                except OutOfPagesError:
                    return False  # a write failed; pages that moved stay valid
        self.mover.fences.synchronize()  # copies of make_room must not run late
        # The grows first, undone if a later one fails (their new slots are still free):
        # a grow fails far more often (a full disk) than a shrink.
        done: list[tuple[Store, int]] = []  # (store, size before this call)
        for store, new, _ in plans:
            if new > store.num_slots:
                old = store.num_slots
                try:
                    store.grow(new)
                except _POOL_FAILURES as exc:  # the pool could not grow (in time, or no memory)
                    self._undo_resizes(done)
                    self.resize_failure = f"the pool kept its size: {_why(exc)}"
                    return False
                done.append((store, old))
        for store, new, _ in plans:
            if new >= store.num_slots:
                continue
            high = store.high_pages(new)
            low = np.sort(store.free_slots()[store.free_slots() < new])[: len(high)]
            a = self.arena
            for pid, slot in zip(high.tolist(), low.tolist(), strict=True):
                if a.store[pid] != store.index:
                    continue  # gone with the subtree of a page lost below
                layout = self.layouts[self._pg_of[int(a.group[pid])]]
                try:
                    self.mover.copy(layout, store, [int(a.slot[pid])], store, [slot])
                except FrameCheckFailed:
                    self.discard_corrupt(store, np.array([pid], dtype=np.int64))
                    continue
                except TierIOError:
                    self._lose_unmovable(store, pid)
                    continue
                store.relocate(pid, slot)
            if len(high):
                self.epoch += 1
            self.mover.fences.synchronize()
            old = store.num_slots
            try:
                store.shrink(new)
            except _POOL_FAILURES as exc:  # the pages moved stay valid
                self._undo_resizes(done)
                self.resize_failure = f"the pool kept its size: {_why(exc)}"
                return False
            done.append((store, old))
        return True

    @staticmethod
    def _undo_resizes(done: list[tuple[Store, int]]) -> None:
        """Give the stores of a failed level resize their old sizes back, the last first.
        A grown store shrinks back (its new slots are free); a shrunk one grows back,
        which can fail too: then the level is left partly resized and
        :class:`TierIOError` says so."""
        for store, old in reversed(done):
            if old < store.num_slots:
                try:
                    store.shrink(old)
                except _POOL_FAILURES:
                    pass  # the pools stay larger than the store uses: harmless
            else:
                try:
                    store.grow(old)
                except _POOL_FAILURES as exc:
                    raise TierIOError(
                        f"level {store.level}: a resize failed half-way and pool group "
                        f"{store.pool_group} cannot grow back to {old} slots ({exc}); it "
                        f"keeps {store.num_slots}") from exc

    def _lose_unmovable(self, store: Store, pid: int) -> None:
        """A page whose copy failed: a droppable one is dropped (with the subtree that
        needs it), a held one lost (its holders recompute)."""
        a = self.arena
        if a.holds[pid] == 0 and a.locks[pid] == 0:
            self.drop(store, np.array([pid], dtype=np.int64), queued=True)
        else:
            self.lose(pid)

    # -- checks and shutdown ----------------------------------------------------------------------

    def check_invariants(self, refs: Sequence[int] | None = None) -> None:
        """Accounting identity per store, no slot owned twice, queue membership consistent
        with page states, tree and pages pointing at each other; with ``refs`` (every page
        reference of every owner, one entry per lock or hold), each live page's locks plus
        holds equal its references (a leaked lock is a slot lost for good)."""
        if refs is not None:
            self._check_owners(refs)
        a = self.arena
        tree = self.tree
        for level, stores in enumerate(self.stores):
            for store in stores:
                store.check(level)
                stats = StorageStatistics(level)
                store.statistics(stats)
                if stats.free + stats.evictable + stats.unavailable != stats.total:
                    raise AssertionError("free + evictable + unavailable != total")
                pids = store.pages()
                nodes = a.node[pids]
                c = nodes >= 0
                if c.any() and (tree.pages[nodes[c], a.group[pids[c]]] != pids[c]).any():
                    raise AssertionError(f"L{level}: a committed page not in its node")

    def _check_owners(self, refs: Sequence[int]) -> None:
        a = self.arena
        n = a.capacity
        want = np.bincount(np.asarray(refs, dtype=np.int64), minlength=n)[:n]
        have = a.locks[:n].astype(np.int64) + a.holds[:n]
        bad = np.flatnonzero((want != have) & (a.level[:n] >= 0))
        if len(bad):
            raise AssertionError("locks + holds != references of open caches: " + "; ".join(
                f"{a.describe(int(p))}: {int(want[p])} references" for p in bad[:5]))

    def close(self, deliver: bool = True) -> None:
        """Close every pool, tier and the mover, each even when an earlier one failed
        (``deliver``: queued events go to the sinks first; else they are dropped).

        Raises:
            TierIOError: something could not be closed (every failure is listed); what
                could be closed is closed.
        """
        failures: list[str] = []
        interrupts: list[BaseException] = []

        def attempt(what: str, close: Callable[[], None]) -> None:
            try:
                close()
            except Exception as exc:  # one failure must not leave the rest open
                failures.append(f"{what}: {type(exc).__name__}: {exc}")
            except BaseException as exc:  # an interrupt (a sink's KeyboardInterrupt):
                interrupts.append(exc)  # everything is released first, then it goes on

        if deliver:
            attempt("event sinks", self.flush_events)
        attempt("copies in flight", self.mover.fences.synchronize)
        # Storage levels close on their I/O threads, all within one deadline: what is
        # stuck then is abandoned (its thread closes the files once it returns).
        deadlines = [io.deadline_s for io in self.io if io is not None and io.deadline_s]
        until = time.monotonic() + max(deadlines, default=0.0)
        abandoned: list[str] = []
        for level, tier in enumerate(self.tiers):
            closers = [(f"level {store.level} store {store.index} pool {i}", pool.close)
                       for store in self.stores[level] for i, pool in enumerate(store.pools)]
            closers.append((f"level {level} tier", tier.close))
            io = self.io[level]
            if io is None:
                for what, close in closers:
                    attempt(what, close)
                continue
            try:
                failed, stuck = io.close(closers, until)
            except BaseException as exc:  # its thread still runs the closers it was given
                interrupts.append(exc)
                continue
            failures += failed
            abandoned += stuck
        attempt("mover", self.mover.close)
        if abandoned:
            failures.append(f"{len(abandoned)} storage operations abandoned past the I/O "
                            f"deadline ({'; '.join(abandoned)}); their level's I/O thread "
                            "closes its files when they return")
        error = TierIOError(f"shutdown could not release {len(failures)} resources "
                            f"(the rest is released): {'; '.join(failures)}") \
            if failures else None
        if interrupts:
            raise interrupts[0] from error
        if error is not None:
            raise error


def release_dropped(levels: Levels, remote: Any) -> None:
    """``weakref.finalize``'s callback for a manager collected without ``shutdown()``:
    its remote level and levels are closed on a thread of their own (a collection may run
    on any thread, kvcm's I/O threads included, and must not wait there), queued events
    undelivered. Failures are ignored: nobody is left to tell."""
    def run() -> None:
        with contextlib.suppress(Exception):
            if remote is not None:
                remote.close()
        with contextlib.suppress(Exception):
            levels.close(deliver=False)

    threading.Thread(target=run, name="kvcm-release", daemon=True).start()


def _allocate(make: Callable[[], Any], field: str, quota: int | None) -> Any:
    """A pool, or a ConfigError naming the quota a pool of that size cannot have (no
    memory for it, or more than an array can index)."""
    try:
        return make()
    except (MemoryError, OverflowError, ValueError) as exc:
        raise ConfigError(field, quota, f"cannot be allocated ({type(exc).__name__}: "
                          f"{exc})") from exc


def _split_runs(runs: list[tuple[int, int]] | None, cut: int
                ) -> tuple[list[tuple[int, int]] | None, list[tuple[int, int]] | None]:
    """Priority runs ``(priority, count)`` of some pages as the runs of their first
    ``cut`` pages and those of the rest (None: no runs, for both)."""
    if runs is None:
        return None, None
    head: list[tuple[int, int]] = []
    for i, (p, c) in enumerate(runs):
        if cut <= 0:
            return head, runs[i:]
        if c > cut:
            head.append((p, cut))
            return head, [(p, c - cut), *runs[i + 1:]]
        head.append((p, c))
        cut -= c
    return head, []


def _in_runs(slots: np.ndarray, old: np.ndarray, per: int) -> np.ndarray:
    """Destination slots for pages leaving source slots ``old``: within each batch of
    ``per``, the batch's slots in ascending order go to its pages in ascending order of
    their source slots, so that pages adjacent on both sides are copied as one run (one
    copy descriptor instead of one per page). ``slots`` (the caller's own) may be sorted
    in place."""
    n = len(slots)
    if n < 2:
        return slots
    out = np.empty_like(slots)
    if n <= per:  # one batch: order_in_batches and sort_in_batches, without their copies
        slots.sort()
        out[old.argsort(kind="stable")] = slots
        return out
    out[order_in_batches(old, per)] = sort_in_batches(slots, per)
    return out
