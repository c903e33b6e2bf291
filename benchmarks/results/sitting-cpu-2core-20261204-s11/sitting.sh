#!/bin/bash
# Session 11's sitting (session 10's script) (no other job on the 2-core machine), main at commit.txt:
# kvcm bench trace beside vLLM's trace replay (first 1,000 Mooncake requests, block 64, GPU
# 3M tokens, alternating, 3 pairs); levels (GPU 0.5M + host 1M + disk 3M, default I/O:
# background writes) beside GPU 4.5M and beside the same levels without the I/O thread
# (no_io_thread.py), 3 alternating rounds; kvcm bench manager beside vllm_host_overhead.py;
# kvcm bench redis.
set -u
OUT=$1; PY=${PY:-.venv/bin/python}; VPY=${VPY:-/tmp/vllm-venv/bin/python}
TRACE=/work/shared/traces/mooncake_synthetic.jsonl; PB=/work/shared/peer_bench
C="--limit 1000 --block-size 64 --reps 3"
L="--gpu-tokens 500000 --host-tokens 1000000 --disk-tokens 3000000"
log() { echo "$(date -u +%H:%M:%S) $* load=$(cut -d' ' -f1 /proc/loadavg)" | tee -a "$OUT/sitting.log"; }
git rev-parse HEAD > "$OUT/commit.txt"
for r in 1 2 3; do
  $PY -m kvcm_core.cli bench trace $TRACE $C --gpu-tokens 3000000 --out "$OUT/kvcm_gpu3M_r$r.json" > "$OUT/kvcm_gpu3M_r$r.log" 2>&1; log kvcm_gpu3M_r$r
  $VPY $PB/vllm_trace_replay.py $TRACE $C --gpu-tokens 3000000 --out "$OUT/vllm_gpu3M_r$r.json" > "$OUT/vllm_gpu3M_r$r.log" 2>&1; log vllm_gpu3M_r$r
done
for r in 1 2 3; do
  $PY -m kvcm_core.cli bench trace $TRACE $C $L --out "$OUT/kvcm_levels_r$r.json" > "$OUT/kvcm_levels_r$r.log" 2>&1; log kvcm_levels_r$r
  $PY -m kvcm_core.cli bench trace $TRACE $C --gpu-tokens 4500000 --out "$OUT/kvcm_gpu4.5M_r$r.json" > "$OUT/kvcm_gpu4.5M_r$r.log" 2>&1; log kvcm_gpu4.5M_r$r
  $PY "$(dirname "$0")/no_io_thread.py" $TRACE $C $L --out "$OUT/kvcm_levels_sync_r$r.json" > "$OUT/kvcm_levels_sync_r$r.log" 2>&1; log kvcm_levels_sync_r$r
done
$VPY $PB/vllm_host_overhead.py --out "$OUT/vllm_host.json" > "$OUT/vllm_host.log" 2>&1; log vllm_host
$PY -m kvcm_core.cli bench manager --out "$OUT/kvcm_host.json" > "$OUT/kvcm_host.log" 2>&1; log kvcm_host
$PY -m kvcm_core.cli bench redis --out "$OUT" > "$OUT/redis.log" 2>&1; log redis
log DONE
