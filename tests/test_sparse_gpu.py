"""Sparse attention on each GPU backend: resolve against the exact LRU on many random cases
(shared-memory and global-memory sorts), the unit copies, and fingerprint-verified engine
runs whose hit and miss counts equal the numpy run's and the host LRU's. Skipped without a
GPU."""

from __future__ import annotations

import numpy as np
import pytest
from sparse_helpers import PREEMPTING, run_loop

from kvcm_core import get_plugin_manager
from kvcm_core.testing.conformance.sparse import (
    ResolveRig,
    check_copy,
    drifting_topk,
    random_case,
    run_case,
)

pytestmark = pytest.mark.gpu


def _gpu_backends() -> list[str]:
    pm = get_plugin_manager()
    return [n for n, s in pm.kernel_backends().items() if s.capabilities.has_device]


def _available(name: str) -> None:
    pm = get_plugin_manager()
    ok, why = pm.availability_of(pm.kernel_backends()[name])
    if not ok:
        pytest.skip(f"kernel backend {name!r} unavailable: {why}")


@pytest.fixture(params=_gpu_backends())
def backend(request: pytest.FixtureRequest):  # type: ignore[no-untyped-def]
    _available(request.param)
    b = get_plugin_manager().kernel_backends()[request.param].factory({})
    yield b
    b.close()


#: (kernel, window, max_windows, threads): v2 and v3 with their widest window, with windows
#: of a few stamps (several windows a row), with none allowed (every row falls back to the
#: sort), and with 512-thread blocks (as for more rows than SMs: slots take more rounds);
#: v3 also in 256-thread blocks (entries and slots take the most rounds); v4 (v3 with the
#: dedup in a shared hash) likewise.
KERNELS = [("v1", None, 16, None), ("v2", None, 16, None), ("v2", None, 16, 512),
           ("v2", 5, 64, None), ("v2", 3, 2, 512), ("v2", 1, 0, None),
           ("v3", None, 16, None), ("v3", None, 16, 512), ("v3", None, 16, 256),
           ("v3", 5, 64, None), ("v3", 3, 2, 256), ("v3", 1, 0, None),
           ("v4", None, 16, None), ("v4", None, 16, 512), ("v4", 3, 2, 256),
           ("v4", 1, 0, None)]


@pytest.fixture(params=KERNELS, ids=lambda k: "-".join(str(x) for x in k))
def kernel(backend, request: pytest.FixtureRequest,  # type: ignore[no-untyped-def]
           monkeypatch: pytest.MonkeyPatch):
    version, window, max_windows, threads = request.param
    monkeypatch.setenv("KVCM_SPARSE_RESOLVE", version)
    backend.sparse_window, backend.sparse_max_windows = window, max_windows
    backend.sparse_threads = threads
    return backend


@pytest.mark.parametrize("shared_limit", [8192, 0], ids=["shared", "global"])
def test_gpu_resolve_is_the_exact_lru_on_random_cases(kernel, shared_limit: int) -> None:
    """``shared_limit=0`` sends every working set through global memory (v1: the sort's
    keys; v2, and v3, which hands such rows to v2: the stamps)."""
    backend = kernel
    backend.sparse_shared_limit = shared_limit
    for seed in range(60 if backend.sparse_window is None else 20):
        case = random_case(np.random.default_rng(seed))
        rig = ResolveRig(backend, case["rows"], case["ns"], case["wsu"], case["mu"],
                         case["ut"])
        try:
            run_case(rig, case)
        finally:
            rig.close()


@pytest.mark.parametrize("rows,wsu", [(64, 4096), (8, 4100), (4, 8192), (2, 9000)])
def test_gpu_resolve_of_2048_selected_on_a_drifting_top_k(kernel, rows: int,
                                                          wsu: int) -> None:
    """9000 entries: past the shared limit (v3 hands the row to v2's global path)."""
    backend = kernel
    rig = ResolveRig(backend, rows, 2048, wsu, 16384, 4)
    try:
        for sel in drifting_topk(np.random.default_rng(wsu), rows, 2048, 8192, 5, 0.5):
            rig.resolve(sel)
    finally:
        rig.close()


@pytest.mark.parametrize("flush", [False, True])
def test_gpu_unit_copies_match_the_byte_model(backend, flush: bool) -> None:
    for seed in range(5):
        check_copy(backend, flush, np.random.default_rng(seed))


@pytest.mark.parametrize("name", _gpu_backends())
@pytest.mark.parametrize("seed", [0, 1])
def test_gpu_sparse_engine_run_is_fingerprint_verified_with_the_numpy_counts(
        name: str, seed: int) -> None:
    _available(name)
    gpu, cpu = run_loop(name, seed), run_loop("numpy", seed)
    assert gpu.sparse is not None and gpu.batch is not None and cpu.batch is not None
    assert gpu.batch.peek_hit_miss_counter() == cpu.batch.peek_hit_miss_counter()
    assert gpu.batch.peek_hit_miss_counter() == (gpu.sparse.hits, gpu.sparse.misses)
    gpu.close()
    cpu.close()


@pytest.mark.parametrize("name", _gpu_backends())
def test_gpu_sparse_engine_run_with_preemption(name: str) -> None:
    _available(name)
    loop = run_loop(name, 5, n=16, **PREEMPTING)
    assert loop.sparse is not None and loop.sparse.checked_entries > 0
    assert sum(r.preemptions for r in loop.finished) > 0
    loop.close()


