"""Fast paths of page moves (kernels/numpy, backend.check_copy_args, migration, frame,
storage): each gives what the general path gives.

A workload over three levels runs once with every fast path on and once with each turned
off, and must leave the same pages in the same slots and queues, the same statistics and
the same events; the smaller rules are checked one by one.
"""

from __future__ import annotations

import dataclasses

import attrs
import kvcm_kernels_numpy
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvcm_codec_raw import RawCodec
from levels_helpers import (
    Driver,
    Recorder,
    SinkPlugin,
    close_all,
    make_manager,
    page_levels,
    snapshot,
    tokens,
)

import kvcm_core
import kvcm_core.backend as backend_mod
import kvcm_core.frame as frame_mod
import kvcm_core.levels as levels_mod
import kvcm_core.migration as migration_mod
import kvcm_core.storage as storage_mod
from kvcm_core import KvcmPluginManager
from kvcm_core.backend import CopyTask, PageRegion, check_copy_args, copy_pairs
from kvcm_core.frame import FrameBook, FrameFormat, layout_fingerprint
from kvcm_core.migration import Mover
from kvcm_core.storage import PageArena, Store
from kvcm_core.tier import DevicePool


def _fast_paths_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kvcm_kernels_numpy, "_FEW_PAIRS", 0)
    monkeypatch.setattr(backend_mod, "_SMALL_PAIRS", 0)
    monkeypatch.setattr(frame_mod, "_FEW_FRAMES", 0)
    monkeypatch.setattr(frame_mod, "_FEW_WRAPS", 0)
    monkeypatch.setattr(Mover, "_direct_parts", lambda self, layout, src, dst: None)
    monkeypatch.setattr(storage_mod, "_ONE_BY_ONE", False)
    monkeypatch.setattr(migration_mod, "_ONE_BY_ONE", False)
    # Copies through the codec's encode and decode rather than the core's own copies.
    monkeypatch.setattr(RawCodec, "identity", False)


def _workload(tmp_path, layout: str) -> tuple:
    """Requests written, suspended, resumed, reused and closed over GPU, host and disk
    levels too small for them: what it leaves (state, statistics, events)."""
    rec = Recorder()
    pm = KvcmPluginManager()
    pm.register(SinkPlugin(rec), name="recorder")
    m = make_manager([("gpu", 10), ("host", 8), ("disk", 16)], tmp_path, layout=layout,
                     pm=pm)
    d = Driver(m)
    prompts = [tokens(26, 40 + i % 3) for i in range(7)]
    caches, states = [], []
    try:
        for i, p in enumerate(prompts):
            c = d.write(p[: 12 + 2 * i] + tokens(5, 90 + i), chunk=3 + i % 4)
            caches.append(c)
            if i % 3 == 2:
                d.resume_and_verify(*caches[-3:])
            if i % 2:
                caches.pop(0).close()
            states.append(snapshot(m, *caches))
        for c in caches:
            c.prefetch(1)
        d.resume_and_verify(*caches)
        states.append(snapshot(m, *caches))
        stats = m.get_and_reset_iteration_stats()
        close_all(m)
        states.append(snapshot(m))
        m.storage_levels.flush_events()
        events = [dataclasses.astuple(e) if dataclasses.is_dataclass(e) else repr(e)
                  for e in rec.events]
        return states, stats, events
    finally:
        if not m.is_shut_down:
            close_all(m)
            m.shutdown()


@pytest.mark.parametrize("layout", ["full", "hybrid"])
def test_fast_paths_of_moves_leave_what_the_general_paths_leave(tmp_path, monkeypatch,
                                                                 layout):
    fast = _workload(tmp_path / "fast", layout)
    with monkeypatch.context() as mp:
        _fast_paths_off(mp)
        general = _workload(tmp_path / "general", layout)
    assert fast[1] == general[1]
    assert fast[2] == general[2]
    assert len(fast[2]) > 50  # the workload moved and dropped pages
    assert sum(g.dropped_blocks for g in fast[1].groups) > 0
    assert sum(g.onboard_blocks for g in fast[1].groups) > 0
    assert fast[0] == general[0]


# -- the numpy backend's copies ------------------------------------------------------------


