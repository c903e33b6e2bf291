"""Cold frames end to end, as an engine developer meets them: a disk level (slot or blob
mode, with or without a blob codec) under a GPU and a host level. Pages pushed to disk come
back bit-exact (fingerprint-checked); a byte flipped in the tier's file makes ``resume()``
raise ``CorruptPageError`` naming the block, the cache can be closed, and the same prompt
again reuses only the blocks before it and recomputes the rest (fingerprint-checked)."""

from __future__ import annotations

import os
import re

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from kvcm_tier_disk import HEADER_BYTES
from levels_helpers import (
    TPB,
    Driver,
    assert_all_free,
    assert_invariants,
    cache_pages,
    chain,
    faulty_disk,
    faulty_tier,
    full_layers,
    make_manager,
    page_levels,
    quota,
    tokens,
)

from kvcm_core import (
    ConfigError,
    CorruptPageError,
    KVCacheManager,
    KVCacheManagerConfig,
    LevelConfig,
)
from kvcm_core.testing.faults import FaultPlan

DISK_MODES = [
    pytest.param("slot", None, id="slot"),
    pytest.param("blob", None, id="blob"),
    pytest.param("blob", "zstd", id="blob-zstd"),
    pytest.param("blob", "lz4", id="blob-lz4"),
]
_PACKAGES = {"zstd": "zstandard", "lz4": "lz4"}


@pytest.fixture
def manager(tmp_path, request):
    made = []

    def build(mode: str, blob_codec: str | None) -> KVCacheManager:
        if blob_codec is not None:
            pytest.importorskip(_PACKAGES[blob_codec])
        levels = [
            LevelConfig(tier="gpu", quota=quota("full", 0, 8)),
            LevelConfig(tier="host", quota=quota("full", 1, 8)),
            LevelConfig(tier="disk", quota=1 << 20, blob_codec=blob_codec,
                        options={"path": str(tmp_path / f"disk{len(made)}"), "mode": mode}),
        ]
        m = KVCacheManager(KVCacheManagerConfig(
            tokens_per_block=TPB, layers=full_layers(), levels=levels,
            kernel_backend=os.environ.get("KVCM_TEST_BACKEND", "numpy"),
            max_util_for_resume=1.0))
        made.append(m)
        return m

    yield build
    for m in made:
        for cache in m.open_caches:
            cache.close()
        assert_all_free(m)
        m.shutdown()


def _push_to_disk(d: Driver):
    """A (7 blocks) suspended and pushed to disk by B and C (8 blocks each)."""
    a = d.write(tokens(30, 11), end=25)
    b = d.write(tokens(32, 12), chunk=32)
    c = d.write(tokens(32, 13), chunk=32)
    assert set(page_levels(a)) == {2}
    return a, b, c


def _flip_a_byte_of(m: KVCacheManager, pid: int) -> None:
    """Flip one byte inside the stored bytes of page ``pid``, in the tier's file."""
    L = m.storage_levels
    pool = L.store_of(pid).pools[0]
    slot = int(L.arena.slot[pid])
    if hasattr(pool, "locate"):  # blob mode
        path, offset, length = pool.locate(slot)
        at = offset + length // 2
    else:
        path, at = pool.path, HEADER_BYTES + slot * pool.slot_bytes + pool.slot_bytes // 2
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ 0x01]))


@pytest.mark.parametrize("mode, blob_codec", DISK_MODES)
def test_pages_pushed_to_disk_come_back_bit_exact(manager, mode, blob_codec):
    m = manager(mode, blob_codec)
    d = Driver(m)
    a, b, c = _push_to_disk(d)
    d.resume_and_verify(a, b, c)
    stats = m.get_and_reset_iteration_stats()
    assert stats.corrupt_pages == 0 and stats.io_failures == 0


@pytest.mark.parametrize("mode, blob_codec", DISK_MODES)
def test_a_flipped_byte_in_the_disk_file_fails_resume_and_the_rest_is_recomputed(
        manager, mode, blob_codec):
    m = manager(mode, blob_codec)
    d = Driver(m)
    a, b, c = _push_to_disk(d)
    _flip_a_byte_of(m, cache_pages(a)[3])
    with pytest.raises(CorruptPageError) as err:
        a.resume()
    assert err.value.block == 3 and "block 3" in str(err.value)
    assert a.status.name == "SUSPENDED"
    assert m.get_and_reset_iteration_stats().corrupt_pages == 1
    a.close()
    assert_invariants(m)
    d.resume_and_verify(b, c)  # other requests carry on
    again = d.create(tokens(30, 11))
    assert again.history_length == 3 * TPB  # blocks 0..2 reused, nothing after them
    d.run_to(again)  # recomputes from block 3 on; every byte fingerprint-checked


