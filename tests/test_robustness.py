"""Robustness (quality.md §3 "Reliability and security"; scenarios.md "Concurrency and
lifecycle", "Faults"; semantics.md "Threads").

- Statistics polled from another thread while the scheduler thread runs an EngineLoop
  workload with manager resizes, suspends and migrations over three levels.
- Several managers in one process: no cross-talk, independent prefix trees, one closing
  disturbs nothing, two sharing a disk directory keep their own files.
- Host memory does not grow over a long steady run (tracemalloc, tree nodes, statistics).
- Event sinks: a raising sink is counted and warned about once; a good sink next to it
  still gets stored, removed and moved events; the workload still verifies.
- Security: ReuseScope salts isolate tenants under eviction pressure and across levels;
  disk-tier files are 0600 in a 0700 directory.
- A soak-lite: 300+ requests, mixed reuse policies, tiny quotas over three levels.

Every byte is checked by the fingerprint engine (EngineLoop checks every step; Driver
checks what each request's history needs).
"""

from __future__ import annotations

import contextlib
import gc
import inspect
import os
import random
import stat
import sys
import threading
import tracemalloc
import warnings
from collections.abc import Sequence
from typing import Any

import pytest
from levels_helpers import (
    Driver,
    Recorder,
    assert_all_free,
    assert_invariants,
    cache_pages,
    close_all,
    level_counts,
    make_manager,
    quota,
    tokens,
)

from kvcm_core import (
    AttentionLayerConfig,
    BlockEvent,
    BufferConfig,
    ConfigError,
    EventKind,
    EventSink,
    KVCacheManager,
    KVCacheManagerConfig,
    KvcmPluginManager,
    LevelConfig,
    ReusePolicy,
    ReuseScope,
    SsmLayerConfig,
    hookimpl,
)
from kvcm_core.radix import scope_root_key
from kvcm_core.storage import Store
from kvcm_core.testing.engine import EngineLoop, Request

P = ReusePolicy




def requests(n: int, rng: random.Random, *, first_id: int = 0, shared: Sequence[int] = (),
             lo: int = 4, hi: int = 28, max_out: int = 6,
             scope: ReuseScope | None = None) -> list[Request]:
    """``n`` requests: ``shared`` then a random tail, the last 1..max_out tokens decoded."""
    out = []
    for i in range(n):
        toks = list(shared) + tokens(rng.randint(lo, hi), rng.randrange(1 << 30))
        out.append(Request(first_id + i, toks, len(toks) - rng.randint(1, max_out),
                           scope=scope))
    return out


# EngineLoop itself now gives back the claims of a request it could not admit.
SafeLoop = EngineLoop


def suspend_all(loop: EngineLoop) -> None:
    """Suspend every running request (they go to the front of the suspended queue)."""
    for req in list(loop.running):
        loop.preempt(req)


# -- 1. statistics from another thread --------------------------------------------------------


class _Poller(threading.Thread):
    """Reads every level's storage statistics in a loop until stopped."""

    def __init__(self, m: KVCacheManager) -> None:
        super().__init__(daemon=True)
        self.m = m
        self.stop = threading.Event()
        self.errors: list[str] = []
        self.torn: list[dict[str, int]] = []
        self.snapshots = 0

    def run(self) -> None:
        nlevels = len(self.m.levels)
        while not self.stop.is_set():
            for lv in range(nlevels):
                try:
                    s = self.m.get_storage_statistics(lv)
                    fields = (s.total, s.free, s.evictable, s.unavailable, s.total_bytes,
                              s.used_bytes)
                    if not all(isinstance(x, int) for x in fields) or s.level != lv:
                        self.errors.append(f"bad snapshot {s!r}")
                except Exception as exc:  # the poller must never see one
                    self.errors.append(f"{type(exc).__name__}: {exc}")
                    continue
                self.snapshots += 1
                if (s.free + s.evictable + s.unavailable != s.total
                        or min(s.free, s.evictable, s.unavailable) < 0):
                    self.torn.append(s.as_dict())


