"""What the parts of a :class:`~kvcm_core.cache.KVCache` share: the state every mixin
reads and the methods they call on each other (declared for the type checker; the
implementations live in the mixin that owns each)."""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from kvcm_core.errors import ArgumentTypeError, InvalidArgumentError

if TYPE_CHECKING:
    from kvcm_core.context import CacheContext
    from kvcm_core.kinds import PageList
    from kvcm_core.levels import Levels
    from kvcm_core.radix import PrefixTree
    from kvcm_core.storage import PageArena
    from kvcm_core.tokens import TokenLog

__all__ = ["CacheBase", "CacheStatus"]


class CacheStatus(enum.Enum):
    ACTIVE = "active"
    SUSPENDED = "suspended"
    CLOSED = "closed"


class CacheBase:
    """The shared state of a cache (set by ``KVCache.__init__``)."""

    id: Any
    _ctx: CacheContext
    _levels: Levels
    _arena: PageArena
    _tree: PrefixTree
    _tpb: int
    _status: CacheStatus
    _capacity: int
    _history: int
    _committed: int
    _version: int
    _tokens: TokenLog
    _keys: list[bytes]
    #: Where the block-key rule stands after ``len(_keys)`` blocks (kvcm_core/radix.py:
    #: the running hash, the last key once chained, or None: rebuilt when needed).
    _cursor: Any
    _nodes: list[int]
    _published: int
    _commit_on: bool
    _root_key: bytes
    _priority_cb: Any
    _pages: list[PageList]  # per group (kvcm_core.kinds.PageList)
    _ssm: list[int]
    _pending: list[tuple[int, int, int]]
    _released_to: list[int]
    _lost: bool
    _beams: list[Any]
    _reuse_status: dict[int, Any]
    _optional_decided: bool
    _selected: set[int]
    _first_resume_done: bool
    _recompute: dict[int, list[int]]
    #: Pages were handed out to be recomputed and no commit has followed yet: until one
    #: does, they may hold nothing, and close publishes none of this cache's pages.
    _unwritten: bool
    _scratch_free_path: bool
    _scratch_live: bool
    #: Why the last ``resize``/``resume`` returned False (None after a success); set on
    #: the instance only by a call (the class default serves until then).
    _last_refusal: str | None = None

    #: ``(batch, row)`` while seated in a :class:`~kvcm_core.batch.Batch` (set by the batch
    #: only), else ``None``.
    batch_seat: tuple[Any, int] | None = None

    def _changed(self) -> None:
        """A page table of this cache changed: a new ``page_table_version``, and the
        cache's batch row (when seated) is marked dirty."""
        self._version += 1
        seat = self.batch_seat
        if seat is not None:
            seat[0].mark_dirty(seat[1])

    def _fenced(self, stream: Any, call: Callable[..., bool], *args: Any) -> bool:
        """``call(*args)`` (a resize, resume or beam change) between the levels'
        ``begin(stream)`` and ``end(stream)`` when fences are on. An error is no refusal:
        the last refusal's reason stands (``last_refusal`` is kept)."""
        L = self._levels
        prev = self._last_refusal
        try:
            if not L.mover.fences.enabled:
                return call(*args)
            L.begin(stream)
            try:
                return call(*args)
            finally:
                L.end(stream)
        except BaseException:
            self._last_refusal = prev
            raise

    def _unlock(self, pids: np.ndarray) -> None:
        """Drop this cache's lock on ``pids`` (the pages may then be evicted or reused).
        When seated in a Batch, kernels fenced by ``record_read`` finish first: they may
        still read these pages through the last published table."""
        self._wait_readers()
        self._levels.change(pids, -1, 0)

    def _wait_readers(self) -> None:
        """When seated in a Batch: wait for the kernels fenced by ``record_read`` (a no-op
        once they are done). Called before a table entry is cleared, so an interrupt
        while waiting changes nothing."""
        seat = self.batch_seat
        if seat is not None:
            seat[0].wait_readers()

    def _check_group(self, group: Any) -> None:
        """Refuse a group argument that is not a cache group id of this model."""
        ngroups = len(self._ctx.life_cycles)
        if isinstance(group, bool) or not isinstance(group, int | np.integer):
            raise ArgumentTypeError(f"group={group!r}: must be an int cache group id")
        if not 0 <= group < ngroups:
            raise InvalidArgumentError(f"group={group!r}: must be a cache group id in "
                                       f"0..{ngroups - 1}")

    def _refuse(self, reason: str) -> bool:
        """Record why a call is refused (``last_refusal``) and return False."""
        self._last_refusal = reason
        return False

    if TYPE_CHECKING:  # implemented by KVCache and its mixins
        stats: Any

        @property
        def num_blocks(self) -> int: ...

        @property
        def beam_width(self) -> int: ...

        def _require(self, *allowed: CacheStatus) -> None: ...
        def _priorities(self, blocks: Sequence[int]) -> dict[int, int]: ...
        def _new_pages(self, group: int, blocks: Sequence[int],
                       prios: dict[int, int] | None = None) -> Sequence[int]: ...
        def _all_pages(self) -> list[int]: ...
        def _refs_by_beam(self) -> list[list[int]]: ...
        def _beam_views(self) -> list[tuple[list[PageList], list[int]]]: ...
        def _grow_beams(self, grow: dict[int, list[int]], prios: dict[int, int]) -> None: ...
        def _unshare_plan(self, history: int, nb_new: int) -> list[tuple[Any, int, int]]: ...
        def _unshare(self, plan: list[tuple[Any, int, int]], history: int,
                     prios: dict[int, int], stream: Any = None) -> None: ...
        def _decide_optional(
            self, selected: Sequence[int] | None) -> list[tuple[int, int, int]]: ...
        def _release_declines(self, declined: list[tuple[int, int, int]],
                              ) -> list[tuple[int, int, int]]: ...
        def _restore_declines(self, declined: list[tuple[int, int, int]],
                              pending: list[tuple[int, int, int]]) -> None: ...
        def _reuse_claims(self) -> list[tuple[int, list[int], int]]: ...
        def _count_optional_reuse(self, claims: list[tuple[int, list[int], int]]) -> None: ...
        def _plan_scratch(self, capacity: int, history: int, nb_new: int,
                          releases: list[tuple[int, int]], grow: dict[int, list[int]],
                          needs: dict[int, int],
                          ) -> dict[int, tuple[int, int, int, int, list[int]]]: ...
        def _apply_scratch(self, plan: dict[int, tuple[int, int, int, int, list[int]]],
                           history: int) -> None: ...
        def _scratch_span(self, g: int, capacity: int, history: int,
                          nb: int) -> tuple[int, int]: ...
        def _scratch_fill(self, g: int, history: int, nb: int,
                          span: tuple[int, int]) -> list[int]: ...
        def _note_recompute(self, g: int, blocks: list[int], history: int) -> None: ...
        def _scratch_pages_needed(self, g: int, capacity: int, nb: int) -> int: ...
        def _note_history(self, old: int, new: int) -> None: ...
        def _scratch_shown(self) -> bool: ...
        def _table(self, group: int, pages: list[int], live: int, nb: int) -> np.ndarray: ...
