#!/bin/bash
# Session 14's levels sitting on the 2-core machine (main at commit.txt): levels (GPU 0.5M +
# host 1M + disk 3M, default I/O: background writes) beside GPU-only 4.5M and the same
# levels without the I/O thread, 4 alternating rounds of 3 repetitions each.
set -u
OUT=$1; PY=${PY:-.venv/bin/python}
TRACE=/work/shared/traces/mooncake_synthetic.jsonl
C="--limit 1000 --block-size 64 --reps 3"
L="--gpu-tokens 500000 --host-tokens 1000000 --disk-tokens 3000000"
NOIO=benchmarks/results/sitting-cpu-2core-20261202-s10/no_io_thread.py
log() { echo "$(date -u +%H:%M:%S) $* load=$(cut -d' ' -f1 /proc/loadavg)" | tee -a "$OUT/sitting.log"; }
git rev-parse HEAD > "$OUT/commit.txt"
for r in 1 2 3 4; do
  $PY -m kvcm_core.cli bench trace $TRACE $C $L --out "$OUT/kvcm_levels_r$r.json" > "$OUT/kvcm_levels_r$r.log" 2>&1; log kvcm_levels_r$r
  $PY -m kvcm_core.cli bench trace $TRACE $C --gpu-tokens 4500000 --out "$OUT/kvcm_gpu4.5M_r$r.json" > "$OUT/kvcm_gpu4.5M_r$r.log" 2>&1; log kvcm_gpu4.5M_r$r
  $PY $NOIO $TRACE $C $L --out "$OUT/kvcm_levels_sync_r$r.json" > "$OUT/kvcm_levels_sync_r$r.log" 2>&1; log kvcm_levels_sync_r$r
done
log DONE
