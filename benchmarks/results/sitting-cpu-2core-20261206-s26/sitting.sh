#!/bin/bash
# Session 26's sitting: issue 9's levels replay (GPU 0.5M + host 1M + disk 3M tokens) beside
# GPU-only 4.5M, for the session's start (BASE: an export of a076684 with a shim that drops
# the editable install, see below) and this checkout, ROUNDS alternating rounds of --reps 3.
# Each side runs from its own directory: `python -m` puts the working directory first on
# sys.path, so the base must run from BASE itself (session 25's sitting ran the base's
# plugins with the current core this way: its start-of-session rows were not the old code).
# Usage: sitting.sh OUT BASE [ROUNDS]; BASE/shim/sitecustomize.py drops the editable finder.
set -u
OUT=$(realpath -m "$1"); BASE=$(realpath "$2"); ROUNDS=${3:-3}
HERE=$PWD; PY=${PY:-python3}
TRACE=$(realpath "${KVCM_TRACE:-.whl/mooncake_synthetic.jsonl}")
C="--limit 1000 --block-size 64 --reps 3"
L="--gpu-tokens 500000 --host-tokens 1000000 --disk-tokens 3000000"
BP=$BASE/shim:$BASE:$BASE/plugins/tiers:$BASE/plugins/kernels:$BASE/plugins/eviction:$BASE/plugins/codecs
log() { echo "$(date -u +%H:%M:%S) $* load=$(cut -d' ' -f1 /proc/loadavg)" | tee -a "$OUT/sitting.log"; }
mkdir -p "$OUT"; git rev-parse HEAD > "$OUT/commit.txt" 2>/dev/null
(cd "$BASE" && PYTHONPATH=$BP $PY -c "import kvcm_core, kvcm_eviction_lru; print('base code:', kvcm_core.__file__, kvcm_eviction_lru.__file__)") | tee -a "$OUT/sitting.log"
$PY -c "import kvcm_core, kvcm_eviction_lru; print('new code:', kvcm_core.__file__, kvcm_eviction_lru.__file__)" | tee -a "$OUT/sitting.log"
base() { (cd "$BASE" && PYTHONPATH=$BP timeout 120 $PY -m kvcm_core.cli bench trace "$TRACE" "$@"); }
new() { timeout 120 $PY -m kvcm_core.cli bench trace "$TRACE" "$@"; }
for r in $(seq 1 "$ROUNDS"); do
  base $C $L --out "$OUT/base_levels_r$r.json" > "$OUT/base_levels_r$r.log" 2>&1; log base_levels_r$r
  new $C $L --out "$OUT/new_levels_r$r.json" > "$OUT/new_levels_r$r.log" 2>&1; log new_levels_r$r
  base $C --gpu-tokens 4500000 --out "$OUT/base_gpu_r$r.json" > "$OUT/base_gpu_r$r.log" 2>&1; log base_gpu_r$r
  new $C --gpu-tokens 4500000 --out "$OUT/new_gpu_r$r.json" > "$OUT/new_gpu_r$r.log" 2>&1; log new_gpu_r$r
done
$PY "$HERE/benchmarks/results/sitting-cpu-2core-20261206-s26/summarize.py" "$OUT" | tee -a "$OUT/sitting.log"
