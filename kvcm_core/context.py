"""What every :class:`~kvcm_core.cache.KVCache` of a manager shares: built once by the
manager, so that a cache needs neither the manager nor its private state."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import attrs

from kvcm_core.config import KVCacheManagerConfig
from kvcm_core.kinds import LifeCycleKind
from kvcm_core.levels import Levels
from kvcm_core.lifecycle import LifeCycle
from kvcm_core.radix import PrefixTree
from kvcm_core.threads import ThreadGuard

__all__ = ["CacheContext"]


@attrs.frozen(kw_only=True)
class CacheContext:
    """The shared parts of a manager's caches.

    Attributes:
        config: the manager configuration.
        levels: the levels room (stores, moves, statistics, events).
        tree: the prefix tree.
        life_cycles, kinds: per cache group, its life cycle and its kind's behaviour.
        attn_groups, ssm_groups, windowed_groups, publish_groups: cache groups by role.
        history_tables: groups whose page table moves with history (windowed, SSM).
        publishes_anything: some life cycle publishes (else no tree is used at all).
        scratch_scales: SWA scratch groups -> scale of each pool of their pool group.
        scratch_max_blocks: SWA scratch groups -> most scratch blocks their slots hold.
        on_close: called with a cache once it closed (the manager forgets it).
        owner: the manager (returned by ``cache.manager``).
        thread: the manager's thread guard (``thread.check()`` opens every mutating call).
        remote: the manager's shared remote level (``committed`` is told of every block a
            commit publishes), or None.
        open_roots: in a model whose attention groups publish no page (SSM states only),
            the open caches per scope root: a closing cache removes the page-less nodes
            of its chain only when no other open cache may be building on them.
    """

    config: KVCacheManagerConfig
    levels: Levels
    tree: PrefixTree
    life_cycles: Sequence[LifeCycle]
    kinds: Sequence[LifeCycleKind]
    attn_groups: Sequence[int]
    ssm_groups: Sequence[int]
    windowed_groups: Sequence[int]
    publish_groups: Sequence[int]
    history_tables: Sequence[int]
    publishes_anything: bool
    scratch_scales: dict[int, tuple[int, ...]]
    scratch_max_blocks: dict[int, int]
    on_close: Callable[[Any], None]
    owner: Any
    thread: ThreadGuard
    remote: Any = None
    open_roots: dict[bytes, int] = attrs.field(factory=dict)

    @property
    def tpb(self) -> int:
        return self.config.tokens_per_block

    @property
    def scratch_groups(self) -> list[int]:
        return sorted(self.scratch_scales)
