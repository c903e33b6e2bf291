#!/bin/bash
# Session 20's first device call, on session 19's final code (held writes): every GPU test
# (pytest -m gpu, 470 s limit for a cold machine), then `kvcm simulate` on each GPU backend
# through benchmarks/simulate_ab.py (manager time per step). Results under $OUT.
set -u
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"; R=$OUT
PY=python3
GPU_TESTS_LIMIT=470 OUT=$R bash benchmarks/gpu_run.sh gpu_tests > $R/gpu_run.txt 2>&1
for b in cuda cupy; do
  KVCM_KERNEL_BACKEND=$b timeout 45 $PY benchmarks/simulate_ab.py default 2>&1 | tail -1 \
    | sed "s/^/$b /" >> $R/simulate_ab.txt
done
tail -3 $R/gpu_run.txt; tail -3 $R/tests_gpu.log; cat $R/simulate_ab.txt