def _resizing_workload(m: KVCacheManager, seed: int, nreq: int = 60,
                       every: int = 6) -> dict[str, int]:
    """Runs ``nreq`` requests through an EngineLoop (suspend preemption) with the check on,
    and every ``every`` steps suspends everything, resizes one level up or down and
    prefetches some suspended caches. Checks invariants every step (scheduler thread)."""
    rng = random.Random(seed)
    base = [16, 12, 40]
    loop = EngineLoop(m, chunk_tokens=8, max_batch=4, preempt_mode="suspend")
    for r in requests(nreq, rng, shared=tokens(12, 99), hi=30):
        loop.submit(r)
    counts = {"steps": 0, "resized": 0, "refused": 0, "prefetched": 0, "offload": 0,
              "onboard": 0}
    while not loop.idle:
        loop.step()
        counts["steps"] += 1
        assert_invariants(m)
        if counts["steps"] % every == 0:
            suspend_all(loop)
            lv = rng.randrange(3)
            ok = m.resize(lv, quota("full", lv, base[lv] + rng.choice([-4, 0, 4, 8])))
            counts["resized" if ok else "refused"] += 1
            assert_invariants(m)
            for req in list(loop.suspended)[:2]:
                counts["prefetched"] += req.cache.prefetch(rng.choice([0, 1]))
            assert_invariants(m)
        st = m.get_and_reset_iteration_stats()
        counts["offload"] += sum(g.offload_blocks for g in st.groups)
        counts["onboard"] += sum(g.onboard_blocks for g in st.groups)
        assert counts["steps"] < 5000, "workload does not finish"
    assert len(loop.finished) == nreq
    return counts


def test_statistics_polled_from_another_thread_never_raise_while_the_workload_verifies(
        tmp_path, cleanup):
    m = make_manager([("gpu", 16), ("host", 12), ("disk", 40)], tmp_path)
    cleanup(m)
    poller = _Poller(m)
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # interleave the two threads finely
    poller.start()
    try:
        counts = _resizing_workload(m, seed=1)
    finally:
        poller.stop.set()
        poller.join(10)
        sys.setswitchinterval(old)
    assert not poller.is_alive()
    assert poller.errors == []
    assert poller.snapshots > 300
    # (Torn snapshots, poller.torn, are possible: see the xfail test below.)
    # The workload really resized, migrated and prefetched.
    assert counts["resized"] >= 5 and counts["offload"] > 0 and counts["onboard"] > 0, counts
    # Read on the scheduler thread, the statistics always satisfy the identity.
    assert_invariants(m)


def test_a_statistics_snapshot_read_from_another_thread_satisfies_the_identity(
        tmp_path, cleanup):
    """Deterministic interleaving: the poller thread is paused (by a per-thread trace
    function) right after Store.statistics read the free count; the scheduler
    thread then grows an active cache by 3 blocks; the poller finishes its snapshot."""
    m = make_manager([("gpu", 8), ("host", 8)], tmp_path)
    cleanup(m)
    d = Driver(m)
    cache = d.create(tokens(20, 1))
    assert cache.resume()
    code = Store.statistics.__code__
    src, first = inspect.getsourcelines(Store.statistics)
    free_lines = [first + i for i, line in enumerate(src)
                  if "free = " in line and "self." in line]
    assert free_lines, "Store.statistics no longer reads the free count"
    after_free = free_lines[0]
    paused, go = threading.Event(), threading.Event()
    out: dict[str, Any] = {}

    def local(frame, event, arg):
        if (event == "line" and frame.f_lineno > after_free and after_free > 0
                and not paused.is_set()):
            paused.set()
            go.wait(5)
        return local

    def tracer(frame, event, arg):
        return local if frame.f_code is code else None

    def poll():
        sys.settrace(tracer)
        try:
            out["stats"] = m.get_storage_statistics(0)
        finally:
            sys.settrace(None)

    t = threading.Thread(target=poll)
    t.start()
    paused.wait(5)
    assert d.step(cache, 12)  # the scheduler thread takes 3 slots meanwhile
    go.set()
    t.join(10)
    s = out["stats"]
    assert s.free + s.evictable + s.unavailable == s.total, s
    assert min(s.free, s.evictable, s.unavailable) >= 0, s


# -- 2. several managers in one process -------------------------------------------------------


def _interleave(loops: Sequence[EngineLoop], check: bool = True) -> None:
    """Step every loop in turn until all are idle, checking each manager every step."""
    for _ in range(20000):
        busy = [lp for lp in loops if not lp.idle]
        if not busy:
            return
        for lp in busy:
            lp.step()
            if check:
                assert_invariants(lp.manager)
    raise AssertionError("interleaved loops did not finish")


