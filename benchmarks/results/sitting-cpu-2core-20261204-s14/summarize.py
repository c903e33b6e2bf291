"""Medians of the levels sitting (levels.sh): us per request and the ratios to GPU-only."""
import json
import statistics
import sys
from pathlib import Path

out = Path(sys.argv[1])
rows = {}
for kind in ("levels", "gpu4.5M", "levels_sync"):
    runs = [json.loads(p.read_text())["results"] for p in sorted(out.glob(f"kvcm_{kind}_r*.json"))]
    rows[kind] = (statistics.median(r["us_per_request_median"] for r in runs),
                  min(r["us_per_request_min"] for r in runs),
                  statistics.median(r["hit_rate"] for r in runs), runs[0]["lru512_hit_rate"])
gpu = rows["gpu4.5M"][0]
for kind, (med, lo, hit, lru) in rows.items():
    print(f"{kind:12s} {med:7.1f} us/request (min {lo:7.1f})  x{med / gpu:4.2f} of GPU-only"
          f"  hit rate {hit:.4f} = {hit / lru:.3f}x LRU-512")
