#!/bin/bash
# Session 25's first device call, on the code of the moment: every GPU test, then the
# manager suite with pages on each GPU backend. Summaries go to the output tail (a call
# returns a limited number of files).
set -u
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
git log --oneline -1 > "$OUT/commit.txt" 2>/dev/null
GPU_TESTS_LIMIT=330 OUT=$OUT bash benchmarks/gpu_run.sh gpu_tests manager_backends \
  > "$OUT/gpu_run.txt" 2>&1
tail -3 "$OUT/tests_gpu.log"; tail -1 "$OUT"/manager_*.log
grep -E "FAILED|ERROR" "$OUT"/*.log | head -30
head -6 "$OUT/env.txt"
