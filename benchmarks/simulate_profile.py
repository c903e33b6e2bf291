"""Where `kvcm simulate`'s slow steps spend the manager's time (issue 16's p99).

Runs the embedded default (or the arguments given, as `kvcm simulate` takes them) with
timers around the manager calls of each step (`create_kv_cache` included), and around each move between levels made
inside a `resume`, then prints:
- the manager's time per step (mean, p99) as this script measured it;
- the slowest steps: time per call kind and how many calls;
- the slowest resumes: each move (level and pool group from -> to, pages, microseconds);
- the time of moves by kind over all resumes.

    python benchmarks/simulate_profile.py [--out DIR] [kvcm simulate arguments...]

A benchmark helper, not part of kvcm: it wraps private functions (`_SimLoop.step`,
`Levels._move`, `ResumeMixin._resume`) to time them, so it follows the code it measures.
"""

from __future__ import annotations

import collections
import sys
import tempfile
import time

import numpy as np

import kvcm_core.cache_resume as cache_resume
import kvcm_core.levels as levels
import kvcm_core.manager as manager
import kvcm_core.simulate.runner as runner
from kvcm_core.cli import main

steps: list[dict[str, int]] = []
current: collections.defaultdict[str, int] = collections.defaultdict(int)
resumes: list[tuple[float, list[tuple[str, int, float]]]] = []
moves_now: list[tuple[str, int, float]] | None = None

_wrap = runner._Timers.wrap


def _timed_wrap(self, name, fn, owner):  # type: ignore[no-untyped-def]
    inner = _wrap(self, name, fn, owner)

    def timed(*args, **kwargs):  # type: ignore[no-untyped-def]
        t0 = time.perf_counter_ns()
        try:
            return inner(*args, **kwargs)
        finally:
            current[name] += time.perf_counter_ns() - t0
            current[name + "#"] += 1

    return timed


_step = runner._SimLoop.step


def _timed_step(self):  # type: ignore[no-untyped-def]
    current.clear()
    try:
        return _step(self)
    finally:
        steps.append(dict(current))


_resume = cache_resume.ResumeMixin._resume


def _timed_resume(self, *args, **kwargs):  # type: ignore[no-untyped-def]
    global moves_now
    moves_now = []
    t0 = time.perf_counter_ns()
    try:
        return _resume(self, *args, **kwargs)
    finally:
        resumes.append(((time.perf_counter_ns() - t0) / 1e3, moves_now))
        moves_now = None


_move = levels.Levels._move


def _timed_move(self, src, pids, dst, *args, **kwargs):  # type: ignore[no-untyped-def]
    t0 = time.perf_counter_ns()
    try:
        return _move(self, src, pids, dst, *args, **kwargs)
    finally:
        if moves_now is not None:
            kind = f"L{src.level}g{src.pool_group}->L{dst.level}g{dst.pool_group}"
            moves_now.append((kind, len(pids), (time.perf_counter_ns() - t0) / 1e3))


_create = manager.KVCacheManager.create_kv_cache


def _timed_create(self, *args, **kwargs):  # type: ignore[no-untyped-def]
    t0 = time.perf_counter_ns()
    try:
        return _create(self, *args, **kwargs)
    finally:
        current["create_kv_cache"] += time.perf_counter_ns() - t0
        current["create_kv_cache#"] += 1


def run(argv: list[str]) -> None:
    runner._Timers.wrap = _timed_wrap
    manager.KVCacheManager.create_kv_cache = _timed_create
    runner._SimLoop.step = _timed_step
    cache_resume.ResumeMixin._resume = _timed_resume
    levels.Levels._move = _timed_move
    args = list(argv)
    if "--out" not in args:
        args += ["--out", tempfile.mkdtemp(prefix="kvcm-simulate-profile-")]
    code = main(["simulate", "--no-plots", "--quiet", "--no-compare", *args])
    if code != 0:
        sys.exit(code)
    total = np.array([sum(v for k, v in s.items() if not k.endswith("#")) for s in steps])
    print(f"steps {len(steps)}: manager us per step mean {total.mean() / 1e3:.0f}, "
          f"p99 {np.percentile(total, 99) / 1e3:.0f}, max {total.max() / 1e3:.0f}")
    print("slowest steps (call: us total / calls):")
    for i in np.argsort(total)[::-1][:8].tolist():
        s = steps[i]
        parts = ", ".join(f"{k} {s[k] / 1e3:.0f}/{s[k + '#']}" for k in sorted(s)
                          if not k.endswith("#"))
        print(f"  step {i}: {total[i] / 1e3:.0f} us: {parts}")
    times = np.array([t for t, _ in resumes])
    print(f"resumes {len(resumes)}: us mean {times.mean():.0f}, p50 {np.median(times):.0f}, "
          f"p99 {np.percentile(times, 99):.0f}")
    print("slowest resumes (move: pages, us):")
    for t, moves in sorted(resumes, key=lambda r: -r[0])[:6]:
        print(f"  {t:.0f} us: " + ", ".join(f"{k} {n}p {u:.0f}" for k, n, u in moves))
    by_kind: collections.defaultdict[str, list[tuple[int, float]]] = \
        collections.defaultdict(list)
    for _, moves in resumes:
        for kind, n, u in moves:
            by_kind[kind].append((n, u))
    print("moves inside resumes, by kind (count, pages mean, us mean, us total):")
    for kind, rows in sorted(by_kind.items(), key=lambda kv: -sum(u for _, u in kv[1])):
        pages, us = np.array([r[0] for r in rows]), np.array([r[1] for r in rows])
        print(f"  {kind}: {len(rows)}, {pages.mean():.1f}, {us.mean():.0f}, {us.sum():.0f}")


if __name__ == "__main__":
    run(sys.argv[1:])