@pytest.mark.parametrize("name", _gpu_backends())
def test_gpu_selection_given_as_a_device_array_is_copied_on_the_stream(name: str) -> None:
    _available(name)
    cp = pytest.importorskip("cupy")
    from sparse_helpers import sparse_config

    from kvcm_core import Batch, KVCacheManager

    m = KVCacheManager(sparse_config(name))
    b = Batch(m, max_rows=2, max_blocks_per_row=8)
    cache = m.create_kv_cache(None, list(range(1, 65)))
    assert cache.resume() and cache.resize(64) and cache.resize(64, 64)
    b.add_kv_cache(cache)
    b.publish()
    sel = np.array([[7, 8, 9, 7], [-1, -1, -1, -1]], dtype=np.int32)
    b.resolve_sparse_selection(0, cp.asarray(sel))
    for layer in (0, 1):
        b.fetch_resolved_pages(layer)
    m.backend.synchronize()
    np.testing.assert_array_equal(b.read_sparse_table(0, "selected"), sel)
    np.testing.assert_array_equal(b.read_sparse_table(0, "entry_map")[0], [0, 1, 2, 0])
    assert b.peek_hit_miss_counter() == (0, 3)
    b.remove_kv_cache(cache)
    cache.close()
    b.close()
    m.shutdown()


def test_gpu_resolve_and_pin_of_more_slots_than_one_round(kernel) -> None:
    """v1 takes 4 x 512 slots a round, v2 8 x 1024 (or 8 x 512 with 512 threads), v3 4 a
    thread: 5000 selected (and pins of 6000 entries) may need several rounds, whose misses
    must keep slot order across them."""
    backend = kernel
    rows = 2
    rig = ResolveRig(backend, rows, 5000, 6000, 20000, 4)
    try:
        rng = np.random.default_rng(11)
        for sel in drifting_topk(rng, rows, 5000, 12000, 3, 0.6):
            sel[:, ::7] = sel[:, ::7][:, ::-1]  # some slots in another order
            rig.resolve(sel)
        marks = np.array([[4000, 7000], [0, 3000]] * (rows // 2))
        rig.pin(marks)  # 750 units in flight on each row
        for sel in drifting_topk(rng, rows, 5000, 12000, 2, 0.6):
            rig.resolve(sel)
    finally:
        rig.close()


@pytest.mark.parametrize("version", ["v3", "v4"])
def test_gpu_resolve_v3_is_the_exact_lru_with_equal_counts_at_the_benchmark_shape(
        backend, monkeypatch: pytest.MonkeyPatch, version: str) -> None:
    """The shape of the target (256 rows x 2048 selected of 4096 entries, half hits),
    through the 512-thread kernel of v3 (and v4): maps, miss lists, state and hit/miss
    counts equal the host LRU's at every step (the rig checks each)."""
    monkeypatch.setenv("KVCM_SPARSE_RESOLVE", version)
    rig = ResolveRig(backend, 256, 2048, 4096, 8192, 4)
    try:
        for sel in drifting_topk(np.random.default_rng(7), 256, 2048, 8192, 4, 0.5):
            rig.resolve(sel)
        hits, misses = rig.counters.sum(0)
        assert hits > 0 and misses > 0
    finally:
        rig.close()


def test_gpu_resolve_refuses_an_unknown_kernel_setting(backend,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVCM_SPARSE_RESOLVE", "v9")
    rig = ResolveRig(backend, 1, 4, 8, 16, 1)
    try:
        with pytest.raises(ValueError, match="KVCM_SPARSE_RESOLVE='v9'"):
            rig.resolve(np.array([[1, 2, 3, 4]]))
    finally:
        rig.close()


@pytest.mark.parametrize("name", _gpu_backends())
def test_gpu_a_row_moved_after_the_flush_takes_its_write_map_along(name: str) -> None:
    """The publish after a move copies the moved row's write map on the device (the
    numpy and deferred runs of tests/test_sparse_review27.py check the same by bytes)."""
    _available(name)
    from sparse_helpers import sparse_config

    from kvcm_core import Batch, KVCacheManager

    m = KVCacheManager(sparse_config(name))
    toks = [int(x) for x in np.random.default_rng(0).integers(1, 30000, 64)]
    c = m.create_kv_cache(None, toks[:8])
    assert c.resume() and c.resize(8) and c.resize(8, 8)
    b = Batch(m, max_rows=3, max_blocks_per_row=8)
    b.add_kv_cache(c)
    b.resize(np.array([12, -1, -1]))  # tokens 8..11 in flight: unit 2 pinned
    b.flush_sparse_units()
    m.backend.synchronize()
    before = b.read_sparse_table(0, "write_map").copy()
    b.move(c, 2)
    b.publish()  # seats uploaded, capacity unchanged: no new pin
    m.backend.synchronize()
    after = b.read_sparse_table(0, "write_map")
    assert after[2].tolist() == before[0].tolist() and (before[0] >= 0).any()
    assert (after[0] == -1).all()
    b.remove_kv_cache(c)
    c.close()
    b.close()
    m.shutdown()
