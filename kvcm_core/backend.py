"""The kernel-backend contract: a device runtime plus the kernels the core launches.

A backend owns memory (device memory, and pinned host memory that its kernels can read and
write), streams and events, and implements every kernel of the contract. The ``numpy``
backend defines each kernel's result; every other backend must match it bit for bit (the
conformance suite checks this). The core talks to the selected backend only through this
interface, so a faster backend is installed and compared without touching the core.

Memory is described by :class:`Buffer` objects and pages inside them by
:class:`PageRegion` (buffer, offset of page 0, stride between page indices).
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import attrs
import numpy as np

from kvcm_core.pagetable import BAD_PAGE_INDEX
from kvcm_core.records import KernelBackendCapabilities

if TYPE_CHECKING:
    from kvcm_core.pagetable import ScratchDesc

__all__ = [
    "BAD_PAGE_INDEX",
    "Buffer",
    "CopyTask",
    "Event",
    "FingerprintPages",
    "KernelBackend",
    "MemoryKind",
    "PageRegion",
    "SparseBufferCells",
    "SparseCopy",
    "SparseResolve",
    "Stream",
    "TableConversion",
    "check_copy_args",
    "copy_pairs",
]



class MemoryKind:
    """Where a buffer lives."""

    DEVICE = "device"
    HOST = "host"  # pinned and device-mapped where the backend has a device


class Buffer(abc.ABC):
    """A block of memory owned by a backend.

    Attributes:
        nbytes: size in bytes.
        kind: :class:`MemoryKind` value.
        ptr: the address kernels use (the device address; for mapped host memory, its
            device-side address).
        host_ptr: the host address when the memory is host-visible, else ``None``.
    """

    nbytes: int
    kind: str
    ptr: int
    host_ptr: int | None

    @abc.abstractmethod
    def free(self) -> None:
        """Release the memory (idempotent). Views taken earlier become invalid."""

    def host_view(self) -> np.ndarray:
        """A ``uint8`` NumPy view of host-visible memory (raises for device memory)."""
        raise TypeError(f"{self.kind} buffer of {type(self).__name__} has no host view")


@attrs.frozen
class PageRegion:
    """Equal-sized pages in a buffer: page ``i`` starts at ``offset + i * stride``."""

    buffer: Buffer
    offset: int
    stride: int

    def page_start(self, index: int) -> int:
        """Byte offset of page ``index`` inside :attr:`buffer`."""
        return self.offset + index * self.stride


@attrs.frozen
class CopyTask:
    """One ``copy_pages`` call's arguments, for batching several in one launch."""

    dst: PageRegion
    src: PageRegion
    page_bytes: int
    pairs: np.ndarray  # int32 [n, 2]: (destination index, source index)


@attrs.frozen
class TableConversion:
    """One table of :meth:`KernelBackend.convert_page_tables`: rows of int32 slot ids
    converted into a buffer's page indices, both tables in place in device buffers.

    Row ``r`` of ``src`` is ``row_elems`` int32 at byte ``4 * r * row_elems``; row ``r`` of
    ``dst`` is ``row_elems * expansion`` int32 at byte ``4 * r * row_elems * expansion``.
    Element ``i`` of a row is block ``i % blocks`` (a row holds ``row_elems // blocks``
    beams). ``scratch`` maps a row to its SWA scratch descriptor (rows absent: none).
    """

    src: Buffer
    dst: Buffer
    row_elems: int
    blocks: int
    scale: int
    offset: int
    expansion: int = 1
    scratch: Any = None  # Mapping[int, ScratchDesc] | None


