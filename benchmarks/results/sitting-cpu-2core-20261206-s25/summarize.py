"""Medians of sitting.sh: us per request, the levels/GPU-only ratios (start and end of the
session) and the vLLM race."""
import json
import statistics
import sys
from pathlib import Path

out = Path(sys.argv[1])


def med(pattern: str) -> tuple[float, float, int]:
    docs = [json.loads(p.read_text()) for p in sorted(out.glob(pattern))]
    if not docs:
        return float("nan"), float("nan"), 0
    if "results" in docs[0]:  # kvcm bench trace
        vals = [d["results"]["us_per_request_median"] for d in docs]
        hit = docs[0]["results"]["hit_rate"]
    else:  # vllm_trace_replay.py
        vals = [d["us_per_request_median"] for d in docs]
        hit = docs[0]["hit_rate"]
    return statistics.median(vals), hit, len(docs)


rows = {k: med(f"{k}_r*.json") for k in ("old_levels", "old_gpu4.5M", "kvcm_levels",
                                         "kvcm_gpu4.5M", "kvcm_levels_sync", "vllm", "kvcm3M")}
for k, (us, hit, n) in rows.items():
    print(f"{k:18s} {us:7.1f} us/request (median of {n} rounds' medians), hit rate {hit:.5f}")
print(f"session start: levels / GPU-only = {rows['old_levels'][0] / rows['old_gpu4.5M'][0]:.3f}")
print(f"session end:   levels / GPU-only = {rows['kvcm_levels'][0] / rows['kvcm_gpu4.5M'][0]:.3f}"
      f" (no I/O thread: {rows['kvcm_levels_sync'][0] / rows['kvcm_gpu4.5M'][0]:.3f})")
print(f"levels end / start = {rows['kvcm_levels'][0] / rows['old_levels'][0]:.3f}; GPU-only "
      f"end / start = {rows['kvcm_gpu4.5M'][0] / rows['old_gpu4.5M'][0]:.3f}")
print(f"vLLM / kvcm (GPU 3M) = {rows['vllm'][0] / rows['kvcm3M'][0]:.2f}x, hit rates "
      f"{rows['kvcm3M'][1]:.5f} vs {rows['vllm'][1]:.5f}")
