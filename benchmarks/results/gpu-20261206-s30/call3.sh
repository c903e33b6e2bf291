#!/bin/bash
# Session 30's third device call (what the device time left allows, after the review's fix
# of the close path, 4b536da): the manager's suite with pages on each device backend and
# the hybrid simulate preset verified on cuda and cupy; summary to the tail.
set -u
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
OUT=$OUT bash benchmarks/gpu_run.sh manager_backends hybrid_simulate > "$OUT/gpu_run.txt" 2>&1
head -3 "$OUT/env.txt"
for f in "$OUT"/manager_*.log "$OUT"/hybrid_simulate_*.log; do echo "== $f"; tail -1 "$f"; done
grep -h "verified" "$OUT"/hybrid_simulate_*.log
grep -hE "FAILED|ERROR" "$OUT"/*.log | head -20
