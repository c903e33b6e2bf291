#!/bin/bash
# Session 21's first device call, on session 20's final code (84d39f7): every GPU test
# (pytest -m gpu), since 192 sparse GPU tests and the quant kernels had not run on it. Results under $OUT.
set -u
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
GPU_TESTS_LIMIT=540 OUT=$OUT bash benchmarks/gpu_run.sh gpu_tests > $OUT/gpu_run.txt 2>&1
tail -3 $OUT/tests_gpu.log
