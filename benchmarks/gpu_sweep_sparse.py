"""Sweep of the sparse resolve kernels' device time (``bash benchmarks/gpu_run.sh
sparse_sweep``): rows x selected units (working set twice the selection, about 50% hits:
each step keeps half of a row's last selection), for each GPU backend and each resolve
kernel (``KVCM_SPARSE_RESOLVE=v1|v2|v3|v4``); beside them v2 through global memory (stamps not
in shared memory); with v1, v2 forced to its fallback sort and v2 in 512-thread blocks on
the fewest rows; with v3, v3 in 256-, 512- and 1024-thread blocks and v3 on 8192 selected
of 16384 entries (past the shared limit: v2's global-memory path). Median and best of the timed
resolves' device time (CUDA events around each call while a gate kernel holds the stream,
so the host's queuing is not in it); ``--burst``: also every step queued behind one gate and
run back to back (device time over the steps). Beside them the gate's floor: the same
measure of an empty kernel. Writes ``sparse_sweep-<device>-<time>.json`` under --out.

    python benchmarks/gpu_sweep_sparse.py --out out [--rows 64 256] [--selected 2048 ...]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from kvcm_core.bench.sparse import _EMPTY, _times, bench_resolve
from kvcm_core.plugins import get_plugin_manager


def _floor(backend: Any, reps: int) -> dict[str, float]:
    """Device time of an empty kernel through the same gate (median and best, us)."""
    module = backend.compile(_EMPTY)

    def launch() -> None:
        module.launch("kvcm_bench_sparse_empty", (1, 1, 1), (32, 1, 1), [np.uint64(0)])

    launch()
    t, _ = _times(backend, [launch] * reps)
    return {"empty_us_median": statistics.median(t) * 1e6, "empty_us_min": min(t) * 1e6}


def _case(backend: Any, version: str, rows: int, ns: int, steps: int, burst: bool,
          **attrs: Any) -> dict[str, Any]:
    old = {k: getattr(backend, k) for k in attrs}
    os.environ["KVCM_SPARSE_RESOLVE"] = version
    for k, v in attrs.items():
        setattr(backend, k, v)
    try:
        r = bench_resolve(backend, rows, ns, 2 * ns, steps, burst=burst)
    finally:
        for k, v in old.items():
            setattr(backend, k, v)
    r["kernel"] = version
    r.update({k: v for k, v in attrs.items()})
    return r


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backends", default="cuda,cupy")
    ap.add_argument("--versions", default="v1,v2,v3,v4")
    ap.add_argument("--rows", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--selected", type=int, nargs="+", default=[2048, 4096, 8192])
    ap.add_argument("--steps", type=int, default=40, help="timed resolves per case")
    ap.add_argument("--burst", action="store_true",
                    help="also time the steps run back to back behind one gate")
    ap.add_argument("--no-extras", action="store_true",
                    help="only the versions x rows x selected grid")
    ap.add_argument("--out", default="out")
    args = ap.parse_args(argv)
    pm = get_plugin_manager()
    results: list[dict[str, Any]] = []
    info: dict[str, Any] = {}
    for name in [n.strip() for n in args.backends.split(",") if n.strip()]:
        spec = pm.kernel_backends()[name]
        ok, why = pm.availability_of(spec)
        if not ok:
            print(f"[{name}] unavailable: {why}", flush=True)
            continue
        backend = spec.factory({})
        try:
            info[name] = backend.device_info() if hasattr(backend, "device_info") else {}
            if hasattr(backend, "compile"):
                info[name]["gate_floor"] = floor = _floor(backend, max(args.steps, 20))
                print(f"[{name}] empty kernel through the gate: median "
                      f"{floor['empty_us_median']:.1f} us, best "
                      f"{floor['empty_us_min']:.1f} us", flush=True)
            versions = [v.strip() for v in args.versions.split(",") if v.strip()]
            cases = [(v, rows, ns, {}) for v in versions
                     for rows in args.rows for ns in args.selected]
            big = max(args.rows)
            if hasattr(backend, "sparse_max_windows") and not args.no_extras:
                cases += [("v2", big, 2048, {"sparse_shared_limit": 0})]
                if "v1" in versions:
                    cases += [("v2", big, 2048, {"sparse_max_windows": 0}),
                              ("v2", min(args.rows), 2048, {"sparse_threads": 512})]
                if "v3" in versions:
                    cases += [("v3", big, 2048, {"sparse_threads": 256}),
                              ("v3", big, 2048, {"sparse_threads": 1024}),
                              ("v3", min(args.rows), 2048, {"sparse_threads": 512})]
                    if 8192 not in args.selected:  # past the shared limit: v2's global path
                        cases += [("v3", big, 8192, {})]
            for version, rows, ns, extra in cases:
                r = _case(backend, version, rows, ns, args.steps, args.burst, **extra)
                r["backend"] = name
                results.append(r)
                tag = ",".join(f"{k}={v}" for k, v in extra.items())
                more = f", burst {r['device_us_burst']:.1f} us" if args.burst else ""
                print(f"[{name}] {version}{' ' + tag if tag else ''} {rows} x {ns} of "
                      f"{2 * ns}: median {r['device_us_median']:.1f} us, best "
                      f"{r['device_us_min']:.1f} us{more}, hit rate {r['hit_rate']:.2f}",
                      flush=True)
        finally:
            backend.close()
    if not results:
        return 2
    dev = next(iter(info.values()), {}).get("device", "host").replace(" ", "-")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"sparse_sweep-{dev}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps({"config": vars(args), "devices": info, "resolve": results},
                               indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
