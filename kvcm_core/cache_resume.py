"""Resuming a :class:`~kvcm_core.cache.KVCache`: the common case (every page already on
the GPU) in one lock call, and the general path (cold pages brought back in one batch per
source store, the OPTIONAL choice, fresh pages and pending copies)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvcm_core.backend import Stream
from kvcm_core.cache_base import CacheBase, CacheStatus
from kvcm_core.errors import CorruptPageError, OutOfPagesError, TierIOError
from kvcm_core.kinds import page_ids as _arr
from kvcm_core.kinds import page_list
from kvcm_core.refusals import level_shortage, over_resume_limit, room_failed

__all__ = ["ResumeMixin"]


class ResumeMixin(CacheBase):
    """``resume`` and its helpers."""

    def resume(self, stream: Stream | None = None,
               optional_reuse_groups: Sequence[int] | None = None) -> bool:
        """Bring the cache to the GPU and lock its pages; False (nothing changed) when the
        GPU level is too full (``max_util_for_resume``) or cannot provide the pages (the
        reason is then in ``last_refusal``).

        On a device backend the copies are only queued: the call returns once they are
        issued, and ``stream`` (the engine's; None: the backend's default stream) is made
        to wait for them, so work queued on it afterwards sees every page in place."""
        self._ctx.thread.check()  # before begin(): a refused call touches no fence
        return self._fenced(stream, self._resume, stream, optional_reuse_groups)

    def _resume(self, stream: Stream | None,
                optional_reuse_groups: Sequence[int] | None) -> bool:
        self._last_refusal = None
        if self._status is CacheStatus.CLOSED:
            self._require(CacheStatus.SUSPENDED)
        if self._status is CacheStatus.ACTIVE:
            if optional_reuse_groups is not None:  # checked against the choice made
                self._decide_optional(optional_reuse_groups)  # (decided: changes nothing)
            return True
        if optional_reuse_groups is None:
            done = self._resume_fast(stream)
            if done is not None:
                return done
        # The choice is checked first: a bad argument is an error, never a refusal.
        declined = self._decide_optional(optional_reuse_groups)
        if self._over_limit_early():
            return False
        ctx = self._ctx
        L = self._levels
        a = self._arena
        refs = self._references()
        if not self._lost and refs and (a.level[_arr(refs)] < 0).any():
            self._lost = True
        if self._lost:
            corrupt = tuple(p for p in refs if p in L.corrupt_ids)
            if corrupt:
                raise self._name_corrupt_block(CorruptPageError(
                    "pages of this cache failed their frame check", pages=corrupt))
            raise TierIOError(
                f"cache {self.id!r} lost pages to a storage failure; close it and recompute "
                "(create_kv_cache again: what is still cached will be reused)")
        tpb = self._tpb
        nb = self.num_blocks
        declined_groups = {g for g, _, _ in declined}
        declined_ids = {p for _, _, p in declined}
        wanted: dict[int, list[int]] = {}
        needs: dict[int, int] = {}
        extra: dict[int, int] = {}
        for _g, _, pid in declined:
            if a.level[pid] == 0 and a.holds[pid] == 1 and not a.locks[pid]:
                pg = L.store_of(pid).pool_group
                extra[pg] = extra.get(pg, 0) + 1
        for g in ctx.attn_groups:
            start, stop = ctx.kinds[g].stale_range(self._history)
            drop = g in declined_groups
            # SWA scratch blocks of the interrupted step stay without a page: the next
            # resize makes them scratch again (or gives them pages).
            s0, s1 = self._scratch_span(g, self._capacity, self._history, nb) \
                if g in ctx.scratch_scales else (0, 0)
            blocks = [b for b, p in enumerate(self._pages[g]) if (p < 0 or drop)
                      and not start <= b < stop and b < nb and not s0 <= b < s1]
            if blocks:
                wanted[g] = blocks
                pg = L.pool_group_of(g)
                needs[pg] = needs.get(pg, 0) + len(blocks)
        for g in ctx.ssm_groups:
            if self._ssm[g] < 0 or g in declined_groups:
                wanted[g] = [-1]
                pg = L.pool_group_of(g)
                needs[pg] = needs.get(pg, 0) + 1
        mine_all = _arr(self._all_pages())
        if declined_ids:
            mine_all = mine_all[~np.isin(mine_all, list(declined_ids))]
        on_gpu = a.level[mine_all] == 0
        cold_arr = mine_all[~on_gpu]
        if len(cold_arr):  # a page shared by beams moves once
            cold_u = _arr(list(dict.fromkeys(cold_arr.tolist())))
            per_pg = np.bincount(L.pool_groups_of(a.group[cold_u]))
            for pg in np.nonzero(per_pg)[0].tolist():
                needs[pg] = needs.get(pg, 0) + int(per_pg[pg])
        limit = ctx.config.max_util_for_resume
        warm_arr = mine_all[on_gpu]
        # A page shared by beams takes one slot: count it once.
        warm_u = np.unique(warm_arr) if self._beams else warm_arr
        # Level-0 pages of ours per pool group (level-0 store index == pool group id).
        mine = np.bincount(a.store[warm_u], minlength=len(L.stores[0])) if len(
            warm_u) else np.zeros(len(L.stores[0]), dtype=np.int64)
        for store in L.stores[0]:
            used = store.num_locked + int(mine[store.pool_group]) + needs.get(
                store.pool_group, 0)
            if used > limit * store.num_slots:
                return self._refuse(over_resume_limit(store, used, limit))
        warm = warm_arr.tolist()
        prios = self._priorities([b for blocks in wanted.values() for b in blocks])
        # Lock what is on the GPU first, so making room cannot push it down.
        warm_by_beam = self._split_by_beam(warm)
        for refs_b in warm_by_beam:
            L.change(_arr(refs_b), 1, -1)
        if not L.can_take(needs, extra):
            reason = level_shortage("resume", L, needs, extra)
            for refs_b in reversed(warm_by_beam):
                L.change(_arr(refs_b), -1, 1)
            return self._refuse(reason)
        # Declined claims are given up first (their pages are room for the replacements),
        # and come back if the resume is refused or interrupted: the choice is final only
        # once the resume succeeds.
        pending = self._release_declines(declined)
        claims = self._reuse_claims()
        try:
            L.make_room_for(needs)
        except BaseException as exc:
            # A write to a colder level failed while making room, or another pool group
            # took the colder room this one counted on: give up for now. An interrupt
            # (KeyboardInterrupt) leaves the same state, and goes on.
            for refs_b in reversed(warm_by_beam):
                L.change(_arr(refs_b), -1, 1)
            self._restore_declines(declined, pending)
            if not isinstance(exc, OutOfPagesError):
                raise
            return self._refuse(room_failed("resume", exc))
        fresh: list[int] = []
        recompute = ({g: list(b) for g, b in self._recompute.items()}, self._unwritten)
        try:
            self._check_not_lost_while_making_room()
            # Cold pages of ours come back in one batch per source store.
            allp = _arr(self._all_pages())
            cold = list(dict.fromkeys(allp[a.level[allp] != 0].tolist()))
            L.onboard(_arr(cold), stream)
            for refs_b in self._split_by_beam(cold):
                L.change(_arr(refs_b), 1, -1)
            sources = {(g, b): src for g, b, src in self._pending}
            for g, blocks in wanted.items():
                pages = self._new_pages(g, blocks, prios)
                fresh.extend(pages)
                dst, src = [], []
                for b, pid in zip(blocks, pages, strict=True):
                    s = sources.get((g, b))
                    if s is not None:
                        dst.append(pid)
                        src.append(s)
                    elif not self._first_resume_done and (
                            (b < 0 and self._history > 0) or 0 <= b * tpb < self._history):
                        self._recompute.setdefault(g, []).append(b)
                        self._unwritten = True
                    elif g in ctx.scratch_scales:  # a scratch page spent short of its chunk
                        self._note_recompute(g, [b], self._history)
                L.fill(g, _arr(dst), _arr(src), stream)
                for b, pid in zip(blocks, pages, strict=True):
                    if ctx.kinds[g].is_ssm:
                        self._ssm[g] = pid
                    else:
                        self._pages[g][b] = pid
        except TierIOError:
            self._fail_resume(fresh)
            raise
        except CorruptPageError as exc:
            self._fail_resume(fresh)
            raise self._name_corrupt_block(exc) from exc
        except BaseException:  # an interrupt: undone, the cache stays SUSPENDED, intact
            self._fail_resume(fresh, lost=False)
            self._recompute, self._unwritten = recompute
            self._restore_declines(declined, pending)
            raise
        self._count_optional_reuse(claims)
        if self._pending:
            L.change(_arr([src for _, _, src in self._pending]), 0, -1)
            self._pending.clear()
        self._first_resume_done = True
        self._changed()
        self._status = CacheStatus.ACTIVE
        return True

    def _resume_fast(self, stream: Stream | None) -> bool | None:
        """The common resume: one beam, full-attention pages only (no SSM, no window),
        none missing, no copy pending and no reuse choice to make; pages on colder levels
        come back in one batch. Locks the pages and returns True; False: refused
        (``last_refusal`` says why; nothing changed); None: not this case, nothing changed
        (the general path decides).

        Raises:
            TierIOError, CorruptPageError: as :meth:`resume`.
        """
        ctx = self._ctx
        if self._beams or self._pending or self._lost or ctx.ssm_groups or \
                ctx.windowed_groups or (self._reuse_status and not self._optional_decided):
            return None
        nb = self.num_blocks
        groups = ctx.attn_groups
        if any(len(self._pages[g]) != nb for g in groups):
            return None
        # Every group's pages, one copy each (a PageList's items are read one object at a
        # time); a hole (-1) sends the resume to the general path.
        pids = _arr(self._pages[groups[0]]) if len(groups) == 1 else \
            np.concatenate([_arr(self._pages[g]) for g in groups] or [_arr(())])
        if len(pids) and pids[pids.argmin()] < 0:
            return None
        a = self._arena
        L = self._levels
        limit = ctx.config.max_util_for_resume
        if len(pids):
            level = a.level[pids]
            cold_n = np.count_nonzero(level)
            if cold_n and (level < 0).any():
                return None  # lost pages: the general path says so
            warm = pids[level == 0] if cold_n else pids
            cold = pids[level != 0] if cold_n else pids[:0]
            mine = np.bincount(a.store[warm], minlength=len(L.stores[0]))
            needs: dict[int, int] = {}
            if cold_n:
                per_pg = np.bincount(L.pool_groups_of(a.group[cold]))
                needs = {pg: int(per_pg[pg]) for pg in np.flatnonzero(per_pg).tolist()}
            for store in L.stores[0]:
                used = store.num_locked + int(mine[store.pool_group]) + needs.get(
                    store.pool_group, 0)
                if used > limit * store.num_slots:
                    return self._refuse(over_resume_limit(store, used, limit))
            # Lock what is on the GPU first, so making room cannot push it down.
            L.change(warm, 1, -1)
            try:
                if cold_n and not self._resume_cold(pids, warm, cold, needs, stream):
                    return False
            except BaseException:
                if not self._lost:  # an interrupt: unlock what was locked, and go on
                    L.change(warm, -1, 1)
                    arrived = cold[a.level[cold] == 0]  # locked on the way
                    L.change(arrived, -1, 1)
                raise
        else:
            for store in L.stores[0]:
                if store.num_locked > limit * store.num_slots:
                    return None
        self._optional_decided = True
        self._first_resume_done = True
        self._changed()
        self._status = CacheStatus.ACTIVE
        return True

    def _resume_cold(self, pids: np.ndarray, warm: np.ndarray, cold: np.ndarray,
                     needs: dict[int, int], stream: Stream | None) -> bool:
        """:meth:`_resume_fast` once ``warm`` pages are locked: room for the ``cold``
        ones, which come back locked. False: refused (``warm`` unlocked again)."""
        L = self._levels
        a = self._arena
        if not L.can_take(needs):
            L.change(warm, -1, 1)
            return self._refuse(level_shortage("resume", L, needs, {}))
        try:
            for pg, n in needs.items():
                L.make_room(L.stores[0][pg], n)
        except OutOfPagesError as exc:
            L.change(warm, -1, 1)
            return self._refuse(room_failed("resume", exc))
        try:
            lost = pids[a.level[pids] < 0]
            if len(lost):  # found corrupt while making room moved it
                raise CorruptPageError("pages of this cache failed their frame "
                                       "check while making room",
                                       pages=tuple(lost.tolist()))
            L.onboard(cold, stream, lock=True)  # arrivals locked on the way
        except TierIOError:
            self._fail_resume([])
            raise
        except CorruptPageError as exc:
            self._fail_resume([])
            raise self._name_corrupt_block(exc) from exc
        return True

    def _over_limit_early(self) -> bool:
        """Refuse (True, ``last_refusal`` set) before any per-page work when the pages this
        cache needs on level 0 alone would lock more of a pool group than
        ``max_util_for_resume``: a scheduler that retries its preempted requests every
        step pays a few microseconds per refusal. Every block a read needs (each attention
        group's blocks outside its stale range and, for SWA scratch groups, outside the
        scratch blocks of an interrupted step; one page per SSM group) takes a level-0
        page whatever else the resume decides (where the page is now, a reuse declined, a
        pending copy, other beams only add to it), so the count is a lower bound of what
        the general path counts and a refusal here is one it would make. False: go on."""
        ctx = self._ctx
        if self._lost:  # the general path reports the lost pages first
            return False
        L = self._levels
        nb = self.num_blocks
        per_pg: dict[int, int] = {}
        for g in ctx.attn_groups:
            start, stop = ctx.kinds[g].stale_range(self._history)
            stale = max(0, min(stop, nb) - max(start, 0))
            if g in ctx.scratch_scales:  # scratch blocks (after history) take none
                s0, s1 = self._scratch_span(g, self._capacity, self._history, nb)
                stale += s1 - s0
            pg = L.pool_group_of(g)
            per_pg[pg] = per_pg.get(pg, 0) + nb - stale
        for g in ctx.ssm_groups:
            pg = L.pool_group_of(g)
            per_pg[pg] = per_pg.get(pg, 0) + 1
        limit = ctx.config.max_util_for_resume
        for store in L.stores[0]:
            used = store.num_locked + per_pg.get(store.pool_group, 0)
            if used > limit * store.num_slots:
                self._refuse(over_resume_limit(store, used, limit))
                return True
        return False

    def _split_by_beam(self, wanted: list[int]) -> list[list[int]]:
        """The references of ``wanted`` pages (in that order), one unique list per beam."""
        if self.beam_width == 1:
            return [wanted]
        keep = set(wanted)
        return [[p for p in refs if p in keep] for refs in self._refs_by_beam()]

    def _references(self) -> list[int]:
        """Every page this cache references, lost ones included, and pending sources."""
        refs = [p for pages in self._beam_views() for lst in (*pages[0], pages[1])
                for p in lst if p >= 0]
        return refs + [src for _, _, src in self._pending]

    def _check_not_lost_while_making_room(self) -> None:
        """Making room moves held pages between cold levels; one found corrupt on the way
        is lost there (not an error of that move).

        Raises:
            CorruptPageError: a page of ours was lost so.
        """
        a = self._arena
        mine = _arr(self._references())
        lost = mine[a.level[mine] < 0] if len(mine) else mine
        if len(lost):
            raise CorruptPageError("pages of this cache failed their frame check while "
                                   "making room", pages=tuple(lost.tolist()))

    def _name_corrupt_block(self, exc: CorruptPageError) -> CorruptPageError:
        """The error ``resume`` raises for corrupt pages: it names the first bad block
        of this request (lowest block ordinal, then cache group; SSM states count as the
        last block)."""
        bad = set(exc.pages)
        found = [(b, g) for g in range(len(self._pages))
                 for b, p in enumerate(self._pages[g]) if p in bad]
        found += [(self.num_blocks, g) for g, p in enumerate(self._ssm) if p in bad]
        block, group = min(found) if found else (None, None)
        where = f"block {block} (tokens {block * self._tpb}..{(block + 1) * self._tpb - 1}" \
            f", cache group {group})" if block is not None else "a block"
        return CorruptPageError(
            f"cache {self.id!r}: {where} read back corrupt from a cold level; the cache "
            "stays SUSPENDED: close it and create the request again (what precedes the "
            "block is reused, the rest is recomputed)", pages=exc.pages, block=block,
            group=group)

    def _fail_resume(self, fresh: list[int], lost: bool = True) -> None:
        """A read failed during resume: undo the locks, free new pages, and mark the cache
        lost (its data is incomplete: the engine must close it and recompute). ``lost``
        False: an interrupt, the data is intact (the cache can resume again)."""
        gone = set(fresh)
        for g in range(len(self._pages)):
            self._pages[g] = page_list(-1 if p in gone else p for p in self._pages[g])
        self._ssm = [-1 if p in gone else p for p in self._ssm]
        L = self._levels
        a = self._arena
        L.change(_arr(fresh), -1, 0)
        for refs in self._refs_by_beam():
            locked = [p for p in refs if a.locks[p] > 0]
            L.change(_arr(locked), -1, 1)
        self._lost = lost

