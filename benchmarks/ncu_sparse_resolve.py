"""Resolves for Nsight Compute (``bash benchmarks/gpu_run.sh sparse_ncu``): the sweep's
half-hit steps, launched one after another with no gate (a gate kernel spinning on a host
flag would hang under the profiler), for each kernel setting and row count, so that ncu's
``gpu__time_duration`` gives each resolve kernel's own duration, launch overhead out.

    ncu --metrics gpu__time_duration.sum -k regex:kvcm_sparse_resolve --csv \\
        python benchmarks/ncu_sparse_resolve.py --versions v2,v3 --rows 64 256

``--summary CSV`` instead reads such a CSV and prints the median and best duration per
kernel and grid (first launch of each case, the untimed all-miss one, left out).
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import sys
from collections import defaultdict

import attrs
import numpy as np


def run(versions: list[str], rows_list: list[int], ns: int, steps: int) -> None:
    from kvcm_core.bench.sparse import _half_hits
    from kvcm_core.plugins import get_plugin_manager
    from kvcm_core.testing.sparse_oracle import ResolveRig, device_array

    backend = get_plugin_manager().kernel_backends()["cuda"].factory({})
    try:
        for version in versions:
            os.environ["KVCM_SPARSE_RESOLVE"] = version
            for rows in rows_list:
                sels = _half_hits(rows, ns, steps, np.random.default_rng(rows))
                mu = int(max(s.max() for s in sels)) + 1
                rig = ResolveRig(backend, rows, ns, 2 * ns, mu, 4)
                bufs = [device_array(backend, s) for s in sels]
                try:
                    for b in bufs:
                        backend.sparse_resolve(attrs.evolve(rig.job(), selected=b))
                    backend.synchronize()
                finally:
                    for b in bufs:
                        b.free()
                    rig.close()
                print(f"{version} {rows} rows: {steps + 1} resolves", flush=True)
    finally:
        backend.close()


def summary(path: str) -> None:
    times: dict[tuple[str, str], list[float]] = defaultdict(list)
    with open(path, newline="") as f:
        lines = [ln for ln in f if ln.startswith('"')]
    for row in csv.DictReader(lines):
        if row.get("Metric Name") != "gpu__time_duration.sum":
            continue
        unit = row.get("Metric Unit", "")
        v = float(row["Metric Value"].replace(",", ""))
        us = v / 1e3 if unit in ("nsecond", "ns") else v if unit in ("usecond", "us") else v * 1e3
        times[(row["Kernel Name"].split("(")[0], row.get("Grid Size", ""))].append(us)
    for (name, grid), ts in times.items():
        ts = ts[1:] if len(ts) > 1 else ts  # the first is the all-miss warm-up
        print(f"{name} grid {grid}: {len(ts)} launches, median {statistics.median(ts):.1f} us, "
              f"best {min(ts):.1f} us")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--versions", default="v2,v3")
    ap.add_argument("--rows", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--selected", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--summary", help="print the summary of an ncu CSV instead")
    args = ap.parse_args(argv)
    if args.summary:
        summary(args.summary)
        return 0
    run([v.strip() for v in args.versions.split(",") if v.strip()], args.rows, args.selected,
        args.steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
