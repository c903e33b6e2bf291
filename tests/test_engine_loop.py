"""The engine loop shared by the tests and ``kvcm simulate``: it must finish any workload
that fits the GPU one request at a time, whatever the pressure and the policies."""

from __future__ import annotations

import numpy as np
import pytest

from kvcm_core import (
    AttentionLayerConfig,
    BufferConfig,
    KVCacheManager,
    KVCacheManagerConfig,
    LevelConfig,
    ReusePolicy,
)
from kvcm_core.testing.engine import EngineLoop, Request


def _manager(policy: ReusePolicy, slots: int) -> KVCacheManager:
    return KVCacheManager(KVCacheManagerConfig(
        tokens_per_block=4,
        layers=[AttentionLayerConfig(layer_id=0, buffers=[BufferConfig(role="kv", size=64)],
                                     reuse_policy=policy)],
        levels=[LevelConfig(tier="gpu", quota=slots * 64)], kernel_backend="numpy"))


@pytest.mark.parametrize("policy", [ReusePolicy.PRIVATE, ReusePolicy.REQUIRED])
def test_engine_loop_never_sacrifices_an_older_request_for_a_newer_one(policy):
    # Nothing reusable (PRIVATE) and a GPU that holds about two requests: preempting the
    # oldest request for a newer one would restart it from zero forever (a livelock).
    m = _manager(policy, slots=12)  # a 44-token request needs 11 slots alone
    rng = np.random.default_rng(0)
    reqs = [Request(i, rng.integers(0, 1000, int(rng.integers(20, 44))).tolist(),
                    int(rng.integers(1, 20))) for i in range(8)]
    loop = EngineLoop(m, chunk_tokens=4, max_batch=8)
    done = loop.run(reqs, max_steps=3000, on_step=lambda _: m.check_invariants())
    assert sorted(r.id for r in done) == list(range(8))
    assert sum(r.preemptions for r in reqs) > 0  # the pressure was real
    m.clear_reusable_blocks()
    stats = m.get_storage_statistics(0)
    assert stats.free == stats.total