@attrs.frozen
class SparseResolve:
    """One selection group's residency state and a resolve's inputs and outputs, all in
    device buffers (int32 unless said), for :meth:`KernelBackend.sparse_resolve`.

    Per lease ``L`` (rows name their lease in ``lease_of_row``; ``-1``: empty row):
    ``resident[L, e]`` the unit held by entry ``e`` (``-1``: free), ``stamp[L, e]`` (int64)
    its last use (``-1``: never), ``tick[L]`` (int64) resolves so far, ``entry_of[L, u]``
    the entry holding unit ``u`` (``-1``: none), ``first[L, u]`` a scratch of
    ``INT32_MAX`` (left as found), ``marks[L] = (history, capacity)`` in tokens: units
    ``[history // unit_tokens, ceil(capacity / unit_tokens))`` are in flight and their
    entries pinned.

    ``selected`` ``[rows, num_selected]`` names the units to resolve (``-1`` or an id
    outside ``[0, max_units)``: unused slot); ``selected=None`` pins the in-flight units
    instead (slot ``s`` is unit ``history // unit_tokens + s``, ``num_selected`` is then the
    working-set size, ``entry_map`` the write map and the miss list the pin's), adding
    nothing to the counters. Outputs: ``entry_map[rows, num_selected]``, the per-row miss lists
    ``miss_unit`` / ``miss_entry`` ``[rows, num_selected]`` (slot order) with
    ``miss_count[rows]``, and ``counters`` (int64 ``[rows, 2]``: distinct hits and misses,
    added). ``keys`` (uint64 ``[rows, pow2 >= working_set_units]``) is the global-memory
    scratch for working sets past the backend's shared-memory limit.
    """

    rows: int
    leases: int
    num_selected: int
    working_set_units: int
    max_units: int
    unit_tokens: int
    lease_of_row: Buffer
    marks: Buffer
    resident: Buffer
    stamp: Buffer
    tick: Buffer
    entry_of: Buffer
    first: Buffer
    selected: Buffer | None
    entry_map: Buffer
    miss_unit: Buffer
    miss_entry: Buffer
    miss_count: Buffer
    counters: Buffer
    keys: Buffer


@attrs.frozen
class SparseBufferCells:
    """Where one sparse buffer's units live: host pages and arena cells.

    Unit ``u`` of a row is bytes ``[(u % upp) * unit_bytes, ...)`` of the host page of block
    ``u // upp`` (``host.page_start(slot)``, ``slot`` from the row's page table); entry ``e``
    of lease ``L`` is bytes ``[(e % upp) * unit_bytes, ...)`` of cell
    ``L * lease_cells + e // upp`` of ``cells`` (``cells.offset`` already names the
    buffer's first cell of lease 0, ``cells.stride`` is the cell size).
    """

    host: PageRegion
    cells: PageRegion
    unit_bytes: int
    units_per_page: int
    lease_cells: int


@attrs.frozen
class SparseCopy:
    """A fetch (host pages to arena cells, the units of the miss lists) or a flush (cells to
    host pages, the units ``[ranges[r, 0], ranges[r, 1])`` of each row, through
    ``entry_of``) of several buffers, for :meth:`KernelBackend.sparse_copy`.

    ``page_table`` is the group's device table ``[rows, row_elems]`` of slot ids (beam 0
    first); a unit whose block has no page (``BAD_PAGE_INDEX``) or no entry is skipped.
    """

    flush: bool
    rows: int
    num_selected: int
    max_units: int
    row_elems: int
    buffers: tuple[SparseBufferCells, ...]
    page_table: Buffer
    lease_of_row: Buffer
    miss_unit: Buffer | None = None
    miss_entry: Buffer | None = None
    miss_count: Buffer | None = None
    entry_of: Buffer | None = None
    ranges: Buffer | None = None


@attrs.frozen
class FingerprintPages:
    """A batch of pages for the fingerprint engine's write and check kernels.

    Page ``i`` is ``page_bytes[i]`` bytes at address ``addresses[i]`` and is cut into
    ``record_slots[i]`` token slots: slot ``t`` covers bytes
    ``[t * P // R, (t + 1) * P // R)`` (``P`` the page size, ``R`` its slot count), filled
    with the 16-byte record ``(token_ids[i, t], (positions[i] + t) mod 2**32, tags[i, 0],
    tags[i, 1])`` as four little-endian uint32 words, repeated and cut at the slot's end.
    Only slots in ``[begin[i], end[i])`` are written or checked.
    """

    addresses: np.ndarray  # int64 [n]: page start as kernels see it
    page_bytes: np.ndarray  # int64 [n]
    record_slots: np.ndarray  # int32 [n]: token slots in the page (tokens_per_block; 1 for SSM)
    token_ids: np.ndarray  # uint32 [n, max record_slots]
    begin: np.ndarray  # int32 [n]
    end: np.ndarray  # int32 [n]
    positions: np.ndarray  # int64 [n]: absolute position of token slot 0
    tags: np.ndarray  # uint32 [n, 2]: (layer id, buffer ordinal << 16 | beam)

    def __len__(self) -> int:
        return len(self.addresses)


class Stream(abc.ABC):
    """An ordered queue of device work. On the numpy backend work runs at once."""

    @abc.abstractmethod
    def synchronize(self) -> None:
        """Block until every piece of work queued so far has finished."""

    @abc.abstractmethod
    def wait_event(self, event: Event) -> None:
        """Make later work on this stream wait for ``event``."""

    @property
    def handle(self) -> int:
        """The native handle (``cudaStream_t`` as an int; 0 where there is none)."""
        return 0


