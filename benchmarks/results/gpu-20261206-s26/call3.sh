#!/bin/bash
# Session 26's third device call: issue 9's levels sitting on the GPU host's CPU, the
# session's start (a076684, carried as wip/base with its shim) against this checkout,
# 3 alternating rounds (sitting-cpu-2core-20261206-s26/sitting.sh).
set -u
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-index .whl/*.whl > /dev/null 2>&1
python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1
bash benchmarks/results/sitting-cpu-2core-20261206-s26/sitting.sh "$OUT" wip/base 3 2>&1 | tail -8