def test_a_corrupt_partial_tail_is_not_published_when_its_cache_closes(manager):
    """A's last block is partial (25 tokens); closing a cache publishes its partial tail,
    but never one whose page was lost to corruption."""
    m = manager("slot", None)
    d = Driver(m)
    a, _b, _c = _push_to_disk(d)
    _flip_a_byte_of(m, cache_pages(a)[6])
    with pytest.raises(CorruptPageError) as err:
        a.resume()
    assert err.value.block == 6
    a.close()
    assert_invariants(m)
    again = d.create(tokens(30, 11))
    assert again.history_length == 6 * TPB
    d.run_to(again)


@pytest.mark.parametrize("mode, blob_codec", DISK_MODES[:2])
def test_a_corrupt_page_found_by_a_prefetch_makes_resume_name_its_block(
        manager, mode, blob_codec):
    """Corruption met while moving held pages (here: a prefetch from disk to the host)
    drops the page there and then; the owner's resume names the block."""
    m = manager(mode, blob_codec)
    d = Driver(m)
    a, b, c = _push_to_disk(d)
    _flip_a_byte_of(m, cache_pages(a)[4])
    b.close()  # room on the host
    m.get_and_reset_iteration_stats()
    assert a.prefetch(1) == len(cache_pages(a)) - 1
    assert m.get_and_reset_iteration_stats().corrupt_pages == 1
    for _ in range(2):  # and again: the cache stays SUSPENDED until closed
        with pytest.raises(CorruptPageError) as err:
            a.resume()
        assert err.value.block == 4
        assert a.status.name == "SUSPENDED"
    a.close()
    again = d.create(tokens(30, 11))
    assert again.history_length == 4 * TPB
    d.run_to(again)
    again.close()
    d.resume_and_verify(c)


@pytest.mark.parametrize("mode, blob_codec", DISK_MODES[:2])
def test_a_corrupt_page_met_by_a_level_shrink_is_dropped_and_named_at_resume(
        manager, mode, blob_codec):
    m = manager(mode, blob_codec)
    d = Driver(m)
    a, b, c = _push_to_disk(d)
    e = d.write(tokens(32, 14), chunk=32)       # B goes to disk too, above A's slots
    assert set(page_levels(b)) == {2}
    a.close()
    L = m.storage_levels
    slots = [int(L.arena.slot[p]) for p in cache_pages(b)]
    top = int(np.argmax(slots))
    _flip_a_byte_of(m, cache_pages(b)[top])
    m.get_and_reset_iteration_stats()
    disk = L.stores[2][0]
    assert m.resize(2, 10 * disk.slot_bytes)
    assert disk.num_slots == 10
    assert m.get_and_reset_iteration_stats().corrupt_pages == 1
    with pytest.raises(CorruptPageError) as err:
        b.resume()
    assert err.value.block == top
    b.close()
    d.resume_and_verify(c, e)


def test_blob_mode_stores_compressed_frames_counted_against_the_quota(manager):
    m = manager("blob", "zstd")
    d = Driver(m)
    a, _b, _c = _push_to_disk(d)
    pool = m.storage_levels.store_of(cache_pages(a)[0]).pools[0]
    assert 0 < pool.stored_bytes <= pool.num_slots * pool.slot_bytes
    # fingerprint records compress absurdly well: only "smaller than raw" is asserted
    cold = m.storage_levels.cold_keys[0][1]
    assert pool.stored_bytes < 7 * cold


@pytest.mark.parametrize("level, field", [
    (LevelConfig(tier="host", quota=1 << 20, blob_codec="zstd"), "levels[1].blob_codec"),
    (LevelConfig(tier="disk", quota=1 << 20, blob_codec="zstd"), "levels[1].blob_codec"),
    (LevelConfig(tier="disk", quota=1 << 20, blob_codec="raw",
                 options={"mode": "blob"}), "levels[1].blob_codec"),
])
def test_blob_codec_needs_a_blob_mode_tier_and_a_blob_codec(tmp_path, level, field):
    pytest.importorskip("zstandard")
    if "path" not in level.options and level.tier == "disk":
        level = LevelConfig(tier="disk", quota=level.quota, blob_codec=level.blob_codec,
                            options={**level.options, "path": str(tmp_path / "d")})
    cfg = KVCacheManagerConfig(tokens_per_block=TPB, layers=full_layers(),
                               levels=[LevelConfig(tier="gpu", quota=1 << 20), level],
                               kernel_backend="numpy")
    with pytest.raises(ConfigError, match=re.escape(field)):
        KVCacheManager(cfg)