class Event(abc.ABC):
    """A marker in a stream that other streams and the host can wait for."""

    @abc.abstractmethod
    def record(self, stream: Stream | None = None) -> None:
        """Mark the current end of ``stream`` (default stream if ``None``)."""

    @abc.abstractmethod
    def query(self) -> bool:
        """True once all work before the recorded point has finished."""

    @abc.abstractmethod
    def synchronize(self) -> None:
        """Block the host until the event has completed."""

    def elapsed_ms(self, start: Event) -> float:
        """Device time in milliseconds from ``start`` to this event, both recorded and
        complete (benchmarks time device work with it).

        Raises:
            NotImplementedError: the backend has no device clock (numpy).
        """
        raise NotImplementedError(f"{type(self).__name__} does not time device work")


def copy_pairs(dst: np.ndarray, src: np.ndarray) -> np.ndarray:
    """The ``int32 [n, 2]`` pair array of a copy: ``(dst[i], src[i])`` per row."""
    out = np.empty((len(dst), 2), dtype=np.int32)
    out[:, 0] = dst
    out[:, 1] = src
    return out


_I32 = np.dtype(np.int32)
#: Pair arrays up to this many rows are bounded in plain Python (a NumPy reduction costs
#: about a microsecond whatever its size; a short list is cheaper).
_SMALL_PAIRS = 16
_min_of = np.minimum.reduce
_max_of = np.maximum.reduce


def check_copy_args(dst: PageRegion, src: PageRegion, page_bytes: int,
                    pairs: np.ndarray) -> tuple[int, int]:
    """Validate ``copy_pages`` arguments; every backend calls this before launching.

    Returns:
        ``(dst_count, src_count)``: one past the highest destination and source page index
        (``(0, 0)`` for no pairs), which is how much of each region the copy touches.

    Raises:
        ValueError: wrong pair array, non-positive page size, negative offsets or strides,
            or a page that would fall outside its buffer.
    """
    if page_bytes <= 0:
        raise ValueError(f"page_bytes={page_bytes}: must be > 0")
    if pairs.ndim != 2 or pairs.shape[1] != 2:
        raise ValueError(f"pairs.shape={pairs.shape}: must be [n, 2] (destination, source)")
    if pairs.dtype is not _I32 and pairs.dtype != _I32:
        raise ValueError(f"pairs.dtype={pairs.dtype}: must be int32")
    d_off, d_stride, s_off, s_stride = dst.offset, dst.stride, src.offset, src.stride
    if d_off < 0 or d_stride < 0:
        raise ValueError(f"dst offset={d_off} stride={d_stride}: must be >= 0")
    if s_off < 0 or s_stride < 0:
        raise ValueError(f"src offset={s_off} stride={s_stride}: must be >= 0")
    n = len(pairs)
    if n == 0:
        return 0, 0
    if n <= _SMALL_PAIRS:  # the same bounds from a short list
        flat = pairs.ravel().tolist()
        lo = min(flat)
        hi_d, hi_s = max(flat[0::2]), max(flat[1::2])
    else:  # one reduction over both columns for the lower bound
        lo = int(_min_of(pairs, axis=None))
        hi_d, hi_s = int(_max_of(pairs[:, 0])), int(_max_of(pairs[:, 1]))
    if lo < 0:  # which column, only here
        low = pairs.min(axis=0).tolist()
        label, column = ("dst", 0) if low[0] < 0 else ("src", 1)
        raise ValueError(f"{label} page index {low[column]}: must be >= 0")
    if d_off + hi_d * d_stride + page_bytes > dst.buffer.nbytes:
        _past_end("dst", dst, hi_d, page_bytes)
    if s_off + hi_s * s_stride + page_bytes > src.buffer.nbytes:
        _past_end("src", src, hi_s, page_bytes)
    return hi_d + 1, hi_s + 1


def _past_end(label: str, region: PageRegion, hi: int, page_bytes: int) -> None:
    end = region.offset + hi * region.stride + page_bytes
    raise ValueError(f"{label} page index {hi} ends at byte {end}, past the buffer's "
                     f"{region.buffer.nbytes} bytes")


