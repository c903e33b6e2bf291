"""Conformance tests for kernel backends.

Every kernel is checked against an independent byte model written here in plain Python and
NumPy slicing (never by calling the ``numpy`` backend), on random layouts drawn by
hypothesis; results are read back through the backend's ``read`` backdoor, and inputs are
written through its ``write`` backdoor. Tests that need pinned host memory gate on
``capabilities.host_mapped``, device-only behaviour on ``capabilities.has_device``.

Subclass to run it for one backend::

    from kvcm_core.testing.conformance.kernels import KernelBackendConformance

    class TestMyBackend(KernelBackendConformance):
        plugin_name = "mine"
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from typing import Any

import attrs
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcm_core.backend import (
    BAD_PAGE_INDEX,
    Buffer,
    CopyTask,
    FingerprintPages,
    KernelBackend,
    MemoryKind,
    PageRegion,
    TableConversion,
)
from kvcm_core.scratch import ScratchDesc, convert_page_indices_reference
from kvcm_core.testing.conformance import ConformanceBase

__all__ = ["KernelBackendConformance"]

#: Bytes of one buffer in a random layout, at most (keeps an example well under a second).
_BUDGET = 4 << 20
_SETTINGS = settings(
    max_examples=50,
    deadline=None,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        # One base class, many subclasses (one per plugin): the same test function runs
        # with different `self`s by design.
        HealthCheck.differing_executors,
    ],
)
_FAST_SETTINGS = settings(_SETTINGS, max_examples=60)

# Page sizes from 1 byte to 1 MiB, mostly not powers of two, weighted to the small end.
_page_sizes = st.one_of(
    st.integers(1, 64), st.integers(65, 16 << 10), st.integers((16 << 10) + 1, 1 << 20)
)
_seeds = st.integers(0, 2**32 - 1)


# -- helpers -------------------------------------------------------------------------------


def _kinds(backend: KernelBackend) -> list[str]:
    """Memory kinds the backend's kernels can address."""
    if backend.capabilities.host_mapped:
        return [MemoryKind.DEVICE, MemoryKind.HOST]
    return [MemoryKind.DEVICE]


def _alloc(backend: KernelBackend, kind: str, nbytes: int) -> Buffer:
    if kind == MemoryKind.DEVICE:
        return backend.alloc_device(nbytes)
    return backend.alloc_host(nbytes)


def _filled(
    backend: KernelBackend, kind: str, nbytes: int, rng: np.random.Generator
) -> tuple[Buffer, np.ndarray]:
    """A buffer of random bytes, and the model's copy of them."""
    buf = _alloc(backend, kind, nbytes)
    data = rng.integers(0, 256, nbytes, dtype=np.uint8)
    backend.write(buf, 0, data)
    return buf, data.copy()


def _read_all(backend: KernelBackend, buf: Buffer) -> np.ndarray:
    return backend.read(buf, 0, buf.nbytes)


def _draw_slot_table(data: st.DataObject, shape: tuple[int, ...]) -> np.ndarray:
    """An int32 table of slot ids of ``shape``, with ``BAD_PAGE_INDEX`` mixed in."""
    size = int(np.prod(shape))
    values = data.draw(st.lists(st.one_of(st.just(BAD_PAGE_INDEX), st.integers(0, 50_000)),
                                min_size=size, max_size=size))
    return np.array(values, dtype=np.int32).reshape(shape)


def _pairs(dst: list[int], src: list[int]) -> np.ndarray:
    return np.array(list(zip(dst, src, strict=True)), dtype=np.int32).reshape(-1, 2)


def _model_copy(
    dst: np.ndarray,
    dst_offset: int,
    dst_stride: int,
    src: np.ndarray,
    src_offset: int,
    src_stride: int,
    page_bytes: int,
    pairs: np.ndarray,
) -> None:
    """The byte model of ``copy_pages``: gather every source page, then scatter."""
    gathered = [
        bytes(src[src_offset + s * src_stride : src_offset + s * src_stride + page_bytes])
        for _, s in pairs.tolist()
    ]
    for (d, _), page in zip(pairs.tolist(), gathered, strict=True):
        start = dst_offset + d * dst_stride
        dst[start : start + page_bytes] = np.frombuffer(page, dtype=np.uint8)


@attrs.frozen
class _CopyLayout:
    """A random ``copy_pages`` call: regions, pages, pairs, memory kinds."""

    page_bytes: int
    dst_kind: str
    dst_offset: int
    dst_stride: int
    dst_nbytes: int
    src_kind: str
    src_offset: int
    src_stride: int
    src_nbytes: int
    dst_pages: list[int]
    src_pages: list[int]
    seed: int


