"""Stream-ordering rules checked on the deferred backend (tests/deferred_backend.py), where
queued work runs only when something waits for it, so a missing wait shows every time."""

from __future__ import annotations

import numpy as np
from deferred_backend import DeferredBackend, deferred_plugin_manager

from kvcm_core import (
    AttentionLayerConfig,
    BufferConfig,
    KVCacheManager,
    KVCacheManagerConfig,
    LevelConfig,
)
from kvcm_core.batch import Batch
from kvcm_core.pagetable import BAD_PAGE_INDEX

TPB, KV = 4, 64
BLOCK = 2 * KV


def _manager(gpu: int, host: int) -> KVCacheManager:
    cfg = KVCacheManagerConfig(
        tokens_per_block=TPB, kernel_backend="deferred", max_util_for_resume=1.0,
        layers=[AttentionLayerConfig(layer_id=0, buffers=[BufferConfig(role="k", size=KV),
                                                          BufferConfig(role="v", size=KV)])],
        levels=[LevelConfig(tier="gpu", quota=gpu * BLOCK),
                LevelConfig(tier="host", quota=host * BLOCK)])
    return KVCacheManager(cfg, plugin_manager=deferred_plugin_manager())


def test_a_host_polling_an_event_sees_the_device_make_progress() -> None:
    """As a GPU runs while the host polls, each query runs the event's stream by one item:
    a polling loop (Batch waiting for its reader fence) ends."""
    be = DeferredBackend()
    s = be.create_stream()
    ran: list[int] = []
    for i in range(5):
        s.queue.append(lambda i=i: ran.append(i))
    ev = be.create_event()
    ev.record(s)
    polls = 0
    while not ev.query():
        polls += 1
        assert polls <= 10, "the event's stream never made progress"
    assert ran == [0, 1, 2, 3, 4]


def test_index_tables_are_converted_from_the_device_tables_the_upload_left() -> None:
    """convert_page_tables is queued on the publish stream behind the upload: the index
    table holds the converted slot ids of the table just uploaded."""
    m = _manager(gpu=8, host=8)
    E = m.backend.create_stream()
    b = Batch(m, max_rows=2, max_blocks_per_row=4)
    b.register_index_table(0, "k")
    c = m.create_kv_cache(None, [])
    assert c.resume(E) and c.resize(8, stream=E)
    b.add_kv_cache(c)
    b.publish(E)
    m.backend.synchronize()
    table = b.read_page_table(0)
    index = b.read_index_table(0, "k")
    assert (table[0, 0, :2] != BAD_PAGE_INDEX).all()
    assert (index[0, 0, :2] != BAD_PAGE_INDEX).all(), "converted before the upload ran"
    assert len(np.unique(index[0, 0, :2])) == 2
    b.close()
    c.close()
    m.shutdown()
