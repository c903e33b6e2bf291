"""Sparse layers in the fingerprint engine and the engine loop.

A model with sparse layers writes a step's new tokens into GPU entries (the batch's write
map), selects units with an indexer, resolves and fetches them, and reads entries; the
history reaches the host pages only through flushes. :class:`SparseSteps` plays that
model around :class:`~kvcm_core.testing.engine.EngineLoop`:

- ``write``: the records of ``[history, capacity)`` of every sparse buffer go into the
  entries of the write map (the dense buffers and the host pages are the fingerprint
  engine's usual business);
- ``select``: per selection group a drifting top-k selection over each row's units, one
  resolve, one fetch per layer, then a check that every selected entry of every buffer of
  every layer of the group holds exactly its unit's records (tokens below capacity);
- ``flush``: after the commits, the units the history crossed go back to the host pages,
  which the next step's fingerprint check reads.

Alongside, an exact LRU model (:class:`~kvcm_core.testing.sparse_oracle.LruOracle`) per
lease and group replays the same pins and resolves, so the batch's hit and miss counts
must equal it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from kvcm_core.backend import FingerprintPages
from kvcm_core.testing.fingerprint import FingerprintMismatch, StepWork, token_ids
from kvcm_core.testing.sparse_oracle import LruOracle

__all__ = ["SparseSteps"]


class SparseSteps:
    """The sparse half of a model step (see module docstring).

    Args:
        engine: the fingerprint engine (its batch must be set).
        seed: seeds the selections.
        keep: share of a row's selection kept from one step to the next.
    """

    def __init__(self, engine: Any, seed: int = 0, keep: float = 0.7) -> None:
        self.engine = engine
        self.batch = engine.batch
        self.backend = engine.backend
        self.rng = np.random.default_rng(seed)
        self.keep = keep
        m = engine.manager
        self.groups: dict[Any, list[int]] = {}  # selection key -> layers
        self.settings: dict[Any, Any] = {}
        for layer in m.config.layers:
            sp = getattr(layer, "sparse", None)
            if sp is None:
                continue
            key = ("layer", layer.layer_id) if sp.selection_id is None else sp.selection_id
            self.groups.setdefault(key, []).append(layer.layer_id)
            self.settings[key] = sp
        for layer in m.config.layers:
            for buf in layer.buffers:
                if getattr(buf, "is_sparse", False) and buf.size % m.tokens_per_block:
                    raise ValueError(f"layer {layer.layer_id}/{buf.role}: sparse "
                                     "fingerprints need sizes that are a multiple of "
                                     "tokens_per_block (whole bytes per token)")
                if getattr(buf, "is_sparse", False) and not layer.effective_exact(buf):
                    # Entries hold records and are checked exactly; the fingerprint
                    # engine would check the host pages as typed values.
                    raise ValueError(f"layer {layer.layer_id}/{buf.role}: the sparse steps "
                                     f"write fingerprint records, so a sparse buffer must be "
                                     f"exact (dtype {buf.dtype!r} without exact=True is a "
                                     "lossy-typed buffer)")
        self.ordinals = {(layer.layer_id, b.role): i for layer in m.config.layers
                         for i, b in enumerate(layer.buffers)
                         if getattr(b, "is_sparse", False)}
        self._last: dict[tuple[Any, int], np.ndarray] = {}  # (group, lease) -> selection
        self._oracles: dict[tuple[Any, int], LruOracle] = {}
        self._marks: dict[int, tuple[int, int]] = {}  # lease -> (history, capacity)
        self.hits = self.misses = 0
        self.checked_entries = 0
        engine.entry_writer = self  # the engine leaves sparse host pages to us

    @property
    def max_chunk(self) -> int:
        """The most tokens a row may take in one step (units in flight must leave
        ``num_selected`` entries free)."""
        return min((sp.working_set_units - sp.num_selected - 1) * sp.unit_tokens
                   for sp in self.settings.values())

    # -- the oracle's view of pins --------------------------------------------------------

    def _seated(self) -> list[tuple[int, int, Any]]:
        b = self.batch
        return [(r, b.sparse_lease(r), c) for r, c in enumerate(b.members) if c is not None]

    def published(self, changed_rows: Any = None) -> None:
        """Replay the pin of a publish in the oracle (called after ``Batch.publish``)."""
        moved = False
        for _, lease, cache in self._seated():
            old = self._marks.get(lease)
            if old is None:
                for key, sp in self.settings.items():
                    self._oracles[(key, lease)] = LruOracle(
                        sp.working_set_units,
                        self.batch.max_blocks_per_row * (self.engine.tpb // sp.unit_tokens))
                self._marks[lease] = (cache.history_length, cache.history_length)
                moved = True
            if self._marks[lease][1] != cache.capacity:
                moved = True
        if moved:
            for _, lease, cache in self._seated():
                self._marks[lease] = (self._marks[lease][0], cache.capacity)
            self._pin()

    def _pin(self) -> None:
        for _, lease, _ in self._seated():
            h, c = self._marks[lease]
            for key, sp in self.settings.items():
                self._oracles[(key, lease)].pin(h, c, sp.unit_tokens)

    def left(self, lease: int) -> None:
        """A row gave its lease back: a new seat starts it afresh."""
        self._marks.pop(lease, None)
        for key in self.settings:
            self._oracles.pop((key, lease), None)
            self._last.pop((key, lease), None)

    # -- writes -----------------------------------------------------------------------------

    def _entry_pages(self, rows: Sequence[tuple[Any, ...]], layers: Sequence[int], lo_of: Any,
                     hi_of: Any) -> FingerprintPages | None:
        """Fingerprint pages of entries: ``rows`` of (row, lease, cache, units, entries,
        tokens); each unit's record slots ``[lo_of(cache), hi_of(cache))`` (tokens)."""
        addr: list[np.ndarray] = []
        tok: list[np.ndarray] = []
        begin: list[np.ndarray] = []
        end: list[np.ndarray] = []
        pos: list[np.ndarray] = []
        tags: list[np.ndarray] = []
        nbytes: list[np.ndarray] = []
        slots: list[np.ndarray] = []
        for _, lease, cache, units, ents, tokens in rows:
            if not len(units):
                continue
            for layer in layers:
                ut = self._unit_tokens(layer)
                for role, cells in self._cells(layer).items():
                    ub, upp = cells.unit_bytes, cells.units_per_page
                    cell = lease * cells.lease_cells + ents // upp
                    addr.append(cells.cells.buffer.ptr + cells.cells.offset
                                + cell * cells.cells.stride + (ents % upp) * ub)
                    first = units * ut
                    ids = np.zeros((len(units), ut), dtype=np.uint32)
                    known = token_ids(tokens, min(len(tokens), cache.capacity))
                    for j in range(ut):
                        at = first + j
                        ok = at < len(known)
                        ids[ok, j] = known[at[ok]]
                    tok.append(ids)
                    begin.append(np.clip(lo_of(cache) - first, 0, ut).astype(np.int32))
                    end.append(np.clip(hi_of(cache) - first, 0, ut).astype(np.int32))
                    pos.append(first.astype(np.int64))
                    tag = np.array([layer, self.ordinals[(layer, role)] << 16], dtype=np.uint32)
                    tags.append(np.broadcast_to(tag, (len(units), 2)))
                    nbytes.append(np.full(len(units), ub, dtype=np.int64))
                    slots.append(np.full(len(units), ut, dtype=np.int32))
        if not addr:
            return None
        width = max(t.shape[1] for t in tok)
        tok = [np.pad(t, ((0, 0), (0, width - t.shape[1]))) for t in tok]
        return FingerprintPages(
            addresses=np.concatenate(addr).astype(np.int64),
            page_bytes=np.concatenate(nbytes), record_slots=np.concatenate(slots),
            token_ids=np.concatenate(tok), begin=np.concatenate(begin),
            end=np.concatenate(end), positions=np.concatenate(pos),
            tags=np.concatenate(tags).astype(np.uint32))

    def _cells(self, layer: int) -> dict[str, Any]:
        roles = [r for (lid, r) in self.ordinals if lid == layer]
        return {r: self.batch.sparse_cells(layer, r) for r in roles}

    def _unit_tokens(self, layer: int) -> int:
        return next(self.settings[k].unit_tokens for k, ls in self.groups.items()
                    if layer in ls)

    def write_entries(self, work: Sequence[StepWork]) -> int:
        """Write ``[history, capacity)`` of every sparse buffer into its write-map entries;
        returns the entries written."""
        by_cache = {id(w.cache): w for w in work}
        written = 0
        for key, layers in self.groups.items():
            sp = self.settings[key]
            wmap = self.batch.read_sparse_table(layers[0], "write_map")
            rows = []
            for r, lease, cache in self._seated():
                w = by_cache.get(id(cache))
                if w is None or cache.capacity <= cache.history_length:
                    continue
                lo = cache.history_length // sp.unit_tokens
                n = -(-cache.capacity // sp.unit_tokens) - lo
                ents = wmap[r, :n].astype(np.int64)
                if (ents < 0).any():
                    raise FingerprintMismatch(f"row {r}: in-flight units {lo}..{lo + n - 1} "
                                              f"have no entry in the write map {wmap[r]}")
                rows.append((r, lease, cache, np.arange(lo, lo + n), ents, w.tokens))
            pages = self._entry_pages(rows, layers, lambda c: c.history_length,
                                      lambda c: c.capacity)
            if pages is not None:
                self.backend.fingerprint_write(pages, self.engine.stream)
                written += len(pages)
        return written

    # -- select, resolve, fetch, check --------------------------------------------------------

    def _select(self, key: Any, lease: int, units: int, ns: int) -> np.ndarray:
        """A drifting top-k of ``units`` units (``-1`` padded; a duplicate now and then)."""
        last = self._last.get((key, lease), np.empty(0, dtype=np.int64))
        last = last[(last >= 0) & (last < units)]
        keep = last[self.rng.random(len(last)) < self.keep]
        pool = np.setdiff1d(np.arange(units), keep)
        fresh = self.rng.choice(pool, min(len(pool), ns - len(keep)), replace=False)
        sel = np.full(ns, -1, dtype=np.int64)
        pick = np.concatenate([keep, fresh])[:ns]
        self.rng.shuffle(pick)
        sel[: len(pick)] = pick
        if len(pick) >= 2 and len(pick) < ns and self.rng.random() < 0.3:
            sel[len(pick)] = pick[0]  # a duplicate counts once
        self._last[(key, lease)] = sel
        return sel

    def select(self, work: Sequence[StepWork]) -> None:
        """Every selection group: select, resolve, fetch for each layer, check the entries.

        Raises:
            FingerprintMismatch: an entry does not hold its unit, or the counts differ from
                the exact LRU.
        """
        by_cache = {id(w.cache): w for w in work}
        for key, layers in self.groups.items():
            sp = self.settings[key]
            sel = np.full((self.batch.max_rows, sp.num_selected), -1, dtype=np.int32)
            rows = []
            for r, lease, cache in self._seated():
                if id(cache) not in by_cache:
                    continue
                units = -(-cache.capacity // sp.unit_tokens)
                sel[r] = self._select(key, lease, units, sp.num_selected)
                rows.append((r, lease, cache))
            if not rows:
                continue
            if len(layers) == 1:  # a lone selection: resolve and fetch fused
                self.batch.fetch_sparse_pages(layers[0], sel, stream=self.engine.stream)
            else:
                # Any layer of the group names it; everything on the engine's stream.
                self.batch.resolve_sparse_selection(layers[-1], sel, self.engine.stream)
                for layer in layers:
                    self.batch.fetch_resolved_pages(layer, stream=self.engine.stream)
            self._check(key, layers, sel, rows, by_cache)

    def _check(self, key: Any, layers: list[int], sel: np.ndarray,
               rows: list[tuple[int, int, Any]], by_cache: dict[int, StepWork]) -> None:
        emap = self.batch.read_sparse_table(layers[0], "entry_map")
        check_rows = []
        for r, lease, cache in rows:
            h, c = self._marks[lease]
            lo = h // self.settings[key].unit_tokens
            hi = -(-c // self.settings[key].unit_tokens) if c > h else lo
            res = self._oracles[(key, lease)].resolve(sel[r].tolist(), range(lo, hi))
            if list(emap[r]) != res.entry_map:
                raise FingerprintMismatch(f"row {r}: entry map {emap[r].tolist()} is not the "
                                          f"exact LRU's {res.entry_map}")
            self.hits += res.hits
            self.misses += len(res.misses)
            valid = sel[r] >= 0
            units, first = np.unique(sel[r][valid], return_index=True)
            ents = emap[r][valid][first].astype(np.int64)
            check_rows.append((r, lease, cache, units.astype(np.int64), ents,
                               by_cache[id(cache)].tokens))
        if (self.hits, self.misses) != self.batch.peek_hit_miss_counter():
            raise FingerprintMismatch(f"hit/miss counts {self.batch.peek_hit_miss_counter()}"
                                      f" differ from the exact LRU's {(self.hits, self.misses)}")
        pages = self._entry_pages(check_rows, layers, lambda c: 0, lambda c: c.capacity)
        if pages is None:
            return
        ok = self.backend.fingerprint_check(pages, self.engine.stream)
        self.checked_entries += len(pages)
        if not ok.all():
            bad = int(np.nonzero(~ok)[0][0])
            raise FingerprintMismatch(
                f"selection {key!r}: the entry at {int(pages.addresses[bad]):#x} (unit of "
                f"positions {int(pages.positions[bad])}.., layer {int(pages.tags[bad, 0])}, "
                f"buffer {int(pages.tags[bad, 1]) >> 16}) does not hold its unit's records; "
                f"{int((~ok).sum())} bad of {len(ok)}")

    def flush(self) -> int:
        """Write back what the histories crossed; the oracle's marks follow."""
        if len(self.batch.dirty_rows()):  # (rows resized since the step's publish, as a
            # speculative step's rewind does: flush_sparse_units would publish them first,
            # and that publish pins; replayed here so that the oracle pins the same)
            self.batch.publish(self.engine.stream)
            self.published()
        n = self.batch.flush_sparse_units(self.engine.stream)
        for _, lease, cache in self._seated():
            self._marks[lease] = (cache.history_length, self._marks[lease][1])
        self._pin()
        return n
