"""Storage I/O that cannot stall everyone (issue 13): one I/O thread per storage level,
``LevelConfig.io_deadline_s``, background writes, shutdown within one deadline.

The disk level is the disk tier wrapped in :class:`~kvcm_core.testing.faults.FaultyTier`;
its ``slow`` knob makes an operation sleep past the deadline, as a frozen file system
would. Every byte is checked through the fingerprint engine: a missed deadline may lose a
block (recomputed), never serve a wrong one.
"""

from __future__ import annotations

import os
import threading
import time

import attrs
import numpy as np
import pytest
from levels_helpers import (
    LAYOUTS,
    TPB,
    Driver,
    assert_all_free,
    assert_invariants,
    cache_pages,
    chain,
    close_all,
    faulty_disk,
    faulty_tier,
    make_levels,
    node_pages,
    page_level,
    page_levels,
    tokens,
)

from kvcm_core import ConfigError, InvalidStateError, KVCacheManager, TierIOError
from kvcm_core.config import DEFAULT_WRITE_QUEUE_DEPTH, KVCacheManagerConfig, LevelConfig
from kvcm_core.level_io import DeadlinePool, IODeadlineError, LevelIO
from kvcm_core.testing.engine import EngineLoop, Request
from kvcm_core.testing.faults import FaultPlan

DEADLINE = 0.1  # seconds; a slow operation sleeps SLOW
SLOW = 0.6


def _manager(tmp_path, plan, tiers=(("gpu", 8), ("host", 8), ("faulty-disk", 40)), *,
             deadline=DEADLINE, depth=0, combine=0, native=True):
    # combine: write_combine_bytes (0 here, so the queue's own behaviour is what a test
    # sees, unless it asks for held writes). native False: the disk tier's own background
    # writes off (FaultyTier passes them through), so the level's thread runs every write.
    levels = make_levels("full", list(tiers), tmp_path)
    levels = [attrs.evolve(lc, io_deadline_s=deadline, write_queue_depth=depth,
                           write_combine_bytes=combine,
                           options=lc.options if native else {**lc.options,
                                                              "native_writes": False})
              if "disk" in lc.tier else lc for lc in levels]
    cfg = KVCacheManagerConfig(tokens_per_block=TPB, layers=LAYOUTS["full"](), levels=levels,
                               kernel_backend=os.environ.get("KVCM_TEST_BACKEND", "numpy"),
                               max_util_for_resume=1.0)
    return KVCacheManager(cfg, plugin_manager=faulty_disk(plan))


@pytest.fixture
def build(tmp_path):
    """Managers with a faulty disk as level 2 (``(manager, plan, tier)``); at the end every
    slow operation has returned, nothing is open, and every slot is free."""
    made = []

    def make(*args, **kw):
        plan = FaultPlan(slow_s=SLOW)
        m = _manager(tmp_path / f"m{len(made)}", plan, *args, **kw)
        made.append((m, plan))
        return m, plan, faulty_tier(m, 2)

    yield make
    for m, plan in made:
        plan.slow_all = False
        plan.slow_reads.clear()
        plan.slow_writes.clear()
        if m.is_shut_down:
            continue
        io = m.storage_levels.io[2]
        assert io is None or io.wait_idle(SLOW * 4)
        close_all(m)
        assert_all_free(m)
        m.shutdown()


def _push_to_disk(d):
    """A (7 blocks) suspended and pushed to disk by B and C (8 blocks each, suspended)."""
    a = d.write(tokens(30, 11), end=25)
    b = d.write(tokens(32, 12), chunk=32)
    c = d.write(tokens(32, 13), chunk=32)
    assert set(page_levels(a)) == {2} and set(page_levels(b)) == {1}
    return a, b, c


def page_levels_of(m, toks):
    """Levels of the pages of the blocks of ``toks`` in the tree."""
    return {page_level(m, p) for n in chain(m, toks) for p in node_pages(m, n) if p >= 0}


def _timed(fn, *args):
    t0 = time.monotonic()
    out = fn(*args)
    return out, time.monotonic() - t0


# -- configuration ---------------------------------------------------------------------------


def test_the_io_deadline_defaults_to_five_seconds_with_background_writes_on():
    lc = LevelConfig(tier="disk", quota=1 << 20)
    assert lc.io_deadline_s == 5.0 and lc.write_queue_depth is None
    assert lc.background_write_depth == DEFAULT_WRITE_QUEUE_DEPTH > 0
    inline = LevelConfig(tier="disk", quota=1 << 20, io_deadline_s=None)
    assert inline.background_write_depth == 0  # no thread, so nothing in the background
    assert LevelConfig(tier="disk", quota=1 << 20, write_queue_depth=0
                       ).background_write_depth == 0


def test_a_level_built_from_defaults_writes_in_the_background(build, tmp_path):
    m = _manager(tmp_path / "defaults", FaultPlan(), deadline=5.0, depth=None)
    try:
        io = m.storage_levels.io[2]
        assert io is not None and io.write_queue_depth == DEFAULT_WRITE_QUEUE_DEPTH
    finally:
        m.shutdown()


