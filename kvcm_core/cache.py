"""KVCache: one request's pages, page tables and lengths.

The three lengths always satisfy ``num_committed_tokens <= history_length <= capacity``.
Semantics kvcm fixes where the spec is silent (documented in docs/semantics.md):

- ``commit(tokens)`` gives the tokens at positions ``[T, T + len(tokens))`` where ``T`` is
  the number of tokens the cache knows (reused prefix plus earlier commits). History
  advances to at least ``T + len(tokens)``, every newly full block is published (unless
  ``stop_committing()`` was called), and pages that became stale are released.
- ``resize(capacity, history_length)`` may also move history (the TRT-LLM style): within
  ``[max(num_committed_tokens, old_capacity - max_rewind_len), old_capacity]``. Moving it
  back rewinds (known tokens past it are forgotten).
- An SSM life cycle has one live state page per request, shown in the page table at block
  ``history_length // tokens_per_block`` (when that block exists).
- The trailing partial block is published when the cache closes.

Pages are page ids of the manager's :class:`~kvcm_core.storage.PageArena` (``-1``: none);
every change of references goes through the :class:`~kvcm_core.levels.Levels` room. The
beams, reuse-decision, publishing and SWA-scratch parts live in mixins of their own
modules.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kvcm_core.backend import Stream
from kvcm_core.cache_base import CacheStatus
from kvcm_core.cache_beams import BeamsMixin
from kvcm_core.cache_publish import PublishMixin
from kvcm_core.cache_resize import ResizeMixin
from kvcm_core.cache_resume import ResumeMixin
from kvcm_core.cache_reuse import ReuseMixin, ReuseStatus
from kvcm_core.cache_scratch import ScratchMixin
from kvcm_core.context import CacheContext
from kvcm_core.errors import InvalidArgumentError, InvalidStateError
from kvcm_core.eviction import check_priority
from kvcm_core.kinds import PageList, page_list, pages_of
from kvcm_core.kinds import page_ids as _arr
from kvcm_core.matching import Match
from kvcm_core.radix import NO_NODE, check_token_array, encode_tokens, scope_root_key
from kvcm_core.stats import RequestStats
from kvcm_core.tokens import TokenLog, encode_token_ids, sliceable
from kvcm_core.types import ReusePolicy, ReuseScope

__all__ = ["CacheStatus", "KVCache", "ReuseStatus"]

_I32 = 1 << 31


def _token_list(tokens: Any) -> list[Any]:
    check_token_array(tokens)
    return list(tokens)


class KVCache(ResumeMixin, ResizeMixin, BeamsMixin, ReuseMixin, PublishMixin, ScratchMixin):
    """The paged KV cache of one request. Made only by
    :meth:`KVCacheManager.create_kv_cache`."""

    def __init__(self, ctx: CacheContext, scope: ReuseScope, match: Match,
                 input_tokens: Sequence[Any] | np.ndarray, cache_id: Any,
                 priority_callback: Callable[[int], int] | None) -> None:
        tpb = ctx.tpb
        L = ctx.levels
        self._ctx = ctx
        self._levels = L
        self._arena = L.arena
        self._tree = ctx.tree
        self._tpb = tpb
        self.id = cache_id
        self.scope = scope
        self._root_key = scope_root_key(scope)
        self._priority_cb = priority_callback
        # commit's decode path applies: no history tables, no stale release, no SSM
        # snapshot at commit, no remote level to tell.
        self._plain_commit = not (ctx.history_tables or ctx.windowed_groups or ctx.ssm_groups
                                  or ctx.remote is not None)
        end = match.length
        self._status = CacheStatus.SUSPENDED
        self._capacity = self._history = self._committed = end
        if match.data is not None and len(match.data) >= 4 * end:
            # The walk encoded them already.
            self._tokens = TokenLog(np.frombuffer(match.data, dtype="<i4", count=end),
                                    len(input_tokens))
        else:
            self._tokens = TokenLog(sliceable(input_tokens)[:end], len(input_tokens))
        self._keys: list[bytes] = list(match.keys)
        self._cursor = match.cursor  # the key cursor after len(self._keys) blocks, or None
        self._nodes: list[int] = match.nodes[: end // tpb].tolist()
        self._published = end // tpb
        self._commit_on = ctx.publishes_anything
        self._version = 0
        ngroups = len(ctx.life_cycles)
        self._table_keys: list[Any] = [None] * ngroups
        self._tables: list[np.ndarray | None] = [None] * ngroups
        self.stats = RequestStats()
        nb = -(-end // tpb)
        self._pages: list[PageList] = [page_list() for _ in range(ngroups)]
        self._ssm: list[int] = [-1] * ngroups
        self._pending: list[tuple[int, int, int]] = []  # (group, block, source page)
        self._init_beams()
        self._released_to = [0] * ngroups
        self._lost = False
        self._init_scratch(ctx)
        stats = L.stats
        stats.lookups += 1 if len(input_tokens) else 0
        stats.lookup_tokens += len(input_tokens)
        stats.hit_tokens += end
        reused = 0
        missed = max(0, -(-len(input_tokens) // tpb) - nb)
        partial_block = end // tpb if end % tpb else -1
        a = self._arena
        # Every attention group's pages are claimed in one Levels.claim, in group order:
        # the same Store.change calls in the same order as one claim per group (a page
        # belongs to one group's stores, so Levels.change's batches per store, in
        # first-seen order, are each group's batches in turn; a claim only moves pages
        # between a store's queues, so what the loop reads meanwhile does not change).
        claims: list[np.ndarray] = []
        counted: list[np.ndarray] = []  # claimed pages of the groups counted now
        for g in ctx.attn_groups:
            kind = ctx.kinds[g]
            self._released_to[g] = kind.stale_range(end)[1]
            pages_g = kind.claim(self._tree, match.nodes, end)
            # The pages offered, in block order, holes (-1: stale or absent) left out: one
            # copy and one argmin (a PageList's items are read one object at a time).
            claimed = _arr(pages_g)
            if len(claimed) and claimed[claimed.argmin()] < 0:
                claimed = claimed[claimed >= 0]
            nfull = len(claimed)
            if partial_block >= 0 and pages_g[partial_block] >= 0:
                # A partial block is never shared writable: copied at the first resume. It
                # is the last block of the match, so its page is claimed last, as the
                # copy source.
                self._pending.append((g, partial_block, pages_g[partial_block]))
                pages_g[partial_block] = -1
                nfull -= 1
            if len(claimed):
                claims.append(claimed)
            if kind.lc.policy is not ReusePolicy.OPTIONAL:  # OPTIONAL: counted once chosen
                if len(claimed):
                    counted.append(claimed)
                gs = stats.groups[g]
                gs.reused_full_blocks += nfull
                gs.reused_partial_blocks += len(claimed) - nfull
                reused += len(claimed)
                gs.missed_blocks += missed
            self._pages[g] = pages_g
        if claims:
            everything = claims[0] if len(claims) == 1 else np.concatenate(claims)
            L.claim(everything)
            a.reused[everything] = True
        if counted:  # the count by level, for all those groups at once
            self._count_by_level(counted[0] if len(counted) == 1 else np.concatenate(counted))
        for g in ctx.ssm_groups:
            snap = ctx.kinds[g].claim(self._tree, match.nodes, end)
            if snap:
                L.change(_arr(snap), 0, 1)
                a.reused[snap[0]] = True
                self._pending.append((g, -1, snap[0]))
                if ctx.life_cycles[g].policy is not ReusePolicy.OPTIONAL:
                    self._count_reuse(g, _arr(snap), 1)
                    reused += 1
        self._init_reuse(end)
        self.stats.reused_blocks = reused
        self.stats.allocated_blocks = reused
        self.stats.missed_blocks = missed
        if not ctx.publish_groups:  # (see _collect_bare_tail)
            ctx.open_roots[self._root_key] = ctx.open_roots.get(self._root_key, 0) + 1

    def _count_reuse(self, g: int, claimed: np.ndarray, nfull: int) -> None:
        stats = self._levels.stats
        if len(claimed):
            self._count_by_level(claimed)
        stats.groups[g].reused_full_blocks += nfull
        stats.groups[g].reused_partial_blocks += len(claimed) - nfull

    def _count_by_level(self, claimed: np.ndarray) -> None:
        """Reused blocks by the level they were found on (``claimed``: not empty)."""
        counts = self._levels.stats.reused_blocks_by_level
        by_level = np.bincount(self._arena.level[claimed], minlength=len(counts))
        for lv, n in enumerate(by_level.tolist()):
            counts[lv] += n

    # -- properties ---------------------------------------------------------------------------

    @property
    def status(self) -> CacheStatus:
        return self._status

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def history_length(self) -> int:
        return self._history

    @property
    def num_committed_tokens(self) -> int:
        return self._committed

    @property
    def num_blocks(self) -> int:
        return -(-self._capacity // self._tpb)

    @property
    def page_table_version(self) -> int:
        """Changes whenever any page table of this cache changes while it is active (a
        Batch finds dirty rows with it): pages taken, released or replaced, beams, scratch
        ranges, and stale ranges or SSM state blocks moved by history."""
        return self._version

    def _note_history(self, old: int, new: int) -> None:
        """History moved: tables of windowed and SSM groups follow it."""
        for g in self._ctx.history_tables:
            kind = self._ctx.kinds[g]
            if kind.table_key(old) != kind.table_key(new) or (
                    kind.is_ssm and old // self._tpb != new // self._tpb):
                self._changed()
                return

    @property
    def batch_row(self) -> int | None:
        """The row of this cache in its :class:`~kvcm_core.batch.Batch`, or ``None``."""
        return None if self.batch_seat is None else self.batch_seat[1]

    def _require_unseated(self, action: str) -> None:
        if self.batch_seat is not None:
            raise InvalidStateError(
                f"cache {self.id!r} is seated in row {self.batch_seat[1]} of a Batch: "
                f"remove_kv_cache before {action}")

    @property
    def last_refusal(self) -> str | None:
        """Why the last ``resize``, ``resume`` or ``set_beam_width`` returned False (which
        level and pool group ran short, and what holds its slots); None after a success."""
        return self._last_refusal

    def __enter__(self) -> KVCache:
        return self

    def __exit__(self, *exc_info: object) -> None:
        """``with manager.create_kv_cache(...) as cache:`` closes the cache on exit, after
        removing it from the :class:`~kvcm_core.batch.Batch` it is seated in."""
        if self.batch_seat is not None:
            self.batch_seat[0].remove_kv_cache(self)
        self.close()

    @property
    def manager(self) -> Any:
        return self._ctx.owner

    def _require(self, *allowed: CacheStatus) -> None:
        if self._status not in allowed:
            raise InvalidStateError(
                f"cache {self.id!r} is {self._status.name}; this operation needs "
                + " or ".join(s.name for s in allowed))

    def pages(self, group: int, beam: int = 0) -> list[int]:
        """Page ids of one group's blocks (``-1``: none); for tests and debugging."""
        self._check_group(group)
        self._check_beam(beam)
        if self._ctx.kinds[group].is_ssm:
            live = self._ssm[group] if beam == 0 else self._beam_ssm(beam)[group]
            return [live]
        return list(self._pages[group] if beam == 0 else self._beam_pages(beam)[group])

    def page_ids(self) -> list[int]:
        """Every page id the cache references (pending copies included)."""
        out = [p for p in self._all_pages()]
        out.extend(src for _, _, src in self._pending)
        return out

    # -- taking pages ----------------------------------------------------------------------------

    def _priorities(self, blocks: Sequence[int]) -> dict[int, int]:
        """Priorities of new blocks, asked before anything changes (a bad callback fails
        the operation with nothing changed)."""
        if self._priority_cb is None:
            return {}
        return {b: check_priority(self._priority_cb(max(b, 0))) for b in set(blocks)}

    def _new_pages(self, group: int, blocks: Sequence[int],
                   prios: dict[int, int] | None = None) -> Sequence[int]:
        """New level-0 pages of ``group`` for ``blocks``, locked once: a PageList (a
        PageList extends by another with one copy; from a list, an item at a time)."""
        if prios is None:
            prios = self._priorities(blocks)
        if len(blocks) == 1 and not prios:  # the decode step's new block: an int id
            self.stats.allocated_blocks += 1
            self.stats.newly_allocated_blocks += 1
            return [self._levels.take_one(group)]
        pr = np.asarray([prios[b] for b in blocks], dtype=np.int8) if prios else None
        pids = self._levels.take(group, len(blocks), pr)
        n = len(pids)
        self.stats.allocated_blocks += n
        self.stats.newly_allocated_blocks += n
        return pages_of(pids)

    def _all_pages(self) -> list[int]:
        """Every live page reference (a page shared by beams appears once per beam: each
        reference is one lock or hold)."""
        level = self._arena.level
        out = [p for pages_g in self._pages for p in pages_g if p >= 0]
        out.extend(p for p in self._ssm if p >= 0)
        out.extend(self._beam_refs())
        if out:
            arr = _arr(out)
            out = arr[level[arr] >= 0].tolist()
        return out

    def _refs_by_beam(self) -> list[list[int]]:
        """Live page references per beam (ids unique within a beam)."""
        level = self._arena.level
        out = []
        for pages, ssm in self._beam_views():
            refs = [p for pages_g in pages for p in pages_g if p >= 0]
            refs.extend(p for p in ssm if p >= 0)
            if refs:
                arr = _arr(refs)
                refs = arr[level[arr] >= 0].tolist()
            out.append(refs)
        return out

    # -- lifecycle -----------------------------------------------------------------------------

    def suspend(self) -> None:
        """Turn locks into holds (pages may then move to colder levels)."""
        self._ctx.thread.check()
        self._require(CacheStatus.ACTIVE, CacheStatus.SUSPENDED)
        self._require_unseated("suspend()")
        if self._status is CacheStatus.SUSPENDED:
            return
        self._drop_scratch()
        for refs in reversed(self._refs_by_beam()):
            self._levels.change(_arr(refs[::-1]), -1, 1)
        self._status = CacheStatus.SUSPENDED
        self._changed()

    def prefetch(self, level: int = 0, stream: Stream | None = None) -> int:
        """Hint for a suspended cache: bring its pages up to ``level`` (0: the GPU) where
        there is room without pushing held pages down. Returns the pages moved.

        On a GPU backend the copies are only started (on the manager's copy streams, after
        ``stream``'s work queued so far: pass the stream your model runs on, as droppable
        pages that make way may still be being written there; ``None``: the default
        stream); ``stream`` is not made to wait for them: the later ``resume(stream)``
        does, so a scheduler overlaps them with its current step."""
        self._ctx.thread.check()
        self._require(CacheStatus.SUSPENDED, CacheStatus.ACTIVE)
        self._ctx.levels.check_level(level)
        if self._status is CacheStatus.ACTIVE:
            return 0
        a = self._arena
        pages = list(dict.fromkeys(p for p in self._all_pages() if a.level[p] > level))
        if not pages:
            return 0
        self._levels.begin(stream)
        try:
            return self._levels.prefetch(_arr(pages), level)
        finally:
            self._levels.end(stream, wait=False)  # nobody waits here: the next resume does

    def commit(self, tokens: Sequence[Any] | np.ndarray, stream: Stream | None = None) -> None:
        """Give the tokens at positions ``[T, T + len(tokens))`` (``T``: tokens known so
        far); history advances to at least their end and full blocks are published.
        ``stream``: where the KV of these tokens was written (None: the backend's default
        stream); a shared remote level reads the pages of the blocks published here after
        the work queued on it (the host waits for it), an SSM snapshot
        (``commit_min_snapshot``) is copied on it, and a block switched to the tree's
        identical page makes it wait for a copy still bringing that page in."""
        self._ctx.thread.check()
        if self._status is not CacheStatus.ACTIVE:
            self._require(CacheStatus.ACTIVE)
        if (type(tokens) is tuple and len(tokens) == 1 and self._plain_commit
                and type(tokens[0]) is int and -_I32 <= tokens[0] < _I32):
            # The decode step of a model with nothing but full attention and no remote
            # level: what the general path below does for it, without its branches.
            log = self._tokens
            end = log.n + 1
            if end <= self._capacity:
                log.extend_ints(tokens)
                self._unwritten = False
                if end > self._history:
                    self._history = end
                if self._commit_on:
                    tpb = self._tpb
                    full = end // tpb
                    if self._published < full:
                        self._publish_range(self._published, full, stream)
                    if self._published * tpb > self._committed:
                        self._committed = self._published * tpb
                return
        short = False
        if isinstance(tokens, np.ndarray):
            check_token_array(tokens)
            if tokens.dtype != np.int32:
                tokens = np.frombuffer(encode_tokens(tokens)[0], dtype="<i4")  # range check
        else:
            if not isinstance(tokens, list | tuple):  # (a deque...: checked as a list)
                tokens = _token_list(tokens)
            # Refuse bad tokens before anything changes (a cheap check for decode steps).
            if len(tokens) == 1 and type(tokens[0]) is int and -_I32 <= tokens[0] < _I32:
                short = True  # the decode step
            elif len(tokens) > 4 or not all(type(t) is int and -_I32 <= t < _I32
                                            for t in tokens):
                data, mm = encode_token_ids(tokens)
                if not mm:  # checked and encoded once: the log copies the array
                    tokens = np.frombuffer(data, dtype="<i4")
            else:
                short = True
        known = self._tokens.n
        end = known + len(tokens)
        if end > self._capacity:
            raise InvalidArgumentError(
                f"commit of {len(tokens)} tokens after {known} known ends at {end}, past "
                f"capacity {self._capacity}")
        if short:
            self._tokens.extend_ints(tokens)  # type: ignore[arg-type]  # checked ints
        else:
            self._tokens.extend(tokens)
        self._unwritten = False  # the step that wrote the recomputed pages is committed
        moved = end > self._history
        if moved:
            if self._ctx.history_tables:
                self._note_history(self._history, end)
            self._history = end
        tpb = self._tpb
        published = self._published
        if self._commit_on:
            full = end // tpb
            ctx = self._ctx
            if self._published < full:
                b0 = self._published
                self._publish_range(b0, full, stream)
                if ctx.remote is not None and self._published > b0:
                    ctx.remote.committed(self._root_key, self._nodes[b0 : self._published],
                                         stream)
            if self._published * tpb > self._committed:
                self._committed = self._published * tpb
            if (ctx.config.commit_min_snapshot and ctx.ssm_groups and end % tpb == 0
                    and end == self._history and self._published == end // tpb and end):
                nid = self._parent_node(end // tpb)  # (ours while its key names it)
                if nid != NO_NODE:
                    self._snapshot(nid, stream)
        if self._ctx.windowed_groups and (moved or self._published > published):
            self._release_stale(moved)  # (published: window pages a resize kept for it)

    def stop_committing(self) -> None:
        """Publish nothing more from this cache (e.g. after a rewind it cannot redo)."""
        self._ctx.thread.check()
        self._require(CacheStatus.ACTIVE, CacheStatus.SUSPENDED)
        if self._commit_on:
            self._commit_on = False
            self._collect_bare_tail()
            if self._status is CacheStatus.ACTIVE and self._ctx.windowed_groups:
                self._release_stale(moved=False)  # stale pages kept for a commit: none now

    def close(self) -> None:
        """Release every page; committed ones stay reusable until evicted. Idempotent."""
        ctx = self._ctx
        ctx.thread.check()
        status = self._status
        if status is CacheStatus.CLOSED:
            return
        if self.batch_seat is not None:
            self._require_unseated("close()")
        L = self._levels
        # Earlier closes' releases into the eviction policy when enough wait: first, so
        # that a policy refusing the insert leaves this close undone (and safe to retry).
        L.flush_due_releases()
        # (Each step below is skipped when it has nothing to do: a close is on every
        # request's path, and its fixed cost weighs as much as its per-block one.)
        if self._commit_on and self._tokens.n <= self._history and not self._unwritten:
            if self._tokens.n % self._tpb or ctx.ssm_groups:  # a tail or a state
                self._publish_at_close()
            else:
                self._demote_leaf()
        active = status is CacheStatus.ACTIVE
        if self._scratch_slots or self._scratch_live or self._beams or self._pending:
            self._close_extras()
        # Deepest block first, every group of a block together: the LRU order then evicts
        # a chain from its tail, and no group's pages of a block age apart from the others.
        groups = ctx.attn_groups
        if len(groups) == 1 and not ctx.ssm_groups:  # one attention group: the usual model
            g = groups[0]
            pages_g = self._pages[g]
            if pages_g:
                pids = np.array(pages_g, dtype=np.int64)[::-1]  # (a copy: see _arr)
                if pids[pids.argmin()] < 0:  # a hole (-1): cheaper than a scan of the list
                    pids = pids[pids >= 0]
                if len(pids) and active:  # locked pages are on the GPU: one store
                    L.gpu_store(g).unlock_all(pids)
                elif len(pids):
                    L.change(pids, 0, -1)
                self._pages[g] = page_list()
        else:
            if len(groups) == 1:
                order = self._pages[groups[0]][::-1]
            else:
                depth = max((len(self._pages[g]) for g in groups), default=0)
                order = [self._pages[g][b] for b in range(depth - 1, -1, -1) for g in groups
                         if b < len(self._pages[g])]
            if ctx.ssm_groups:
                order.extend(self._ssm[g] for g in ctx.ssm_groups)
            pids = _arr(order)
            if -1 in order:
                pids = pids[pids >= 0]
            if len(pids):
                if active:
                    L.release_locked(pids)
                else:
                    L.change(pids, 0, -1)
            for g in groups:
                self._pages[g] = page_list()
            self._ssm = [-1] * len(self._ssm)
        self._status = CacheStatus.CLOSED
        self._version += 1  # (_changed for a cache in no batch, which it is: see above)
        if not ctx.publish_groups:
            left = ctx.open_roots[self._root_key] - 1
            if left:
                ctx.open_roots[self._root_key] = left
            else:
                del ctx.open_roots[self._root_key]
        ctx.on_close(self)

    def _close_extras(self) -> None:
        """What a close releases besides the blocks' pages: scratch slots, extra beams,
        and a pending partial block's copy source (a close before the first resume). The
        source lies below every block held, so it goes first (before the blocks, deepest
        first: see close)."""
        if self._scratch_slots or self._scratch_live:
            self._drop_scratch()
        if self._beams:
            self._release_beams()
        if self._pending:
            self._levels.change(_arr([src for _, _, src in self._pending]), 0, -1)
            self._pending.clear()

    # -- page tables ---------------------------------------------------------------------------

    def get_base_page_indices(self, group: int, beam: int = 0) -> np.ndarray:
        """Slot ids of this cache's blocks for one cache group (read-only int32 array of
        ``num_blocks``); ``BAD_PAGE_INDEX`` for absent or stale blocks."""
        self._ctx.thread.check()
        ctx = self._ctx
        if self._status is CacheStatus.CLOSED:
            self._require(CacheStatus.ACTIVE, CacheStatus.SUSPENDED)
        if type(group) is not int or not 0 <= group < len(ctx.life_cycles):
            self._check_group(group)
        if type(beam) is not int or beam:  # (False and 0.0 are no beam ids)
            self._check_beam(beam)
            if beam:
                return self._beam_table(int(group), int(beam))
        nb = (self._capacity + self._tpb - 1) // self._tpb
        kind = ctx.kinds[group]
        key = (self._version, self._levels.epoch, nb, kind.table_key(self._history))
        if self._table_keys[group] == key:
            return self._tables[group]  # type: ignore[return-value]
        table = self._table(group, self._pages[group], self._ssm[group], nb)
        self._tables[group] = table
        self._table_keys[group] = key
        return table

    def _table(self, group: int, pages: list[int], live: int, nb: int) -> np.ndarray:
        kind = self._ctx.kinds[group]
        if kind.is_ssm:
            table = kind.state_table(live, self._history, nb, self._arena)  # type: ignore[attr-defined]
        else:
            table = kind.table(pages, self._history, nb, self._arena)
        table.flags.writeable = False
        return table

    def __repr__(self) -> str:
        return (f"KVCache(id={self.id!r}, {self._status.name}, committed={self._committed}, "
                f"history={self._history}, capacity={self._capacity})")
