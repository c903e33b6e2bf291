"""The ``cupy`` and ``cuda`` kernel backends.

The first part runs everywhere (CI has no GPU): registration, honest availability, lazy
imports, option checks and the pieces of the host side that need no device. The ``gpu``
part runs on a CUDA machine (``pytest -m gpu``) and is skipped cleanly elsewhere: every
kernel bit for bit equal to the numpy reference on random inputs, both copy paths, stream
and event ordering, and zero-copy export.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import attrs
import numpy as np
import pytest

from kvcm_core.backend import (
    BAD_PAGE_INDEX,
    CopyTask,
    FingerprintPages,
    KernelBackend,
    MemoryKind,
    PageRegion,
)
from kvcm_core.errors import PluginError
from kvcm_core.layout import PageIndexConverter
from kvcm_core.plugins import BACKEND_ENV, get_plugin_manager
from kvcm_core.scratch import ScratchDesc

GPU_BACKENDS = ("cupy", "cuda")


# -- everywhere --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", GPU_BACKENDS)
def test_gpu_backend_is_registered_with_device_capabilities(name: str) -> None:
    spec = get_plugin_manager().kernel_backend(name)
    caps = spec.capabilities
    assert caps.has_device and caps.host_mapped and caps.copy_engine and caps.compiles_sources


def test_gpu_backends_rank_above_numpy_with_distinct_priorities() -> None:
    backends = get_plugin_manager().kernel_backends()
    priorities = [backends[n].priority for n in (*GPU_BACKENDS, "numpy")]
    assert len(set(priorities)) == len(priorities)
    assert min(backends[n].priority for n in GPU_BACKENDS) > backends["numpy"].priority


@pytest.mark.parametrize("name", GPU_BACKENDS)
def test_availability_is_cached_and_gives_a_reason_when_false(name: str) -> None:
    spec = get_plugin_manager().kernel_backend(name)
    first = spec.availability()
    assert spec.availability() is first
    if not first:
        assert first.reason.strip()


@pytest.mark.parametrize("name", GPU_BACKENDS)
def test_unavailable_backend_factory_raises_with_the_reason(name: str) -> None:
    spec = get_plugin_manager().kernel_backend(name)
    avail = spec.availability()
    if avail:
        pytest.skip(f"{name} is available here")
    with pytest.raises(RuntimeError, match="unavailable"):
        spec.factory({})
    with pytest.raises(PluginError, match=name):
        get_plugin_manager().select_kernel_backend(name)


def test_importing_gpu_plugins_imports_neither_cupy_nor_cuda_python() -> None:
    code = (
        "import sys, kvcm_kernels_cupy, kvcm_kernels_cuda, kvcm_kernels_cuda_common;"
        "print(sorted(m for m in ('cupy', 'cuda.bindings', 'cuda') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "[]"


def test_auto_selects_the_available_backend_of_highest_priority(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    pm = get_plugin_manager()
    available = [s for s in pm.kernel_backends().values() if s.availability()]
    expected = max(available, key=lambda s: s.priority).name
    assert pm.select_kernel_backend("auto").name == expected
    if not any(pm.kernel_backend(n).availability() for n in GPU_BACKENDS):
        assert expected == "numpy"


@pytest.mark.parametrize(
    ("options", "word"),
    [
        ({"copy_pathh": "sm"}, "copy_pathh"),
        ({"copy_path": "dma"}, "copy_path"),
        ({"block_threads": 100}, "block_threads"),
        ({"device": -1}, "device"),
    ],
)
def test_backend_options_reject_unknown_keys_and_bad_values(
    options: dict[str, Any], word: str
) -> None:
    from kvcm_kernels_cuda_common import parse_options

    with pytest.raises(ValueError, match=word):
        parse_options(options)


def test_copy_engine_descriptors_merge_runs_of_adjacent_pages_in_order() -> None:
    from kvcm_kernels_cuda_common.base import _copy_descriptors

    numpy_backend = get_plugin_manager().kernel_backend("numpy").factory({})
    src, dst = numpy_backend.alloc_device(64 * 16), numpy_backend.alloc_device(64 * 16)
    try:
        pairs = np.array([[0, 5], [1, 6], [2, 7], [9, 1], [3, 8]], dtype=np.int32)
        dense = CopyTask(PageRegion(dst, 0, 64), PageRegion(src, 0, 64), 64, pairs)
        dsts, srcs, sizes = _copy_descriptors([dense])
        assert sizes.tolist() == [3 * 64, 64, 64]
        assert dsts.tolist() == [dst.ptr, dst.ptr + 9 * 64, dst.ptr + 3 * 64]
        assert srcs.tolist() == [src.ptr + 5 * 64, src.ptr + 64, src.ptr + 8 * 64]

        run = CopyTask(PageRegion(dst, 0, 64), PageRegion(src, 0, 64), 64, pairs[:3])
        dsts, srcs, sizes = _copy_descriptors([run, dense])  # one run, then the mixed task
        assert sizes.tolist() == [3 * 64, 3 * 64, 64, 64]
        assert dsts.tolist()[:2] == [dst.ptr, dst.ptr]
        assert srcs.tolist()[:2] == [src.ptr + 5 * 64, src.ptr + 5 * 64]

        gapped = CopyTask(PageRegion(dst, 0, 80), PageRegion(src, 0, 64), 64, pairs[:3])
        _, _, sizes = _copy_descriptors([gapped])
        assert sizes.tolist() == [64, 64, 64]  # a gap between pages: one copy each
    finally:
        src.free()
        dst.free()


def test_kernel_arguments_pass_one_element_arrays_by_value_and_refuse_longer_ones() -> None:
    """A struct passed by value (the quant codec's slot-table parameter) is a NumPy array of
    one ``void`` element; an array of several elements is a mistake (a host array meant as
    device memory) and is refused naming its shape."""
    from kvcm_kernels_cuda_common.base import _scalar

    words = np.arange(16, dtype=np.uint32)
    struct = words.view(np.dtype((np.void, words.nbytes)))
    assert _scalar(struct) is struct
    assert _scalar(3) == np.int64(3) and _scalar(np.uint64(7)) == np.uint64(7)
    with pytest.raises(TypeError, match=r"one element; got shape \(16,\)"):
        _scalar(words)


def test_dlpack_export_shares_memory_and_releases_unconsumed_capsules() -> None:
    from kvcm_kernels_cuda_common import dlpack

    owner = np.arange(32, dtype=np.uint8)
    view = dlpack.MemoryView(owner.ctypes.data, 32, dlpack.DLDEVICE_CPU, owner=owner)
    before = len(dlpack._exports)
    shared = np.from_dlpack(view)
    assert shared.ctypes.data == owner.ctypes.data and shared.shape == (32,)
    owner[3] = 200
    assert shared[3] == 200
    del shared
    capsule = view.__dlpack__()
    del capsule
    assert len(dlpack._exports) == before
    with pytest.raises(BufferError):
        view.__dlpack__(copy=True)


def test_a_typed_memory_view_exports_its_shape_and_element_type_without_copying() -> None:
    from kvcm_kernels_cuda_common import dlpack

    owner = np.arange(24, dtype=np.int32)
    flat = dlpack.MemoryView(owner.ctypes.data, owner.nbytes, dlpack.DLDEVICE_CPU, owner=owner)
    table = flat.typed((2, 3, 4), "<i4")
    shared = np.from_dlpack(table)
    assert shared.shape == (2, 3, 4) and shared.dtype == np.int32
    assert shared.ctypes.data == owner.ctypes.data
    assert shared[1, 2, 3] == 23
    assert table.__array_interface__["shape"] == (2, 3, 4)
    assert table.__array_interface__["typestr"] == "<i4"
    with pytest.raises(ValueError, match="needs 100 bytes"):
        flat.typed((25,), "<i4")
    with pytest.raises(ValueError, match="typestr"):
        flat.typed((2,), "<f4")


# -- on a GPU ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reference() -> Iterator[KernelBackend]:
    backend = get_plugin_manager().kernel_backend("numpy").factory({})
    yield backend
    backend.close()


def _make(name: str, options: dict[str, Any] | None = None) -> KernelBackend:
    spec = get_plugin_manager().kernel_backend(name)
    avail = spec.availability()
    if not avail:
        pytest.skip(f"{name} unavailable: {avail.reason}")
    return spec.factory(options or {})


@pytest.fixture(scope="module", params=GPU_BACKENDS)
def gpu(request: pytest.FixtureRequest) -> Iterator[KernelBackend]:
    backend = _make(request.param)
    yield backend
    backend.close()


def _twin(gpu: KernelBackend, ref: KernelBackend, kind: str, data: np.ndarray) -> tuple[Any, Any]:
    """The same bytes in a GPU buffer and a numpy buffer."""
    g = gpu.alloc_device(data.size) if kind == MemoryKind.DEVICE else gpu.alloc_host(data.size)
    r = ref.alloc_device(data.size)
    gpu.write(g, 0, data)
    ref.write(r, 0, data)
    return g, r


def _random_copy_case(rng: np.random.Generator) -> dict[str, Any]:
    page = int(rng.choice([1, 3, 16, 100, 4096, 4100, 65536, 70001, 1 << 20]))
    src_stride = page + int(rng.choice([0, 0, 1, 16, 333]))
    dst_stride = page + int(rng.choice([0, 0, 5, 16, 64]))
    cap = int(max(2, min(64, (24 << 20) // max(src_stride, dst_stride))))
    n = int(rng.integers(1, cap + 1))
    return {
        "page": page,
        "src": (int(rng.integers(0, 40)), src_stride),
        "dst": (int(rng.integers(0, 40)), dst_stride),
        "cap": cap,
        "pairs": np.stack([rng.permutation(cap)[:n], rng.integers(0, cap, n)], axis=1).astype(
            np.int32
        ),
        "kinds": (
            str(rng.choice([MemoryKind.DEVICE, MemoryKind.HOST])),
            str(rng.choice([MemoryKind.DEVICE, MemoryKind.HOST])),
        ),
    }


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["sm", "ce"])
@pytest.mark.parametrize("name", GPU_BACKENDS)
def test_copy_pages_equals_numpy_bit_for_bit_on_each_forced_path(
    name: str, path: str, reference: KernelBackend
) -> None:
    backend = _make(name, {"copy_path": path})
    rng = np.random.default_rng(1234)
    try:
        for _ in range(12):
            case = _random_copy_case(rng)
            page, cap = case["page"], case["cap"]
            (s_off, s_stride), (d_off, d_stride) = case["src"], case["dst"]
            src_kind, dst_kind = case["kinds"]
            assert backend.choose_copy_path(dst_kind, src_kind, page) == path
            src_bytes = rng.integers(0, 256, s_off + cap * s_stride + 7, dtype=np.uint8)
            dst_bytes = rng.integers(0, 256, d_off + cap * d_stride + 7, dtype=np.uint8)
            g_src, r_src = _twin(backend, reference, src_kind, src_bytes)
            g_dst, r_dst = _twin(backend, reference, dst_kind, dst_bytes)
            try:
                for b, s, d in ((backend, g_src, g_dst), (reference, r_src, r_dst)):
                    b.copy_pages(
                        PageRegion(d, d_off, d_stride),
                        PageRegion(s, s_off, s_stride),
                        page,
                        case["pairs"],
                    )
                got = backend.read(g_dst, 0, g_dst.nbytes)
                want = reference.read(r_dst, 0, r_dst.nbytes)
                assert np.array_equal(got, want), f"case {case['page']=} {case['kinds']=}"
            finally:
                for buf in (g_src, g_dst, r_src, r_dst):
                    buf.free()
    finally:
        backend.close()


@pytest.mark.gpu
def test_copy_pages_batch_is_one_unit_equal_to_numpy(
    gpu: KernelBackend, reference: KernelBackend
) -> None:
    rng = np.random.default_rng(5)
    row, rows = 3 * 4096 + 77, 40
    src_bytes = rng.integers(0, 256, row * rows, dtype=np.uint8)
    dst_bytes = rng.integers(0, 256, row * rows, dtype=np.uint8)
    g_src, r_src = _twin(gpu, reference, MemoryKind.HOST, src_bytes)
    g_dst, r_dst = _twin(gpu, reference, MemoryKind.DEVICE, dst_bytes)
    try:
        columns = [(0, 4096), (4096, 4000), (8192 + 13, 4096)]
        for b, s, d in ((gpu, g_src, g_dst), (reference, r_src, r_dst)):
            tasks = []
            for k, (col, width) in enumerate(columns):
                r = np.random.default_rng(k)
                pairs = np.stack([r.permutation(rows)[:25], r.integers(0, rows, 25)], axis=1)
                tasks.append(
                    CopyTask(
                        PageRegion(d, col, row),
                        PageRegion(s, col, row),
                        width,
                        pairs.astype(np.int32),
                    )
                )
            b.copy_pages_batch(tasks)
        assert np.array_equal(
            gpu.read(g_dst, 0, g_dst.nbytes), reference.read(r_dst, 0, r_dst.nbytes)
        )
    finally:
        for buf in (g_src, g_dst, r_src, r_dst):
            buf.free()


@pytest.mark.gpu
def test_convert_page_indices_equals_numpy_including_overflow(
    gpu: KernelBackend, reference: KernelBackend
) -> None:
    rng = np.random.default_rng(9)
    for shape, scale, offset, expansion in [
        ((7,), 1, 0, 1),
        ((3, 129), 4, 17, 3),
        ((256, 2048), 2, 5, 1),
        ((2, 3, 5), 1000, 1 << 20, 2),
    ]:
        slots = rng.integers(0, 1 << 16, shape, dtype=np.int32)
        slots[rng.random(shape) < 0.2] = BAD_PAGE_INDEX
        got = gpu.convert_page_indices(slots, scale, offset, expansion)
        want = reference.convert_page_indices(slots, scale, offset, expansion)
        assert got.dtype == np.int32 and got.shape == want.shape
        assert np.array_equal(got, want)
    big = np.array([[0, 1 << 30]], dtype=np.int32)
    with pytest.raises(OverflowError):
        reference.convert_page_indices(big, 4, 0)
    with pytest.raises(OverflowError):
        gpu.convert_page_indices(big, 4, 0)


def _scratch_case(
    rng: np.random.Generator, shape: tuple[int, ...], unit_scale: int, expansion: int
) -> tuple[np.ndarray, int, int, ScratchDesc]:
    """Slot ids with BAD entries and a scratch range over (and past) the table."""
    width = shape[-1]
    slots = rng.integers(0, 1 << 16, shape, dtype=np.int32)
    slots[rng.random(shape) < 0.2] = BAD_PAGE_INDEX
    spb = int(rng.integers(1, unit_scale + 1))
    begin = int(rng.integers(0, width + 2))
    end = begin + int(rng.integers(1, width + 3))
    ids = rng.integers(0, 1 << 16, max(1, end * spb // unit_scale + 2))
    offset = int(rng.integers(0, 3 * unit_scale)) * expansion
    return slots, unit_scale * expansion, offset, ScratchDesc(begin, end, tuple(ids), spb)


@pytest.mark.gpu
def test_convert_page_indices_with_scratch_equals_numpy_bit_for_bit(
    gpu: KernelBackend, reference: KernelBackend
) -> None:
    rng = np.random.default_rng(11)
    cases = [
        ((7,), 1, 1),
        ((13,), 8, 2),
        ((3, 129), 6, 1),
        ((3, 129), 4, 3),
        ((256, 2048), 8, 1),  # more elements than one grid: grid-stride loop
        ((2, 3, 50), 5, 2),
    ]
    for _ in range(20):
        width = int(rng.integers(1, 40))
        shape = (width,) if rng.random() < 0.5 else (int(rng.integers(1, 5)), width)
        cases.append((shape, int(rng.integers(1, 17)), int(rng.integers(1, 3))))
    for shape, unit_scale, expansion in cases:
        slots, scale, offset, desc = _scratch_case(rng, shape, unit_scale, expansion)
        got = gpu.convert_page_indices(slots, scale, offset, expansion, scratch=desc)
        want = reference.convert_page_indices(slots, scale, offset, expansion, scratch=desc)
        assert got.dtype == np.int32 and got.shape == want.shape
        assert np.array_equal(got, want), (shape, scale, offset, expansion, desc)
        plain = gpu.convert_page_indices(slots, scale, offset, expansion, scratch=None)
        assert np.array_equal(
            plain, reference.convert_page_indices(slots, scale, offset, expansion)
        )
    # The converter runs the backend's kernel; the staging ring is reused across calls.
    conv = PageIndexConverter(8, 3, 1, scratch_pages_per_block=2)
    table = np.array([5, BAD_PAGE_INDEX, BAD_PAGE_INDEX, 4, BAD_PAGE_INDEX], dtype=np.int32)
    desc = ScratchDesc(1, 4, (9, 11), 2)
    for _ in range(3 * 8):
        assert np.array_equal(conv.convert(table, desc, backend=gpu), conv.convert(table, desc))
    big = ScratchDesc(0, 2, (1 << 29,), 1)
    with pytest.raises(OverflowError):
        reference.convert_page_indices(table, 8, 0, scratch=big)
    with pytest.raises(OverflowError):
        gpu.convert_page_indices(table, 8, 0, scratch=big)
    with pytest.raises(ValueError):
        gpu.convert_page_indices(table, 8, 0, scratch=ScratchDesc(0, 5, (1,), 4))


def _fingerprint_batch(
    rng: np.random.Generator, bases: list[int], sizes: list[int], width: int
) -> FingerprintPages:
    n = len(bases)
    slots = rng.integers(1, width + 1, n).astype(np.int32)
    a, b = rng.integers(0, slots + 1), rng.integers(0, slots + 1)
    return FingerprintPages(
        addresses=np.array(bases, dtype=np.int64),
        page_bytes=np.array(sizes, dtype=np.int64),
        record_slots=slots,
        token_ids=rng.integers(0, 1 << 32, (n, width), dtype=np.uint32),
        begin=np.minimum(a, b).astype(np.int32),
        end=np.maximum(a, b).astype(np.int32),
        positions=rng.integers(0, 1 << 40, n, dtype=np.int64),
        tags=rng.integers(0, 1 << 32, (n, 2), dtype=np.uint32),
    )


@pytest.mark.gpu
def test_fingerprint_write_and_check_equal_numpy(
    gpu: KernelBackend, reference: KernelBackend
) -> None:
    rng = np.random.default_rng(21)
    sizes = [int(x) for x in rng.choice([1, 15, 16, 33, 4096, 5000, 65536, 131072 + 3], 40)]
    offsets = np.cumsum([0] + [s + int(rng.integers(0, 40)) for s in sizes])
    total = int(offsets[-1]) + 64
    data = rng.integers(0, 256, total, dtype=np.uint8)
    for kind in (MemoryKind.DEVICE, MemoryKind.HOST):
        g, r = _twin(gpu, reference, kind, data)
        try:
            seed = int(rng.integers(0, 1 << 30))
            batches = []
            for buf in (g, r):
                bases = [buf.ptr + int(o) for o in offsets[:-1]]
                batches.append(_fingerprint_batch(np.random.default_rng(seed), bases, sizes, 64))
            gpu.fingerprint_write(batches[0])
            reference.fingerprint_write(batches[1])
            assert np.array_equal(gpu.read(g, 0, total), reference.read(r, 0, total))
            assert gpu.fingerprint_check(batches[0]).all()
            # Corrupt one byte inside a written slot of some page: only that page fails.
            fp = batches[1]
            lo = fp.begin.astype(np.int64) * fp.page_bytes // fp.record_slots
            hi = fp.end.astype(np.int64) * fp.page_bytes // fp.record_slots
            victim = int(np.flatnonzero(hi > lo)[0])
            at = int(offsets[victim] + lo[victim])
            gpu.write(g, at, gpu.read(g, at, 1) ^ np.uint8(1))
            reference.write(r, at, reference.read(r, at, 1) ^ np.uint8(1))
            got, want = gpu.fingerprint_check(batches[0]), reference.fingerprint_check(fp)
            assert np.array_equal(got, want) and not got[victim]
        finally:
            g.free()
            r.free()


@pytest.mark.gpu
def test_fingerprint_refuses_addresses_outside_backend_memory(gpu: KernelBackend) -> None:
    rng = np.random.default_rng(2)
    buf = gpu.alloc_device(4096)
    try:
        batch = _fingerprint_batch(rng, [buf.ptr + 4000], [4096], 8)
        with pytest.raises(ValueError, match="not inside"):
            gpu.fingerprint_write(batch)
    finally:
        buf.free()


@pytest.mark.gpu
def test_work_on_one_stream_runs_in_order(gpu: KernelBackend) -> None:
    """A page written by the fingerprint kernel and then copied on the same stream: the
    copy reads the new data."""
    page, pages = 1 << 20, 64
    a, b = gpu.alloc_device(page * pages), gpu.alloc_device(page * pages)
    try:
        gpu.write(a, 0, np.zeros(page * pages, dtype=np.uint8))
        stream = gpu.create_stream()
        rng = np.random.default_rng(3)
        batch = _fingerprint_batch(
            rng, [a.ptr + i * page for i in range(pages)], [page] * pages, 32
        )
        batch = attrs.evolve(
            batch, begin=np.zeros(pages, dtype=np.int32), end=batch.record_slots.copy()
        )
        gpu.fingerprint_write(batch, stream)
        pairs = np.stack([np.arange(pages), np.arange(pages)], axis=1).astype(np.int32)
        gpu.copy_pages(PageRegion(b, 0, page), PageRegion(a, 0, page), page, pairs, stream)
        stream.synchronize()
        assert np.array_equal(gpu.read(b, 0, b.nbytes), gpu.read(a, 0, a.nbytes))
        assert gpu.read(a, 0, a.nbytes).any()
    finally:
        a.free()
        b.free()


@pytest.mark.gpu
def test_event_makes_another_stream_wait(gpu: KernelBackend) -> None:
    nbytes = 256 << 20
    rng = np.random.default_rng(4)
    src_host = gpu.alloc_host(nbytes)
    mid, dst = gpu.alloc_device(nbytes), gpu.alloc_device(nbytes)
    try:
        data = rng.integers(0, 256, nbytes, dtype=np.uint8)
        gpu.write(src_host, 0, data)
        gpu.write(dst, 0, np.zeros(16, dtype=np.uint8))
        first, second = gpu.create_stream(), gpu.create_stream()
        whole = np.array([[0, 0]], dtype=np.int32)
        gpu.copy_pages(PageRegion(mid, 0, 0), PageRegion(src_host, 0, 0), nbytes, whole, first)
        done = gpu.create_event()
        done.record(first)
        second.wait_event(done)
        gpu.copy_pages(PageRegion(dst, 0, 0), PageRegion(mid, 0, 0), nbytes, whole, second)
        finished = gpu.create_event()
        finished.record(second)
        finished.synchronize()
        assert done.query() and finished.query()
        assert finished.elapsed_ms(done) >= 0.0
        assert np.array_equal(gpu.read(dst, 0, nbytes), data)
    finally:
        for buf in (src_host, mid, dst):
            buf.free()


@pytest.mark.gpu
@pytest.mark.parametrize("kind", [MemoryKind.DEVICE, MemoryKind.HOST])
def test_as_array_is_a_zero_copy_view_at_the_buffer_address(gpu: KernelBackend, kind: str) -> None:
    buf = gpu.alloc_device(4096) if kind == MemoryKind.DEVICE else gpu.alloc_host(4096)
    try:
        gpu.write(buf, 0, np.arange(4096, dtype=np.uint32).astype(np.uint8))
        view = gpu.as_array(buf)
        cai = view.__cuda_array_interface__
        assert cai["data"][0] == buf.ptr and tuple(cai["shape"]) == (4096,)
        if kind == MemoryKind.DEVICE:
            cupy = pytest.importorskip("cupy")
            arr = cupy.from_dlpack(view)
            assert arr.data.ptr == buf.ptr
            arr[5] = 77  # written through the view, seen by the backend
            cupy.cuda.runtime.deviceSynchronize()
            assert gpu.read(buf, 5, 1)[0] == 77
    finally:
        buf.free()


@pytest.mark.gpu
def test_copy_bytes_and_compiled_source_run_on_the_device(gpu: KernelBackend) -> None:
    a, b = gpu.alloc_device(1000), gpu.alloc_device(1000)
    try:
        data = np.arange(1000, dtype=np.uint16).astype(np.uint8)
        gpu.write(a, 0, data)
        gpu.copy_bytes(b, 0, a, 0, 1000)
        assert np.array_equal(gpu.read(b, 0, 1000), data)
        module = gpu.compile(  # type: ignore[attr-defined]
            'extern "C" __global__ void inc(unsigned char* p, long long n) {'
            " long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;"
            " if (i < n) p[i] += 1; }"
        )
        module.launch("inc", (4, 1, 1), (256, 1, 1), [b, 1000])
        assert np.array_equal(gpu.read(b, 0, 1000), (data + 1).astype(np.uint8))
    finally:
        a.free()
        b.free()
