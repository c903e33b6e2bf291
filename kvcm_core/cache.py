"""KVCache: one request's pages, page tables and lengths (concepts.md §2, §11).

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
  ``history_length // tokens_per_block`` (when that block exists); every other entry is
  ``BAD_PAGE_INDEX``. The model reads the state at ``history`` there and writes the state
  after this step's tokens back in place. Snapshots are published when the cache closes
  (at its final endpoint) and, with ``commit_min_snapshot``, by copy at every commit that
  ends exactly on a block boundary.
- The trailing partial block is published when the cache closes.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import attrs
import numpy as np

from kvcm_core.backend import BAD_PAGE_INDEX, Stream
from kvcm_core.errors import InvalidStateError, OutOfPagesError, TierIOError
from kvcm_core.events import EventKind
from kvcm_core.eviction import check_priority
from kvcm_core.radix import Node, block_keys, encode_tokens, scope_root_key
from kvcm_core.scratch import ScratchDesc, scratch_slots_needed
from kvcm_core.stats import RequestStats
from kvcm_core.types import ReusePolicy, ReuseScope

if TYPE_CHECKING:
    from kvcm_core.manager import KVCacheManager
    from kvcm_core.matching import Match
    from kvcm_core.storage import Page

__all__ = ["CacheStatus", "KVCache", "ReuseStatus"]


@attrs.frozen
class ReuseStatus:
    """What the prefix match offers one non-REQUIRED cache group (concepts.md §4).

    Attributes:
        policy: the group's reuse policy.
        complete: every page needed at the endpoint is available.
        endpoint: tokens the claim reuses up to (the match length).
        coverage: ``[begin, end)`` token ranges the claimed pages provide.
    """

    policy: ReusePolicy
    complete: bool
    endpoint: int
    coverage: tuple[tuple[int, int], ...]


@attrs.define(eq=False)
class _Beam:
    """Pages of one extra beam: shared with beam 0 below the fork, its own from there."""

    fork: int  # history at the fork: positions below were written by beam 0
    pages: list[list[Any]]  # per cache group, per block
    ssm: list[Any]  # per cache group: the beam's live SSM state


class CacheStatus(enum.Enum):
    ACTIVE = "active"
    SUSPENDED = "suspended"
    CLOSED = "closed"


_I32 = 1 << 31
_NO_STALE = (0, 0)


def _check_count(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 0:
        raise ValueError(f"{name}={value!r}: must be an int >= 0")
    return int(value)


class KVCache:
    """The paged KV cache of one request. Made only by
    :meth:`KVCacheManager.create_kv_cache`."""

    def __init__(
        self,
        manager: KVCacheManager,
        scope: ReuseScope,
        match: Match,
        input_tokens: Sequence[Any] | np.ndarray,
        cache_id: Any,
        priority_callback: Callable[[int], int] | None,
    ) -> None:
        m = manager
        tpb = m.tokens_per_block
        self._m = m
        self._tpb = tpb
        self.id = cache_id
        self.scope = scope
        self._root_key = scope_root_key(scope)
        self._priority_cb = priority_callback
        end = match.length
        self._status = CacheStatus.SUSPENDED
        self._capacity = self._history = self._committed = end
        self._tokens: list[Any] = list(input_tokens[:end])
        self._keys: list[bytes] = list(match.keys)
        self._nodes: list[Node] = list(match.nodes[: end // tpb])
        self._published = end // tpb
        self._commit_on = m._publishes_anything
        self._version = 0
        self._table_keys: list[Any] = [None] * len(m.life_cycles)
        self._tables: list[np.ndarray | None] = [None] * len(m.life_cycles)
        self.stats = RequestStats()
        ngroups = len(m.life_cycles)
        nb = -(-end // tpb)
        self._pages: list[list[Page | None]] = [[] for _ in range(ngroups)]
        self._ssm: list[Page | None] = [None] * ngroups
        self._pending: list[tuple[int, int, Page]] = []  # (group, block, source) to copy
        self._beams: list[_Beam] = []  # beams 1.. (beam 0 is self._pages / self._ssm)
        self._released_to = [0] * ngroups
        self._lost = False
        # SWA scratch (kvcm_core.scratch): per group, this cache's scratch slots and the
        # scratch blocks [begin, end) of the current step (live until history moves).
        self._scratch_slots: dict[int, list[Page]] = {}
        self._scratch_range: dict[int, tuple[int, int]] = {}
        self._scratch_live = False
        # False when resize must always take the full path (e.g. SWA scratch bookkeeping).
        self._scratch_free_path = manager.config.swa_scratch is None
        self._m._stats.lookups += 1 if len(input_tokens) else 0
        self._m._stats.lookup_tokens += len(input_tokens)
        self._m._stats.hit_tokens += end
        reused = 0
        partial_block = end // tpb if end % tpb else -1
        nodes = match.nodes
        by_level = m._stats.reused_blocks_by_level
        for g in m._attn_groups:
            lc = m.life_cycles[g]
            start, stop = lc.stale_range(end, tpb)
            self._released_to[g] = stop
            gstats = m._stats.groups[g]
            # Claim every needed page of the match (held until the first resume).
            pages_g: list[Page | None] = [node.pages[g] for node in nodes[:nb]]
            pages_g[start:stop] = [None] * (stop - start)
            src = pages_g[partial_block] if partial_block >= 0 else None
            if src is not None:
                pages_g[partial_block] = None
                self._pending.append((g, partial_block, src))
                claimed = [p for p in pages_g if p is not None]
                claimed.append(src)
                nfull = len(claimed) - 1
            else:
                claimed = [p for p in pages_g if p is not None]
                nfull = len(claimed)
            for page in claimed:
                page.store.hold(page)
                page.reused = True
            if lc.policy is not ReusePolicy.OPTIONAL:  # OPTIONAL: counted once chosen
                for page in claimed:
                    by_level[page.level] += 1
                reused += len(claimed)
                gstats.reused_full_blocks += nfull
                gstats.reused_partial_blocks += len(claimed) - nfull
                gstats.missed_blocks += max(0, -(-len(input_tokens) // tpb) - nb)
            self._pages[g] = pages_g
        for g in m._ssm_groups:
            if end:
                node = match.nodes[(end - 1) // tpb]
                page = node.pages[g]
                # A snapshot serves only the exact endpoint it was taken at.
                if page is not None and node.end(tpb) == end:
                    page.store.hold(page)
                    page.reused = True
                    self._pending.append((g, -1, page))
                    if m.life_cycles[g].policy is not ReusePolicy.OPTIONAL:
                        m._stats.reused_blocks_by_level[page.level] += 1
                        m._stats.groups[g].reused_full_blocks += 1
                        reused += 1
        self._reuse_status: dict[int, ReuseStatus] = {}
        self._optional_decided = False
        self._selected: set[int] = set()
        self._first_resume_done = False
        self._recompute: dict[int, list[int]] = {}
        for g, lc in enumerate(m.life_cycles):
            if lc.policy is not ReusePolicy.REQUIRED:
                self._reuse_status[g] = self._status_of(g, end)
        self.stats.reused_blocks = reused
        self.stats.allocated_blocks = reused
        self.stats.missed_blocks = max(0, -(-len(input_tokens) // tpb) - nb)

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
    def beam_width(self) -> int:
        return 1 + len(self._beams)

    def beam_fork(self, beam: int) -> int:
        """History length when ``beam`` was forked from beam 0 (0 for beam 0): its tokens
        below that position are beam 0's and their KV pages were written by beam 0."""
        self._check_beam(beam)
        return self._beams[beam - 1].fork if beam else 0

    def _check_beam(self, beam: Any) -> None:
        if isinstance(beam, bool) or not isinstance(beam, int | np.integer) or not (
                0 <= beam < self.beam_width):
            raise ValueError(f"beam={beam!r}: must be in 0..{self.beam_width - 1} (beam "
                             f"width {self.beam_width})")

    def _page_lists(self) -> list[list[list[Any]]]:
        """Per beam, the per-group page lists (beam 0 first)."""
        return [self._pages, *(bm.pages for bm in self._beams)]

    def set_beam_width(self, width: int) -> bool:
        """Fork beams from beam 0 (or drop the last ones) for beam search.

        New beams share every full block beam 0 has written (below ``history_length //
        tokens_per_block``), get a private copy of the partial block at ``history_length``
        and of the SSM state, and fresh pages for the blocks after it. Dropping beams
        releases their pages. Only beam 0 publishes to the prefix tree (``commit`` takes
        beam 0's tokens). Returns False, with nothing changed, when level 0 cannot provide
        the pages. SWA scratch pages are not used with beams.
        """
        self._require(CacheStatus.ACTIVE)
        m = self._m
        if isinstance(width, bool) or not isinstance(width, int | np.integer) or not (
                1 <= width <= m.config.max_beam_width):
            raise ValueError(f"width={width!r}: must be in 1..{m.config.max_beam_width} "
                             "(KVCacheManagerConfig.max_beam_width)")
        width = int(width)
        if width < self.beam_width:
            for bm in reversed(self._beams[width - 1:]):
                self._release_beam(bm)
            del self._beams[width - 1:]
            self._version += 1
            return True
        if width == self.beam_width:
            return True
        if m._scratch_groups:
            raise InvalidStateError("beams are not supported together with SWA scratch pages")
        tpb = self._tpb
        hist = self._history
        shared_below = hist // tpb  # full blocks beam 0 has written
        tail = shared_below if hist % tpb else -1
        new = width - self.beam_width
        needs: dict[int, int] = {}
        plan: dict[int, list[int]] = {}
        for g in m._attn_groups:
            own = [b for b, p in enumerate(self._pages[g]) if p is not None
                   and b >= shared_below]
            plan[g] = own
            if own:
                pg = m._gpu_store[g].pool_group
                needs[pg] = needs.get(pg, 0) + new * len(own)
        for g in m._ssm_groups:
            if self._ssm[g] is not None:
                pg = m._gpu_store[g].pool_group
                needs[pg] = needs.get(pg, 0) + new
        prios = self._priorities([b for own in plan.values() for b in own])
        if not m._can_take(needs):
            return False
        for _ in range(new):
            beam = _Beam(hist, [], [None] * len(m.life_cycles))
            for g in range(len(m.life_cycles)):
                base = self._pages[g]
                pages_g: list[Any] = [p if b < shared_below else None
                                      for b, p in enumerate(base)]
                for page in pages_g:
                    if page is not None:
                        page.store.lock(page)
                own = plan.get(g, [])
                if own:
                    fresh = self._new_pages(g, own, prios)
                    for b, page in zip(own, fresh, strict=True):
                        pages_g[b] = page
                    src = base[tail] if tail in own else None
                    copy = pages_g[tail] if tail in own else None
                    if src is not None and copy is not None:
                        m._copy_blocks(g, [(copy.slot, src.slot)])
                beam.pages.append(pages_g)
            for g in m._ssm_groups:
                live = self._ssm[g]
                if live is not None:
                    page = self._new_pages(g, [-1], prios)[0]
                    m._copy_blocks(g, [(page.slot, live.slot)])
                    beam.ssm[g] = page
            self._beams.append(beam)
        self._version += 1
        return True

    def _release_beam(self, beam: _Beam) -> None:
        active = self._status is CacheStatus.ACTIVE
        refs = [p for pages_g in beam.pages for p in reversed(pages_g) if p is not None]
        refs += [p for p in beam.ssm if p is not None]
        for page in refs:
            if page.level < 0:
                continue
            if active:
                page.store.unlock(page)
            else:
                page.store.unhold(page)

    @property
    def batch_row(self) -> int | None:
        return None

    @property
    def reuse_status(self) -> dict[int, ReuseStatus]:
        """Per non-REQUIRED cache group, what the match offers (see :class:`ReuseStatus`)."""
        return dict(self._reuse_status)

    def _status_of(self, g: int, end: int) -> ReuseStatus:
        m = self._m
        lc = m.life_cycles[g]
        tpb = self._tpb
        if lc.is_ssm:
            have = any(grp == g for grp, _, _ in self._pending)
            return ReuseStatus(lc.policy, have or end == 0, end,
                               ((0, end),) if have and end else ())
        start, stop = lc.stale_range(end, tpb)
        pending = {b for grp, b, _ in self._pending if grp == g}
        ranges: list[list[int]] = []
        complete = True
        for b in range(-(-end // tpb)):
            if start <= b < stop:
                continue
            if self._pages[g][b] is None and b not in pending:
                complete = False
                continue
            lo, hi = b * tpb, min(end, (b + 1) * tpb)
            if ranges and ranges[-1][1] == lo:
                ranges[-1][1] = hi
            else:
                ranges.append([lo, hi])
        return ReuseStatus(lc.policy, complete, end, tuple((a, b) for a, b in ranges))

    def recompute_blocks(self, group: int) -> list[int]:
        """Blocks (``-1``: the SSM state) whose pages were given fresh at the first resume
        although history covers them: the engine must recompute or reconstruct them
        (declined OPTIONAL groups, missing SINK_REQUIRED_ONLY window pages, PRIVATE
        state)."""
        return list(self._recompute.get(group, ()))

    @property
    def manager(self) -> KVCacheManager:
        return self._m

    def _require(self, *allowed: CacheStatus) -> None:
        if self._status not in allowed:
            raise InvalidStateError(
                f"cache {self.id!r} is {self._status.name}; this operation needs "
                + " or ".join(s.name for s in allowed)
            )

    # -- lifecycle -----------------------------------------------------------------------------

    def _priority(self, block: int) -> int:
        if self._priority_cb is None:
            return 35
        return check_priority(self._priority_cb(block))

    def _priorities(self, blocks: Sequence[int]) -> dict[int, int]:
        """Priorities of new blocks, asked before anything changes (a bad callback fails
        the operation with nothing changed)."""
        if self._priority_cb is None:
            return {}
        return {b: self._priority(max(b, 0)) for b in set(blocks)}

    def _new_pages(self, group: int, blocks: Sequence[int],
                   prios: dict[int, int] | None = None) -> list[Page]:
        if prios is None:
            prios = self._priorities(blocks)
        pages = self._m._take(group, len(blocks))
        store = self._m._gpu_store[group]
        for page, b in zip(pages, blocks, strict=True):
            store.lock(page)
            if prios:
                page.priority = prios[b]
        n = len(pages)
        self.stats.allocated_blocks += n
        self.stats.newly_allocated_blocks += n
        return pages

    def resume(self, stream: Stream | None = None,
               optional_reuse_groups: Sequence[int] | None = None) -> bool:
        """Bring the cache to the GPU and lock its pages; False (nothing changed) when the
        GPU level is too full (``max_util_for_resume``) or cannot provide the pages."""
        if self._status is CacheStatus.CLOSED:
            self._require(CacheStatus.SUSPENDED)
        if self._status is CacheStatus.ACTIVE:
            return True
        lists = [*self._pages, self._ssm]
        for bm in self._beams:
            lists += [*bm.pages, bm.ssm]
        if (not self._lost and any(
                p is not None and p.level < 0 for pages in lists
                for p in pages)) or any(src.level < 0 for _, _, src in self._pending):
            self._lost = True
        if self._lost:
            raise TierIOError(
                f"cache {self.id!r} lost pages to a storage failure; close it and recompute "
                "(create_kv_cache again: what is still cached will be reused)")
        m = self._m
        tpb = self._tpb
        nb = self.num_blocks
        declined = self._decide_optional(optional_reuse_groups)
        declined_groups = {g for g, _, _ in declined}
        wanted: dict[int, list[int]] = {}
        needs: dict[int, int] = {}
        extra: dict[int, int] = {}
        for _g, _, page in declined:
            if page.level == 0 and page.holds == 1 and not page.locks:
                pg = page.store.pool_group
                extra[pg] = extra.get(pg, 0) + 1
        for g in m._attn_groups:
            start, stop = m.life_cycles[g].stale_range(self._history, tpb)
            drop = g in declined_groups
            blocks = [b for b, p in enumerate(self._pages[g]) if (p is None or drop)
                      and not start <= b < stop and b < nb]
            if blocks:
                wanted[g] = blocks
                pg = m._gpu_store[g].pool_group
                needs[pg] = needs.get(pg, 0) + len(blocks)
        for g in m._ssm_groups:
            if self._ssm[g] is None or g in declined_groups:
                wanted[g] = [-1]
                pg = m._gpu_store[g].pool_group
                needs[pg] = needs.get(pg, 0) + 1
        declined_ids = {id(p) for _, _, p in declined}
        cold = [p for p in self._all_pages() if p.level != 0 and id(p) not in declined_ids]
        for page in {id(p): p for p in cold}.values():  # a page shared by beams moves once
            pg = m._gpu_store[page.group].pool_group
            needs[pg] = needs.get(pg, 0) + 1
        limit = m.config.max_util_for_resume
        mine: dict[int, int] = {}
        for page in self._all_pages():
            if page.level == 0 and id(page) not in declined_ids:
                mine[page.store.pool_group] = mine.get(page.store.pool_group, 0) + 1
        for store in m.stores[0]:
            locked = store.num_slots - store.num_free - len(store.droppable) - len(store.held)
            used = locked + mine.get(store.pool_group, 0) + needs.get(store.pool_group, 0)
            if used > limit * store.num_slots:
                return False
        prios = self._priorities([b for blocks in wanted.values() for b in blocks])
        # Lock what is on the GPU first, so making room cannot push it down.
        warm = [p for p in self._all_pages() if p.level == 0 and id(p) not in declined_ids]
        for page in warm:
            page.store.hold_to_lock(page)
        if not m._can_take(needs, extra):
            for page in reversed(warm):
                page.store.lock_to_hold(page)
            return False
        self._apply_declines(declined)
        try:
            for pg, n in needs.items():
                m._make_room(m.stores[0][pg], n)
        except OutOfPagesError:
            # A write to a colder level failed while making room: give up for now.
            for page in reversed(warm):
                page.store.lock_to_hold(page)
            return False
        fresh: list[Page] = []
        try:
            # Cold pages of ours come back in one batch per source store.
            cold = [p for p in self._all_pages() if p.level != 0]
            m._onboard(list({id(p): p for p in cold}.values()), stream)
            for page in cold:
                page.store.hold_to_lock(page)
            sources = {(g, b): page for g, b, page in self._pending}
            for g, blocks in wanted.items():
                pages = self._new_pages(g, blocks, prios)
                fresh.extend(pages)
                copies = []
                for b, page in zip(blocks, pages, strict=True):
                    src = sources.get((g, b))
                    if src is not None:
                        copies.append((page, src))
                    elif not self._first_resume_done and ((b < 0 and self._history > 0) or
                                                          0 <= b * tpb < self._history):
                        self._recompute.setdefault(g, []).append(b)
                m._fill(g, copies, stream)
                for b, page in zip(blocks, pages, strict=True):
                    if m.life_cycles[g].is_ssm:
                        self._ssm[g] = page
                    else:
                        self._pages[g][b] = page
        except TierIOError:
            self._fail_resume(fresh)
            raise
        for _, _, src in self._pending:
            src.store.unhold(src)
        self._pending.clear()
        self._first_resume_done = True
        self._version += 1
        self._status = CacheStatus.ACTIVE
        return True

    def _decide_optional(self, selected: Sequence[int] | None) -> list[tuple[int, int, Page]]:
        """Validate the OPTIONAL choice; return the claims to give up ``(group, block,
        page)`` (block -1: a pending copy or SSM snapshot). Raises ValueError, with nothing
        changed, for a REQUIRED, unknown or incomplete group."""
        m = self._m
        optional = {g for g, st in self._reuse_status.items()
                    if st.policy is ReusePolicy.OPTIONAL}
        if self._optional_decided:
            if selected is not None and set(selected) != self._selected:
                raise ValueError(
                    f"optional_reuse_groups={list(selected)!r}: the choice was made at the "
                    f"first resume ({sorted(self._selected)}) and cannot change")
            return []
        chosen = set()
        for g in selected or ():
            if isinstance(g, bool) or not isinstance(g, int | np.integer) or not (
                    0 <= g < len(m.life_cycles)):
                raise ValueError(f"optional_reuse_groups: {g!r} is not a cache group id "
                                 f"(0..{len(m.life_cycles) - 1})")
            if g not in optional:
                raise ValueError(
                    f"optional_reuse_groups: group {g} has policy "
                    f"{m.life_cycles[g].policy.name}; only OPTIONAL groups can be chosen "
                    f"(OPTIONAL groups: {sorted(optional)})")
            if not self._reuse_status[g].complete:
                raise ValueError(
                    f"optional_reuse_groups: group {g} is incomplete (coverage "
                    f"{self._reuse_status[g].coverage} of endpoint "
                    f"{self._reuse_status[g].endpoint}); it cannot be reused")
            chosen.add(int(g))
        declined: list[tuple[int, int, Page]] = []
        for g in sorted(optional - chosen):
            for b, page in enumerate(self._pages[g]):
                if page is not None:
                    declined.append((g, b, page))
            declined.extend((grp, -1, p) for grp, _, p in self._pending if grp == g)
        self._selected = chosen
        return declined

    def _apply_declines(self, declined: list[tuple[int, int, Page]]) -> None:
        """Give up declined claims before allocating their replacements; count the chosen
        ones in the statistics (declined groups count nothing)."""
        m = self._m
        if self._optional_decided:
            return
        gone = {id(p) for _, _, p in declined}
        for g, b, page in declined:
            if b >= 0 and self._pages[g][b] is page:
                self._pages[g][b] = None
            page.store.unhold(page)
        self._pending = [(g, b, p) for g, b, p in self._pending if id(p) not in gone]
        for g in self._selected:
            claimed = [p for p in self._pages[g] if p is not None]
            claimed += [p for grp, _, p in self._pending if grp == g]
            m._stats.groups[g].reused_full_blocks += len(claimed)
            self.stats.reused_blocks += len(claimed)
            self.stats.allocated_blocks += len(claimed)
            for p in claimed:
                m._stats.reused_blocks_by_level[p.level] += 1
        self._optional_decided = True

    def _fail_resume(self, fresh: list[Page]) -> None:
        """A read failed during resume: undo the locks, free new pages, and mark the cache
        lost (its data is incomplete: the engine must close it and recompute)."""
        fresh_ids = {id(p) for p in fresh}
        for g in range(len(self._pages)):
            self._pages[g] = [None if p is not None and id(p) in fresh_ids else p
                              for p in self._pages[g]]
        for g in range(len(self._ssm)):
            if self._ssm[g] is not None and id(self._ssm[g]) in fresh_ids:
                self._ssm[g] = None
        for page in fresh:
            page.store.unlock(page)
        for page in self._all_pages():
            if page.level < 0:
                continue  # lost: nothing to give back
            if page.locks and page.store is not None:
                page.store.lock_to_hold(page)
        self._lost = True

    def _all_pages(self) -> list[Page]:
        """Every page reference of the cache (a page shared by beams appears once per
        beam: each reference is one lock or hold)."""
        out = [p for pages_g in self._pages for p in pages_g if p is not None and p.level >= 0]
        out.extend(p for p in self._ssm if p is not None and p.level >= 0)
        for bm in self._beams:
            out.extend(p for pages_g in bm.pages for p in pages_g
                       if p is not None and p.level >= 0)
            out.extend(p for p in bm.ssm if p is not None and p.level >= 0)
        return out

    def suspend(self) -> None:
        """Turn locks into holds (pages may then move to colder levels)."""
        self._require(CacheStatus.ACTIVE, CacheStatus.SUSPENDED)
        if self._status is CacheStatus.SUSPENDED:
            return
        self._drop_scratch()
        for page in reversed(self._all_pages()):
            page.store.lock_to_hold(page)
        self._status = CacheStatus.SUSPENDED
        self._version += 1

    def resize(self, capacity: int, history_length: int | None = None) -> bool:
        """Set this step's capacity (and optionally move history). Returns False, with
        everything unchanged, when level 0 cannot provide the pages."""
        if self._status is not CacheStatus.ACTIVE:
            self._require(CacheStatus.ACTIVE)
        tpb = self._tpb
        if (history_length is None and type(capacity) is int
                and self._history <= capacity
                and (capacity + tpb - 1) // tpb == (self._capacity + tpb - 1) // tpb
                and self._scratch_free_path):
            # The decode fast path: same blocks, same history, nothing to allocate.
            self._capacity = capacity
            return True
        m = self._m
        capacity = _check_count("capacity", capacity)
        if history_length is None:
            history = self._history
        else:
            history = _check_count("history_length", history_length)
            lo = max(self._committed, self._capacity - m.config.max_rewind_len)
            if not lo <= history <= self._capacity:
                raise ValueError(
                    f"history_length={history}: must be in [{lo}, {self._capacity}] "
                    f"(>= num_committed_tokens and old capacity - max_rewind_len, "
                    f"<= old capacity)"
                )
        if capacity < history:
            raise ValueError(f"capacity={capacity}: must be >= history_length ({history})")
        nb_new = -(-capacity // tpb)
        keep = max(0, history - m.config.max_rewind_len)
        releases: list[tuple[int, int]] = []
        grow: dict[int, list[int]] = {}
        needs: dict[int, int] = {}
        extra: dict[int, int] = {}
        for g in m._attn_groups:
            pages_g = self._pages[g]
            old_nb = len(pages_g)
            lc = m.life_cycles[g]
            if lc.window is not None:
                start, stop = lc.stale_range(keep, tpb)
                for b in range(max(start, self._released_to[g]), min(stop, old_nb)):
                    if pages_g[b] is not None:
                        releases.append((g, b))
            for b in range(nb_new, old_nb):
                if pages_g[b] is not None and (g, b) not in releases:
                    releases.append((g, b))
            if nb_new > old_nb:
                grow[g] = list(range(old_nb, nb_new))
                pg = m._gpu_store[g].pool_group
                needs[pg] = needs.get(pg, 0) + nb_new - old_nb
        plan = (self._plan_scratch(capacity, history, nb_new, releases, grow, needs)
                if m._scratch_groups else None)
        if self._beams:  # every beam grows and sheds the same blocks as beam 0
            for g, blocks in grow.items():
                pg = m._gpu_store[g].pool_group
                needs[pg] += len(blocks) * len(self._beams)
        prios = self._priorities([b for blocks in grow.values() for b in blocks])
        if needs:
            for g, b in releases:
                page = self._pages[g][b]
                assert page is not None
                if page.locks == 1 and not page.holds:
                    pg = page.store.pool_group
                    extra[pg] = extra.get(pg, 0) + 1
            for g, (*_, drop, _) in (plan or {}).items():
                if drop:
                    pg = m._gpu_store[g].pool_group
                    extra[pg] = extra.get(pg, 0) + drop
            if not m._can_take(needs, extra):
                return False
            for pg, n in needs.items():
                # Make the room before releasing anything where that alone suffices: a
                # failed write while making room then leaves this cache untouched.
                store = m.stores[0][pg]
                if n > store.num_free and m._room(store, n):
                    try:
                        m._make_room(store, n)
                    except OutOfPagesError:
                        return False
        for lists in self._page_lists():
            for g, b in reversed(releases):
                page = lists[g][b]
                lists[g][b] = None
                if page is not None:
                    page.store.unlock(page)
        for g in m._windowed_groups:
            lc = m.life_cycles[g]
            self._released_to[g] = max(self._released_to[g], lc.stale_range(keep, tpb)[1])
        if plan is not None:
            self._apply_scratch(plan, history)
        for lists in self._page_lists():
            for g in m._attn_groups:
                del lists[g][nb_new:]
        for bm in self._beams:
            for g, blocks in grow.items():
                bm.pages[g].extend(self._new_pages(g, blocks, prios))
        for g, blocks in grow.items():
            if plan is None:
                self._pages[g].extend(self._new_pages(g, blocks, prios))
                continue
            pages_g = self._pages[g]  # scratch blocks stay None
            pages_g.extend([None] * (nb_new - len(pages_g)))
            for b, page in zip(blocks, self._new_pages(g, blocks, prios), strict=True):
                pages_g[b] = page
        if history < len(self._tokens):
            del self._tokens[history:]
            del self._keys[history // tpb:]
        self._capacity = capacity
        self._history = history
        if releases or grow:
            self._version += 1
        return True

    def commit(self, tokens: Sequence[Any]) -> None:
        """Give the tokens at positions ``[T, T + len(tokens))`` (``T``: tokens known so
        far); history advances to at least their end and full blocks are published."""
        if self._status is not CacheStatus.ACTIVE:
            self._require(CacheStatus.ACTIVE)
        if isinstance(tokens, np.ndarray):
            tokens = tokens.tolist()
        elif not isinstance(tokens, list | tuple):
            tokens = list(tokens)
        # Refuse bad tokens before anything changes (a cheap check for decode steps).
        if len(tokens) > 4 or not all(type(t) is int and -_I32 <= t < _I32 for t in tokens):
            encode_tokens(tokens)
        known = len(self._tokens)
        end = known + len(tokens)
        if end > self._capacity:
            raise ValueError(
                f"commit of {len(tokens)} tokens after {known} known ends at {end}, past "
                f"capacity {self._capacity}"
            )
        self._tokens.extend(tokens)
        moved = end > self._history
        if moved:
            self._history = end
        tpb = self._tpb
        if self._commit_on:
            full = end // tpb
            if self._published < full:
                self._publish_range(self._published, full)
            if self._published * tpb > self._committed:
                self._committed = self._published * tpb
            m = self._m
            if (m.config.commit_min_snapshot and m._ssm_groups and end % tpb == 0
                    and end == self._history and self._published == end // tpb and end):
                self._snapshot(self._nodes[end // tpb - 1])
        if moved and self._m._windowed_groups:
            self._release_stale()

    def _release_stale(self) -> None:
        m = self._m
        self._scratch_live = False  # history moved: this step's scratch pages are spent
        tpb = self._tpb
        keep = max(0, self._history - m.config.max_rewind_len)
        changed = False
        for g in m._windowed_groups:
            start, stop = m.life_cycles[g].stale_range(keep, tpb)
            lo = max(start, self._released_to[g])
            if stop <= lo:
                continue
            for lists in self._page_lists():
                pages_g = lists[g]
                for b in range(min(stop, len(pages_g)) - 1, lo - 1, -1):
                    page = pages_g[b]
                    if page is not None:
                        pages_g[b] = None
                        page.store.unlock(page)
                        changed = True
            self._released_to[g] = stop
        if changed:
            self._version += 1

    def _parent_node(self, block: int) -> Node | None:
        """The node a new block goes under, or None if that chain left the tree."""
        if block == 0:
            return self._m.tree.root(self._root_key)
        parent = self._nodes[block - 1]
        if parent.parent is None:  # detached from the tree by an eviction
            return None
        return parent

    def _block_key(self, block: int) -> bytes:
        keys = self._keys
        if len(keys) <= block:
            # Hash every missing block up to ``block`` from one encoding of their tokens.
            b0 = len(keys)
            tpb = self._tpb
            prev = keys[b0 - 1] if b0 else self._root_key
            keys.extend(block_keys(prev, self._tokens[b0 * tpb : (block + 1) * tpb], tpb,
                                   0, block + 1 - b0))
        return keys[block]

    def _publish_range(self, b0: int, b1: int) -> None:
        """Publish full blocks ``[b0, b1)`` (the hot path of prefill commits)."""
        m = self._m
        tpb = self._tpb
        tree = m.tree
        groups = m._publish_groups
        events = bool(m._sinks)
        stats = m._stats.groups
        self._block_key(b1 - 1)
        keys = self._keys
        tokens = self._tokens
        all_pages = self._pages
        nodes = self._nodes
        parent = self._parent_node(b0)
        for b in range(b0, b1):
            if parent is None:
                self._commit_on = False
                return
            key = keys[b]
            node = parent.children.get(key)
            if node is None:
                tokens_b = tuple(tokens[b * tpb : (b + 1) * tpb])
                if parent.partials:
                    self._supersede_partials(parent, tokens_b)
                node = tree.add_full(parent, key, tokens_b)
            for g in groups:
                mine = all_pages[g][b]
                if mine is None:
                    continue
                theirs = node.pages[g]
                if theirs is mine:
                    continue
                if theirs is None:
                    node.pages[g] = mine
                    mine.node = node
                    if events:
                        m._event(EventKind.STORED, node, g, mine.level, node.tokens)
                elif theirs.level == 0 and mine.node is None:
                    # Rebase onto the identical tree block and free our copy.
                    theirs.store.lock(theirs)
                    theirs.reused = True
                    all_pages[g][b] = theirs
                    mine.store.unlock(mine)
                    stats[g].rebased_blocks += 1
                    self._version += 1
            nodes.append(node)
            self._published = b + 1
            parent = node

    def _supersede_partials(self, parent: Node, tokens: tuple) -> None:
        """Remove partial children that ``tokens`` covers (the longer block wins)."""
        m = self._m
        for p in list(parent.partials):
            if tokens[: len(p.tokens)] == p.tokens and len(p.tokens) < len(tokens):
                for g, page in enumerate(p.pages):
                    if page is None:
                        continue
                    p.pages[g] = None
                    m._event(EventKind.REMOVED, p, g, page.level)
                    page.store.unpublish(page)
                m.tree.detach(p)

    def _snapshot(self, node: Node) -> None:
        """Copy the live SSM state into a snapshot page of ``node`` (best effort)."""
        m = self._m
        for g in m._ssm_groups:
            live = self._ssm[g]
            if live is None or node.pages[g] is not None or not m.life_cycles[g].publishes:
                continue
            store = m._gpu_store[g]
            if not m._can_take({store.pool_group: 1}):
                continue
            snap = m._take(g, 1)[0]
            m._copy_blocks(g, [(snap.slot, live.slot)])
            snap.node = node
            node.pages[g] = snap
            store._enter_policy(snap)
            m._event(EventKind.STORED, node, g, snap.level)

    def prefetch(self, level: int = 0) -> int:
        """Hint for a suspended cache: bring its pages up to ``level`` (0: the GPU) where
        there is room without pushing held pages down. Returns the pages moved."""
        self._require(CacheStatus.SUSPENDED, CacheStatus.ACTIVE)
        if self._status is CacheStatus.ACTIVE:
            return 0
        return self._m._prefetch([p for p in self._all_pages() if p.level > level], level)

    def stop_committing(self) -> None:
        """Publish nothing more from this cache (e.g. after a rewind it cannot redo)."""
        self._require(CacheStatus.ACTIVE, CacheStatus.SUSPENDED)
        self._commit_on = False

    def _publish_tail(self) -> Node | None:
        """Publish the trailing partial block; returns the node ending at the cache's
        known tokens (for the SSM snapshot), or None."""
        m = self._m
        tpb = self._tpb
        n = len(self._tokens)
        b = n // tpb
        if n % tpb == 0:
            return self._nodes[b - 1] if b and self._published >= b else None
        if self._published < b:
            return None
        parent = self._parent_node(b)
        if parent is None:
            return None
        part = tuple(self._tokens[b * tpb :])
        for child in parent.iter_children():
            if child.tokens[: len(part)] == part:
                return child if len(child.tokens) == len(part) else None
        self._supersede_partials(parent, part)
        node = m.tree.add_partial(parent, part)
        for g in m._publish_groups:
            pages_g = self._pages[g]
            mine = pages_g[b] if b < len(pages_g) else None
            if mine is not None and mine.node is None:
                node.pages[g] = mine
                mine.node = node
                m._event(EventKind.STORED, node, g, mine.level, part)
        return node

    def close(self) -> None:
        """Release every page; committed ones stay reusable until evicted. Idempotent."""
        if self._status is CacheStatus.CLOSED:
            return
        m = self._m
        tpb = self._tpb
        if self._commit_on and len(self._tokens) <= self._history:
            node = self._publish_tail()
            if (node is not None and len(self._tokens) == self._history
                    and node.end(tpb) == self._history):
                for g in m._ssm_groups:
                    live = self._ssm[g]
                    if live is not None and node.pages[g] is None and \
                            m.life_cycles[g].publishes:
                        node.pages[g] = live
                        live.node = node
                        m._event(EventKind.STORED, node, g, live.level)
        active = self._status is CacheStatus.ACTIVE
        self._drop_scratch()
        for bm in reversed(self._beams):
            self._release_beam(bm)
        self._beams.clear()
        # Deepest block first, every group of a block together: the LRU order then evicts
        # a chain from its tail, and no group's pages of a block age apart from the others.
        depth = max((len(self._pages[g]) for g in m._attn_groups), default=0)
        for b in range(depth - 1, -1, -1):
            for g in m._attn_groups:
                pages_g = self._pages[g]
                page = pages_g[b] if b < len(pages_g) else None
                if page is not None and page.level >= 0:
                    if active:
                        page.store.unlock(page)
                    else:
                        page.store.unhold(page)
        for g in m._attn_groups:
            self._pages[g] = []
        for g in m._ssm_groups:
            page = self._ssm[g]
            if page is not None and page.level >= 0:
                if active:
                    page.store.unlock(page)
                else:
                    page.store.unhold(page)
                self._ssm[g] = None
        for _, _, src in self._pending:
            if src.level >= 0:
                src.store.unhold(src)
        self._pending.clear()
        self._status = CacheStatus.CLOSED
        self._version += 1
        m._open.pop(id(self), None)

    # -- SWA scratch pages (kvcm_core.scratch, docs/semantics.md) ------------------------------

    def scratch(self, group: int) -> ScratchDesc | None:
        """This step's scratch blocks of one cache group, or None (no scratch blocks this
        step, the group has no scratch, or history moved past the step).

        Scratch blocks show ``BAD_PAGE_INDEX`` in :meth:`get_base_page_indices`; a
        buffer's page indices for them come from
        ``manager.get_page_index_converter(layer_id, role).convert(table, desc)``.
        """
        m = self._m
        if isinstance(group, bool) or not isinstance(group, int | np.integer) or not (
                0 <= group < len(m.life_cycles)):
            raise ValueError(f"group={group!r}: must be a cache group id in "
                             f"0..{len(m.life_cycles) - 1}")
        rng = self._scratch_range.get(int(group))
        if rng is None or rng[1] <= rng[0] or not self._scratch_live or \
                self._status is not CacheStatus.ACTIVE:
            return None
        sc = m.config.swa_scratch
        assert sc is not None
        return ScratchDesc(rng[0], rng[1], tuple(p.slot for p in self._scratch_slots[group]),
                           sc.scratch_pages_per_block)

    def _plan_scratch(self, capacity: int, history: int, nb_new: int,
                      releases: list[tuple[int, int]], grow: dict[int, list[int]],
                      needs: dict[int, int]) -> dict[int, tuple[int, int, int, int, list[int]]]:
        """Plan this step's scratch blocks per scratch group, adjusting ``releases``,
        ``grow`` and ``needs`` of :meth:`resize` in place. Returns ``group -> (begin, end,
        scratch slots to take, scratch slots to drop, blocks to give a page again)``.

        Scratch blocks: new blocks (first token at or after ``history``) stale at
        ``max(0, capacity - max_rewind_len)`` (never sinks), at most what
        ``max_scratch_slots`` hold; the rest get ordinary pages."""
        m = self._m
        tpb = self._tpb
        sc = m.config.swa_scratch
        assert sc is not None
        keep_c = max(0, capacity - m.config.max_rewind_len)
        first_new = -(-history // tpb)
        released = set(releases)
        plan: dict[int, tuple[int, int, int, int, list[int]]] = {}
        for g in m._scratch_groups:
            lc = m.life_cycles[g]
            pages_g = self._pages[g]
            old_nb = len(pages_g)
            pg = m._gpu_store[g].pool_group
            start, stop = lc.stale_range(keep_c, tpb)
            begin = max(first_new, start)
            end = min(stop, nb_new, begin + m._scratch_max_blocks[g])
            if end <= begin:
                begin = end = 0
            k = scratch_slots_needed(end - begin, sc.scratch_pages_per_block,
                                     m._scratch_scales[g])
            have = len(self._scratch_slots.get(g, ()))
            # Blocks of the range hold no page: pages they still have (an earlier resize of
            # this step) hold nothing needed (they start at or after history).
            for b in range(begin, min(end, old_nb)):
                if pages_g[b] is not None and (g, b) not in released:
                    releases.append((g, b))
                    released.add((g, b))
            if g in grow:
                kept = [b for b in grow[g] if not begin <= b < end]
                needs[pg] -= len(grow[g]) - len(kept)
                grow[g] = kept
            # Blocks an earlier range left without a page that are needed again.
            s_h, e_h = lc.stale_range(history, tpb)
            ob, oe = self._scratch_range.get(g, (0, 0))
            fill = [b for b in range(ob, min(oe, old_nb, nb_new))
                    if pages_g[b] is None and not s_h <= b < e_h and not begin <= b < end]
            if fill:
                grow[g] = sorted(grow.get(g, []) + fill)
                needs[pg] = needs.get(pg, 0) + len(fill)
            take = max(0, k - have)
            drop = have if k == 0 else 0
            if take:
                needs[pg] = needs.get(pg, 0) + take
            plan[g] = (begin, end, take, drop, fill)
        return plan

    def _apply_scratch(self, plan: dict[int, tuple[int, int, int, int, list[int]]],
                       history: int) -> None:
        """Carry out :meth:`_plan_scratch` (after resize checked that level 0 has room)."""
        m = self._m
        changed = False
        for g, (begin, end, take, drop, fill) in plan.items():
            slots = self._scratch_slots.setdefault(g, [])
            if drop:
                for page in reversed(slots):
                    page.store.unlock(page)
                slots.clear()
                changed = True
            if take:
                pages = m._take(g, take)
                for page in pages:
                    page.store.lock(page)
                slots.extend(pages)
                changed = True
            if self._scratch_range.get(g, (0, 0)) != (begin, end):
                changed = True
            self._scratch_range[g] = (begin, end)
            for b in fill:
                if b * self._tpb < history:  # its tokens were lost with the scratch page
                    self._recompute.setdefault(g, []).append(b)
        self._scratch_live = True
        if changed:
            self._version += 1

    def _drop_scratch(self) -> None:
        """Release every scratch slot (suspend, close)."""
        for slots in self._scratch_slots.values():
            for page in reversed(slots):
                page.store.unlock(page)
            slots.clear()
        if self._scratch_range:
            self._scratch_range.clear()
            self._version += 1
        self._scratch_live = False

    # -- page tables ---------------------------------------------------------------------------

    def get_base_page_indices(self, group: int, beam: int = 0) -> np.ndarray:
        """Slot ids of this cache's blocks for one cache group (read-only int32 array of
        ``num_blocks``); ``BAD_PAGE_INDEX`` for absent or stale blocks."""
        m = self._m
        if self._status is CacheStatus.CLOSED:
            self._require(CacheStatus.ACTIVE, CacheStatus.SUSPENDED)
        if (type(group) is not int and (isinstance(group, bool) or not isinstance(
                group, int | np.integer))) or not 0 <= group < len(m.life_cycles):
            raise ValueError(f"group={group!r}: must be a cache group id in "
                             f"0..{len(m.life_cycles) - 1}")
        if beam != 0:
            self._check_beam(beam)
            return self._beam_table(group, int(beam))
        tpb = self._tpb
        nb = (self._capacity + tpb - 1) // tpb
        lc = m.life_cycles[group]
        # Full attention has no stale range: its table depends on the pages only.
        stale = lc.stale_range(self._history, tpb) if lc.window is not None or lc.is_ssm \
            else _NO_STALE
        key = (self._version, m._epoch, nb, stale)
        if self._table_keys[group] == key:
            return self._tables[group]  # type: ignore[return-value]
        table = np.full(nb, BAD_PAGE_INDEX, dtype=np.int32)
        if lc.is_ssm:
            live = self._ssm[group]
            b = self._history // tpb
            if live is not None and live.level == 0 and b < nb:
                table[b] = live.slot
        else:
            for b, page in enumerate(self._pages[group][:nb]):
                if page is not None and page.level == 0:
                    table[b] = page.slot
            table[stale[0] : stale[1]] = BAD_PAGE_INDEX
        table.flags.writeable = False
        self._tables[group] = table
        self._table_keys[group] = key
        return table

    def _beam_table(self, group: int, beam: int) -> np.ndarray:
        """Page table of an extra beam (built on each call: beams are short-lived)."""
        m = self._m
        tpb = self._tpb
        nb = (self._capacity + tpb - 1) // tpb
        lc = m.life_cycles[group]
        bm = self._beams[beam - 1]
        table = np.full(nb, BAD_PAGE_INDEX, dtype=np.int32)
        if lc.is_ssm:
            live = bm.ssm[group]
            b = self._history // tpb
            if live is not None and live.level == 0 and b < nb:
                table[b] = live.slot
        else:
            for b, page in enumerate(bm.pages[group][:nb]):
                if page is not None and page.level == 0:
                    table[b] = page.slot
            start, stop = lc.stale_range(self._history, tpb)
            table[start:stop] = BAD_PAGE_INDEX
        table.flags.writeable = False
        return table

    def __repr__(self) -> str:
        return (f"KVCache(id={self.id!r}, {self._status.name}, committed={self._committed}, "
                f"history={self._history}, capacity={self._capacity})")


