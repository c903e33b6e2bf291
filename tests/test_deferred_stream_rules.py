"""Stream-ordering rules checked on the deferred backend (tests/deferred_backend.py), where
queued work runs only when something waits for it, so a missing wait shows every time."""

from __future__ import annotations

from pathlib import Path

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
from kvcm_core.batch import Batch
from kvcm_core.pagetable import BAD_PAGE_INDEX
from kvcm_core.testing.fingerprint import FingerprintEngine, StepWork

TPB, KV = 4, 64
BLOCK = 2 * KV



pytestmark = pytest.mark.usefixtures("deferred_schedule")  # lazy and eager-default

def _manager(gpu: int, host: int) -> KVCacheManager:
    return _manager_over([LevelConfig(tier="gpu", quota=gpu * BLOCK),
                          LevelConfig(tier="host", quota=host * BLOCK)])


def _manager_over(levels: list[LevelConfig]) -> KVCacheManager:
    cfg = KVCacheManagerConfig(
        tokens_per_block=TPB, kernel_backend="deferred", max_util_for_resume=1.0,
        layers=[AttentionLayerConfig(layer_id=0, buffers=[BufferConfig(role="k", size=KV),
                                                          BufferConfig(role="v", size=KV)])],
        levels=levels)
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


def test_prefetch_copies_wait_for_the_work_queued_on_the_stream_it_is_given() -> None:
    """Before its first copy, prefetch(level, stream) makes the copy streams wait for
    ``stream``'s work queued so far: the droppable pages that make way (GPU to host) are
    read after the engine's last write of them on its stream, even when the GPU runs the
    evict stream first; ``stream`` itself is not made to wait for the prefetch."""
    m = _manager(gpu=2, host=8)
    E = m.backend.create_stream()
    eng = FingerprintEngine(m)
    eng.stream = E
    ty, tx = list(range(100, 140)), list(range(500, 540))
    y = m.create_kv_cache(None, [])
    assert y.resume(E) and y.resize(8, stream=E)
    eng.write([StepWork(y, ty)])
    y.commit(ty[:8], E)
    eng.check([StepWork(y, ty)])
    y.suspend()
    x = m.create_kv_cache(None, [])
    assert x.resume(E) and x.resize(8, stream=E)  # Y's pages pushed to the host
    eng.write([StepWork(x, tx)])  # X's last step, queued on E
    x.commit(tx[:8], E)
    x.close()  # X's blocks: cached, droppable on the GPU
    queued_on_e = len(E.queue)
    assert y.prefetch(0, E) == 2  # X's pages make way (GPU -> host), Y comes up
    waits = [f for f in list(E.queue)[queued_on_e:] if getattr(f, "__name__", "") == "reach"]
    assert not waits, "the engine's stream was made to wait for the prefetch"
    for s in m.backend._streams:  # the GPU runs the copy streams first
        if s is not E and s is not m.backend.default_stream:
            s.run()
    z = m.create_kv_cache(None, tx[:9])  # X's prompt again: both blocks reused
    assert z.history_length == 8
    assert z.resume(E)
    eng.check([StepWork(z, tx)])  # FingerprintMismatch when the copy read stale bytes
    z.suspend()
    assert y.resume(E)
    eng.check([StepWork(y, ty)])
    y.suspend()
    y.close()
    z.close()
    m.shutdown()


def test_a_level0_quota_shrink_moves_what_the_engine_wrote_on_its_own_stream() -> None:
    """manager.resize(0, smaller): the copies out of released GPU slots finish before the
    call returns and read what the engine wrote there, its last step on its own stream
    included (not only after the manager's tracked copies)."""
    m = _manager(gpu=8, host=8)
    E = m.backend.create_stream()
    eng = FingerprintEngine(m)
    eng.stream = E
    t = list(range(100, 140))
    f = m.create_kv_cache(None, [])
    assert f.resume(E) and f.resize(16, stream=E)  # filler: GPU slots 0..3
    a = m.create_kv_cache(None, [])
    assert a.resume(E) and a.resize(8, stream=E)  # A: slots 4, 5
    before = a.get_base_page_indices(0).tolist()
    eng.write([StepWork(a, t)])  # A's step, queued on E
    a.commit(t[:8], E)
    a.suspend()
    f.close()  # nothing committed: slots 0..3 free
    assert m.resize(0, 4 * BLOCK)  # every cache suspended: shrink level 0
    assert m.backend.pending() == 0, "a resize's copies finish before it returns"
    assert a.resume(E)
    assert a.get_base_page_indices(0).tolist() != before  # relocated
    eng.check([StepWork(a, t)])  # FingerprintMismatch when the engine's write was lost
    a.suspend()
    a.close()
    m.shutdown()


def test_batch_resize_fast_path_waits_for_the_reader_fence_before_writing_staging_rows() -> None:
    """record_read(stream): the next upload waits for that fence on the host before going
    on; Batch.resize's decode fast path writes new slot ids into the pinned staging rows in
    place, so it waits before that write, else the previous publish's upload (still queued)
    copies the next step's rows and a kernel fenced by record_read reads them."""
    _step_reading_table("resize", record_read=True)