@st.composite
def _copy_layouts(draw: st.DrawFn, kinds: list[str]) -> _CopyLayout:
    page_bytes = draw(_page_sizes)
    regions = []
    for _ in range(2):
        offset = draw(st.integers(0, 300))
        extra = draw(st.one_of(st.just(0), st.integers(1, 63), st.integers(1, 2 * page_bytes)))
        stride = page_bytes + extra
        capacity = draw(st.integers(1, max(1, min(48, (_BUDGET - offset) // stride))))
        tail = draw(st.integers(0, 100))
        regions.append(
            (offset, stride, capacity, offset + (capacity - 1) * stride + page_bytes + tail)
        )
    (d_off, d_stride, d_cap, d_size), (s_off, s_stride, s_cap, s_size) = regions
    dst_pages = draw(st.permutations(range(d_cap)))[: draw(st.integers(0, d_cap))]
    src_pages = draw(
        st.lists(st.integers(0, s_cap - 1), min_size=len(dst_pages), max_size=len(dst_pages))
    )
    return _CopyLayout(
        page_bytes=page_bytes,
        dst_kind=draw(st.sampled_from(kinds)),
        dst_offset=d_off,
        dst_stride=d_stride,
        dst_nbytes=d_size,
        src_kind=draw(st.sampled_from(kinds)),
        src_offset=s_off,
        src_stride=s_stride,
        src_nbytes=s_size,
        dst_pages=list(dst_pages),
        src_pages=src_pages,
        seed=draw(_seeds),
    )


@attrs.frozen
class _BatchTask:
    column: int  # byte offset of the task's column inside a row
    page_bytes: int
    dst_rows: list[int]
    src_rows: list[int]


@attrs.frozen
class _BatchLayout:
    """Tasks sharing one destination and one source buffer, each in its own column of the
    rows (as a codec lays out pools inside a cold page), so no destination overlaps."""

    dst_kind: str
    dst_offset: int
    dst_row: int
    dst_rows: int
    src_kind: str
    src_offset: int
    src_row: int
    src_rows: int
    tasks: list[_BatchTask]
    seed: int


@st.composite
def _batch_layouts(draw: st.DrawFn, kinds: list[str]) -> _BatchLayout:
    count = draw(st.integers(0, 4))
    widths = draw(st.lists(st.integers(1, 8 << 10), min_size=count, max_size=count))
    columns, start = [], 0
    for width in widths:
        columns.append(start)
        start += width + draw(st.integers(0, 17))
    row = max(start, 1)
    dst_row = row + draw(st.integers(0, 40))
    src_row = row + draw(st.integers(0, 40))
    dst_rows = draw(st.integers(1, max(1, min(24, _BUDGET // dst_row))))
    src_rows = draw(st.integers(1, max(1, min(24, _BUDGET // src_row))))
    tasks = []
    for column, width in zip(columns, widths, strict=True):
        rows = draw(st.permutations(range(dst_rows)))[: draw(st.integers(0, dst_rows))]
        tasks.append(
            _BatchTask(
                column=column,
                page_bytes=draw(st.integers(1, width)),
                dst_rows=list(rows),
                src_rows=draw(
                    st.lists(st.integers(0, src_rows - 1), min_size=len(rows), max_size=len(rows))
                ),
            )
        )
    return _BatchLayout(
        dst_kind=draw(st.sampled_from(kinds)),
        dst_offset=draw(st.integers(0, 99)),
        dst_row=dst_row,
        dst_rows=dst_rows,
        src_kind=draw(st.sampled_from(kinds)),
        src_offset=draw(st.integers(0, 99)),
        src_row=src_row,
        src_rows=src_rows,
        tasks=tasks,
        seed=draw(_seeds),
    )


@attrs.frozen
class _FpPage:
    kind: str
    gap: int  # bytes skipped before the page in its buffer
    page_bytes: int
    record_slots: int
    begin: int
    end: int
    token_ids: list[int]
    position: int
    tags: tuple[int, int]


_u32 = st.integers(0, 2**32 - 1)


@st.composite
def _fp_pages(draw: st.DrawFn, kind: str) -> _FpPage:
    page_bytes = draw(st.one_of(st.integers(1, 80), st.integers(81, 64 << 10)))
    slots = draw(st.integers(1, 64))
    a, b = draw(st.integers(0, slots)), draw(st.integers(0, slots))
    return _FpPage(
        kind=kind,
        gap=draw(st.integers(0, 33)),
        page_bytes=page_bytes,
        record_slots=slots,
        begin=min(a, b),
        end=max(a, b),
        token_ids=draw(st.lists(_u32, min_size=slots, max_size=slots)),
        position=draw(st.integers(0, 2**40)),
        tags=(draw(_u32), draw(_u32)),
    )


def _fp_batches(kinds: list[str]) -> st.SearchStrategy[list[_FpPage]]:
    return st.lists(st.sampled_from(kinds).flatmap(_fp_pages), min_size=0, max_size=6)


def _slot_bounds(page: _FpPage, t: int) -> tuple[int, int]:
    """Bytes of token slot ``t``, as FingerprintPages' docstring defines them."""
    p, r = page.page_bytes, page.record_slots
    return t * p // r, (t + 1) * p // r


def _model_fingerprint(page: _FpPage, image: np.ndarray) -> None:
    """Write the records of ``page``'s slots in ``[begin, end)`` into ``image`` (its bytes)."""
    for t in range(page.begin, page.end):
        lo, hi = _slot_bounds(page, t)
        record = struct.pack(
            "<4I", page.token_ids[t], (page.position + t) % 2**32, page.tags[0], page.tags[1]
        )
        filled = (record * ((hi - lo) // 16 + 1))[: hi - lo]
        image[lo:hi] = np.frombuffer(filled, dtype=np.uint8)


def _checked_bytes(page: _FpPage) -> list[int]:
    """Byte offsets in ``page`` that belong to a slot in ``[begin, end)``."""
    out: list[int] = []
    for t in range(page.begin, page.end):
        lo, hi = _slot_bounds(page, t)
        out.extend(range(lo, hi))
    return out


@attrs.define
class _FpSetup:
    """Fingerprint pages placed in freshly allocated buffers of random bytes."""

    pages: list[_FpPage]
    buffers: dict[str, Buffer]
    models: dict[str, np.ndarray]
    starts: list[int]  # byte offset of each page in its kind's buffer
    batch: FingerprintPages

    def free(self) -> None:
        for buf in self.buffers.values():
            buf.free()


def _place_fingerprints(
    backend: KernelBackend, pages: list[_FpPage], rng: np.random.Generator
) -> _FpSetup:
    sizes: dict[str, int] = {}
    starts = []
    for page in pages:
        start = sizes.get(page.kind, 0) + page.gap
        starts.append(start)
        sizes[page.kind] = start + page.page_bytes
    buffers, models = {}, {}
    for kind, size in sizes.items():
        buffers[kind], models[kind] = _filled(backend, kind, size + 7, rng)
    n = len(pages)
    width = max((p.record_slots for p in pages), default=0)
    token_ids = np.zeros((n, width), dtype=np.uint32)
    for i, page in enumerate(pages):
        token_ids[i, : page.record_slots] = page.token_ids
    batch = FingerprintPages(
        addresses=np.array(
            [buffers[p.kind].ptr + s for p, s in zip(pages, starts, strict=True)], dtype=np.int64
        ),
        page_bytes=np.array([p.page_bytes for p in pages], dtype=np.int64),
        record_slots=np.array([p.record_slots for p in pages], dtype=np.int32),
        token_ids=token_ids,
        begin=np.array([p.begin for p in pages], dtype=np.int32),
        end=np.array([p.end for p in pages], dtype=np.int32),
        positions=np.array([p.position for p in pages], dtype=np.int64),
        tags=np.array([p.tags for p in pages], dtype=np.uint32).reshape(n, 2),
    )
    return _FpSetup(pages, buffers, models, starts, batch)


def _flip(backend: KernelBackend, buf: Buffer, offset: int) -> None:
    byte = backend.read(buf, offset, 1)
    backend.write(buf, offset, byte ^ np.uint8(0x5A))


# -- the suite -----------------------------------------------------------------------------


class KernelBackendConformance(ConformanceBase):
    """Checks a kernel backend's runtime and kernels against byte models."""

    kvcm_kind = "kernel_backend"

    @pytest.fixture(scope="class")
    @classmethod
    def backend(cls, kvcm_plugin_spec: Any) -> Iterator[KernelBackend]:
        """The backend under test, built with default options."""
        backend = kvcm_plugin_spec.factory({})
        yield backend
        backend.close()

    # -- record --------------------------------------------------------------------------

    def test_backend_declares_the_capabilities_of_its_record(
        self, backend: KernelBackend, kvcm_plugin_spec: Any
    ) -> None:
        assert backend.capabilities == kvcm_plugin_spec.capabilities

    # -- runtime -------------------------------------------------------------------------

    @pytest.mark.parametrize("nbytes", [0, 1, 3, 255, 4097, (1 << 20) + 7])
    @pytest.mark.parametrize("kind", [MemoryKind.DEVICE, MemoryKind.HOST])
    def test_alloc_gives_a_buffer_of_the_requested_size_and_kind(
        self, backend: KernelBackend, kind: str, nbytes: int
    ) -> None:
        if kind not in _kinds(backend):
            pytest.skip("backend declares no host-mapped memory")
        buf = _alloc(backend, kind, nbytes)
        try:
            assert buf.nbytes == nbytes
            assert buf.kind == kind
            assert isinstance(buf.ptr, int)
            data = backend.read(buf, 0, nbytes)
            assert data.dtype == np.uint8 and data.shape == (nbytes,)
        finally:
            buf.free()

    @_FAST_SETTINGS
    @given(data=st.data())
    def test_write_then_read_round_trips_bytes_at_any_offset(
        self, backend: KernelBackend, data: st.DataObject
    ) -> None:
        kind = data.draw(st.sampled_from(_kinds(backend)))
        nbytes = data.draw(st.integers(1, 5000))
        offset = data.draw(st.integers(0, nbytes))
        payload = data.draw(st.binary(max_size=nbytes - offset))
        buf = _alloc(backend, kind, nbytes)
        try:
            backend.write(buf, 0, np.zeros(nbytes, dtype=np.uint8))
            backend.write(buf, offset, payload)
            expected = np.zeros(nbytes, dtype=np.uint8)
            expected[offset : offset + len(payload)] = np.frombuffer(payload, dtype=np.uint8)
            got = backend.read(buf, offset, len(payload))
            assert got.dtype == np.uint8
            assert got.tobytes() == payload
            assert np.array_equal(_read_all(backend, buf), expected)
            got[...] = 0  # read returns a copy, not a view
            assert backend.read(buf, offset, len(payload)).tobytes() == payload
        finally:
            buf.free()

    def test_write_accepts_arrays_of_any_dtype_as_their_bytes(self, backend: KernelBackend) -> None:
        values = np.arange(7, dtype=np.float32) * 1.5
        buf = backend.alloc_device(64)
        try:
            backend.write(buf, 5, values)
            assert backend.read(buf, 5, values.nbytes).tobytes() == values.tobytes()
        finally:
            buf.free()

    @pytest.mark.parametrize(("offset", "nbytes"), [(-1, 1), (0, 17), (16, 1), (10, 7)])
    def test_read_or_write_outside_the_buffer_raises_value_error(
        self, backend: KernelBackend, offset: int, nbytes: int
    ) -> None:
        buf = backend.alloc_device(16)
        try:
            backend.write(buf, 0, bytes(range(16)))
            with pytest.raises(ValueError):
                backend.read(buf, offset, nbytes)
            with pytest.raises(ValueError):
                backend.write(buf, offset, bytes(nbytes))
            assert backend.read(buf, 0, 16).tobytes() == bytes(range(16))
        finally:
            buf.free()

    @pytest.mark.parametrize("kind", [MemoryKind.DEVICE, MemoryKind.HOST])
    @pytest.mark.parametrize("nbytes", [0, 1, 4096])
    def test_free_is_idempotent(self, backend: KernelBackend, kind: str, nbytes: int) -> None:
        if kind not in _kinds(backend):
            pytest.skip("backend declares no host-mapped memory")
        buf = _alloc(backend, kind, nbytes)
        buf.free()
        buf.free()

    def test_host_memory_has_a_host_view_of_its_bytes(self, backend: KernelBackend) -> None:
        if not backend.capabilities.host_mapped:
            pytest.skip("backend declares no host-mapped memory")
        buf = backend.alloc_host(33)
        try:
            assert buf.host_ptr is not None
            backend.write(buf, 0, bytes(range(33)))
            backend.synchronize()
            view = buf.host_view()
            assert view.dtype == np.uint8 and view.shape == (33,)
            assert view.tobytes() == bytes(range(33))
            view[3] = 200
            assert backend.read(buf, 3, 1)[0] == 200
        finally:
            buf.free()

    def test_device_memory_has_no_host_view(self, backend: KernelBackend) -> None:
        if not backend.capabilities.has_device:
            pytest.skip("backend has no device: its device memory is host memory")
        buf = backend.alloc_device(16)
        try:
            assert buf.host_ptr is None
            with pytest.raises(TypeError):
                buf.host_view()
        finally:
            buf.free()

    def test_new_event_queries_complete(self, backend: KernelBackend) -> None:
        assert backend.create_event().query() is True

    def test_streams_and_events_order_work_and_complete_after_synchronize(
        self, backend: KernelBackend
    ) -> None:
        rng = np.random.default_rng(7)
        src, src_model = _filled(backend, MemoryKind.DEVICE, 4096, rng)
        mid = backend.alloc_device(4096)
        dst = backend.alloc_device(4096)
        try:
            first, second = backend.create_stream(), backend.create_stream()
            assert isinstance(first.handle, int)
            whole = _pairs([0], [0])
            backend.copy_pages(PageRegion(mid, 0, 0), PageRegion(src, 0, 0), 4096, whole, first)
            done = backend.create_event()
            done.record(first)
            second.wait_event(done)
            backend.copy_pages(PageRegion(dst, 0, 0), PageRegion(mid, 0, 0), 4096, whole, second)
            later = backend.create_event()
            later.record(second)
            second.synchronize()
            assert later.query() is True
            done.synchronize()
            assert done.query() is True
            assert np.array_equal(_read_all(backend, dst), src_model)

            on_default = backend.create_event()
            on_default.record(None)
            backend.default_stream.wait_event(on_default)
            backend.synchronize()
            assert on_default.query() is True
        finally:
            for buf in (src, mid, dst):
                buf.free()

    # -- copy_pages ----------------------------------------------------------------------

    @_SETTINGS
    @given(data=st.data())
    def test_copy_pages_matches_byte_model_on_random_layouts(
        self, backend: KernelBackend, data: st.DataObject
    ) -> None:
        lay = data.draw(_copy_layouts(_kinds(backend)))
        rng = np.random.default_rng(lay.seed)
        dst, dst_model = _filled(backend, lay.dst_kind, lay.dst_nbytes, rng)
        src, src_model = _filled(backend, lay.src_kind, lay.src_nbytes, rng)
        try:
            pairs = _pairs(lay.dst_pages, lay.src_pages)
            backend.copy_pages(
                PageRegion(dst, lay.dst_offset, lay.dst_stride),
                PageRegion(src, lay.src_offset, lay.src_stride),
                lay.page_bytes,
                pairs,
            )
            _model_copy(
                dst_model,
                lay.dst_offset,
                lay.dst_stride,
                src_model,
                lay.src_offset,
                lay.src_stride,
                lay.page_bytes,
                pairs,
            )
            assert np.array_equal(_read_all(backend, dst), dst_model)
            assert np.array_equal(_read_all(backend, src), src_model)
        finally:
            dst.free()
            src.free()

    @_SETTINGS
    @given(data=st.data())
    def test_copy_pages_within_one_buffer_matches_byte_model(
        self, backend: KernelBackend, data: st.DataObject
    ) -> None:
        """Copy-on-write and defragmentation copy between disjoint pages of one pool."""
        kind = data.draw(st.sampled_from(_kinds(backend)))
        page_bytes = data.draw(_page_sizes)
        stride = page_bytes + data.draw(st.integers(0, 100))
        offset = data.draw(st.integers(0, 77))
        capacity = data.draw(st.integers(2, max(2, min(40, _BUDGET // stride))))
        order = data.draw(st.permutations(range(capacity)))
        n_dst = data.draw(st.integers(1, capacity - 1))
        dst_pages, sources = list(order[:n_dst]), list(order[n_dst:])
        src_pages = data.draw(st.lists(st.sampled_from(sources), min_size=n_dst, max_size=n_dst))
        rng = np.random.default_rng(data.draw(_seeds))
        buf, model = _filled(backend, kind, offset + capacity * stride + 5, rng)
        try:
            pairs = _pairs(dst_pages, src_pages)
            region = PageRegion(buf, offset, stride)
            backend.copy_pages(region, region, page_bytes, pairs)
            _model_copy(model, offset, stride, model, offset, stride, page_bytes, pairs)
            assert np.array_equal(_read_all(backend, buf), model)
        finally:
            buf.free()

    @_SETTINGS
    @given(data=st.data())
    def test_copy_pages_checked_by_caller_copies_like_copy_pages_batch(
        self, backend: KernelBackend, data: st.DataObject
    ) -> None:
        """The core's entry for moves between stores (the same pages in every part, the
        arguments in range) copies the bytes copy_pages_batch copies."""
        kinds = _kinds(backend)
        dst_kind, src_kind = data.draw(st.sampled_from(kinds)), data.draw(st.sampled_from(kinds))
        sizes = data.draw(st.lists(st.integers(1, 40), min_size=1, max_size=3))
        row = sum(sizes) + data.draw(st.integers(0, 16))
        rows = data.draw(st.integers(1, 30))
        n = data.draw(st.integers(1, rows))
        dst_pages = list(data.draw(st.permutations(range(rows))))[:n]
        src_pages = data.draw(st.lists(st.integers(0, rows - 1), min_size=n, max_size=n))
        dtype = data.draw(st.sampled_from([np.int32, np.int64]))
        rng = np.random.default_rng(data.draw(_seeds))
        dst, dst_model = _filled(backend, dst_kind, rows * row, rng)
        src, src_model = _filled(backend, src_kind, rows * row, rng)
        try:
            parts = []
            column = 0
            for size in sizes:
                parts.append((PageRegion(dst, column, row), PageRegion(src, column, row), size))
                column += size
            backend.copy_pages_checked_by_caller(
                parts, np.asarray(dst_pages, dtype=dtype), np.asarray(src_pages, dtype=dtype))
            pairs = _pairs(dst_pages, src_pages)
            for dr, sr, size in parts:
                _model_copy(dst_model, dr.offset, row, src_model, sr.offset, row, size, pairs)
            assert np.array_equal(_read_all(backend, dst), dst_model)
            assert np.array_equal(_read_all(backend, src), src_model)
        finally:
            dst.free()
            src.free()

    def test_copy_pages_with_no_pairs_changes_nothing(self, backend: KernelBackend) -> None:
        rng = np.random.default_rng(3)
        dst, dst_model = _filled(backend, MemoryKind.DEVICE, 100, rng)
        src, src_model = _filled(backend, MemoryKind.DEVICE, 100, rng)
        try:
            empty = np.zeros((0, 2), dtype=np.int32)
            backend.copy_pages(PageRegion(dst, 0, 10), PageRegion(src, 0, 10), 10, empty)
            backend.copy_pages_batch([])
            backend.copy_pages_batch(
                [CopyTask(PageRegion(dst, 0, 10), PageRegion(src, 0, 10), 10, empty)]
            )
            assert np.array_equal(_read_all(backend, dst), dst_model)
            assert np.array_equal(_read_all(backend, src), src_model)
        finally:
            dst.free()
            src.free()

    @_SETTINGS
    @given(data=st.data())
    def test_copy_pages_batch_matches_byte_model_on_random_layouts(
        self, backend: KernelBackend, data: st.DataObject
    ) -> None:
        lay = data.draw(_batch_layouts(_kinds(backend)))
        rng = np.random.default_rng(lay.seed)
        dst, dst_model = _filled(
            backend, lay.dst_kind, lay.dst_offset + lay.dst_rows * lay.dst_row, rng
        )
        src, src_model = _filled(
            backend, lay.src_kind, lay.src_offset + lay.src_rows * lay.src_row, rng
        )
        try:
            tasks = []
            for task in lay.tasks:
                pairs = _pairs(task.dst_rows, task.src_rows)
                tasks.append(
                    CopyTask(
                        dst=PageRegion(dst, lay.dst_offset + task.column, lay.dst_row),
                        src=PageRegion(src, lay.src_offset + task.column, lay.src_row),
                        page_bytes=task.page_bytes,
                        pairs=pairs,
                    )
                )
            backend.copy_pages_batch(tasks)
            for task, ct in zip(lay.tasks, tasks, strict=True):
                _model_copy(
                    dst_model,
                    lay.dst_offset + task.column,
                    lay.dst_row,
                    src_model,
                    lay.src_offset + task.column,
                    lay.src_row,
                    task.page_bytes,
                    ct.pairs,
                )
            assert np.array_equal(_read_all(backend, dst), dst_model)
            assert np.array_equal(_read_all(backend, src), src_model)
        finally:
            dst.free()
            src.free()

    # Each bad call: (description, dst region args, src region args, page_bytes, pairs).
    _BAD_COPIES: list[tuple[str, tuple[int, int], tuple[int, int], int, Any]] = [
        ("int64 pairs", (0, 16), (0, 16), 16, np.array([[0, 1]], dtype=np.int64)),
        ("float pairs", (0, 16), (0, 16), 16, np.array([[0, 1]], dtype=np.float32)),
        ("pairs of three", (0, 16), (0, 16), 16, np.array([[0, 1, 2]], dtype=np.int32)),
        ("flat pairs", (0, 16), (0, 16), 16, np.array([0, 1], dtype=np.int32)),
        ("destination past the end", (0, 16), (0, 16), 16, np.array([[4, 0]], dtype=np.int32)),
        ("source past the end", (0, 16), (0, 16), 16, np.array([[0, 4]], dtype=np.int32)),
        ("negative destination", (0, 16), (0, 16), 16, np.array([[-1, 0]], dtype=np.int32)),
        ("negative source", (0, 16), (0, 16), 16, np.array([[0, -2]], dtype=np.int32)),
        ("offset pushes the page out", (1, 16), (0, 16), 16, np.array([[3, 0]], dtype=np.int32)),
        (
            "page larger than stride past end",
            (0, 16),
            (0, 16),
            17,
            np.array([[3, 0]], dtype=np.int32),
        ),
        ("zero page size", (0, 16), (0, 16), 0, np.array([[0, 1]], dtype=np.int32)),
        ("negative page size", (0, 16), (0, 16), -4, np.array([[0, 1]], dtype=np.int32)),
        ("negative offset", (-16, 16), (0, 16), 16, np.array([[1, 0]], dtype=np.int32)),
        ("negative stride", (48, -16), (0, 16), 16, np.array([[1, 0]], dtype=np.int32)),
    ]

    @pytest.mark.parametrize(
        ("dst_args", "src_args", "page_bytes", "pairs"),
        [case[1:] for case in _BAD_COPIES],
        ids=[case[0] for case in _BAD_COPIES],
    )
    def test_copy_pages_bad_arguments_raise_value_error_and_change_nothing(
        self,
        backend: KernelBackend,
        dst_args: tuple[int, int],
        src_args: tuple[int, int],
        page_bytes: int,
        pairs: np.ndarray,
    ) -> None:
        rng = np.random.default_rng(11)
        dst, dst_model = _filled(backend, MemoryKind.DEVICE, 64, rng)
        src, src_model = _filled(backend, MemoryKind.DEVICE, 64, rng)
        try:
            bad_dst, bad_src = PageRegion(dst, *dst_args), PageRegion(src, *src_args)
            with pytest.raises(ValueError):
                backend.copy_pages(bad_dst, bad_src, page_bytes, pairs)
            good = CopyTask(
                PageRegion(dst, 0, 16),
                PageRegion(src, 0, 16),
                16,
                np.array([[0, 1], [2, 3]], dtype=np.int32),
            )
            with pytest.raises(ValueError):
                backend.copy_pages_batch([good, CopyTask(bad_dst, bad_src, page_bytes, pairs)])
            assert np.array_equal(_read_all(backend, dst), dst_model)
            assert np.array_equal(_read_all(backend, src), src_model)
        finally:
            dst.free()
            src.free()

    # -- convert_page_indices ------------------------------------------------------------

    @_FAST_SETTINGS
    @given(data=st.data())
    def test_convert_page_indices_matches_formula_and_keeps_bad_page_index(
        self, backend: KernelBackend, data: st.DataObject
    ) -> None:
        shape = tuple(data.draw(st.lists(st.integers(0, 4), min_size=1, max_size=3)))
        slots = _draw_slot_table(data, shape)
        before = slots.copy()
        scale = data.draw(st.integers(1, 1000))
        offset = data.draw(st.integers(0, 100_000))
        expansion = data.draw(st.integers(1, 4))
        out = backend.convert_page_indices(slots, scale, offset, expansion)
        backend.synchronize()
        out = np.asarray(out)
        assert out.dtype == np.int32
        assert out.shape == (*shape[:-1], shape[-1] * expansion)
        for index in np.ndindex(*shape):
            head, i = index[:-1], index[-1]
            slot = int(slots[index])
            for e in range(expansion):
                want = BAD_PAGE_INDEX if slot == BAD_PAGE_INDEX else slot * scale + offset + e
                assert out[(*head, i * expansion + e)] == want
        assert np.array_equal(slots, before)

    @pytest.mark.parametrize("expansion", [1, 3])
    def test_convert_page_indices_never_folds_bad_page_index_to_zero(
        self, backend: KernelBackend, expansion: int
    ) -> None:
        # slot * scale + offset would be 0 for BAD_PAGE_INDEX with scale 1, offset 1.
        slots = np.array([[BAD_PAGE_INDEX, 0, BAD_PAGE_INDEX]], dtype=np.int32)
        out = np.asarray(backend.convert_page_indices(slots, 1, 1, expansion))
        bad = [BAD_PAGE_INDEX] * expansion
        assert out.tolist() == [bad + [1 + e for e in range(expansion)] + bad]

    @_FAST_SETTINGS
    @given(data=st.data())
    def test_convert_page_indices_with_scratch_matches_scalar_model(
        self, backend: KernelBackend, data: st.DataObject
    ) -> None:
        rows = data.draw(st.one_of(st.just(None), st.integers(0, 3)))
        width = data.draw(st.integers(0, 14))
        shape = (width,) if rows is None else (rows, width)
        slots = _draw_slot_table(data, shape)
        before = slots.copy()
        expansion = data.draw(st.integers(1, 2))
        unit_scale = data.draw(st.integers(1, 16))
        scale, offset = unit_scale * expansion, data.draw(st.integers(0, 300)) * expansion
        spb = data.draw(st.integers(1, unit_scale))
        begin = data.draw(st.integers(0, width + 3))  # inside the table or past it
        end = data.draw(st.integers(begin + 1, begin + width + 4))
        stop = min(end, width)
        needed = 0 if stop <= begin else (stop - 1 - begin) * spb // unit_scale + 1
        ids = data.draw(st.lists(st.integers(0, 50_000), min_size=needed,
                                 max_size=needed + 2))
        desc = ScratchDesc(begin, end, tuple(ids), spb)
        out = np.asarray(backend.convert_page_indices(slots, scale, offset, expansion,
                                                      scratch=desc))
        backend.synchronize()
        assert out.dtype == np.int32
        assert out.shape == (*shape[:-1], shape[-1] * expansion)
        for index in np.ndindex(*shape):
            head, b = index[:-1], index[-1]
            slot = int(slots[index])
            if begin <= b < end:
                total = (b - begin) * spb
                page = ids[total // unit_scale] * unit_scale + (
                    total % unit_scale + offset // expansion) % unit_scale
                want = [page * expansion + e for e in range(expansion)]
            elif slot == BAD_PAGE_INDEX:
                want = [BAD_PAGE_INDEX] * expansion
            else:
                want = [slot * scale + offset + e for e in range(expansion)]
            got = out[(*head, slice(b * expansion, (b + 1) * expansion))].tolist()
            assert got == want, (index, desc, scale, offset, expansion)
        assert np.array_equal(slots, before)

    @pytest.mark.parametrize("expansion", [1, 2])
    def test_convert_page_indices_scratch_none_or_outside_is_the_plain_conversion(
        self, backend: KernelBackend, expansion: int
    ) -> None:
        slots = np.array([[3, BAD_PAGE_INDEX, 0, 7], [BAD_PAGE_INDEX, 1, 2, 5]], dtype=np.int32)
        plain = np.asarray(backend.convert_page_indices(slots, 6, 2, expansion))
        for scratch in (None, ScratchDesc(4, 9, (), 2), ScratchDesc(7, 8, (1,), 1)):
            got = np.asarray(backend.convert_page_indices(slots, 6, 2, expansion,
                                                          scratch=scratch))
            assert np.array_equal(got, plain), scratch

    def test_convert_page_indices_scratch_maps_bad_blocks_of_every_row(
        self, backend: KernelBackend
    ) -> None:
        # scale 8, spb 2: blocks 1, 2, 3 at positions 0, 1, 2 -> slot 9 sub-pages 3, 5,
        # 7 (offset 3), and block 4 (position 3, total 6) -> sub-page (6 + 3) % 8 = 1.
        slots = np.array(
            [[5, BAD_PAGE_INDEX, BAD_PAGE_INDEX, 4, BAD_PAGE_INDEX, BAD_PAGE_INDEX, 2]] * 2,
            dtype=np.int32,
        )
        out = np.asarray(backend.convert_page_indices(
            slots, 8, 3, 1, scratch=ScratchDesc(1, 5, (9, 11), 2)))
        row = [5 * 8 + 3, 9 * 8 + 3, 9 * 8 + 5, 9 * 8 + 7, 9 * 8 + 1, BAD_PAGE_INDEX, 2 * 8 + 3]
        assert out.tolist() == [row, row]
        # expansion 2: whole pages (4 a slot, the buffer at page 1), two units each.
        out = np.asarray(backend.convert_page_indices(
            slots[0], 8, 2, 2, scratch=ScratchDesc(2, 3, (6,), 2)))
        assert out[4:6].tolist() == [(6 * 4 + 1) * 2, (6 * 4 + 1) * 2 + 1]
        assert out[2:4].tolist() == [BAD_PAGE_INDEX, BAD_PAGE_INDEX]
        assert out[6:8].tolist() == [4 * 8 + 2, 4 * 8 + 3]

    @pytest.mark.parametrize(
        ("scale", "offset", "expansion", "scratch", "error"),
        [
            (4, 0, 1, ScratchDesc(-1, 2, (0, 1), 1), ValueError),  # begin < 0
            (4, 0, 1, ScratchDesc(0, 2, (0,), 0), ValueError),  # spb < 1
            (4, 0, 1, ScratchDesc(0, 6, (0,), 2), ValueError),  # too few slot ids
            (4, 0, 1, ScratchDesc(0, 2, (-3,), 1), ValueError),  # negative slot id
            (6, 0, 4, ScratchDesc(0, 2, (0,), 1), ValueError),  # scale % expansion
            (6, 1, 2, ScratchDesc(0, 2, (0,), 1), ValueError),  # offset % expansion
            (0, 0, 1, ScratchDesc(0, 2, (0,), 1), ValueError),  # scale < 1
            (4, 0, 1, ScratchDesc(0, 2, (1 << 30,), 1), OverflowError),  # index > int32
        ],
    )
    def test_convert_page_indices_refuses_bad_scratch_arguments(
        self, backend: KernelBackend, scale: int, offset: int, expansion: int,
        scratch: Any, error: type[Exception]
    ) -> None:
        slots = np.array([BAD_PAGE_INDEX, BAD_PAGE_INDEX, 1], dtype=np.int32)
        with pytest.raises(error):
            backend.convert_page_indices(slots, scale, offset, expansion, scratch=scratch)
        with pytest.raises(TypeError):
            backend.convert_page_indices(
                slots, 4, 0, 1, scratch=(0, 2, (0, 1), 1)  # type: ignore[arg-type]
            )

    # -- convert_page_tables (a Batch's index tables, device to device) -----------------

    @_FAST_SETTINGS
    @given(data=st.data())
    def test_convert_page_tables_converts_the_chosen_rows_of_every_table_like_the_reference(
        self, backend: KernelBackend, data: st.DataObject
    ) -> None:
        rows = data.draw(st.integers(1, 6))
        beams = data.draw(st.integers(1, 2))
        blocks = data.draw(st.integers(1, 9))
        chosen = sorted(data.draw(st.sets(st.integers(0, rows - 1), min_size=1)))
        jobs, expected, buffers = [], [], []
        for _ in range(data.draw(st.integers(1, 3))):
            expansion = data.draw(st.integers(1, 3))
            unit_scale = data.draw(st.integers(1, 16))
            scale = unit_scale * expansion
            offset = data.draw(st.integers(0, 300)) * expansion
            base = _draw_slot_table(data, (rows, beams, blocks))
            scratch = {}
            for r in range(rows):
                if data.draw(st.booleans()):
                    spb = data.draw(st.integers(1, unit_scale))
                    begin = data.draw(st.integers(0, blocks - 1))
                    end = data.draw(st.integers(begin + 1, blocks + 2))
                    stop = min(end, blocks)
                    needed = (stop - 1 - begin) * spb // unit_scale + 1
                    ids = tuple(data.draw(st.lists(st.integers(0, 50_000), min_size=needed,
                                                   max_size=needed + 1)))
                    scratch[r] = ScratchDesc(begin, end, ids, spb)
            src = backend.alloc_device(base.nbytes)
            backend.write(src, 0, base.reshape(-1).view(np.uint8))
            sentinel = np.full((rows, beams, blocks * expansion), 77, dtype=np.int32)
            dst = backend.alloc_device(sentinel.nbytes)
            backend.write(dst, 0, sentinel.reshape(-1).view(np.uint8))
            buffers += [src, dst]
            jobs.append(TableConversion(src, dst, beams * blocks, blocks, scale, offset,
                                        expansion, scratch or None))
            want = sentinel.copy()
            for r in chosen:
                want[r] = convert_page_indices_reference(base[r], scale, offset, expansion,
                                                         scratch.get(r))
            expected.append(want)
        try:
            backend.convert_page_tables(jobs, np.asarray(chosen, dtype=np.int32))
            backend.synchronize()
            for job, want in zip(jobs, expected, strict=True):
                got = backend.read(job.dst, 0, want.nbytes).view(np.int32).reshape(want.shape)
                assert np.array_equal(got, want), (chosen, job.scratch)
        finally:
            for buf in buffers:
                buf.free()

    def test_convert_page_tables_keeps_bad_page_index_and_leaves_other_rows_alone(
        self, backend: KernelBackend
    ) -> None:
        base = np.array([[[BAD_PAGE_INDEX, 0, 5]], [[1, BAD_PAGE_INDEX, 2]]], dtype=np.int32)
        src = backend.alloc_device(base.nbytes)
        dst = backend.alloc_device(base.nbytes * 2)
        try:
            backend.write(src, 0, base.reshape(-1).view(np.uint8))
            backend.write(dst, 0, np.full(12, 9, dtype=np.int32).view(np.uint8))
            job = TableConversion(src, dst, 3, 3, 1, 1, 2)  # slot 0 -> 1, 2 (never 0)
            backend.convert_page_tables([job], np.array([0], dtype=np.int32))
            backend.synchronize()
            got = backend.read(dst, 0, 48).view(np.int32).reshape(2, 6)
            assert got[0].tolist() == [BAD_PAGE_INDEX, BAD_PAGE_INDEX, 1, 2, 6, 7]
            assert got[1].tolist() == [9] * 6, "a row not chosen is left as it was"
        finally:
            src.free()
            dst.free()

    # -- fingerprint engine --------------------------------------------------------------

    @_SETTINGS
    @given(data=st.data())
    def test_fingerprint_write_matches_record_model_only_inside_begin_end(
        self, backend: KernelBackend, data: st.DataObject
    ) -> None:
        pages = data.draw(_fp_batches(_kinds(backend)))
        setup = _place_fingerprints(backend, pages, np.random.default_rng(data.draw(_seeds)))
        try:
            backend.fingerprint_write(setup.batch)
            for page, start in zip(pages, setup.starts, strict=True):
                model = setup.models[page.kind]
                _model_fingerprint(page, model[start : start + page.page_bytes])
            for kind, buf in setup.buffers.items():
                assert np.array_equal(_read_all(backend, buf), setup.models[kind])
            ok = np.asarray(backend.fingerprint_check(setup.batch))
            assert ok.dtype == np.bool_ and ok.shape == (len(pages),)
            assert ok.all()
        finally:
            setup.free()

    @_SETTINGS
    @given(data=st.data())
    def test_fingerprint_check_fails_on_a_flipped_checked_byte_only(
        self, backend: KernelBackend, data: st.DataObject
    ) -> None:
        pages = data.draw(
            _fp_batches(_kinds(backend)).filter(lambda ps: any(_checked_bytes(p) for p in ps))
        )
        setup = _place_fingerprints(backend, pages, np.random.default_rng(data.draw(_seeds)))
        try:
            backend.fingerprint_write(setup.batch)
            i = data.draw(st.sampled_from([k for k, p in enumerate(pages) if _checked_bytes(p)]))
            page, buf = pages[i], setup.buffers[pages[i].kind]
            inside = setup.starts[i] + data.draw(st.sampled_from(_checked_bytes(page)))
            _flip(backend, buf, inside)
            expected = np.ones(len(pages), dtype=bool)
            expected[i] = False
            assert np.array_equal(np.asarray(backend.fingerprint_check(setup.batch)), expected)
            _flip(backend, buf, inside)  # restore

            checked = set(_checked_bytes(page))
            unchecked = [b for b in range(page.page_bytes) if b not in checked]
            if unchecked:
                outside = setup.starts[i] + data.draw(st.sampled_from(unchecked))
                _flip(backend, buf, outside)
                assert np.asarray(backend.fingerprint_check(setup.batch)).all()
        finally:
            setup.free()
