#!/bin/bash
# Session 21's last device call (470 s of device time left after failed starts), on the
# session's final code: the GPU tests other than the sparse kernels and the quant codec
# kernels (their code did not change since run 1), then the beam, prefix-reuse and
# lifecycle suites with pages on the cuda backend. Results under $OUT.
set -u
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
PY=python3
GPU_TESTS_K="not test_sparse_gpu and not test_codecs_quant" GPU_TESTS_LIMIT=200 OUT=$OUT \
  bash benchmarks/gpu_run.sh gpu_tests > $OUT/gpu_run.txt 2>&1
tail -2 $OUT/tests_gpu.log
KVCM_TEST_BACKEND=cuda KVCM_PROPERTY_EXAMPLES=10 timeout 100 "$PY" -m pytest -q -p no:cacheprovider \
  --tb=short tests/test_beams.py tests/test_prefix_reuse.py tests/test_manager_lifecycle.py \
  > $OUT/manager_cuda.log 2>&1
tail -2 $OUT/manager_cuda.log