@pytest.mark.parametrize(("kw", "field"), [
    ({"io_deadline_s": 0}, "LevelConfig.io_deadline_s"),
    ({"io_deadline_s": -1.0}, "LevelConfig.io_deadline_s"),
    ({"io_deadline_s": "5"}, "LevelConfig.io_deadline_s"),
    ({"io_deadline_s": True}, "LevelConfig.io_deadline_s"),
    ({"write_queue_depth": -1}, "LevelConfig.write_queue_depth"),
    ({"write_queue_depth": 1.5}, "LevelConfig.write_queue_depth"),
    ({"io_deadline_s": None, "write_queue_depth": 2}, "LevelConfig.write_queue_depth"),
])
def test_bad_io_deadline_or_queue_depth_is_refused_naming_the_field(kw, field):
    with pytest.raises(ConfigError) as info:
        LevelConfig(tier="disk", quota=1 << 20, **kw)
    assert info.value.field == field


def test_only_storage_levels_get_an_io_thread_and_none_turns_it_off(build, tmp_path):
    m, _, _ = build()
    L = m.storage_levels
    assert L.io[0] is None and L.io[1] is None  # GPU and pinned host: no I/O to bound
    assert L.io[2] is not None and L.io[2].deadline_s == DEADLINE
    assert all(isinstance(s.pools[0], DeadlinePool) for s in L.stores[2])
    off = _manager(tmp_path / "off", FaultPlan(), deadline=None)
    try:
        assert off.storage_levels.io[2] is None
        assert not isinstance(off.storage_levels.stores[2][0].pools[0], DeadlinePool)
    finally:
        off.shutdown()


# -- writes ----------------------------------------------------------------------------------


def test_a_write_past_its_deadline_drops_the_blocks_instead_of_offloading_them(build):
    m, plan, tier = build([("gpu", 8), ("host", 4), ("faulty-disk", 16)])
    d = Driver(m)
    s, r = _cascade(m, d, n=3, seed=100)                   # held S on the GPU, R0 on the host
    plan.slow_writes = {tier.writes + 1}
    m.get_and_reset_iteration_stats()
    # R1 -> host, R0 -> disk in one batch: that write sleeps past the deadline.
    _, took = _timed(lambda: d.write(r[2], chunk=16, suspend=False).close())
    assert took < SLOW - 0.1, "the step waited for the slow write"
    io = m.storage_levels.io[2]
    assert io.stats.write_misses == 1, (tier.injected, io.stats.as_dict())
    assert len(tier.injected) == 1 and " slow " in tier.injected[0]
    st = m.get_and_reset_iteration_stats()
    assert st.io_failures == 1 and st.groups[0].dropped_blocks == 4
    assert_invariants(m)
    # R0 is simply not cached; the rest is, and the disk holds nothing.
    assert m.probe_reuse(None, r[0]) == 0
    assert m.probe_reuse(None, r[1]) == 16 and m.probe_reuse(None, r[2]) == 16
    assert io.wait_idle(SLOW * 4)                          # the late write lands...
    disk = m.get_storage_statistics(2)
    assert disk.free == disk.total                         # ...in slots nobody owns
    again = d.create(r[0] + tokens(5, 7))
    assert again.history_length == 0
    d.run_to(again)
    again.close()
    q = d.create(r[1] + tokens(5, 8))
    assert q.history_length == 16
    d.run_to(q)
    q.close()
    d.resume_and_verify(s)


def test_while_a_level_is_stuck_its_io_fails_at_once_and_it_recovers_by_itself(build):
    m, plan, tier = build()
    d = Driver(m)
    a, b, c = _push_to_disk(d)
    io = m.storage_levels.io[2]
    plan.slow_reads = {tier.reads + 1}
    t0 = time.monotonic()
    with pytest.raises(TierIOError, match=r"missed its 0\.1 s I/O deadline"):
        a.resume()
    assert time.monotonic() - t0 < SLOW - 0.1
    assert io.stuck() is not None
    # B is on the host; making room for it pushes C to the disk: refused at once.
    _, took = _timed(b.resume)
    assert took < DEADLINE / 2
    assert io.stats.fast_fails >= 1
    b.suspend()
    assert io.wait_idle(SLOW * 4) and io.stuck() is None
    reads = tier.reads
    d.resume_and_verify(b, c)                              # the level works again
    assert tier.reads > reads
    a.close()


# -- reads -----------------------------------------------------------------------------------


def test_a_read_past_its_deadline_loses_the_blocks_and_resume_raises(build):
    m, plan, tier = build()
    d = Driver(m)
    a, b, c = _push_to_disk(d)
    a_toks = d.toks[id(a)]
    assert m.probe_reuse(None, a_toks[:25]) == 24
    plan.slow_reads = {tier.reads + 1}
    with pytest.raises(TierIOError, match=r"missed its 0\.1 s I/O deadline") as info:
        a.resume()
    assert isinstance(info.value.__cause__, IODeadlineError)
    assert m.storage_levels.io[2].stats.read_misses == 1
    assert_invariants(m)
    # Lost: out of the tree, no slot; the cache stays SUSPENDED and can be closed.
    assert m.probe_reuse(None, a_toks[:25]) == 0
    assert all(page_level(m, p) < 0 for p in cache_pages(a))
    with pytest.raises(TierIOError):
        a.resume()
    assert a.status.name == "SUSPENDED"
    with pytest.raises(InvalidStateError):
        a.resize(30)
    a.close()
    assert m.storage_levels.io[2].wait_idle(SLOW * 4)
    d.resume_and_verify(b, c)
    again = d.create(a_toks)
    assert again.history_length == 0
    d.run_to(again)
    again.close()


