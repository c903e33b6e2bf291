"""The sparse state of a batch, by selection group: which layers share a selection, the
device tables of their residency state and results, and small helpers to move host tables
to the device. :class:`~kvcm_core.sparse.arena.SparseArena` owns them."""

from __future__ import annotations

import ctypes
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import attrs
import numpy as np

from kvcm_core.backend import Buffer, CopyTask, MemoryKind, PageRegion, SparseResolve
from kvcm_core.sparse.reference import INT32_MAX, in_flight

if TYPE_CHECKING:
    from kvcm_core.backend import Event, KernelBackend, Stream

__all__ = ["STATE", "DeviceArray", "Mirror", "SelectionGroup", "resolve_job",
           "selection_groups"]


class Mirror:
    """A small device table written from the host: ``host`` is a plain array; each upload
    stages it in the next of a few pinned buffers (waiting for that buffer's last copy), so
    a queued copy never reads a later value; an upload on another stream than the last one
    waits for it, so uploads land in program order."""

    _SLOTS = 4

    def __init__(self, backend: KernelBackend, shape: tuple[int, ...], dtype: Any,
                 fill: int) -> None:
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        self.backend = backend
        self.device = backend.alloc_device(nbytes)
        self.host = np.full(shape, fill, dtype=dtype)
        self.nbytes = nbytes
        self._staging = [backend.alloc_host(nbytes) for _ in range(self._SLOTS)]
        self._done: list[Event | None] = [None] * self._SLOTS
        self._next = 0
        self._last: tuple[Any, Event] | None = None  # (stream, event) of the last upload
        self.upload(None)
        # Made once, before any use: the first upload is complete before a later one on
        # another stream can be queued (else the device could run it last).
        backend.default_stream.synchronize()

    def upload(self, stream: Stream | None) -> None:
        k = self._next
        self._next = (k + 1) % self._SLOTS
        done = self._done[k]
        if done is not None:
            done.synchronize()
        st = stream or self.backend.default_stream
        if self._last is not None and self._last[0] is not st:
            st.wait_event(self._last[1])
        buf = self._staging[k]
        buf.host_view()[: self.nbytes] = self.host.reshape(-1).view(np.uint8)
        pair = np.zeros((1, 2), dtype=np.int32)
        self.backend.copy_pages_batch([CopyTask(PageRegion(self.device, 0, self.nbytes),
                                                PageRegion(buf, 0, self.nbytes), self.nbytes,
                                                pair)], stream)
        ev = self.backend.create_event()
        ev.record(stream)
        self._done[k] = ev
        self._last = (st, ev)

    def free(self) -> None:
        self.device.free()
        for b in self._staging:
            b.free()


