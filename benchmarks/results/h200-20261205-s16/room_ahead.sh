#!/bin/bash
# Session 16's second H200 call: making room ahead (make_room once per engine step) on
# and off, alternating, in kvcm simulate on each GPU backend; the new tests on each
# backend. Results under $OUT.
set -u
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
PY=python3
$PY -m pip install -q --no-deps --no-index .whl/*.whl > /dev/null 2>&1
$PY -m pip install -q --no-deps --no-build-isolation -e . -e examples/kvcm-tier-example \
  -e examples/tiny-engine > /dev/null 2>&1
for b in cuda cupy; do
  KVCM_TEST_BACKEND=$b timeout 120 $PY -m pytest -q tests/test_make_room.py \
    tests/test_engine_loop.py -p no:cacheprovider 2>&1 | tail -2 > "$OUT/tests_$b.txt"
done
off='import sys; sys.path.insert(0, "benchmarks"); import kvcm_core.testing.engine as E
E.EngineLoop.room_ahead = lambda self: None
import simulate_profile as sp; sp.run(sys.argv[1:])'
for r in 1 2 3; do
  for b in cuda cupy; do
    KVCM_KERNEL_BACKEND=$b timeout 100 $PY benchmarks/simulate_profile.py --out /tmp/sp \
      2>&1 | head -1 | sed "s/^/$b on  r$r: /" >> "$OUT/room_ahead.txt"
    KVCM_KERNEL_BACKEND=$b timeout 100 $PY -c "$off" --out /tmp/sp \
      2>&1 | head -1 | sed "s/^/$b off r$r: /" >> "$OUT/room_ahead.txt"
  done
done
cat "$OUT"/tests_*.txt "$OUT/room_ahead.txt"