def test_a_reusable_block_whose_read_misses_the_deadline_leaves_the_tree(build):
    m, plan, tier = build()
    d = Driver(m)
    p_toks = tokens(22, 1)
    d.write(p_toks, suspend=False).close()
    other = d.write(tokens(32, 2), chunk=32)
    filler = d.write(tokens(32, 3), chunk=32)              # P -> disk
    q_toks = p_toks + tokens(10, 4)
    q = d.create(q_toks)
    assert q.history_length == 22 and set(page_levels(q)) == {2}
    plan.slow_reads = {tier.reads + 1}
    with pytest.raises(TierIOError):
        q.resume()
    q.close()
    assert_invariants(m)
    assert m.storage_levels.io[2].wait_idle(SLOW * 4)
    left = m.probe_reuse(None, q_toks[:31])
    assert left < 22                                       # recomputed, never served
    r = d.create(q_toks)
    assert r.history_length == left
    d.run_to(r)
    r.close()
    d.resume_and_verify(other, filler)


# -- nobody else waits ---------------------------------------------------------------------


def test_a_frozen_cold_tier_does_not_stall_requests_that_live_on_the_gpu(build):
    """Every disk operation sleeps SLOW (a frozen file system) while an engine loop keeps
    stepping a mix of requests: no step waits much more than one deadline, the frozen
    level costs at most one deadline per SLOW seconds, and every byte verifies."""
    m, plan, tier = build([("gpu", 12), ("host", 4), ("faulty-disk", 40)])
    loop = EngineLoop(m, chunk_tokens=8, max_batch=4, preempt_mode="suspend",
                      recompute_lost=True)
    rid = 0

    def submit(n):
        nonlocal rid
        for _ in range(n):
            rid += 1
            prompt = tokens(12 + rid % 20, rid)
            loop.submit(Request(rid, prompt + tokens(6, 1000 + rid), prompt_len=len(prompt)))

    submit(6)
    for _ in range(20):                                    # warm: pages reach the disk
        loop.step()
        submit(1)
    assert m.get_storage_statistics(2).free < m.get_storage_statistics(2).total
    plan.slow_all = True
    worst, start, waits = 0.0, time.monotonic(), 0
    for _ in range(60):
        submit(1)
        _, took = _timed(loop.step)
        worst = max(worst, took)
        waits += took > DEADLINE * 0.8
        m.check_invariants()
    frozen = time.monotonic() - start
    assert any(" slow " in line for line in tier.injected)
    assert worst < DEADLINE + 0.35, f"a step took {worst:.2f} s"
    assert waits <= frozen / SLOW + 2, f"{waits} steps waited a deadline in {frozen:.1f} s"
    plan.slow_all = False
    assert m.storage_levels.io[2].wait_idle(SLOW * 4)
    for _ in range(400):                                   # thaw: everything finishes
        if loop.idle:
            break
        loop.step()
    assert loop.idle and len(loop.finished) == rid
    m.check_invariants()


# -- background writes -----------------------------------------------------------------------


def _cascade(m, d, n=3, seed=300):
    """A held request (stays on the GPU) and ``n`` closed ones of 16 tokens: the third
    close pushes the first one's blocks (droppable victims) from the host to the disk."""
    s = d.write(tokens(16, seed))
    r = [tokens(16, seed + 1 + i) for i in range(n)]
    for t in r[:2]:
        d.write(t, chunk=16, suspend=False).close()
    return s, r


def _reuse_and_verify(d, prefix, n, seed):
    """A new request on ``prefix`` reuses ``n`` tokens, and every byte checks."""
    q = d.create(prefix + tokens(3, seed))
    assert q.history_length == n
    d.run_to(q)
    q.close()


def test_background_writes_of_cached_victims_do_not_hold_the_step_and_read_back(build):
    m, plan, tier = build([("gpu", 8), ("host", 4), ("faulty-disk", 40)], depth=4)
    d = Driver(m)
    s, r = _cascade(m, d)
    plan.slow_writes = {tier.writes + 1}
    _, took = _timed(lambda: d.write(r[2], chunk=16, suspend=False).close())  # R0 -> disk
    assert took < DEADLINE / 2, "the step waited for a background write"
    io = m.storage_levels.io[2]
    assert not io.wait_idle(0) and io.stats.write_misses == 0  # still writing, unwaited
    assert page_levels_of(m, r[0]) == {2}
    assert io.wait_idle(SLOW * 4)
    _reuse_and_verify(d, r[0], 16, 1)                      # read after the write landed
    assert io.stats.background_failures == 0 and io.stats.read_misses == 0
    d.resume_and_verify(s)


