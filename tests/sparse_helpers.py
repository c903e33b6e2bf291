"""A small model with sparse layers for the sparse tests (CPU and GPU)."""

from __future__ import annotations

from typing import Any

import numpy as np

from kvcm_core import (
    AttentionLayerConfig,
    BufferConfig,
    KVCacheManager,
    KVCacheManagerConfig,
    LevelConfig,
    SparseConfig,
)
from kvcm_core.testing.engine import EngineLoop, Request

TPB = 16
UT = 4  # tokens per unit: 4 units per page


def sparse(selection: Any, ns: int = 4, wsu: int = 12) -> SparseConfig:
    return SparseConfig(unit_tokens=UT, num_selected=ns, working_set_units=wsu,
                        selection_id=selection)


def sparse_config(backend: str = "numpy", levels: int = 1, **kw: Any) -> KVCacheManagerConfig:
    """Layers 0 and 1 share selection "s" (sparse K and V of two sizes, a dense indexer key
    on layer 0), layer 2 selects alone, layer 3 is dense."""
    lv = [LevelConfig(tier="gpu", quota=kw.pop("quota", 1 << 20))]
    if levels > 1:
        lv.append(LevelConfig(tier="host", quota=1 << 22, codec="raw"))
    return KVCacheManagerConfig(
        tokens_per_block=TPB, kernel_backend=backend, levels=lv,
        sparse_host_quota=kw.pop("sparse_host_quota", 1 << 21),
        layers=[
            AttentionLayerConfig(layer_id=0, sparse=sparse("s"), buffers=[
                BufferConfig(role="k", size=256, is_sparse=True),
                BufferConfig(role="v", size=128, is_sparse=True),
                BufferConfig(role="ik", size=256)]),
            AttentionLayerConfig(layer_id=1, sparse=sparse("s"), buffers=[
                BufferConfig(role="k", size=256, is_sparse=True),
                BufferConfig(role="v", size=128, is_sparse=True)]),
            AttentionLayerConfig(layer_id=2, sparse=sparse(None, 3, 8), buffers=[
                BufferConfig(role="kv", size=256, is_sparse=True)]),
            AttentionLayerConfig(layer_id=3, buffers=[BufferConfig(role="kv", size=256)]),
        ], **kw)


def requests(seed: int, n: int = 12) -> list[Request]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        length = int(rng.integers(20, 90))
        toks = [int(x) for x in rng.integers(1, 30000, length)]
        out.append(Request(i, toks, prompt_len=int(rng.integers(5, 30))))
    return out


def run_loop(backend: str = "numpy", seed: int = 0, n: int = 12, *, levels: int = 1,
             quota: int = 1 << 20, sparse_host_quota: int = 1 << 21, **kw: Any) -> EngineLoop:
    """The engine loop over :func:`requests`, fingerprint-verified; the loop stays open."""
    m = KVCacheManager(sparse_config(backend, levels=levels, quota=quota,
                                     sparse_host_quota=sparse_host_quota))
    loop = EngineLoop(m, chunk_tokens=kw.pop("chunk_tokens", 16),
                      max_batch=kw.pop("max_batch", 4), sparse_seed=seed, **kw)
    loop.run(requests(seed, n))
    return loop


#: A two-level run tight enough that requests are suspended and resumed mid-unit.
PREEMPTING = {"levels": 2, "quota": 24 * 1024, "sparse_host_quota": 10 * 1024,
              "preempt_mode": "suspend"}
