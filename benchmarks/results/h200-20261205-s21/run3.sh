#!/bin/bash
# Session 21's third device call: where `kvcm simulate`'s manager time goes on the GPU
# host (benchmarks/profile_simulate.py): level moves by pair and backend/fence calls on
# each GPU backend, and a cProfile on cuda. Results under $OUT.
set -u
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
PY=python3
"$PY" -m pip install -q --no-deps --no-index .whl/*.whl > /dev/null 2>&1
"$PY" -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1
for b in cuda cupy; do
  KVCM_KERNEL_BACKEND=$b timeout 90 $PY benchmarks/profile_simulate.py moves $OUT/moves-$b.txt > /dev/null 2>&1
done
KVCM_KERNEL_BACKEND=cuda timeout 150 $PY benchmarks/profile_simulate.py profile $OUT/profile-cuda.txt > /dev/null 2>&1
cat $OUT/moves-*.txt
