"""The NumPy reference of the sparse kernels: resolve (and pin) and unit copies.

Every kernel backend must give these results bit for bit (:meth:`KernelBackend.sparse_resolve`,
:meth:`KernelBackend.sparse_copy`). The functions take host views of the job's buffers, so
the numpy backend runs them in place and tests run them on copies.

Resolution of one row (lease ``L``) of a selection group:

1. Slots holding ``-1`` or an id outside ``[0, max_units)`` are unused. A unit selected in
   several slots counts once, at its first slot.
2. A unit held by an entry is a hit on it; the others are misses.
3. Protected entries: the hits, and the pinned entries (holding an in-flight unit,
   ``[history // unit_tokens, ceil(capacity / unit_tokens))`` from ``marks[L]``; none when
   ``capacity <= history``).
4. The misses, in slot order, take the other entries ordered by ``(stamp, index)``: free
   entries first (stamp ``-1``), lowest index first, then the least recently used.
5. Every resolved unit's entry gets the stamp ``tick * working_set_units + slot``, so the
   units of one resolve become most recent in slot order; ``tick`` advances by one.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["INT32_MAX", "copy_reference", "in_flight", "keys_width", "pin_selection",
           "resolve_reference", "resolve_views"]

INT32_MAX = 0x7FFFFFFF


def keys_width(working_set_units: int) -> int:
    """Eviction keys a row sorts: the working set rounded up to a power of two, at least
    256 (the padding sorts last)."""
    return max(256, 1 << max(0, (working_set_units - 1).bit_length()))


def in_flight(marks: Any, unit_tokens: int) -> tuple[int, int]:
    """The in-flight units ``[lo, hi)`` of marks ``(history, capacity)``: the units that hold
    a token of ``[history, capacity)`` (none when ``capacity <= history``)."""
    h, c = int(marks[0]), int(marks[1])
    lo = h // unit_tokens
    return lo, (-(-c // unit_tokens) if c > h else lo)


def pin_selection(marks: np.ndarray, unit_tokens: int, width: int, max_units: int) -> np.ndarray:
    """The pin step's selection of one lease: slot ``s`` is in-flight unit ``lo + s``."""
    lo, hi = in_flight(marks, unit_tokens)
    hi = min(hi, max_units)
    sel = np.arange(lo, lo + width, dtype=np.int64)
    sel[sel >= hi] = -1
    return sel


def resolve_views(job: Any) -> dict[str, Any]:
    """Host views of a :class:`~kvcm_core.backend.SparseResolve`'s buffers, shaped."""
    rows, ns, wsu, mu = job.rows, job.num_selected, job.working_set_units, job.max_units
    leases = job.leases

    def view(buf: Any, dtype: Any, *shape: int) -> np.ndarray | None:
        if buf is None:
            return None
        n = int(np.prod(shape)) * np.dtype(dtype).itemsize
        return buf.host_view()[:n].view(dtype).reshape(shape)

    return {
        "lease_of_row": view(job.lease_of_row, np.int32, rows),
        "marks": view(job.marks, np.int32, leases, 2),
        "resident": view(job.resident, np.int32, leases, wsu),
        "stamp": view(job.stamp, np.int64, leases, wsu),
        "tick": view(job.tick, np.int64, leases),
        "entry_of": view(job.entry_of, np.int32, leases, mu),
        "selected": view(job.selected, np.int32, rows, ns),
        "entry_map": view(job.entry_map, np.int32, rows, ns),
        "miss_unit": view(job.miss_unit, np.int32, rows, ns),
        "miss_entry": view(job.miss_entry, np.int32, rows, ns),
        "miss_count": view(job.miss_count, np.int32, rows),
        "counters": view(job.counters, np.int64, rows, 2),
    }


def resolve_reference(v: dict[str, Any], rows: int, num_selected: int, wsu: int,
                      max_units: int, unit_tokens: int) -> None:
    """Resolve in place over host views ``v`` of a :class:`~kvcm_core.backend.SparseResolve`
    (keys ``lease_of_row``, ``marks``, ``resident``, ``stamp``, ``tick``, ``entry_of``,
    ``selected`` (``None``: pin), ``entry_map``, ``miss_unit``, ``miss_entry``,
    ``miss_count``, ``counters``).

    Raises:
        ValueError: a row has more misses than unprotected entries (the caller bounds the
            in-flight units so that this cannot happen).
    """
    pin = v["selected"] is None
    for r in range(rows):
        lease = int(v["lease_of_row"][r])
        if lease < 0:
            v["entry_map"][r] = -1
            v["miss_count"][r] = 0
            continue
        marks = v["marks"][lease]
        sel = pin_selection(marks, unit_tokens, num_selected, max_units) if pin else \
            v["selected"][r].astype(np.int64)
        sel = np.where((sel >= 0) & (sel < max_units), sel, -1)
        _resolve_row(v, r, lease, sel, wsu, unit_tokens, pin)