def test_several_managers_in_one_process_verify_and_keep_independent_prefix_trees(
        tmp_path, cleanup):
    m1 = make_manager([("gpu", 12)], tmp_path / "one")
    m2 = make_manager([("gpu", 12), ("host", 10), ("disk", 30)], tmp_path / "two",
                      layout="hybrid")
    m3 = make_manager([("gpu", 14), ("host", 16)], tmp_path / "three")
    for m in (m1, m2, m3):
        cleanup(m)
    assert os.path.isdir(tmp_path / "two" / "L2")
    shared = tokens(16, 7)
    rng = random.Random(2)
    l1, l2, l3 = (SafeLoop(m, chunk_tokens=6, max_batch=3) for m in (m1, m2, m3))
    for lp, first in ((l1, 0), (l2, 100)):
        for r in requests(12, rng, first_id=first, shared=shared):
            lp.submit(r)
    _interleave([l1, l2])
    # Both cached the shared prefix; the third manager sees nothing of it.
    assert m1.probe_reuse(None, shared) >= 12
    assert m2.probe_reuse(None, shared) >= 12
    assert m3.probe_reuse(None, shared) == 0
    assert m3.tree.num_nodes == 0
    for r in requests(12, rng, first_id=200, shared=shared):
        l3.submit(r)
    for r in requests(6, rng, first_id=300, shared=shared):
        l1.submit(r)
    _interleave([l1, l2, l3])
    assert next(r for r in l3.finished if r.id == 200).reused == 0  # found nothing
    probes = [m.probe_reuse(None, shared) for m in (m1, m2, m3)]
    # A prefix only one manager has: no one else reuses it.
    only2 = tokens(20, 8)
    l2.submit(Request(400, [*only2, 5, 6, 7], 21))
    _interleave([l2])
    assert m2.probe_reuse(None, only2) >= 4
    assert m1.probe_reuse(None, only2) == 0 and m3.probe_reuse(None, only2) == 0
    # Clearing and shutting down one manager disturbs neither the others' trees nor work.
    m1.clear_reusable_blocks()
    assert m1.probe_reuse(None, shared) == 0
    assert [m.probe_reuse(None, shared) for m in (m2, m3)] == probes[1:]
    m1.shutdown()
    for lp, first in ((l2, 500), (l3, 600)):
        for r in requests(8, rng, first_id=first, shared=shared):
            lp.submit(r)
    _interleave([l2, l3])
    assert all(r.reused >= 12 for r in l2.finished[-8:] + l3.finished[-8:])
    for m in (m2, m3):
        assert_invariants(m)


def _disk_files(path) -> list[str]:
    return sorted(n for n in os.listdir(path) if n.endswith(".kvcm"))


def test_two_managers_sharing_one_disk_directory_keep_their_own_files(tmp_path, cleanup):
    # make_manager puts level i at tmp_path / f"L{i}": both managers get the same L2.
    disk = tmp_path / "L2"
    ma = make_manager([("gpu", 8), ("host", 8), ("disk", 30)], tmp_path)
    files_a = set(_disk_files(disk))
    mb = make_manager([("gpu", 8), ("host", 8), ("disk", 30)], tmp_path)
    cleanup(ma)
    cleanup(mb)
    assert ma.storage_levels.tiers[2].directory == mb.storage_levels.tiers[2].directory
    da, db = Driver(ma), Driver(mb)
    # Interleaved, the same tokens in both: each third write pushes the first to disk.
    a_caches, b_caches = [], []
    for i in range(3):
        a_caches.append(da.write(tokens(32, 10 + i), chunk=32))
        b_caches.append(db.write(tokens(32, 10 + i), chunk=32))
    for c in (a_caches[0], b_caches[0]):
        assert level_counts(c, 3)[2] > 0, "pages reached the disk level"
    all_files = set(_disk_files(disk))
    assert len(all_files) == 2 * len(files_a)  # disjoint file sets
    da.resume_and_verify(*a_caches)
    db.resume_and_verify(*b_caches)
    # Closing A removes only its files; B's disk pages are intact.
    close_all(ma)
    assert_all_free(ma)
    ma.shutdown()
    left = set(_disk_files(disk))
    assert left == all_files - files_a
    assert level_counts(b_caches[0], 3)[2] > 0  # B's first request is read from disk
    db.resume_and_verify(*b_caches)
    assert set(_disk_files(disk)) == left


# -- 3. host memory over a long run -----------------------------------------------------------


