"""The KV-cache manager: the public entry point that wires the parts together.

It builds the life-cycle registry, the storage layout, the tiers and codec, the prefix
tree and the :class:`~kvcm_core.levels.Levels` room, and hands every
:class:`~kvcm_core.cache.KVCache` a :class:`~kvcm_core.context.CacheContext` of them. One
scheduler thread drives a manager (not thread safe by design: it is on the engine's
per-step path); several managers may live in one process. Statistics may be read from
other threads.
"""

from __future__ import annotations

import contextlib
import itertools
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from kvcm_core.backend import KernelBackend, Stream
from kvcm_core.cache import CacheStatus, KVCache
from kvcm_core.codec import PageCodec
from kvcm_core.config import KVCacheManagerConfig
from kvcm_core.context import CacheContext
from kvcm_core.errors import (
    ArgumentTypeError,
    ConfigError,
    InvalidArgumentError,
    InvalidStateError,
    OutOfPagesError,
)
from kvcm_core.frame import level_frames
from kvcm_core.kinds import make_kind
from kvcm_core.layout import StorageLayout
from kvcm_core.levels import Levels, release_dropped
from kvcm_core.lifecycle import LifeCycleRegistry
from kvcm_core.manager_layout import LayoutQueries
from kvcm_core.matching import Match, match_prefix
from kvcm_core.plugins import KvcmPluginManager, get_plugin_manager, make_tier
from kvcm_core.radix import PrefixTree, check_token_array, scope_root_key
from kvcm_core.records import CodecKind, CodecSpec, Medium
from kvcm_core.remote import RemoteLevel, RemoteStatistics, build_remote, split_keyed_level
from kvcm_core.scratch import max_scratch_blocks, validate_scratch_layout
from kvcm_core.sparse.storage import check_sparse_backend, level0_slots
from kvcm_core.stats import IterationStats
from kvcm_core.storage import StorageStatistics
from kvcm_core.threads import ThreadGuard
from kvcm_core.tier import Tier
from kvcm_core.types import ReuseScope
from kvcm_core.units import parse_size

__all__ = ["MAX_SLOTS", "KVCacheManager"]

#: The most slots one pool group of a level may have: page indices are int32.
MAX_SLOTS = 2**31 - 1


_DEFAULT_SCOPE = ReuseScope()  # frozen: one instance serves every scope=None call
_DEFAULT_ROOT = scope_root_key(_DEFAULT_SCOPE)


