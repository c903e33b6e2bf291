"""Side-by-side tables of one sitting: ``vllm-r*.json`` (vllm_host_overhead.py),
``kvcm-before-r*.json`` and ``kvcm-after-r*.json`` (kvcm bench manager) in the folder given
(default: this one). Each cell: the median over rounds of each run's median over its reps,
and in brackets the minimum over rounds of each run's minimum."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

folder = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent)


def load(side: str) -> list[dict[str, Any]]:
    return [json.loads(f.read_text()) for f in sorted(folder.glob(f"{side}-r*.json"))]


V, B, N = load("vllm"), load("kvcm-before"), load("kvcm-after")


def pick(run: dict[str, Any], path: list[str]) -> float:
    x: Any = run["results"]
    for p in path:
        x = x[p]
    return float(x)


def cell(runs: list[dict[str, Any]], path: list[str] | None) -> str:
    if path is None:
        return "-"
    med = statistics.median(pick(r, [*path[:2], "median", *path[2:]]) for r in runs)
    low = min(pick(r, [*path[:2], "min", *path[2:]]) for r in runs)
    return f"{med:.3f} ({low:.3f})"


def row(label: str, vpath: list[str] | None, kpath: list[str] | None) -> str:
    return f"| {label} | {cell(V, vpath)} | {cell(B, kpath)} | {cell(N, kpath)} |"


print(f"rounds: vllm {len(V)}, kvcm before {len(B)}, kvcm after {len(N)}\n")
print("| median (min) | vLLM 0.33 | kvcm before | kvcm after |")
print("| --- | --- | --- | --- |")
for tpb in (16, 32):
    bs = f"block_size_{tpb}"
    dec, pre = [bs, "decode"], [bs, "prefill_prefix_reuse"]
    print(row(f"tpb {tpb} decode us/req-step (vLLM: allocate_slots + append/hash)",
              [*dec, "alloc_plus_append_us_per_req_step"],
              [*dec, "resize_commit_us_per_req_step"]))
    print(row(f"tpb {tpb} decode us/req-step (vLLM: allocate_slots only)",
              [*dec, "alloc_us_per_req_step"], None))
    print(row(f"tpb {tpb} close/free after decode, us/block",
              [*dec, "free_us_per_block"], [*dec, "close_us_per_block"]))
    print(row(f"tpb {tpb} close/free after prefill, us/block",
              [*pre, "free_us_per_block"], [*pre, "close_us_per_block"]))
    print(row(f"tpb {tpb} prefill lookup us/matched block (vLLM: get_computed_blocks, "
              "its hashing apart)",
              [*pre, "get_computed_blocks_us_per_matched_block"],
              [*pre, "lookup_us_per_matched_block"]))
    print(row(f"tpb {tpb} prefill total us/request",
              [*pre, "total_us_per_request"], [*pre, "total_us_per_request"]))
for tpb in (16, 32):
    bs = f"block_size_{tpb}"
    h = [r["results"][bs]["prefill_prefix_reuse"]["median"]
         ["request_init_block_hash_us_per_request"] / (r["config"]["prefill_len"] // tpb)
         for r in V]
    print(f"\nvLLM tpb {tpb}: SHA-256 block hashing at request init "
          f"{statistics.median(h):.3f} us/block (median over rounds)")
print("\nprobe_reuse, tpb 16, 64 matched blocks, us per matched block: median over rounds "
      "of each run's median (min over rounds)\n")
print("| cached blocks | before, list | before, int32 | after, list | after, int32 "
      "| bare chain (after runs) |")
print("| --- | --- | --- | --- | --- | --- |")
keys = ("us_per_matched_block_median", "int32_array_us_per_matched_block_median")
for size in ("10000", "100000", "1000000"):
    cells = []
    for runs in (B, N):
        for key in keys:
            vals = [r["results"]["lookup_scaling"][size][key] for r in runs]
            cells.append(f"{statistics.median(vals):.3f} ({min(vals):.3f})")
    vals = [r["results"]["lookup_scaling"][size]["bare_chain_us_per_matched_block_median"]
            for r in N]
    cells.append(f"{statistics.median(vals):.3f} ({min(vals):.3f})")
    print(f"| {size} | " + " | ".join(cells) + " |")
for name, runs in (("before", B), ("after", N)):
    for key in keys:
        ratios = [r["results"]["lookup_scaling"]["1000000"][key]
                  / r["results"]["lookup_scaling"]["10000"][key] for r in runs]
        print(f"{name} {key}: 1M / 10k per run {[round(x, 2) for x in ratios]}")