def _live_nodes(m: KVCacheManager) -> int:
    return sum(len(m.tree.subtree(root)) for root in m.tree.roots().values())


def _steady_round(m: KVCacheManager, rng: random.Random, shared: Sequence[int],
                  scope_of=lambda i: None) -> None:
    loop = EngineLoop(m, chunk_tokens=8, max_batch=4)
    for i, r in enumerate(requests(8, rng, shared=shared, hi=24)):
        r.scope = scope_of(i)
        loop.submit(r)
    loop.run()
    loop.close()  # frees the loop's batch buffers, as an engine that stops a run does
    assert m.num_open_caches == 0
    m.get_and_reset_iteration_stats()


def _measure_rounds(m: KVCacheManager, rounds: int, k: int, scope_of=lambda i: None
                    ) -> dict[int, tuple[int, int, int]]:
    """Runs ``rounds`` steady rounds; at rounds k and 2k records (traced bytes, counted
    tree nodes, live pages)."""
    rng = random.Random(3)
    shared = tokens(12, 5)
    marks: dict[int, tuple[int, int, int]] = {}
    tracemalloc.start()
    try:
        for rnd in range(1, rounds + 1):
            _steady_round(m, rng, shared, lambda i, rnd=rnd: scope_of(rnd * 100 + i))
            if rnd in (k, 2 * k):
                gc.collect()
                pages = sum(st.total - st.free for st in
                            (m.get_storage_statistics(lv) for lv in range(len(m.levels))))
                marks[rnd] = (tracemalloc.get_traced_memory()[0], m.tree.num_nodes, pages)
    finally:
        tracemalloc.stop()
    return marks


def test_host_memory_does_not_grow_over_a_long_steady_run(tmp_path, cleanup):
    m = make_manager([("gpu", 12), ("host", 12), ("disk", 24)], tmp_path)
    cleanup(m)
    total_slots = sum(m.get_storage_statistics(lv).total for lv in range(3))
    marks = _measure_rounds(m, rounds=16, k=8)
    (mem_k, nodes_k, pages_k), (mem_2k, nodes_2k, _) = marks[8], marks[16]
    # The cache is full by round k: pages and nodes are bounded by the slots.
    assert pages_k > total_slots // 2
    assert nodes_2k <= total_slots + 8 * 8  # + partial tails of the last round
    assert nodes_2k == _live_nodes(m)       # the node counter does not drift
    assert abs(nodes_2k - nodes_k) <= total_slots // 2
    # Python heap: no growth proportional to the requests served (8 rounds x 8).
    assert mem_2k - mem_k < 64 * 1024, (mem_k, mem_2k)
    assert_invariants(m)


def test_host_memory_does_not_grow_when_every_request_has_its_own_salt(tmp_path, cleanup):
    m = make_manager([("gpu", 12), ("host", 12), ("disk", 24)], tmp_path)
    cleanup(m)
    rng = random.Random(3)
    shared = tokens(12, 5)
    for rnd in range(12):
        _steady_round(m, rng, shared, lambda i, rnd=rnd: ReuseScope(salt=f"s{rnd}-{i}"))
    gc.collect()
    live_scopes = sum(1 for root in m.tree.roots().values() if m.tree.subtree(root))
    total_slots = sum(m.get_storage_statistics(lv).total for lv in range(3))
    assert live_scopes <= total_slots
    # Every scope whose blocks were all evicted is forgotten.
    assert len(m.tree.roots()) == live_scopes, (len(m.tree.roots()), live_scopes)


# -- 4. event sinks ---------------------------------------------------------------------------


class RaisingSink(EventSink):
    def __init__(self) -> None:
        self.calls = 0

    def on_events(self, events: Sequence[BlockEvent]) -> None:
        self.calls += 1
        raise RuntimeError("sink is down")


class CountingRecorder(Recorder):
    def __init__(self) -> None:
        super().__init__()
        self.batches = 0

    def on_events(self, events: Sequence[BlockEvent]) -> None:
        self.batches += 1
        super().on_events(events)


class TwoSinks:
    """A hand-registered plugin with a raising sink and a good one."""

    def __init__(self, *sinks: EventSink) -> None:
        self.sinks = list(sinks)

    @hookimpl
    def kvcm_event_sinks(self, config):
        return list(self.sinks)