def test_held_pages_are_written_synchronously_even_with_a_background_queue(build):
    """A suspended request's pages must not be lost to a failed background write: their
    write (here slow, within the deadline) completes before the step goes on."""
    m, plan, tier = build(depth=4, deadline=SLOW * 3)
    d = Driver(m)
    plan.slow_writes = {tier.writes + 1}
    (a, b, c), took = _timed(_push_to_disk, d)             # A's held pages -> disk
    io = m.storage_levels.io[2]
    assert took > SLOW / 2, "the held pages' write did not complete before the step"
    assert io.wait_idle(0) and io.stats.write_misses == 0  # nothing left in flight
    d.resume_and_verify(a, b, c)


def test_a_failed_background_write_makes_its_blocks_lost_never_wrong(build):
    m, plan, tier = build([("gpu", 8), ("host", 4), ("faulty-disk", 40)], depth=4)
    d = Driver(m)
    s, r = _cascade(m, d)
    plan.fail_writes = {tier.writes + 1}
    d.write(r[2], chunk=16, suspend=False).close()         # R0 -> disk: fails later
    io = m.storage_levels.io[2]
    assert io.wait_idle(SLOW * 4) and io.stats.background_failures == 1
    assert m.get_and_reset_iteration_stats().io_failures == 0  # not known at write time
    # The tree still names R0's blocks; reading them fails, so they are lost (recomputed).
    q = d.create(r[0] + tokens(3, 5))
    assert q.history_length == 16
    with pytest.raises(TierIOError, match="background write failed"):
        q.resume()
    assert io.stats.bad_reads == 1
    q.close()
    assert_invariants(m)
    assert m.probe_reuse(None, r[0]) == 0                  # gone from the tree
    _reuse_and_verify(d, r[0], 0, 6)                       # recomputed, then cached again
    _reuse_and_verify(d, r[1], 16, 7)
    d.resume_and_verify(s)


def test_queued_background_writes_wake_the_thread_once_and_run_as_one_write(build):
    """Below half the queue, background writes wait for the level's thread without waking
    it; the next wake-up runs the queued writes of the pool as one write, and every block
    reads back intact."""
    m, _plan, tier = build([("gpu", 8), ("host", 4), ("faulty-disk", 40)], depth=8,
                           native=False)  # (the level's thread's own queue)
    d = Driver(m)
    s, r = _cascade(m, d, n=6)
    io = m.storage_levels.io[2]
    d.write(r[2], chunk=16, suspend=False).close()          # R0 -> disk
    assert io.wait_idle(SLOW)                               # the thread now sleeps
    before = tier.writes
    for t in r[3:6]:                                        # R1, R2, R3 -> disk
        d.write(t, chunk=16, suspend=False).close()
    assert io.background_in_flight == 3 and tier.writes == before, "the thread was woken"
    assert page_levels_of(m, r[3]) == {2}                   # on the disk level already
    assert io.wait_idle(SLOW) and tier.writes == before + 1  # one merged write
    assert io.stats.queue_full_drops == 0 and io.stats.background_failures == 0
    for i in range(4):
        _reuse_and_verify(d, r[i], 16, 60 + i)
    d.resume_and_verify(s)


def test_merged_background_writes_keep_the_last_write_of_a_slot():
    """Queued background writes of one pool merge into one write; a slot written twice
    (freed and reused while its first write waited) holds its last rows, and a failure
    marks every slot of the merged writes unreadable until it is written again."""
    from kvcm_core.testing.faults import FaultyTier
    from kvcm_core.testing.reference import DictTier

    plan = FaultPlan()
    tier = FaultyTier(DictTier(), plan)
    io = LevelIO(2, deadline_s=1.0, write_queue_depth=8)
    pool = DeadlinePool(io, tier.create_pool(16, 8, name="p"))
    rows = [np.full((2, 16), v, dtype=np.uint8) for v in (1, 2, 3)]
    with io.dropping(True):
        pool.write(np.array([0, 1]), rows[0]).wait()
        assert io.wait_idle(1.0)
        before = tier.writes
        pool.write(np.array([5, 2]), rows[1]).wait()
        pool.write(np.array([1, 6]), rows[2]).wait()   # slot 1 again: its last rows win
        assert io.background_in_flight == 2 and tier.writes == before
    assert io.wait_idle(1.0) and tier.writes == before + 1
    out = np.zeros((5, 16), dtype=np.uint8)
    pool.read(np.array([0, 1, 2, 5, 6]), out).wait()
    assert out[:, 0].tolist() == [1, 3, 2, 2, 3]
    plan.fail_writes = {tier.writes + 1}
    with io.dropping(True):
        pool.write(np.array([3]), rows[0][:1]).wait()
        pool.write(np.array([4]), rows[1][:1]).wait()
    assert io.wait_idle(1.0) and io.stats.background_failures == 2
    for slot in (3, 4):
        with pytest.raises(TierIOError, match="background write failed"):
            pool.read(np.array([slot]), out[:1]).wait()
    pool.write(np.array([3]), rows[2][:1]).wait()      # written again (synchronously)
    pool.read(np.array([3]), out[:1]).wait()
    assert out[0, 0] == 3
    io.close([("pool", pool.close)], time.monotonic() + 1.0)