def _step_reading_table(publish_next: str, record_read: bool = False) -> None:
    """One step: publish, a kernel queued on E reads row 0 (fenced by record_read or
    not), then the next step changes the row by ``publish_next`` ("resize": Batch.resize's fast path
    writing staging rows in place; "publish": the cache grows and publish restages the
    row). The kernel must read the table of its own step."""
    m = _manager(gpu=8, host=8)
    be = m.backend
    E = be.create_stream()
    b = Batch(m, max_rows=2, max_blocks_per_row=8)
    c = m.create_kv_cache(None, [])
    assert c.resume(E) and c.resize(4, stream=E)  # one block
    b.add_kv_cache(c)
    b.publish(E)
    b.wait_ready(E)
    pt, nbs = b.page_table(0), b.num_blocks(0)
    want = (1, c.get_base_page_indices(0).tolist())
    seen = {}

    def kernel() -> None:  # an attention kernel of this step on E
        seen["table"] = (int(nbs[0]), pt[0, 0, : int(nbs[0])].tolist())

    E.queue.append(kernel)
    if record_read:
        b.record_read(E)  # fence the reader
    if publish_next == "resize":
        assert b.resize([8, -1], stream=E) == [True, True]
    else:
        assert c.resize(8, stream=E)
        b.mark_dirty(0)
        b.publish(E)
    be.synchronize()
    assert seen["table"] == want, "the step's kernel read the next step's table"
    assert b.read_num_blocks(0)[0] == 2
    b.remove_kv_cache(c)
    b.close()
    c.suspend()
    c.close()
    m.shutdown()


def test_batch_resize_fast_path_waits_for_the_last_upload_without_a_reader_fence() -> None:
    """An engine that never calls record_read (one stream: its kernels are ordered after
    the upload anyway): the staging rows the last upload copies from are not rewritten
    before that upload ran."""
    _step_reading_table("resize")


def test_publish_waits_for_the_last_upload_before_restaging_rows_without_a_reader_fence() -> None:
    """The same for a publish that restages a changed row."""
    _step_reading_table("publish")


@pytest.mark.parametrize("below", ["disk", "host-int8", "host"])
@pytest.mark.parametrize("held", [True, False], ids=["suspended", "closed"])
def test_a_move_out_of_the_gpu_waits_for_the_engines_queued_writes(
        tmp_path: Path, below: str, held: bool) -> None:
    """A's step is written on the engine's stream E and still queued when B's resize
    pushes A's pages down. Every move out of level 0 waits for E first, including the
    copies no pinned level takes (a disk right below the GPU, a codec on the host level),
    which run on another stream: A's KV read back is the KV the step wrote."""
    if below == "disk":
        lower = LevelConfig(tier="disk", quota=16 * BLOCK, options={"path": str(tmp_path)})
    else:
        lower = LevelConfig(tier="host", quota=16 * BLOCK,
                            codec="int8" if below == "host-int8" else None)
    m = _manager_over([LevelConfig(tier="gpu", quota=2 * BLOCK), lower])
    be = m.backend
    E = be.create_stream()
    eng = FingerprintEngine(m)
    eng.stream = E
    tokens = list(range(100, 140))
    a = m.create_kv_cache(None, [])
    assert a.resume(E) and a.resize(8, stream=E)
    eng.write([StepWork(a, tokens)])  # queued on E
    a.commit(tokens[:8], E)
    if held:
        a.suspend()  # held pages: pushed down when room is needed
    else:
        a.close()  # cached blocks, droppable
    b = m.create_kv_cache(None, [])
    assert b.resume(E) and b.resize(8, stream=E)  # takes A's two GPU slots
    be.default_stream.synchronize()  # a GPU may run the other streams first
    b.suspend()
    if held:
        assert a.resume(E)
        eng.check([StepWork(a, tokens)])
        a.suspend()
        a.close()
    else:
        z = m.create_kv_cache(None, tokens[:9])
        assert z.history_length == 8
        assert z.resume(E)
        eng.check([StepWork(z, tokens)])
        z.suspend()
        z.close()
    b.close()
    m.shutdown()


def test_an_index_table_registered_mid_run_is_converted_before_the_next_readers() -> None:
    """register_index_table after a publish converts on the default stream: after the
    queued upload it converts from, and before a kernel that wait_ready orders on the
    engine's stream (rows not dirty are not converted again by the next publish)."""
    m = _manager(gpu=8, host=8)
    be = m.backend
    E = be.create_stream()
    b = Batch(m, max_rows=2, max_blocks_per_row=4)
    c = m.create_kv_cache(None, [])
    assert c.resume(E) and c.resize(8, stream=E)
    b.add_kv_cache(c)
    b.publish(E)  # upload queued on E
    ix = b.register_index_table(0, "k")
    assert b.publish(E) == 0  # nothing dirty
    b.wait_ready(E)
    seen = {}
    E.queue.append(lambda: seen.setdefault("ix", ix[0, 0, :2].tolist()))
    E.run()  # a GPU may run E first unless it waits for the conversion
    be.synchronize()
    converted = b.read_index_table(0, "k")[0, 0, :2].tolist()
    assert BAD_PAGE_INDEX not in converted, "converted before the upload ran"
    assert seen["ix"] == converted, "a kernel read the index table before its conversion"
    b.close()
    c.suspend()
    c.close()
    m.shutdown()
