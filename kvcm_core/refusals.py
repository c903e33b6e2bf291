"""The reasons behind a ``False`` from :meth:`KVCache.resize` / :meth:`KVCache.resume`
(and :meth:`KVCacheManager.resize`), as the short strings ``last_refusal`` holds.

A refusal is part of normal operation (memory is short right now), so it is a ``False``
return rather than an exception; these texts say which level and pool group ran short,
by how much, and what holds the space, so that an engine developer can tell a full GPU
from a too-small configuration. They are built only when a call is refused, never on the
path of a call that succeeds.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["level_shortage", "over_resume_limit", "room_failed"]


def _state(store: Any) -> str:
    held = len(store.held)
    return (f"{store.num_free} free, {store.num_droppable} evictable, {held} held by "
            f"suspended caches, {store.num_locked} locked by active caches, of "
            f"{store.num_slots}")


def level_shortage(op: str, levels: Any, needs: Mapping[int, int],
                   extra: Mapping[int, int] | None = None) -> str:
    """``op`` needed ``needs[pool group]`` new level-0 slots that level 0 cannot provide
    (``extra``: slots the call would have released first)."""
    for pg, n in sorted(needs.items()):
        store = levels.stores[0][pg]
        more = (extra or {}).get(pg, 0)
        if n > store.num_free + store.num_droppable + more and \
                not levels.room(store, n - more):
            short = n - more - store.num_free - store.num_droppable - len(store.held)
            if short > 0 and len(store.held):  # moving the held pages out would not do
                where = (f"{short} short even with every unlocked page moved out: the "
                         "pages locked by active caches hold the rest")
            else:
                where = ("no colder level can take the held pages" if len(store.held)
                         else "nothing can be moved out")
            return (f"{op}: level 0 pool group {pg} cannot provide {n} more pages "
                    f"({_state(store)}; {where})")
    total = sum(needs.values())
    return f"{op}: level 0 cannot provide {total} more pages"


def over_resume_limit(store: Any, used: int, limit: float) -> str:
    """Resuming would lock more of a level-0 pool group than ``max_util_for_resume``."""
    return (f"resume: level 0 pool group {store.pool_group} would have {used} of "
            f"{store.num_slots} slots locked, over max_util_for_resume={limit} "
            f"({int(limit * store.num_slots)} slots)")


def room_failed(op: str, exc: BaseException) -> str:
    """Making room on level 0 failed (``OutOfPagesError``: nothing could be freed, or a
    write of held pages to a colder level failed)."""
    return f"{op}: could not make room on level 0 ({exc})"
