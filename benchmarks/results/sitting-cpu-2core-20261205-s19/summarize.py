"""Prints the session 18 sitting's table from its JSON files (see sitting.sh)."""
import json
import statistics
import sys
from pathlib import Path

out = Path(sys.argv[1])


def res(name: str) -> dict:
    return json.loads((out / f"{name}.json").read_text())["results"]


def vllm(name: str) -> dict:
    return json.loads((out / f"{name}.json").read_text())


for r in (1, 2, 3):
    row = []
    for v in ("base", "new"):
        lv, g = res(f"{v}_lv{r}"), res(f"{v}_g{r}")
        a, b = lv["us_per_request_median"], g["us_per_request_median"]
        row.append(f"{v}: levels {a:.1f} / GPU-only {b:.1f} us = {a / b:.2f}x "
                   f"(hit {lv['hit_rate']:.4f}, {lv['hit_rate'] / lv['lru512_hit_rate']:.3f}x "
                   "LRU-512)")
    print(f"round {r}: " + " | ".join(row))
k = [res(f"kvcm_gpu3M_r{r}") for r in (1, 2, 3)]
p = [vllm(f"vllm_gpu3M_r{r}") for r in (1, 2, 3)]
km = statistics.median(x["us_per_request_median"] for x in k)
pm = statistics.median(x["us_per_request_median"] for x in p)
print(f"GPU 3M: kvcm {[round(x['us_per_request_median'], 1) for x in k]} us/request, "
      f"vLLM {[round(x['us_per_request_median'], 1) for x in p]}; medians {km:.1f} vs {pm:.1f}: "
      f"kvcm {pm / km:.2f}x faster; hit rates {k[0]['hit_rate']:.5f} / {p[0]['hit_rate']:.5f}")