class DeviceArray(Buffer):
    """A caller's device array, seen as a buffer for one copy (never freed here)."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.ptr, self.nbytes = ptr, nbytes
        self.kind = MemoryKind.DEVICE
        self.host_ptr = None

    def free(self) -> None:
        pass

    def host_view(self) -> np.ndarray:
        # Reached on backends without a device only, where "device" memory is host memory.
        return np.ctypeslib.as_array((ctypes.c_uint8 * self.nbytes).from_address(self.ptr))


@attrs.define
class SelectionGroup:
    """The layers that share one selection, and their device state (see module doc)."""

    key: Any
    layers: tuple[int, ...]
    group: int  # the cache group of the sparse buffers
    unit_tokens: int
    num_selected: int
    working_set_units: int
    units_per_page: int
    max_units: int
    write_back_units: int  # the most units one flush may write back, over all rows
    buffers: dict[int, dict[str, Any]] = attrs.field(factory=dict)  # SparseBufferCells
    state: dict[str, Buffer] = attrs.field(factory=dict)
    templates: dict[str, Buffer] = attrs.field(factory=dict)
    pending: set[int] = attrs.field(factory=set)  # layers yet to fetch the miss list
    fetched: list[Any] = attrs.field(factory=list)  # events of those fetches
    resolved: Event | None = None
    resolve_stream: Any = None  # the stream of the last resolve
    pin_copy_owed: bool = False  # the pin list's fetch was not queued (an interrupt)
    ranges: Any = None  # the flush ranges' _Mirror
    carry: Buffer | None = None  # write-map rows a move sets aside (SparseArena.move)

    def in_flight(self, history: int, capacity: int) -> int:
        """Units in flight for these marks."""
        lo, hi = in_flight((history, capacity), self.unit_tokens)
        return hi - lo


#: (name, dtype, fill, per lease (True) or per row, width key)
STATE = (
    ("resident", np.int32, -1, True, "wsu"),
    ("stamp", np.int64, -1, True, "wsu"),
    ("tick", np.int64, 0, True, None),
    ("entry_of", np.int32, -1, True, "units"),
    ("first", np.int32, INT32_MAX, True, "units"),
    ("selected", np.int32, -1, False, "ns"),
    ("entry_map", np.int32, -1, False, "ns"),
    ("write_map", np.int32, -1, False, "wsu"),
    ("miss_unit", np.int32, -1, False, "ns"),
    ("miss_entry", np.int32, -1, False, "ns"),
    ("miss_count", np.int32, 0, False, None),
    ("pin_unit", np.int32, -1, False, "wsu"),
    ("pin_entry", np.int32, -1, False, "wsu"),
    ("pin_count", np.int32, 0, False, None),
    ("counters", np.int64, 0, False, 2),
    ("keys", np.uint64, 0, False, "keys"),
)


def resolve_job(state: Mapping[str, Buffer], lease_of_row: Buffer, marks: Buffer, *,
                rows: int, leases: int, num_selected: int, working_set_units: int,
                max_units: int, unit_tokens: int, pin: bool) -> SparseResolve:
    """The :class:`SparseResolve` of one group's state tables (named as in ``STATE``): a
    resolve, or (``pin``) the pin of in-flight units into the write map."""
    s = state
    return SparseResolve(
        rows=rows, leases=leases, num_selected=working_set_units if pin else num_selected,
        working_set_units=working_set_units, max_units=max_units, unit_tokens=unit_tokens,
        lease_of_row=lease_of_row, marks=marks, resident=s["resident"], stamp=s["stamp"],
        tick=s["tick"], entry_of=s["entry_of"], first=s["first"],
        selected=None if pin else s["selected"],
        entry_map=s["write_map" if pin else "entry_map"],
        miss_unit=s["pin_unit" if pin else "miss_unit"],
        miss_entry=s["pin_entry" if pin else "miss_entry"],
        miss_count=s["pin_count" if pin else "miss_count"], counters=s["counters"],
        keys=s["keys"])


def selection_groups(manager: Any, max_blocks: int, max_rows: int) -> list[SelectionGroup]:
    """One :class:`SelectionGroup` per selection id (a layer without one is alone)."""
    tpb = manager.tokens_per_block
    out: dict[Any, SelectionGroup] = {}
    for layer in manager.config.layers:
        sp = getattr(layer, "sparse", None)
        if sp is None:
            continue
        key = ("layer", layer.layer_id) if sp.selection_id is None else ("id", sp.selection_id)
        roles = [b.role for b in layer.buffers if b.is_sparse]
        grp = out.get(key)
        if grp is None:
            upp = tpb // sp.unit_tokens
            # A row's crossed units are pinned units, at most working_set_units -
            # num_selected (publish refuses more in flight): every flush of accepted
            # steps fits, whatever the steps' sizes or how late histories move.
            wb = max_rows * max(1, sp.working_set_units - sp.num_selected)
            grp = out[key] = SelectionGroup(
                key, (), int(manager.get_buffer_group_id(layer.layer_id, roles[0])),
                sp.unit_tokens, sp.num_selected, sp.working_set_units, upp,
                max_blocks * upp, wb)
        grp.layers = (*grp.layers, layer.layer_id)
        grp.buffers[layer.layer_id] = dict.fromkeys(roles)  # cells are placed later
    return list(out.values())
