#!/bin/bash
# Session 25's second device call: issue 9's levels sitting on the GPU host's CPU (three
# alternating rounds of --reps 3: levels, GPU-only 4.5M, levels with inline writes), then
# the quick kernel benchmark. Ratios to the output tail.
set -u
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
git log --oneline -1 > "$OUT/commit.txt" 2>/dev/null
OUT=$OUT bash benchmarks/gpu_run.sh levels_sitting kernels_quick > "$OUT/gpu_run.txt" 2>&1
python3 benchmarks/results/sitting-cpu-2core-20261204-s14/summarize.py "$OUT" 2>&1 | tail -12
tail -25 "$OUT/bench.log"
