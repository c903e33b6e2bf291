"""The sparse state a :class:`~kvcm_core.batch.Batch` owns: leases, residency, cells.

Every seated row holds one **lease** (``add_kv_cache`` takes the lowest free one,
``remove_kv_cache`` returns it, ``move`` carries it). A lease owns, per selection group,
the residency state of the resolve kernels (``resident``, ``stamp``, ``tick``,
``entry_of``) and, per sparse buffer, ``cells_per_buffer`` cells of the device arena of
its pool: entry ``e`` of buffer ``b`` is sub-unit ``e % units_per_page`` of cell
``lease * cells_per_lease + slot_in_pool(b) * cells_per_buffer + e // units_per_page``, so
every buffer of a layer holds the unit of entry ``e`` at the same entry index.

Per lease the marks ``(history, capacity)`` (tokens) say which units are in flight:
``[history // unit_tokens, ceil(capacity / unit_tokens))``. Their entries are pinned
(never evicted) until :meth:`SparseArena.flush` writes them back and moves ``history``.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import attrs
import numpy as np

from kvcm_core.backend import (
    Buffer,
    CopyTask,
    PageRegion,
    SparseBufferCells,
    SparseCopy,
    SparseResolve,
)
from kvcm_core.errors import ArgumentTypeError, InvalidArgumentError, InvalidStateError
from kvcm_core.sparse.reference import keys_width
from kvcm_core.sparse.state import (
    STATE,
    DeviceArray,
    Mirror,
    SelectionGroup,
    resolve_job,
    selection_groups,
)

if TYPE_CHECKING:
    from kvcm_core.backend import KernelBackend, Stream

__all__ = ["SparseArena"]


class SparseArena:
    """Leases, residency and cells of one batch (see module docstring).

    Args:
        manager: the batch's manager.
        max_rows: the batch's rows (and leases).
        max_blocks: blocks a row holds.
    """

    def __init__(self, manager: Any, max_rows: int, max_blocks: int) -> None:
        self.backend: KernelBackend = manager.backend
        self.manager = manager
        self.rows = self.leases = max_rows
        self.groups = selection_groups(manager, max_blocks, max_rows)
        self.by_layer = {layer: g for g in self.groups for layer in g.layers}
        self.lease_of_row = Mirror(self.backend, (max_rows,), np.int32, -1)
        self.marks = Mirror(self.backend, (max_rows, 2), np.int32, 0)
        self._free = list(range(max_rows))
        self._fresh: set[int] = set()  # leases whose state is reset at the next publish
        self._seats_moved = False  # the lease table changed since its last upload
        self._caps = np.full(max_rows, -1, dtype=np.int64)  # capacity last pinned, by lease
        # Rows moved since the write maps were last written (pin or carry): new row -> the
        # row whose device write map it takes; ``_staged``: sources copied aside already.
        self._moved: dict[int, int] = {}
        self._staged: set[int] = set()
        # A prepare or flush took new marks whose pin has not run (an interrupt between):
        # the next publish or flush uploads the marks and pins.
        self._pin_owed = False
        self.arenas: list[Buffer] = []
        self._place_cells()
        for g in self.groups:
            self._alloc_state(g)
            g.ranges = Mirror(self.backend, (max_rows, 2), np.int32, 0)
            # Write-map rows set aside by a move's carry (one more row: all -1).
            g.carry = self.backend.alloc_device((max_rows + 1) * g.working_set_units * 4)
            self.backend.write(g.carry, 0, np.full((max_rows + 1) * g.working_set_units, -1,
                                                   dtype=np.int32).view(np.uint8))

    # -- layout ----------------------------------------------------------------------------

    def _place_cells(self) -> None:
        """One device arena per sparse pool; each buffer's cells (see module docstring)."""
        m = self.manager
        pools: dict[tuple[int, int], list[tuple[SelectionGroup, int, str]]] = {}
        for g in self.groups:
            for layer, roles in g.buffers.items():
                for role in roles:
                    attr = m.buffer_attr(layer, role)
                    pools.setdefault((attr.pool_group, attr.pool), []).append((g, layer, role))
        for members in pools.values():
            _g0, layer0, role0 = members[0]
            size = m.buffer_attr(layer0, role0).size
            slot_bytes = m.get_page_stride(layer0, role0)
            per_buffer = max(-(-g.working_set_units // g.units_per_page) for g, _, _ in members)
            lease_cells = (slot_bytes // size) * per_buffer
            arena = self.backend.alloc_device(self.leases * lease_cells * size)
            self.arenas.append(arena)
            for g, layer, role in members:
                attr = m.buffer_attr(layer, role)
                cells = PageRegion(arena, (attr.offset // size) * per_buffer * size, size)
                g.buffers[layer][role] = SparseBufferCells(
                    m.get_page_region(layer, role), cells, size // g.units_per_page,
                    g.units_per_page, lease_cells)

    def _alloc_state(self, g: SelectionGroup) -> None:
        widths = {"wsu": g.working_set_units, "units": g.max_units, "ns": g.num_selected,
                  "keys": keys_width(g.working_set_units), None: 1, 2: 2}
        for name, dtype, fill, per_lease, width in STATE:
            n = (self.leases if per_lease else self.rows) * widths[width]
            item = np.dtype(dtype).itemsize
            buf = self.backend.alloc_device(n * item)
            self.backend.write(buf, 0, np.full(n, fill, dtype=dtype).view(np.uint8))
            g.state[name] = buf
            if per_lease:  # one lease's reset image
                tpl = self.backend.alloc_host(widths[width] * item)
                tpl.host_view()[:] = np.full(widths[width], fill, dtype=dtype).view(np.uint8)
                g.templates[name] = tpl

    # -- leases ----------------------------------------------------------------------------

    def seat(self, row: int, cache: Any) -> int:
        """Give ``row`` the lowest free lease; its state resets at the next publish. A
        request arriving with history has it on the host already: nothing to flush."""
        self.check_beams(cache)
        lease = heapq.heappop(self._free)
        self.lease_of_row.host[row] = lease
        self._seats_moved = True
        h = cache.history_length
        self.marks.host[lease] = (h, h)
        self._caps[lease] = -1
        self._fresh.add(lease)
        self._moved.pop(row, None)  # (a fresh lease pins every row)
        return lease

    def leave(self, row: int) -> None:
        lease = int(self.lease_of_row.host[row])
        self.lease_of_row.host[row] = -1
        self._seats_moved = True
        self._moved.pop(row, None)
        heapq.heappush(self._free, lease)

    def move(self, old: int, new: int) -> None:
        """Carry ``old``'s lease to ``new``; its write map follows at the next publish."""
        host = self.lease_of_row.host
        host[new], host[old] = host[old], -1
        self._seats_moved = True
        self._moved[new] = self._moved.pop(old, old)

    def lease(self, row: int) -> int:
        return int(self.lease_of_row.host[row])

    @staticmethod
    def check_beams(cache: Any) -> None:
        if cache.beam_width > 1:
            raise InvalidStateError(
                f"cache {cache.id!r} has beam width {cache.beam_width}: sparse layers do not "
                "take beams yet (beam width must be 1)")

    # -- publish: in-flight units get pinned entries ---------------------------------------

    def check_in_flight(self, cache: Any, row: int, capacity: int,
                        history: int | None = None) -> None:
        """Refuse a capacity whose in-flight units leave a group fewer than
        ``num_selected`` free entries. ``history``: the row's history after the change
        (default: the cache's); a rewind below the flushed mark counts from there (the next
        flush lowers the mark to it).

        Raises:
            InvalidArgumentError: too many tokens in flight for a working set.
        """
        lease = self.lease(row)
        now = cache.history_length if history is None or history < 0 else history
        hist = min(int(self.marks.host[lease][0]), int(now))
        for g in self.groups:
            n = g.in_flight(hist, capacity)
            if n > g.working_set_units - g.num_selected:
                raise InvalidArgumentError(
                    f"capacity={capacity} of cache {cache.id!r}: {n} units in flight (from "
                    f"the flushed history {hist}) exceed working_set_units - num_selected = "
                    f"{g.working_set_units - g.num_selected} of selection {g.key[1]!r}; "
                    "flush, or write fewer tokens per step")

    def check(self, members: Sequence[Any], skip: Sequence[int] = ()) -> None:
        """Refuse what :meth:`prepare` refuses, changing nothing (``skip``: rows whose new
        capacity the caller checks itself).

        Raises:
            InvalidStateError: a row took beams, or seats changed while a resolve awaits
                its fetches.
            InvalidArgumentError: too many units in flight.
        """
        if self._seats_moved:
            self.check_fetched("publish after rows were seated, moved or removed")
        for row, cache in enumerate(members):
            if cache is None:
                continue
            self.check_beams(cache)
            cap = cache.capacity
            lease = self.lease(row)
            # A new capacity, or a rewind below the flushed mark (cache.resize moves it
            # without the batch): the units in flight count from there.
            if row not in skip and (cap != self._caps[lease] or
                                    cache.history_length < int(self.marks.host[lease][0])):
                self.check_in_flight(cache, row, cap)

    def check_fetched(self, action: str) -> None:
        """Refuse ``action`` (a change of seats) while a resolve awaits its fetches: its
        miss list is indexed by row, and a fetch after the seats moved would leave
        entries marked resident that were never fetched.

        Raises:
            InvalidStateError: a group's layers have not fetched its miss list.
        """
        for g in self.groups:
            if g.pending:
                raise InvalidStateError(
                    f"{action} while selection {g.key[1]!r} awaits fetch_resolved_pages of "
                    f"layers {sorted(g.pending)}: fetch first (the miss list is by row)")

    def prepare(self, members: Sequence[Any], checked: bool = False) -> bool:
        """Before a publish queues anything: take every row's capacity into its marks,
        refusing (with nothing changed) beams, too many units in flight and seats changed
        under a pending fetch (``checked``: the caller ran :meth:`check` on these members
        just before, with nothing changed since). Returns whether anything moved."""
        if not checked:
            self.check(members)
        changed = bool(self._fresh)
        for row, cache in enumerate(members):
            if cache is not None and cache.capacity != self._caps[self.lease(row)]:
                changed = True
        if changed:
            self._pin_owed = True  # until _pin returns (an interrupt before: pinned later)
            for row, cache in enumerate(members):
                if cache is not None:
                    lease = self.lease(row)
                    self.marks.host[lease][1] = self._caps[lease] = cache.capacity
        return changed

    def publish(self, changed: bool, tables: Sequence[tuple[Buffer, int]],
                stream: Stream | None) -> None:
        """Upload the lease table when seats changed (and the marks, fresh leases' state
        and the pins when :meth:`prepare` saw a change, or an interrupted publish or flush
        left them owed), after the page tables went up."""
        self._upload_seats(stream)
        if not (changed or self._pin_owed):
            self._carry_write_maps(stream)
            return
        self.marks.upload(stream)
        if self._fresh:
            self._reset(sorted(self._fresh), stream)
            self._fresh.clear()
        self._pin(tables, stream)

    def _upload_seats(self, stream: Stream | None) -> None:
        if self._seats_moved:
            self.lease_of_row.upload(stream)
            self._seats_moved = False

    def _carry_write_maps(self, stream: Stream | None) -> None:
        """A moved row's write map follows it (the pin that wrote it is not repeated): each
        group's source rows are set aside, then copied to their new rows; rows left empty
        get ``-1``. Safe to repeat after an interrupt: rows are set aside once."""
        if not self._moved:
            return
        rows = self.rows
        new = sorted(set(self._moved.values()) - self._staged)
        pairs = [(r, self._moved[r]) for r in sorted(self._moved)]
        pairs += [(r, rows) for r in sorted(set(self._moved.values()) - set(self._moved))
                  if self.lease_of_row.host[r] < 0]
        for phase, todo in (("set aside", new), ("carry", pairs)):
            if not todo:
                continue
            tasks = []
            for g in self.groups:
                n = g.working_set_units * 4
                wm, carry = PageRegion(g.state["write_map"], 0, n), PageRegion(g.carry, 0, n)
                if phase == "set aside":
                    p = np.repeat(np.asarray(todo, dtype=np.int32)[:, None], 2, axis=1)
                    tasks.append(CopyTask(carry, wm, n, p))
                else:
                    tasks.append(CopyTask(wm, carry, n, np.asarray(todo, dtype=np.int32)))
            self.backend.copy_pages_batch(tasks, stream)
            if phase == "set aside":
                self._staged.update(new)
        self._moved.clear()
        self._staged.clear()

    def _pin(self, tables: Sequence[tuple[Buffer, int]], stream: Stream | None) -> None:
        """Give every in-flight unit an entry; a unit that got a new one is fetched from its
        host page (its tokens below history are there: a resumed request, or an entry
        evicted since the flush)."""
        for g in self.groups:
            # Owed from before the kernel marks the entries resident until their fetch is
            # queued: an interrupt between leaves the copy to the next publish or flush.
            g.pin_copy_owed = True
            self.backend.sparse_resolve(self._job(g, pin=True), stream)
            self._pin_copy(g, tables, stream)
        self._moved.clear()  # every row's write map is written
        self._staged.clear()
        self._pin_owed = False

    def _pin_copy(self, g: SelectionGroup, tables: Sequence[tuple[Buffer, int]],
                  stream: Stream | None) -> None:
        """Fetch the units of the group's last pin list (the pin's misses)."""
        s = g.state
        table, width = tables[g.group]
        self.backend.sparse_copy(SparseCopy(
            flush=False, rows=self.rows, num_selected=g.working_set_units,
            max_units=g.max_units, row_elems=width, buffers=self._group_cells(g),
            page_table=table, lease_of_row=self.lease_of_row.device, miss_unit=s["pin_unit"],
            miss_entry=s["pin_entry"], miss_count=s["pin_count"]), stream)
        g.pin_copy_owed = False

    def settle_pin_copies(self, tables: Sequence[tuple[Buffer, int]],
                          stream: Stream | None) -> None:
        """Queue the fetch of a pin list an interrupt left unfetched (its entries are
        marked resident), with the lease and page tables it was resolved with: before a
        publish uploads either (Batch.publish), or a flush."""
        for g in self.groups:
            if g.pin_copy_owed:
                self._pin_copy(g, tables, stream)

    def owes(self) -> bool:
        """Whether an interrupted publish or flush left a pin or its fetch owed."""
        return self._pin_owed or any(g.pin_copy_owed for g in self.groups)

    def check_pinned(self, members: Sequence[Any]) -> None:
        """Raises InvalidStateError when a row's capacity moved since the last publish, or
        an interrupted publish or flush left pins owed."""
        if self.owes():
            raise InvalidStateError("a publish or flush was interrupted before its pins: "
                                    "publish first")
        for row, cache in enumerate(members):
            if cache is not None and cache.capacity != self._caps[self.lease(row)]:
                raise InvalidStateError(f"row {row}: capacity moved to {cache.capacity} "
                                        "since the last publish: publish first")

    def _reset(self, leases: list[int], stream: Stream | None) -> None:
        pairs = np.zeros((len(leases), 2), dtype=np.int32)
        pairs[:, 0] = leases
        tasks = []
        for g in self.groups:
            for name, tpl in g.templates.items():
                n = tpl.nbytes
                tasks.append(CopyTask(PageRegion(g.state[name], 0, n), PageRegion(tpl, 0, n),
                                      n, pairs))
        self.backend.copy_pages_batch(tasks, stream)

    def _job(self, g: SelectionGroup, pin: bool) -> SparseResolve:
        return resolve_job(g.state, self.lease_of_row.device, self.marks.device,
                           rows=self.rows, leases=self.leases, num_selected=g.num_selected,
                           working_set_units=g.working_set_units, max_units=g.max_units,
                           unit_tokens=g.unit_tokens, pin=pin)

    # -- resolve and fetch -----------------------------------------------------------------

    def group_of(self, layer_id: Any) -> SelectionGroup:
        g = self.by_layer.get(layer_id)
        if g is None:
            raise InvalidArgumentError(
                f"layer_id={layer_id!r}: not a sparse layer (sparse layers: "
                f"{sorted(self.by_layer)})")
        return g

    def resolve(self, layer_id: int, selected: Any, stream: Stream | None) -> SelectionGroup:
        """Resolve a group's selection (the miss list of the previous one consumed).

        Raises:
            InvalidStateError: a layer of the group has not fetched the previous miss list.
        """
        g = self.group_of(layer_id)
        if g.pending:
            raise InvalidStateError(
                f"resolve for selection {g.key[1]!r} before layers {sorted(g.pending)} "
                "fetched the previous miss list (call fetch_resolved_pages for each)")
        rows = None if selected is None else self._check_selection(g, selected)
        st = stream or self.backend.default_stream
        for ev in g.fetched:  # consumers of the last miss list on other streams
            st.wait_event(ev)
        g.fetched = []
        if selected is not None:
            self._stage_selection(g, selected, rows, stream)
        # The fetches are owed from before the kernel marks the misses resident: an
        # interrupt after it leaves them owed (fetch_resolved_pages records the event).
        g.pending, g.resolved, g.resolve_stream = set(g.layers), None, stream
        self.backend.sparse_resolve(self._job(g, pin=False), stream)
        ev = self.backend.create_event()
        ev.record(stream)
        g.resolved = ev
        return g

    def _check_selection(self, g: SelectionGroup, selected: Any) -> np.ndarray | None:
        """Refuse a selection of the wrong kind or shape (nothing changed); a NumPy one
        comes back as the int32 rows to write (ids out of range unused: ids past int32
        would otherwise wrap into real units), a device one as None."""
        want = (self.rows, g.num_selected)
        if isinstance(selected, np.ndarray):
            if selected.shape != want or selected.dtype.kind not in "iu":
                raise InvalidArgumentError(
                    f"selected: must be an int array of shape {want} (max_rows, num_selected)"
                    f", got {selected.dtype} {selected.shape}")
            sel = selected
            if sel.dtype != np.int32 and len(sel) and (
                    int(sel.min()) < -1 or int(sel.max()) >= g.max_units):
                sel = np.where((sel >= 0) & (sel < g.max_units), sel, -1)
            return np.ascontiguousarray(sel, dtype=np.int32)
        iface = getattr(selected, "__cuda_array_interface__", None)
        if iface is None:
            raise InvalidArgumentError(
                f"selected: a NumPy array or a device array (__cuda_array_interface__), got "
                f"{type(selected).__name__}")
        shape, typestr = tuple(iface["shape"]), iface["typestr"]
        contiguous = iface.get("strides") in (None, (4 * g.num_selected, 4))
        if shape != want or typestr != "<i4" or not contiguous:
            raise InvalidArgumentError(
                f"selected: must be a contiguous int32 device array of shape {want}, got "
                f"{typestr} {shape} strides {iface.get('strides')}")
        return None

    def _stage_selection(self, g: SelectionGroup, selected: Any, rows: np.ndarray | None,
                         stream: Stream | None) -> None:
        """Bring ``selected`` (checked: ``rows`` from :meth:`_check_selection`) into the
        group's selection table: a NumPy array is written (synchronously), a device array
        (``__cuda_array_interface__``: contiguous int32) copied on ``stream``."""
        table = g.state["selected"]
        if rows is not None:
            self.backend.write(table, 0, rows.view(np.uint8))
            return
        ptr = int(selected.__cuda_array_interface__["data"][0])
        if ptr != table.ptr:  # not the table itself, written in place by the indexer
            self.backend.copy_bytes(table, 0, DeviceArray(ptr, table.nbytes), 0,
                                    table.nbytes, stream)

    def fetch(self, layer_id: int, roles: Iterable[str] | None, page_table: Buffer,
              row_elems: int, stream: Stream | None) -> None:
        """Copy the current miss list's units of a layer's buffers into its cells.

        Raises:
            InvalidStateError: nothing was resolved for the layer's group.
        """
        g = self.group_of(layer_id)
        cells = self.cells(layer_id, roles)  # (a bad role changes nothing)
        if g.resolved is None and g.pending:  # the resolve was interrupted after its kernel
            g.resolved = self.backend.create_event()
            g.resolved.record(g.resolve_stream)
        if g.resolved is None:
            raise InvalidStateError(f"fetch for layer {layer_id} before any "
                                    "resolve_sparse_selection of its group")
        (stream or self.backend.default_stream).wait_event(g.resolved)
        s = g.state
        self.backend.sparse_copy(SparseCopy(
            flush=False, rows=self.rows, num_selected=g.num_selected, max_units=g.max_units,
            row_elems=row_elems, buffers=cells,
            page_table=page_table, lease_of_row=self.lease_of_row.device,
            miss_unit=s["miss_unit"], miss_entry=s["miss_entry"],
            miss_count=s["miss_count"]), stream)
        g.pending.discard(layer_id)
        ev = self.backend.create_event()
        ev.record(stream)
        g.fetched.append(ev)

    def cells(self, layer_id: int, roles: Iterable[str] | None) -> tuple[SparseBufferCells, ...]:
        """The cells of a layer's sparse buffers (``roles``: a subset)."""
        return tuple(self._cells_now(layer_id, r) for r in self.check_roles(layer_id, roles))

    def check_roles(self, layer_id: int, roles: Iterable[str] | None) -> list[str]:
        """The roles of a layer's sparse buffers that ``roles`` names (None: all).

        Raises:
            ArgumentTypeError: ``roles`` is not a str or an iterable of str.
            InvalidArgumentError: a role that is not one of the layer's sparse buffers.
        """
        own = self.group_of(layer_id).buffers[layer_id]
        if roles is None:
            return list(own)
        arg = roles
        try:
            roles = [roles] if isinstance(roles, str) else list(roles)
        except TypeError:  # not iterable
            roles = [arg]
        if not all(isinstance(r, str) for r in roles):
            raise ArgumentTypeError(f"buffers={arg!r}: a role or an iterable of roles (str)")
        bad = [r for r in roles if r not in own]
        if bad:
            raise InvalidArgumentError(f"buffers={bad!r}: layer {layer_id}'s sparse buffers "
                                       f"are {sorted(own)}")
        return roles

    def _group_cells(self, g: SelectionGroup) -> tuple[SparseBufferCells, ...]:
        return tuple(self._cells_now(layer, r) for layer in g.layers for r in g.buffers[layer])

    def _cells_now(self, layer_id: int, role: str) -> SparseBufferCells:
        """A buffer's cells with its host pages where they are now (a pool moves when the
        manager resizes it)."""
        cells = self.by_layer[layer_id].buffers[layer_id][role]
        return attrs.evolve(cells, host=self.manager.get_page_region(layer_id, role))

    # -- flush ----------------------------------------------------------------------------

    def check_flushed(self, members: Sequence[Any], history: Sequence[int] | None) -> None:
        """``Batch.resize`` may move a sparse row's history only once the last move was
        flushed.

        Raises:
            InvalidStateError: a row's history moved since the last flush.
        """
        if history is None:
            return
        for row, cache in enumerate(members):
            if cache is None or history[row] in (-1, cache.history_length):
                continue
            mark = int(self.marks.host[self.lease(row)][0])
            if mark != cache.history_length:
                raise InvalidStateError(
                    f"row {row}: history moved from {mark} to {cache.history_length} and "
                    "was not flushed: call flush_sparse_units first")

    def check_write_map(self, members: Sequence[Any]) -> None:
        """The write map counts slots from each row's flushed history: refuse it while a
        row's history moved (or rewound) since the last flush.

        Raises:
            InvalidStateError: a row's history differs from its flushed mark.
        """
        for row, cache in enumerate(members):
            if cache is None:
                continue
            mark = int(self.marks.host[self.lease(row)][0])
            if mark != cache.history_length:
                raise InvalidStateError(
                    f"row {row}: history moved from {mark} to {cache.history_length} since "
                    "the last flush (the write map counts from the flushed history): call "
                    "flush_sparse_units first")

    def unflushed(self, row: int, cache: Any) -> bool:
        """Whether ``row`` has units its history crossed since the last flush."""
        h0, c0 = (int(x) for x in self.marks.host[self.lease(row)])
        return min(cache.history_length, c0) > h0

    def flush(self, members: Sequence[Any], page_tables: Sequence[tuple[Buffer, int]],
              stream: Stream | None, only: Sequence[int] | None = None) -> int:
        """Write back every unit that crossed the history mark; returns the units written
        (per group, summed). ``only``: just these rows, which are leaving the batch (no
        pins follow: the other rows' marks stay; no write-back bound: the copy goes by
        per-row ranges, and refusing would lose the units).

        Raises:
            InvalidArgumentError: a group's units exceed its write-back bound (nothing is
                written; not with ``only``).
        """
        self.settle_pin_copies(page_tables, stream)
        spans = []  # (row, lease, old history, new history, old capacity)
        for row, cache in enumerate(members):
            if cache is None or (only is not None and row not in only):
                continue
            lease = self.lease(row)
            h0, c0 = (int(x) for x in self.marks.host[lease])
            spans.append((row, lease, h0, cache.history_length, c0))
        ranges = []
        for g in self.groups:
            r = np.zeros((self.rows, 2), dtype=np.int32)
            for row, _, h0, h1, c0 in spans:
                end = min(h1, c0)
                if end > h0:
                    r[row] = (h0 // g.unit_tokens, -(-end // g.unit_tokens))
            total = int((r[:, 1] - r[:, 0]).sum())
            if only is None and total > g.write_back_units:
                raise InvalidArgumentError(
                    f"flush of {total} units for selection {g.key[1]!r} exceeds the write-"
                    f"back bound of {g.write_back_units} units (max_rows x (working_set_"
                    "units - num_selected)): more units crossed than were ever in flight")
            ranges.append((r, total))
        written = 0
        for g, (r, total) in zip(self.groups, ranges, strict=True):
            if total:
                self._flush_group(g, r, page_tables[g.group], stream)
                written += total
        if only is None:
            self._pin_owed = True  # the new marks' pin (until _pin returns)
        for _, lease, _, h1, _ in spans:
            self.marks.host[lease][0] = h1
        self.marks.upload(stream)
        if only is None:
            self._pin(page_tables, stream)  # the write maps follow the new history
        return written

    def _flush_group(self, g: SelectionGroup, ranges: np.ndarray,
                     table: tuple[Buffer, int], stream: Stream | None) -> None:
        g.ranges.host[...] = ranges
        g.ranges.upload(stream)
        cells = self._group_cells(g)
        self.backend.sparse_copy(SparseCopy(
            flush=True, rows=self.rows, num_selected=g.num_selected, max_units=g.max_units,
            row_elems=table[1], buffers=cells, page_table=table[0],
            lease_of_row=self.lease_of_row.device, entry_of=g.state["entry_of"],
            ranges=g.ranges.device), stream)

    # -- views -----------------------------------------------------------------------------

    def table(self, g: SelectionGroup, name: str) -> Any:
        """A zero-copy device view of one state table, shaped."""
        shapes = {"selected": (g.num_selected, np.int32), "entry_map": (g.num_selected, np.int32),
                  "write_map": (g.working_set_units, np.int32)}
        width, dtype = shapes[name]
        buf = g.state[name]
        arr = self.backend.as_array(buf)
        n = self.rows * width * 4
        if hasattr(arr, "view") and hasattr(arr, "reshape"):
            return arr[:n].view(dtype).reshape(self.rows, width)
        return arr.typed((self.rows, width), "<i4")

    def read(self, g: SelectionGroup, name: str) -> np.ndarray:
        """A host copy of a per-row table (synchronous; tests and tools)."""
        width = g.working_set_units if name == "write_map" else g.num_selected
        raw = self.backend.read(g.state[name], 0, self.rows * width * 4)
        return raw.view(np.int32).reshape(self.rows, width)

    def counters(self) -> tuple[int, int]:
        hits = misses = 0
        for g in self.groups:
            raw = self.backend.read(g.state["counters"], 0, self.rows * 16)
            c = raw.view(np.int64).reshape(self.rows, 2)
            hits += int(c[:, 0].sum())
            misses += int(c[:, 1].sum())
        return hits, misses

    def free(self) -> None:
        self.lease_of_row.free()
        self.marks.free()
        for a in self.arenas:
            a.free()
        for g in self.groups:
            g.ranges.free()
            g.carry.free()
            for b in (*g.state.values(), *g.templates.values()):
                b.free()