def _filled(be, nbytes: int, seed: int):
    buf = be.alloc_device(nbytes)
    buf.host_view()[:] = np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)
    return buf


@pytest.mark.parametrize("same_buffer", [False, True])
@pytest.mark.parametrize("n", [1, 2, 5, 8, 9, 40])
def test_numpy_copy_of_a_few_pages_page_by_page_gives_the_bytes_of_gather_and_scatter(
        monkeypatch, n, same_buffer):
    rng = np.random.default_rng(n)
    results = []
    for few in (kvcm_kernels_numpy._FEW_PAIRS, 0):
        monkeypatch.setattr(kvcm_kernels_numpy, "_FEW_PAIRS", few)
        be = kvcm_kernels_numpy.NumpyBackend()
        a, b = _filled(be, 4096, 1), _filled(be, 6000, 2)
        src = PageRegion(a, 8, 48)  # pages of 40 bytes with gaps, at an offset
        dst = PageRegion(a, 2000, 40) if same_buffer else PageRegion(b, 24, 40)
        d = rng.permutation(40)[:n].astype(np.int32)
        s = rng.permutation(40)[:n].astype(np.int32)
        rng = np.random.default_rng(n)  # the same pairs for both paths
        be.copy_pages_batch([CopyTask(dst, src, 40, copy_pairs(d, s))])
        results.append((a.host_view().copy(), b.host_view().copy()))
    np.testing.assert_array_equal(results[0][0], results[1][0])
    np.testing.assert_array_equal(results[0][1], results[1][1])


def test_numpy_copy_of_one_page_onto_itself_overlapping_is_a_move():
    be = kvcm_kernels_numpy.NumpyBackend()
    a = _filled(be, 256, 3)
    before = a.host_view().copy()
    region = PageRegion(a, 0, 10)  # pages of 32 bytes overlap their neighbours
    be.copy_pages_batch([CopyTask(region, region, 32, copy_pairs(np.array([1]),
                                                                   np.array([0])))])
    want = before.copy()
    want[10:42] = before[0:32]
    np.testing.assert_array_equal(a.host_view(), want)


def test_numpy_copy_keeps_no_page_view_of_a_freed_buffer():
    be = kvcm_kernels_numpy.NumpyBackend()
    a, b = _filled(be, 640, 4), _filled(be, 640, 5)
    for n in (3, 10):  # page by page (the buffers' bytes kept), gather and scatter (items)
        pairs = copy_pairs(np.arange(n), np.arange(n)[::-1])
        be.copy_pages_batch([CopyTask(PageRegion(b, 0, 64), PageRegion(a, 0, 64), 64, pairs)])
    assert be._items and be._views
    a.free()
    assert all(kept[0] is not a for kept in [*be._items.values(), *be._views.values()])
    with pytest.raises(ValueError, match="freed"):
        be.copy_pages_batch([CopyTask(PageRegion(b, 0, 64), PageRegion(a, 0, 64), 64,
                                      copy_pairs(np.arange(10), np.arange(10)))])
    with pytest.raises(ValueError, match="freed"):
        be.copy_pages_batch([CopyTask(PageRegion(b, 0, 64), PageRegion(a, 0, 64), 64,
                                      copy_pairs(np.arange(1), np.arange(1)))])
    c = _filled(be, 640, 6)  # a new buffer, perhaps at the old address
    be.copy_pages_batch([CopyTask(PageRegion(b, 0, 64), PageRegion(c, 0, 64), 64,
                                  copy_pairs(np.arange(10), np.arange(10)))])
    np.testing.assert_array_equal(b.host_view(), c.host_view())


@pytest.mark.parametrize("n", [1, 3, 16, 17, 100])
def test_check_copy_args_bounds_short_and_long_pair_arrays_alike(monkeypatch, n):
    be = kvcm_kernels_numpy.NumpyBackend()
    a, b = be.alloc_device(64 * 200), be.alloc_device(64 * 150 + 8)
    dst, src = PageRegion(b, 8, 64), PageRegion(a, 0, 64)
    rng = np.random.default_rng(n)
    d = rng.permutation(150)[:n].astype(np.int32)
    s = rng.permutation(200)[:n].astype(np.int32)
    cases = [(d, s), (d, s + 199 - s.max()), (d + 149 - d.max(), s),
             (d + 150 - d.max(), s), (d, s + 200 - s.max()), (d - 1 - d.min(), s),
             (d, s - 1 - s.min()), (d - 5 - d.min(), s - 3 - s.min())]
    for dd, ss in cases:
        pairs = copy_pairs(dd, ss)
        out = []
        for small in (backend_mod._SMALL_PAIRS, 0):
            monkeypatch.setattr(backend_mod, "_SMALL_PAIRS", small)
            try:
                out.append(check_copy_args(dst, src, 64, pairs))
            except ValueError as exc:
                out.append(str(exc))
        assert out[0] == out[1]