def test_level_zero_takes_no_blob_codec():
    with pytest.raises(ConfigError, match=re.escape("levels[0].blob_codec")):
        KVCacheManagerConfig(tokens_per_block=TPB, layers=full_layers(),
                             levels=[LevelConfig(tier="gpu", quota=1 << 20, blob_codec="zstd")])


def test_host_pages_carry_no_frame_and_disk_slots_hold_one(manager):
    m = manager("slot", None)
    L = m.storage_levels
    host, disk = L.stores[1][0], L.stores[2][0]
    cold = L.cold_keys[0][1]
    assert host.frames is None and host.pools[0].slot_bytes == cold
    assert disk.frames is not None and disk.pools[0].slot_bytes == cold + 72
    assert np.array_equal(disk.frames.seqs, np.zeros(disk.num_slots, dtype=np.uint64))


# -- random damage under a random workload ---------------------------------------------------


class _Workload:
    """Requests over shared prefixes on a stack with a faulty disk at ``level``; every
    request that meets a corrupt page is closed and created again, as an engine would. A
    resume refused for room (tiny levels) is simply not taken."""

    def __init__(self, m: KVCacheManager, level: int) -> None:
        self.m, self.level, self.d = m, level, Driver(m)
        self.tier = faulty_tier(m, level)
        base = tokens(28, 5)
        self.prompts = [base[:20], base[:12] + tokens(12, 6), base, tokens(26, 7)]
        self.open: list = []
        self.detected = 0

    def start(self, toks) -> None:
        for _ in range(10):  # each retry reuses less: the bad blocks left the tree
            cache = self.d.create(toks)
            try:
                if not cache.resume() or not self._run(cache):
                    cache.close()
                    return
            except CorruptPageError:
                self.detected += 1
                cache.close()
                continue
            cache.suspend()
            self.open.append(cache)
            return
        raise AssertionError("a request kept meeting corrupt pages")

    def _run(self, cache) -> bool:
        """Step the request to its end; False when a step is refused for room (after a
        shrink the suspended requests' held pages can leave too little for a new one)."""
        end = len(self.d.toks[id(cache)])
        while cache.history_length < end:
            if not self.d.step(cache, min(5, end - cache.history_length)):
                assert "cannot provide" in (cache.last_refusal or ""), cache.last_refusal
                return False
        self.d.check(cache)  # the engine reads every byte of its history
        return True

    def resume(self, cache) -> None:
        try:
            if not cache.resume():
                return
        except CorruptPageError:
            self.detected += 1
            self.open.remove(cache)
            toks = self.d.toks[id(cache)]
            cache.close()
            self.start(toks)
            return
        self.d.check(cache)  # the engine reads every byte of its history
        cache.suspend()

    def corrupt(self, k: int) -> None:
        disk = self.m.storage_levels.stores[self.level][0]
        pages = disk.pages()
        if len(pages):
            self.tier.plan.corrupt_offset = k % disk.slot_bytes
            slot = int(self.m.storage_levels.arena.slot[pages[k % len(pages)]])
            self.tier.corrupt(disk.pools[0], slot)


#: GPU / host / disk (the disk last), and GPU / disk / host: evictions and prefetches
#: then read pages back from the disk while making room.
STACKS = {
    "disk-last": ([("gpu", 8), ("host", 4), ("faulty-disk", 40)], 2),
    "disk-middle": ([("gpu", 8), ("faulty-disk", 6), ("host", 10)], 1),
}