def _spied_pools(io: LevelIO, tier, n: int) -> tuple[list[DeadlinePool], list[int]]:
    """``n`` pools of ``tier`` on ``io``; the list records ``tier.writes`` as each read of
    any of them runs (how many writes ran before it)."""
    seen: list[int] = []
    pools = []
    for k in range(n):
        inner = tier.create_pool(16, 8, name=f"p{k}")
        read = inner.read

        def spy(slots, dest, read=read):
            seen.append(tier.writes)
            return read(slots, dest)

        inner.read = spy
        pools.append(DeadlinePool(io, inner))
    return pools, seen


def test_a_read_goes_ahead_of_queued_background_writes_of_other_slots():
    """A resume's read does not wait for write-back it does not need: queued background
    writes of other slots of its pool, or of another pool, run after it."""
    from kvcm_core.testing.faults import FaultyTier
    from kvcm_core.testing.reference import DictTier

    tier = FaultyTier(DictTier(), FaultPlan())
    io = LevelIO(2, deadline_s=1.0, write_queue_depth=8)
    (pool, other), seen = _spied_pools(io, tier, 2)
    pool.write(np.array([0, 1]), np.full((2, 16), 7, dtype=np.uint8)).wait()  # synchronous
    with io.dropping(True):
        pool.write(np.array([2, 3]), np.full((2, 16), 8, dtype=np.uint8)).wait()
        other.write(np.array([0]), np.full((1, 16), 9, dtype=np.uint8)).wait()
    assert io.background_in_flight == 2 and tier.writes == 1  # queued, the thread asleep
    out = np.zeros((2, 16), dtype=np.uint8)
    pool.read(np.array([1, 0]), out).wait()
    assert seen == [1] and out[:, 0].tolist() == [7, 7]  # it ran before both writes
    assert io.wait_idle(1.0) and tier.writes == 3  # then they ran (one write per pool)...
    assert io.background_in_flight == 0
    back = np.zeros((1, 16), dtype=np.uint8)
    other.read(np.array([0]), back).wait()
    assert back[0, 0] == 9  # ...and their data is there
    io.close([("pools", lambda: (pool.close(), other.close()))], time.monotonic() + 1.0)


def test_a_read_of_a_slot_with_a_queued_background_write_waits_and_sees_its_rows():
    """Reads never overtake a queued write of a slot they read, nor anything queued
    before that write: they see the rows written last."""
    from kvcm_core.testing.faults import FaultyTier
    from kvcm_core.testing.reference import DictTier

    tier = FaultyTier(DictTier(), FaultPlan())
    io = LevelIO(2, deadline_s=1.0, write_queue_depth=8)
    (pool,), seen = _spied_pools(io, tier, 1)
    with io.dropping(True):
        pool.write(np.array([4]), np.full((1, 16), 1, dtype=np.uint8)).wait()
        pool.write(np.array([5, 6]), np.full((2, 16), 2, dtype=np.uint8)).wait()
        pool.write(np.array([7]), np.full((1, 16), 3, dtype=np.uint8)).wait()
    assert tier.writes == 0
    out = np.zeros((2, 16), dtype=np.uint8)
    pool.read(np.array([6, 4]), out).wait()  # slot 6: the second write; slot 4: the first
    assert out[:, 0].tolist() == [2, 1]
    assert seen == [1]  # the first two writes ran as one merged write before the read
    assert io.wait_idle(1.0) and tier.writes == 2  # the third (slot 7) after it
    io.close([("pool", pool.close)], time.monotonic() + 1.0)


def test_a_background_write_running_past_the_deadline_makes_the_level_refuse_at_once():
    """Nobody waits for a background write, yet once the thread has run it for longer
    than the deadline the level counts as stuck: the next read is refused at once rather
    than waiting a deadline behind it, and the level recovers when the write returns."""
    from kvcm_core.testing.faults import FaultyTier
    from kvcm_core.testing.reference import DictTier

    plan = FaultPlan(slow_s=SLOW)
    tier = FaultyTier(DictTier(), plan)
    io = LevelIO(2, deadline_s=DEADLINE, write_queue_depth=2)
    pool = DeadlinePool(io, tier.create_pool(16, 8, name="p"))
    rows = np.full((1, 16), 7, dtype=np.uint8)
    pool.write(np.array([1]), rows).wait()                  # synchronous: nothing queued
    plan.slow_writes = {tier.writes + 1}
    with io.dropping(True):
        pool.write(np.array([0]), rows).wait()              # wakes the thread (half of 2)
    assert io.stuck() is None
    time.sleep(DEADLINE * 1.5)
    assert io.stuck() is not None and "running" in io.stuck()
    out = np.zeros((1, 16), dtype=np.uint8)
    t0 = time.monotonic()
    with pytest.raises(IODeadlineError, match="not attempted") as caught:
        pool.read(np.array([1]), out).wait()
    assert not caught.value.attempted and time.monotonic() - t0 < DEADLINE / 2
    assert io.wait_idle(SLOW * 2) and io.stuck() is None
    pool.read(np.array([0]), out).wait()                    # the late write landed
    assert out[0, 0] == 7
    io.close([("pool", pool.close)], time.monotonic() + 1.0)


