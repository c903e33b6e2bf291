#!/bin/bash
# Session 18's second device call: every GPU test (pytest -m gpu) on the merged code, with
# a limit long enough for a cold machine to finish. Results under $OUT.
set -u
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
GPU_TESTS_LIMIT=460 OUT=$OUT bash benchmarks/gpu_run.sh gpu_tests > $OUT/gpu_run.txt 2>&1
tail -3 $OUT/tests_gpu.log
