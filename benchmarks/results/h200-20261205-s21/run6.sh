#!/bin/bash
# Session 21's last device call (about 240 s of device time left after failed starts):
# the GPU tests of the manager, the overlapped migrations and the Batch on the final code.
set -u
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
PY=python3
"$PY" -m pip install -q --no-deps --no-index .whl/*.whl > /dev/null 2>&1
"$PY" -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1
timeout 130 "$PY" -m pytest -q -m gpu -p no:cacheprovider --tb=short tests/test_gpu_manager.py \
  tests/test_migrate_overlap.py tests/test_batch_gpu.py > $OUT/tests_gpu.log 2>&1
tail -3 $OUT/tests_gpu.log
