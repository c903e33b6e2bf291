"""What a prefix match offers the non-REQUIRED cache groups of a
:class:`~kvcm_core.cache.KVCache`, and the client's OPTIONAL choice at the first resume
(docs/semantics.md)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import attrs
import numpy as np

from kvcm_core.cache_base import CacheBase, CacheStatus
from kvcm_core.errors import ArgumentTypeError, InvalidArgumentError
from kvcm_core.kinds import PageList
from kvcm_core.types import ReusePolicy

__all__ = ["CacheStatus", "ReuseMixin", "ReuseStatus"]


@attrs.frozen
class ReuseStatus:
    """What the prefix match offers one non-REQUIRED cache group.

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


class ReuseMixin(CacheBase):
    """Reuse status per group, the OPTIONAL decision and recompute lists."""

    _ctx: Any
    _levels: Any
    _arena: Any
    _tpb: int
    _pages: list[PageList]
    _pending: list[tuple[int, int, int]]
    _reuse_status: dict[int, ReuseStatus]
    _optional_decided: bool
    _selected: set[int]
    _first_resume_done: bool
    _recompute: dict[int, list[int]]

    def _init_reuse(self, end: int) -> None:
        self._reuse_status = {}
        self._optional_decided = False
        self._selected = set()
        self._first_resume_done = False
        self._recompute = {}
        self._unwritten = False
        for g, lc in enumerate(self._ctx.life_cycles):
            if lc.policy is not ReusePolicy.REQUIRED:
                self._reuse_status[g] = self._status_of(g, end)

    @property
    def reuse_status(self) -> dict[int, ReuseStatus]:
        """Per non-REQUIRED cache group, what the match offers (see :class:`ReuseStatus`)."""
        return dict(self._reuse_status)

    def _status_of(self, g: int, end: int) -> ReuseStatus:
        kind = self._ctx.kinds[g]
        lc = kind.lc
        tpb = self._tpb
        if kind.is_ssm:
            have = any(grp == g for grp, _, _ in self._pending)
            return ReuseStatus(lc.policy, have or end == 0, end,
                               ((0, end),) if have and end else ())
        start, stop = kind.stale_range(end)
        pending = {b for grp, b, _ in self._pending if grp == g}
        ranges: list[list[int]] = []
        complete = True
        for b in range(-(-end // tpb)):
            if start <= b < stop:
                continue
            if self._pages[g][b] < 0 and b not in pending:
                complete = False
                continue
            lo, hi = b * tpb, min(end, (b + 1) * tpb)
            if ranges and ranges[-1][1] == lo:
                ranges[-1][1] = hi
            else:
                ranges.append([lo, hi])
        return ReuseStatus(lc.policy, complete, end, tuple((a, b) for a, b in ranges))

    def recompute_blocks(self, group: int) -> list[int]:
        """Blocks (``-1``: the SSM state) whose pages were given fresh although history
        covers them: the engine must recompute or reconstruct them. At the first resume:
        declined OPTIONAL groups, missing SINK_REQUIRED_ONLY window pages, PRIVATE state.
        With SWA scratch, at any later resize or resume too: blocks whose scratch page was
        spent by a commit short of the chunk, given a page again once history (or a
        rewind) needs them. The list is kept for the cache's life (a later call returns
        it again), less the blocks that have no page any more (gone stale out of a window:
        they show ``BAD_PAGE_INDEX`` and need nothing) or that start at or after history
        (after a rewind: the step writes them)."""
        self._check_group(group)
        pages = self._pages[group]
        end = self._history
        tpb = self._tpb
        return [b for b in self._recompute.get(group, ())
                if b < 0 or (b < len(pages) and pages[b] >= 0 and b * tpb < end)]

    def _decide_optional(self, selected: Sequence[int] | None) -> list[tuple[int, int, int]]:
        """Validate the OPTIONAL choice; return the claims to give up ``(group, block,
        page)`` (block -1: a pending copy or SSM snapshot). Raises ValueError, with nothing
        changed, for a REQUIRED, unknown or incomplete group."""
        if selected is not None and (isinstance(selected, str | bytes) or
                                     not isinstance(selected, Iterable)):
            raise ArgumentTypeError(f"optional_reuse_groups={selected!r}: must be a sequence of "
                                    "cache group ids, or None")
        ngroups = len(self._ctx.life_cycles)
        optional = {g for g, st in self._reuse_status.items()
                    if st.policy is ReusePolicy.OPTIONAL}
        if self._optional_decided:
            if selected is not None and set(selected) != self._selected:
                raise InvalidArgumentError(
                    f"optional_reuse_groups={list(selected)!r}: the choice was made at the "
                    f"first resume ({sorted(self._selected)}) and cannot change")
            return []
        chosen = set()
        for g in selected or ():
            if isinstance(g, bool) or not isinstance(g, int | np.integer) or not (
                    0 <= g < ngroups):
                raise InvalidArgumentError(f"optional_reuse_groups: {g!r} is not a cache group id "
                                 f"(0..{ngroups - 1})")
            if g not in optional:
                raise InvalidArgumentError(
                    f"optional_reuse_groups: group {g} has policy "
                    f"{self._ctx.life_cycles[g].policy.name}; only OPTIONAL groups can be "
                    f"chosen (OPTIONAL groups: {sorted(optional)})")
            if not self._reuse_status[g].complete:
                raise InvalidArgumentError(
                    f"optional_reuse_groups: group {g} is incomplete (coverage "
                    f"{self._reuse_status[g].coverage} of endpoint "
                    f"{self._reuse_status[g].endpoint}); it cannot be reused")
            chosen.add(int(g))
        declined: list[tuple[int, int, int]] = []
        for g in sorted(optional - chosen):
            for b, pid in enumerate(self._pages[g]):
                if pid >= 0:
                    declined.append((g, b, pid))
            declined.extend((grp, -1, p) for grp, _, p in self._pending if grp == g)
        self._selected = chosen
        return declined

    def _release_declines(self, declined: list[tuple[int, int, int]],
                          ) -> list[tuple[int, int, int]]:
        """Give up declined claims before allocating their replacements (their pages
        become droppable: room for the replacements); returns the pending copies as they
        were, for :meth:`_restore_declines`."""
        pending = list(self._pending)
        if not declined:
            return pending
        gone = {p for _, _, p in declined}
        for g, b, pid in declined:
            if b >= 0 and self._pages[g][b] == pid:
                self._pages[g][b] = -1
        self._levels.change(np.asarray([p for _, _, p in declined], dtype=np.int64), 0, -1)
        self._pending = [(g, b, p) for g, b, p in pending if p not in gone]
        return pending

    def _restore_declines(self, declined: list[tuple[int, int, int]],
                          pending: list[tuple[int, int, int]]) -> None:
        """Undo :meth:`_release_declines` after a refused or interrupted resume: the claims
        come back, held again, wherever their pages went meanwhile. A page dropped
        meanwhile (it was droppable) is gone: its block stays without a page and is
        recomputed if a later resume reuses its group (:meth:`recompute_blocks`)."""
        if not declined:
            return
        a = self._arena
        pids = np.asarray([p for _, _, p in declined], dtype=np.int64)
        alive = (a.store[pids] >= 0) | (a.locks[pids] + a.holds[pids] > 0)
        self._levels.change(pids[alive], 0, 1)
        back = set(pids[alive].tolist())
        for g, b, pid in declined:
            if b >= 0 and pid in back and self._pages[g][b] < 0:
                self._pages[g][b] = pid
        gone = set(pids.tolist()) - back
        self._pending = [(g, b, p) for g, b, p in pending if p not in gone]
        for g in {g for g, _, p in declined if p in gone}:  # the offer shrank
            self._reuse_status[g] = self._status_of(g, self._reuse_status[g].endpoint)

    def _reuse_claims(self) -> list[tuple[int, list[int], int]]:
        """The chosen OPTIONAL groups' claims, as ``(group, levels, partial)``: the level
        each claimed page is reused from, and how many of them are partial blocks (an
        attention group's pending copy; an SSM snapshot counts as a full block). Taken
        once the declined claims are given up and before any page is added;
        :meth:`_count_optional_reuse` counts them when the first resume succeeds. Empty
        once the choice is final."""
        if self._optional_decided:
            return []
        level = self._arena.level
        out = []
        for g in self._selected:
            claimed = [p for p in self._pages[g] if p >= 0]
            pending = [(b, p) for grp, b, p in self._pending if grp == g]
            claimed += [p for _, p in pending]
            out.append((g, [int(level[p]) for p in claimed],
                        sum(1 for b, _ in pending if b >= 0)))
        return out

    def _count_optional_reuse(self, claims: list[tuple[int, list[int], int]]) -> None:
        """The OPTIONAL choice is final (the first resume succeeded): count the chosen
        groups' ``claims`` (:meth:`_reuse_claims`) in the statistics; declined groups
        count nothing."""
        stats = self._levels.stats
        for g, levels, partial in claims:
            stats.groups[g].reused_full_blocks += len(levels) - partial
            stats.groups[g].reused_partial_blocks += partial
            self.stats.reused_blocks += len(levels)  # type: ignore[attr-defined]
            self.stats.allocated_blocks += len(levels)  # type: ignore[attr-defined]
            for lv in levels:
                stats.reused_blocks_by_level[lv] += 1
        self._optional_decided = True
