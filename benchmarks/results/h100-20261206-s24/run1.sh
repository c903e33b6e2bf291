#!/bin/bash
# Session 24's first device call, on 0b6bc04 (session 23's final code, whose last commits
# never ran on a GPU): every GPU test, then the manager suite on each GPU backend.
set -u
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
GPU_TESTS_LIMIT=300 OUT=$OUT bash benchmarks/gpu_run.sh gpu_tests manager_backends \
  > "$OUT/gpu_run.txt" 2>&1
tail -3 "$OUT/tests_gpu.log"; tail -1 "$OUT"/manager_*.log
grep -E "FAILED|ERROR" "$OUT"/*.log | head -30
