"""``kvcm simulate --preset two-engine``: two engine instances sharing one Redis level.

Two managers (what two engine processes would each hold: their own GPU and host levels)
serve one seeded trace; the turns of a conversation alternate between them (turn ``k`` of
session ``s`` goes to engine ``(s + k) % 2``), so a turn finds its conversation's earlier
turns only in the other engine, unless the engines share a level. Three runs of the same
trace, each verified by the fingerprint engine at every step in both engines:

1. **shared**: both managers have a ``redis`` level on one ``redis-server`` the run starts
   on a free loopback port (and stops);
2. **local only**: the same managers without the Redis level;
3. **GPU only**: level 0 alone.

The report gives each run's hit rate (prompt tokens reused over prompt tokens looked up,
first lookups only) and the infinite-cache bound of the trace (one unbounded cache that
sees every request: what perfect sharing would give). After each engine step both managers
wait for the writes they queued (``flush_remote``): a real step lasts longer than a
loopback write, and the run's figures then do not depend on thread timing.

The report and the summary say how many engine steps and pages were checked. A failure
ends as the single-engine run's does: one line on stderr (``verification failed: ...``,
exit 1, for a fingerprint mismatch or a broken invariant; exit 3 for other failures) and
``report.json`` with ``verification.ok = false`` and the traceback. The preset refuses
(exit 2) the options it cannot apply: ``--corrupt-at``, ``--verify-every`` (it always
checks every page at every step), ``--gpu-only``, ``--no-compare``, ``--duration`` and
``--trace``.
"""

from __future__ import annotations

import argparse
import heapq
import json
import time
import traceback
from collections import defaultdict
from pathlib import Path
from typing import Any

import attrs
from rich.markup import escape

from kvcm_core.config import KVCacheManagerConfig
from kvcm_core.console import OutputError, atomic_output
from kvcm_core.errors import ConfigError, PluginError
from kvcm_core.manager import KVCacheManager
from kvcm_core.simulate.runner import (
    SchedulerConfig,
    SchedulerStalled,
    infinite_bound,
    working_set,
)
from kvcm_core.simulate.workload import TraceRequest, generate_trace
from kvcm_core.testing.engine import EngineLoop, Request

__all__ = ["EnginesResult", "run_engines", "run_two_engine"]

ENGINES = 2


@attrs.define
class EnginesResult:
    """One run of the trace over the engines."""

    label: str
    lookup_tokens: int = 0
    hit_tokens: int = 0
    steps: int = 0
    remote_blocks: int = 0
    reused_blocks_by_level: list[int] = attrs.Factory(list)
    creation_order: list[str] = attrs.Factory(list)
    per_engine: list[list[int]] = attrs.Factory(list)  # [lookup, hit] per engine
    remote: list[dict[str, int]] = attrs.Factory(list)  # remote statistics per engine
    #: Engine steps (over both engines) whose pages the fingerprint engine checked, and the
    #: pages it checked: every page of every stepped request, every step.
    steps_checked: int = 0
    pages_checked: int = 0
    wall_s: float = 0.0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.lookup_tokens if self.lookup_tokens else 0.0

    def as_dict(self) -> dict[str, Any]:
        out = attrs.asdict(self)
        del out["creation_order"]
        out["hit_rate"] = self.hit_rate
        return out


class _Loop(EngineLoop):
    """An engine loop that counts each request's first lookup."""

    def __init__(self, manager: KVCacheManager, res: EnginesResult, engine: int,
                 sched: SchedulerConfig) -> None:
        super().__init__(manager, chunk_tokens=sched.chunk_tokens, max_batch=sched.max_batch,
                         token_budget=sched.token_budget, check=True)
        create = manager.create_kv_cache
        seen: set[Any] = set()

        def counted(scope: Any = None, input_tokens: Any = (), id: Any = None,
                    priority_callback: Any = None) -> Any:
            cache = create(scope, input_tokens, id=id, priority_callback=priority_callback)
            if id not in seen:
                seen.add(id)
                res.creation_order.append(id)
                res.lookup_tokens += len(input_tokens)
                res.hit_tokens += cache.history_length
                res.per_engine[engine][0] += len(input_tokens)
                res.per_engine[engine][1] += cache.history_length
            return cache

        manager.create_kv_cache = counted  # type: ignore[method-assign]


