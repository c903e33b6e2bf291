#!/bin/bash
# Session 18's first H200 call, on session 17's final code: every GPU test (pytest -m gpu,
# with room to finish this time), issue 9's levels replay beside GPU-only on this host's
# CPU (16 cores: the disk I/O thread does not share the main thread's core), and
# `kvcm simulate` twice on each GPU backend. Results under $OUT.
set -u
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"; R=$OUT
PY=python3
GPU_TESTS_LIMIT=330 OUT=$R bash benchmarks/gpu_run.sh gpu_tests > $R/gpu_run.txt 2>&1
mkdir -p $R/lv && OUT=$R/lv timeout 150 bash benchmarks/gpu_run.sh levels_sitting > /dev/null 2>&1
$PY benchmarks/results/sitting-cpu-2core-20261204-s14/summarize.py $R/lv > $R/levels_summary.txt 2>&1
rm -rf $R/lv
for r in 1 2; do
  for b in cuda cupy; do
    KVCM_KERNEL_BACKEND=$b timeout 40 $PY benchmarks/simulate_ab.py default 2>&1 | tail -1 \
      | sed "s/^/$b r$r /" >> $R/simulate_ab.txt
  done
done
tail -3 $R/gpu_run.txt; cat $R/levels_summary.txt $R/simulate_ab.txt