# -- frames ----------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 8, 9])
def test_frame_check_of_a_few_frames_matches_the_general_check(monkeypatch, n):
    fmt = FrameFormat(codec_id=3, layout=layout_fingerprint({"x": 1}))
    rng = np.random.default_rng(n)
    book = FrameBook(fmt, 32, 24)
    slots = rng.permutation(30)[:n]
    keys = rng.integers(0, 256, (n, 32), dtype=np.uint8)
    frames = book.wrap(slots, rng.integers(0, 256, (n, 24), dtype=np.uint8), keys)
    trials = [(slots, frames)]
    for bit in range(frames.shape[1] * 8):  # every bit of a frame, flipped
        bad = frames.copy()
        bad[bit % n, bit // 8] ^= np.uint8(1 << (bit % 8))
        trials.append((slots, bad))
    trials.append((np.where(slots == slots[0], 31, slots), frames))  # a slot never written
    trials.append((slots[::-1].copy(), frames))  # frames read from each other's slots
    # A valid frame of another block (its key replaced, sequence number kept, CRC-32C
    # recomputed) in the first slot.
    other = frames.copy()
    at = frame_mod._KEY_AT
    other[0, at : at + 32] = rng.integers(0, 256, 32, dtype=np.uint8)
    crc = int(frame_mod._crc(other[0, :-4]))
    other[0, -4:] = np.frombuffer(crc.to_bytes(4, "little"), np.uint8)
    trials.append((slots, other))
    for sl, fr in trials:
        few = book.check(sl, fr)
        monkeypatch.setattr(frame_mod, "_FEW_FRAMES", 0)
        general = book.check(sl, fr)
        monkeypatch.undo()
        assert few.dtype == general.dtype == np.bool_
        assert few.tolist() == general.tolist()
    assert book.check(slots, frames).all()
    assert book.check(slots, other).tolist() == [False] + [True] * (n - 1)


# -- copies between the GPU level and a device-accessible level ------------------------------


def test_direct_copy_plan_follows_a_pool_that_moved(tmp_path, cleanup):
    m = make_manager([("gpu", 8), ("host", 8)], tmp_path)
    cleanup(m)
    d = Driver(m)
    a = d.write(tokens(24, 1))
    b = d.write(tokens(24, 2))  # pushes A to the host level
    host = m.stores[1][0]
    pool = host.pools[0]
    assert isinstance(pool, DevicePool)
    before = pool.buffer
    m.storage_levels.mover.forget_plans = lambda: None  # keep the plans over the resize
    assert m.resize(1, m.levels[1].quota * 3)
    assert pool.buffer is not before  # the host pool moved: a plan kept must not be used
    d.resume_and_verify(a, b)
    a.close()
    b.close()


# -- single pages in and out of the queues ---------------------------------------------------


class _Pool:
    slot_bytes = 8
    num_slots = 8


def _store() -> Store:
    from kvcm_eviction_lru.segments import SegmentLruPolicy

    return Store(0, 1, 0, [_Pool()], SegmentLruPolicy, False, PageArena())


def _subject(store: Store, locks: int, holds: int, node: int) -> np.ndarray:
    """Five pages: two held and queued, two droppable and queued, then the subject page
    with these counts and a locked page (in no queue; a batch call ignores it)."""
    pids = store.take(0, 6)
    a = store.arena
    a.locks[pids] = 0
    a.holds[pids[:2]] = 1
    store.held.insert_many(pids[:2])
    a.node[pids[2:4]] = [11, 12]
    store.droppable.insert_many(pids[2:4])
    a.locks[pids[4]], a.holds[pids[4]], a.node[pids[4]] = locks, holds, node
    a.priority[pids[4]] = 7
    a.locks[pids[5]] = 1
    return pids


def _queues(store: Store, pid: int) -> tuple:
    return (int(store.arena.store[pid]), store.held.pop_victims(9).tolist(),
            store.droppable.pop_victims(9).tolist())


@pytest.mark.parametrize("locks", [0, 1])
@pytest.mark.parametrize("holds", [0, 2])
@pytest.mark.parametrize("node", [-1, 5])
def test_one_page_enters_and_leaves_the_queues_as_in_a_batch(locks, holds, node):
    entered, left = [], []
    for batch in (False, True):
        store = _store()
        pids = _subject(store, locks, holds, node)
        store._enter(pids[4:] if batch else pids[4:5])
        entered.append(_queues(store, int(pids[4])))
        store = _store()
        pids = _subject(store, locks, holds, node)
        store._enter(pids[4:5])
        store._leave(pids[4:] if batch else pids[4:5])
        left.append(_queues(store, int(pids[4])))
    assert entered[0] == entered[1]
    assert left[0] == left[1]
    assert len(left[0][1]) == 2 and len(left[0][2]) == 2  # only the subject left


@pytest.mark.parametrize("slots", [[3], [4, 1], [6, 6], [0, 5, 2, 7, 1, 3, 4, 9], list(range(9))])
def test_frame_wrap_of_a_few_pages_gives_the_bytes_and_records_of_the_general_wrap(
        monkeypatch, slots):
    fmt = FrameFormat(codec_id=5, layout=layout_fingerprint({"y": 2}))
    rng = np.random.default_rng(len(slots))
    sl = np.asarray(slots, dtype=np.int64)
    payloads = rng.integers(0, 256, (len(sl), 40), dtype=np.uint8)
    keys = rng.integers(0, 256, (len(sl), 32), dtype=np.uint8)
    out = []
    for few in (8, 0):
        monkeypatch.setattr(frame_mod, "_FEW_WRAPS", few)
        book = FrameBook(fmt, 12, 40)
        book.wrap(np.array([2]), payloads[:1], keys[:1])  # an earlier write
        frames = book.wrap(sl, payloads, keys)
        assert frames.dtype == np.uint8 and frames.flags.writeable
        out.append((frames.tolist(), book.keys.tolist(), book.seqs.tolist(), book._next_seq,
                    book.check(sl[-1:], frames[-1:]).tolist()))
    assert out[0] == out[1]


def test_frame_key_of_one_page_is_its_key_in_a_batch(tmp_path, cleanup):
    m = make_manager([("gpu", 8), ("host", 6), ("disk", 20)], tmp_path)
    cleanup(m)
    d = Driver(m)
    for i in range(4):  # committed blocks and a partial tail each; two left suspended
        c = d.write(tokens(21, 60 + i))
        if i < 2:
            c.close()
    lv = m.storage_levels
    pids = [p for level in m.stores for s in level for p in s.pages().tolist()]
    nodes = lv.arena.node[pids]
    kinds = {"uncommitted" if n < 0 else "partial" if lv.tree.key(int(n)) is None
             else "full" for n in nodes.tolist()}
    assert kinds == {"uncommitted", "partial", "full"}
    for p in pids:
        one = lv.frame_keys(np.array([p], dtype=np.int64))
        both = lv.frame_keys(np.array([p, pids[0]], dtype=np.int64))
        assert one.shape == (1, 32) and one.tobytes() == both[:1].tobytes()


def test_frame_keys_of_a_batch_are_each_pages_key_after_node_ids_are_recycled(
        tmp_path, cleanup):
    """The key rows the tree keeps for framed levels follow its nodes: after many
    requests (shared prefixes, partial tails, drops that free node ids for reuse by
    full and partial blocks alike), a batch's frame keys are each page's tree key, or
    its page-derived key where it has none."""
    m = make_manager([("gpu", 8), ("host", 6), ("disk", 20)], tmp_path)
    cleanup(m)
    d = Driver(m)
    for i in range(40):
        toks = tokens(4 * (i % 3), 7) + tokens(3 + (5 * i) % 9, 100 + i)
        d.write(toks, suspend=False).close()
    lv = m.storage_levels
    assert sum(g.dropped_blocks for g in lv.stats.groups) > 20  # ids were recycled
    pids = np.array([p for level in m.stores for s in level for p in s.pages().tolist()],
                    dtype=np.int64)
    nodes = lv.arena.node[pids].tolist()
    keys = [lv.tree.key(n) if n >= 0 else None for n in nodes]
    assert any(k is None for k in keys) and any(k is not None for k in keys)
    want = [k if k is not None else frame_mod.page_key(None, p)
            for k, p in zip(keys, pids.tolist(), strict=True)]
    assert [bytes(r) for r in lv.frame_keys(pids)] == want


@pytest.mark.parametrize("few", [8, 0])  # keyless rows found by the byte search, or all at once
@pytest.mark.parametrize("word", [1, 2, 3])
def test_frame_keys_keep_a_tree_key_whose_first_word_is_zero(tmp_path, cleanup,
                                                             monkeypatch, word, few):
    """Only an all-zero key row means "no tree key": a key whose first eight bytes or more
    are zero (a run of zeros that, with the zero rows around it, spans a row boundary) is
    still the block's key."""
    m = make_manager([("gpu", 8), ("host", 6), ("disk", 20)], tmp_path)
    cleanup(m)
    monkeypatch.setattr(levels_mod, "_FEW_KEYLESS", few)
    lv = m.storage_levels
    pids = np.arange(6, dtype=np.int64)
    crafted = np.zeros((6, 32), dtype=np.uint8)
    crafted[[0, 2, 5], 8 * word] = [7, 255, 1]  # first word zero, one later byte set
    crafted[4, :8] = 9                        # an ordinary key
    monkeypatch.setattr(lv.tree, "key_rows_of", lambda nodes: crafted.copy())
    want = [crafted[i].tobytes() if crafted[i].any() else frame_mod.page_key(None, i)
            for i in range(6)]
    assert [bytes(r) for r in lv.frame_keys(pids)] == want


def _row(kind: int, zeros: int, seed: int) -> bytes:
    """A key row: all zero (kind 0), or random bytes with ``zeros`` zero bytes at its
    start (1), its end (2) or both (3): runs of zeros that cross row boundaries."""
    if kind == 0:
        return bytes(32)
    body = bytearray(np.random.default_rng(seed).integers(1, 256, 32, dtype=np.uint8))
    zeros = min(zeros, 31)
    if kind & 1:
        body[:zeros] = bytes(zeros)
    if kind & 2:
        body[32 - zeros:] = bytes(zeros)
    return bytes(body)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 31), st.integers(0, 99)),
                min_size=2, max_size=40),
       st.sampled_from([8, 0, 2]))
