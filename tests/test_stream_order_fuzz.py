"""Seeded random engine sequences on streams that run in any order (a GPU's do).

An engine drives the manager on its own stream ``E`` and passes it to every call that
takes one (``resume``, ``resize``, ``commit``, ``set_beam_width``, ``prefetch``,
``make_room``, ``Batch.publish`` / ``wait_ready`` / ``record_read`` / ``resize``), writes
each step's KV with the fingerprint engine on ``E`` and checks, after every operation,
that every active cache's history still holds the records written for it, and that a
seated cache's device page-table row (read by a 'kernel' queued on ``E``) is its table.

The backend is :class:`chaos_backend.ChaosBackend`: queued work runs only when waited for
("lazy") or also at random moments ("eager"), and ``synchronize`` runs the streams in a
random order, so a missing event or host wait shows up as a wrong page or a wrong table.
Each seed also picks a model and manager variation (eager/lazy, a disk level, beams, a
sliding-window layer, a Batch, checks run now or queued on ``E``).

``KVCM_STREAM_FUZZ_SEEDS`` (default 16), ``KVCM_STREAM_FUZZ_STEPS`` (default 120) and
``KVCM_STREAM_FUZZ_FIRST`` (default 0) choose the seeds run, e.g.
``KVCM_STREAM_FUZZ_SEEDS=450 pytest tests/test_stream_order_fuzz.py``.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from chaos_backend import ChaosBackend, chaos_plugin_manager

from kvcm_core import (
    AttentionLayerConfig,
    Batch,
    BufferConfig,
    CacheStatus,
    KVCacheManager,
    KVCacheManagerConfig,
    KvcmError,
    LevelConfig,
)
from kvcm_core.testing.fingerprint import FingerprintEngine, StepWork

TPB = 4
KV = 64
BLOCK = 2 * 2 * KV  # bytes per block of one layer: k and v, TPB tokens of 16 bytes
MAXB = 8  # blocks per request at most
REWIND = 6
LOG_TAIL = 30

DEFAULT_SEEDS = 16
SEEDS = int(os.environ.get("KVCM_STREAM_FUZZ_SEEDS", str(DEFAULT_SEEDS)))
STEPS = int(os.environ.get("KVCM_STREAM_FUZZ_STEPS", "120"))
FIRST = int(os.environ.get("KVCM_STREAM_FUZZ_FIRST", "0"))


@dataclass(frozen=True)
class Variation:
    mode: str  # the chaos backend's mode: "lazy" or "eager"
    disk: bool  # a disk level under host
    beams: int  # max_beam_width
    window: bool  # layer 1 is a sliding-window layer (else full attention)
    use_batch: bool  # a Batch seats some caches; its device tables are checked
    queued_checks: bool  # half the checks are queued on E (run when E runs)

    @classmethod
    def of_seed(cls, seed: int) -> Variation:
        r = random.Random(seed * 7919 + 1)
        return cls(mode=r.choice(["lazy", "eager", "eager"]), disk=r.random() < 0.4,
                   beams=r.choice([1, 1, 2, 3]), window=r.random() < 0.3,
                   use_batch=r.random() < 0.6, queued_checks=r.random() < 0.5)


class QueuedFailure(AssertionError):
    """A check queued on the engine's stream failed when the stream ran it."""


def _known_tokens(cache: Any) -> int:
    """Tokens the cache knows (prompt and commits, less those a rewind dropped)."""
    return cache._tokens.n


def make_manager(gpu: int, host: int, disk: Path | None, beams: int, window: bool,
                 chaos: dict[str, Any]) -> KVCacheManager:
    levels = [LevelConfig(tier="gpu", quota=gpu * BLOCK),
              LevelConfig(tier="host", quota=host * BLOCK)]
    if disk is not None:
        levels.append(LevelConfig(tier="disk", quota=48 * BLOCK, options={"path": str(disk)}))

    def kv() -> list[BufferConfig]:
        return [BufferConfig(role="k", size=KV), BufferConfig(role="v", size=KV)]

    second = (AttentionLayerConfig(layer_id=1, buffers=kv(), sliding_window_size=9,
                                   num_sink_tokens=2)
              if window else AttentionLayerConfig(layer_id=1, buffers=kv()))
    layers = [AttentionLayerConfig(layer_id=0, buffers=kv()), second]
    cfg = KVCacheManagerConfig(tokens_per_block=TPB, layers=layers, levels=levels,
                               kernel_backend="chaos", max_util_for_resume=1.0,
                               max_rewind_len=REWIND, max_beam_width=beams)
    return KVCacheManager(cfg, plugin_manager=chaos_plugin_manager(**chaos))


