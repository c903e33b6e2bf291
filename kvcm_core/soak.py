"""``kvcm soak``: a long seeded random workload with storage faults, verified every step.

It drives :class:`~kvcm_core.testing.engine.EngineLoop` (the scheduler the tests and
``kvcm simulate`` use) over three tiny levels: GPU, host, and a disk level wrapped in the
fault-injecting tier (:class:`~kvcm_core.testing.faults.FaultyTier`). Every step it may
submit requests (prompts share a few prefixes, so blocks are reused from every level),
arm write and read faults on the disk level, and cross-check the model: ``probe_reuse``
against what ``create_kv_cache`` then reuses; every ``resize_every`` steps it suspends
every request and resizes the host or disk level's quota. The fingerprint engine checks
every page a running request needs every step (a wrong KV byte is a
:class:`FingerprintMismatch`) and ``manager.check_invariants()`` runs after every step.
At the end the leak check runs: once the loop closed its caches none may be left open
(those that are are named), and with the reusable blocks dropped every slot of every level
must be free; a leak fails the run (exit 1) and the summary says whether the check ran and
passed.

Four kinds of fault, each armed per step at its rate:

- **write**: a disk write fails (poison stored): the blocks it was moving are dropped;
- **read**: a disk read fails: the blocks are lost, the cache that needed them raises
  ``TierIOError`` at ``resume``; the loop closes it and recomputes the request (a
  *recompute*);
- **corrupt**: a byte of a stored disk page is flipped (now, or by the next write): the
  frame check fires on its next read (``CorruptPageError``; recomputed likewise);
- **slow**: a disk read or write sleeps past the level's ``io_deadline_s`` (a frozen file
  system): the operation misses its deadline (a write dropped, a read lost) and the level
  refuses I/O at once until the sleeper returns; no step waits longer than about one
  deadline (``slowest step`` in the summary). Checked without timing: every slow
  operation sleeps past the deadline on the level's thread, so each must be a miss; a run
  with fewer misses (read, write and background) than slow faults fails (a step waited
  out a sleep). The summary gives the operations that ran
  past the deadline (``deadline misses``) apart from those refused at once while the level
  was stuck (``refused at once while stuck``, the level's ``fast_fails``), and, with
  ``--write-queue-depth``, the background writes that ran past it (the level's
  ``background_misses``).

The fault-injecting tier keeps the disk tier's own I/O paths, as production uses them:
reads from the page cache on the scheduler's thread (``read_nowait``) and, with
``--write-queue-depth``, background writes on the tier's own threads (``write_behind``);
failed and corrupting writes are injected there too, while a read planned to fail or be
slow, and a write planned slow, go through the level's thread.

None may ever produce wrong KV, and every page kvcm loses must answer to a fault the
soak injected (kvcm ignoring a failed write or read, or losing pages, would otherwise pass
as "corrupt pages caught" and recomputes). The fault-injecting tier records what each
fault left in each disk slot; the soak wraps the levels' ``discard_corrupt`` and ``lose``
and ends the run (exit 1, ``losses no fault explains`` in the summary) when

- a page fails its frame check in a slot that no corrupting fault damaged (a failed read
  used as data, a page lost for nothing), or in a slot that holds the poison of a failed
  write (kvcm kept the blocks of a write that failed);
- a page is lost (a read that failed or missed its deadline) in a step in which the disk
  level met no I/O fault at all (no fault injected, no failed transfer, miss, refusal or
  failed background write).

No hypothesis at run time: the workload comes from ``numpy.random.default_rng(seed)``, so
the command runs from a plain install and a seed replays exactly, except that slow faults
make what happens while a level is stuck depend on timing.

Exit status: 0 when every step verified; 1 on wrong KV, a broken invariant, a leak, a loss
no fault explains, a deadline breach, or an exception kvcm raised (mid-run, or building the
manager): the run stops, the caches are closed and the manager shut down, the summary is
printed and stderr names the seed, the step and the error (``--debug`` adds the
traceback); 2 on a bad command line.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import numpy as np

from kvcm_core.config import AttentionLayerConfig, BufferConfig, KVCacheManagerConfig, LevelConfig
from kvcm_core.errors import ConfigError
from kvcm_core.frame import HEADER
from kvcm_core.hookspecs import hookimpl
from kvcm_core.level_io import IODeadlineError
from kvcm_core.manager import KVCacheManager
from kvcm_core.plugins import KvcmPluginManager
from kvcm_core.records import TierSpec
from kvcm_core.testing.engine import EngineLoop, Request
from kvcm_core.testing.faults import FaultPlan, FaultyTier, faulty_tier_spec
from kvcm_core.testing.fingerprint import FingerprintMismatch

__all__ = ["SoakConfig", "SoakResult", "main", "run_soak"]

_TPB = 4
_PAGE = 2 * 16 * _TPB  # one block of one layer: a k and a v page
#: Level quotas (bytes): 48, 24 and 64 blocks of both layers on GPU, host and disk.
_QUOTAS = (2 * _PAGE * 48, 2 * _PAGE * 24, 2 * _PAGE * 64)
_FAULTY = "soak-faulty-disk"
_PREFIXES = 8
_KINDS = ("write", "read", "corrupt", "slow")


def _kind(line: str) -> str:
    """The kind of one ``FaultyTier.injected`` line."""
    for word, kind in (("slow", "slow"), ("corrupted", "corrupt"), ("write", "write"),
                       ("read", "read")):
        if word in line:
            return kind
    return "other"


def _rate(instance: Any, attribute: attrs.Attribute[float], value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 1:
        raise ConfigError(f"soak.{attribute.name}", value, "must be a number in [0, 1]")


def _count(instance: Any, attribute: attrs.Attribute[int], value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"soak.{attribute.name}", value, "must be an int >= 0")


def _arrivals(instance: Any, attribute: attrs.Attribute[float], value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not (
            math.isfinite(value) and value >= 0):
        raise ConfigError(f"soak.{attribute.name}", value, "must be a finite number >= 0")


def _seconds(instance: Any, attribute: attrs.Attribute[float], value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= 60:
        raise ConfigError(f"soak.{attribute.name}", value, "must be seconds in (0, 60]")


#: The least ``slow_s - io_deadline_s`` a soak accepts (see :func:`_check_deadline`).
SLOW_MARGIN_S = 0.05

@attrs.frozen(kw_only=True)
class SoakConfig:
    """One soak run.

    Attributes:
        steps: engine steps to run.
        seed: seeds the workload and the faults.
        write_fault_rate: chance per step of arming a failed write on the disk level.
        read_fault_rate: chance per step of arming a failed read on the disk level.
        corrupt_rate: chance per step of a flipped byte in a disk page (the frame check
            fires when it is read).
        slow_rate: chance per step of a disk read or write sleeping past the deadline.
        io_deadline_s: the disk level's ``LevelConfig.io_deadline_s``.
        slow_s: how long a slow operation sleeps (more than ``io_deadline_s``).
        write_queue_depth: the disk level's ``LevelConfig.write_queue_depth`` (background
            writes; 0: none).
        arrival_rate: mean requests submitted per step (Poisson).
        probe_every: cross-check ``probe_reuse`` against ``create_kv_cache`` every this
            many steps (0: never).
        resize_every: every this many steps, suspend every request and resize the host or
            disk level's quota at random (0: never).
    """

    steps: int = attrs.field(default=1000, validator=_count)
    seed: int = attrs.field(default=0, validator=_count)
    write_fault_rate: float = attrs.field(default=0.05, validator=_rate)
    read_fault_rate: float = attrs.field(default=0.05, validator=_rate)
    corrupt_rate: float = attrs.field(default=0.02, validator=_rate)
    slow_rate: float = attrs.field(default=0.002, validator=_rate)
    io_deadline_s: float = attrs.field(default=0.1, validator=_seconds)
    slow_s: float = attrs.field(default=0.25, validator=_seconds)
    write_queue_depth: int = attrs.field(default=0, validator=_count)
    arrival_rate: float = attrs.field(default=0.5, validator=_arrivals)
    probe_every: int = attrs.field(default=5, validator=_count)
    resize_every: int = attrs.field(default=100, validator=_count)

    def __attrs_post_init__(self) -> None:
        need = max(2 * self.io_deadline_s, self.io_deadline_s + SLOW_MARGIN_S)
        if self.slow_s < need:
            raise ConfigError(
                "soak.slow_s", self.slow_s,
                f"must exceed io_deadline_s ({self.io_deadline_s}) by a margin: at least "
                f"{need:g} (twice it, and {SLOW_MARGIN_S} s past it), so that a step whose "
                "wait for the disk is woken late by a busy machine still stops waiting "
                "before the slow operation ends (the run's deadline check counts each slow "
                "operation as a miss)")


@attrs.define
class SoakResult:
    """What a soak run did. ``ok`` when no wrong KV and no broken invariant was seen."""

    steps: int = 0
    requests: int = 0
    finished: int = 0
    tokens: int = 0
    faults: int = 0
    faults_by_kind: dict[str, int] = attrs.field(factory=lambda: dict.fromkeys(_KINDS, 0))
    #: Disk reads and writes that ran past the I/O deadline (the blocks dropped or lost):
    #: the level's ``read_misses + write_misses``.
    deadline_misses: int = 0
    #: Background disk writes that ran past the deadline (the level's
    #: ``background_misses``; none without ``write_queue_depth``).
    background_misses: int = 0
    #: Disk operations refused at once, never attempted, while the level was stuck on one
    #: past its deadline (the level's ``fast_fails``), and the quota resizes among them.
    refused_while_stuck: int = 0
    resizes_refused_while_stuck: int = 0
    corrupt_pages: int = 0
    slowest_step_s: float = 0.0
    recomputes: int = 0
    probes: int = 0
    resizes: int = 0
    wrong_kv: int = 0
    invariant_breaches: int = 0
    #: Exceptions kvcm raised during the run (not wrong KV or a broken invariant): the
    #: first ends the steps; the leak check and the shutdown still run.
    errors: int = 0
    #: The traceback of the exception that failed the run (``--debug`` prints it).
    traceback: str | None = None
    #: 1 when fewer disk operations missed the I/O deadline than slow faults slept past
    #: it (a step waited out a sleep; checked at the end of the run).
    deadline_breaches: int = 0
    #: Pages lost, or failing their frame check, that no injected fault explains (the
    #: run stops at the first).
    unexplained_losses: int = 0
    #: The end-of-run leak check: None until it ran, then "" (nothing leaked) or what
    #: leaked (caches left open, slots still allocated).
    leaks: str | None = None
    seconds: float = 0.0
    failure: str | None = None

    @property
    def ok(self) -> bool:
        return (self.wrong_kv == 0 and self.invariant_breaches == 0
                and self.unexplained_losses == 0 and self.deadline_breaches == 0
                and self.errors == 0
                and self.failure is None)

    @property
    def steps_per_second(self) -> float:
        return self.steps / self.seconds if self.seconds > 0 else 0.0

    def summary_lines(self) -> list[str]:
        """The summary, a few lines of at most about 80 characters each."""
        kinds = ", ".join(f"{n} {k}" for k, n in self.faults_by_kind.items())
        if self.leaks is None:
            leak = "leak check not run (the run stopped first)"
        elif self.leaks:
            leak = f"leak check FAILED: {self.leaks}"
        else:
            leak = "leak check passed (no open cache, no slot held)"
        return [
            f"steps {self.steps}, {self.steps_per_second:.0f} steps/s, slowest step "
            f"{self.slowest_step_s * 1000:.0f} ms",
            f"requests {self.requests} ({self.finished} finished, {self.tokens} tokens)",
            f"faults injected {self.faults} ({kinds})",
            f"disk I/O: deadline misses {self.deadline_misses} (ran past it), "
            f"refused at once while stuck {self.refused_while_stuck}",
            f"disk background writes past the deadline {self.background_misses}",
            f"corrupt pages caught {self.corrupt_pages}, recomputes {self.recomputes}, "
            f"probes {self.probes}, quota resizes {self.resizes}",
            f"wrong KV {self.wrong_kv}, invariant breaches {self.invariant_breaches}, "
            f"losses no fault explains {self.unexplained_losses}, kvcm errors {self.errors}",
            leak,
        ]

    def summary(self) -> str:
        """The summary as one text of a few lines."""
        return "\n".join(self.summary_lines())

    def progress_line(self) -> str:
        """A short line for progress reports."""
        return (f"requests {self.requests} ({self.finished} finished), faults "
                f"{self.faults}, deadline misses {self.deadline_misses}, refused "
                f"{self.refused_while_stuck}, recomputes {self.recomputes}, wrong KV "
                f"{self.wrong_kv}")


class _TierPlugin:
    def __init__(self, spec: TierSpec) -> None:
        self.spec = spec

    @hookimpl
    def kvcm_tiers(self) -> Any:
        yield self.spec


def _layers() -> list[AttentionLayerConfig]:
    """Tiny: a full-attention layer and a windowed one with sinks (two life cycles)."""
    kv = [BufferConfig(role="k", size=16 * _TPB), BufferConfig(role="v", size=16 * _TPB)]
    return [AttentionLayerConfig(layer_id=0, buffers=kv),
            AttentionLayerConfig(layer_id=1, buffers=kv, sliding_window_size=8,
                                 num_sink_tokens=4)]


def _manager(directory: str, plan: FaultPlan, deadline: float = 0.1, depth: int = 0
             ) -> KVCacheManager:
    pm = KvcmPluginManager()
    pm.register(_TierPlugin(faulty_tier_spec(pm.tier("disk"), plan, name=_FAULTY)),
                name="soak-faults")
    return KVCacheManager(KVCacheManagerConfig(
        tokens_per_block=_TPB, layers=_layers(), kernel_backend="numpy",
        max_util_for_resume=1.0,
        levels=[LevelConfig(tier="gpu", quota=_QUOTAS[0]),
                LevelConfig(tier="host", quota=_QUOTAS[1]),
                LevelConfig(tier=_FAULTY, quota=_QUOTAS[2], io_deadline_s=deadline,
                            write_queue_depth=depth, options={"path": directory})]),
        plugin_manager=pm)


def _resize_cold_level(m: KVCacheManager, loop: EngineLoop, rng: np.random.Generator) -> bool:
    """Suspend every running request (``manager.resize`` needs that), then give the host
    or the disk level a random quota between half and one and a half of its first one.
    Returns whether the resize was done (a refusal changes nothing)."""
    for req in list(loop.running):
        loop.preempt(req)
    level = int(rng.integers(1, 3))
    return m.resize(level, int(_QUOTAS[level] * rng.uniform(0.5, 1.5)))


class _Workload:
    """Seeded requests: one of a few shared prefixes, a private suffix, a short answer."""

    def __init__(self, rng: np.random.Generator) -> None:
        self.rng = rng
        self.prefixes = [self._tokens(int(rng.integers(4, 41))) for _ in range(_PREFIXES)]
        self.ids = 0

    def _tokens(self, n: int) -> list[int]:
        return self.rng.integers(1, 30000, n).tolist()

    def prompt(self) -> list[int]:
        rng = self.rng
        prefix = self.prefixes[int(rng.integers(len(self.prefixes)))]
        return prefix + self._tokens(int(rng.integers(1, 16)))

    def request(self) -> Request:
        prompt = self.prompt()
        self.ids += 1
        answer = self._tokens(int(self.rng.integers(1, 13)))
        return Request(self.ids, prompt + answer, prompt_len=len(prompt))


def _arm_faults(cfg: SoakConfig, rng: np.random.Generator, tier: FaultyTier,
                m: KVCacheManager) -> None:
    """Make one of the next few disk writes (reads) fail, flip a byte of a disk page, make
    a disk operation slow, at the configured rates."""
    plan = tier.plan
    if rng.random() < cfg.write_fault_rate:
        plan.fail_writes.add(tier.writes + int(rng.integers(1, 4)))
    if rng.random() < cfg.read_fault_rate:
        plan.fail_reads.add(tier.reads + int(rng.integers(1, 4)))
    if rng.random() < cfg.corrupt_rate:
        _corrupt(rng, tier, m)
    if rng.random() < cfg.slow_rate:
        if rng.random() < 0.5:
            plan.slow_writes.add(tier.writes + int(rng.integers(1, 4)))
        else:
            plan.slow_reads.add(tier.reads + int(rng.integers(1, 4)))


def _corrupt(rng: np.random.Generator, tier: FaultyTier, m: KVCacheManager) -> None:
    """Flip a byte of a page stored on the disk level now (preferring one likely to be
    read), or, when the level holds none, of the next write: in the header (magic, key,
    sequence, length) or anywhere."""
    L = m.storage_levels
    store = L.stores[2][int(rng.integers(len(L.stores[2])))]
    pages = store.pages()
    slot_bytes = store.pools[0].slot_bytes
    # Half the flips in the header (magic, key, sequence, length), half anywhere.
    head = HEADER.itemsize if rng.random() < 0.5 else slot_bytes
    tier.plan.corrupt_offset = int(rng.integers(head))
    a = L.arena
    # A page likely to be read: a suspended request's (read at its resume), else a
    # reusable block that was reused before (a shared prefix).
    for likely in (pages[a.holds[pages] > 0], pages[a.reused[pages] > 0]):
        if len(likely):
            pages = likely
            break
    if len(pages):
        pid = int(pages[int(rng.integers(len(pages)))])
        tier.corrupt(store.pools[0], int(a.slot[pid]))
    else:
        tier.plan.corrupt_writes.add(tier.writes + 1)


def _probe(m: KVCacheManager, work: _Workload) -> None:
    """The model check: ``probe_reuse`` equals what ``create_kv_cache`` reuses."""
    tokens = work.prompt()
    expected = m.probe_reuse(None, tokens)
    cache = m.create_kv_cache(None, tokens)
    got = cache.history_length
    cache.close()
    if got != expected:
        raise AssertionError(f"probe_reuse said {expected} tokens, create_kv_cache reused {got}")


class _Unexplained(Exception):
    """A page lost, or failing its frame check, that no injected fault explains."""


def _fault_signal(m: KVCacheManager, tier: FaultyTier) -> tuple[int, ...]:
    """Counters that grow whenever the disk level met an I/O fault: the faults injected,
    the core's failed transfers, and the level's misses, refusals and failed background
    writes."""
    L = m.storage_levels
    io = L.io[2]
    st = () if io is None else (io.stats.read_misses, io.stats.write_misses,
                                io.stats.fast_fails, io.stats.bad_reads,
                                io.stats.background_failures, io.stats.background_misses)
    return (len(tier.injected), L.stats.io_failures, *st)


class _LossWatch:
    """Holds kvcm to the faults the soak injected: every page the frame check rejects
    must sit in a disk slot that a corrupting fault damaged (not in one a failed write
    poisoned: kvcm must have dropped those blocks), and every page lost otherwise
    (``lose``: a read that failed or missed its deadline) must be lost in a step in which
    the disk level met an I/O fault. Wraps ``discard_corrupt`` and ``lose`` of the
    manager's levels on the instance; the first violation is kept in ``problem`` (the
    soak ends the run with it; raising inside kvcm would only test its error paths)."""

    def __init__(self, m: KVCacheManager, tier: FaultyTier) -> None:
        self.m = m
        self.tier = tier
        self.problem: str | None = None
        self.signal = _fault_signal(m, tier)
        self._discarding = 0
        L = m.storage_levels
        discard, lose = L.discard_corrupt, L.lose

        def discard_corrupt(store: Any, pids: np.ndarray, queued: bool = True) -> None:
            if self.problem is None:
                for pid in np.asarray(pids).tolist():
                    self._check_corrupt(store, int(pid))
            self._discarding += 1
            try:
                discard(store, pids, queued)
            finally:
                self._discarding -= 1

        def lost(pid: int) -> None:
            if not self._discarding and self.problem is None and \
                    _fault_signal(self.m, self.tier) == self.signal:
                a = L.arena
                self.problem = (f"page {pid} (level {int(a.level[pid])}, slot "
                                f"{int(a.slot[pid])}) was lost, but the disk level met no "
                                "I/O fault in this step")
            lose(pid)

        L.discard_corrupt = discard_corrupt  # type: ignore[method-assign]
        L.lose = lost  # type: ignore[method-assign]

    def _check_corrupt(self, store: Any, pid: int) -> None:
        slot = int(self.m.storage_levels.arena.slot[pid])
        where = f"page {pid} (level {store.level}, slot {slot}) failed its frame check"
        damage = self.tier.damage(store.pools[0], slot) if store.level == 2 else None
        if damage == "corrupt":
            return
        if damage == "failed write":
            self.problem = (f"{where}: the slot holds the poison of a failed write, whose "
                            "blocks kvcm should have dropped")
        else:
            self.problem = f"{where}, but no injected fault damaged it"

    def start(self) -> None:
        """A new part of a step: losses from here on need a fault from here on."""
        self.signal = _fault_signal(self.m, self.tier)

    def check(self) -> None:
        """Raise :class:`_Unexplained` if kvcm lost a page no fault explains."""
        if self.problem is not None:
            raise _Unexplained(self.problem)


def run_soak(cfg: SoakConfig, on_step: Callable[[int, SoakResult], None] | None = None
             ) -> SoakResult:
    """Run ``cfg.steps`` verified steps; never raises for wrong KV, a broken invariant or
    an exception kvcm raises once the manager is built (they end the run, are counted in
    the result and named in ``failure``; the leak check and the shutdown still run)."""
    rng = np.random.default_rng(cfg.seed)
    work = _Workload(rng)
    result = SoakResult()
    plan = FaultPlan()
    with tempfile.TemporaryDirectory(prefix="kvcm-soak-") as directory:
        plan.slow_s = cfg.slow_s
        m = _manager(directory, plan, cfg.io_deadline_s, cfg.write_queue_depth)
        tier = m.storage_levels.tiers[2]
        assert isinstance(tier, FaultyTier)
        loop = EngineLoop(m, chunk_tokens=16, max_batch=6, preempt_mode="suspend",
                          recompute_lost=True)
        _count_refused_resizes(m, result)
        watch = _LossWatch(m, tier)
        start = time.perf_counter()
        every = max(1, cfg.steps // 20)

        def tally(since: float) -> None:
            """Fill in the counts that live elsewhere (at the end and every 5%, so a
            progress line shows the figures of a run that is stopped early)."""
            result.seconds = time.perf_counter() - since
            result.faults = len(tier.injected)
            result.faults_by_kind = dict.fromkeys(_KINDS, 0)
            for line in tier.injected:
                kind = _kind(line)
                result.faults_by_kind[kind] = result.faults_by_kind.get(kind, 0) + 1
            io = m.storage_levels.io[2]
            if io is not None:  # (a refusal at once is in fast_fails only, in no miss)
                st = io.stats
                result.refused_while_stuck = st.fast_fails
                result.deadline_misses = st.read_misses + st.write_misses
                result.background_misses = st.background_misses
            result.corrupt_pages = m.storage_levels.stats.corrupt_pages
            result.recomputes = loop.lost_resumes

        try:
            for step in range(cfg.steps):
                if len(loop.waiting) < 12:
                    for _ in range(int(rng.poisson(cfg.arrival_rate))):
                        loop.submit(work.request())
                        result.requests += 1
                _arm_faults(cfg, rng, tier, m)
                watch.start()
                t0 = time.perf_counter()
                report = loop.step()
                result.slowest_step_s = max(result.slowest_step_s, time.perf_counter() - t0)
                watch.check()
                m.check_invariants()
                if cfg.probe_every and step % cfg.probe_every == 0:
                    watch.start()
                    _probe(m, work)
                    watch.check()
                    result.probes += 1
                if cfg.resize_every and step % cfg.resize_every == cfg.resize_every - 1:
                    watch.start()
                    result.resizes += _resize_cold_level(m, loop, rng)
                    watch.check()
                    m.check_invariants()
                result.steps += 1
                result.tokens += report.tokens
                result.finished += len(report.finished)
                loop.finished.clear()  # a long run keeps no finished request
                if (step + 1) % every == 0:
                    tally(start)
                if on_step is not None:
                    on_step(step, result)
        except FingerprintMismatch as exc:
            result.wrong_kv += 1
            result.failure = f"step {result.steps}: wrong KV: {exc}"
        except AssertionError as exc:
            result.invariant_breaches += 1
            result.failure = f"step {result.steps}: invariant broken: {exc}"
        except _Unexplained as exc:
            result.unexplained_losses += 1
            result.failure = f"step {result.steps}: {exc}"
        except Exception as exc:  # kvcm raised mid-run: reported, and still shut down
            _raised(result, exc, f"step {result.steps}")
        try:
            tally(start)
            io = m.storage_levels.io[2]
            loop.close_all()
            leak = _leaks(m)
            result.leaks = leak
            if leak and result.failure is None:
                result.invariant_breaches += 1
                result.failure = f"after {result.steps} steps: leaked: {leak}"
            if io is not None:
                io.wait_idle(cfg.slow_s * 4)  # a slow operation still sleeping: let it return
                tally(start)  # (a background write that returned late is a miss now)
                _check_deadline(result)
        except Exception as exc:
            _raised(result, exc, f"after {result.steps} steps, checking the end")
        finally:
            try:
                m.shutdown()
            except Exception as exc:
                _raised(result, exc, f"after {result.steps} steps, shutting down")
    return result


def _raised(result: SoakResult, exc: Exception, where: str) -> None:
    """kvcm raised ``exc`` (not a check of the soak): counted, and the run's failure (if
    it is the first) names where, the type and the message; the traceback is kept for
    ``--debug``."""
    result.errors += 1
    if result.failure is None:
        result.failure = f"{where}: {type(exc).__name__}: {exc}"
        result.traceback = traceback.format_exc()


def _check_deadline(result: SoakResult) -> None:
    """Every slow operation slept past the deadline, on the level's thread: each must have
    been a miss (a read or write the caller stopped waiting for, or a background write
    past it). Fewer misses than slow faults means a step waited out a sleep. This leans on
    the margin ``SoakConfig`` demands between ``slow_s`` and ``io_deadline_s`` (at least
    as much again, and :data:`SLOW_MARGIN_S`): a waiter the machine wakes later than that
    past its deadline finds the slow operation done, uses its result, and counts no miss
    (only a machine far too busy to run the soak does that)."""
    slow = result.faults_by_kind["slow"]
    misses = result.deadline_misses + result.background_misses
    if slow > misses and result.failure is None:
        result.deadline_breaches += 1
        result.failure = (f"after {result.steps} steps: {slow} disk operations slept past "
                          f"the I/O deadline but only {misses} missed it: a step waited "
                          "for a frozen disk beyond the deadline")


def _count_refused_resizes(m: KVCacheManager, result: SoakResult) -> None:
    """Count the disk level's quota resizes refused at once while it was stuck (its
    ``fast_fails`` count them with the refused reads and writes; wraps the level's
    ``call`` on the instance)."""
    io = m.storage_levels.io[2]
    if io is None:
        return
    call = io.call

    def counted(fn: Any, what: str, kind: str, *args: Any, **kwargs: Any) -> None:
        try:
            call(fn, what, kind, *args, **kwargs)
        except IODeadlineError as exc:
            if kind == "resize" and not exc.attempted:
                result.resizes_refused_while_stuck += 1
            raise

    io.call = counted  # type: ignore[method-assign]


def _leaks(m: KVCacheManager) -> str:
    """After the loop closed its caches, none may be left open (those that are, are named,
    then closed so that the check goes on), and with the reusable blocks dropped every slot
    of every level must be free; returns what leaked (empty when nothing did)."""
    leaks = []
    left = m.open_caches
    if left:
        ids = ", ".join(repr(c.id) for c in left[:10]) + (" ..." if len(left) > 10 else "")
        leaks.append(f"{len(left)} caches left open ({ids})")
        for cache in left:
            cache.close()
    m.clear_reusable_blocks()
    for level in range(len(m.levels)):
        stats = m.get_storage_statistics(level)
        if stats.free != stats.total:
            leaks.append(f"level {level}: {stats.total - stats.free} of {stats.total} slots")
    return "; ".join(leaks)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvcm soak",
        description="A seeded random workload over GPU, host and disk levels with injected "
        "disk write and read failures, corrupted disk pages and disk I/O past its deadline; "
        "every step fingerprint-verified and invariant-"
        "checked. Exit 1 on any wrong KV, broken invariant, leak, or lost page no injected "
        "fault explains.")
    p.add_argument("--steps", type=int, default=1000, help="engine steps (default 1000)")
    p.add_argument("--seed", type=int, default=0, help="workload and fault seed, an int >= 0")
    p.add_argument("--write-fault-rate", type=float, default=0.05,
                   help="chance per step of a failed disk write (default 0.05)")
    p.add_argument("--read-fault-rate", type=float, default=0.05,
                   help="chance per step of a failed disk read (default 0.05)")
    p.add_argument("--corrupt-rate", type=float, default=0.02,
                   help="chance per step of a flipped byte in a disk page (default 0.02)")
    p.add_argument("--slow-rate", type=float, default=0.002,
                   help="chance per step of a disk operation sleeping past the I/O "
                   "deadline (default 0.002)")
    p.add_argument("--io-deadline", type=float, default=0.1,
                   help="the disk level's io_deadline_s (default 0.1)")
    p.add_argument("--slow-s", type=float, default=0.25,
                   help="seconds a slow operation sleeps (default 0.25; at least twice "
                   "--io-deadline and 0.05 s past it)")
    p.add_argument("--write-queue-depth", type=int, default=0,
                   help="background disk writes in flight (default 0: none)")
    p.add_argument("--quiet", action="store_true", help="only the final line")
    p.add_argument("--debug", action="store_true",
                   help="print the traceback of an exception that failed the run")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        cfg = SoakConfig(steps=args.steps, seed=args.seed,
                         write_fault_rate=args.write_fault_rate,
                         read_fault_rate=args.read_fault_rate,
                         corrupt_rate=args.corrupt_rate, slow_rate=args.slow_rate,
                         io_deadline_s=args.io_deadline, slow_s=args.slow_s,
                         write_queue_depth=args.write_queue_depth)
    except (ConfigError, ValueError) as exc:
        print(f"kvcm soak: {exc}", file=sys.stderr)
        return 2
    every = max(1, cfg.steps // 20)

    def progress(step: int, result: SoakResult) -> None:
        if not args.quiet and (step + 1) % every == 0:
            print(f"  {step + 1}/{cfg.steps}: {result.progress_line()}", flush=True)

    try:
        result = run_soak(cfg, progress)
    except Exception as exc:  # building the manager failed: nothing ran
        if args.debug:
            traceback.print_exc()
        print(f"kvcm soak (seed {cfg.seed}): FAILED before the first step: "
              f"{type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    print(f"kvcm soak (seed {cfg.seed}):")
    for line in result.summary_lines():
        print(f"  {line}")
    if not result.ok:
        if args.debug and result.traceback:
            print(result.traceback, file=sys.stderr, end="")
        hint = " (--debug for the traceback)" if result.traceback and not args.debug else ""
        print(f"kvcm soak (seed {cfg.seed}): FAILED: {result.failure}{hint}", file=sys.stderr)
        return 1
    return 0