@pytest.mark.parametrize("raising_first", [True, False])
def test_a_raising_event_sink_is_counted_and_warned_once_and_a_good_sink_still_gets_events(
        tmp_path, cleanup, raising_first):
    bad, good = RaisingSink(), CountingRecorder()
    pm = KvcmPluginManager()  # autoload: the built-in tiers, backends, policies
    pm.register(TwoSinks(*((bad, good) if raising_first else (good, bad))), name="sinks")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        m = make_manager([("gpu", 10), ("host", 8), ("disk", 30)], tmp_path, pm=pm)
        cleanup(m)
        loop = EngineLoop(m, chunk_tokens=8, max_batch=4, preempt_mode="suspend")
        rng = random.Random(4)
        for r in requests(40, rng, shared=tokens(12, 1), hi=24):
            loop.submit(r)
        loop.run(on_step=lambda rep: (assert_invariants(m), m.flush_events()))
        m.clear_reusable_blocks()
    sink_warnings = [w for w in caught if issubclass(w.category, RuntimeWarning)
                     and "RaisingSink" in str(w.message)]
    assert len(sink_warnings) == 1, [str(w.message) for w in caught]
    assert bad.calls == good.batches > 1
    assert m.event_sink_errors == {"RaisingSink": bad.calls}
    kinds = {e.kind for e in good.events}
    assert kinds == {EventKind.STORED, EventKind.REMOVED, EventKind.MOVED}
    moved = [e for e in good.events if e.kind is EventKind.MOVED]
    assert {(e.from_level, e.level) for e in moved} >= {(0, 1), (1, 2)}
    assert len(loop.finished) == 40 and all(r.done for r in loop.finished)


def test_two_raising_sinks_of_one_class_are_counted_and_warned_about_each_on_its_own(
        tmp_path, cleanup):
    first, second = RaisingSink(), RaisingSink()
    pm = KvcmPluginManager()
    pm.register(TwoSinks(first, second), name="sinks")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        m = make_manager([("gpu", 10), ("host", 8)], tmp_path, pm=pm)
        cleanup(m)
        d = Driver(m)
        for i in range(3):
            d.write(tokens(12, 50 + i), suspend=False).close()
            m.flush_events()
    assert first.calls == second.calls == 3
    assert m.event_sink_errors == {"RaisingSink": 3, "RaisingSink#2": 3}
    named = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)
             and "RaisingSink" in str(w.message)]
    assert len(named) == 2 and any("RaisingSink#2" in w for w in named)


# -- 5. security ------------------------------------------------------------------------------


def test_salts_isolate_scopes_under_eviction_pressure_and_across_levels(tmp_path, cleanup):
    m = make_manager([("gpu", 10), ("host", 8), ("disk", 24)], tmp_path)
    cleanup(m)
    d = Driver(m)
    a, b, never = (ReuseScope(salt="tenant-a"), ReuseScope(salt="tenant-b"),
                   ReuseScope(salt="tenant-c"))
    prompt = tokens(24, 3)
    # A writes the prompt; its pages get pushed to host and disk by pressure.
    ca = d.write(prompt, chunk=24, scope=a)
    ca.close()
    assert m.probe_reuse(a, prompt) >= 20
    fillers = [d.write(tokens(28, 50 + i), chunk=28) for i in range(3)]
    for c in fillers:
        c.close()
    a_root = m.tree.roots()[scope_root_key(a)]
    level = m.storage_levels.arena.level
    a_levels = {int(level[p]) for node in m.tree.subtree(a_root)
                for p in m.tree.pages[node].tolist() if p >= 0}
    assert a_levels & {1, 2}, f"A's blocks went below the GPU: {a_levels}"
    # Probes reveal nothing across scopes, wherever A's pages are.
    assert m.probe_reuse(b, prompt) == 0
    assert m.probe_reuse(never, prompt) == 0
    assert m.probe_reuse(None, prompt) == 0
    cb = d.create(prompt, scope=b)
    assert cb.history_length == 0  # B reuses nothing of A
    d.run_to(cb)
    cb.suspend()
    # Both scopes now hold the same tokens on separate chains with separate pages.
    a2 = d.create(prompt, scope=a)
    assert a2.history_length > 0
    assert not set(cache_pages(a2)) & set(cache_pages(cb))
    d.run_to(a2)
    a2.suspend()
    d.resume_and_verify(a2, cb)
    for c in (a2, cb):
        c.close()
    # Random pressure from many salts over the same tokens: a scope never reuses what only
    # other scopes wrote, and a never-written scope always probes 0.
    rng = random.Random(5)
    written: dict[str, int] = {}
    for i in range(30):
        salt = f"s{rng.randrange(4)}"
        scope = ReuseScope(salt=salt)
        toks = prompt if rng.random() < 0.7 else tokens(rng.randint(8, 28), 900 + i)
        seen = written.get(salt, 0) if toks is prompt else None
        c = d.create(toks, scope=scope)
        if toks is prompt and not seen:
            assert c.history_length == 0, (salt, c.history_length)
        d.run_to(c, chunk=7)
        c.close()
        if toks is prompt:
            written[salt] = 1
        for other in ("s0", "s1", "s2", "s3"):
            if other not in written:
                assert m.probe_reuse(ReuseScope(salt=other), prompt) == 0
        assert m.probe_reuse(never, prompt) == 0
        assert_invariants(m)


