#!/bin/bash
# Session 21's last device call, on the session's final code: every GPU test (pytest -m gpu).
# Results under $OUT.
set -u
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
GPU_TESTS_LIMIT=470 OUT=$OUT bash benchmarks/gpu_run.sh gpu_tests > $OUT/gpu_run.txt 2>&1
tail -2 $OUT/tests_gpu.log
