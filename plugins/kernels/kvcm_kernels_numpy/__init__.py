"""The ``numpy`` kernel backend: the reference every other backend must match.

Its "device memory" is host memory, its streams and events are synchronous, and its kernels
are plain NumPy. It is the default where no GPU exists, so the whole manager runs and is
tested on machines without one.
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Iterator, Sequence

import numpy as np

from kvcm_core import hookimpl
from kvcm_core.backend import (
    Buffer,
    CopyTask,
    Event,
    FingerprintPages,
    KernelBackend,
    MemoryKind,
    PageRegion,
    SparseCopy,
    SparseResolve,
    Stream,
    TableConversion,
    check_copy_args,
)
from kvcm_core.records import KernelBackendCapabilities, KernelBackendSpec
from kvcm_core.scratch import ScratchDesc, convert_page_indices_reference
from kvcm_core.sparse.reference import copy_reference, resolve_reference, resolve_views

__all__ = ["NumpyBackend", "NumpyBuffer", "fingerprint_image"]

_ALIGN = 256
_FEW_PAIRS = 8  # copies of up to this many pages run page by page (see NumpyBackend._copy)
_KEPT_VIEWS = 256  # whole-buffer page views kept at most (see NumpyBackend._page_items)
# run_copies False: a move's copy here is one gather and one scatter of whole pages
# (copy_pages_checked_by_caller), as cheap in any order; pairing its slots into runs
# would only sort them.
CAPABILITIES = KernelBackendCapabilities(has_device=False, host_mapped=True, run_copies=False)


class NumpyBuffer(Buffer):
    """Host memory standing in for device or pinned memory (aligned to 256 bytes)."""

    def __init__(self, backend: NumpyBackend, nbytes: int, kind: str) -> None:
        if isinstance(nbytes, bool) or not isinstance(nbytes, int | np.integer) or nbytes < 0:
            raise ValueError(f"nbytes={nbytes!r}: must be an int >= 0")
        self.nbytes = int(nbytes)
        self.kind = kind
        raw = np.empty(self.nbytes + _ALIGN, dtype=np.uint8)
        start = (-raw.ctypes.data) % _ALIGN
        self._raw: np.ndarray | None = raw
        self._array: np.ndarray | None = raw[start : start + self.nbytes]
        self.ptr = int(self._array.ctypes.data)
        self.host_ptr = self.ptr
        self._backend = backend
        backend._track(self)

    @property
    def array(self) -> np.ndarray:
        if self._array is None:
            raise ValueError("buffer was freed")
        return self._array

    def host_view(self) -> np.ndarray:
        return self.array

    def free(self) -> None:
        if self._array is not None:
            self._backend._untrack(self)
            self._array = None
            self._raw = None

    def __repr__(self) -> str:
        return f"NumpyBuffer({self.kind}, {self.nbytes} bytes at {self.ptr:#x})"


class NumpyStream(Stream):
    """Work runs when it is queued; there is nothing to wait for."""

    def synchronize(self) -> None:
        pass

    def wait_event(self, event: Event) -> None:
        pass


class NumpyEvent(Event):
    def __init__(self) -> None:
        self.recorded = False

    def record(self, stream: Stream | None = None) -> None:
        self.recorded = True

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


def _page_view(region: PageRegion, page_bytes: int, count: int) -> np.ndarray:
    """``[count, page_bytes]`` view of a region's first ``count`` pages (the caller
    checked that they lie inside the buffer)."""
    base = region.buffer.host_view()
    if count == 0:
        return np.empty((0, page_bytes), dtype=np.uint8)
    off, stride = region.offset, region.stride
    if stride == page_bytes:  # packed pages: a plain reshape
        return base[off : off + count * page_bytes].reshape(count, page_bytes)
    return np.ndarray((count, page_bytes), dtype=np.uint8, buffer=base, offset=off,
                      strides=(stride, 1))


def _page_items(region: PageRegion, page_bytes: int, count: int) -> np.ndarray:
    """:func:`_page_view` with each page as one item (``void`` of ``page_bytes``): a
    fancy index then copies whole pages, not byte by byte."""
    base = region.buffer.host_view()
    return np.ndarray((count,), dtype=_page_item(page_bytes), buffer=base,
                      offset=region.offset, strides=(region.stride,))


def _all_items(region: PageRegion, page_bytes: int) -> np.ndarray | None:
    """:func:`_page_items` of every whole page of the region's buffer (None: a region
    with a zero stride, or without one whole page)."""
    stride = region.stride
    room = region.buffer.nbytes - region.offset - page_bytes
    if stride <= 0 or room < 0:
        return None
    return _page_items(region, page_bytes, room // stride + 1)


@functools.lru_cache(maxsize=64)
def _page_item(page_bytes: int) -> np.dtype:
    """The ``void`` dtype of one page (kept: making a dtype costs as much as the view)."""
    return np.dtype((np.void, page_bytes))


def _slot_maps(page_bytes: int, slots: int) -> tuple[np.ndarray, np.ndarray]:
    """For each byte of a page: its token slot, and its offset inside the 16-byte record."""
    j = np.arange(page_bytes, dtype=np.int64)
    slot = ((j + 1) * slots - 1) // page_bytes
    first = (slot * page_bytes) // slots
    return slot, (j - first) % 16


def fingerprint_image(pages: FingerprintPages, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Expected bytes and write mask of the pages ``rows`` (all of one size and slot count).

    Returns:
        ``(image uint8 [k, P], mask bool [k, P])``: the records, and which bytes belong to
        slots in ``[begin, end)``.
    """
    p = int(pages.page_bytes[rows[0]])
    r = int(pages.record_slots[rows[0]])
    slot_of, off_of = _slot_maps(p, r)
    words = np.empty((len(rows), r, 4), dtype="<u4")
    words[:, :, 0] = pages.token_ids[rows, :r]
    pos = pages.positions[rows, None] + np.arange(r, dtype=np.int64)[None, :]
    words[:, :, 1] = (pos & 0xFFFFFFFF).astype("<u4")
    words[:, :, 2] = pages.tags[rows, 0, None]
    words[:, :, 3] = pages.tags[rows, 1, None]
    record_bytes = words.view(np.uint8).reshape(len(rows), r, 16)
    image = record_bytes[:, slot_of, off_of]
    mask = (slot_of[None, :] >= pages.begin[rows, None]) & (
        slot_of[None, :] < pages.end[rows, None]
    )
    return image, mask


