#!/bin/bash
# Session 19's sitting on the 2-core VM, nothing else running. Alternating, three rounds:
# - issue 9's levels replay (GPU 0.5M + host 1M + disk 3M tokens) and one GPU level of
#   4.5M tokens, at the session's start (BASE: 3545896, unpacked) and its end (this
#   checkout);
# - kvcm bench trace on one GPU level of 3M tokens beside vLLM's KV cache manager replaying
#   the same file the same way (peer_bench/vllm_trace_replay.py, its own venv).
# Usage: sitting.sh OUT BASE TRACE VLLM_PYTHON VLLM_REPLAY
set -u
O=$1; B=$2; T=$3; VPY=$4; VREP=$5
mkdir -p "$O"
C="--limit 1000 --block-size 64 --reps 3"
LV="--gpu-tokens 500000 --host-tokens 1000000 --disk-tokens 3000000"
N=$PWD
path() { echo "$1:$1/plugins/codecs:$1/plugins/eviction:$1/plugins/kernels:$1/plugins/tiers"; }
for r in 1 2 3; do
  for v in base new; do
    if [ $v = base ]; then D=$B; else D=$N; fi
    (cd "$D" && PYTHONPATH=$(path "$D") python -m kvcm_core.cli bench trace "$T" $C $LV \
       --out "$O/${v}_lv$r.json" > "$O/${v}_lv$r.log" 2>&1)
    (cd "$D" && PYTHONPATH=$(path "$D") python -m kvcm_core.cli bench trace "$T" $C \
       --gpu-tokens 4500000 --out "$O/${v}_g$r.json" > "$O/${v}_g$r.log" 2>&1)
  done
  PYTHONPATH=$(path "$N") python -m kvcm_core.cli bench trace "$T" $C --gpu-tokens 3000000 \
    --out "$O/kvcm_gpu3M_r$r.json" > "$O/kvcm_gpu3M_r$r.log" 2>&1
  "$VPY" "$VREP" "$T" --limit 1000 --block-size 64 --gpu-tokens 3000000 --reps 3 \
    --out "$O/vllm_gpu3M_r$r.json" > "$O/vllm_gpu3M_r$r.log" 2>&1
done
python3 "$(dirname "$0")/summarize.py" "$O"
