"""Batch on each GPU backend: a captured CUDA graph reads the rows ``publish`` uploads, a
reader fence keeps pages from being released, tables reach torch through DLPack, and the
index tables are converted on the device like the reference. Skipped without a GPU."""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest

from kvcm_core import (
    AttentionLayerConfig,
    Batch,
    BufferConfig,
    InvalidStateError,
    KVCacheManager,
    KVCacheManagerConfig,
    LevelConfig,
    get_plugin_manager,
)

TPB = 16
PAGE = 256


def _gpu_backends() -> list[str]:
    pm = get_plugin_manager()
    return [n for n, s in pm.kernel_backends().items() if s.capabilities.has_device]


def _manager(backend: str, slots: int = 256) -> KVCacheManager:
    cfg = KVCacheManagerConfig(
        tokens_per_block=TPB,
        layers=[AttentionLayerConfig(layer_id=0, buffers=[BufferConfig(role="k", size=PAGE),
                                                          BufferConfig(role="v", size=PAGE)])],
        levels=[LevelConfig(tier="gpu", quota=slots * 2 * PAGE)], kernel_backend=backend)
    return KVCacheManager(cfg)


def _active(m: KVCacheManager, n: int, seed: int) -> Any:
    toks = np.random.default_rng(seed).integers(1, 30000, n).tolist()
    c = m.create_kv_cache(None, toks)
    assert c.resume() and c.resize(n)
    return c


def _cupy_view(cp: Any, view: Any, owner: Any) -> Any:
    iface = view.__cuda_array_interface__
    mem = cp.cuda.UnownedMemory(iface["data"][0], int(np.prod(iface["shape"])) * 4, owner)
    return cp.ndarray(iface["shape"], dtype=cp.int32, memptr=cp.cuda.MemoryPointer(mem, 0))


_COPY = r'''extern "C" __global__ void copy_table(const int* a, int* b, int n) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
        b[i] = a[i];
}'''

_GATED = r'''extern "C" __global__ void gated_read(volatile int* flag, const int* a, int* b) {
    while (*flag == 0) { }
    b[0] = a[0];
}'''


def _begin_capture(backend: str, stream: Any) -> None:
    if backend == "cupy":
        stream.native.begin_capture()
    else:
        from cuda.bindings import driver
        mode = driver.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED
        assert int(driver.cuStreamBeginCapture(stream.native, mode)[0]) == 0


def _end_capture(backend: str, stream: Any) -> None:
    if backend == "cupy":
        stream.native.end_capture()
    else:
        from cuda.bindings import driver
        err, graph = driver.cuStreamEndCapture(stream.native)
        assert int(err) == 0
        driver.cuGraphDestroy(graph)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", _gpu_backends())
def test_a_captured_graph_reads_what_each_publish_uploads(backend: str) -> None:
    cp = pytest.importorskip("cupy")
    m = _manager(backend)
    b = Batch(m, max_rows=4, max_blocks_per_row=16)
    a, c = _active(m, 40, 1), _active(m, 70, 2)
    b.add_kv_cache(a)
    b.add_kv_cache(c, row=2)
    b.publish()
    m.backend.synchronize()
    table = _cupy_view(cp, b.page_table(0), b)
    out = cp.full(table.shape, 12345, dtype=cp.int32)
    kernel = cp.RawKernel(_COPY, "copy_table")
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        s.begin_capture()
        kernel((4,), (128,), (table, out, np.int32(table.size)))
        graph = s.end_capture()
    graph.launch(s)
    s.synchronize()
    np.testing.assert_array_equal(out.get(), b.read_page_table(0))
    # Members change; the graph, captured once, reads the new rows after publish.
    d = _active(m, 100, 3)
    b.add_kv_cache(d, row=1)
    assert c.resize(120)
    b.remove_kv_cache(a)
    a.close()
    assert b.publish() == 3  # rows 0 (emptied), 1 (seated) and 2 (grown)
    m.backend.synchronize()
    graph.launch(s)
    s.synchronize()
    got = out.get()
    np.testing.assert_array_equal(got, b.read_page_table(0))
    np.testing.assert_array_equal(got[1, 0, :7], d.get_base_page_indices(0))
    np.testing.assert_array_equal(got[2, 0, :8], c.get_base_page_indices(0))
    assert (got[0] == -1).all()
    # A publish queued on a stream that is capturing is refused: it would not run.
    st = m.backend.create_stream()
    d.resize(130)
    _begin_capture(backend, st)
    try:
        with pytest.raises(InvalidStateError, match="graph capture"):
            b.publish(st)
    finally:
        _end_capture(backend, st)
    assert b.publish() == 1
    b.close()
    for x in (c, d):
        x.close()
    m.shutdown()


