#!/bin/bash
# Session 20's third device call (a short one: the session's last device minutes): the GPU
# tests other than the quant codec kernels (unchanged since run 2), on the code after the
# later review fixes (Batch.resize checks, sparse publish checked once, commit's stream).
set -u
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
GPU_TESTS_K="not test_codecs_quant" GPU_TESTS_LIMIT=150 OUT=$OUT \
  bash benchmarks/gpu_run.sh gpu_tests > $OUT/gpu_run.txt 2>&1
tail -3 $OUT/tests_gpu.log
