#!/bin/bash
# Session 25's sitting on the 2-core VM, nothing else running: issue 9's levels replay
# (GPU 0.5M + host 1M + disk 3M tokens) beside GPU-only 4.5M, for the session's start
# (OLD, a worktree of d3fabcb) and its end (this checkout), plus the levels without the
# I/O thread, 3 alternating rounds of --reps 3; then vLLM 0.33 beside kvcm on the GPU-3M
# race, 2 alternating rounds. Usage: sitting.sh OUT OLD_WORKTREE
set -u
OUT=$1; OLD=$2; PY=${PY:-.venv/bin/python}
TRACE=/work/shared/traces/mooncake_synthetic.jsonl
C="--limit 1000 --block-size 64 --reps 3"
L="--gpu-tokens 500000 --host-tokens 1000000 --disk-tokens 3000000"
NOIO=benchmarks/results/sitting-cpu-2core-20261202-s10/no_io_thread.py
OLDPATH=$OLD:$OLD/plugins/tiers:$OLD/plugins/kernels:$OLD/plugins/eviction:$OLD/plugins/codecs
log() { echo "$(date -u +%H:%M:%S) $* load=$(cut -d' ' -f1 /proc/loadavg)" | tee -a "$OUT/sitting.log"; }
mkdir -p "$OUT"; git rev-parse HEAD > "$OUT/commit.txt"; git -C "$OLD" rev-parse HEAD > "$OUT/old_commit.txt"
for r in 1 2 3; do
  PYTHONPATH=$OLDPATH $PY -m kvcm_core.cli bench trace $TRACE $C $L --out "$OUT/old_levels_r$r.json" > "$OUT/old_levels_r$r.log" 2>&1; log old_levels_r$r
  PYTHONPATH=$OLDPATH $PY -m kvcm_core.cli bench trace $TRACE $C --gpu-tokens 4500000 --out "$OUT/old_gpu4.5M_r$r.json" > "$OUT/old_gpu4.5M_r$r.log" 2>&1; log old_gpu4.5M_r$r
  $PY -m kvcm_core.cli bench trace $TRACE $C $L --out "$OUT/kvcm_levels_r$r.json" > "$OUT/kvcm_levels_r$r.log" 2>&1; log kvcm_levels_r$r
  $PY -m kvcm_core.cli bench trace $TRACE $C --gpu-tokens 4500000 --out "$OUT/kvcm_gpu4.5M_r$r.json" > "$OUT/kvcm_gpu4.5M_r$r.log" 2>&1; log kvcm_gpu4.5M_r$r
  $PY $NOIO $TRACE $C $L --out "$OUT/kvcm_levels_sync_r$r.json" > "$OUT/kvcm_levels_sync_r$r.log" 2>&1; log kvcm_levels_sync_r$r
done
for r in 1 2; do
  /tmp/vllm-venv/bin/python benchmarks/peer/vllm_trace_replay.py $TRACE --limit 1000 --block-size 64 --gpu-tokens 3000000 --reps 3 --out "$OUT/vllm_r$r.json" > "$OUT/vllm_r$r.log" 2>&1; log vllm_r$r
  $PY -m kvcm_core.cli bench trace $TRACE --limit 1000 --block-size 64 --gpu-tokens 3000000 --reps 3 --out "$OUT/kvcm3M_r$r.json" > "$OUT/kvcm3M_r$r.log" 2>&1; log kvcm3M_r$r
done
log DONE
