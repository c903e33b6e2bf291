"""Replaying a trace through the manager: the measured run, the infinite-cache bound and
the working set.

The measured run drives :class:`~kvcm_core.testing.engine.EngineLoop` (the scheduler the
tests use) step by step: requests are submitted when they arrive (a session's next request
``delay`` steps after its predecessor finished), the fingerprint engine checks every page
every step, and the manager's counters are read after every step.

Manager time is measured by wrapping, on the instances, the manager's ``create_kv_cache``
and ``make_room``, each cache's ``resume``, ``resize``, ``commit``, ``suspend``, ``close``,
``pages_needed`` and ``get_base_page_indices`` (the page tables the engine reads), and the
engine's batch's ``publish``, ``add_kv_cache`` and ``remove_kv_cache``; the fingerprint engine's
``check`` and ``write`` are timed apart, less the page-table reads they make.

Verification is full by default (``verify_every=1``): every page every step. For traces
too large for that, ``verify_every=N`` samples it (:class:`_Sampler`): every page of every
running request is checked at every ``N``-th step, and each request's pages at its first
step after it was admitted or resumed (where a wrong reuse or a lost migration shows
first); after a self-test corrupted a page (``--corrupt-at``) every check is full until
one has covered the corrupted request; the records are still written at every step, so a
page corrupted in between is caught at the next full check while its request runs. The
manager's invariant check then runs every ``invariants_every * N`` steps (and at the end).

The infinite-cache bound replays the requests, in the order the measured run created their
caches, through a second manager whose only level holds the whole working set (nothing is
ever evicted; the run checks that): each request looks up the same tokens (its prompt less
the last token) and then commits its whole sequence at once. So the bound uses the
manager's own matching rules (block granularity, partial reuse, sliding-window and sink
constraints), and since every request created earlier is fully committed when a request
looks up, it is an upper bound of what any cache size can reuse on that run. With SSM
layers and ``commit_min_snapshot`` the replay commits block by block, so that an SSM
snapshot is kept at every block end (the engine's chunked commits keep one at each chunk's
end that falls on a block boundary: a subset).
"""

from __future__ import annotations

import hashlib
import heapq
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import attrs
import numpy as np

from kvcm_core.cache import CacheStatus
from kvcm_core.config import AttentionLayerConfig, KVCacheManagerConfig, LevelConfig
from kvcm_core.manager import KVCacheManager
from kvcm_core.simulate.workload import TraceRequest, kinds_of
from kvcm_core.testing.engine import EngineLoop, Request, StepReport

__all__ = ["STALL_STEPS", "STEP_UNITS", "RunResult", "SchedulerConfig", "SchedulerStalled",
           "infinite_bound", "run_trace", "working_set"]

#: The step units of ``kvcm simulate`` everywhere (the table's and report's ``steps``,
#: ``--corrupt-at``, the step a failure names, the plots' x axis): engine steps that ran,
#: numbered from 0. A stretch with no request in the system (waiting for a trace's next
#: arrival) is skipped and not counted; a run of ``steps = N`` has steps 0 .. N - 1.
STEP_UNITS = ("engine steps that ran, numbered from 0; idle stretches waiting for the "
              "next arrival are skipped and not counted")

#: The default of ``[simulate] stall_steps`` (``--stall-steps``): a run in which no request
#: got further than it ever had (a token count it never reached before) and none finished,
#: for this many engine steps in a row, has stalled: requests resumed and preempted again
#: over and over, or given tokens and then recomputed from what they had before, for ever.
STALL_STEPS = 1000


class SchedulerStalled(RuntimeError):
    """The scheduler made no progress: no request advanced for too long. The message
    says at which step, which requests were stuck, and the likely cause."""

_ns = time.perf_counter_ns
_TIMED_CACHE_CALLS = ("resume", "resize", "commit", "suspend", "close", "pages_needed")


