#!/bin/bash
# Session 21's last device call, on the session's final code: every GPU test (pytest -m gpu),
# then where simulate's manager time goes on this host (moves by level pair, backend and
# fence calls, cuda) and one simulate on each backend. Results under $OUT.
set -u
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
PY=python3
GPU_TESTS_LIMIT=440 OUT=$OUT bash benchmarks/gpu_run.sh gpu_tests > $OUT/gpu_run.txt 2>&1
tail -2 $OUT/tests_gpu.log
KVCM_KERNEL_BACKEND=cuda timeout 60 $PY benchmarks/profile_simulate.py moves $OUT/moves-cuda.txt > /dev/null 2>&1
for b in cuda cupy; do
  KVCM_KERNEL_BACKEND=$b timeout 40 $PY benchmarks/simulate_ab.py default 2>&1 | tail -1 \
    | sed "s/^/$b /" >> $OUT/simulate_ab.txt
done
cat $OUT/moves-cuda.txt $OUT/simulate_ab.txt 2>/dev/null
