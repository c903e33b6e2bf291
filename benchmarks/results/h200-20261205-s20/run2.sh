#!/bin/bash
# Session 20's second device call, on the session's final code: every GPU test
# (pytest -m gpu) after the Batch/sparse, room-refusal and argument-check fixes. Results under $OUT.
set -u
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
GPU_TESTS_LIMIT=480 OUT=$OUT bash benchmarks/gpu_run.sh gpu_tests > $OUT/gpu_run.txt 2>&1
tail -3 $OUT/tests_gpu.log
