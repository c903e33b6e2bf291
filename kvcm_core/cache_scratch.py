"""SWA scratch pages of a :class:`~kvcm_core.cache.KVCache` during chunked prefill
(:mod:`kvcm_core.scratch`, docs/semantics.md)."""

from __future__ import annotations

from typing import Any

import numpy as np

from kvcm_core.cache_base import CacheBase, CacheStatus
from kvcm_core.scratch import ScratchDesc, scratch_slots_needed

__all__ = ["ScratchMixin"]


class ScratchMixin(CacheBase):
    """Per scratch group: this cache's scratch slots and this step's scratch range."""

    def _init_scratch(self, ctx: Any) -> None:
        # Per group, this cache's scratch slots (page ids) and the scratch blocks
        # [begin, end) of the current step (live until history moves).
        self._scratch_slots: dict[int, list[int]] = {}
        self._scratch_range: dict[int, tuple[int, int]] = {}
        self._scratch_live = False
        # Per group, the end of the highest scratch range this cache had: blocks without
        # a page that history needs (spent or dropped scratch pages) lie below it.
        self._scratch_hi: dict[int, int] = {}
        # False when resize must always take the full path (SWA scratch bookkeeping).
        self._scratch_free_path = ctx.config.swa_scratch is None

    def scratch(self, group: int) -> ScratchDesc | None:
        """This step's scratch blocks of one cache group, or None (no scratch blocks this
        step, the group has no scratch, or history moved past the step).

        Scratch blocks show ``BAD_PAGE_INDEX`` in :meth:`get_base_page_indices`; a
        buffer's page indices for them come from
        ``manager.get_page_index_converter(layer_id, role).convert(table, desc)``.
        """
        self._check_group(group)
        rng = self._scratch_range.get(int(group))
        if rng is None or rng[1] <= rng[0] or not self._scratch_live or \
                self._status is not CacheStatus.ACTIVE:
            return None
        sc = self._ctx.config.swa_scratch
        assert sc is not None
        slots = self._arena.slot[np.asarray(self._scratch_slots[group], dtype=np.int64)]
        return ScratchDesc(rng[0], rng[1], tuple(int(s) for s in slots),
                           sc.scratch_pages_per_block)

    def scratch_page_ids(self, group: int) -> list[int]:
        """Page ids of this cache's scratch slots of one cache group (kept across steps
        until a step needs none, or suspend/close); for tests and debugging."""
        self._check_group(group)
        return list(self._scratch_slots.get(int(group), ()))

    def _scratch_span(self, g: int, capacity: int, history: int, nb: int) -> tuple[int, int]:
        """The scratch blocks ``[begin, end)`` of scratch group ``g`` at ``resize(capacity)``
        with history ``history`` (``nb``: the block count of ``capacity``); ``(0, 0)``: none.

        New blocks (first token at or after ``history``) stale at ``max(0, capacity -
        max_rewind_len)`` (never sinks), at most what ``max_scratch_slots`` hold."""
        ctx = self._ctx
        start, stop = ctx.kinds[g].stale_range(max(0, capacity - ctx.config.max_rewind_len))
        begin = max(-(-history // self._tpb), start)
        end = min(stop, nb, begin + ctx.scratch_max_blocks[g])
        return (begin, end) if end > begin else (0, 0)

    def _scratch_fill(self, g: int, history: int, nb: int, span: tuple[int, int]) -> list[int]:
        """Blocks of scratch group ``g`` below ``nb`` (and the blocks it has) that hold no
        page although history ``history`` needs them or a step writes them, outside the
        scratch ``span``: blocks whose scratch page was spent (a commit short of the chunk,
        then perhaps a rewind into them) or dropped (``suspend``). The resize gives them
        pages; those holding history are listed by ``recompute_blocks``. Only such blocks
        lack a page there (the others were released as stale), so only the window and the
        blocks after it, below the highest scratch range's end, are looked at."""
        pages_g = self._pages[g]
        lo = self._ctx.kinds[g].stale_range(history)[1]
        hi = min(len(pages_g), nb, self._scratch_hi.get(g, 0))
        if lo >= hi or -1 not in pages_g[lo:hi]:
            return []
        begin, end = span
        return [b for b in range(lo, hi) if pages_g[b] < 0 and not begin <= b < end]

    def _scratch_pages_needed(self, g: int, capacity: int, nb: int) -> int:
        """Level-0 pages ``resize(capacity)`` takes for scratch group ``g`` (``nb``: the
        block count of ``capacity``), after the ``resume`` of a suspended cache: its new
        blocks outside the scratch span, the blocks :meth:`_scratch_fill` gives a page
        again and the scratch slots it takes (pages a window releases not subtracted)."""
        ctx = self._ctx
        sc = ctx.config.swa_scratch
        assert sc is not None
        h = self._history
        span = self._scratch_span(g, capacity, h, nb)
        begin, end = span
        have = len(self._pages[g])
        new = max(0, nb - have) - max(0, min(end, nb) - max(begin, have))
        fill = self._scratch_fill(g, h, nb, span)
        if fill and self._status is CacheStatus.SUSPENDED:  # resume gives the others
            r0, r1 = self._scratch_span(g, self._capacity, h, self.num_blocks)
            fill = [b for b in fill if r0 <= b < r1]
        take = scratch_slots_needed(end - begin, sc.scratch_pages_per_block,
                                    ctx.scratch_scales[g]) - len(self._scratch_slots.get(g, ()))
        return new + len(fill) + max(0, take)

    def _note_recompute(self, g: int, blocks: list[int], history: int) -> None:
        """List for ``recompute_blocks`` the ``blocks`` (given fresh pages) holding history."""
        listed = self._recompute.setdefault(g, [])
        for b in blocks:
            if b * self._tpb < history and b not in listed:
                listed.append(b)
                self._unwritten = True

    def _plan_scratch(self, capacity: int, history: int, nb_new: int,
                      releases: list[tuple[int, int]], grow: dict[int, list[int]],
                      needs: dict[int, int]) -> dict[int, tuple[int, int, int, int, list[int]]]:
        """Plan this step's scratch blocks per scratch group, adjusting ``releases``,
        ``grow`` and ``needs`` of :meth:`resize` in place. Returns ``group -> (begin, end,
        scratch slots to take, scratch slots to drop, blocks to give a page again)``.

        Scratch blocks: :meth:`_scratch_span`; the rest get ordinary pages, and so do the
        blocks :meth:`_scratch_fill` finds."""
        ctx = self._ctx
        sc = ctx.config.swa_scratch
        assert sc is not None
        released = set(releases)
        plan: dict[int, tuple[int, int, int, int, list[int]]] = {}
        for g in ctx.scratch_groups:
            pages_g = self._pages[g]
            old_nb = len(pages_g)
            pg = self._levels.pool_group_of(g)
            begin, end = self._scratch_span(g, capacity, history, nb_new)
            k = scratch_slots_needed(end - begin, sc.scratch_pages_per_block,
                                     ctx.scratch_scales[g])
            have = len(self._scratch_slots.get(g, ()))
            # Blocks of the range hold no page: pages they still have (an earlier resize of
            # this step) hold nothing needed (they start at or after history).
            for b in range(begin, min(end, old_nb)):
                if pages_g[b] >= 0 and (g, b) not in released:
                    releases.append((g, b))
                    released.add((g, b))
            if g in grow:
                kept = [b for b in grow[g] if not begin <= b < end]
                needs[pg] -= len(grow[g]) - len(kept)
                grow[g] = kept
            fill = self._scratch_fill(g, history, nb_new, (begin, end))
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
        L = self._levels
        shown = self._scratch_shown()
        changed = False
        for g, (begin, end, take, drop, fill) in plan.items():
            slots = self._scratch_slots.setdefault(g, [])
            if drop:
                self._unlock(np.asarray(slots[::-1], dtype=np.int64))
                slots.clear()
                changed = True
            if take:
                slots.extend(L.take(g, take).tolist())
                changed = True
            if self._scratch_range.get(g, (0, 0)) != (begin, end):
                changed = True
            self._scratch_range[g] = (begin, end)
            if end > self._scratch_hi.get(g, 0):
                self._scratch_hi[g] = end
            self._note_recompute(g, fill, history)  # their tokens were lost with the page
        self._scratch_live = True
        if changed or shown != self._scratch_shown():  # scratch() turned on
            self._changed()

    def _scratch_shown(self) -> bool:
        """Whether :meth:`scratch` names scratch blocks for some group now (a change of it
        is a change of the page tables the engine reads)."""
        return self._scratch_live and any(e > b for b, e in self._scratch_range.values())

    def _drop_scratch(self) -> None:
        """Release every scratch slot (suspend, close)."""
        for slots in self._scratch_slots.values():
            if slots:
                self._unlock(np.asarray(slots[::-1], dtype=np.int64))
            slots.clear()
        if self._scratch_range:
            self._scratch_range.clear()
            self._changed()
        self._scratch_live = False

    # -- page tables ---------------------------------------------------------------------------