class KernelBackend(abc.ABC):
    """A device runtime and the kernels of the contract.

    Subclasses set :attr:`name` and :attr:`capabilities`. Methods that take a ``stream``
    queue work on it (``None`` = the backend's default stream) and return at once on
    device backends; the numpy backend runs everything synchronously.
    """

    name: str = "abstract"
    capabilities: KernelBackendCapabilities = KernelBackendCapabilities(has_device=False)

    # -- runtime -----------------------------------------------------------------------

    @abc.abstractmethod
    def alloc_device(self, nbytes: int) -> Buffer:
        """Device memory of ``nbytes`` (contents undefined)."""

    @abc.abstractmethod
    def alloc_host(self, nbytes: int) -> Buffer:
        """Pinned, device-mapped host memory of ``nbytes`` (contents undefined)."""

    @property
    @abc.abstractmethod
    def default_stream(self) -> Stream:
        """The stream used when ``None`` is passed."""

    @abc.abstractmethod
    def create_stream(self) -> Stream:
        """A new stream."""

    @abc.abstractmethod
    def create_event(self) -> Event:
        """A new event (not yet recorded: it queries as complete)."""

    def synchronize(self) -> None:
        """Wait for all work on the device."""
        self.default_stream.synchronize()

    def is_capturing(self, stream: Stream | None = None) -> bool:
        """Whether ``stream`` is capturing a CUDA graph (work queued on it is recorded,
        not run). Backends without graphs never capture."""
        return False

    @abc.abstractmethod
    def read(self, buffer: Buffer, offset: int, nbytes: int) -> np.ndarray:
        """Copy ``nbytes`` at ``offset`` of ``buffer`` to a new host ``uint8`` array.

        Synchronous, after all queued work: a backdoor for tests and tools, not a data path.
        """

    @abc.abstractmethod
    def write(self, buffer: Buffer, offset: int, data: np.ndarray | bytes) -> None:
        """Copy host bytes into ``buffer`` at ``offset``; synchronous (a backdoor)."""

    def copy_bytes(
        self,
        dst: Buffer,
        dst_offset: int,
        src: Buffer,
        src_offset: int,
        nbytes: int,
        stream: Stream | None = None,
    ) -> None:
        """One contiguous copy of ``nbytes`` (a plain memcpy queued on ``stream``): the
        physical limit that page copies are measured against.

        Raises:
            ValueError: a range outside its buffer.
        """
        for label, buf, off in (("destination", dst, dst_offset), ("source", src, src_offset)):
            if off < 0 or nbytes < 0 or off + nbytes > buf.nbytes:
                raise ValueError(f"copy {label} of {nbytes} bytes at {off} outside {buf.nbytes}")
        dst.host_view()[dst_offset : dst_offset + nbytes] = src.host_view()[
            src_offset : src_offset + nbytes
        ]

    def as_array(self, buffer: Buffer) -> Any:
        """A zero-copy array view of the buffer: a NumPy array on the numpy backend, a
        device array (DLPack, ``__cuda_array_interface__``) on CUDA backends."""
        return buffer.host_view()

    # -- kernels -----------------------------------------------------------------------

    @abc.abstractmethod
    def copy_pages(
        self,
        dst: PageRegion,
        src: PageRegion,
        page_bytes: int,
        pairs: np.ndarray,
        stream: Stream | None = None,
    ) -> None:
        """Copy pages: for each row ``(d, s)`` of ``pairs`` (int32 ``[n, 2]``), the
        ``page_bytes`` bytes at ``src.page_start(s)`` go to ``dst.page_start(d)``.

        Destination pages must not overlap each other or any source page of the same call
        (the result is undefined otherwise). An empty ``pairs`` is a no-op. Regions may be
        in device or host memory, any combination.
        """

    def copy_pages_batch(self, tasks: Sequence[CopyTask], stream: Stream | None = None) -> None:
        """Several ``copy_pages`` calls as one unit of work (one launch where possible).

        Every task is validated before any is run, so bad arguments in one task raise
        ``ValueError`` and copy nothing. Destination pages must not overlap each other or
        any source page across the whole batch.
        """
        for task in tasks:
            check_copy_args(task.dst, task.src, task.page_bytes, task.pairs)
        for task in tasks:
            self.copy_pages(task.dst, task.src, task.page_bytes, task.pairs, stream)

    def copy_pages_checked_by_caller(self, parts: Sequence[tuple[PageRegion, PageRegion, int]],
                                     dst: np.ndarray, src: np.ndarray,
                                     stream: Stream | None = None) -> None:
        """:meth:`copy_pages_batch` of the same pages in every part, for a copy the core
        built: ``parts`` as ``(dst region, src region, page bytes)``, page ``src[i]`` of
        every part's source into page ``dst[i]`` of its destination (1-D integer arrays of
        the same length, every index at least 0 and inside its region's buffer, no
        destination overlapping a source). A backend may skip the argument checks here;
        the default builds the pair array and runs :meth:`copy_pages_batch`."""
        pairs = copy_pairs(dst, src)
        self.copy_pages_batch([CopyTask(dr, sr, size, pairs) for dr, sr, size in parts],
                              stream)

    @abc.abstractmethod
    def convert_page_indices(
        self,
        slots: np.ndarray,
        scale: int,
        offset: int,
        expansion: int = 1,
        stream: Stream | None = None,
        *,
        scratch: ScratchDesc | None = None,
    ) -> np.ndarray:
        """Slot ids to page indices: ``out[..., i*expansion + e] = slots[..., i] * scale +
        offset + e`` for ``e < expansion``; ``BAD_PAGE_INDEX`` entries stay
        ``BAD_PAGE_INDEX`` (all ``expansion`` of them). Input and output are int32; the
        output's last axis is ``expansion`` times longer.

        ``scratch`` (a :class:`~kvcm_core.scratch.ScratchDesc`, SWA scratch pages) applies
        to the last axis (blocks): a block ``b`` of the table with ``begin <= b < end`` maps,
        whatever its slot entry (the base table shows ``BAD_PAGE_INDEX`` there), to its
        rotated index in the descriptor's scratch slots. With ``p = b - begin``,
        ``spb = scratch_pages_per_block``, ``S = scale // expansion`` and ``O = offset //
        expansion`` (the arithmetic runs in whole pages of ``expansion`` units)::

            total = p * spb
            page  = slot_ids[total // S] * S + (total % S + O) % S
            out[..., b*expansion + e] = page * expansion + e

        Other blocks convert as without ``scratch``; blocks of the range past the table's
        end are ignored. ``scratch=None`` (or a range outside the table) is the plain
        conversion. The reference is :func:`kvcm_core.scratch.convert_page_indices_reference`.

        Raises:
            ValueError: ``expansion < 1``; with ``scratch``: ``begin < 0``, ``spb < 1``,
                ``scale`` outside ``[1, INT32_MAX]``, ``scale`` or ``offset`` not a multiple
                of ``expansion``, too few slot ids or one outside ``[0, INT32_MAX]``
                (:func:`kvcm_core.scratch.scratch_kernel_args`).
            OverflowError: a result outside ``[BAD_PAGE_INDEX, INT32_MAX]``.
        """

    def convert_page_tables(self, tables: Sequence[TableConversion], rows: np.ndarray,
                            stream: Stream | None = None) -> None:
        """Convert ``rows`` (int32 row numbers) of every table in ``tables``, device to
        device, as one unit of work (one launch on CUDA backends): each converted row is
        what :meth:`convert_page_indices` gives for that row with the row's scratch
        descriptor. Other rows of ``dst`` are left as they are. The caller keeps results
        in range (no overflow is reported) and rows within both buffers.

        Raises:
            NotImplementedError: the backend has no such kernel (a ``Batch`` needs it).
        """
        raise NotImplementedError(f"kernel backend {self.name!r} has no convert_page_tables")

    # -- sparse attention --------------------------------------------------------------

    def sparse_resolve(self, job: SparseResolve, stream: Stream | None = None) -> None:
        """Resolve one selection group's selection (or pin its in-flight units) on the
        device: the rules are :func:`kvcm_core.sparse.reference.resolve_reference`'s,
        bit for bit.

        Raises:
            NotImplementedError: the backend has no such kernel (sparse layers need it).
        """
        raise NotImplementedError(f"kernel backend {self.name!r} has no sparse_resolve")

    def sparse_copy(self, job: SparseCopy, stream: Stream | None = None) -> None:
        """Fetch or flush sparse units (:class:`SparseCopy`), one launch on CUDA backends:
        :func:`kvcm_core.sparse.reference.copy_reference` defines the bytes.

        Raises:
            NotImplementedError: the backend has no such kernel (sparse layers need it).
        """
        raise NotImplementedError(f"kernel backend {self.name!r} has no sparse_copy")

    # -- the fingerprint engine's kernels ---------------------------------------------

    @abc.abstractmethod
    def fingerprint_write(self, pages: FingerprintPages, stream: Stream | None = None) -> None:
        """Write the records of :class:`FingerprintPages` into their pages."""

    @abc.abstractmethod
    def fingerprint_check(
        self, pages: FingerprintPages, stream: Stream | None = None
    ) -> np.ndarray:
        """Check pages against their records; returns ``bool [n]`` (True: exact match).

        Synchronous: returns after the check ran.
        """

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release backend-wide resources (streams, compiled modules)."""
