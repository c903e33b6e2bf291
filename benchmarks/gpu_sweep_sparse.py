"""Sweep of the sparse resolve kernels' device time (``bash benchmarks/gpu_run.sh
sparse_sweep``): rows x selected units (working set twice the selection, about 50% hits:
each step keeps half of a row's last selection), for each GPU backend and each resolve
kernel (``KVCM_SPARSE_RESOLVE=v1|v2``); beside them v2 through global memory (stamps not in
shared memory), v2 forced to its fallback sort, and v2 in 512-thread blocks on the
fewest rows. Median and best of the timed resolves'
device time (CUDA events around each call while a gate kernel holds the stream, so the
host's queuing is not in it). Writes ``sparse_sweep-<device>-<time>.json`` under --out.

    python benchmarks/gpu_sweep_sparse.py --out out [--rows 64 256] [--selected 2048 ...]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from kvcm_core.bench.sparse import bench_resolve
from kvcm_core.plugins import get_plugin_manager


def _case(backend: Any, version: str, rows: int, ns: int, steps: int,
          **attrs: Any) -> dict[str, Any]:
    old = {k: getattr(backend, k) for k in attrs}
    os.environ["KVCM_SPARSE_RESOLVE"] = version
    for k, v in attrs.items():
        setattr(backend, k, v)
    try:
        r = bench_resolve(backend, rows, ns, 2 * ns, steps)
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
    ap.add_argument("--versions", default="v1,v2")
    ap.add_argument("--rows", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--selected", type=int, nargs="+", default=[2048, 4096, 8192])
    ap.add_argument("--steps", type=int, default=20, help="timed resolves per case")
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
            cases = [(v, rows, ns, {}) for v in args.versions.split(",")
                     for rows in args.rows for ns in args.selected]
            big = max(args.rows)
            if hasattr(backend, "sparse_max_windows"):
                cases += [("v2", big, 2048, {"sparse_shared_limit": 0}),
                          ("v2", big, 2048, {"sparse_max_windows": 0}),
                          ("v2", min(args.rows), 2048, {"sparse_threads": 512})]
            for version, rows, ns, extra in cases:
                r = _case(backend, version, rows, ns, args.steps, **extra)
                r["backend"] = name
                results.append(r)
                tag = ",".join(f"{k}={v}" for k, v in extra.items())
                print(f"[{name}] {version}{' ' + tag if tag else ''} {rows} x {ns} of "
                      f"{2 * ns}: median {r['device_us_median']:.1f} us, best "
                      f"{r['device_us_min']:.1f} us, hit rate {r['hit_rate']:.2f}",
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
