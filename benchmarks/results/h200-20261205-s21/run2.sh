#!/bin/bash
# Session 21's second device call (warm machine, session 20's final code): `kvcm simulate`
# on each GPU backend through benchmarks/simulate_ab.py, two alternating rounds (manager
# time per step, issue 16's p99 bar). Results under $OUT.
set -u
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"; R=$OUT
PY=python3
for r in 1 2; do for b in cuda cupy; do
  KVCM_KERNEL_BACKEND=$b timeout 60 $PY benchmarks/simulate_ab.py default 2>&1 | tail -1 \
    | sed "s/^/round $r $b /" >> $R/simulate_ab.txt
done; done
nproc >> $R/host.txt; lscpu | grep -iE "model name|^CPU\(s\)|MHz" >> $R/host.txt
cat $R/simulate_ab.txt $R/host.txt
