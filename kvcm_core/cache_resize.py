"""Resizing a :class:`~kvcm_core.cache.KVCache` for a step, and releasing the pages of
windowed groups that became stale as history grew."""

from __future__ import annotations

from typing import Any

import numpy as np

from kvcm_core.backend import Stream
from kvcm_core.cache_base import CacheBase, CacheStatus
from kvcm_core.errors import ArgumentTypeError, InvalidArgumentError, OutOfPagesError
from kvcm_core.kinds import page_ids as _arr
from kvcm_core.refusals import level_shortage, room_failed

_ACTIVE = CacheStatus.ACTIVE

__all__ = ["ResizeMixin"]


def _check_count(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise ArgumentTypeError(f"{name}={value!r}: must be an int >= 0")
    if value < 0:
        raise InvalidArgumentError(f"{name}={value!r}: must be an int >= 0")
    return int(value)


class ResizeMixin(CacheBase):
    """``resize`` and the release of stale window pages."""

    def resize(self, capacity: int, history_length: int | None = None,
               stream: Stream | None = None) -> bool:
        """Set this step's capacity (and optionally move history). Returns False, with
        everything unchanged, when level 0 cannot provide the pages (the reason is then in
        ``last_refusal``).

        ``stream``: the engine's stream (None: the backend's default stream). Pages pushed
        down to make room are copied asynchronously on a device backend; ``stream`` is
        made to wait for those copies, so new pages written on it afterwards never
        overwrite a slot before its old contents were read. A resize within the current
        last block (most decode steps) moves and allocates nothing, so ``stream`` is
        given nothing to wait for."""
        tpb = self._tpb
        if (type(capacity) is int and history_length is None and self._status is _ACTIVE
                and self._history <= capacity and self._scratch_free_path
                and (capacity + tpb - 1) // tpb == (self._capacity + tpb - 1) // tpb):
            # The decode fast path: same blocks, same history, nothing to allocate.
            self._ctx.thread.check()
            self._last_refusal = None
            self._capacity = capacity
            return True
        self._ctx.thread.check()  # before begin(): a refused call touches no fence
        return self._fenced(stream, self._resize, capacity, history_length, stream)

    def pages_needed(self, capacity: int | None = None) -> dict[int, int]:
        """The level-0 pages, per cache group, that ``resize(capacity)`` would take now
        (``capacity`` None: the current one), and first ``resume`` for a suspended cache:
        its pages on colder levels and the blocks it lacks. Groups that need none are
        left out. Window groups count every new block (the pages their window releases
        are not subtracted), so the figure is an upper bound there. SWA scratch groups
        count the scratch slots the resize takes instead of its scratch blocks, and the
        blocks whose spent scratch page it replaces.
        What an engine sums over a step's caches for :meth:`KVCacheManager.make_room`.

        Raises:
            InvalidStateError: the cache is closed.
            InvalidArgumentError, ArgumentTypeError: ``capacity`` is not a count.
        """
        self._ctx.thread.check()
        self._require(CacheStatus.ACTIVE, CacheStatus.SUSPENDED)
        ctx = self._ctx
        nb = self.num_blocks if capacity is None else \
            -(-_check_count("capacity", capacity) // self._tpb)
        out: dict[int, int] = {}
        cap = self._capacity if capacity is None else int(capacity)
        suspended = self._status is CacheStatus.SUSPENDED
        for g in ctx.attn_groups:
            have = len(self._pages[g])
            if g in ctx.scratch_scales:  # scratch slots for scratch blocks, spent ones
                n = self._scratch_pages_needed(g, cap, nb)
                if n:
                    out[g] = n
            elif nb > have:
                out[g] = (nb - have) * self.beam_width
        if suspended:
            a = self._arena
            nb_now = self.num_blocks
            for g in ctx.attn_groups:
                start, stop = ctx.kinds[g].stale_range(self._history)
                s0, s1 = self._scratch_span(g, self._capacity, self._history, nb_now) \
                    if g in ctx.scratch_scales else (0, 0)  # no page at resume
                missing = sum(1 for b, p in enumerate(self._pages[g][:nb_now])
                              if p < 0 and not start <= b < stop and not s0 <= b < s1)
                if missing:
                    out[g] = out.get(g, 0) + missing
            for g in ctx.ssm_groups:
                if self._ssm[g] < 0:
                    out[g] = out.get(g, 0) + 1
            pages = np.unique(np.asarray(self._all_pages(), dtype=np.int64))
            cold = pages[a.level[pages] > 0] if len(pages) else pages
            for g, n in zip(*np.unique(a.group[cold], return_counts=True), strict=True):
                out[int(g)] = out.get(int(g), 0) + int(n)
        return out

    def _resize(self, capacity: int, history_length: int | None,
                stream: Stream | None = None) -> bool:
        self._last_refusal = None
        if self._status is not CacheStatus.ACTIVE:
            self._require(CacheStatus.ACTIVE)
        tpb = self._tpb
        if history_length is None and type(capacity) is int and self._grow_fast(capacity):
            return True
        ctx = self._ctx
        L = self._levels
        a = self._arena
        capacity = _check_count("capacity", capacity)
        history = self._resize_history(capacity, history_length)  # errors before refusals
        nb_new = -(-capacity // self._tpb)
        for g in ctx.attn_groups:  # O(1): a size no level 0 could ever hold is refused
            slots = L.gpu_store(g).num_slots
            more = nb_new - len(self._pages[g])
            if g not in ctx.windowed_groups and nb_new > slots:
                return self._refuse(
                    f"resize({capacity}): level 0 cannot provide {more} more pages: cache "
                    f"group {g} needs {nb_new} blocks and level 0 holds {slots} slots in all")
            # A window releases pages, but every new block (SWA scratch aside) takes one now.
            if more - ctx.scratch_max_blocks.get(g, 0) > slots:
                return self._refuse(
                    f"resize({capacity}): level 0 cannot provide {more} more pages: cache "
                    f"group {g} (windowed) gets {more} new blocks and level 0 holds {slots} "
                    "slots in all")
        keep = max(0, history - ctx.config.max_rewind_len)
        releases: list[tuple[int, int]] = []
        grow: dict[int, list[int]] = {}
        needs: dict[int, int] = {}
        extra: dict[int, int] = {}
        for g in ctx.attn_groups:
            pages_g = self._pages[g]
            old_nb = len(pages_g)
            kind = ctx.kinds[g]
            for b in kind.releasable(pages_g, keep, self._released_to[g]):
                if pages_g[b] >= 0 and b < self._release_limit(g):
                    releases.append((g, b))
            for b in range(nb_new, old_nb):
                if pages_g[b] >= 0 and (g, b) not in releases:
                    releases.append((g, b))
            if nb_new > old_nb:
                grow[g] = list(range(old_nb, nb_new))
                pg = L.pool_group_of(g)
                needs[pg] = needs.get(pg, 0) + nb_new - old_nb
        plan = (self._plan_scratch(capacity, history, nb_new, releases, grow, needs)
                if ctx.scratch_scales else None)
        nbeams = self.beam_width - 1
        unshare: list[tuple[Any, int, int]] = []
        if nbeams:  # every beam grows and sheds the same blocks as beam 0
            for g, blocks in grow.items():
                needs[L.pool_group_of(g)] += len(blocks) * nbeams
            if history < self._history:  # a rewind below a fork unshares blocks
                unshare = self._unshare_plan(history, nb_new)
                for _, g, _ in unshare:
                    pg = L.pool_group_of(g)
                    needs[pg] = needs.get(pg, 0) + 1
        prios = self._priorities([b for blocks in grow.values() for b in blocks] +
                                 [b for _, _, b in unshare])
        if needs:
            for g, b in releases:
                pid = self._pages[g][b]
                if a.locks[pid] == 1 and not a.holds[pid]:
                    pg = L.store_of(pid).pool_group
                    extra[pg] = extra.get(pg, 0) + 1
            for g, (*_, drop, _) in (plan or {}).items():
                if drop:
                    pg = L.pool_group_of(g)
                    extra[pg] = extra.get(pg, 0) + drop
            if not L.can_take(needs, extra):
                return self._refuse(level_shortage("resize", L, needs, extra))
            for pg, n in needs.items():
                # Make the room before releasing anything where that alone suffices: a
                # failed write while making room then leaves this cache untouched.
                store = L.stores[0][pg]
                if n > store.num_free and L.room(store, n):
                    try:
                        L.make_room(store, n)
                    except OutOfPagesError as exc:
                        return self._refuse(room_failed("resize", exc))
            for pg, n in needs.items():
                # Pool groups can share a colder store: the room made for one may have
                # taken the colder room another (that needs its releases) counted on.
                store = L.stores[0][pg]
                if n > store.num_free and not L.room(store, n - extra.get(pg, 0)):
                    return self._refuse(level_shortage("resize", L, needs, extra))
        try:
            self._resize_apply(releases, keep, plan, history, nb_new, unshare, prios, grow,
                               stream)
        except BaseException:
            # An interrupt or a device error part-way: the tables still match the pages
            # (nothing leaks), and a seated row is published again; the cache may be
            # partly resized (docs/batch.md).
            self._changed()
            raise
        # Tables are ``num_blocks`` long: a change of block count changes every table
        # (an SSM group's too, which takes no page per block).
        resized = -(-capacity // tpb) != -(-self._capacity // tpb)
        self._capacity = capacity
        if history != self._history and ctx.history_tables:
            self._note_history(self._history, history)  # type: ignore[attr-defined]
        self._history = history
        if releases or grow or resized or unshare:
            self._changed()
        return True

    def _resize_apply(self, releases: list[tuple[int, int]], keep: int,
                      plan: dict[int, tuple[int, int, int, int, list[int]]] | None,
                      history: int, nb_new: int, unshare: list[tuple[Any, int, int]],
                      prios: dict[int, int], grow: dict[int, list[int]],
                      stream: Stream | None) -> None:
        """The page changes of a resize whose room is made: releases, SWA scratch,
        unshared and new pages, the token log cut to ``history``."""
        ctx = self._ctx
        tpb = self._tpb
        if releases:
            self._wait_readers()  # before any change: an interrupt there changes nothing
            for pages, _ in reversed(self._beam_views()):
                gone = [pages[g][b] for g, b in reversed(releases) if pages[g][b] >= 0]
                self._unlock(_arr(gone))
                for g, b in releases:
                    pages[g][b] = -1
        for g in ctx.windowed_groups:
            self._released_to[g] = max(self._released_to[g], min(
                ctx.kinds[g].stale_range(keep)[1], self._release_limit(g)))
        if plan is not None:
            self._apply_scratch(plan, history)
        for pages, _ in self._beam_views():
            for g in ctx.attn_groups:
                del pages[g][nb_new:]
        if self._beams and history < self._history:
            self._unshare(unshare, history, prios, stream)
        views = self._beam_views()
        lens = [{g: len(pages[g]) for g in grow} for pages, _ in views]
        try:
            self._grow_beams(grow, prios)
            for g, blocks in grow.items():
                if plan is None:
                    self._pages[g].extend(self._new_pages(g, blocks, prios))
                    continue
                pages_g = self._pages[g]  # scratch blocks stay -1
                pages_g.extend([-1] * (nb_new - len(pages_g)))
                for b, pid in zip(blocks, self._new_pages(g, blocks, prios), strict=True):
                    pages_g[b] = pid
        except BaseException:  # (an interrupt, a device error) no beam keeps part of the
            for (pages, _), n in zip(views, lens, strict=True):  # growth: the row is as
                for g, k in n.items():  # before it (in no table yet: no reader to wait)
                    self._levels.change(_arr([p for p in pages[g][k:] if p >= 0]), -1, 0)
                    del pages[g][k:]
            raise
        if history < self._tokens.n:
            self._tokens.truncate(history)
            if len(self._keys) > history // tpb:
                del self._keys[history // tpb:]
                self._cursor = None  # it is past the kept keys: rebuilt at the next commit

    def check_resize(self, capacity: int, history_length: int | None = None) -> None:
        """Raise what ``resize(capacity, history_length)`` raises for its arguments, changing
        nothing (:meth:`Batch.resize <kvcm_core.batch.Batch.resize>` checks every row
        before it resizes any).

        Raises:
            InvalidStateError: the cache is not ACTIVE.
            InvalidArgumentError, ArgumentTypeError: a bad capacity or history length.
        """
        self._ctx.thread.check()
        self._require(CacheStatus.ACTIVE)
        self._resize_history(_check_count("capacity", capacity), history_length)

    def _resize_history(self, capacity: int, history_length: int | None) -> int:
        """The history a resize to ``capacity`` leaves (checked)."""
        if history_length is None:
            history = self._history
        else:
            history = _check_count("history_length", history_length)
            lo = max(self._committed, self._capacity - self._ctx.config.max_rewind_len)
            if not lo <= history <= self._capacity:
                raise InvalidArgumentError(
                    f"history_length={history}: must be in [{lo}, {self._capacity}] "
                    f"(>= num_committed_tokens and old capacity - max_rewind_len, "
                    f"<= old capacity)")
        if capacity < history:
            raise InvalidArgumentError(
                f"capacity={capacity}: must be >= history_length ({history})")
        if history < self._history:
            if self._ctx.ssm_groups:
                raise InvalidArgumentError(
                    f"history_length={history}: a model with SSM layers cannot rewind "
                    f"history (now {self._history}): the live state already holds the "
                    f"tokens up to {self._history} and no earlier state is kept")
            self._check_window_rewind(history)
        return history

    def _check_window_rewind(self, history: int) -> None:
        """A rewind must not need window pages already released. Pages are released once
        stale at ``history - max_rewind_len`` of the highest history reached, so a
        rewind, a step forward and another rewind could reach below that mark, where the
        window at the new history would read released pages: refused."""
        ctx = self._ctx
        for g in ctx.windowed_groups:
            start, stop = ctx.kinds[g].stale_range(history)
            if self._released_to[g] > max(start, stop):
                raise InvalidArgumentError(
                    f"history_length={history}: cache group {g} already released the "
                    f"window pages of blocks below {self._released_to[g]}, which the window "
                    f"at {history} reads; a rewind reaches at most max_rewind_len="
                    f"{ctx.config.max_rewind_len} tokens below the highest history this "
                    "cache reached")

    def _grow_fast(self, capacity: int) -> bool:
        """Growth of a one-group full-attention cache with one beam and no scratch (the
        prefill step): take the new pages at once. False: the general path decides."""
        ctx = self._ctx
        groups = ctx.attn_groups
        if len(groups) != 1 or ctx.ssm_groups or ctx.windowed_groups or \
                not self._scratch_free_path or self.beam_width != 1 or \
                capacity < self._history:  # type: ignore[attr-defined]
            return False
        g = groups[0]
        pages_g = self._pages[g]
        old_nb = len(pages_g)
        nb_new = -(-capacity // self._tpb)
        if nb_new <= old_nb:
            return False
        L = self._levels
        store = L.gpu_store(g)
        n = nb_new - old_nb
        prios = self._priorities(range(old_nb, nb_new))  # type: ignore[attr-defined]
        if n > store.num_free:
            if not L.room(store, n):
                return self._refuse(level_shortage("resize", L, {store.pool_group: n}))
            try:
                L.make_room(store, n)
            except OutOfPagesError as exc:
                return self._refuse(room_failed("resize", exc))
        pages_g.extend(self._new_pages(g, range(old_nb, nb_new), prios))  # type: ignore[attr-defined]
        self._capacity = capacity
        self._changed()
        return True

    # -- Batch.resize's batched growth (one allocation for many caches) -------------------------

    def batch_growth(self, capacity: int, thread_checked: bool = False) -> int:
        """For :meth:`Batch.resize <kvcm_core.batch.Batch.resize>`: ``0`` when the resize
        was done here (the same blocks: only the capacity moves); the number of new pages
        it needs when it is plain growth of a one-group full-attention cache with one beam,
        no scratch and no priority callback (nothing is changed: the batch takes the pages
        of many caches at once and hands them over with :meth:`batch_grow`); ``-1`` when it
        must go through :meth:`resize` (``thread_checked``: the caller checked the thread,
        as ``Batch.resize`` does once for all its rows)."""
        if not thread_checked:
            self._ctx.thread.check()
        tpb = self._tpb
        nb_new = (capacity + tpb - 1) // tpb
        if self._status is not _ACTIVE or capacity < self._history or \
                not self._scratch_free_path:
            return -1
        if nb_new == (self._capacity + tpb - 1) // tpb:
            self._capacity = capacity
            self._last_refusal = None
            return 0
        ctx = self._ctx
        if len(ctx.attn_groups) != 1 or ctx.ssm_groups or ctx.windowed_groups or \
                self._priority_cb is not None or self.beam_width != 1:  # type: ignore[attr-defined]
            return -1
        n = nb_new - len(self._pages[ctx.attn_groups[0]])
        return n if n > 0 else -1

    def batch_grow(self, capacity: int, pids: list[int], thread_checked: bool = False
                   ) -> None:
        """Take ``pids`` (new level-0 pages of the cache's one group, locked once, as many
        as :meth:`batch_growth` asked for) as the blocks after the current ones, and move
        the capacity (``thread_checked``: see :meth:`batch_growth`)."""
        if not thread_checked:
            self._ctx.thread.check()
        self._pages[self._ctx.attn_groups[0]].extend(pids)
        self.stats.allocated_blocks += len(pids)  # type: ignore[attr-defined]
        self.stats.newly_allocated_blocks += len(pids)  # type: ignore[attr-defined]
        self._capacity = capacity
        self._last_refusal = None
        self._changed()

    def _release_limit(self, g: int) -> int:
        """The block where releasing stale window pages of group ``g`` stops now: the
        blocks this cache has yet to publish stay (history moved forward by ``resize``
        ahead of the ``commit`` that gives their tokens), so committed window pages stay
        reusable whatever the order of the engine's calls; the commit that publishes
        them releases them."""
        if self._commit_on and self._ctx.life_cycles[g].publishes:
            return self._published
        return 1 << 62

    def _release_stale(self, moved: bool = True) -> None:
        ctx = self._ctx
        # History moved: this step's scratch pages are spent, and ``scratch()`` turns to
        # None (a change of the tables even when no page is released).
        changed = False
        if moved:
            changed = self._scratch_shown()
            self._scratch_live = False
        keep = max(0, self._history - ctx.config.max_rewind_len)
        for g in ctx.windowed_groups:
            start, stop = ctx.kinds[g].stale_range(keep)
            stop = min(stop, self._release_limit(g))
            lo = max(start, self._released_to[g])
            if stop <= lo:
                continue
            for pages, _ in self._beam_views():
                pages_g = pages[g]
                span = range(min(stop, len(pages_g)) - 1, lo - 1, -1)
                gone = [pages_g[b] for b in span if pages_g[b] >= 0]
                if gone:  # unlocked first: an interrupt while it waits changes nothing
                    self._unlock(_arr(gone))
                    for b in span:
                        pages_g[b] = -1
                    changed = True
            self._released_to[g] = stop
        if changed:
            self._changed()

