#!/bin/bash
# Session 32's first device call: the kernel benchmark (the CUDA and CuPy kernels are
# unchanged since 2026-12-04; the numpy backend's copy path changed on 2026-12-06, after the
# last kernel benchmark) and the manager's suite with pages on each device backend.
set -u
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
OUT=$OUT bash benchmarks/gpu_run.sh kernels_bench manager_backends > "$OUT/gpu_run.txt" 2>&1
head -3 "$OUT/env.txt"
for f in "$OUT"/bench.log "$OUT"/manager_*.log; do echo "== $f"; tail -3 "$f"; done
grep -hE "FAILED|ERROR" "$OUT"/*.log | head -20
