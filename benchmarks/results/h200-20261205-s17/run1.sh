#!/bin/bash
# Session 17's first H200 call: every GPU test (pytest -m gpu), then `kvcm simulate`
# with the engine loop as it is, with refused requests' caches closed (as before this
# session) and without room ahead, alternating, two rounds on each GPU backend.
# Results under $OUT.
set -u
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"; R=$OUT
PY=python3
GPU_TESTS_LIMIT=290 OUT=$R bash benchmarks/gpu_run.sh gpu_tests > $R/gpu_run.txt 2>&1
for r in 1 2; do
  for b in cuda cupy; do
    for v in default close-refused no-room-ahead; do
      KVCM_KERNEL_BACKEND=$b timeout 60 $PY benchmarks/simulate_ab.py $v 2>&1 | tail -1 \
        | sed "s/^/$b r$r /" >> $R/simulate_ab.txt
    done
  done
done
tail -3 $R/gpu_run.txt; cat $R/simulate_ab.txt
