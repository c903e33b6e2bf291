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

    def _plan_scratch(self, capacity: int, history: int, nb_new: int,
                      releases: list[tuple[int, int]], grow: dict[int, list[int]],
                      needs: dict[int, int]) -> dict[int, tuple[int, int, int, int, list[int]]]:
        """Plan this step's scratch blocks per scratch group, adjusting ``releases``,
        ``grow`` and ``needs`` of :meth:`resize` in place. Returns ``group -> (begin, end,
        scratch slots to take, scratch slots to drop, blocks to give a page again)``.

        Scratch blocks: new blocks (first token at or after ``history``) stale at
        ``max(0, capacity - max_rewind_len)`` (never sinks), at most what
        ``max_scratch_slots`` hold; the rest get ordinary pages."""
        ctx = self._ctx
        tpb = self._tpb
        sc = ctx.config.swa_scratch
        assert sc is not None
        keep_c = max(0, capacity - ctx.config.max_rewind_len)
        first_new = -(-history // tpb)
        released = set(releases)
        plan: dict[int, tuple[int, int, int, int, list[int]]] = {}
        for g in ctx.scratch_groups:
            kind = ctx.kinds[g]
            pages_g = self._pages[g]
            old_nb = len(pages_g)
            pg = self._levels.pool_group_of(g)
            start, stop = kind.stale_range(keep_c)
            begin = max(first_new, start)
            end = min(stop, nb_new, begin + ctx.scratch_max_blocks[g])
            if end <= begin:
                begin = end = 0
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
            # Blocks an earlier range left without a page that are needed again.
            s_h, e_h = kind.stale_range(history)
            ob, oe = self._scratch_range.get(g, (0, 0))
            fill = [b for b in range(ob, min(oe, old_nb, nb_new))
                    if pages_g[b] < 0 and not s_h <= b < e_h and not begin <= b < end]
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
            for b in fill:
                if b * self._tpb < history:  # its tokens were lost with the scratch page
                    self._recompute.setdefault(g, []).append(b)
                    self._unwritten = True
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