def _resolve_row(v: dict[str, Any], r: int, lease: int, sel: np.ndarray, wsu: int,
                 unit_tokens: int, pin: bool) -> None:
    resident, stamp, entry_of = v["resident"][lease], v["stamp"][lease], v["entry_of"][lease]
    valid = np.flatnonzero(sel >= 0)
    _, first = np.unique(sel[valid], return_index=True)
    slots = np.sort(valid[first])  # first slot of each distinct unit, in slot order
    units = sel[slots]
    ent = entry_of[units].astype(np.int64)
    hit = ent >= 0
    lo, hi = in_flight(v["marks"][lease], unit_tokens)
    protected = (resident >= lo) & (resident < hi)
    protected[ent[hit]] = True
    cand = np.flatnonzero(~protected)
    order = cand[np.lexsort((cand, stamp[cand]))]
    miss = ~hit
    k = int(miss.sum())
    if k > len(order):
        raise ValueError(f"row {r}: {k} misses but only {len(order)} entries to take")
    take = order[:k]
    old = resident[take]
    entry_of[old[old >= 0]] = -1
    resident[take] = units[miss]
    entry_of[units[miss]] = take
    ent[miss] = take
    tick = int(v["tick"][lease])
    stamp[ent] = tick * wsu + slots
    v["tick"][lease] = tick + 1
    out = v["entry_map"][r]
    out[...] = np.where(sel >= 0, entry_of[np.maximum(sel, 0)], -1)
    v["miss_unit"][r, :k] = units[miss]
    v["miss_entry"][r, :k] = take
    v["miss_count"][r] = k
    if pin:
        return
    v["counters"][r, 0] += int(hit.sum())
    v["counters"][r, 1] += k


def copy_reference(job: Any) -> None:
    """Run a :class:`~kvcm_core.backend.SparseCopy` on host-visible buffers."""
    table = job.page_table.host_view()[: 4 * job.rows * job.row_elems].view(np.int32)
    table = table.reshape(job.rows, job.row_elems)
    leases = _ints(job.lease_of_row, job.rows)
    for r in range(job.rows):
        lease = int(leases[r])
        if lease < 0:
            continue
        units, ents = _row_units(job, r, lease)
        if not len(units):
            continue
        for cells in job.buffers:
            slots = table[r, units // cells.units_per_page]
            ok = (slots >= 0) & (ents >= 0)
            _copy_units(cells, lease, units[ok], ents[ok], slots[ok], job.flush)


def _ints(buf: Any, n: int, dtype: Any = np.int32) -> np.ndarray:
    return buf.host_view()[: n * np.dtype(dtype).itemsize].view(dtype)


def _row_units(job: Any, r: int, lease: int) -> tuple[np.ndarray, np.ndarray]:
    """The units a row copies and their entries (``-1``: none)."""
    n = job.rows * job.num_selected
    if job.flush:
        lo, hi = (int(x) for x in _ints(job.ranges, 2 * job.rows).reshape(-1, 2)[r])
        units = np.arange(max(lo, 0), min(hi, job.max_units), dtype=np.int64)
        entry_of = _ints(job.entry_of, job.max_units * (lease + 1))[lease * job.max_units:]
        return units, entry_of[units].astype(np.int64)
    k = int(_ints(job.miss_count, job.rows)[r])
    at = r * job.num_selected
    units = _ints(job.miss_unit, n)[at: at + k].astype(np.int64)
    ents = _ints(job.miss_entry, n)[at: at + k].astype(np.int64)
    return units, ents


def _copy_units(cells: Any, lease: int, units: np.ndarray, ents: np.ndarray,
                slots: np.ndarray, flush: bool) -> None:
    ub, upp = cells.unit_bytes, cells.units_per_page
    host = cells.host.offset + slots.astype(np.int64) * cells.host.stride + (units % upp) * ub
    cell = (cells.cells.offset + (lease * cells.lease_cells + ents // upp) * cells.cells.stride
            + (ents % upp) * ub)
    span = np.arange(ub, dtype=np.int64)
    hv, cv = cells.host.buffer.host_view(), cells.cells.buffer.host_view()
    hidx, cidx = host[:, None] + span, cell[:, None] + span
    if flush:
        hv[hidx] = cv[cidx]
    else:
        cv[cidx] = hv[hidx]