@pytest.mark.gpu
@pytest.mark.parametrize("release", ["remove_and_close", "shrink"])
@pytest.mark.parametrize("backend", _gpu_backends())
def test_a_reader_fence_keeps_pages_until_the_reading_kernel_is_done(
        backend: str, release: str) -> None:
    cp = pytest.importorskip("cupy")
    m = _manager(backend)
    b = Batch(m, max_rows=2, max_blocks_per_row=16)
    c = _active(m, 64, 1)
    b.add_kv_cache(c)
    b.publish()
    m.backend.synchronize()
    store = m.stores[0][0]
    free_before = store.num_free
    flag_mem = cp.cuda.alloc_pinned_memory(4)
    flag = np.frombuffer(flag_mem, dtype=np.int32, count=1)
    flag[0] = 0
    out = cp.zeros(1, dtype=cp.int32)
    st = m.backend.create_stream()
    gated = cp.RawKernel(_GATED, "gated_read")
    external = cp.cuda.Stream.from_external(st) if hasattr(cp.cuda.Stream, "from_external") \
        else cp.cuda.ExternalStream(st.handle)  # CuPy before 14
    with external:
        gated((1,), (1,), (flag_mem.ptr, _cupy_view(cp, b.page_table(0), b), out))
    b.record_read(st)
    done = threading.Event()

    def engine_frees() -> None:
        m.bind_thread()  # the scheduler hands the manager to this thread (one at a time)
        if release == "shrink":  # the seated cache gives back all but its first block
            assert c.resize(TPB)
        else:
            b.remove_kv_cache(c)
            c.close()
        done.set()

    worker = threading.Thread(target=engine_frees, daemon=True)
    worker.start()
    time.sleep(0.3)
    try:
        assert not done.is_set(), "removal waited for the reader"
        assert store.num_free == free_before, "no page was released"
        assert c.capacity == 64 or release != "shrink"
    finally:
        flag[0] = 1  # the reader finishes
    assert done.wait(10)
    worker.join(10)
    m.bind_thread()  # and takes it back
    assert store.num_free > free_before, "pages go once the fence passed"
    st.synchronize()
    assert int(out.get()[0]) >= 0
    b.close()
    if release == "shrink":
        c.close()
    m.shutdown()


@pytest.mark.gpu
@pytest.mark.parametrize("backend", _gpu_backends())
def test_an_index_table_handed_to_torch_through_dlpack_reads_the_right_pages(
        backend: str) -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA")
    m = _manager(backend)
    b = Batch(m, max_rows=3, max_blocks_per_row=8)
    caches = [_active(m, 20 + 30 * i, i) for i in range(3)]
    for c in caches:
        b.add_kv_cache(c)
    b.register_index_table(0, "v")
    b.publish()
    # Mark every page of buffer v with its slot id (written through the backend).
    region = m.get_page_region(0, "v")
    for c in caches:
        for slot in c.get_base_page_indices(0).tolist():
            mark = np.full(PAGE // 4, slot, dtype=np.int32).view(np.uint8)
            m.backend.write(region.buffer, region.page_start(slot), mark)
    m.backend.synchronize()
    pool = torch.from_dlpack(m.backend.as_array(region.buffer))
    pages = pool[: pool.numel() // PAGE * PAGE].view(-1, PAGE).view(torch.int32)
    index = torch.from_dlpack(b.index_table(0, "v"))
    assert index.shape == (3, 1, 8) and index.dtype == torch.int32
    table = torch.from_dlpack(b.page_table(0))
    for row, c in enumerate(caches):
        slots = c.get_base_page_indices(0)
        got_slots = table[row, 0, : len(slots)].cpu().numpy()
        np.testing.assert_array_equal(got_slots, slots)
        idx = index[row, 0, : len(slots)].long()
        read = pages[idx][:, 0].cpu().numpy()  # the first word of each page
        np.testing.assert_array_equal(read, slots)
    b.close()
    for c in caches:
        c.close()
    m.shutdown()
