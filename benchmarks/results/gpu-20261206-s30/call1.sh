#!/bin/bash
# Session 30's device call: every GPU test on the final code (the close path of sessions 29
# and 30, the LRU's inserts of many closes and reserve); summary to the tail.
set -u
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
GPU_TESTS_LIMIT=420 OUT=$OUT bash benchmarks/gpu_run.sh gpu_tests > "$OUT/gpu_run.txt" 2>&1
head -3 "$OUT/env.txt"
tail -2 "$OUT/tests_gpu.log"; grep -E "FAILED|ERROR" "$OUT"/*.log | head -20