def test_a_full_write_queue_drops_cached_victims_at_once_and_nothing_waits(build):
    """Depth 1 and a write sleeping past the deadline in the background: the next cascade
    of droppable victims to the disk is refused at once (dropped, not offloaded, not an
    I/O failure), and no step waits for the level."""
    m, plan, tier = build([("gpu", 8), ("host", 4), ("faulty-disk", 40)], depth=1)
    d = Driver(m)
    s, r = _cascade(m, d, n=5, seed=200)                   # held S on the GPU, R0 on the host
    plan.slow_writes = {tier.writes + 1}
    m.get_and_reset_iteration_stats()
    _, took = _timed(lambda: d.write(r[2], chunk=16, suspend=False).close())  # R0 -> disk
    io = m.storage_levels.io[2]
    assert took < DEADLINE / 2 and not io.wait_idle(0)     # the slow write is in flight
    _, took = _timed(lambda: d.write(r[3], chunk=16, suspend=False).close())  # R1 -> disk?
    assert took < DEADLINE / 2, "a step waited for the full write queue"
    assert io.stats.queue_full_drops == 1 and io.stats.write_misses == 0
    st = m.get_and_reset_iteration_stats()
    assert st.io_failures == 0 and st.groups[0].dropped_blocks == 4
    assert m.probe_reuse(None, r[1]) == 0                  # dropped, not cached
    assert_invariants(m)
    assert io.wait_idle(SLOW * 4)
    assert m.probe_reuse(None, r[0]) == 16                 # the slow write landed
    q = d.create(r[0] + tokens(3, 9))
    d.run_to(q)                                            # read back from the disk
    q.close()
    d.resume_and_verify(s)


# -- resize and shutdown ---------------------------------------------------------------------


def test_a_resize_that_misses_its_deadline_is_refused_and_the_level_keeps_its_size(build):
    """A pool resize sleeping past the deadline: ``resize`` returns False within about
    one deadline naming it, the level keeps its size once the late resize has been undone
    behind it, and every page on the disk reads back intact."""
    m, plan, _tier = build()
    d = Driver(m)
    a, b, c = _push_to_disk(d)
    before = m.get_storage_statistics(2).total
    quota = m.config.levels[2].quota
    plan.slow_resizes = True
    ok, took = _timed(m.resize, 2, quota * 2)
    assert not ok and took < DEADLINE + 0.3
    assert "deadline" in m.last_refusal and "kept its size" in m.last_refusal
    assert m.get_storage_statistics(2).total == before
    plan.slow_resizes = False
    io = m.storage_levels.io[2]
    assert io.wait_idle(SLOW * 4)
    inner = m.storage_levels.stores[2][0].pools[0].inner_pool
    assert inner.num_slots == before                       # grown late, then sized back
    m.check_invariants()
    d.resume_and_verify(a, b, c)
    assert m.resize(2, quota * 2) and m.get_storage_statistics(2).total > before


def test_a_resize_of_a_stuck_level_is_refused_at_once_and_changes_nothing(build):
    m, plan, tier = build()
    d = Driver(m)
    a, b, c = _push_to_disk(d)
    plan.slow_reads = {tier.reads + 1}
    with pytest.raises(TierIOError):
        a.resume()
    before = m.get_storage_statistics(2).total
    ok, took = _timed(m.resize, 2, m.config.levels[2].quota * 2)
    assert not ok and took < DEADLINE / 2 and m.last_refusal is not None
    assert m.get_storage_statistics(2).total == before
    a.close()
    assert m.storage_levels.io[2].wait_idle(SLOW * 4)
    assert m.resize(2, m.config.levels[2].quota * 2)
    assert m.get_storage_statistics(2).total > before
    d.resume_and_verify(b, c)


def test_shutdown_waits_one_deadline_then_lists_what_it_abandoned(build):
    m, plan, tier = build()
    d = Driver(m)
    a, _b, _c = _push_to_disk(d)
    directory = tier.inner.directory
    plan.slow_reads = {tier.reads + 1}
    with pytest.raises(TierIOError):
        a.resume()
    close_all(m)
    t0 = time.monotonic()
    with pytest.raises(TierIOError, match="abandoned past the I/O deadline") as info:
        m.shutdown()
    assert time.monotonic() - t0 < DEADLINE + 0.2          # one deadline, not SLOW
    assert "read of" in str(info.value) and "(running" in str(info.value)
    assert m.is_shut_down
    m.shutdown()                                           # a second call is a no-op
    # The stuck read returns; the level's thread then closes the files it still had.
    io = m.storage_levels.io[2]
    assert io.wait_idle(SLOW * 4)
    t0 = time.monotonic()
    while io.thread_alive and time.monotonic() - t0 < 2:
        time.sleep(0.01)
    assert not io.thread_alive
    deadline = time.monotonic() + 2
    while os.path.exists(directory) and os.listdir(directory) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not any(n.startswith("kvcm-owner") for n in os.listdir(directory))