class Req:
    def __init__(self, cache: Any, tokens: list[int]) -> None:
        self.cache = cache
        self.tokens = tokens  # the request's whole sequence (rewinds replace its tail)
        self.resumed_once = False


class Fuzz:
    """One seeded random sequence of engine operations, all on the engine's stream."""

    OPS = (("create", 3), ("resume", 4), ("step", 8), ("write_only", 2), ("suspend", 3),
           ("prefetch", 2), ("close", 1.5), ("make_room", 1.5), ("level_resize", 1),
           ("beam", 1.5), ("batch_add", 2), ("batch_resize", 3), ("batch_publish", 0.5))

    def __init__(self, seed: int, var: Variation, tmp: Path) -> None:
        self.rng = r = random.Random(seed)
        self.var = var
        self.disk = tmp / "disk" if var.disk else None
        self.m = make_manager(gpu=r.randint(5, 10), host=r.randint(6, 16), disk=self.disk,
                              beams=var.beams, window=var.window,
                              chaos={"mode": var.mode, "p": 0.35, "seed": seed})
        be = self.m.backend
        assert isinstance(be, ChaosBackend)
        self.be = be
        self.E = be.create_stream()
        self.engine = FingerprintEngine(self.m)
        self.engine.stream = self.E
        self.batch = Batch(self.m, 4, MAXB, var.beams) if var.use_batch else None
        self.failures: list[str] = []
        self.reqs: list[Req] = []
        self.prefixes = [[r.randint(0, 999) for _ in range(r.choice([0, 3, 4, 6, 8, 9]))]
                         for _ in range(3)]
        self.ops: list[str] = []

    # -- helpers ---------------------------------------------------------------------------

    def note(self, s: str) -> None:
        self.ops.append(f"#{len(self.ops)} {s}")

    def work(self, q: Req) -> list[StepWork]:
        c = q.cache
        return [StepWork(c, q.tokens, b) for b in range(c.beam_width)]

    def live(self) -> list[Req]:
        return [q for q in self.reqs if q.cache.status is not CacheStatus.CLOSED]

    def active(self) -> list[Req]:
        return [q for q in self.reqs if q.cache.status is CacheStatus.ACTIVE]

    def suspended(self) -> list[Req]:
        return [q for q in self.reqs if q.cache.status is CacheStatus.SUSPENDED]

    def seated(self, q: Req) -> bool:
        return self.batch is not None and self.batch.row_of(q.cache) is not None

    def unseat(self, q: Req) -> None:
        if self.batch is not None and self.seated(q):
            self.batch.remove_kv_cache(q.cache)
            self.note(f"batch.remove {q.cache.id}")

    def raise_queued(self) -> None:
        if self.failures:
            raise QueuedFailure("a check on the engine's stream failed: " + self.failures[0])

    def check_all(self) -> None:
        work = [w for q in self.active() for w in self.work(q)]
        if work:
            if self.var.queued_checks and self.rng.random() < 0.5:
                self.queue_check(work)
            else:
                self.engine.check(work)
        self.m.check_invariants()
        self.raise_queued()

    def queue_check(self, work: list[StepWork]) -> None:
        """The history check as a kernel queued on E: it runs when E gets to it."""
        # The pages are chosen now (as a kernel's tables are read when it is launched).
        pages = self.engine._rows(work, writing=False)
        if pages is None:
            return
        owners = self.engine._owners.copy()
        ids = [w.cache.id for w in work]
        tag = len(self.ops) - 1  # the last operation noted

        def run() -> None:
            ok = self.be.fingerprint_check_now(pages)
            if not ok.all():
                bad = int(np.nonzero(~ok)[0][0])
                self.failures.append(
                    f"queued at op #{tag}: cache {ids[int(owners[bad])]!r} block "
                    f"{int(pages.positions[bad]) // TPB} layer {int(pages.tags[bad, 0])}"
                    f" beam {int(pages.tags[bad, 1]) & 0xFFFF} does not hold its records")
        self.be.enqueue(self.E, run)

    # -- operations ------------------------------------------------------------------------

    def op_create(self) -> None:
        if len(self.live()) >= 6:
            return
        r = self.rng
        pre = list(r.choice(self.prefixes))
        n = r.randint(max(len(pre) + 1, 2), MAXB * TPB - 2)
        toks = pre + [r.randint(0, 999) for _ in range(n - len(pre))]
        k = r.randint(0, len(toks) - 1)
        c = self.m.create_kv_cache(None, toks[:k])
        self.reqs.append(Req(c, toks))
        self.note(f"create {c.id} prompt={k} hist={c.history_length}")

    def op_resume(self) -> None:
        s = self.suspended()
        if not s:
            return
        q = self.rng.choice(s)
        ok = q.cache.resume(self.E)
        self.note(f"resume {q.cache.id} -> {ok}")
        if ok and not q.resumed_once:
            q.resumed_once = True
            self.engine.recompute([StepWork(q.cache, q.tokens)])

    def _step_target(self, q: Req) -> tuple[int, int | None] | None:
        """A new capacity, and a history to rewind to (None: keep it)."""
        c = q.cache
        r = self.rng
        hist, cap = c.history_length, c.capacity
        h = None
        if r.random() < 0.25 and cap > 0:
            lo = max(c.num_committed_tokens, cap - REWIND)
            if lo <= cap:
                h = r.randint(lo, cap)
        base = hist if h is None else h
        top = min(len(q.tokens), MAXB * TPB)
        if base >= top:
            return None
        return r.randint(base + 1, min(top, base + 12)), h

    def _after_resize(self, q: Req, h: int | None, old_hist: int) -> None:
        """A rewind may reject speculative tokens: new tokens past the new history."""
        if h is not None and h < old_hist and self.rng.random() < 0.5:
            q.tokens[h:] = [self.rng.randint(0, 999) for _ in range(len(q.tokens) - h)]

    def _write_commit(self, q: Req) -> None:
        c = q.cache
        self.engine.write(self.work(q))
        known = _known_tokens(c)
        if self.rng.random() < 0.85 and c.capacity > known:
            end = self.rng.randint(known + 1, c.capacity) if self.rng.random() < 0.3 \
                else c.capacity
            c.commit(q.tokens[known:end], self.E)
            self.note(f"  commit {c.id} [{known},{end})")

    def op_step(self) -> None:
        a = [q for q in self.active() if not self.seated(q) or self.rng.random() < 0.3]
        if not a:
            return
        q = self.rng.choice(a)
        t = self._step_target(q)
        if t is None:
            return
        cap, h = t
        c = q.cache
        old_hist = c.history_length
        try:
            ok = c.resize(cap, h, stream=self.E)
        except KvcmError as exc:
            self.note(f"resize {c.id} {cap} h={h} refused: {type(exc).__name__}: {exc}")
            return
        self.note(f"resize {c.id} cap={cap} h={h} (hist was {old_hist}) -> {ok}")
        if not ok:
            return
        self._after_resize(q, h, old_hist)
        if self.seated(q):
            self.publish()
        self._write_commit(q)

    def op_write_only(self) -> None:
        """A step within capacity: write ``[history, capacity)`` and commit."""
        a = [q for q in self.active() if q.cache.capacity > q.cache.history_length]
        if not a:
            return
        q = self.rng.choice(a)
        self.note(f"write {q.cache.id}")
        self._write_commit(q)

    def op_suspend(self) -> None:
        a = self.active()
        if not a:
            return
        q = self.rng.choice(a)
        self.unseat(q)
        q.cache.suspend()
        self.note(f"suspend {q.cache.id}")

    def op_prefetch(self) -> None:
        s = self.suspended()
        if not s:
            return
        q = self.rng.choice(s)
        n = q.cache.prefetch(0, self.E)
        self.note(f"prefetch {q.cache.id} -> {n}")

    def op_close(self) -> None:
        live = self.live()
        if not live:
            return
        q = self.rng.choice(live)
        self.unseat(q)
        q.cache.close()
        self.note(f"close {q.cache.id}")
        self.reqs.remove(q)

    def op_make_room(self) -> None:
        live = self.live()
        if not live:
            return
        pages: dict[int, int] = {}
        for q in self.rng.sample(live, min(len(live), 3)):
            c = q.cache
            cap = min(c.capacity + self.rng.randint(0, 8), MAXB * TPB)
            cap = max(cap, c.history_length)
            for g, n in c.pages_needed(cap).items():
                pages[g] = pages.get(g, 0) + n
        ok = self.m.make_room(pages, self.E)
        self.note(f"make_room {pages} -> {ok}")

    def op_level_resize(self) -> None:
        """A quota change: every cache is suspended first (the engine's writes on E may
        still be queued: the moves out of released GPU slots must wait for them)."""
        if self.active():
            if self.rng.random() < 0.5:
                return
            for q in self.active():
                self.unseat(q)
                q.cache.suspend()
                self.note(f"suspend {q.cache.id}")
        level = self.rng.choice([0, 1, 1] + ([2] if self.disk is not None else []))
        lo, hi = {0: (5, 12), 1: (6, 20), 2: (24, 64)}[level]
        quota = self.rng.randint(lo, hi) * BLOCK
        ok = self.m.resize(level, quota)
        self.note(f"manager.resize({level}, {quota // BLOCK} blocks) -> {ok}")

    def op_beam(self) -> None:
        if self.var.beams < 2:
            return
        a = [q for q in self.active() if not self.seated(q)]
        if not a:
            return
        q = self.rng.choice(a)
        w = self.rng.randint(1, self.var.beams)
        ok = q.cache.set_beam_width(w, self.E)
        self.note(f"set_beam_width {q.cache.id} {w} -> {ok}")
        if ok and q.cache.capacity > q.cache.history_length:
            self.engine.write(self.work(q))  # the beams write their own [history, capacity)

    # -- batch -----------------------------------------------------------------------------

    def publish(self) -> None:
        assert self.batch is not None
        self.batch.publish(self.E)
        self.table_kernel()

    def table_kernel(self) -> None:
        """wait_ready, a 'kernel' on E reading the device tables, record_read."""
        b = self.batch
        assert b is not None
        b.wait_ready(self.E)
        groups = range(self.m.num_cache_groups)
        expect = {}
        for q in self.active():
            row = b.row_of(q.cache)
            if row is None:
                continue
            c = q.cache
            expect[row] = (c.id, [[np.asarray(c.get_base_page_indices(g, beam)).copy()
                                   for beam in range(c.beam_width)] for g in groups])
        views = [(b.page_table(g), b.num_blocks(g)) for g in groups]
        tag = len(self.ops) - 1  # the last operation noted

        def run() -> None:
            for row, (cid, per_group) in expect.items():
                for g, tables in enumerate(per_group):
                    pt, nbs = views[g]
                    nb = int(nbs[row])
                    for beam, want in enumerate(tables):
                        got = pt[row, beam, :nb]
                        if nb != len(want) or not np.array_equal(got, want):
                            self.failures.append(
                                f"queued at op #{tag}: batch row {row} ({cid}) group {g} beam "
                                f"{beam}: device table {got.tolist()} (nb {nb}), expected "
                                f"{want.tolist()}")
                            return
        self.be.enqueue(self.E, run)
        b.record_read(self.E)

    def op_batch_add(self) -> None:
        b = self.batch
        if b is None or None not in b.members:
            return
        a = [q for q in self.active() if not self.seated(q)
             and q.cache.num_blocks <= MAXB and q.cache.beam_width <= self.var.beams]
        if not a:
            return
        q = self.rng.choice(a)
        row = b.add_kv_cache(q.cache)
        self.note(f"batch.add {q.cache.id} row {row}")
        self.publish()

    def op_batch_resize(self) -> None:
        b = self.batch
        if b is None:
            return
        seated = [q for q in self.active() if self.seated(q)]
        if not seated:
            return
        caps = [-1] * b.max_rows
        hists = [-1] * b.max_rows
        use_h = self.rng.random() < 0.3
        chosen = []
        for q in seated:
            if self.rng.random() >= 0.8:
                continue
            t = self._step_target(q)
            if t is None:
                continue
            cap, h = t
            if not use_h:
                h = None
                cap = max(cap, q.cache.history_length + 1)
                if cap > min(len(q.tokens), MAXB * TPB):
                    continue
            row = b.row_of(q.cache)
            assert row is not None
            caps[row] = cap
            if h is not None:
                hists[row] = h
            chosen.append((q, h, q.cache.history_length))
        if not chosen:
            return
        hist_arg = hists if use_h else None
        try:
            out = b.resize(caps, hist_arg, stream=self.E)
        except KvcmError as exc:
            self.note(f"batch.resize {caps} {hist_arg} refused: {type(exc).__name__}: {exc}")
            self.publish()
            return
        self.note(f"batch.resize caps={caps} hist={hist_arg} -> {out}")
        self.table_kernel()
        for q, h, old in chosen:
            row = b.row_of(q.cache)
            if out[row]:
                self._after_resize(q, h, old)
                self._write_commit(q)

    def op_batch_publish(self) -> None:
        if self.batch is None:
            return
        self.note("batch.publish")
        self.publish()

    # -- driving ---------------------------------------------------------------------------

    def run(self, steps: int) -> None:
        names = [n for n, _ in self.OPS]
        weights = [w for _, w in self.OPS]
        for _ in range(steps):
            getattr(self, "op_" + self.rng.choices(names, weights)[0])()
            # a seated cache changed by a direct call: publish before the next table read
            if self.batch is not None and len(self.batch.dirty_rows()):
                self.publish()
            self.check_all()
        self.be.synchronize()
        self.raise_queued()

    def close_all(self) -> None:
        for q in list(self.reqs):
            self.unseat(q)
        for q in list(self.reqs):
            q.cache.close()
        self.reqs.clear()
        self.be.synchronize()
        self.raise_queued()