class KVCacheManager(LayoutQueries):
    """Manages the paged KV cache of every running request.

    Args:
        config: the configuration (see :class:`~kvcm_core.KVCacheManagerConfig`).
        plugin_manager: where plugins are looked up (default: the process-wide one).
    """

    def __init__(
        self, config: KVCacheManagerConfig, *, plugin_manager: KvcmPluginManager | None = None
    ) -> None:
        if not isinstance(config, KVCacheManagerConfig):
            raise ConfigError("config", type(config).__name__, "must be a KVCacheManagerConfig")
        pm = plugin_manager or get_plugin_manager()
        #: The configuration as given; :attr:`config` holds the manager's own levels (a
        #: keyed level, the last one, is :attr:`remote`: see docs/remote.md).
        self.given_config = config
        config, keyed = split_keyed_level(config, pm)
        self.config = config
        self.tokens_per_block = config.tokens_per_block
        backend_spec = pm.select_kernel_backend(config.kernel_backend)
        self.kernel_backend: str = backend_spec.name
        self.registry = LifeCycleRegistry(config)
        self.layout = StorageLayout(self.registry)
        # SWA scratch (kvcm_core.scratch): group -> scale of each pool of its pool group,
        # and the most scratch blocks max_scratch_slots hold.
        scratch_scales = validate_scratch_layout(config, self.registry, self.layout)
        sc = config.swa_scratch
        scratch_max = {
            g: max_scratch_blocks(sc.max_scratch_slots, sc.scratch_pages_per_block, scales)
            for g, scales in scratch_scales.items()
        } if sc is not None else {}
        self.life_cycles = self.registry.life_cycles
        policy_spec = pm.eviction_policy(config.eviction_policy)
        lcs = self.life_cycles
        tpb = self.tokens_per_block
        self.tree = PrefixTree(len(lcs), tpb)
        # Built last, just before the tiers: a rule broken above leaves nothing to release.
        self.backend: KernelBackend = backend_spec.factory({})
        try:
            check_sparse_backend(config, self.backend, backend_spec.name)
        except ConfigError:
            self.backend.close()
            raise
        tiers: list[Tier] = []
        attn = [g for g, lc in enumerate(lcs) if not lc.is_ssm]
        self._walk_groups = [g for g in attn if lcs[g].window is None and lcs[g].constrains]
        #: The shared remote level (a keyed tier), or None.
        self.remote: RemoteLevel | None = None
        try:  # a construction that fails releases what it built (files, threads, memory)
            codecs = self._build_tiers(pm, tiers)
            self.storage_levels = Levels(config, self.layout, lcs, self.backend, tiers,
                                         codecs, lambda: policy_spec.factory({}), self.tree,
                                         pm.event_sinks(config),
                                         level_frames(config, pm, tiers))
            if keyed is not None:
                self.remote = build_remote(
                    pm, keyed, len(config.levels), config, self.storage_levels,
                    self.backend, codecs, self.codec_specs,
                    [g for g in attn if lcs[g].publishes], self._walk_groups)
        except BaseException:
            if hasattr(self, "storage_levels"):  # the remote level failed: pools and all
                with contextlib.suppress(Exception):
                    self.storage_levels.close()
            else:
                for tier in reversed(tiers):
                    with contextlib.suppress(Exception):
                        tier.close()
            with contextlib.suppress(Exception):
                self.backend.close()
            raise
        #: Each level's page codec (None on level 0).
        self.codecs: list[PageCodec | None] = codecs
        self._prune_groups = [g for g, lc in enumerate(lcs)
                              if lc.constrains and g not in self._walk_groups]
        #: The owner thread of this manager and what it made (see :meth:`bind_thread`).
        self.thread_guard = ThreadGuard(config.check_thread)
        self._open: dict[int, KVCache] = {}
        self._ids = itertools.count()
        self._closed = False
        #: Why the last :meth:`resize` returned False; None after a success.
        self.last_refusal: str | None = None
        self._ctx = CacheContext(
            config=config, levels=self.storage_levels, tree=self.tree, life_cycles=lcs,
            kinds=[make_kind(g, lc, tpb) for g, lc in enumerate(lcs)],
            attn_groups=attn, ssm_groups=[g for g, lc in enumerate(lcs) if lc.is_ssm],
            windowed_groups=[g for g, lc in enumerate(lcs) if lc.is_windowed],
            publish_groups=[g for g in attn if lcs[g].publishes],
            history_tables=[g for g, lc in enumerate(lcs) if lc.is_windowed or lc.is_ssm],
            # A model whose every life cycle is PRIVATE publishes nothing: no tree at all.
            publishes_anything=any(lc.publishes for lc in lcs),
            scratch_scales=scratch_scales, scratch_max_blocks=scratch_max,
            on_close=self._forget_cache, owner=self, thread=self.thread_guard,
            remote=self.remote)
        # Collected without shutdown(): threads, files and memory released (not at exit).
        self._finalizer = weakref.finalize(self, release_dropped, self.storage_levels, self.remote)
        self._finalizer.atexit = False

    def _build_tiers(self, pm: KvcmPluginManager, tiers: list[Tier]) -> list[PageCodec | None]:
        """Build each level's tier into ``tiers`` (a failure part way leaves the caller what
        to close); return each level's page codec (None on level 0; a cold level without
        one uses ``raw``; a move between two codecs transcodes: see migration.Mover)."""
        config = self.config
        codecs: list[PageCodec | None] = []
        built: dict[str, PageCodec] = {}
        #: Each level's page codec record (name, ``capabilities.codec_id``); None on level 0.
        self.codec_specs: list[CodecSpec | None] = [None]
        for i, level in enumerate(config.levels):
            spec = pm.tier(level.tier)
            if i == 0 and spec.capabilities.medium is not Medium.DEVICE:
                raise ConfigError(
                    "levels[0].tier", level.tier,
                    f"level 0 must be device memory; this tier's medium is "
                    f"{spec.capabilities.medium.value}")
            codecs.append(None if i == 0 else self._page_codec(pm, i, built))
            tiers.append(make_tier(spec, self.backend, level.options, i))
        return codecs

    def _page_codec(self, pm: KvcmPluginManager, level: int,
                    built: dict[str, PageCodec]) -> PageCodec:
        """Cold level ``level``'s page codec (one instance per name, shared by levels)."""
        name = self.config.levels[level].codec or "raw"
        codec_spec = pm.level_codec(name, f"levels[{level}].codec")  # lists the known
        if codec_spec.capabilities.kind is not CodecKind.PAGE:
            raise ConfigError(f"levels[{level}].codec", codec_spec.name,
                              "must be a page codec (blob codecs are for storage tiers)")
        self.codec_specs.append(codec_spec)
        if name not in built:
            built[name] = codec_spec.factory({})
        return built[name]

    # -- public lookups -------------------------------------------------------------------

    @property
    def levels(self) -> tuple[Any, ...]:
        """The level configurations, warm to cold."""
        return self.config.levels

    @property
    def stores(self) -> list[list[Any]]:
        """Per level, its stores (one per pool group; cold groups below level 0)."""
        return self.storage_levels.stores

    def get_storage_statistics(self, level: int = 0) -> StorageStatistics:
        """Slots of a level: ``free + evictable + unavailable == total``."""
        return self.storage_levels.statistics(self.storage_levels.check_level(level))

    def get_and_reset_iteration_stats(self) -> IterationStats:
        """Counters since the last call; flushes pending events (see :meth:`flush_events`)."""
        self.thread_guard.check()
        self._check_open()
        self.storage_levels.flush_events()
        return self.storage_levels.reset_stats()

    @property
    def event_sink_errors(self) -> dict[str, int]:
        """Per event sink, batches it raised on (and so lost)."""
        return self.storage_levels.event_sink_errors

    def flush_events(self) -> None:
        """Deliver pending events to the sinks (one that raises is counted in
        :attr:`event_sink_errors`, not propagated). InvalidStateError after shutdown()."""
        self.thread_guard.check()
        self._check_open()
        self.storage_levels.flush_events()

    # -- requests -------------------------------------------------------------------------

    def create_kv_cache(
        self,
        scope: ReuseScope | None = None,
        input_tokens: Sequence[Any] | np.ndarray = (),
        id: Any = None,
        priority_callback: Callable[[int], int] | None = None,
    ) -> KVCache:
        """Match the prompt's prefix and return a SUSPENDED cache holding the matched pages.

        Args:
            scope: reuse scope (tenant, adapter); ``None`` is the default scope.
            input_tokens: the tokens whose KV may be reused (usually the prompt less its
                last token, which the engine must compute anyway); a list or an integer
                array (int32 is the cheapest). A list may hold 32-byte multimodal digests,
                one per position (docs/semantics.md, "Multimodal inputs").
            id: an identifier for the request (default: a counter).
            priority_callback: ``block ordinal -> priority (0..100)`` for its pages.
        """
        self.thread_guard.check()
        self._check_open()
        scope = self._check_scope(scope)
        if priority_callback is not None and not callable(priority_callback):
            raise ArgumentTypeError(f"priority_callback={priority_callback!r}: must be a "
                                    "callable (block ordinal -> priority) or None")
        match = self._match(scope, input_tokens)
        held = None
        remote = self.remote
        if remote is not None:  # one round trip for the blocks after the local match
            match, held = remote.extend(scope_root_key(scope), input_tokens, match,
                                        lambda: self._match(scope, input_tokens))
        try:
            cache = KVCache(self._ctx, scope, match, input_tokens,
                            next(self._ids) if id is None else id, priority_callback)
        finally:
            if remote is not None and held is not None:  # the cache holds them now
                remote.release(held)
        self._open[builtins_id(cache)] = cache
        return cache

    def _forget_cache(self, cache: KVCache) -> None:
        self._open.pop(builtins_id(cache), None)

    def probe_reuse(self, scope: ReuseScope | None,
                    tokens: Sequence[int | bytes] | np.ndarray, *, remote: bool = False) -> int:
        """Tokens ``create_kv_cache`` would reuse now, without taking anything.

        Args:
            remote: also ask the shared remote level (one round trip, nothing pulled);
                by default only local levels are looked at (no I/O). See docs/remote.md
                for when the two can differ.
        """
        self.thread_guard.check()
        self._check_open()
        scope = self._check_scope(scope)
        if remote and self.remote is not None:
            return self.remote.probe(scope_root_key(scope), tokens, self._match(scope, tokens),
                                     self.config.reuse_match_backoff,
                                     self.config.enable_partial_reuse)
        return self._match(scope, tokens, probe=True).length

    def get_remote_statistics(self) -> RemoteStatistics:
        """Counters of the shared remote level (docs/remote.md).

        Raises:
            InvalidStateError: the configuration has no keyed level.
        """
        return self._need_remote().statistics()

    def flush_remote(self, timeout_s: float | None = None) -> bool:
        """Wait until the remote level's queued writes were made (or failed); False when
        ``timeout_s`` (seconds >= 0; None or inf: no limit) passed first.

        Raises:
            InvalidStateError: no keyed level (a bad timeout_s: see RemoteLevel.flush).
        """
        return self._need_remote().flush(timeout_s)

    def _need_remote(self) -> RemoteLevel:
        if self.remote is None:
            raise InvalidStateError("this manager has no remote level: no keyed tier "
                                    "(such as 'redis') among config.levels")
        return self.remote

    def _check_scope(self, scope: ReuseScope | None) -> ReuseScope:
        if scope is None:
            return _DEFAULT_SCOPE
        if not isinstance(scope, ReuseScope):
            raise ArgumentTypeError(f"scope={scope!r}: must be a ReuseScope or None")
        return scope

    def _match(self, scope: ReuseScope, tokens: Sequence[Any] | np.ndarray,
               probe: bool = False) -> Match:
        check_token_array(tokens)
        return match_prefix(
            self.tree, _DEFAULT_ROOT if scope is _DEFAULT_SCOPE else scope_root_key(scope),
            tokens, self.tokens_per_block,
            self.life_cycles, walk_groups=self._walk_groups,
            prune_groups=self._prune_groups, partial=self.config.enable_partial_reuse,
            backoff=self.config.reuse_match_backoff, probe=probe)

    def _check_open(self) -> None:
        if self._closed:
            raise InvalidStateError("the manager was shut down")

    @property
    def is_shut_down(self) -> bool:
        return self._closed

    @property
    def open_caches(self) -> list[KVCache]:
        """The caches not closed yet."""
        return list(self._open.values())

    # -- whole-manager operations -------------------------------------------------------------

    @property
    def num_open_caches(self) -> int:
        return len(self._open)

    @property
    def scratch_groups(self) -> list[int]:
        """The SWA scratch cache groups (sorted; empty without ``swa_scratch``)."""
        return list(self._ctx.scratch_groups)

    @property
    def scratch_scales(self) -> dict[int, tuple[int, ...]]:
        """SWA scratch group -> scale of each pool of its pool group (a copy)."""
        return dict(self._ctx.scratch_scales)

    @property
    def scratch_max_blocks(self) -> dict[int, int]:
        """SWA scratch group -> most scratch blocks ``max_scratch_slots`` hold (a copy)."""
        return dict(self._ctx.scratch_max_blocks)

    def clear_reusable_blocks(self) -> None:
        """Drop every reusable (droppable) block. Refused while caches are open."""
        self.thread_guard.check()
        self._check_open()
        if self._open:
            raise InvalidStateError(
                f"clear_reusable_blocks() refused: {len(self._open)} caches are open; close "
                "them first")
        self.storage_levels.clear()

    def bind_thread(self) -> None:
        """Make the calling thread the one that drives this manager and everything it made
        (caches, batches). Until then the first thread that calls a mutating method owns
        them; a mutating call from another thread raises ``InvalidStateError``. An engine
        that builds the manager on one thread and schedules on another calls this once
        from the scheduler thread. A no-op when ``config.check_thread`` is False."""
        self.thread_guard.bind()

    def __enter__(self) -> KVCacheManager:
        return self

    def __exit__(self, *exc_info: object) -> None:
        """``with KVCacheManager(config) as manager:`` closes every cache still open
        (removing it from its :class:`~kvcm_core.batch.Batch` first), then shuts down."""
        if not self._closed:
            for cache in list(self._open.values()):
                cache.__exit__(None, None, None)
        self.shutdown()

    def shutdown(self) -> None:
        """Release every pool, tier and file. Refused while caches are open; idempotent.

        Raises:
            InvalidStateError: caches are open (nothing is released).
            TierIOError: some resource could not be released (a read-only or failing file
                system); the message lists each failure. Everything else is released and
                the manager is shut down all the same: a second call is a no-op.
        """
        if self._closed:
            return
        self.thread_guard.check()
        if self._open:
            raise InvalidStateError(
                f"shutdown() refused: {len(self._open)} caches are open; close them first")
        self._closed = True  # set first: a failure below never leaves it half shut
        self._finalizer.detach()
        try:
            self.storage_levels.removed_at_shutdown()  # queued: close's flush delivers them
            if self.remote is not None:
                self.remote.close()
        finally:
            self.storage_levels.close()

    def resize(self, level: int, quota: int | str) -> bool:
        """Grow or shrink a level's quota while every cache is suspended, moving pages out
        of the released space (into free slots of the level, else down a level). Returns
        False, sizes unchanged, when the pages cannot be placed or a pool cannot take its
        new size (out of memory, a full disk): the reason is in ``last_refusal`` (None
        after a success). Room made before a refusal stays made: cached pages moved down
        (the last level's dropped), with their events and counters (docs/semantics.md).

        Raises:
            InvalidStateError: a cache is active.
            TierIOError: a pool failed to resize and a store already shrunk could not grow
                back (that store keeps its smaller size; the message says which).
            ArgumentTypeError, InvalidArgumentError: a level that is not an int, or that
                the manager does not have among its own (a keyed remote level is sized by
                its store).
            ConfigError: a bad quota.
        """
        self.thread_guard.check()
        self._check_open()
        level = self.storage_levels.check_level(level)  # (a keyed level is not resized)
        quota = parse_size(quota, "quota")
        active = [c.id for c in self._open.values() if c.status is CacheStatus.ACTIVE]
        if active:
            raise InvalidStateError(
                f"manager.resize() needs every cache suspended; active: {active[:8]}")
        if level == 0:
            slots = level0_slots(self.layout, self.config, quota)
        else:
            try:
                slots = self.storage_levels.cold_slots(level, quota)
            except ConfigError:
                raise ConfigError("quota", quota, f"too small for level {level}") from None
        if max(slots) > MAX_SLOTS:  # refused before anything is sized (O(1))
            self.last_refusal = (
                f"resize(level={level}, quota={quota}): {max(slots)} slots in one pool "
                f"group; slot ids are 32-bit page indices (at most {MAX_SLOTS} slots)")
            return False
        L = self.storage_levels
        ok = L.resize_level(level, slots)
        self.last_refusal = None if ok else f"resize(level={level}, quota={quota}): " + (
            L.resize_failure or
            f"the pages in the slots given up cannot be placed (too few free slots left on "
            f"level {level}, and the colder levels cannot take the rest)")
        return ok

    def make_room(self, pages: Mapping[int, int], stream: Stream | None = None) -> bool:
        """Free level-0 slots ahead of the calls that will take them: ``pages[cache
        group]`` new level-0 pages (summed over the cache groups of one pool group, which
        share its slots; :meth:`KVCache.pages_needed` says what a cache will take). The
        pages pushed out go down (or are dropped at the last level) as a ``resume`` or
        ``resize`` would push them, but in one batch per level for all the caches of an
        engine step rather than one per call. Only unlocked pages move: pages of active
        caches stay. A hint: returns whether that many slots are free now. A pool group
        where that much room cannot be made is left as it is (the calls that follow make
        room, refuse or preempt as usual, rather than every unlocked page moving down).

        ``stream``: as for ``resize`` (the engine's stream waits for the copies of pages
        pushed out before new pages written on it reuse their slots).

        Raises:
            ArgumentTypeError: ``pages`` is not a mapping of ints to ints.
            InvalidArgumentError: an unknown cache group or a negative count.
        """
        self.thread_guard.check()
        self._check_open()
        if not isinstance(pages, Mapping):
            raise ArgumentTypeError(f"pages={pages!r}: must be a mapping of cache group "
                                    "to a number of pages")
        L = self.storage_levels
        per_pg: dict[int, int] = {}
        for group, n in pages.items():
            for name, v in (("cache group", group), ("count", n)):
                if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                    raise ArgumentTypeError(f"pages: {name} {v!r} must be an int")
            if not 0 <= group < self.num_cache_groups:
                raise InvalidArgumentError(f"pages: cache group {group} must be in 0.."
                                           f"{self.num_cache_groups - 1}")
            if n < 0:
                raise InvalidArgumentError(f"pages[{group}]={n}: must be >= 0")
            pg = L.pool_group_of(int(group))
            per_pg[pg] = per_pg.get(pg, 0) + int(n)
        ok = True
        L.begin(stream)
        try:
            for pg, n in per_pg.items():
                store = L.stores[0][pg]
                if n <= store.num_free:
                    continue
                if not L.room(store, n):  # all or nothing: the calls that follow decide
                    ok = False
                    continue
                try:
                    L.make_room(store, n)
                except OutOfPagesError:  # a write below failed: what moved stays
                    ok = False
        finally:
            L.end(stream)
        return ok

    def check_invariants(self) -> None:
        """Check internal invariants (tests and debugging): accounting identity per pool
        group, no slot owned twice, queue membership consistent with page states (and
        droppable pages queued at their own priority), tree and pages pointing at each
        other, and every lock or hold one reference of an open cache (its pages, beams,
        pending claims and scratch slots)."""
        caches = list(self._open.values())
        refs = [p for c in caches for p in c.page_ids()]
        refs += [p for c in caches for g in self.scratch_groups for p in c.scratch_page_ids(g)]
        self.storage_levels.check_invariants(refs)


builtins_id = id
