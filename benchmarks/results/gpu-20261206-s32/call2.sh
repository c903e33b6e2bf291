#!/bin/bash
# Session 32's second device call (the machine still warm from the first): every GPU test.
set -u
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
GPU_TESTS_LIMIT=420 OUT=$OUT bash benchmarks/gpu_run.sh gpu_tests > "$OUT/gpu_run.txt" 2>&1
head -3 "$OUT/env.txt"
tail -1 "$OUT/tests_gpu.log"
grep -hE "FAILED|ERROR" "$OUT"/*.log | head -20
