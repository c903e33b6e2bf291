#!/bin/bash
# Session 23's last device call, on the session's final code: every GPU test, the manager
# suite on each GPU backend, then issue 9's levels replay beside GPU-only on this host's CPU.
set -u
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
git log --oneline -1 > "$OUT/commit.txt" 2>/dev/null
GPU_TESTS_LIMIT=300 OUT=$OUT bash benchmarks/gpu_run.sh gpu_tests manager_backends \
  > "$OUT/gpu_run.txt" 2>&1
tail -1 "$OUT/tests_gpu.log" "$OUT"/manager_*.log
OUT=$OUT bash benchmarks/gpu_run.sh levels_sitting > "$OUT/levels_run.txt" 2>&1
python3 benchmarks/results/sitting-cpu-2core-20261204-s14/summarize.py "$OUT" \
  > "$OUT/levels_summary.txt" 2>&1
cat "$OUT/levels_summary.txt"