def run_engines(config: KVCacheManagerConfig, trace: list[TraceRequest],
                sched: SchedulerConfig, label: str, engines: int = ENGINES,
                result: EnginesResult | None = None) -> EnginesResult:
    """Replay ``trace`` over ``engines`` managers built from ``config`` (the turns of a
    session alternate between them), verified at every step. ``result``: filled in place
    (what a failed run got to is then still at hand).

    Raises:
        FingerprintMismatch: a page did not hold what a request's history says.
        AssertionError: a manager invariant broke.
        SchedulerStalled: no engine made progress for a long time.
    """
    res = result if result is not None else EnginesResult(label=label)
    res.per_engine = [[0, 0] for _ in range(engines)]
    managers: list[KVCacheManager] = []
    loops: list[_Loop] = []
    t0 = time.perf_counter()
    at_end = False
    try:
        for e in range(engines):
            managers.append(KVCacheManager(config))
            loops.append(_Loop(managers[-1], res, e, sched))
        res.reused_blocks_by_level = [0] * len(managers[0].levels)
        children: dict[str, list[int]] = defaultdict(list)
        ready: list[tuple[int, int]] = []
        for i, r in enumerate(trace):
            if r.after is None:
                ready.append((r.arrival or 0, i))
            else:
                children[r.after].append(i)
        heapq.heapify(ready)
        remote = managers[0].remote is not None
        step = idle = 0
        every = sched.invariants_every
        while True:
            while ready and ready[0][0] <= step:
                _, i = heapq.heappop(ready)
                r = trace[i]
                items = r.items()  # (images as their digests)
                loops[(r.session + r.turn) % engines].submit(Request(
                    r.id, items if isinstance(items, list) else items.tolist(), r.prompt_len,
                    scope=r.scope))
            if all(loop.idle for loop in loops):
                if not ready:
                    break
                step = ready[0][0]
                continue
            progressed = False
            for loop in loops:
                if loop.idle:
                    continue
                report = loop.step()
                if report.stepped:
                    res.steps_checked += 1
                progressed |= bool(report.stepped or report.finished)
                for req in report.finished:
                    for j in children.get(req.id, ()):
                        heapq.heappush(ready, (step + 1 + trace[j].delay, j))
            for m in managers:
                if remote:
                    m.flush_remote(10.0)
                st = m.get_and_reset_iteration_stats()
                res.remote_blocks += st.remote_blocks
                for lv, n in enumerate(st.reused_blocks_by_level):
                    res.reused_blocks_by_level[lv] += n
            idle = 0 if progressed else idle + 1
            if idle >= sched.stall_steps:
                raise SchedulerStalled(f"step {res.steps}: no engine advanced for {idle} steps")
            if every and (res.steps + 1) % every == 0:
                for m in managers:
                    m.check_invariants()
            res.steps += 1
            step += 1
        at_end = True
        for m in managers:
            m.check_invariants()
            if remote:
                res.remote.append(attrs.asdict(m.get_remote_statistics()))
    except Exception as exc:
        # Named in the failure's message, in the single-engine run's step units.
        exc.kvcm_step = ("the end of the run" if at_end  # type: ignore[attr-defined]
                         else f"step {res.steps} of the {label} run")
        raise
    finally:
        res.wall_s = time.perf_counter() - t0
        res.pages_checked = sum(loop.engine.checked_pages for loop in loops)
        for loop in loops:
            loop.close_all()
        for m in managers:
            m.shutdown()
    return res


def _levels(raw: dict[str, Any], fractions: tuple[float, ...] | None,
            ws: dict[str, int]) -> list[dict[str, Any]]:
    levels = [dict(lv) for lv in raw["levels"]]
    if fractions is not None:
        if len(fractions) != len(levels):
            raise ConfigError("simulate.level_fractions", list(fractions),
                              f"needs one fraction per level ({len(levels)})")
        floor = 2 * (ws["largest_request_blocks"] + 1) * ws["bytes_per_block"]
        for i, (lv, frac) in enumerate(zip(levels, fractions, strict=True)):
            lv["quota"] = max(floor if i == 0 else 1, int(frac * ws["bytes"]))
    return levels


