"""Where `kvcm simulate` (embedded default) spends the manager's host time, on any
backend (``KVCM_KERNEL_BACKEND``): a benchmark helper for the GPU host, not part of kvcm.

    python benchmarks/profile_simulate.py moves OUT.txt    # real timers, no profiler
    python benchmarks/profile_simulate.py profile OUT.txt  # cProfile, top functions

``moves``: time of each level move and drop by (from, to) level pair (calls, pages,
median, total), and the count and time of every kernel-backend, stream and event call
made while a manager call runs (what a GPU backend adds over NumPy's).
``profile``: cProfile of the whole run, top 60 functions by own time and by cumulative
time (the profiler inflates Python-heavy code: read it for where, not how much).
"""

from __future__ import annotations

import collections
import cProfile
import io
import pstats
import sys
import tempfile
import time

import numpy as np

import kvcm_core.levels as levels_mod
import kvcm_core.manager as manager_mod
from kvcm_core.cli import main

_ARGS = ["simulate", "--no-plots", "--quiet", "--no-compare"]


def _simulate() -> None:
    code = main([*_ARGS, "--out", tempfile.mkdtemp(prefix="kvcm-prof-")])
    if code != 0:
        raise SystemExit(code)


def _timed(record: list, key: object, fn):  # noqa: ANN001, ANN202
    def w(*a, **k):  # noqa: ANN002, ANN003, ANN202
        t0 = time.perf_counter_ns()
        try:
            return fn(*a, **k)
        finally:
            record.append((key(a) if callable(key) else key, time.perf_counter_ns() - t0))
    return w


def moves(out: str) -> None:
    rec: list = []
    orig_move, orig_drop = levels_mod.Levels._move, levels_mod.Levels.drop

    def move(self, src, pids, dst, *a, **k):  # noqa: ANN001, ANN002, ANN003, ANN202
        t0 = time.perf_counter_ns()
        try:
            return orig_move(self, src, pids, dst, *a, **k)
        finally:
            rec.append(((src.level, dst.level), len(pids), time.perf_counter_ns() - t0))

    def drop(self, store, pids, *a, **k):  # noqa: ANN001, ANN002, ANN003, ANN202
        t0 = time.perf_counter_ns()
        try:
            return orig_drop(self, store, pids, *a, **k)
        finally:
            rec.append(((store.level, "drop"), len(pids), time.perf_counter_ns() - t0))

    levels_mod.Levels._move = move  # type: ignore[method-assign]
    levels_mod.Levels.drop = drop  # type: ignore[method-assign]
    calls: list = []
    orig_init = manager_mod.KVCacheManager.__init__

    def init(self, *a, **k):  # noqa: ANN001, ANN002, ANN003, ANN202
        orig_init(self, *a, **k)
        be = self.backend
        for name in ("copy_bytes", "copy_pages", "copy_pages_batch", "create_event",
                     "synchronize", "read", "write"):
            setattr(be, name, _timed(calls, f"backend.{name}", getattr(be, name)))
        for stream in (be.default_stream, *self.storage_levels.mover.fences.streams()):
            for name in ("synchronize", "wait_event"):
                if hasattr(stream, name):
                    try:
                        setattr(stream, name, _timed(calls, f"stream.{name}",
                                                     getattr(stream, name)))
                    except AttributeError:
                        pass
        fences = self.storage_levels.mover.fences
        for name in ("wait_host", "wait_all", "record", "record_batch", "run_batches",
                     "wait_batches", "prune", "begin", "end", "join_op"):
            setattr(fences, name, _timed(calls, f"fences.{name}", getattr(fences, name)))

    manager_mod.KVCacheManager.__init__ = init  # type: ignore[method-assign]
    _simulate()
    lines = []
    by = collections.defaultdict(list)
    for k, n, ns in rec:
        by[k].append((n, ns / 1e3))
    for k, v in sorted(by.items(), key=lambda kv: str(kv[0])):
        a = np.array(v)
        lines.append(f"move {k}: calls {len(v)} pages {a[:, 0].sum():.0f} mean pages "
                     f"{a[:, 0].mean():.1f} median us {np.median(a[:, 1]):.0f} total ms "
                     f"{a[:, 1].sum() / 1e3:.1f}")
    byc = collections.defaultdict(list)
    for k, ns in calls:
        byc[k].append(ns / 1e3)
    for k, v in sorted(byc.items(), key=lambda kv: -sum(kv[1])):
        lines.append(f"call {k}: calls {len(v)} median us {np.median(v):.1f} total ms "
                     f"{sum(v) / 1e3:.1f}")
    with open(out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


def profile(out: str) -> None:
    prof = cProfile.Profile()
    prof.runcall(_simulate)
    s = io.StringIO()
    st = pstats.Stats(prof, stream=s)
    st.sort_stats("tottime").print_stats(60)
    st.sort_stats("cumulative").print_stats(60)
    with open(out, "w") as f:
        f.write(s.getvalue())


if __name__ == "__main__":
    {"moves": moves, "profile": profile}[sys.argv[1]](sys.argv[2])
