"""Storage faults on cold levels (quality.md §3 "Faults", scenarios.md "Faults").

The disk level is the disk tier wrapped in :class:`~kvcm_core.testing.faults.FaultyTier`
(registered by hand on a fresh plugin manager). kvcm must never serve wrong KV: a block
whose cold copy cannot be written or read is dropped from the prefix tree (and recomputed
by whoever needs it), no slot leaks, other requests carry on, and the error type says what
happened. Every byte is checked through the fingerprint engine.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from kvcm_tier_disk import HEADER_BYTES
from levels_helpers import (
    Driver,
    assert_all_free,
    assert_invariants,
    cache_pages,
    chain,
    close_all,
    faulty_disk,
    faulty_tier,
    level_counts,
    make_manager,
    node_pages,
    page_level,
    page_levels,
    quota,
    snapshot,
    tokens,
)

from kvcm_core import CorruptPageError, InvalidStateError, OutOfPagesError, TierIOError
from kvcm_core.testing.faults import FaultPlan
from kvcm_core.testing.fingerprint import FingerprintMismatch

# Writes of droppable victims go to a background queue by default, where a failure is met
# later, at a read (tests/test_io_deadline.py covers that): these tests check what a
# failed synchronous write does.
SYNC_WRITES = {"write_queue_depth": 0}


@pytest.fixture
def faulty(tmp_path):
    """Builds managers whose last level is a faulty disk; returns (manager, plan, tier).
    At the end: close what is open, clear the tree, and every slot of every level is free
    (no leak, whatever failed)."""
    made = []

    def build(tiers=(("gpu", 8), ("host", 8), ("faulty-disk", 40)), **kw):
        plan = FaultPlan()
        m = make_manager(list(tiers), tmp_path / f"m{len(made)}", pm=faulty_disk(plan), **kw)
        made.append(m)
        level = next(i for i, (t, _) in enumerate(tiers) if t == "faulty-disk")
        return m, plan, faulty_tier(m, level)

    yield build
    for m in made:
        if m.is_shut_down:
            continue
        close_all(m)
        assert_all_free(m)
        m.shutdown()


def _push_to_disk(d):
    """A (7 blocks) suspended and pushed to disk by B and C (8 blocks each, suspended)."""
    a = d.write(tokens(30, 11), end=25)
    b = d.write(tokens(32, 12), chunk=32)
    c = d.write(tokens(32, 13), chunk=32)
    assert set(page_levels(a)) == {2}
    assert set(page_levels(b)) == {1}
    assert set(page_levels(c)) == {0}
    return a, b, c


# -- writes --------------------------------------------------------------------------------------


def test_failed_disk_write_drops_the_droppable_blocks_and_leaks_nothing(faulty):
    m, plan, tier = faulty([("gpu", 8), ("host", 4), ("faulty-disk", 16)], disk=SYNC_WRITES)
    d = Driver(m)
    s = d.write(tokens(16, 1))                  # held, stays on the GPU (droppable go first)
    r = [tokens(16, 100 + i) for i in range(3)]
    d.write(r[0], chunk=16, suspend=False).close()        # R0 on the GPU
    d.write(r[1], chunk=16, suspend=False).close()        # R0 -> host
    assert {page_level(m, p) for n in chain(m, r[0]) for p in node_pages(m, n)
            if p >= 0} == {1}
    plan.fail_writes = {tier.writes + 1}
    m.get_and_reset_iteration_stats()
    # R1 -> host, R0 -> disk in one batch: that write fails.
    d.write(r[2], chunk=16, suspend=False).close()
    assert len(tier.injected) == 1 and "failed" in tier.injected[0]
    st = m.get_and_reset_iteration_stats()
    assert st.io_failures == 1
    assert st.groups[0].dropped_blocks == 4
    assert_invariants(m)
    # R0's blocks are gone from the tree; the others are still reusable.
    assert m.probe_reuse(None, r[0]) == 0
    assert chain(m, r[0]) == []
    assert m.probe_reuse(None, r[1]) == 16 and m.probe_reuse(None, r[2]) == 16
    # Nothing of R0 stayed on the disk: the poisoned slots were given back.
    disk = m.get_storage_statistics(2)
    assert disk.free == disk.total
    # Other requests are unaffected; R0 is recomputed and R1 reused from the host.
    assert set(page_levels(s)) == {0}
    d.resume_and_verify(s)
    d.write(r[0] + tokens(5, 7), suspend=False).close()
    q = d.create(r[1] + tokens(5, 8))
    assert q.history_length == 16
    d.run_to(q)
    q.close()


def test_failed_write_of_part_of_a_chain_keeps_only_the_prefix_that_arrived(faulty):
    """R0's blocks leave the host two at a time; the first batch's write fails: those
    blocks are dropped (with everything below them), what was written later is reused."""
    m, plan, tier = faulty([("gpu", 4), ("host", 4), ("faulty-disk", 16)], disk=SYNC_WRITES)
    d = Driver(m)
    r = [tokens(16, 100 + i) for i in range(3)]
    d.write(r[0], chunk=16, suspend=False).close()
    d.write(r[1], chunk=16, suspend=False).close()   # R0 -> host
    plan.fail_writes = {tier.writes + 1}
    d.write(r[2], chunk=5, suspend=False).close()    # R0 -> disk in small batches
    assert len(tier.injected) == 1
    assert_invariants(m)
    assert m.probe_reuse(None, r[0]) < 16
    left = m.probe_reuse(None, r[0][:15])
    assert len(chain(m, r[0])) >= left // 4
    q = d.create(r[0])
    assert q.history_length == left
    d.run_to(q)
    q.close()


def test_failed_host_to_disk_write_of_cold_droppable_blocks_never_serves_poison(faulty):
    """Every disk write fails: closed blocks pushed off the host are dropped, reuse only
    ever comes from levels that hold good data."""
    m, plan, _tier = faulty([("gpu", 4), ("host", 4), ("faulty-disk", 16)], disk=SYNC_WRITES)
    d = Driver(m)
    plan.fail_all_writes = True
    reqs = [tokens(12, 200 + i) for i in range(6)]
    for t in reqs:
        d.write(t, chunk=12, suspend=False).close()
        assert_invariants(m)
    assert m.get_storage_statistics(2).free == m.get_storage_statistics(2).total
    assert m.get_and_reset_iteration_stats().io_failures > 0
    plan.fail_all_writes = False
    for t in reqs:
        want = m.probe_reuse(None, [*t, 1])
        c = d.create([*t, 1, 2, 3], match_len=13)
        assert c.history_length == want
        d.run_to(c)
        c.close()


def test_failed_write_of_held_pages_during_resume_returns_false_and_changes_nothing(
        faulty):
    m, plan, _tier = faulty([("gpu", 8), ("host", 8), ("faulty-disk", 24)])
    d = Driver(m)
    x = d.write(tokens(32, 1), chunk=32)
    y = d.write(tokens(32, 2), chunk=32)
    a = d.write(tokens(24, 3), chunk=24)
    b = d.write(tokens(24, 4), chunk=24)
    assert level_counts(a, 3) == [2, 4, 0]  # some pages warm, some on the host
    plan.fail_all_writes = True
    before = snapshot(m, x, y, a, b)
    try:
        ok = a.resume()
    except TierIOError:
        ok = False
    assert ok is False
    assert snapshot(m, x, y, a, b) == before
    plan.fail_all_writes = False
    d.resume_and_verify(a, b, x, y)


def test_failed_write_of_held_pages_during_cache_resize_returns_false(faulty):
    m, plan, _tier = faulty([("gpu", 8), ("host", 8), ("faulty-disk", 16)])
    d = Driver(m)
    a = d.write(tokens(32, 1), chunk=32)
    b = d.write(tokens(32, 2), chunk=32)        # A -> host (full)
    assert set(page_levels(a)) == {1}
    plan.fail_all_writes = True
    c = d.create(tokens(32, 3))
    assert c.resume()
    before = snapshot(m, a, b, c)
    try:
        ok = c.resize(32)   # B -> host needs A -> disk: the write fails
    except TierIOError:
        ok = False
    assert ok is False
    assert snapshot(m, a, b, c) == before


@pytest.mark.parametrize("level", [0, 1])
def test_failed_write_of_held_pages_during_manager_resize_returns_false(faulty, level):
    m, plan, _tier = faulty([("gpu", 8), ("host", 8), ("faulty-disk", 16)])
    d = Driver(m)
    a = d.write(tokens(32, 1), chunk=32)
    b = d.write(tokens(32, 2), chunk=32)        # A on the host, B on the GPU
    plan.fail_all_writes = True
    before = snapshot(m, a, b)
    try:
        ok = m.resize(level, quota("full", level, 2))
    except TierIOError:
        ok = False
    assert ok is False
    assert snapshot(m, a, b) == before


def test_failed_write_of_held_pages_leaves_every_page_where_it_was(faulty):
    """Whatever the error, a failed write of held pages loses nothing: every page keeps
    its data (the fingerprints verify once the disk works again) and no slot leaks."""
    m, plan, _tier = faulty([("gpu", 8), ("host", 8), ("faulty-disk", 16)])
    d = Driver(m)
    a = d.write(tokens(32, 1), chunk=32)
    b = d.write(tokens(32, 2), chunk=32)
    plan.fail_all_writes = True
    c = d.create(tokens(32, 3))
    assert c.resume()
    with pytest.raises((TierIOError, OutOfPagesError)):
        if not c.resize(32):
            raise OutOfPagesError("returned False")
    assert_invariants(m)
    assert set(page_levels(a)) == {1} and set(page_levels(b)) == {0}
    assert c.history_length == 0
    plan.fail_all_writes = False
    assert d.step(c, 32)
    c.suspend()
    d.resume_and_verify(a, b, c)


# -- reads -----------------------------------------------------------------------------------------


def test_failed_disk_read_during_resume_loses_the_cache_and_leaks_nothing(faulty):
    m, plan, tier = faulty()
    d = Driver(m)
    a, b, c = _push_to_disk(d)
    a_toks = d.toks[id(a)]
    assert m.probe_reuse(None, a_toks[:25]) == 24
    plan.fail_reads = {tier.reads + 1}
    with pytest.raises(TierIOError):
        a.resume()
    assert len(tier.injected) == 1
    assert_invariants(m)
    # The lost blocks are gone from the tree and their disk slots are free again.
    assert m.probe_reuse(None, a_toks[:25]) == 0
    assert all(page_level(m, p) < 0 for p in cache_pages(a))
    assert not any(page_level(m, p) >= 0 for lv in m.stores[2] for p in lv.pages()
                   if p in cache_pages(a))
    # The cache refuses to resume again and closes cleanly.
    with pytest.raises(TierIOError):
        a.resume()
    assert a.status.name == "SUSPENDED"
    with pytest.raises(InvalidStateError):
        a.resize(30)
    a.close()
    a.close()
    assert_invariants(m)
    # Other requests carry on, bit-exact.
    d.resume_and_verify(b, c)
    # The request is recomputed from scratch.
    again = d.create(a_toks)
    assert again.history_length == 0
    d.run_to(again)
    again.close()


def test_failed_disk_read_while_reusing_closed_blocks(faulty):
    m, plan, tier = faulty()
    d = Driver(m)
    p_toks = tokens(22, 1)                      # 5 full blocks + a partial one
    d.write(p_toks, suspend=False).close()
    other = d.write(tokens(32, 2), chunk=32)    # P -> host
    filler = d.write(tokens(32, 3), chunk=32)   # other -> host, P -> disk
    q_toks = p_toks + tokens(10, 4)
    assert m.probe_reuse(None, q_toks[:31]) == 22
    q = d.create(q_toks)
    assert q.history_length == 22
    assert set(page_levels(q)) == {2}           # claims on disk pages
    plan.fail_reads = {tier.reads + 1}
    with pytest.raises(TierIOError):
        q.resume()
    assert_invariants(m)
    with pytest.raises(TierIOError):
        q.resume()
    q.close()
    assert_invariants(m)
    # No wrong KV later: what is left of P in the tree is reused and verifies.
    left = m.probe_reuse(None, q_toks[:31])
    assert left < 22
    r = d.create(q_toks)
    assert r.history_length == left
    d.run_to(r)
    r.close()
    d.resume_and_verify(other, filler)


def test_failed_read_of_a_partial_block_claim_is_a_tier_error(faulty):
    """Only the partial block is on disk; its copy (made at first resume) fails."""
    m, plan, _tier = faulty([("gpu", 8), ("faulty-disk", 40)])
    d = Driver(m)
    p_toks = tokens(6, 1)                       # 1 full block + 2 tokens
    d.write(p_toks, suspend=False).close()
    d.write(tokens(32, 2), chunk=32)            # P -> disk
    q_toks = p_toks + tokens(6, 3)
    q = d.create(q_toks)
    assert q.history_length == 6
    plan.fail_all_reads = True
    with pytest.raises(TierIOError):
        q.resume()
    assert_invariants(m)
    with pytest.raises(TierIOError):
        q.resume()
    q.close()
    plan.fail_all_reads = False
    left = m.probe_reuse(None, q_toks[:11])
    r = d.create(q_toks)
    assert r.history_length == left < 6
    d.run_to(r)
    r.close()


def test_failed_disk_read_during_prefetch_keeps_the_pages_on_disk(faulty):
    m, plan, _tier = faulty()
    d = Driver(m)
    a, b, c = _push_to_disk(d)
    assert m.resize(1, 40 * 1024)
    plan.fail_all_reads = True
    before_levels = page_levels(a)
    try:
        a.prefetch(1)
    except TierIOError:
        pass
    assert_invariants(m)
    plan.fail_all_reads = False
    if all(page_level(m, p) >= 0 for p in cache_pages(a)):
        assert page_levels(a) == before_levels
        d.resume_and_verify(a, b, c)
    else:  # the pages were declared lost: the cache refuses to resume
        with pytest.raises(TierIOError):
            a.resume()
        d.resume_and_verify(b, c)


# -- the oracle catches wrong data on every level --------------------------------------------


def _flip(m, page):
    """Invert one byte of a device-accessible (GPU or host) page through the backend."""
    pool = m.storage_levels.store_of(page).pools[0]
    start = pool.region.page_start(int(m.storage_levels.arena.slot[page]))
    byte = m.backend.read(pool.buffer, start, 1)
    m.backend.write(pool.buffer, start, np.asarray(byte) ^ 0xFF)


def test_fingerprint_engine_catches_a_corrupted_host_page(faulty):
    m, _plan, _tier = faulty([("gpu", 8), ("host", 24), ("faulty-disk", 40)])
    d = Driver(m)
    a = d.write(tokens(22, 1))
    b = d.write(tokens(22, 2))
    d.write(tokens(32, 3), chunk=32)            # A and B -> host
    assert set(page_levels(a)) == {1} and set(page_levels(b)) == {1}
    _flip(m, cache_pages(a)[3])
    assert a.resume()
    with pytest.raises(FingerprintMismatch):
        d.check(a)
    a.close()
    d.resume_and_verify(b)   # the control: an untouched page on the same level is fine


def test_truncated_disk_file_re_extended_by_later_writes_is_detected_not_served(faulty):
    """Issue 13, defect 2: a disk-tier file truncated under kvcm, then re-extended by
    later writes, read back zeros for the lost slots with no error. Every read of a cold
    slot is now checked against what was written: resume raises CorruptPageError for the
    first lost block, the loss is counted, and the prompt is recomputed (checked)."""
    m, _plan, _tier = faulty()
    d = Driver(m)
    a, b, c = _push_to_disk(d)
    disk_pool = m.storage_levels.store_of(cache_pages(a)[0]).pools[0].inner
    os.truncate(disk_pool.path, HEADER_BYTES)
    e = d.write(tokens(32, 14), chunk=32)       # pushes B to disk: past the end, so the
    assert set(page_levels(b)) == {2}           # file grows again with a hole of zeros
    assert os.path.getsize(disk_pool.path) > HEADER_BYTES
    m.get_and_reset_iteration_stats()
    with pytest.raises(CorruptPageError) as err:
        a.resume()
    assert err.value.block == 0
    assert m.get_and_reset_iteration_stats().corrupt_pages >= 1
    assert a.status.name == "SUSPENDED"
    a.close()
    d.resume_and_verify(b, c, e)
    again = d.create(tokens(30, 11))
    assert again.history_length == 0            # nothing of A is reused
    d.run_to(again)


def test_corrupted_disk_page_makes_resume_raise_naming_the_block_and_is_recomputed(faulty):
    """A byte flipped in a disk page: resume raises CorruptPageError naming the block, the
    cache stays SUSPENDED and can be closed, the statistics count it, other requests carry
    on, and the same prompt again reuses only the blocks before it (fingerprint-checked)."""
    m, _plan, tier = faulty()
    d = Driver(m)
    a, b, c = _push_to_disk(d)
    page = cache_pages(a)[2]
    m.get_and_reset_iteration_stats()
    tier.corrupt(m.storage_levels.store_of(page).pools[0],
                 int(m.storage_levels.arena.slot[page]))
    with pytest.raises(CorruptPageError) as err:
        a.resume()
    assert err.value.block == 2
    assert "block 2" in str(err.value)
    assert a.status.name == "SUSPENDED"
    assert m.get_and_reset_iteration_stats().corrupt_pages == 1
    a.close()
    assert_invariants(m)
    d.resume_and_verify(b, c)
    again = d.create(tokens(30, 11))
    assert again.history_length == 2 * 4  # blocks 0 and 1 only
    d.run_to(again)  # recomputes from block 2 on, every byte checked




@pytest.mark.parametrize("disk", [
    None, {"mode": "blob"}, {"mode": "blob", "blob_codec": "zstd"}],
    ids=["slot", "blob", "blob-zstd"])
@pytest.mark.parametrize("offset", [0, 30, 100, -1], ids=["magic", "key", "payload", "crc"])
def test_silently_corrupted_disk_writes_are_caught_whatever_byte_they_hit(faulty, disk, offset):
    """Every disk write stores one inverted byte and reports success: kvcm never serves
    those pages, counts them, and the request is recomputed (fingerprint-checked)."""
    if disk and "blob_codec" in disk:
        pytest.importorskip("zstandard")
    m, plan, _tier = faulty(disk=disk)
    plan.corrupt_offset = offset
    plan.corrupt_writes = set(range(1, 1000))
    d = Driver(m)
    a, b, c = _push_to_disk(d)
    plan.corrupt_writes = set()  # what travels through the disk from now on is intact
    m.get_and_reset_iteration_stats()
    with pytest.raises(CorruptPageError) as err:
        a.resume()
    assert err.value.block == 0
    assert m.get_and_reset_iteration_stats().corrupt_pages == len(cache_pages(a))
    a.close()
    d.resume_and_verify(b, c)
    again = d.create(tokens(30, 11))
    assert again.history_length == 0
    d.run_to(again)


def _behind_pool(tmp_path, plan):  # type: ignore[no-untyped-def]
    from kvcm_tier_disk import aio

    from kvcm_core.plugins import KvcmPluginManager
    from kvcm_core.testing.faults import FaultyTier

    if not aio.native_available():
        pytest.skip("no native background writes on this platform")
    disk = KvcmPluginManager().tier("disk")
    tier = FaultyTier(disk.factory(None, {"path": str(tmp_path)}), plan)
    return tier, tier.create_pool(64, 8)


def _finish(handle):  # type: ignore[no-untyped-def]
    import time

    end = time.monotonic() + 10
    while not handle.done():
        assert time.monotonic() < end, "background write never finished"
        time.sleep(0.001)
    return handle.error()


def test_the_faulty_tier_passes_the_disk_tiers_write_behind_and_read_nowait_through(tmp_path):
    """A storage level uses a pool's own background writes and memory reads when it has
    them; the wrapper must keep them (it hid them: the soak never ran those paths)."""
    from kvcm_core.tier import StoragePool

    tier, pool = _behind_pool(tmp_path, FaultPlan())
    assert type(pool).write_behind is not StoragePool.write_behind
    assert type(pool).read_nowait is not StoragePool.read_nowait
    rows = np.arange(2 * 64, dtype=np.uint8).reshape(2, 64)
    handle = pool.write_behind(np.array([3, 4]), rows)
    assert handle is not None and _finish(handle) is None
    out = np.zeros_like(rows)
    if pool.read_nowait(np.array([3, 4]), out):  # (page cache: nearly always)
        assert (out == rows).all() and tier.reads == 1
    assert tier.writes == 1
    tier.close()


def test_faults_are_injected_on_write_behind_and_read_nowait_declines_a_planned_fault(
        tmp_path):
    """A planned failed write fails on write_behind too (poison stored, error() says so,
    the slots marked); a corrupting one stores the inverted byte; a slow write, and a read
    planned to fail or be slow, decline (None / False) without spending an ordinal, so the
    fault happens on write / read."""
    from kvcm_core.testing.faults import POISON

    plan = FaultPlan(fail_writes={1}, corrupt_writes={2}, slow_writes={3}, fail_reads={1})
    tier, pool = _behind_pool(tmp_path, plan)
    rows = np.full((1, 64), 5, dtype=np.uint8)
    error = _finish(pool.write_behind(np.array([0]), rows))
    assert error is not None and "injected fault: write 1" in error
    assert tier.damage(pool, 0) == "failed write"
    assert _finish(pool.write_behind(np.array([1]), rows)) is None
    assert tier.damage(pool, 1) == "corrupt"
    assert pool.write_behind(np.array([2]), rows) is None and tier.writes == 2
    out = np.zeros((2, 64), dtype=np.uint8)
    assert not pool.read_nowait(np.array([0, 1]), out) and tier.reads == 0
    plan.fail_reads = set()
    plan.slow_writes = set()
    got = np.zeros((2, 64), dtype=np.uint8)
    pool.read(np.array([0, 1]), got).wait()
    assert (got[0] == POISON).all()
    assert got[1, 0] == 5 ^ 0xFF and (got[1, 1:] == 5).all()
    tier.close()


def test_the_soak_with_a_write_queue_runs_the_disk_tiers_native_io_paths(monkeypatch):
    """kvcm soak --write-queue-depth N: background writes on the disk tier's own threads
    and reads from memory on the scheduler's thread, as with the bare disk tier."""
    from kvcm_tier_disk import aio

    from kvcm_core import KVCacheManager
    from kvcm_core.soak import SoakConfig, run_soak

    if not aio.native_available():
        pytest.skip("no native background writes on this platform")
    seen: dict[str, int] = {}
    shutdown = KVCacheManager.shutdown

    def record(self, *a, **k):  # type: ignore[no-untyped-def]
        seen.update(self.storage_levels.io[2].stats.as_dict())
        return shutdown(self, *a, **k)

    monkeypatch.setattr(KVCacheManager, "shutdown", record)
    result = run_soak(SoakConfig(steps=1500, seed=3, write_queue_depth=4))
    assert result.ok, result.failure
    assert seen["direct_writes"] > 0 and seen["direct_reads"] > 0, seen
