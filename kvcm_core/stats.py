"""Per-request and per-iteration counters."""

from __future__ import annotations

import attrs

__all__ = ["GroupIterationStats", "IterationStats", "RequestStats"]


@attrs.define
class RequestStats:
    """Counters of one request, in blocks (summed over life cycles).

    Attributes:
        allocated_blocks: pages the request holds or has held (reused + newly allocated).
        newly_allocated_blocks: pages allocated for it (fresh or copies).
        reused_blocks: pages taken from the prefix tree at creation.
        missed_blocks: prompt blocks that had to be computed (not reused).
    """

    allocated_blocks: int = 0
    newly_allocated_blocks: int = 0
    reused_blocks: int = 0
    missed_blocks: int = 0


@attrs.define
class GroupIterationStats:
    """Counters of one life cycle since the last reset."""

    reused_full_blocks: int = 0
    reused_partial_blocks: int = 0
    missed_blocks: int = 0
    onboard_blocks: int = 0
    onboard_bytes: int = 0
    offload_blocks: int = 0
    offload_bytes: int = 0
    intra_device_copies: int = 0
    dropped_before_reuse: int = 0
    dropped_blocks: int = 0
    rebased_blocks: int = 0


@attrs.define
class IterationStats:
    """Counters since the last :meth:`KVCacheManager.get_and_reset_iteration_stats`.

    Attributes:
        groups: per cache group.
        reused_blocks_by_level: blocks reused from each level (index = level).
        lookups: prefix lookups (``create_kv_cache`` calls with tokens).
        lookup_tokens: tokens looked up; ``hit_tokens``: tokens reused.
        io_failures: storage transfers that failed (their pages stayed or were dropped).
        corrupt_pages: cold pages whose frame failed its check on a read (dropped from
            the prefix tree with everything below them, and recomputed by whoever needs
            them).
        remote_blocks: blocks ``create_kv_cache`` pulled from the shared remote level
            into a local level (docs/remote.md).
    """

    groups: list[GroupIterationStats]
    reused_blocks_by_level: list[int]
    lookups: int = 0
    lookup_tokens: int = 0
    hit_tokens: int = 0
    io_failures: int = 0
    corrupt_pages: int = 0
    remote_blocks: int = 0

    @classmethod
    def empty(cls, num_groups: int, num_levels: int) -> IterationStats:
        return cls([GroupIterationStats() for _ in range(num_groups)], [0] * num_levels)
