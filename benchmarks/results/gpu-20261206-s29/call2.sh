#!/bin/bash
# Session 29's second device call: every GPU test on the final code (the close path, the
# LRU's inserts of many closes and reserve, since call1's tree); summary to the tail.
set -u
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
GPU_TESTS_LIMIT=420 OUT=$OUT bash benchmarks/gpu_run.sh gpu_tests > "$OUT/gpu_run.txt" 2>&1
head -3 "$OUT/env.txt"
tail -2 "$OUT/tests_gpu.log"; grep -E "FAILED|ERROR" "$OUT"/*.log | head -20
