#!/bin/bash
# Session 27's third device call: the sparse arena's moved-row write map on each GPU backend
# (a device-to-device copy at the publish, new today), the sparse GPU tests, and the sparse
# preset of kvcm simulate on each backend; summaries to the tail.
set -u
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
GPU_TESTS_LIMIT=300 GPU_TESTS_K="sparse" OUT=$OUT bash benchmarks/gpu_run.sh gpu_tests sparse_simulate > "$OUT/gpu_run.txt" 2>&1
head -3 "$OUT/env.txt"; tail -2 "$OUT/tests_gpu.log"; grep -E "FAILED|ERROR" "$OUT"/*.log | head -20
grep -c "moved_after_the_flush" "$OUT/tests_gpu.log"
for b in cuda cupy; do echo "== sparse $b"; tail -3 "$OUT/sparse_simulate_$b.log"; done