def test_shutdown_of_an_idle_level_is_quick_and_raises_nothing(build):
    m, _, _ = build()
    d = Driver(m)
    _push_to_disk(d)
    close_all(m)
    io = m.storage_levels.io[2]
    assert io.thread_alive
    _, took = _timed(m.shutdown)
    assert took < DEADLINE and m.is_shut_down
    t0 = time.monotonic()
    while io.thread_alive and time.monotonic() - t0 < 2:
        time.sleep(0.01)
    assert not io.thread_alive                             # the thread ended with it


# -- LevelIO on its own ------------------------------------------------------------------------


def test_level_io_runs_in_order_and_every_os_failure_is_a_tier_io_error():
    io = LevelIO(3, 1.0)
    seen = []
    io.call(lambda: seen.append(1), "first", "write")
    io.call(lambda: seen.append(2), "second", "read")
    assert seen == [1, 2] and io.stats.operations == 2

    def fail():
        raise OSError(5, "Input/output error")

    with pytest.raises(TierIOError, match="Input/output error"):
        io.call(fail, "write of 1 slots", "write")
    assert io.close([], time.monotonic() + 1) == ([], [])


def test_level_io_past_its_deadline_refuses_at_once_until_the_late_call_returns():
    io = LevelIO(3, 0.05)
    gate = threading.Event()
    with pytest.raises(IODeadlineError, match=r"level 3: read of 2 slots missed its 0\.05 s") \
            as info:
        io.call(gate.wait, "read of 2 slots", "read")
    assert info.value.attempted and io.stats.read_misses == 1
    assert io.stuck().startswith("read of 2 slots")
    ran = []
    t0 = time.monotonic()
    with pytest.raises(IODeadlineError, match=r"not attempted: .* stuck on read of 2") as info:
        io.call(lambda: ran.append(1), "write of 1 slots", "write")
    assert time.monotonic() - t0 < 0.04 and not info.value.attempted and not ran
    assert io.stats.fast_fails == 1 and io.stats.write_misses == 0  # not attempted
    gate.set()
    assert io.wait_idle(2) and io.stuck() is None
    io.call(lambda: ran.append(1), "write of 1 slots", "write")   # recovered
    assert ran == [1]
    io.close([], time.monotonic() + 1)


def test_level_io_close_abandons_what_is_stuck_and_runs_the_closers_after_it():
    io = LevelIO(3, 0.05)
    gate = threading.Event()
    with pytest.raises(IODeadlineError):
        io.call(gate.wait, "write of 4 slots", "write")
    closed = []
    t0 = time.monotonic()
    failures, abandoned = io.close([("level 3 tier", lambda: closed.append("tier"))],
                                   time.monotonic() + 0.05)
    assert time.monotonic() - t0 < 0.2 and failures == []
    assert abandoned[0].startswith("level 3: write of 4 slots (running")
    assert abandoned[1] == "level 3 tier (queued)" and not closed
    with pytest.raises(TierIOError, match="after shutdown"):
        io.call(lambda: None, "read of 1 slots", "read")
    gate.set()
    t0 = time.monotonic()
    while io.thread_alive and time.monotonic() - t0 < 2:
        time.sleep(0.01)
    assert closed == ["tier"] and not io.thread_alive


def test_a_failed_background_write_marks_its_slots_until_they_are_written_again():
    io = LevelIO(3, 1.0, write_queue_depth=2)
    pool = object()
    slots = np.array([4, 5])

    def fail():
        raise TierIOError("injected")

    io.background(fail, "write of 2 slots", pool, slots)
    assert io.wait_idle(1) and io.stats.background_failures == 1
    with pytest.raises(TierIOError, match=r"slots \[5\] were not written"):
        io.call(lambda: io.check_readable(pool, np.array([5, 7])), "read", "read")
    io.call(lambda: io.check_readable(pool, np.array([6])), "read", "read")  # others fine
    io.background(lambda: None, "write of 2 slots", pool, slots)
    assert io.wait_idle(1)
    io.call(lambda: io.check_readable(pool, slots), "read", "read")
    io.close([], time.monotonic() + 1)



# -- what a deadline cost, counted apart ------------------------------------------------------


def _slow_level(deadline: float, slow_s: float, depth: int = 8):
    """A LevelIO over a fault-injecting in-memory tier: ``(io, pool, plan, tier)``."""
    from kvcm_core.testing.faults import FaultyTier
    from kvcm_core.testing.reference import DictTier

    plan = FaultPlan(slow_s=slow_s)
    tier = FaultyTier(DictTier(), plan)
    io = LevelIO(2, deadline_s=deadline, write_queue_depth=depth)
    return io, DeadlinePool(io, tier.create_pool(16, 8, name="p")), plan, tier


