"""Pages, slots and their states on every level.

A :class:`Page` is one slot at one level for one (block, life cycle). Its state follows
from who references it:

- ``LOCKED``: an active request needs it on the GPU (``locks > 0``). Never moves or drops.
- ``HELD``: only suspended requests (or pending reuse claims) reference it
  (``holds > 0``). May move to a colder level, never dropped.
- ``DROPPABLE``: committed (in the prefix tree) and unreferenced. May move down, or be
  dropped at the last level.
- otherwise the page is freed at once (an uncommitted page nobody references).

Per (level, pool group) the store keeps a free list, a slot -> page table, and two
eviction-policy instances (droppable pages, held pages), so that the accounting identity
``free + evictable + unavailable == total`` can be checked by counting pages.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from kvcm_core.errors import OutOfPagesError
from kvcm_core.eviction import DEFAULT_PRIORITY, EvictionPolicy

if TYPE_CHECKING:
    from kvcm_core.tier import Pool

__all__ = ["Page", "PageState", "PoolGroupStore", "StorageStatistics"]


class PageState(enum.Enum):
    LOCKED = "locked"
    HELD = "held"
    DROPPABLE = "droppable"
    FREE = "free"


class Page:
    """One slot at one level holding one block of one life cycle."""

    __slots__ = (
        "__weakref__",
        "group",
        "holds",
        "level",
        "locks",
        "node",
        "priority",
        "ready",
        "reused",
        "slot",
        "store",
    )

    def __init__(self, store: PoolGroupStore, slot: int, group: int) -> None:
        self.store = store
        self.slot = slot
        self.group = group
        self.level = store.level
        self.locks = 0
        self.holds = 0
        self.node: Any = None  # the prefix-tree node holding it once committed
        self.priority = DEFAULT_PRIORITY
        self.ready: Any = None  # event or I/O handle the data waits on, if any
        self.reused = False  # claimed by a request other than its writer

    @property
    def state(self) -> PageState:
        if self.locks:
            return PageState.LOCKED
        if self.holds:
            return PageState.HELD
        if self.node is not None:
            return PageState.DROPPABLE
        return PageState.FREE

    def __repr__(self) -> str:
        return (f"Page(g{self.group} L{self.level} slot {self.slot} {self.state.name} "
                f"locks={self.locks} holds={self.holds})")


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


class PoolGroupStore:
    """Slots of one pool group at one level: pools, free list, pages, eviction order.

    Args:
        level: level index.
        pool_group: pool group id at that level.
        pools: the tier's pools (one per slot size; one pool for cold levels).
        make_policy: builds an eviction-policy instance.
        last_level: pages here cannot move further down (held pages are not evictable).
    """

    def __init__(
        self,
        level: int,
        pool_group: int,
        pools: list[Pool],
        make_policy: Callable[[], EvictionPolicy],
        last_level: bool,
    ) -> None:
        self.level = level
        self.pool_group = pool_group
        self.pools = pools
        self.num_slots = pools[0].num_slots
        self.slot_bytes = sum(p.slot_bytes for p in pools)
        self.last_level = last_level
        # Pop from the end: low slot ids first, which keeps shrinking cheap.
        self.free: list[int] = list(range(self.num_slots - 1, -1, -1))
        self.pages: list[Page | None] = [None] * self.num_slots
        self.droppable = make_policy()
        self.held = make_policy()

    # -- counting ------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_evictable(self) -> int:
        """Slots that can be freed here: droppable pages, and held ones if they can move."""
        return len(self.droppable) + (0 if self.last_level else len(self.held))

    def live_pages(self) -> Iterator[Page]:
        return (p for p in self.pages if p is not None)

    # -- slots ---------------------------------------------------------------------------

    def take_slots(self, group: int, n: int) -> list[Page]:
        """``n`` new FREE-state pages from the free list (the caller makes room first)."""
        if n > len(self.free):
            raise OutOfPagesError(
                f"level {self.level} pool group {self.pool_group}: {n} slots wanted, "
                f"{len(self.free)} free"
            )
        out = []
        free = self.free
        pages = self.pages
        for _ in range(n):
            slot = free.pop()
            page = Page(self, slot, group)
            pages[slot] = page
            out.append(page)
        return out

    def release_slot(self, page: Page) -> None:
        """Return a page's slot to the free list (the page must be unreferenced)."""
        if self.pages[page.slot] is page:
            self.pages[page.slot] = None
            self.free.append(page.slot)
        page.slot = -1

    # -- state transitions ------------------------------------------------------------------

    def _leave_policy(self, page: Page) -> None:
        if page.locks:
            return
        if page.holds:
            self.held.remove(page)
        elif page.node is not None:
            self.droppable.remove(page)

    def _enter_policy(self, page: Page) -> None:
        if page.locks:
            return
        if page.holds:
            self.held.insert(page, page.priority)
        elif page.node is not None:
            self.droppable.insert(page, page.priority)
        else:
            self.release_slot(page)

    def lock(self, page: Page) -> None:
        if not page.locks:
            self._leave_policy(page)
        page.locks += 1

    def unlock(self, page: Page) -> None:
        page.locks -= 1
        if not page.locks:
            self._enter_policy(page)

    def hold(self, page: Page) -> None:
        if not page.locks:
            self._leave_policy(page)
        page.holds += 1
        if not page.locks:
            self._enter_policy(page)

    def unhold(self, page: Page) -> None:
        if not page.locks:
            self._leave_policy(page)
        page.holds -= 1
        if not page.locks:
            self._enter_policy(page)

    def lock_to_hold(self, page: Page) -> None:
        """A suspending owner: one lock becomes one hold."""
        page.locks -= 1
        page.holds += 1
        if not page.locks:
            self._enter_policy(page)

    def hold_to_lock(self, page: Page) -> None:
        """A resuming owner: one hold becomes one lock."""
        if not page.locks:
            self._leave_policy(page)
        page.holds -= 1
        page.locks += 1

    def publish(self, page: Page, node: Any) -> None:
        """Mark a referenced page committed (it will be droppable once released)."""
        page.node = node

    def unpublish(self, page: Page) -> None:
        """Detach a page from the tree; an unreferenced one is freed."""
        if not page.locks and not page.holds and page.node is not None:
            self.droppable.remove(page)
            page.node = None
            self.release_slot(page)
        else:
            page.node = None

    def touch(self, page: Page) -> None:
        if not page.locks:
            if page.holds:
                self.held.touch(page)
            elif page.node is not None:
                self.droppable.touch(page)

    def statistics(self, into: StorageStatistics) -> None:
        # Read each count once, so a reader on another thread gets a consistent snapshot
        # of this store (free + evictable + unavailable == total) while it changes.
        total = self.num_slots
        free = len(self.free)
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
