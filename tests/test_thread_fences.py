"""A mutating call from a thread other than the owner's is refused before it changes
anything, the owner's stream fences included: on the deferred backend (stream work runs
only when something waits for it) a refused ``resize``/``resume``/``set_beam_width`` from
another thread, landing while the owner is inside ``resize(stream=s)``, must not reset the
fence that makes the owner's eviction copies wait for ``s``, else a block offloaded to the
host is copied before the engine's KV write on ``s`` ran and a later request reuses wrong
KV."""

from __future__ import annotations

import threading

import pytest
from deferred_backend import deferred_plugin_manager

from kvcm_core import (
    AttentionLayerConfig,
    BufferConfig,
    InvalidStateError,
    KVCacheManager,
    KVCacheManagerConfig,
    LevelConfig,
)
from kvcm_core.levels import Levels
from kvcm_core.testing.fingerprint import FingerprintEngine, StepWork

TPB = 4


@pytest.mark.parametrize("intrusion", ["resize", "resume", "set_beam_width"])
def test_a_call_from_another_thread_is_refused_before_it_touches_the_owners_stream_fences(
        monkeypatch: pytest.MonkeyPatch, intrusion: str) -> None:
    cfg = KVCacheManagerConfig(
        tokens_per_block=TPB, kernel_backend="deferred",
        layers=[AttentionLayerConfig(layer_id=0, buffers=[BufferConfig(role="k", size=64),
                                                          BufferConfig(role="v", size=64)])],
        levels=[LevelConfig(tier="gpu", quota=4 * 128), LevelConfig(tier="host", quota=16 * 128)],
        max_util_for_resume=1.0, max_beam_width=2)
    m = KVCacheManager(cfg, plugin_manager=deferred_plugin_manager())
    s = m.backend.create_stream()
    eng = FingerprintEngine(m)
    eng.stream = s
    other = m.create_kv_cache(None, [])  # the cache the intruder touches
    if intrusion != "resume":
        assert other.resume(s)
    # X: 2 blocks written on s (deferred), committed, closed: droppable on the GPU.
    xt = list(range(100, 108))
    x = m.create_kv_cache(None, [])
    assert x.resume(s) and x.resize(8, stream=s)
    eng.step([StepWork(x, xt)])
    x.commit(xt, s)
    x.close()
    foreign: list[str] = []
    owner = threading.get_ident()
    for name in ("begin", "end"):
        orig = getattr(Levels, name)

        def spy(self, stream, _orig=orig, _name=name):
            if threading.get_ident() != owner:
                foreign.append(_name)
            return _orig(self, stream)
        monkeypatch.setattr(Levels, name, spy)
    refused: list[BaseException] = []

    def cb(block: int) -> int:
        if not refused:
            def intrude() -> None:
                try:
                    if intrusion == "resize":
                        other.resize(4)
                    elif intrusion == "set_beam_width":
                        other.set_beam_width(2, s)
                    else:
                        other.resume()
                except InvalidStateError as exc:
                    refused.append(exc)
            t = threading.Thread(target=intrude)
            t.start()
            t.join()
        return 35

    # Y needs 3 new pages: X's 2 droppable GPU pages are pushed to the host.
    y = m.create_kv_cache(None, [], priority_callback=cb)
    assert y.resume(s)
    assert y.resize(12, stream=s)
    assert refused and "thread" in str(refused[0])
    assert not foreign, f"a refused call from another thread ran Levels.{foreign}"
    # On a GPU the copy streams run as soon as nothing they wait for is pending.
    for st in m.backend._streams:
        if st is not s:
            st.run()
    m.backend.synchronize()
    y.close()
    other.close()
    z = m.create_kv_cache(None, xt)  # reuses X's prefix, from the host
    assert z.num_committed_tokens == 8
    assert z.resume(s)
    eng.check([StepWork(z, xt)])
    z.close()
    m.check_invariants()
    m.shutdown()
