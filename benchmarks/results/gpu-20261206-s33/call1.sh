#!/bin/bash
# Session 33's first device call, on the session's code (3a708ad: the layout queries moved
# into manager_layout.py; no kernel or host-path change): every GPU test and the manager's
# suite with its pages on each device backend.
set -u
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
GPU_TESTS_LIMIT=330 OUT=$OUT bash benchmarks/gpu_run.sh gpu_tests manager_backends > "$OUT/gpu_run.txt" 2>&1
head -3 "$OUT/env.txt"
for f in "$OUT"/tests_gpu.log "$OUT"/manager_*.log; do echo "== $f"; tail -1 "$f"; done
grep -hE "FAILED|ERROR" "$OUT"/*.log | head -20