def test_frame_keys_give_page_keys_exactly_to_all_zero_rows(tmp_path_factory, rows, few):
    """frame_keys' byte search finds the all-zero key rows (no tree key: a page key) and
    no other, however the zero runs of the rows around them fall."""
    tmp = tmp_path_factory.mktemp("fk")
    m = make_manager([("gpu", 8), ("host", 6), ("disk", 20)], tmp)
    try:
        lv = m.storage_levels
        crafted = np.frombuffer(b"".join(_row(*r) for r in rows), dtype=np.uint8
                                ).reshape(len(rows), 32)
        pids = np.arange(100, 100 + len(rows), dtype=np.int64)
        lv.tree.key_rows_of = lambda nodes: crafted.copy()
        old = levels_mod._FEW_KEYLESS
        levels_mod._FEW_KEYLESS = few
        try:
            got = [bytes(r) for r in lv.frame_keys(pids)]
        finally:
            levels_mod._FEW_KEYLESS = old
        want = [bytes(r) if r.any() else frame_mod.page_key(None, int(p))
                for r, p in zip(crafted, pids, strict=True)]
        assert got == want
    finally:
        m.shutdown()


def test_tree_key_rows_survive_growth_and_are_zero_for_partial_blocks_and_no_node():
    from kvcm_core.radix import NO_NODE, PrefixTree

    tree = PrefixTree(1, 2, capacity=16)
    root = tree.root(b"r" * 32)  # before keep_key_rows: copied in
    tree.keep_key_rows()
    keys = [bytes([i]) * 32 for i in range(1, 41)]
    nids = tree.add_chain(root, keys, np.ones((40, 2), dtype=np.int32), 0)  # grows
    part = tree.add_partial(int(nids[-1]), [5])
    one = tree.add_one(int(nids[-1]), b"z" * 32, np.ones(2, dtype=np.int32), 40)
    assert tree.capacity > 16
    got = tree.key_rows_of(np.array([root, *nids.tolist(), part, one, NO_NODE]))
    want = [b"r" * 32, *keys, bytes(32), b"z" * 32, bytes(32)]
    assert [bytes(r) for r in got] == want


