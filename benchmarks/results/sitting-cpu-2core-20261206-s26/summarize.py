"""Medians of sitting.sh: us per request per configuration and side, and the ratios."""
import json
import statistics
import sys
from pathlib import Path

out = Path(sys.argv[1])


def med(pattern: str) -> tuple[float, float, int, list[float]]:
    docs = [json.loads(p.read_text()) for p in sorted(out.glob(pattern))]
    if not docs:
        return float("nan"), float("nan"), 0, []
    vals = [d["results"]["us_per_request_median"] for d in docs]
    return statistics.median(vals), docs[0]["results"]["hit_rate"], len(docs), vals


rows = {k: med(f"{k}_r*.json") for k in ("base_levels", "base_gpu", "new_levels", "new_gpu")}
for k, (us, hit, n, vals) in rows.items():
    print(f"{k:12s} {us:7.1f} us/request (median of {n} rounds: "
          f"{', '.join(f'{v:.1f}' for v in vals)}), hit rate {hit:.5f}")
for side in ("base", "new"):
    print(f"{side}: levels / GPU-only = "
          f"{rows[side + '_levels'][0] / rows[side + '_gpu'][0]:.3f}")
print(f"levels new / base = {rows['new_levels'][0] / rows['base_levels'][0]:.3f}; "
      f"GPU-only new / base = {rows['new_gpu'][0] / rows['base_gpu'][0]:.3f}")
