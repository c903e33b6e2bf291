#!/bin/bash
# Session 29's device call, run twice (on 93ea1ee, then on the final code): every GPU
# test (frames built in a storage level's held rows, the LRU's pops and inserts, the disk
# level's page-cache reads, the close path), then the hybrid preset of kvcm simulate with
# pages on each GPU backend; summaries to the tail.
set -u
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
GPU_TESTS_LIMIT=480 OUT=$OUT bash benchmarks/gpu_run.sh gpu_tests hybrid_simulate > "$OUT/gpu_run.txt" 2>&1
head -3 "$OUT/env.txt"
tail -2 "$OUT/tests_gpu.log"; grep -E "FAILED|ERROR" "$OUT"/*.log | head -20
for b in cuda cupy; do echo "== hybrid $b"; grep -E "verified|exit|Error|error" "$OUT/hybrid_simulate_$b.log" | head -5; done