@pytest.mark.parametrize("n", [2, 3, 10, 64])
def test_move_slots_of_one_batch_pair_ascending_sources_with_ascending_slots(n):
    from kvcm_core.levels import _in_runs
    from kvcm_core.migration import order_in_batches, sort_in_batches

    rng = np.random.default_rng(n)
    for per in (n, n + 5, max(1, n // 3)):
        old = rng.permutation(500)[:n].astype(np.int32)
        slots = rng.permutation(300)[:n].astype(np.int64)
        want = np.empty_like(slots)
        want[order_in_batches(old, per)] = sort_in_batches(slots, per)
        assert _in_runs(slots.copy(), old, per).tolist() == want.tolist()


@pytest.mark.parametrize("n", [1, 3])
def test_settling_locked_pages_without_the_queue_rules_leaves_what_the_rules_leave(n):
    out = []
    for locked in (False, True):
        src = _store()
        dst = Store(1, 2, 0, [_Pool()], type(src.held), False, src.arena)
        pids = src.take(0, n + 2)
        a = src.arena
        a.node[pids] = np.arange(n + 2) + 3
        a.holds[pids] = 1  # held, then locked by the move (a resume's onboard)
        src.vacate(pids[:n], queued=False)
        slots = dst.reserve_slots(n)
        a.locks[pids[:n]] += 1
        dst.settle(pids[:n], slots, locked=locked)
        out.append((len(dst.held), len(dst.droppable), a.store[pids].tolist(),
                    a.slot[pids].tolist(), [dst.page_at(s) for s in range(8)]))
    assert out[0] == out[1]
    assert out[0][0] == out[0][1] == 0


class _RunsPlugin:
    """The numpy backend declaring that its copies cost per run (as a device's do)."""

    @kvcm_core.hookimpl
    def kvcm_kernel_backends(self):
        caps = attrs.evolve(kvcm_kernels_numpy.CAPABILITIES, run_copies=True)

        class RunsBackend(kvcm_kernels_numpy.NumpyBackend):
            name = "numpy-runs"
            capabilities = caps

        yield kvcm_core.KernelBackendSpec(name="numpy-runs", factory=RunsBackend,
                                          description="numpy, run_copies (tests)",
                                          capabilities=caps, priority=-10)


@pytest.mark.parametrize("runs", [False, True], ids=["numpy", "run_copies"])
def test_moves_pair_slots_into_runs_only_for_backends_whose_copies_cost_per_run(
        runs, tmp_path, cleanup, monkeypatch):
    """Moves between levels (to the host level and back, through the disk level) pair
    their slots into runs where the backend says a copy costs per run, and skip that
    sorting on the numpy backend, whose copy is one gather in any order; every byte
    read back is right either way."""
    import kvcm_core.levels as levels_mod

    pm = KvcmPluginManager()
    pm.register(_RunsPlugin(), name="numpy-runs")
    monkeypatch.setenv("KVCM_TEST_BACKEND", "numpy-runs" if runs else "numpy")
    calls: list[int] = []
    real = levels_mod._in_runs
    monkeypatch.setattr(levels_mod, "_in_runs", lambda *a: calls.append(1) or real(*a))
    m = make_manager([("gpu", 8), ("host", 6), ("disk", 20)], tmp_path, pm=pm)
    cleanup(m)
    assert m.storage_levels.mover.backend.capabilities.run_copies is runs
    d = Driver(m)
    caches = [d.write(tokens(24, 200 + i)) for i in range(4)]  # the first ones move down
    assert max(max(page_levels(c)) for c in caches) == 2
    d.resume_and_verify(*caches)  # back to the GPU, every byte checked
    assert bool(calls) is runs
