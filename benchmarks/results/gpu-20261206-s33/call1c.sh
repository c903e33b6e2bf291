#!/bin/bash
# Session 33's device call with the little device time left after refused starts: the
# manager's suite with its pages on each device backend (cuda-python, CuPy), which covers
# the layout queries this session moved (base addresses, strides, regions, converters).
set -u
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
OUT=$OUT bash benchmarks/gpu_run.sh manager_backends > "$OUT/gpu_run.txt" 2>&1
head -3 "$OUT/env.txt"
for f in "$OUT"/manager_*.log; do echo "== $f"; tail -1 "$f"; done
grep -hE "FAILED|ERROR" "$OUT"/*.log | head -20