def _seeds() -> list[Any]:
    return [pytest.param(s, id=f"seed{s}") for s in range(FIRST, FIRST + SEEDS)]


@pytest.mark.parametrize("seed", _seeds())
def test_random_engine_sequences_on_streams_that_run_in_any_order_always_read_the_kv_they_wrote(
        seed: int, tmp_path: Path) -> None:
    var = Variation.of_seed(seed)
    fuzz = Fuzz(seed, var, tmp_path)
    clean = False
    try:
        try:
            fuzz.run(STEPS)
            fuzz.close_all()
        except Exception as exc:
            tail = "\n".join(fuzz.ops[-LOG_TAIL:])
            raise AssertionError(
                f"seed {seed} ({var}, {STEPS} steps) failed after {len(fuzz.ops)} operations "
                f"(rerun: KVCM_STREAM_FUZZ_FIRST={seed} KVCM_STREAM_FUZZ_SEEDS=1)\n"
                f"{type(exc).__name__}: {exc}\nlast operations:\n{tail}") from exc
        clean = True
    finally:
        try:
            fuzz.m.shutdown()
        except Exception:
            if clean:
                raise


def test_the_default_seeds_cover_every_variation() -> None:
    """The seeds run by default try each variation both ways (so a change of the seed
    mapping cannot silently drop one)."""
    vars_ = [Variation.of_seed(s) for s in range(DEFAULT_SEEDS)]
    assert {v.mode for v in vars_} == {"lazy", "eager"}
    for field in ("disk", "window", "use_batch", "queued_checks"):
        assert {getattr(v, field) for v in vars_} == {False, True}, field
    assert {v.beams for v in vars_} >= {1, 2}
