#!/bin/bash
# Session 24's device call once little device time was left (failed starts took most of
# it): every GPU test (pytest -m gpu) on the code of the moment, nothing else.
set -u
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
GPU_TESTS_LIMIT=330 OUT=$OUT bash benchmarks/gpu_run.sh gpu_tests > "$OUT/gpu_run.txt" 2>&1
tail -3 "$OUT/tests_gpu.log"
grep -E "FAILED|ERROR" "$OUT"/*.log | head -30
head -5 "$OUT/env.txt"