@attrs.frozen(kw_only=True)
class SchedulerConfig:
    """Scheduler knobs (the ``[simulate]`` table, besides ``workload``).

    Attributes:
        chunk_tokens: prefill chunk size.
        max_batch: most requests running at once.
        token_budget: most tokens processed per step.
        invariants_every: run the manager's invariant check every this many steps (0: only
            at the end).
        samples: about how many points the time series keep.
        stall_steps: the stall watchdog: the run fails (``SchedulerStalled``) when for
            this many engine steps in a row no request got further than it ever had (its
            history past the most tokens it ever reached: tokens recomputed after a
            preemption are not progress) and none finished.
        batch_ops: the engine grows its rows with ``Batch.resize`` and compacts them with
            ``Batch.move``, registers every attention buffer's index table, and checks the
            batch's tables (base and index) after every step's publish
            (:class:`~kvcm_core.testing.engine.EngineLoop`).
        rewind_every, rewind_draft: speculative decoding with rewinds (0: off). A model
            with SSM layers cannot rewind: ``kvcm simulate`` then runs them in a
            companion run of the same trace on the model less its SSM layers
            (``report.json``'s ``speculative``).
    """

    chunk_tokens: int = 256
    max_batch: int = 16
    token_budget: int = 1024
    invariants_every: int = 100
    samples: int = 200
    stall_steps: int = STALL_STEPS
    batch_ops: bool = False
    rewind_every: int = 0
    rewind_draft: int = 0


@attrs.define
class RunResult:
    """What one replay measured. Token counts are prompt tokens looked up and reused."""

    label: str
    levels: list[dict[str, Any]]
    steps: int = 0
    wall_s: float = 0.0
    lookup_tokens: int = 0
    hit_tokens: int = 0
    reused_blocks_by_level: list[int] = attrs.Factory(list)
    onboard_blocks: int = 0
    onboard_bytes: int = 0
    offload_blocks: int = 0
    offload_bytes: int = 0
    intra_device_copies: int = 0
    dropped_blocks: int = 0
    dropped_before_reuse: int = 0
    preemptions: int = 0
    finished: int = 0
    creation_order: list[str] = attrs.Factory(list)
    first_lookup: set[str] = attrs.Factory(set)
    #: Lookups again of a request whose earlier cache ran (resumed) and was then closed:
    #: preempted by recompute, or its cold pages lost (each [lookups, tokens, hit tokens]).
    relookups: int = 0
    relookup_tokens: int = 0
    relookup_hit_tokens: int = 0
    #: Lookups again of a request whose earlier cache never ran: its admission was
    #: refused (no room) and the cache given back while it waited, then retried.
    retry_lookups: int = 0
    retry_lookup_tokens: int = 0
    retry_hit_tokens: int = 0
    all_lookup_tokens: int = 0
    all_hit_tokens: int = 0
    by_kind: dict[str, list[int]] = attrs.Factory(dict)  # kind -> [lookup, hit]
    manager_ns: dict[str, list[int]] = attrs.Factory(dict)  # call -> [calls, ns]
    manager_ns_per_step: list[int] = attrs.Factory(list)
    manager_ns_per_request: dict[str, int] = attrs.Factory(dict)
    fingerprint_ns: int = 0
    pages_checked: int = 0
    pages_written: int = 0
    steps_checked: int = 0
    steps_fully_checked: int = 0
    fresh_checks: int = 0
    invariant_checks: int = 0
    #: Sparse layers: hits and misses of the resolves (equal to an exact LRU's, checked
    #: every step) and the entries checked after fetches; empty without sparse layers.
    sparse: dict[str, int] = attrs.Factory(dict)
    #: What the run exercised beyond plain steps: SSM snapshots taken at commit and SSM
    #: states reused, blocks encoded and decoded by lossy cold codecs, requests carrying
    #: multimodal digests, the engine's Batch.resize / Batch.move calls, speculative
    #: steps and rewinds (:attr:`EngineLoop.counters <kvcm_core.testing.engine.EngineLoop>`).
    features: dict[str, int] = attrs.Factory(dict)
    #: Per storage level with an I/O thread (level index as a string): its
    #: :class:`~kvcm_core.level_io.IOStats` counters at the end of the run.
    storage_io: dict[str, dict[str, int]] = attrs.Factory(dict)
    series: dict[str, Any] = attrs.Factory(dict)

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.lookup_tokens if self.lookup_tokens else 0.0


