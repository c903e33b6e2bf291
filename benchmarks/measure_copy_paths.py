"""What ``copy_path="measure"`` chooses on this machine, for each CUDA backend: the page
size from which host-to-device and device-to-host copies go to the copy engines, the
timings behind it and how long the measurement took. Usage: python
benchmarks/measure_copy_paths.py [OUT.json]"""
import json
import sys
import time

from kvcm_core.backend import MemoryKind
from kvcm_core.plugins import get_plugin_manager

report = {}
for name in ("cuda", "cupy"):
    spec = get_plugin_manager().kernel_backend(name)
    if not spec.availability():
        continue
    t0 = time.perf_counter()
    backend = spec.factory({"copy_path": "measure"})
    took = time.perf_counter() - t0
    try:
        h, d = MemoryKind.HOST, MemoryKind.DEVICE
        ce_from = {"h2d": backend.auto_ce_min_page_bytes[(h, d)],
                   "d2h": backend.auto_ce_min_page_bytes[(d, h)]}
        times = {k: {str(p): [round(x * 1e6, 1) for x in t] for p, t in v.items()}
                 for k, v in backend.copy_path_times.items()}
        report[name] = {"built_in_s": round(took, 3), "ce_from_page_bytes": ce_from,
                        "us_sm_ce_per_16MiB_copy": times}
        print(name, f"built in {took:.2f} s; copy engines from {ce_from}")
        for k, v in times.items():
            print(" ", k, "us (gather, engines) by page size:", v)
    finally:
        backend.close()
if len(sys.argv) > 1:
    with open(sys.argv[1], "w") as f:
        json.dump(report, f, indent=1)