def test_disk_tier_files_are_0600_in_a_0700_directory(tmp_path, cleanup):
    disk = tmp_path / "L2"
    disk.mkdir(mode=0o755)
    os.chmod(disk, 0o755)
    old = os.umask(0)  # even a permissive umask must not widen the modes
    try:
        m = make_manager([("gpu", 8), ("host", 8), ("disk", 20)], tmp_path)
    finally:
        os.umask(old)
    cleanup(m)
    d = Driver(m)
    caches = [d.write(tokens(32, 30 + i), chunk=32) for i in range(3)]
    assert level_counts(caches[0], 3)[2] > 0
    assert stat.S_IMODE(os.stat(disk).st_mode) == 0o700
    # The pool files live in this manager's owner directory (0700, holding its lock).
    owners = os.listdir(disk)
    assert len(owners) == 1 and owners[0].startswith("kvcm-owner-")
    owner = disk / owners[0]
    assert stat.S_IMODE(os.lstat(owner).st_mode) == 0o700 and not owner.is_symlink()
    names = os.listdir(owner)
    assert "lock" in names and len(names) > 1
    for name in names:
        st = os.lstat(owner / name)
        assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600, name
        assert st.st_uid == os.geteuid() and st.st_nlink == 1
    d.resume_and_verify(*caches)
    # A directory path that is a symbolic link is refused, naming the field.
    link = tmp_path / "link"
    link.symlink_to(disk)
    with pytest.raises(ConfigError, match=r"levels\[1\]\.options\.path=.*link.*\(tier .disk.\)"):
        KVCacheManager(KVCacheManagerConfig(
            tokens_per_block=4, layers=[AttentionLayerConfig(
                layer_id=0, buffers=[BufferConfig(role="k", size=64)])],
            kernel_backend="numpy",
            levels=[LevelConfig(tier="gpu", quota=1 << 16),
                    LevelConfig(tier="disk", quota=1 << 16, options={"path": str(link)})]))


# -- eviction cascade -------------------------------------------------------------------------


def test_a_cascade_that_drops_an_ancestor_never_moves_its_freed_descendant(tmp_path):
    m = make_manager([("gpu", 4), ("host", 2), ("disk", 2)], tmp_path)
    try:
        _cascade_drops_an_ancestor(m)
    finally:  # best effort: the bug leaves leaked slots that the cleanup would report
        close_all_quietly(m)


def close_all_quietly(m: KVCacheManager) -> None:
    for cache in m.open_caches:
        with contextlib.suppress(Exception):
            cache.close()
    with contextlib.suppress(Exception):
        m.shutdown()


def _cascade_drops_an_ancestor(m: KVCacheManager) -> None:
    d = Driver(m)
    # X: block 0 evicted first (priority 0), block 1 last (priority 100).
    d.write(tokens(8, 1), match_len=0, suspend=False,
            priority_callback=lambda b: 0 if b == 0 else 100).close()
    d.write(tokens(12, 2), match_len=0, suspend=False).close()       # X0 -> host
    d.write(tokens(8, 3), match_len=0, suspend=False,
            priority_callback=lambda b: 1).close()                   # X0 -> disk
    x0, x1 = (m.probe_reuse(None, tokens(8, 1)[:n]) for n in (4, 8))
    assert (x0, x1) == (4, 8)
    # Every GPU page is a victim now: X1 moves to the host, whose room-making pushes host
    # pages to the disk, which drops X0 (lowest priority) and so frees X1.
    u = d.create(tokens(16, 4), match_len=0, priority_callback=lambda b: 50)
    assert u.resume()
    assert d.step(u, 16)
    d.check(u)
    assert_invariants(m)