def bytes_per_block(config: KVCacheManagerConfig) -> int:
    """Bytes one block of tokens takes over every buffer of every layer."""
    return sum(b.size for layer in config.layers for b in layer.buffers
               if isinstance(layer, AttentionLayerConfig))


def working_set(trace: list[TraceRequest], config: KVCacheManagerConfig) -> dict[str, int]:
    """Distinct blocks (full, plus each sequence's trailing partial block) over the whole
    trace, per reuse scope: what an unbounded cache would end up holding, and its bytes."""
    tpb = config.tokens_per_block
    seen: set[bytes] = set()
    for r in trace:
        key = hashlib.blake2b(r.scope.encode(), digest_size=16).digest()
        data = r.tokens.astype("<i4").tobytes()
        step = 4 * tpb
        for off in range(0, len(data), step):
            key = hashlib.blake2b(key + data[off:off + step], digest_size=16).digest()
            seen.add(key)
    blocks = len(seen)
    largest = max((-(-len(r.tokens) // tpb) for r in trace), default=0)
    return {"blocks": blocks, "bytes": blocks * bytes_per_block(config),
            "largest_request_blocks": largest, "bytes_per_block": bytes_per_block(config)}


class _Sampler:
    """Sampled verification: which requests the fingerprint check covers this step.

    ``full`` (set by the runner before each step): check every running request. Otherwise
    only the caches marked fresh (created or resumed since their last check)."""

    def __init__(self, every: int) -> None:
        self.every = every
        self.full = True
        #: A cache whose page a self-test corrupted: every check is full until one has
        #: covered it (or it closed), so that the corruption is always looked at.
        self.pending: Any = None
        self.fresh: set[int] = set()
        self.full_steps = 0
        self.fresh_checks = 0

    def mark(self, cache: Any) -> None:
        self.fresh.add(id(cache))

    def wrap(self, check: Callable[[Any], None]) -> Callable[[Any], None]:
        def sampled(work: Any) -> None:
            work = list(work)
            fresh = [w for w in work if id(w.cache) in self.fresh]
            self.fresh_checks += len(fresh)
            for w in fresh:
                self.fresh.discard(id(w.cache))
            if self.full:
                self.full_steps += 1
                if self.pending is not None and any(w.cache is self.pending for w in work):
                    self.pending = None
                check(work)
            elif fresh:
                check(fresh)

        return sampled


class _Timers:
    """Accumulates manager time per call kind, per step and per request."""

    def __init__(self) -> None:
        self.calls: dict[str, list[int]] = defaultdict(lambda: [0, 0])
        self.step_ns = 0
        self.table_ns = 0  # page-table reads (made from inside the fingerprint engine)
        self.per_request: dict[str, int] = defaultdict(int)

    def wrap(self, name: str, fn: Callable[..., Any], owner: str | None,
             owner_of: Callable[..., str] | None = None) -> Callable[..., Any]:
        """``fn`` timed as the manager call ``name``; its time also goes to the request
        ``owner`` (or the one ``owner_of(*args)`` names), if any."""
        slot = self.calls[name]
        per_request = self.per_request

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = _ns()
            try:
                return fn(*args, **kwargs)
            finally:
                dt = _ns() - t0
                slot[0] += 1
                slot[1] += dt
                self.step_ns += dt
                if name == "page_tables":
                    self.table_ns += dt
                who = owner if owner_of is None else owner_of(*args, **kwargs)
                if who is not None:
                    per_request[who] += dt

        return timed


def _instrument(manager: KVCacheManager, loop: EngineLoop, timers: _Timers,
                res: RunResult, kinds: dict[str, str], sampler: _Sampler | None = None) -> None:
    """Time manager calls by wrapping them on the instances (EngineLoop is unchanged)."""
    create = manager.create_kv_cache
    ran: dict[str, bool] = {}  # request -> whether its current cache has resumed

    def create_kv_cache(scope: Any = None, input_tokens: Any = (), id: Any = None,
                        priority_callback: Any = None) -> Any:
        t0 = _ns()
        cache = create(scope, input_tokens, id=id, priority_callback=priority_callback)
        dt = _ns() - t0
        slot = timers.calls["create_kv_cache"]
        slot[0] += 1
        slot[1] += dt
        timers.step_ns += dt
        rid = str(id)
        timers.per_request[rid] += dt
        n, hit = len(input_tokens), cache.history_length
        if rid in res.first_lookup:
            # A lookup again, counted apart from the hit rate: after the request ran and
            # was preempted by recompute (or lost cold pages), or a retry of an admission
            # refused before it ever ran.
            if ran.get(rid):
                res.relookups += 1
                res.relookup_tokens += n
                res.relookup_hit_tokens += hit
            else:
                res.retry_lookups += 1
                res.retry_lookup_tokens += n
                res.retry_hit_tokens += hit
        else:
            res.first_lookup.add(rid)
            res.creation_order.append(rid)
            res.lookup_tokens += n
            res.hit_tokens += hit
            kind = res.by_kind[kinds[rid]]
            kind[0] += n
            kind[1] += hit
        for name in _TIMED_CACHE_CALLS:
            setattr(cache, name, timers.wrap(name, getattr(cache, name), str(id)))
        ran[rid] = False
        if sampler is not None:
            sampler.mark(cache)
        resume = cache.resume

        def resume_marked(*args: Any, **kwargs: Any) -> Any:
            ok = resume(*args, **kwargs)
            if ok:
                ran[rid] = True
                if sampler is not None:
                    sampler.mark(cache)
            return ok

        cache.resume = resume_marked  # type: ignore[method-assign]
        cache.get_base_page_indices = timers.wrap(  # type: ignore[method-assign]
            "page_tables", cache.get_base_page_indices, str(id))
        return cache

    manager.create_kv_cache = create_kv_cache  # type: ignore[method-assign]
    _count_features(manager, res)
    manager.make_room = timers.wrap(  # type: ignore[method-assign]
        "make_room", manager.make_room, None)
    batch = loop.batch
    if batch is not None:
        # The engine's batch is kvcm API the engine calls every step: publishing the page
        # tables (all running requests together), seating and unseating a request.
        batch.publish = timers.wrap(  # type: ignore[method-assign]
            "batch.publish", batch.publish, None)
        for name in ("add_kv_cache", "remove_kv_cache"):
            setattr(batch, name, timers.wrap(f"batch.{name}", getattr(batch, name), None,
                                             owner_of=lambda cache, *_a, **_k: str(cache.id)))
    engine = loop.engine
    fp = [0]

    def timed(fn: Callable[[Any], None]) -> Callable[[Any], None]:
        def run(work: Any) -> None:
            t0, tables0 = _ns(), timers.table_ns
            try:
                fn(work)
            finally:
                fp[0] += _ns() - t0 - (timers.table_ns - tables0)

        return run

    if sampler is not None:
        engine.check = sampler.wrap(engine.check)  # type: ignore[method-assign, assignment]
    for name in ("check", "write", "recompute"):
        if hasattr(engine, name):
            setattr(engine, name, timed(getattr(engine, name)))
    loop.kvcm_sim_fp_ns = fp  # type: ignore[attr-defined]



def _count_features(manager: KVCacheManager, res: RunResult) -> None:
    """Count, by wrapping on the instances, the SSM snapshots (a copy of a live SSM state
    into a snapshot page: ``Levels.copy_blocks`` of an SSM group) and the blocks encoded
    and decoded by each lossy cold codec."""
    f = res.features
    ssm = {g for g, lc in enumerate(manager.life_cycles) if lc.is_ssm}
    if ssm:
        f["ssm_snapshots"] = 0
        levels = manager.storage_levels
        copy_blocks = levels.copy_blocks

        def counted_copy(group: int, dst: Any, *args: Any, **kwargs: Any) -> Any:
            out = copy_blocks(group, dst, *args, **kwargs)
            if group in ssm:
                f["ssm_snapshots"] += len(dst)
            return out

        levels.copy_blocks = counted_copy  # type: ignore[method-assign]
    seen: set[int] = set()
    for codec in manager.codecs:
        if codec is None or codec.lossless or id(codec) in seen:
            continue
        seen.add(id(codec))
        f.setdefault("lossy_encoded_blocks", 0)
        f.setdefault("lossy_decoded_blocks", 0)
        for name in ("encode", "decode"):
            fn = getattr(codec, name)

            def counted(*args: Any, _fn: Any = fn, _key: str = f"lossy_{name}d_blocks",
                        **kwargs: Any) -> Any:
                out = _fn(*args, **kwargs)
                slots = kwargs.get("src_slots", args[3] if len(args) > 3 else ())
                f[_key] += len(slots)
                return out

            setattr(codec, name, counted)


class _SimLoop(EngineLoop):
    """EngineLoop whose preemption spares requests already given their chunk this step.

    Such a request has been resized past its history and not committed yet; giving its
    chunk back wastes the step's work, and in recompute mode EngineLoop then reads the
    closed victim's cache (None). If no other request can be preempted, the requester
    preempts itself, as EngineLoop does.
    """

    def _preempt(self, exclude: Request) -> Request | None:
        for req in reversed(self.running):
            cache = req.cache
            # (a row Batch.resize grew this step and not reached yet has no chunk yet)
            if (req is not exclude and cache.status is CacheStatus.ACTIVE
                    and (cache.capacity == cache.history_length
                         or id(req) in self._planned)):
                self._preempt_one(req)
                return req
        return None


#: Called after every step with ``(manager, loop, step)``; returns the cache whose pages it
#: corrupted (a self-test), else None: sampled verification then checks every page until a
#: check has covered that cache.
StepHook = Callable[[KVCacheManager, EngineLoop, int], Any]
Progress = Callable[[RunResult, StepReport | None], None]


def run_trace(
    config: KVCacheManagerConfig,
    trace: list[TraceRequest],
    sched: SchedulerConfig,
    *,
    label: str = "run",
    check: bool = True,
    verify_every: int = 1,
    on_step: StepHook | None = None,
    progress: Progress | None = None,
) -> RunResult:
    """Replay ``trace`` through a new manager built from ``config``.

    Args:
        config: the manager configuration (its level list is used as is).
        trace: the requests.
        sched: scheduler knobs.
        label: names the run in the report.
        check: run the fingerprint check every step (writes always happen).
        verify_every: 1: check every page every step; ``N > 1``: sampled verification
            (every page every ``N``-th step, each request at its first step after it was
            admitted or resumed, the invariant check every ``invariants_every * N``
            steps; see the module docstring).
        on_step: called after every step with ``(manager, loop, step)`` (fault injection);
            it returns the cache whose pages it corrupted, if any: with sampled
            verification the next checks are then full until one covers that cache.
        progress: called after every step with the partial result and the step's report.

    Raises:
        FingerprintMismatch: a page did not hold what a request's history says.
        AssertionError: a manager invariant broke.
        SchedulerStalled: the scheduler made no progress.
    """
    manager = KVCacheManager(config)
    levels = [{"tier": lv.tier, "quota": lv.quota} for lv in config.levels]
    res = RunResult(label=label, levels=levels,
                    reused_blocks_by_level=[0] * len(config.levels))
    res.by_kind = {k: [0, 0] for k in kinds_of(trace)}
    loop = _SimLoop(manager, chunk_tokens=sched.chunk_tokens, max_batch=sched.max_batch,
                    token_budget=sched.token_budget, check=check,
                    batch_ops=sched.batch_ops, index_tables=sched.batch_ops,
                    rewind_every=sched.rewind_every,
                    rewind_draft=sched.rewind_draft)
    timers = _Timers()
    sampler = _Sampler(verify_every) if check and verify_every > 1 else None
    _instrument(manager, loop, timers, res, {r.id: r.kind for r in trace}, sampler)
    children: dict[str, list[int]] = defaultdict(list)
    ready: list[tuple[int, int]] = []  # (step, trace index)
    for i, r in enumerate(trace):
        if r.after is None:
            ready.append((r.arrival or 0, i))
        else:
            children[r.after].append(i)
    heapq.heapify(ready)
    nlevels = len(manager.levels)  # its own levels (a keyed level has no slots)
    every = max(1, sched.invariants_every) if sched.invariants_every else 0
    if sampler is not None:
        every *= verify_every  # sampled verification samples the invariant checks too
    series: dict[str, Any] = {"step": [], "hit_rate": [], "cumulative_hit_rate": [],
                              "running": [], "manager_us": [],
                              "occupancy": [[] for _ in range(nlevels)],
                              "evictable": [[] for _ in range(nlevels)]}
    window = [0, 0, 0]  # lookup tokens, hit tokens, manager ns since the last sample
    sample_every = max(1, int(trace_span_estimate(trace, sched) / max(1, sched.samples)))
    step = 0  # the trace's clock: arrivals; it jumps over idle gaps (see STEP_UNITS)
    idle = 0  # steps in a row in which no request got further than it ever had
    furthest: dict[Any, int] = {}  # request id -> the most tokens its history ever held
    ssm_groups = {g for g, lc in enumerate(manager.life_cycles) if lc.is_ssm}
    reused_ssm = 0  # SSM states reused (from snapshots) at lookups
    t_start = time.perf_counter()
    at_end = False
    try:
        while True:
            while ready and ready[0][0] <= step:
                _, i = heapq.heappop(ready)
                r = trace[i]
                loop.submit(Request(r.id, r.items(), r.prompt_len, scope=r.scope))  # type: ignore[arg-type]
                if r.images:
                    res.features["multimodal_requests"] = \
                        res.features.get("multimodal_requests", 0) + 1
            if loop.idle:
                if not ready:
                    break
                step = ready[0][0]
                continue
            timers.step_ns = 0
            look0, hit0 = res.lookup_tokens, res.hit_tokens
            if sampler is not None:
                if sampler.pending is not None and \
                        sampler.pending.status is CacheStatus.CLOSED:
                    sampler.pending = None  # closed unchecked: main reports it undetected
                sampler.full = sampler.pending is not None or \
                    res.steps % sampler.every == 0
            report = loop.step()
            if check and report.stepped:
                res.steps_checked += 1
            res.preemptions += len(report.preempted)
            for req in report.finished:
                res.finished += 1
                for j in children.get(req.id, ()):
                    heapq.heappush(ready, (step + 1 + trace[j].delay, j))
            st = manager.get_and_reset_iteration_stats()
            res.all_lookup_tokens += st.lookup_tokens
            res.all_hit_tokens += st.hit_tokens
            for lv, n in enumerate(st.reused_blocks_by_level):
                res.reused_blocks_by_level[lv] += n
            for gi, g in enumerate(st.groups):
                if gi in ssm_groups:
                    reused_ssm += g.reused_full_blocks + g.reused_partial_blocks
                res.onboard_blocks += g.onboard_blocks
                res.onboard_bytes += g.onboard_bytes
                res.offload_blocks += g.offload_blocks
                res.offload_bytes += g.offload_bytes
                res.intra_device_copies += g.intra_device_copies
                res.dropped_blocks += g.dropped_blocks
                res.dropped_before_reuse += g.dropped_before_reuse
            res.manager_ns_per_step.append(timers.step_ns)
            window[0] += res.lookup_tokens - look0
            window[1] += res.hit_tokens - hit0
            window[2] += timers.step_ns
            idle = 0 if _progressed(loop, report, furthest) else idle + 1
            if idle >= sched.stall_steps or not (report.stepped or report.resumed
                                                 or report.finished):
                raise _stalled(config, sched, loop, res.steps, idle)
            if on_step is not None:
                corrupted = on_step(manager, loop, res.steps)
                if corrupted is not None and sampler is not None:
                    sampler.pending = corrupted
            if every and (res.steps + 1) % every == 0:
                manager.check_invariants()
                res.invariant_checks += 1
            if res.steps % sample_every == 0:
                series["step"].append(res.steps)
                series["hit_rate"].append(window[1] / window[0] if window[0] else None)
                series["cumulative_hit_rate"].append(res.hit_rate)
                series["running"].append(len(loop.running))
                series["manager_us"].append(window[2] / 1e3)
                for lv in range(nlevels):
                    s = manager.get_storage_statistics(lv)
                    series["occupancy"][lv].append(
                        (s.total - s.free) / s.total if s.total else 0.0)
                    series["evictable"][lv].append(s.evictable / s.total if s.total else 0.0)
                window = [0, 0, 0]
            res.steps += 1
            step += 1
            if progress is not None:
                progress(res, report)
        at_end = True
        manager.check_invariants()
        res.invariant_checks += 1
    except Exception as exc:
        # The failure names its step (STEP_UNITS), or the end-of-run check.
        where = "the end of the run" if at_end else f"step {res.steps}"
        exc.kvcm_step = where  # type: ignore[attr-defined]
        raise
    finally:
        res.wall_s = time.perf_counter() - t_start
        res.manager_ns = {k: list(v) for k, v in timers.calls.items()}
        res.manager_ns_per_request = dict(timers.per_request)
        res.fingerprint_ns = loop.kvcm_sim_fp_ns[0]  # type: ignore[attr-defined]
        res.pages_checked = loop.engine.checked_pages
        if sampler is not None:
            res.steps_fully_checked = sampler.full_steps
            res.fresh_checks = sampler.fresh_checks
        elif check:
            res.steps_fully_checked = res.steps_checked
        res.pages_written = loop.engine.written_pages
        if loop.sparse is not None:
            res.sparse = {"hits": loop.sparse.hits, "misses": loop.sparse.misses,
                          "entries_checked": loop.sparse.checked_entries}
        res.series = series
        for key, n in loop.counters.items():  # those of the behaviours this run had on
            if (sched.batch_ops and key.startswith("batch_")) or (
                    sched.rewind_every and sched.rewind_draft and not key.startswith("batch_")):
                res.features[key] = n
        if res.features and "multimodal_requests" not in res.features and \
                any(r.images for r in trace):
            res.features["multimodal_requests"] = 0
        if "ssm_snapshots" in res.features:
            res.features["ssm_states_reused"] = reused_ssm
        res.storage_io = {str(level): io.stats.as_dict()
                          for level, io in enumerate(manager.storage_levels.io)
                          if io is not None}
        loop.close_all()
        manager.shutdown()
    return res


def _progressed(loop: EngineLoop, report: StepReport, furthest: dict[Any, int]) -> bool:
    """Whether a step made progress: a request finished, or a running one's history went
    past the most tokens it ever held (``furthest``, updated). A request given tokens it
    had before (recomputed after a preemption) made none."""
    progressed = bool(report.finished)
    if report.stepped:
        for req in loop.running:
            cache = req.cache
            if cache is None:
                continue
            n = cache.history_length
            if n > furthest.get(req.id, 0):
                furthest[req.id] = n
                progressed = True
    for req in report.finished:
        furthest.pop(req.id, None)
    return progressed


def _stalled(config: KVCacheManagerConfig, sched: SchedulerConfig, loop: EngineLoop,
             step: int, idle: int) -> SchedulerStalled:
    stuck = [r.id for r in (*loop.running, *loop.suspended, *loop.waiting)]
    level0 = config.levels[0]
    if len(config.levels) > 1:
        cause = ("level 0 cannot hold the pages of the requests that run together, and the "
                 "colder levels cannot take the pages of the suspended ones")
    else:
        cause = "level 0 cannot hold the pages of the requests that run together"
    return SchedulerStalled(
        f"step {step}: no request advanced past the most tokens it had reached, and none "
        f"finished, for {max(1, idle)} steps (stall_steps = {sched.stall_steps}; stuck: "
        f"{', '.join(stuck[:10])}{' ...' if len(stuck) > 10 else ''}); likely cause: "
        f"{cause} (level 0: {level0.tier}, {level0.quota} bytes; max_batch="
        f"{sched.max_batch}, token_budget={sched.token_budget}): raise the quotas or lower "
        "max_batch")


def trace_span_estimate(trace: list[TraceRequest], sched: SchedulerConfig) -> int:
    """A rough number of steps the trace takes (to space the time-series samples)."""
    tokens = sum(len(r.tokens) for r in trace)
    decode = sum(r.output_len for r in trace)
    last = max((r.arrival or 0 for r in trace), default=0)
    return max(last, tokens // max(1, sched.token_budget) + decode // max(1, sched.max_batch))


def infinite_bound(config: KVCacheManagerConfig, trace: list[TraceRequest],
                   order: list[str], ws_bytes: int) -> dict[str, Any]:
    """The hit rate an unbounded cache gets on ``trace`` replayed in ``order`` (see the
    module docstring). Requests not in ``order`` (never created) follow in trace order."""
    quota = 2 * ws_bytes + 64 * bytes_per_block(config) * max(1, len(config.layers))
    cfg = attrs.evolve(config, levels=[LevelConfig(tier=config.levels[0].tier, quota=quota)],
                       max_util_for_resume=1.0)
    by_id = {r.id: r for r in trace}
    seen = set(order)
    ids = [i for i in order if i in by_id] + [r.id for r in trace if r.id not in seen]
    by_kind = {k: [0, 0] for k in kinds_of(trace)}
    lookup = hit = 0
    tpb = cfg.tokens_per_block
    snapshots = cfg.commit_min_snapshot and any(
        not isinstance(layer, AttentionLayerConfig) for layer in cfg.layers)
    t0 = time.perf_counter()
    # (with: an error closes the open cache, so that shutdown does not refuse and hide it)
    with KVCacheManager(cfg) as m:
        for rid in ids:
            r = by_id[rid]
            n = max(0, r.prompt_len - 1)
            items = r.items()
            head = items[:n].tolist() if isinstance(items, np.ndarray) else items[:n]
            cache = m.create_kv_cache(r.scope, head, id=rid)
            reused = cache.history_length
            lookup += n
            hit += reused
            by_kind[r.kind][0] += n
            by_kind[r.kind][1] += reused
            if not cache.resume() or not cache.resize(len(r.tokens)):
                raise RuntimeError("the infinite-cache replay ran out of pages (working set "
                                   "underestimated)")
            if snapshots:  # block by block: an SSM snapshot at every block end (the
                pos = cache.history_length  # most an engine's chunked commits can give)
                while pos < len(r.tokens):
                    end = min(len(r.tokens), (pos // tpb + 1) * tpb)
                    cache.commit(items[pos:end])
                    pos = end
            else:
                cache.commit(items[cache.history_length:])
            cache.close()
        stats = m.get_and_reset_iteration_stats()
        dropped = sum(g.dropped_blocks for g in stats.groups)
    return {"hit_rate": hit / lookup if lookup else 0.0, "lookup_tokens": lookup,
            "hit_tokens": hit, "dropped_blocks": dropped, "wall_s": time.perf_counter() - t0,
            "by_kind": {k: (v[1] / v[0] if v[0] else None) for k, v in by_kind.items()}}


def kind_rates(res: RunResult) -> dict[str, float | None]:
    return {k: (v[1] / v[0] if v[0] else None) for k, v in res.by_kind.items()}


def percentiles(values: list[int], scale: float) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "p50": 0.0, "p99": 0.0, "max": 0.0}
    arr = np.asarray(values, dtype=np.float64) * scale
    return {"mean": float(arr.mean()), "p50": float(np.percentile(arr, 50)),
            "p99": float(np.percentile(arr, 99)), "max": float(arr.max())}
