#!/bin/bash
# Session 33's second device call, the same code: the kernel benchmark, then issue 9's
# levels replay beside GPU-only on this host's CPUs (three alternating rounds).
set -u
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
OUT=$OUT bash benchmarks/gpu_run.sh kernels_bench levels_sitting > "$OUT/gpu_run.txt" 2>&1
head -3 "$OUT/env.txt"
tail -3 "$OUT/bench.log"
for f in "$OUT"/kvcm_*.log; do echo "== $f"; grep -E "^rep|^│" "$f" | tail -4; done
grep -hE "FAILED|ERROR|Traceback" "$OUT"/*.log | head -20