@pytest.mark.parametrize("stack", sorted(STACKS))
@settings(max_examples=20, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(ops=st.lists(st.tuples(st.sampled_from(["new", "resume", "corrupt", "close",
                                               "prefetch", "shrink"]),
                              st.integers(0, 10_000)), min_size=4, max_size=24))
# Found on the H200 run: after a shrink, a new request can be refused for room; that is a
# refusal, not damage.
@example(ops=[("new", 1), ("new", 2), ("shrink", 0), ("new", 3)])
def test_random_disk_damage_never_reaches_the_engine(tmp_path_factory, stack, ops):
    tiers, level = STACKS[stack]
    m = make_manager(tiers, tmp_path_factory.mktemp("damage"), pm=faulty_disk(FaultPlan()))
    w = _Workload(m, level)
    disk = m.storage_levels.stores[level][0]
    try:
        for op, k in ops:
            if op == "new" and len(w.open) < 3:
                w.start(w.prompts[k % len(w.prompts)])
            elif op == "resume" and w.open:
                w.resume(w.open[k % len(w.open)])
            elif op == "corrupt":
                w.corrupt(k)
            elif op == "close" and w.open:
                w.open.pop(k % len(w.open)).close()
            elif op == "prefetch" and w.open:
                w.open[k % len(w.open)].prefetch(k % 2)
            elif op == "shrink":  # every cache is suspended here
                m.resize(level, disk.slot_bytes * (4 + k % 6))
            assert_invariants(m)
        for cache in list(w.open):
            w.resume(cache)
        # A resume that meets a page found corrupt earlier (by another request's move)
        # counts nothing new: every detection was counted once, when first found.
        assert m.get_and_reset_iteration_stats().corrupt_pages >= min(w.detected, 1)
    finally:
        for cache in m.open_caches:
            cache.close()
        assert_all_free(m)
        m.shutdown()


@pytest.mark.parametrize("corrupt", ["all", "first"])
def test_droppable_pages_found_corrupt_in_a_cascade_are_dropped_with_what_is_below(
        tmp_path, corrupt):
    """A disk level between the GPU and the host: evictions read droppable pages back
    from disk. If every frame of a chain is damaged, or only its first block's (whose
    loss takes the rest of the chain along), nothing damaged moves, nothing leaks, and
    the prompt is recomputed."""
    plan = FaultPlan(corrupt_writes=set(range(1, 1000)) if corrupt == "all" else set())
    m = make_manager([("gpu", 8), ("faulty-disk", 8), ("host", 16)], tmp_path,
                     pm=faulty_disk(plan))
    try:
        d = Driver(m)
        prompts = [tokens(32, 20 + i) for i in range(3)]
        d.write(prompts[0], chunk=32, suspend=False).close()  # R0 on the GPU
        d.write(prompts[1], chunk=32, suspend=False).close()  # R0 -> disk
        # Written out (a held write would be read back from memory, intact).
        assert m.storage_levels.io[1].wait_idle(5.0)
        if corrupt == "first":  # only block 0's frame is damaged
            first = int(m.tree.pages[chain(m, prompts[0])[0], 0])
            L = m.storage_levels
            faulty_tier(m, 1).corrupt(L.store_of(first).pools[0], int(L.arena.slot[first]))
        m.get_and_reset_iteration_stats()
        d.write(prompts[2], chunk=32, suspend=False).close()  # R0 read back: disk -> host
        stats = m.get_and_reset_iteration_stats()
        assert stats.corrupt_pages == (8 if corrupt == "all" else 1)
        assert_invariants(m)
        assert m.get_storage_statistics(2).free == m.get_storage_statistics(2).total
        assert m.probe_reuse(None, prompts[0]) == 0
        again = d.create(prompts[0])
        d.run_to(again)  # recomputed; every byte checked
        again.close()
    finally:
        for cache in m.open_caches:
            cache.close()
        assert_all_free(m)
        m.shutdown()


def test_resume_fails_when_making_its_room_finds_its_own_pages_corrupt(tmp_path):
    """GPU / disk / host: resuming A pushes B down to the disk, which pushes A's own held
    pages from the disk to the host; they fail their frame check on that read. The resume
    must not go on with holes: it raises CorruptPageError naming the block."""
    plan = FaultPlan()
    m = make_manager([("gpu", 8), ("faulty-disk", 6), ("host", 10)], tmp_path,
                     pm=faulty_disk(plan))
    try:
        d = Driver(m)
        a = d.write(tokens(20, 30))             # 5 blocks
        b = d.write(tokens(32, 31), chunk=32)   # 8 blocks: A goes to the disk
        assert set(page_levels(a)) == {1}
        L = m.storage_levels
        tier = faulty_tier(m, 1)
        for pid in cache_pages(a):
            tier.corrupt(L.store_of(pid).pools[0], int(L.arena.slot[pid]))
        with pytest.raises(CorruptPageError) as err:
            a.resume()
        assert err.value.block is not None
        assert a.status.name == "SUSPENDED"
        assert m.get_and_reset_iteration_stats().corrupt_pages >= 1
        a.close()
        assert_invariants(m)
        d.resume_and_verify(b)
        # A's pages that were not read yet are still damaged on the disk: the engine
        # recreates the request until it has met (and dropped) them all.
        w = _Workload(m, 1)
        w.start(tokens(20, 30))
        assert len(w.open) == 1 and w.detected >= 1
    finally:
        for cache in m.open_caches:
            cache.close()
        assert_all_free(m)
        m.shutdown()
