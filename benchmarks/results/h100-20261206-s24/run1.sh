#!/bin/bash
# Session 24's first device call, on the code of the moment (session 23's final commits
# never ran on a GPU, and this session's fixes): every GPU test, then the manager suite
# on each GPU backend.
set -u
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
git log --oneline -1 > "$OUT/commit.txt" 2>/dev/null
GPU_TESTS_LIMIT=300 OUT=$OUT bash benchmarks/gpu_run.sh gpu_tests manager_backends \
  > "$OUT/gpu_run.txt" 2>&1
tail -3 "$OUT/tests_gpu.log"; tail -1 "$OUT"/manager_*.log
grep -E "FAILED|ERROR" "$OUT"/*.log | head -30
