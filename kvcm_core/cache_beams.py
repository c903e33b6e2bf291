"""Beam search for a :class:`~kvcm_core.cache.KVCache`: extra beams forked from beam 0."""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np

from kvcm_core.backend import Stream
from kvcm_core.cache_base import CacheBase, CacheStatus
from kvcm_core.errors import (
    ArgumentTypeError,
    InvalidArgumentError,
    InvalidStateError,
    OutOfPagesError,
)
from kvcm_core.kinds import PageList, page_list
from kvcm_core.refusals import level_shortage, room_failed

__all__ = ["BeamsMixin"]


@attrs.define(eq=False)
class _Beam:
    """Pages of one extra beam: shared with beam 0 below the fork, its own from there."""

    fork: int  # history at the fork: positions below were written by beam 0
    pages: list[list[int]]  # per cache group, per block (page id or -1)
    ssm: list[int]  # per cache group: the beam's live SSM state (or -1)


class BeamsMixin(CacheBase):
    """Beams 1.. of a cache (beam 0 is the cache's own pages)."""

    def _init_beams(self) -> None:
        self._beams = []

    @property
    def beam_width(self) -> int:
        return 1 + len(self._beams)

    def beam_fork(self, beam: int) -> int:
        """History length when ``beam`` was forked from beam 0 (0 for beam 0): its tokens
        below that position are beam 0's and their KV pages were written by beam 0."""
        self._check_beam(beam)
        return self._beams[beam - 1].fork if beam else 0

    def _check_beam(self, beam: Any) -> None:
        if isinstance(beam, bool) or not isinstance(beam, int | np.integer):
            raise ArgumentTypeError(f"beam={beam!r}: must be an int in "
                                    f"0..{self.beam_width - 1}")
        if not 0 <= beam < self.beam_width:
            raise InvalidArgumentError(f"beam={beam!r}: must be in 0..{self.beam_width - 1} "
                                       f"(beam width {self.beam_width})")

    def _beam_views(self) -> list[tuple[list[PageList], list[int]]]:
        """Per beam (beam 0 first), its per-group page lists and SSM states."""
        return [(self._pages, self._ssm), *((bm.pages, bm.ssm) for bm in self._beams)]

    def _beam_refs(self) -> list[int]:
        out: list[int] = []
        for bm in self._beams:
            out.extend(p for pages_g in bm.pages for p in pages_g if p >= 0)
            out.extend(p for p in bm.ssm if p >= 0)
        return out

    def _beam_pages(self, beam: int) -> list[list[int]]:
        self._check_beam(beam)
        return self._beams[beam - 1].pages

    def _beam_ssm(self, beam: int) -> list[int]:
        self._check_beam(beam)
        return self._beams[beam - 1].ssm

    def set_beam_width(self, width: int, stream: Stream | None = None) -> bool:
        """Fork beams from beam 0 (or drop the last ones) for beam search.

        New beams share every full block beam 0 has written (below ``history_length //
        tokens_per_block``), get a private copy of the partial block at ``history_length``
        and of the SSM state, and fresh pages for the blocks after it. Dropping beams
        releases their pages. Only beam 0 publishes to the prefix tree (``commit`` takes
        beam 0's tokens). Returns False, with nothing changed, when level 0 cannot provide
        the pages (the reason is then in ``last_refusal``). SWA scratch pages are not used
        with beams.

        ``stream``: the engine's stream (None: the backend's default stream), as for
        ``resize``. The copies of the partial block and of the SSM state are queued on it
        (after beam 0's writes queued there), pages pushed down to make room are copied
        only after its work queued so far, and it is made to wait for those copies, so
        the new beams' pages written on it afterwards never overwrite a slot before its
        old contents were read.
        """
        self._ctx.thread.check()  # before begin(): a refused call touches no fence
        return self._fenced(stream, self._set_beam_width, width, stream)

    def _set_beam_width(self, width: int, stream: Stream | None) -> bool:
        self._require(CacheStatus.ACTIVE)  # type: ignore[attr-defined]
        self._last_refusal = None
        ctx = self._ctx
        L = self._levels
        most = ctx.config.max_beam_width
        if isinstance(width, bool) or not isinstance(width, int | np.integer):
            raise ArgumentTypeError(f"width={width!r}: must be an int in 1..{most}")
        if not 1 <= width <= most:
            raise InvalidArgumentError(f"width={width!r}: must be in 1..{most} "
                                       "(KVCacheManagerConfig.max_beam_width)")
        width = int(width)
        if width < self.beam_width:
            for bm in reversed(self._beams[width - 1:]):
                self._release_beam(bm)
            del self._beams[width - 1:]
            self._changed()
            return True
        if width == self.beam_width:
            return True
        if ctx.scratch_scales:
            raise InvalidStateError("beams are not supported together with SWA scratch pages")
        hist = self._history
        shared_below = hist // self._tpb  # full blocks beam 0 has written
        tail = shared_below if hist % self._tpb else -1
        new = width - self.beam_width
        needs: dict[int, int] = {}
        plan: dict[int, list[int]] = {}
        for g in ctx.attn_groups:
            own = [b for b, p in enumerate(self._pages[g]) if p >= 0 and b >= shared_below]
            plan[g] = own
            if own:
                pg = L.pool_group_of(g)
                needs[pg] = needs.get(pg, 0) + new * len(own)
        for g in ctx.ssm_groups:
            if self._ssm[g] >= 0:
                pg = L.pool_group_of(g)
                needs[pg] = needs.get(pg, 0) + new
        blocks = [b for own in plan.values() for b in own]
        if any(self._ssm[g] >= 0 for g in ctx.ssm_groups):
            blocks.append(-1)  # the copies of the SSM state
        prios = self._priorities(blocks)  # type: ignore[attr-defined]
        if not L.can_take(needs):
            return self._refuse(level_shortage("set_beam_width", L, needs))
        try:  # all the room first: a failed write then leaves the cache as it was
            L.make_room_for(needs)
        except OutOfPagesError as exc:
            return self._refuse(room_failed("set_beam_width", exc))
        ngroups = len(ctx.life_cycles)
        old_beams = len(self._beams)
        try:
            for _ in range(new):
                beam = _Beam(hist, [], [-1] * ngroups)
                self._beams.append(beam)  # filled in place: an error releases what it has
                for g in range(ngroups):
                    base = self._pages[g]
                    pages_g = page_list(p if b < shared_below else -1 for b, p in enumerate(base))
                    shared = np.asarray([p for p in pages_g if p >= 0], dtype=np.int64)
                    L.change(shared, 1, 0)
                    beam.pages.append(pages_g)
                    own = plan.get(g, [])
                    if own:
                        fresh = self._new_pages(g, own, prios)  # type: ignore[attr-defined]
                        for b, pid in zip(own, fresh, strict=True):
                            pages_g[b] = pid
                        if tail in own and base[tail] >= 0:
                            L.copy_blocks(g, np.asarray([pages_g[tail]]),
                                          np.asarray([base[tail]]), stream)
                for g in ctx.ssm_groups:
                    live = self._ssm[g]
                    if live >= 0:
                        pid = self._new_pages(g, [-1], prios)[0]  # type: ignore[attr-defined]
                        beam.ssm[g] = pid
                        L.copy_blocks(g, np.asarray([pid]), np.asarray([live]), stream)
        except BaseException:  # (a backend error, an interrupt) the new beams go again
            for bm in reversed(self._beams[old_beams:]):
                self._release_beam(bm)
            del self._beams[old_beams:]
            raise
        self._changed()
        return True

    def _unshare_plan(self, history: int, nb_new: int) -> list[tuple[_Beam, int, int]]:
        """The (beam, group, block) whose page a rewind of history to ``history`` must
        unshare: blocks a beam shares with beam 0 below its fork that the beams will write
        again (from the block of ``history`` on, within the ``nb_new`` kept blocks)."""
        out = []
        lo = history // self._tpb
        for bm in self._beams:
            hi = min(bm.fork // self._tpb, nb_new)
            for g in self._ctx.attn_groups:
                base, mine = self._pages[g], bm.pages[g]
                out.extend((bm, g, b) for b in range(lo, min(hi, len(mine)))
                           if mine[b] >= 0 and mine[b] == base[b])
        return out

    def _unshare(self, plan: list[tuple[_Beam, int, int]], history: int,
                 prios: dict[int, int], stream: Stream | None = None) -> None:
        """Give each beam of ``plan`` its own page for its block (a copy where the block
        holds tokens below ``history``, queued on ``stream``, the engine's), and move
        every fork down to ``history`` (the beams write their own tokens from there):
        shared pages are never written. The room was made."""
        L = self._levels
        tpb = self._tpb
        if plan:
            self._wait_readers()  # (once: the unlocks below then never wait)
        for bm, g, b in plan:
            old = bm.pages[g][b]
            pid = self._new_pages(g, [b], prios)[0]  # type: ignore[attr-defined]
            if b * tpb < history:
                try:
                    L.copy_blocks(g, np.asarray([pid]), np.asarray([old]), stream)
                except BaseException:  # the new page goes again; the beam keeps ``old``
                    self._unlock(np.asarray([pid]))
                    raise
            self._unlock(np.asarray([old]))
            bm.pages[g][b] = pid
        for bm in self._beams:
            bm.fork = min(bm.fork, history)

    def _grow_beams(self, grow: dict[int, list[int]], prios: dict[int, int]) -> None:
        for bm in self._beams:
            for g, blocks in grow.items():
                bm.pages[g].extend(self._new_pages(g, blocks, prios))  # type: ignore[attr-defined]

    def _release_beam(self, beam: _Beam) -> None:
        refs = [p for pages_g in beam.pages for p in reversed(pages_g) if p >= 0]
        refs += [p for p in beam.ssm if p >= 0]
        arr = np.asarray(refs, dtype=np.int64)
        if self._status is CacheStatus.ACTIVE:
            self._unlock(arr)
        else:
            self._levels.change(arr, 0, -1)

    def _release_beams(self) -> None:
        for bm in reversed(self._beams):
            self._release_beam(bm)
        self._beams.clear()

    def _beam_table(self, group: int, beam: int) -> np.ndarray:
        """Page table of an extra beam (built on each call: beams are short-lived)."""
        bm = self._beams[beam - 1]
        nb = (self._capacity + self._tpb - 1) // self._tpb
        return self._table(group, bm.pages[group], bm.ssm[group], nb)  # type: ignore[attr-defined]
