#!/bin/bash
# Session 26's second device call: every GPU test on the merged code (the interrupt fixes,
# the remote level's fixes, the framed-write work); summaries to the output tail.
set -u
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
git log --oneline -1 > "$OUT/commit.txt" 2>/dev/null
GPU_TESTS_LIMIT=500 OUT=$OUT bash benchmarks/gpu_run.sh gpu_tests > "$OUT/gpu_run.txt" 2>&1
tail -2 "$OUT/tests_gpu.log"; grep -E "FAILED|ERROR" "$OUT"/*.log | head -20