def _groups(pages: FingerprintPages) -> Iterator[np.ndarray]:
    keys = pages.page_bytes.astype(np.int64) * (1 << 20) + pages.record_slots.astype(np.int64)
    for key in np.unique(keys):
        yield np.nonzero(keys == key)[0]


class NumpyBackend(KernelBackend):
    """The reference backend (see module docstring)."""

    name = "numpy"
    capabilities = CAPABILITIES

    def __init__(self, options: dict | None = None) -> None:
        self._stream = NumpyStream()
        self._starts: list[int] = []
        self._buffers: dict[int, NumpyBuffer] = {}
        #: (buffer address, offset, stride, page bytes) -> the page items of the whole
        #: buffer (:func:`_all_items`), kept while the buffer lives: a copy indexes them
        #: instead of making two views per call.
        self._items: dict[tuple[int, int, int, int], tuple[NumpyBuffer, np.ndarray]] = {}
        self._views: dict[int, tuple[NumpyBuffer, memoryview]] = {}  # address -> its bytes

    # -- runtime -----------------------------------------------------------------------

    def _track(self, buf: NumpyBuffer) -> None:
        if buf.nbytes:
            bisect.insort(self._starts, buf.ptr)
            self._buffers[buf.ptr] = buf

    def _untrack(self, buf: NumpyBuffer) -> None:
        if buf.nbytes and self._buffers.get(buf.ptr) is buf:
            del self._buffers[buf.ptr]
            self._starts.pop(bisect.bisect_left(self._starts, buf.ptr))
            if self._items:
                for key in [k for k in self._items if k[0] == buf.ptr]:
                    del self._items[key]
            kept = self._views.pop(buf.ptr, None)
            if kept is not None:
                kept[1].release()

    def _page_items(self, region: PageRegion, page_bytes: int, count: int) -> np.ndarray:
        """Pages ``0..count-1`` of ``region`` as items (at least that many): the kept
        items of the whole buffer where it is one of this backend's live buffers."""
        buf = region.buffer
        key = (buf.ptr, region.offset, region.stride, page_bytes)
        kept = self._items.get(key)
        if kept is not None and kept[0] is buf:
            return kept[1]
        if self._buffers.get(buf.ptr) is not buf:  # not ours (or freed): nothing kept
            return _page_items(region, page_bytes, count)
        items = _all_items(region, page_bytes)
        if items is None:
            return _page_items(region, page_bytes, count)
        if len(self._items) >= _KEPT_VIEWS:
            self._items.clear()
        self._items[key] = (buf, items)
        return items

    def _kept_items(self, region: PageRegion, page_bytes: int) -> np.ndarray | None:
        """:meth:`_page_items` of every whole page of the region's buffer, kept; None
        where the buffer is not one of this backend's live buffers (or has no whole
        page)."""
        buf = region.buffer
        kept = self._items.get((buf.ptr, region.offset, region.stride, page_bytes))
        if kept is not None and kept[0] is buf:
            return kept[1]
        if self._buffers.get(buf.ptr) is not buf or _all_items(region, page_bytes) is None:
            return None
        return self._page_items(region, page_bytes, 0)

    def _bytes(self, buf: Buffer) -> memoryview | None:
        """The bytes of one of this backend's live buffers (kept while it lives), else
        None."""
        kept = self._views.get(buf.ptr)
        if kept is not None and kept[0] is buf:
            return kept[1]
        if self._buffers.get(buf.ptr) is not buf:
            return None
        view = memoryview(buf.host_view())
        self._views[buf.ptr] = (buf, view)
        return view

    def _copy(self, task: CopyTask, counts: tuple[int, int]) -> None:
        """One checked copy: ``counts`` from :func:`check_copy_args`."""
        pairs = task.pairs
        n = len(pairs)
        if n == 0:
            return
        if n <= _FEW_PAIRS:
            src, dst = task.src, task.dst
            sb, db = src.buffer, dst.buffer
            if n == 1 or sb is not db:
                sm, dm = self._bytes(sb), self._bytes(db)
                if sm is not None and dm is not None:
                    # Page by page, slices of the buffers' bytes: what the gather and
                    # scatter below give, as nothing is read after a write to it (one
                    # page, or two buffers; an overlapping slice copies like memmove).
                    size = task.page_bytes
                    s0, s_stride, d0, d_stride = src.offset, src.stride, dst.offset, dst.stride
                    for d, s in pairs.tolist():
                        at, fr = d0 + d * d_stride, s0 + s * s_stride
                        dm[at : at + size] = sm[fr : fr + size]
                    return
        src_view = self._page_items(task.src, task.page_bytes, counts[1])
        dst_view = self._page_items(task.dst, task.page_bytes, counts[0])
        dst_view[pairs[:, 0]] = src_view[pairs[:, 1]]  # gather first, then scatter

    def _resolve(self, address: int, nbytes: int) -> tuple[NumpyBuffer, int]:
        """The live buffer holding ``[address, address + nbytes)`` and the offset in it."""
        i = bisect.bisect_right(self._starts, address) - 1
        if i >= 0:
            buf = self._buffers[self._starts[i]]
            off = address - buf.ptr
            if off + nbytes <= buf.nbytes:
                return buf, off
        raise ValueError(
            f"address {address:#x} (+{nbytes} bytes) is not inside memory of this backend"
        )

    def alloc_device(self, nbytes: int) -> NumpyBuffer:
        return NumpyBuffer(self, nbytes, MemoryKind.DEVICE)

    def alloc_host(self, nbytes: int) -> NumpyBuffer:
        return NumpyBuffer(self, nbytes, MemoryKind.HOST)

    @property
    def default_stream(self) -> Stream:
        return self._stream

    def create_stream(self) -> Stream:
        return NumpyStream()

    def create_event(self) -> Event:
        return NumpyEvent()

    def read(self, buffer: Buffer, offset: int, nbytes: int) -> np.ndarray:
        if offset < 0 or nbytes < 0 or offset + nbytes > buffer.nbytes:
            raise ValueError(f"read of {nbytes} bytes at {offset} outside {buffer.nbytes} bytes")
        return buffer.host_view()[offset : offset + nbytes].copy()

    def write(self, buffer: Buffer, offset: int, data: np.ndarray | bytes) -> None:
        src = np.frombuffer(data, dtype=np.uint8) if isinstance(data, bytes | bytearray) \
            else np.ascontiguousarray(data).view(np.uint8).reshape(-1)
        if offset < 0 or offset + src.size > buffer.nbytes:
            raise ValueError(f"write of {src.size} bytes at {offset} outside {buffer.nbytes}")
        buffer.host_view()[offset : offset + src.size] = src

    # -- kernels -----------------------------------------------------------------------

    def copy_pages(
        self,
        dst: PageRegion,
        src: PageRegion,
        page_bytes: int,
        pairs: np.ndarray,
        stream: Stream | None = None,
    ) -> None:
        self._copy(CopyTask(dst, src, page_bytes, pairs),
                   check_copy_args(dst, src, page_bytes, pairs))

    def copy_pages_batch(self, tasks: Sequence[CopyTask], stream: Stream | None = None) -> None:
        if len(tasks) == 1:
            task = tasks[0]
            self._copy(task, check_copy_args(task.dst, task.src, task.page_bytes, task.pairs))
            return
        counts = [check_copy_args(t.dst, t.src, t.page_bytes, t.pairs) for t in tasks]
        for task, n in zip(tasks, counts, strict=True):  # all checked before any runs
            self._copy(task, n)

    def copy_pages_checked_by_caller(self, parts: Sequence[tuple[PageRegion, PageRegion, int]],
                                     dst: np.ndarray, src: np.ndarray,
                                     stream: Stream | None = None) -> None:
        # The core's moves between stores (the pages of every part at the same indices):
        # one gather and one scatter of whole-page items per part, indexed by the slot
        # arrays as they are, without the pair array and its bounds checks (a caller's
        # promise; an index past the buffer still raises IndexError). A subclass that
        # runs batches its own way (deferred on streams, say), or a wrapper set on this
        # instance (tracing, fault injection), gets them as batches.
        if getattr(self.copy_pages_batch, "__func__", None) is not \
                NumpyBackend.copy_pages_batch:
            super().copy_pages_checked_by_caller(parts, dst, src, stream)
            return
        views = []
        for dr, sr, size in parts:
            dv, sv = self._kept_items(dr, size), self._kept_items(sr, size)
            if dv is None or sv is None:  # a buffer not ours: the checked copy
                super().copy_pages_checked_by_caller(parts, dst, src, stream)
                return
            views.append((dv, sv))
        for dv, sv in views:
            dv[dst] = sv[src]  # gather first, then scatter

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
        return convert_page_indices_reference(slots, scale, offset, expansion, scratch)

    def convert_page_tables(self, tables: Sequence[TableConversion], rows: np.ndarray,
                            stream: Stream | None = None) -> None:
        sel = np.asarray(rows, dtype=np.int64)
        if not len(sel):
            return
        chosen = set(sel.tolist())
        for t in tables:
            n_rows = t.src.nbytes // (4 * t.row_elems)
            src = t.src.host_view()[: 4 * n_rows * t.row_elems].view(np.int32)
            src = src.reshape(n_rows, -1, t.blocks)
            dst = t.dst.host_view()[: 4 * n_rows * t.row_elems * t.expansion].view(np.int32)
            dst = dst.reshape(n_rows, -1, t.blocks * t.expansion)
            scratch = {r: d for r, d in (t.scratch or {}).items() if r in chosen}
            plain = sel if not scratch else np.asarray(
                [r for r in sel.tolist() if r not in scratch], dtype=np.int64)
            if len(plain):
                dst[plain] = convert_page_indices_reference(src[plain], t.scale, t.offset,
                                                            t.expansion)
            for r, desc in scratch.items():
                dst[r] = convert_page_indices_reference(src[r], t.scale, t.offset,
                                                        t.expansion, desc)

    def sparse_resolve(self, job: SparseResolve, stream: Stream | None = None) -> None:
        resolve_reference(resolve_views(job), job.rows, job.num_selected,
                          job.working_set_units, job.max_units, job.unit_tokens)

    def sparse_copy(self, job: SparseCopy, stream: Stream | None = None) -> None:
        copy_reference(job)

    def _locate(self, pages: FingerprintPages) -> tuple[np.ndarray, np.ndarray]:
        """For every page: index of the live buffer holding it, and its offset there."""
        starts = np.asarray(self._starts, dtype=np.int64)
        addr = pages.addresses.astype(np.int64)
        idx = np.searchsorted(starts, addr, side="right") - 1
        if len(addr) and (idx.min() < 0):
            bad = int(addr[np.argmin(idx)])
            raise ValueError(f"address {bad:#x} is not inside memory of this backend")
        offsets = addr - starts[idx] if len(addr) else addr
        sizes = np.asarray([self._buffers[int(a)].nbytes for a in starts], dtype=np.int64)
        over = offsets + pages.page_bytes.astype(np.int64) > sizes[idx] if len(addr) else []
        if np.any(over):
            k = int(np.nonzero(over)[0][0])
            raise ValueError(f"address {int(addr[k]):#x} (+{int(pages.page_bytes[k])} bytes) "
                             "is not inside memory of this backend")
        return idx, offsets

    def _fingerprint_groups(
        self, pages: FingerprintPages
    ) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
        """Per (buffer, page size, slot count): rows, byte positions, image, mask, view."""
        idx, offsets = self._locate(pages)
        starts = self._starts
        for rows in _groups(pages):
            for b in np.unique(idx[rows]):
                sub = rows[idx[rows] == b]
                image, mask = fingerprint_image(pages, sub)
                p = image.shape[1]
                pos = offsets[sub, None] + np.arange(p, dtype=np.int64)[None, :]
                yield sub, pos, image, mask, self._buffers[starts[int(b)]].array

    def fingerprint_write(self, pages: FingerprintPages, stream: Stream | None = None) -> None:
        for _, pos, image, mask, view in self._fingerprint_groups(pages):
            view[pos[mask]] = image[mask]

    def fingerprint_check(
        self, pages: FingerprintPages, stream: Stream | None = None
    ) -> np.ndarray:
        ok = np.ones(len(pages), dtype=bool)
        for rows, pos, image, mask, view in self._fingerprint_groups(pages):
            ok[rows] = ((view[pos] == image) | ~mask).all(axis=1)
        return ok


@hookimpl
def kvcm_kernel_backends():
    yield KernelBackendSpec(
        name="numpy",
        factory=NumpyBackend,
        description="Reference backend: NumPy on the CPU, synchronous (no GPU needed)",
        capabilities=CAPABILITIES,
        priority=0,
    )
