"""Copies inside a cache (beam forks, unsharing at a rewind, SSM snapshots at commit) and
pages a commit switches to follow the stream rules of docs/semantics.md ("Streams, events
and prefetch"): a copy that reads a page the engine wrote runs after the engine's work
queued on its stream, a slot freed by a move is handed out again only behind the copy that
read it, and the engine's stream waits for copies that fill pages it will read.

On the ``deferred`` test backend a stream's work runs only when something waits for it. A
GPU may run the default stream's queue before the engine's: the tests model that by running
the default stream first (``default_stream.synchronize()``), so a copy queued there without
waiting for the engine's stream reads a page before the engine wrote it."""

from __future__ import annotations

from typing import Any

import pytest
from deferred_backend import deferred_plugin_manager

from kvcm_core import (
    AttentionLayerConfig,
    BufferConfig,
    KVCacheManager,
    KVCacheManagerConfig,
    LevelConfig,
    SsmLayerConfig,
)
from kvcm_core.testing.fingerprint import FingerprintEngine, StepWork

TPB = 4
KV = 64
BLOCK = 2 * KV



pytestmark = pytest.mark.usefixtures("deferred_schedule")  # lazy and eager-default

def _manager(gpu: int, host: int, ssm: bool = False, **kw: Any) -> KVCacheManager:
    layers: list[Any] = [AttentionLayerConfig(
        layer_id=0, buffers=[BufferConfig(role="k", size=KV), BufferConfig(role="v", size=KV)])]
    if ssm:
        layers.append(SsmLayerConfig(layer_id=1, buffers=[BufferConfig(role="state", size=48)]))
    cfg = KVCacheManagerConfig(
        tokens_per_block=TPB, layers=layers,
        levels=[LevelConfig(tier="gpu", quota=gpu * BLOCK),
                LevelConfig(tier="host", quota=host * BLOCK)],
        kernel_backend="deferred", max_util_for_resume=1.0, **kw)
    return KVCacheManager(cfg, plugin_manager=deferred_plugin_manager())


def _rig(m: KVCacheManager) -> tuple[Any, FingerprintEngine]:
    e = m.backend.create_stream()  # the engine's stream
    eng = FingerprintEngine(m)
    eng.stream = e
    return e, eng


def _default_first(m: KVCacheManager) -> None:
    """The GPU runs the default stream's queue before the engine's."""
    m.backend.default_stream.synchronize()


def _check_both_beams_then_close(m: KVCacheManager, eng: FingerprintEngine, c: Any,
                                 toks: list[int]) -> None:
    """The default stream runs first (as a GPU may), then both beams are checked on the
    engine's stream; then the cache closes and the manager's records hold."""
    _default_first(m)
    eng.check([StepWork(c, toks, 0), StepWork(c, toks, 1)])
    m.backend.synchronize()
    c.close()
    m.check_invariants()
    m.shutdown()


def test_a_beam_fork_copies_beam_0s_partial_block_and_ssm_state_after_the_engines_writes():
    m = _manager(16, 16, ssm=True, max_beam_width=2)
    e, eng = _rig(m)
    toks = list(range(100, 120))
    c = m.create_kv_cache(None, [])
    assert c.resume(e) and c.resize(6, stream=e)  # block 0 full, block 1 partial
    eng.write([StepWork(c, toks)])  # queued on e
    c.commit(toks[:6], e)
    assert c.set_beam_width(2, e)  # beam 1: its own copy of block 1 and of the state
    _check_both_beams_then_close(m, eng, c, toks)


def test_a_rewind_below_the_fork_copies_the_unshared_block_after_the_engines_writes():
    m = _manager(16, 16, max_beam_width=2, max_rewind_len=8)
    e, eng = _rig(m)
    toks = list(range(100, 120))
    c = m.create_kv_cache(None, [])
    assert c.resume(e) and c.resize(8, stream=e)
    eng.write([StepWork(c, toks)])  # blocks 0 and 1, queued on e
    c.commit(toks[:4], e)
    assert c.resize(8, history_length=8, stream=e)
    assert c.set_beam_width(2, e)  # fork at 8: both blocks shared, nothing copied
    assert c.resize(8, history_length=6, stream=e)  # rewind below the fork: a copy of block 1
    _check_both_beams_then_close(m, eng, c, toks)


