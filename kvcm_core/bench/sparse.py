"""Benchmark of the sparse-attention kernels (``kvcm bench sparse``), on every available
kernel backend with a device (``--backends`` to choose; ``numpy`` gives host times only).

- **resolve**: ``--rows`` (64 and 256) rows x 2048 selected units with a working set of
  4096 entries; each step keeps 1024 units of the previous selection (hits) and brings
  1024 new ones (misses): 50% hits. Device time per resolve: events around the call
  while a gate kernel holds the stream, so the host's time to queue it is not counted
  (the selections were uploaded before). Also the global-memory path: a working set
  of 8192 entries (past the shared-memory limit, when it is 4096), and 4096 entries with
  shared memory turned off.
- **fetch**: the missed units of 64 rows copied from pinned host pages into their entries,
  units of ``--unit-kib`` (1, 4 and 16 KiB), ``--missed-mib`` in all; beside it the model
  ``missed bytes / pinned host-to-device bandwidth + one launch``, both limits measured in
  the same run (one ``copy_bytes`` of 64 MiB; 1000 empty launches).
- **flush**: the same units written back from their entries to the host pages, against
  the pinned device-to-host bandwidth.
- **trace**: the hits of a drifting top-k trace (70% of a row's selection kept each step)
  beside those of an exact LRU computed on the host; they must be equal.

Targets on an H200: fetch within 1.2x of its model for units of 4 KiB and more; resolve of
256 x 2048 under 50 us of device time.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from typing import Any

import attrs
import numpy as np

from kvcm_core.backend import KernelBackend, PageRegion, SparseBufferCells, SparseCopy
from kvcm_core.bench import (
    DeviceGate,
    HelpFormatter,
    add_output_options,
    device_backends,
    parse_with_quick,
    result_header,
    timed_calls,
    write_result,
)
from kvcm_core.console import int_at_least
from kvcm_core.plugins import get_plugin_manager
from kvcm_core.testing.sparse_oracle import ResolveRig, device_array, drifting_topk

_EMPTY = 'extern "C" __global__ void kvcm_bench_sparse_empty(unsigned long long x) {}\n'
_KIB = 1024

#: What ``--quick`` changes: a run of seconds.
QUICK = {"rows": [8], "selected": 256, "steps": 4, "reps": 3, "unit_kib": [1, 4],
         "missed_mib": 4, "trace_steps": 10}


def _limits(backend: KernelBackend, reps: int) -> dict[str, float]:
    """Pinned host-to-device and device-to-host bandwidth and the device time of an empty
    launch, measured now (host seconds on a backend without a device clock)."""
    out: dict[str, float] = {}
    n = 64 << 20
    host, dev = backend.alloc_host(n), backend.alloc_device(n)
    try:
        t, _ = timed_calls(backend, lambda: backend.copy_bytes(dev, 0, host, 0, n), reps, 1)
        out["h2d_gbps"] = n / statistics.median(t) / 1e9
        t, _ = timed_calls(backend, lambda: backend.copy_bytes(host, 0, dev, 0, n), reps, 1)
        out["d2h_gbps"] = n / statistics.median(t) / 1e9
    finally:
        host.free()
        dev.free()
    compile_ = getattr(backend, "compile", None)
    if compile_ is not None:  # one empty launch's device time, the host's queuing not in it
        module = compile_(_EMPTY)
        launch = functools.partial(module.launch, "kvcm_bench_sparse_empty", (1, 1, 1),
                                   (32, 1, 1), [np.uint64(0)])
        t, _ = _times(backend, [launch] * max(reps, 5))
        out["launch_device_us"] = statistics.median(t) * 1e6
    else:
        out["launch_device_us"] = 0.0
    return out


def _times(backend: KernelBackend, calls: list[Any]) -> tuple[list[float], list[float]]:
    """Device and host seconds of each call: on a backend that compiles CUDA C, the device
    time of the call's own work (:class:`~kvcm_core.bench.DeviceGate`: the host's queuing
    is not in it); elsewhere the host time, twice."""
    if not hasattr(backend, "compile"):
        host = []
        for call in calls:
            t0 = time.perf_counter()
            call()
            host.append(time.perf_counter() - t0)
        return host, host
    gate = DeviceGate(backend)
    try:
        pairs = [gate.time(call) for call in calls]
    finally:
        gate.close()
    return [d for d, _ in pairs], [h for _, h in pairs]


def _half_hits(rows: int, ns: int, steps: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Selections where each step keeps half of a row's last selection and brings units the
    row never selected (every row counts its units from 0)."""
    cur = np.tile(np.arange(ns, dtype=np.int64), (rows, 1))
    fresh = ns
    out = []
    for _ in range(steps + 1):
        out.append(cur.astype(np.int32))
        new = np.arange(fresh, fresh + ns - ns // 2, dtype=np.int64)
        fresh += ns - ns // 2
        nxt = np.empty_like(cur)
        for r in range(rows):
            keep = rng.choice(cur[r], ns // 2, replace=False)
            nxt[r] = rng.permutation(np.concatenate([keep, new]))
        cur = nxt
    return out


def bench_resolve(backend: KernelBackend, rows: int, ns: int, wsu: int, steps: int,
                  shared_limit: int | None = None, burst: bool = False) -> dict[str, Any]:
    """Device time of resolves with about 50% hits (the first, all-miss, resolve untimed).

    ``burst``: also the same steps again on a fresh state, all queued behind the gate
    between two events and run back to back: their device time over ``steps``
    (``device_us_burst``: the gaps between launches in, the gate's release paid once)."""
    sels = _half_hits(rows, ns, steps, np.random.default_rng(rows))
    mu = int(max(s.max() for s in sels)) + 1
    rig = ResolveRig(backend, rows, ns, wsu, mu, 4)
    old = getattr(backend, "sparse_shared_limit", None)
    if shared_limit is not None:
        backend.sparse_shared_limit = shared_limit  # type: ignore[attr-defined]
    bufs = [device_array(backend, s) for s in sels]
    jobs = [attrs.evolve(rig.job(), selected=b) for b in bufs]
    try:
        backend.sparse_resolve(jobs[0])
        first = rig.read("counters")
        dev, host = _times(backend, [functools.partial(backend.sparse_resolve, j)
                                     for j in jobs[1:]])
        counts = rig.read("counters") - first  # the timed resolves
        if burst:
            rig.close()
            rig = ResolveRig(backend, rows, ns, wsu, mu, 4)
            jobs = [attrs.evolve(rig.job(), selected=b) for b in bufs]
            backend.sparse_resolve(jobs[0])
            def steps_back_to_back() -> None:
                for j in jobs[1:]:
                    backend.sparse_resolve(j)

            d, _ = _times(backend, [steps_back_to_back])
            burst_us = d[0] / len(jobs[1:]) * 1e6
    finally:
        if shared_limit is not None:
            backend.sparse_shared_limit = old  # type: ignore[attr-defined]
        for b in bufs:
            b.free()
        rig.close()
    hits, misses = int(counts[:, 0].sum()), int(counts[:, 1].sum())
    out = {"rows": rows, "selected": ns, "working_set_units": wsu,
           "device_us_median": statistics.median(dev) * 1e6, "device_us_min": min(dev) * 1e6,
           "host_us_median": statistics.median(host) * 1e6,
           "hit_rate": hits / max(1, hits + misses)}
    if burst:
        out["device_us_burst"] = burst_us
    return out


def bench_copy(backend: KernelBackend, unit_kib: int, missed_mib: int, rows: int, reps: int,
               limits: dict[str, float]) -> dict[str, Any]:
    """Fetch and flush of ``missed_mib`` of units of ``unit_kib`` over ``rows`` rows."""
    ub = unit_kib * _KIB
    upp = 4
    per_row = max(1, (missed_mib << 20) // (ub * rows))
    blocks = -(-per_row // upp)
    page = ub * upp
    host = backend.alloc_host(rows * blocks * page)
    cells_bytes = rows * blocks * page
    arena = backend.alloc_device(cells_bytes)
    table = np.arange(rows * blocks, dtype=np.int32).reshape(rows, blocks)
    units = np.tile(np.arange(per_row, dtype=np.int32), (rows, 1))
    entry_of = np.full((rows, blocks * upp), -1, dtype=np.int32)
    entry_of[:, :per_row] = units
    arrays = [table, np.arange(rows, dtype=np.int32), units, units,
              np.full(rows, per_row, dtype=np.int32), entry_of,
              np.tile(np.array([0, per_row], dtype=np.int32), (rows, 1))]
    bufs = [device_array(backend, a) for a in arrays]
    cells = (SparseBufferCells(PageRegion(host, 0, page), PageRegion(arena, 0, page), ub, upp,
                               blocks),)
    out: dict[str, Any] = {"unit_kib": unit_kib, "rows": rows, "units_per_row": per_row}
    missed = rows * per_row * ub
    try:
        for name, flush, gbps in (("fetch", False, limits["h2d_gbps"]),
                                  ("flush", True, limits["d2h_gbps"])):
            job = SparseCopy(flush=flush, rows=rows, num_selected=per_row,
                             max_units=blocks * upp, row_elems=blocks, buffers=cells,
                             page_table=bufs[0], lease_of_row=bufs[1], miss_unit=bufs[2],
                             miss_entry=bufs[3], miss_count=bufs[4], entry_of=bufs[5],
                             ranges=bufs[6])
            backend.sparse_copy(job)  # warm-up
            dev, host_t = _times(backend, [functools.partial(backend.sparse_copy, job)] * reps)
            model = missed / (gbps * 1e9) + limits["launch_device_us"] * 1e-6
            out[name] = {"bytes": missed, "device_us_median": statistics.median(dev) * 1e6,
                         "model_us": model * 1e6,
                         "ratio_to_model": statistics.median(dev) / model,
                         "host_us_median": statistics.median(host_t) * 1e6}
    finally:
        for b in (host, arena, *bufs):
            b.free()
    return out


def bench_trace(backend: KernelBackend, rows: int, ns: int, wsu: int,
                steps: int) -> dict[str, Any]:
    """Hits of a drifting top-k trace on the device beside an exact LRU on the host (the
    rig checks every step against it)."""
    rig = ResolveRig(backend, rows, ns, wsu, 4 * wsu, 4)
    try:
        for sel in drifting_topk(np.random.default_rng(0), rows, ns, 4 * wsu, steps, 0.7):
            rig.resolve(sel)
        counts = rig.read("counters")
    finally:
        rig.close()
    return {"rows": rows, "selected": ns, "working_set_units": wsu, "steps": steps,
            "device_hits": int(counts[:, 0].sum()), "device_misses": int(counts[:, 1].sum()),
            "host_lru_hits": int(rig.counters[:, 0].sum()),
            "host_lru_misses": int(rig.counters[:, 1].sum())}


def run_backend(args: argparse.Namespace, name: str) -> dict[str, Any]:
    backend = get_plugin_manager().kernel_backends()[name].factory({})
    try:
        limits = _limits(backend, args.reps)
        out: dict[str, Any] = {"limits": limits, "resolve": [], "copy": []}
        cases: list[tuple[int, int, int | None]] = [
            (r, args.working_set, None) for r in args.rows]
        cases += [(args.rows[-1], 2 * args.working_set, None),
                  (args.rows[-1], args.working_set, 0)]
        for rows, wsu, limit in cases:
            r = bench_resolve(backend, rows, args.selected, wsu, args.steps, limit)
            shared = getattr(backend, "sparse_shared_limit", 0)
            r["path"] = "global" if limit == 0 or wsu > shared else "shared"
            out["resolve"].append(r)
            print(f"[{name}] resolve {rows} x {args.selected} of {wsu} ({r['path']}): "
                  f"{r['device_us_median']:.1f} us device, hit rate {r['hit_rate']:.2f}",
                  flush=True)
        for kib in args.unit_kib:
            c = bench_copy(backend, kib, args.missed_mib, 64, args.reps, limits)
            out["copy"].append(c)
            print(f"[{name}] {kib} KiB units: fetch {c['fetch']['ratio_to_model']:.2f}x, "
                  f"flush {c['flush']['ratio_to_model']:.2f}x of the model", flush=True)
        out["trace"] = bench_trace(backend, 8, args.selected, args.working_set,
                                   args.trace_steps)
        print(f"[{name}] trace hits: device {out['trace']['device_hits']}, host LRU "
              f"{out['trace']['host_lru_hits']}", flush=True)
        return out
    finally:
        backend.close()


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kvcm bench sparse", description=__doc__,
                                 formatter_class=HelpFormatter)
    ap.add_argument("--backends", default="auto",
                    help="comma-separated kernel backends, or auto: every available one "
                         "with a device")
    ap.add_argument("--rows", type=int_at_least(1), nargs="+", default=[64, 256],
                    help="rows resolved")
    ap.add_argument("--selected", type=int_at_least(1), default=2048,
                    help="units selected per row (at most --working-set)")
    ap.add_argument("--working-set", type=int_at_least(1), default=4096,
                    help="entries per row")
    ap.add_argument("--steps", type=int_at_least(1), default=20,
                    help="timed resolves per case")
    ap.add_argument("--reps", type=int_at_least(1), default=9,
                    help="timed repetitions of each copy")
    ap.add_argument("--unit-kib", type=int_at_least(1), nargs="+", default=[1, 4, 16],
                    help="unit sizes of the copies")
    ap.add_argument("--missed-mib", type=int_at_least(1), default=256,
                    help="bytes each copy moves")
    ap.add_argument("--trace-steps", type=int_at_least(1), default=50,
                    help="steps of the hit trace")
    add_output_options(ap, "8 rows x 256 selected, small copies, few steps")
    return ap


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parse_with_quick(parser, argv, QUICK)
    if args.selected > args.working_set:
        parser.error(f"--selected {args.selected} with --working-set {args.working_set}: a "
                     f"row's selection must fit its working set")
    pm = get_plugin_manager()
    names = device_backends(pm, args.backends)
    if not names:
        print("kvcm bench sparse: no kernel backend with a device is available (try "
              "--backends numpy for host times)", file=sys.stderr)
        return 2
    results = {name: run_backend(args, name) for name in names}
    doc = {**result_header("kvcm sparse kernels: resolve, fetch and flush device time "
                           "against limits measured in the same run; trace hits against "
                           "an exact host LRU"),
           "config": vars(args), "backends": results}
    write_result(doc, args.out, "sparse", args.tag)
    return 0


if __name__ == "__main__":
    sys.exit(main())
