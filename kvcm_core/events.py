"""Events for KV-aware routers: blocks stored, removed, and moved between levels.

Their content follows the block-stored / block-removed event schemas routers already read
(block hashes as hex digests, parent hash, token ids, medium), plus the cache group and the
level, and a moved event of kvcm's own.
"""

from __future__ import annotations

import abc
import enum
from collections.abc import Sequence

import attrs

__all__ = ["BlockEvent", "EventKind", "EventSink"]


class EventKind(enum.Enum):
    STORED = "stored"
    REMOVED = "removed"
    MOVED = "moved"


@attrs.frozen(kw_only=True)
class BlockEvent:
    """One block event.

    Attributes:
        kind: stored, removed or moved.
        block_key: the block's key (hex SHA-256 of the scope root and the block's whole
            prefix: docs/semantics.md, "Block keys").
        parent_key: the parent block's key (hex); ``None`` for a chain's first block
            (its parent is the scope root, which is no block: docs/semantics.md, "Block
            events").
        group: cache group (life cycle) id.
        level: level the block is now on (moved/stored) or was removed from.
        medium: that level's backing medium (``"device"``, ``"host"``, ``"file"``...).
        from_level: for moved events, the level it left.
        token_ids: the block's tokens (stored events only).
    """

    kind: EventKind
    block_key: str
    parent_key: str | None
    group: int
    level: int
    medium: str
    from_level: int | None = None
    token_ids: tuple[int, ...] = ()


class EventSink(abc.ABC):
    """Receives batches of events. Must return quickly: it is called on the manager's
    thread. A slow sink should queue (bounded) and drop with a counter."""

    @abc.abstractmethod
    def on_events(self, events: Sequence[BlockEvent]) -> None: ...