def test_a_call_refused_at_once_is_a_fast_fail_and_in_no_read_or_write_miss():
    io, pool, plan, tier = _slow_level(0.05, 0.5)
    rows = np.ones((1, 16), dtype=np.uint8)
    plan.slow_writes = {tier.writes + 1}
    with pytest.raises(IODeadlineError, match="missed its"):
        pool.write(np.array([0]), rows).wait()             # attempted, waited for: a miss
    out = np.zeros((1, 16), dtype=np.uint8)
    for _ in range(3):                                     # refused at once: fast fails
        with pytest.raises(IODeadlineError, match="not attempted"):
            pool.read(np.array([1]), out).wait()
        with pytest.raises(IODeadlineError, match="not attempted"):
            pool.write(np.array([1]), rows).wait()
    st = io.stats
    assert (st.write_misses, st.read_misses, st.fast_fails, st.background_misses) == \
        (1, 0, 6, 0), st.as_dict()
    assert io.wait_idle(2.0)
    io.close([("pool", pool.close)], time.monotonic() + 1.0)


def test_a_background_write_the_level_finishes_past_its_deadline_is_one_background_miss():
    io, pool, plan, tier = _slow_level(0.1, 0.4)
    rows = np.ones((1, 16), dtype=np.uint8)
    with io.dropping(True):
        pool.write(np.array([0]), rows).wait()             # on time
        assert io.wait_idle(1.0)
        plan.slow_writes = {tier.writes + 1}
        pool.write(np.array([1]), rows).wait()             # returns at once; lands late
    assert io.wait_idle(2.0)                               # nobody looked at it meanwhile
    st = io.stats
    assert st.background_misses == 1, st.as_dict()
    assert st.write_misses == st.read_misses == st.fast_fails == 0
    assert st.background_failures == 0                     # late, but written
    io.close([("pool", pool.close)], time.monotonic() + 1.0)


def test_a_background_write_seen_stuck_then_landing_late_is_counted_once():
    io, pool, plan, tier = _slow_level(0.1, 0.5)
    rows = np.ones((1, 16), dtype=np.uint8)
    plan.slow_writes = {tier.writes + 1}
    with io.dropping(True):
        pool.write(np.array([1]), rows).wait()
        io.wait_idle(0)                                    # wake the thread: it starts
    time.sleep(0.25)
    out = np.zeros((1, 16), dtype=np.uint8)
    with pytest.raises(IODeadlineError, match="not attempted"):
        pool.read(np.array([1]), out).wait()               # the level is stuck on it
    assert io.stats.background_misses == 1                 # seen late: counted at once
    assert io.wait_idle(2.0)
    st = io.stats
    assert (st.background_misses, st.fast_fails, st.read_misses, st.write_misses) == \
        (1, 1, 0, 0), st.as_dict()
    io.close([("pool", pool.close)], time.monotonic() + 1.0)


def test_a_full_queue_waiting_in_vain_for_a_background_write_counts_it_as_a_background_miss():
    """A write that must not be dropped finds the queue full and waits for the oldest
    background write, which is stuck: that write is a background miss, the new one a fast
    fail (not attempted), and no foreground miss is counted."""
    io = LevelIO(3, 0.05, write_queue_depth=1)
    pool = object()
    gate = threading.Event()
    io.background(gate.wait, "write of 2 slots", pool, np.array([4, 5]))
    with pytest.raises(IODeadlineError, match="not attempted"):
        io.background(lambda: None, "write of 1 slots", pool, np.array([6]))
    st = io.stats
    assert (st.background_misses, st.fast_fails, st.write_misses) == (1, 1, 0), st.as_dict()
    gate.set()
    assert io.wait_idle(1.0) and io.stats.background_misses == 1  # landing: not again
    io.close([], time.monotonic() + 1)


def test_a_write_queued_behind_a_slow_background_write_is_a_write_miss_and_it_a_background_one():
    io, pool, plan, tier = _slow_level(0.05, 0.4)
    rows = np.ones((1, 16), dtype=np.uint8)
    plan.slow_writes = {tier.writes + 1}
    with io.dropping(True):
        pool.write(np.array([1]), rows).wait()             # background, slow
    with pytest.raises(IODeadlineError, match="missed its"):
        pool.write(np.array([2]), rows).wait()             # held pages: queued behind it
    assert io.wait_idle(2.0)
    st = io.stats
    assert (st.write_misses, st.background_misses, st.fast_fails) == (1, 1, 0), st.as_dict()
    io.close([("pool", pool.close)], time.monotonic() + 1.0)


def test_a_manager_background_write_past_its_deadline_is_a_background_miss(build):
    m, plan, tier = build([("gpu", 8), ("host", 4), ("faulty-disk", 40)], depth=4)
    d = Driver(m)
    s, r = _cascade(m, d)
    plan.slow_writes = {tier.writes + 1}
    d.write(r[2], chunk=16, suspend=False).close()         # R0 -> disk, in the background
    io = m.storage_levels.io[2]
    assert io.wait_idle(SLOW * 4)
    st = io.stats.as_dict()
    assert st["background_misses"] == 1 and st["write_misses"] == 0, st
    assert st["fast_fails"] == 0 and st["background_failures"] == 0, st
    _reuse_and_verify(d, r[0], 16, 1)                      # late, but written and intact
    d.resume_and_verify(s)