def test_a_slot_a_beam_fork_frees_by_an_eviction_is_written_only_behind_the_copy_that_read_it():
    m = _manager(4, 8, max_beam_width=2)
    e, eng = _rig(m)
    ta, tb = list(range(100, 140)), list(range(500, 540))
    a = m.create_kv_cache(None, [])
    assert a.resume(e) and a.resize(8, stream=e)
    eng.write([StepWork(a, ta)])
    a.commit(ta[:8], e)
    a.suspend()  # a holds 2 of the 4 GPU slots
    b = m.create_kv_cache(None, [])
    assert b.resume(e) and b.resize(6, stream=e)  # the other 2
    eng.write([StepWork(b, tb)])
    assert b.set_beam_width(2, e)  # beam 1's 2 pages: a's pages evicted to the host
    eng.write([StepWork(b, tb, 1)])  # beam 1's own [0, 6), on e
    eng.check([StepWork(b, tb, 0), StepWork(b, tb, 1)])
    b.suspend()
    assert a.resume(e)  # a comes back from the host: what the eviction read
    eng.check([StepWork(a, ta)])
    m.backend.synchronize()
    a.close()
    b.close()
    m.check_invariants()
    m.shutdown()


def test_a_commit_snapshot_copies_the_ssm_state_after_the_engines_writes():
    m = _manager(32, 32, ssm=True, commit_min_snapshot=True)
    e, eng = _rig(m)
    t = list(range(100, 140))
    a = m.create_kv_cache(None, [])
    assert a.resume(e) and a.resize(4, stream=e)
    eng.write([StepWork(a, t)])
    a.commit(t[:4], e)
    eng.check([StepWork(a, t)])
    assert a.resize(8, stream=e)
    eng.write([StepWork(a, t)])  # the state after 8 tokens, queued on e
    a.commit(t[4:8], e)  # the snapshot at 8: a copy of the live state
    _default_first(m)
    eng.check([StepWork(a, t)])
    a.close()
    b = m.create_kv_cache(None, t[:9])  # reuses 2 blocks and the snapshot at 8
    assert b.history_length == 8
    assert b.resume(e)
    eng.recompute([StepWork(b, t)])
    assert b.resize(9, stream=e)
    eng.check([StepWork(b, t)])
    m.backend.synchronize()
    b.close()
    m.check_invariants()
    m.shutdown()


def test_a_commit_that_rebases_onto_the_trees_page_makes_the_engine_wait_for_its_onboard():
    m = _manager(4, 8)
    e, eng = _rig(m)
    p = [7, 8, 9, 10]
    tx = p + list(range(100, 120))
    x = m.create_kv_cache(None, [])
    assert x.resume(e) and x.resize(4, stream=e)
    eng.write([StepWork(x, tx)])
    x.commit(tx[:4], e)
    eng.check([StepWork(x, tx)])
    x.close()  # block p cached on the GPU
    y = m.create_kv_cache(None, tx[:5])  # holds block p, suspended
    assert y.history_length == 4
    f = m.create_kv_cache(None, [])
    assert f.resume(e) and f.resize(16, stream=e)  # fills the GPU: p pushed to the host
    eng.write([StepWork(f, list(range(200, 216)))])
    f.close()
    z = m.create_kv_cache(None, [])  # computes p itself
    assert z.resume(e) and z.resize(5, stream=e)
    assert y.prefetch(0) == 1  # p comes back up: an onboard nobody waited for
    tz = p + [55] * 20
    eng.write([StepWork(z, tz)])
    z.commit(tz[:5], e)  # block 0 is p: z switches to the tree's page
    eng.check([StepWork(z, tz)])  # the engine's next kernel on e
    m.backend.synchronize()
    y.close()
    z.close()
    m.check_invariants()
    m.shutdown()
