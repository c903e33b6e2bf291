#!/bin/bash
# Every figure of issue 9's acceptance in one sitting (first used in session 32 on the
# project's 2-core VM), each kvcm run beside its vLLM peer run, alternating: the race (5 rounds, each side a
# median of 3 replays), the manager's host overhead (3 rounds), the levels replay against
# GPU-only (ROUNDS alternating rounds of --reps 3), and simulate on the trace.
# Each timed run, kvcm's and vLLM's alike, starts once the VM reads calm: floor.py's bare
# lookup floor at most GATE us per block (default 0.38; about 0.33 when nothing else runs
# on the host, up to 0.7 in the slow stretches of 2026-12-06), or after 120 s of waiting;
# the reading before each run is logged beside it in sitting.log.
# Usage: bash benchmarks/sitting/sit.sh OUTDIR [ROUNDS] [GATE], from the checkout, kvcm
# installed (a .venv there is activated); VLLM_PY: the python of a venv with vLLM 0.33 and
# benchmarks/peer/venv_requirements.txt (default /tmp/vllm-venv/bin/python); TRACE: the
# Mooncake trace (default .whl/mooncake_synthetic.jsonl). Then: python3
# benchmarks/sitting/summary.py OUTDIR.
O=$(realpath -m "$1"); ROUNDS=${2:-15}; GATE=${3:-0.38}
mkdir -p "$O"/race "$O"/manager "$O"/levels "$O"/simulate-trace
cd "$(git rev-parse --show-toplevel)" || exit 1
if [ -f .venv/bin/activate ]; then . .venv/bin/activate; fi
export PYTHONPATH=$PWD:$PWD/plugins/tiers:$PWD/plugins/kernels:$PWD/plugins/eviction:$PWD/plugins/codecs
git rev-parse --short HEAD > "$O"/commit.txt; git status --short | head -5 >> "$O"/commit.txt
VP=${VLLM_PY:-/tmp/vllm-venv/bin/python}
T=${TRACE:-.whl/mooncake_synthetic.jsonl}
HERE=$(dirname "$(realpath "$0")")
FLOOR=""
gate() { FLOOR=$(python "$HERE/floor.py" --wait "$GATE" | tail -1); }
log() { echo "$(date -u +%H:%M:%S) $* load=$(cut -d' ' -f1 /proc/loadavg) before: $FLOOR" | tee -a "$O/sitting.log"; }
R="--limit 1000 --block-size 64 --reps 3"
for r in 1 2 3 4 5; do
  gate
  $VP benchmarks/peer/vllm_trace_replay.py $T $R --gpu-tokens 3000000 --out $O/race/vllm$r.json > $O/race/vllm$r.log 2>&1; log race vllm$r
  gate
  python -m kvcm_core.cli bench trace $T $R --gpu-tokens 3000000 --out $O/race/kvcm$r.json > $O/race/kvcm$r.log 2>&1; log race kvcm$r
done
for r in 1 2 3; do
  gate
  $VP benchmarks/peer/vllm_host_overhead.py --out $O/manager/vllm$r.json > $O/manager/vllm$r.log 2>&1; log manager vllm$r
  gate
  python -m kvcm_core.cli bench manager --out $O/manager/kvcm$r.json > $O/manager/kvcm$r.log 2>&1; log manager kvcm$r
done
L="--gpu-tokens 500000 --host-tokens 1000000 --disk-tokens 3000000"
for r in $(seq 1 "$ROUNDS"); do
  gate
  python -m kvcm_core.cli bench trace $T $R $L --out $O/levels/levels_r$r.json > $O/levels/levels_r$r.log 2>&1; log levels_r$r
  gate
  python -m kvcm_core.cli bench trace $T $R --gpu-tokens 4500000 --out $O/levels/gpu_r$r.json > $O/levels/gpu_r$r.log 2>&1; log gpu_r$r
done
( time python -m kvcm_core.cli simulate --trace $T --trace-limit 300 --out $O/simulate-trace ) > $O/simulate-trace/sim.log 2>&1; echo "rc=$?" >> $O/simulate-trace/sim.log
log all done
