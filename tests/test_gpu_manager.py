"""The manager on each GPU kernel backend: fingerprint-verified workloads over three levels
(gpu, host, disk) with every reuse policy, checked every step, and the bytes of every live
page equal to the same run on the NumPy reference. Skipped without a GPU.

The whole manager suite also runs on a GPU backend with ``KVCM_TEST_BACKEND=cuda`` (or
``cupy``): see benchmarks/gpu_run.sh.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvcm_core import (
    AttentionLayerConfig,
    BufferConfig,
    KVCacheManager,
    KVCacheManagerConfig,
    LevelConfig,
    ReusePolicy,
    SsmLayerConfig,
    get_plugin_manager,
)
from kvcm_core.testing.engine import EngineLoop, Request, chat_requests
from kvcm_core.tier import DevicePool

P = ReusePolicy


def _gpu_backends() -> list[str]:
    pm = get_plugin_manager()
    return [n for n, s in pm.kernel_backends().items() if s.capabilities.has_device]


def _config(backend: str, disk: Path) -> KVCacheManagerConfig:
    layers = [
        AttentionLayerConfig(layer_id=0, buffers=[
            BufferConfig(role="k", size=4096), BufferConfig(role="v", size=4096)]),
        AttentionLayerConfig(layer_id=1, buffers=[
            BufferConfig(role="k", size=2048), BufferConfig(role="v", size=2048,
                                                          reuse_policy=P.OPTIONAL)]),
        AttentionLayerConfig(layer_id=2, buffers=[BufferConfig(role="kv", size=3000)],
                             sliding_window_size=64, num_sink_tokens=16),
        AttentionLayerConfig(layer_id=3, buffers=[BufferConfig(role="kv", size=4096)],
                             sliding_window_size=48, num_sink_tokens=16,
                             reuse_policy=P.SINK_REQUIRED_ONLY),
        SsmLayerConfig(layer_id=4, buffers=[BufferConfig(role="state", size=12288),
                                            BufferConfig(role="conv", size=512,
                                                         reuse_policy=P.PRIVATE)]),
    ]
    return KVCacheManagerConfig(
        tokens_per_block=16, layers=layers, commit_min_snapshot=True,
        levels=[LevelConfig(tier="gpu", quota="3MiB"), LevelConfig(tier="host", quota="6MiB"),
                LevelConfig(tier="disk", quota="64MiB", options={"path": str(disk)})],
        kernel_backend=backend)


def _workload(seed: int = 0) -> list[Request]:
    return chat_requests(seed, sessions=6, turns=4, system=300, message=(10, 120),
                         reply=(5, 40))


def _run(backend: str, disk: Path, pm: Any = None) -> tuple[KVCacheManager, EngineLoop, Any]:
    m = KVCacheManager(_config(backend, disk), plugin_manager=pm)
    loop = EngineLoop(m, chunk_tokens=96, max_batch=4, token_budget=256)
    loop.run(_workload(), on_step=lambda _: m.check_invariants())
    return m, loop, m.get_and_reset_iteration_stats()


def _live_pages(m: KVCacheManager) -> dict[tuple[int, int, int, int], bytes]:
    """Bytes of every live page of the device-accessible levels, by (level, store, page
    id, pool): the same decisions give the same page ids, while the slots a move puts
    pages in may differ between backends (a backend whose copies cost per run pairs
    them into runs, the numpy backend does not: ``run_copies``)."""
    out = {}
    for level, stores in enumerate(m.stores):
        for si, store in enumerate(stores):
            arena = m.storage_levels.arena
            for pid in store.pages().tolist():
                slot = int(arena.slot[pid])
                for k, pool in enumerate(store.pools):
                    if not isinstance(pool, DevicePool):
                        continue
                    data = m.backend.read(pool.buffer, slot * pool.slot_bytes,
                                          pool.slot_bytes)
                    out[(level, si, pid, k)] = data.tobytes()
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("backend", _gpu_backends())
def test_fingerprint_workload_on_gpu_backend_matches_the_numpy_reference(backend, tmp_path):
    spec = get_plugin_manager().kernel_backend(backend)
    avail = spec.availability()
    if not avail:
        pytest.skip(f"{backend} unavailable: {avail.reason}")
    _check_matches_numpy(backend, tmp_path)


def test_fingerprint_workload_on_queued_streams_matches_the_numpy_reference(tmp_path):
    """The same workload on the deferred CPU backend (copies really queued on the copy
    streams, run only when something waits for them): the GPU backends' asynchronous
    migration paths, checked in CI (several buffers of different sizes per page, cold
    pages of several parts, single-page moves)."""
    from deferred_backend import deferred_plugin_manager

    _check_matches_numpy("deferred", tmp_path, deferred_plugin_manager())


def _check_matches_numpy(backend: str, tmp_path: Path, pm: Any = None) -> None:
    gm, gloop, gstats = _run(backend, tmp_path / "gpu", pm)
    nm, nloop, nstats = _run("numpy", tmp_path / "numpy")
    assert gm.kernel_backend == backend
    # Every step was verified on both; the runs took the same decisions ...
    assert gloop.engine.checked_pages == nloop.engine.checked_pages > 0
    assert [r.reused for r in gloop.finished] == [r.reused for r in nloop.finished]
    assert gstats == nstats
    assert sum(g.offload_blocks for g in gstats.groups) > 0
    assert sum(g.onboard_blocks for g in gstats.groups) > 0
    # ... and every live page holds the same bytes, bit for bit.
    gpages, npages = _live_pages(gm), _live_pages(nm)
    assert gpages.keys() == npages.keys() and gpages
    diff = [k for k in gpages if gpages[k] != npages[k]]
    assert not diff, f"{len(diff)} pages differ, e.g. {diff[:5]}"
    gm.clear_reusable_blocks()
    assert all(gm.get_storage_statistics(lv).free == gm.get_storage_statistics(lv).total
               for lv in range(3))
    gm.shutdown()
    nm.shutdown()
