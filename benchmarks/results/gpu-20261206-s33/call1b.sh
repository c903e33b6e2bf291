#!/bin/bash
# Session 33's device call when little device time is left: every GPU test only.
set -u
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
GPU_TESTS_LIMIT=330 OUT=$OUT bash benchmarks/gpu_run.sh gpu_tests > "$OUT/gpu_run.txt" 2>&1
head -3 "$OUT/env.txt"
tail -1 "$OUT"/tests_gpu.log
grep -hE "FAILED|ERROR" "$OUT"/*.log | head -20
