"""The fingerprint engine's failure names what an engine developer needs to find the bad
page: the request that owns it and the block, beside the layer, buffer and positions."""

from __future__ import annotations

import numpy as np
import pytest

from kvcm_core import (
    AttentionLayerConfig,
    BufferConfig,
    KVCacheManager,
    KVCacheManagerConfig,
    LevelConfig,
)
from kvcm_core.testing.fingerprint import FingerprintEngine, FingerprintMismatch, StepWork

TPB = 4


@pytest.mark.parametrize("bad_block", [0, 3])
def test_a_mismatch_names_the_request_owning_the_bad_page_and_its_block(bad_block: int):
    cfg = KVCacheManagerConfig(
        tokens_per_block=TPB, kernel_backend="numpy",
        layers=[AttentionLayerConfig(layer_id=0, buffers=[BufferConfig(role="k", size=64)])],
        levels=[LevelConfig(tier="gpu", quota="64KiB")])
    with KVCacheManager(cfg) as m:
        engine = FingerprintEngine(m)
        work = []
        for rid, seed in (("first", 1), ("second", 2), ("third", 3)):
            toks = np.random.default_rng(seed).integers(0, 30000, 4 * TPB).tolist()
            cache = m.create_kv_cache(None, [], id=rid)
            assert cache.resume() and cache.resize(len(toks))
            work.append(StepWork(cache, toks))
        engine.write(work)
        for w in work:
            w.cache.commit(w.tokens)
        engine.check(work)  # intact
        second = work[1].cache
        slot = int(second.get_base_page_indices(0)[bad_block])
        region = m.get_page_region(0, "k")
        m.backend.write(region.buffer, region.page_start(slot), np.zeros(64, np.uint8))
        with pytest.raises(FingerprintMismatch,
                           match=rf"request 'second': .*\(block {bad_block}, positions "):
            engine.check(work)
        for w in work:
            w.cache.close()