def run_two_engine(args: argparse.Namespace, out: Path, console: Any, err: Any) -> int:
    """Run the two-engine comparison (``main`` of ``kvcm simulate`` calls it); returns
    the exit status."""
    from kvcm_core.plugins import get_plugin_manager
    from kvcm_core.simulate import _classify, _fail, load_config
    from kvcm_core.testing.redis_server import RedisServer, redis_binaries

    found = redis_binaries()
    if isinstance(found, str):
        err.print(f"kvcm simulate --preset two-engine: needs a redis-server to start: {found}",
                  markup=False, highlight=False)
        return 2
    try:
        get_plugin_manager().tier("redis")  # the redis package, through the tier's check
        import redis  # noqa: F401
    except (PluginError, ImportError) as exc:
        err.print(f"kvcm simulate --preset two-engine: the redis tier is unavailable: {exc} "
                  "(pip install 'kvcm[redis]')", markup=False, highlight=False)
        return 2
    sim = load_config(None, "two-engine")
    if args.stall_steps is not None:
        sim = attrs.evolve(sim, scheduler=attrs.evolve(sim.scheduler,
                                                       stall_steps=args.stall_steps))
    wl = sim.workload
    if args.requests is not None:
        wl = attrs.evolve(wl, requests=args.requests)
    seed = sim.seed if args.seed is None else args.seed
    trace = generate_trace(wl, seed)
    raw = dict(sim.kvcm)
    base = KVCacheManagerConfig.from_dict(raw)
    ws = working_set(trace, base)
    levels = _levels(raw, sim.level_fractions, ws)
    t0 = time.perf_counter()
    server = RedisServer()
    runs: dict[str, EnginesResult] = {}
    error: str | None = None
    code = 0
    tb: str | None = None
    bound: dict[str, Any] | None = None
    try:
        levels[-1]["options"] = {**levels[-1].get("options", {}), "url": server.url}
        shared = KVCacheManagerConfig.from_dict({**raw, "levels": levels})
        local = KVCacheManagerConfig.from_dict({**raw, "levels": levels[:-1]})
        gpu = KVCacheManagerConfig.from_dict({**raw, "levels": levels[:1]})
        for label, cfg in (("shared", shared), ("local only", local), ("gpu only", gpu)):
            if not args.quiet:
                console.print(f"running {label} ...")
            runs[label] = EnginesResult(label=label)
            run_engines(cfg, trace, sim.scheduler, label, result=runs[label])
        bound = infinite_bound(local, trace, runs["shared"].creation_order, ws["bytes"])
    except Exception as exc:  # as the single-engine run: one line, a report, exit 1 or 3
        code, error = _classify(exc)
        tb = traceback.format_exc()
    finally:
        server.stop()
    pages = sum(r.pages_checked for r in runs.values())
    steps = sum(r.steps_checked for r in runs.values())
    report: dict[str, Any] = {
        "preset": "two-engine", "seed": seed, "requests": len(trace), "engines": ENGINES,
        "routing": "turn k of session s on engine (s + k) % 2",
        "working_set_bytes": ws["bytes"], "levels": [
            {"tier": lv["tier"], "quota": lv["quota"]} for lv in levels],
        "verification": {"ok": error is None, "error": error},
        "verification_mode": {"mode": "full", "verify_every": 1,
                              "description": "every page checked at every step, in both "
                                             "engines",
                              "steps_checked": steps, "pages_checked": pages},
        "runs": {k: v.as_dict() for k, v in runs.items()},
        "infinite_bound": ({k: v for k, v in bound.items() if k != "by_kind"}
                           if bound is not None else None),
        "wall_s": time.perf_counter() - t0,
    }
    if error is not None:
        report["exit_status"] = code
        report["traceback"] = tb
    try:
        out.mkdir(parents=True, exist_ok=True)
        with atomic_output(out / "report.json") as tmp:
            tmp.write_text(json.dumps(report, indent=1, default=str) + "\n")
    except OSError as exc:  # the previous report.json, if any, is left whole
        message = str(exc) if isinstance(exc, OutputError) else \
            f"--out {out}: cannot create the folder ({exc.strerror or exc})"
        if error is None:
            return _fail(err, f"the runs verified but the report was not written: {message}",
                         3, traceback.format_exc(), bool(getattr(args, "debug", False)))
        return _fail(err, f"{error} (the report was not written: {message})", code, tb,
                     bool(getattr(args, "debug", False)))
    if error is not None:
        return _fail(err, f"{error} (report: {out / 'report.json'})", code, tb,
                     bool(getattr(args, "debug", False)))
    assert bound is not None
    if not args.quiet:
        console.print(f"kvcm simulate --preset two-engine: {len(trace)} requests, "
                      f"{ENGINES} engines (turns alternate), seed {seed}")
        for label, r in runs.items():
            extra = f"  ({r.remote_blocks} blocks from Redis)" if r.remote_blocks else ""
            console.print(f"  {label:<11} hit rate {100 * r.hit_rate:5.1f}%{extra}")
        console.print(f"  {'bound':<11} hit rate {100 * bound['hit_rate']:5.1f}%  "
                      "(one unbounded cache seeing every request)")
        console.print(f"[green]verified (full):[/] every page checked at every step in both "
                      f"engines ({steps} engine steps, {pages:,} pages checked over "
                      f"{len(runs)} runs)", highlight=False)
        console.print(f"report: {escape(str(out / 'report.json'))}  "
                      f"({report['wall_s']:.1f} s)", highlight=False)
    return 0