# -- 6. soak-lite -----------------------------------------------------------------------------


def _mixed_policy_config(levels: list[LevelConfig]) -> KVCacheManagerConfig:
    layers = [
        AttentionLayerConfig(layer_id=0, buffers=[
            BufferConfig(role="k", size=64),
            BufferConfig(role="v", size=64, reuse_policy=P.OPTIONAL)]),
        AttentionLayerConfig(layer_id=1, buffers=[BufferConfig(role="k", size=32)],
                             sliding_window_size=8, num_sink_tokens=2,
                             reuse_policy=P.SINK_REQUIRED_ONLY),
        AttentionLayerConfig(layer_id=3, buffers=[
            BufferConfig(role="k", size=32, reuse_policy=P.PRIVATE)]),
        SsmLayerConfig(layer_id=2, buffers=[
            BufferConfig(role="state", size=48),
            BufferConfig(role="conv", size=16, reuse_policy=P.PRIVATE),
            BufferConfig(role="o", size=16, reuse_policy=P.OPTIONAL)]),
    ]
    return KVCacheManagerConfig(tokens_per_block=4, layers=layers, levels=levels,
                                kernel_backend=os.environ.get("KVCM_TEST_BACKEND", "numpy"),
                                commit_min_snapshot=True, max_util_for_resume=1.0)


def _soak(m: KVCacheManager, seed: int, n: int = 320) -> dict[str, int]:
    """``n`` requests in waves of 40 through an EngineLoop (suspend preemption, fingerprint
    check every step), some sharing one of four prompts, under three scopes; invariants
    every step; everything free at the end."""
    rng = random.Random(seed)
    prompts = [tokens(rng.randint(5, 21), 700 + i) for i in range(4)]
    loop = EngineLoop(m, chunk_tokens=8, max_batch=3, preempt_mode="suspend")
    reqs = []
    for i in range(n):
        toks = list(rng.choice(prompts)) if rng.random() < 0.6 else []
        toks += tokens(rng.randint(2, 28), 10_000 + i)
        scope = rng.choice([None, None, ReuseScope(salt="x"), ReuseScope(lora_id=1)])
        reqs.append(Request(i, toks, max(1, len(toks) - rng.randint(0, 6)), scope=scope))
    stats = {"preempted": 0, "reused": 0, "offload": 0, "onboard": 0, "dropped": 0}

    def on_step(rep: Any) -> None:
        m.check_invariants()
        stats["preempted"] += len(rep.preempted)
        st = m.get_and_reset_iteration_stats()
        stats["offload"] += sum(g.offload_blocks for g in st.groups)
        stats["onboard"] += sum(g.onboard_blocks for g in st.groups)
        stats["dropped"] += sum(g.dropped_blocks for g in st.groups)

    for k in range(0, len(reqs), 40):  # waves, so that some wait while others run
        loop.run(reqs[k:k + 40], max_steps=20000, on_step=on_step)
    assert len(loop.finished) == len(reqs)
    assert all(r.done for r in reqs)
    stats["reused"] = sum(1 for r in reqs if r.reused)
    assert m.num_open_caches == 0
    assert_all_free(m)
    return stats


def _soak_manager(tmp_path, gpu_quota: int, disk_quota: int) -> KVCacheManager:
    return KVCacheManager(_mixed_policy_config([
        LevelConfig(tier="gpu", quota=gpu_quota), LevelConfig(tier="host", quota=8000),
        LevelConfig(tier="disk", quota=disk_quota, options={"path": str(tmp_path / "disk")})]))


def test_soak_lite_320_requests_mixed_policies_tiny_gpu_and_host_three_levels(tmp_path,
                                                                             cleanup):
    m = _soak_manager(tmp_path, gpu_quota=5000, disk_quota=400_000)
    cleanup(m)
    stats = _soak(m, seed=6)
    assert stats["reused"] > 20 and stats["preempted"] > 10, stats
    assert stats["offload"] > 0 and stats["onboard"] > 0, stats


def test_soak_lite_with_a_tiny_last_level_too(tmp_path):
    m = _soak_manager(tmp_path, gpu_quota=9000, disk_quota=30_000)
    try:
        _soak(m, seed=6)
    finally:
        close_all_quietly(m)
