"""Overlapping migrations (issue 16): copies issued on the evict and onboard streams, the
engine's stream made to wait, slots fenced by events.

On the CPU the ``deferred`` test backend claims a device, so the manager takes these paths,
but it runs queued work only when a result needs it: every page the fingerprint engine
reads is read after exactly what the engine's stream was made to wait for, so a missing
event or host wait shows up as a fingerprint mismatch, every time. The same orderings run
on each GPU backend (marked ``gpu``: the fingerprint kernels on the stream given to
``resume``, right after it returns)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from deferred_backend import DeferredBackend, deferred_plugin_manager

from kvcm_core import (
    AttentionLayerConfig,
    BufferConfig,
    KVCacheManager,
    KVCacheManagerConfig,
    LevelConfig,
)
from kvcm_core.fences import Fences
from kvcm_core.testing.engine import EngineLoop, Request, chat_requests
from kvcm_core.testing.fingerprint import FingerprintEngine, FingerprintMismatch, StepWork

TPB = 16
KV = 1024  # bytes of K (and of V) per layer and block on the CPU
KV_GPU = 32 << 10  # on a GPU: blocks of 128 KiB, so that copies take a while


def _kv(backend: str) -> int:
    return KV if backend in ("numpy", "deferred") else KV_GPU


def _config(backend: str, gpu: int, host: int, disk: Path | None = None,
            disk_blocks: int = 64, kv: int | None = None) -> KVCacheManagerConfig:
    kv = kv or _kv(backend)
    block = 2 * 2 * kv
    levels = [LevelConfig(tier="gpu", quota=gpu * block),
              LevelConfig(tier="host", quota=host * block)]
    if disk is not None:
        levels.append(LevelConfig(tier="disk", quota=disk_blocks * block,
                                  options={"path": str(disk)}))
    return KVCacheManagerConfig(
        tokens_per_block=TPB,
        layers=[AttentionLayerConfig(layer_id=i, buffers=[BufferConfig(role="k", size=kv),
                                                          BufferConfig(role="v", size=kv)])
                for i in range(2)],
        levels=levels, kernel_backend=backend, max_util_for_resume=1.0)


def _manager(gpu: int, host: int, disk: Path | None = None, backend: str = "deferred",
             disk_blocks: int = 64, kv: int | None = None) -> KVCacheManager:
    pm = deferred_plugin_manager()
    return KVCacheManager(_config(backend, gpu, host, disk, disk_blocks, kv),
                          plugin_manager=pm)


def _workload(seed: int = 0) -> list[Request]:
    return chat_requests(seed, sessions=5, turns=3, system=200, message=(10, 100),
                         reply=(5, 30))


class _Rig:
    """Requests of ``blocks`` blocks written and checked by the fingerprint engine on
    ``stream``."""

    def __init__(self, m: KVCacheManager, stream: Any) -> None:
        self.m = m
        self.stream = stream
        self.engine = FingerprintEngine(m)
        self.engine.stream = stream
        self.tokens: dict[int, list[int]] = {}

    def fill(self, cache: Any, blocks: int, seed: int) -> None:
        """Resume, grow, write every page, commit and suspend."""
        toks = np.random.default_rng(seed).integers(0, 50_000, blocks * TPB).tolist()
        self.tokens[id(cache)] = toks
        assert cache.resume(self.stream)
        assert cache.resize(blocks * TPB, stream=self.stream)
        self.engine.write([StepWork(cache, toks)])
        cache.commit(toks)
        cache.suspend()

    def check(self, cache: Any) -> None:
        self.engine.check([StepWork(cache, self.tokens[id(cache)])])


def _shutdown(m: KVCacheManager) -> None:
    for cache in list(m.open_caches):
        cache.close()
    m.shutdown()


def _queued(m: KVCacheManager) -> None:
    """On the deferred backend: work is still queued (the host did not wait for it)."""
    if isinstance(m.backend, DeferredBackend):
        assert m.backend.pending() > 0


def _available(name: str) -> bool:
    pm = deferred_plugin_manager()
    return bool(pm.availability_of(pm.kernel_backend(name))[0])


#: The deferred CPU backend, and each GPU backend (marked gpu; skipped where unavailable).
BACKENDS = ["deferred", *(pytest.param(b, marks=pytest.mark.gpu) for b in ("cuda", "cupy"))]


@pytest.fixture(params=BACKENDS)
def backend(request) -> str:
    if request.param != "deferred" and not _available(request.param):
        pytest.skip(f"kernel backend {request.param} unavailable")
    return request.param


def test_resume_returns_with_the_swap_copies_still_queued_and_a_check_on_its_stream_sees_every_page(
        backend):
    m = _manager(gpu=4, host=16, backend=backend)
    be = m.backend
    stream = be.create_stream()
    rig = _Rig(m, stream)
    a, b = m.create_kv_cache(), m.create_kv_cache()
    rig.fill(a, 4, seed=1)
    rig.fill(b, 4, seed=2)  # pushes a to the host level, into the slots a freed
    batches = m.storage_levels.mover.fences.batches
    assert a.resume(stream)  # b pushed out, a brought back
    fences = m.storage_levels.mover.fences
    assert fences.batches > batches  # the copies were issued as fenced batches ...
    _queued(m)  # ... and not waited for: the host was not synchronised
    rig.check(a)  # a kernel on the stream right after resume: every page in place
    a.suspend()
    assert b.resume(stream)
    rig.check(b)
    m.check_invariants()
    _shutdown(m)


def test_slots_freed_by_an_eviction_are_overwritten_only_after_the_eviction_read_them(
        backend):
    _slot_reuse(backend)


def _slot_reuse(backend: str) -> None:
    m = _manager(gpu=4, host=16, backend=backend)
    be = m.backend
    stream = be.create_stream()
    rig = _Rig(m, stream)
    caches = [m.create_kv_cache() for _ in range(4)]
    for i, cache in enumerate(caches):  # each one's pages go into the slots of the last
        rig.fill(cache, 4, seed=10 + i)
    for cache in caches:  # every request's bytes survived the reuse of its old slots
        assert cache.resume(stream)
        rig.check(cache)
        cache.suspend()
    _shutdown(m)


def test_prefetch_then_resume_sees_every_page(backend):
    m = _manager(gpu=8, host=16, backend=backend)
    be = m.backend
    stream = be.create_stream()
    rig = _Rig(m, stream)
    a, b = m.create_kv_cache(), m.create_kv_cache()
    rig.fill(a, 4, seed=3)
    rig.fill(b, 8, seed=4)  # the GPU full of b: a on the host level
    b.close()  # its pages stay cached on the GPU, droppable
    assert a.prefetch(0) == 4  # issued on the onboard stream, nobody waits yet
    _queued(m)
    assert a.resume(stream)  # already on the GPU: the fast path still orders the stream
    rig.check(a)
    _shutdown(m)


def test_cascade_to_disk_during_onboard_keeps_every_page(tmp_path, backend):
    _cascade(tmp_path, backend)


def _cascade(tmp_path: Path, backend: str) -> None:
    m = _manager(gpu=4, host=4, disk=tmp_path / "d", disk_blocks=64, backend=backend)
    be = m.backend
    stream = be.create_stream()
    rig = _Rig(m, stream)
    caches = [m.create_kv_cache() for _ in range(4)]
    for i, cache in enumerate(caches):  # the host full: each push sends its pages to disk
        rig.fill(cache, 4, seed=20 + i)
    for cache in caches:  # each resume onboards while another request cascades down
        assert cache.resume(stream)
        rig.check(cache)
        cache.suspend()
    m.check_invariants()
    _shutdown(m)


@pytest.mark.parametrize("stream", ["default", "own"])
def test_fingerprint_workload_over_three_levels_on_queued_streams_matches_numpy(tmp_path,
                                                                                 stream,
                                                                                 backend):
    kv = _kv(backend)  # the numpy reference runs the same shapes

    def run(backend: str) -> tuple[Any, Any]:
        m = _manager(gpu=56, host=64, disk=tmp_path / backend / stream, backend=backend,
                     disk_blocks=256, kv=kv)
        st = m.backend.create_stream() if stream == "own" else None
        loop = EngineLoop(m, chunk_tokens=64, max_batch=4, token_budget=192,
                          use_batch=stream == "default", stream=st)
        loop.run(_workload(), on_step=lambda _: m.check_invariants())
        stats = m.get_and_reset_iteration_stats()
        return m, (loop, stats)

    dm, (dloop, dstats) = run(backend)
    nm, (nloop, nstats) = run("numpy")
    assert dm.storage_levels.mover.fences.batches > 0
    assert nm.storage_levels.mover.fences.batches == 0  # numpy: nothing to track
    assert dloop.engine.checked_pages == nloop.engine.checked_pages > 0
    assert [r.reused for r in dloop.finished] == [r.reused for r in nloop.finished]
    assert dstats == nstats
    assert sum(g.offload_blocks for g in dstats.groups) > 0
    assert sum(g.onboard_blocks for g in dstats.groups) > 0
    _shutdown(dm)
    _shutdown(nm)


@pytest.mark.parametrize("step", ["end", "wait_batches", "wait_host", "join_op"])
def test_each_ordering_step_left_out_shows_as_wrong_pages(monkeypatch, tmp_path, step):
    # The deferred backend catches a missing event or host wait: with one step of
    # kvcm_core.fences doing nothing, a check reads slots before (or after) their copies.
    monkeypatch.setattr(Fences, step, lambda self, *args: None)
    with pytest.raises(FingerprintMismatch):
        _slot_reuse("deferred")
        _cascade(tmp_path, "deferred")


def test_prune_forgets_exactly_the_completed_prefix_of_each_lane_with_few_queries():
    """Batches of one stream complete in order: prune drops each lane's completed prefix,
    keeps every batch still queued (its fence must still be waited for), and finds the
    boundary by bisection rather than querying every tracked event."""
    be = DeferredBackend()
    be.progress_on_query = False  # the streams stand still while prune queries
    fences = Fences(be)
    a, b = be.create_stream(), be.create_stream()
    on_a = [fences.record_batch(a) for _ in range(40)]
    on_b = [fences.record_batch(b) for _ in range(9)]
    fences.events[on_a[24]][1].synchronize()  # stream a ran up to its 25th batch
    queries = []
    for _, ev in fences.events.values():
        query = ev.query
        ev.query = lambda q=query: queries.append(1) or q()  # type: ignore[method-assign]
    fences.prune()
    assert sorted(fences.events) == on_a[25:] + on_b
    assert len(queries) <= 2 * 7  # log2(40) + log2(9), rounded up, per lane
    b.synchronize()
    a.synchronize()
    fences.prune()
    assert not fences.events and fences.batches == 49


def test_moves_after_a_quota_resize_reallocates_the_host_pool_use_the_new_pool(backend):
    """Moves keep their copy plans per pair of stores: a resize that reallocates a pool
    must replace them (a stale plan would copy into the freed pool), and the resize's own
    make-room copies must finish before the pool it shrinks is reallocated."""
    m = _manager(gpu=4, host=12, backend=backend)
    stream = m.backend.create_stream()
    rig = _Rig(m, stream)
    caches = [m.create_kv_cache() for _ in range(3)]
    for i, cache in enumerate(caches):  # plans for GPU <-> host now kept
        rig.fill(cache, 4, seed=40 + i)
    block = 2 * 2 * _kv(backend)  # 2 layers, K and V
    host_before = m.storage_levels.stores[1][0].pools[0].region.buffer
    assert m.resize(1, 24 * block)  # grow: a new host pool, the pages copied over
    assert m.storage_levels.stores[1][0].pools[0].region.buffer is not host_before
    for cache in [*caches, *caches]:  # swaps through the new pool, every page checked
        assert cache.resume(stream)
        rig.check(cache)
        cache.suspend()
    assert m.resize(1, 12 * block)  # shrink again: pages in the released slots move
    for cache in caches:
        assert cache.resume(stream)
        rig.check(cache)
        cache.suspend()
    m.check_invariants()
    _shutdown(m)
