#!/bin/bash
# Session 25's second device call, after the levels' hot-path work: issue 9's levels sitting
# on the GPU host's CPU (three alternating rounds of --reps 3: levels, GPU-only 4.5M,
# levels with inline writes, by gpu_run.sh levels_sitting), then the session start's code
# (d3fabcb, carried in wip/old, meant to be imported through PYTHONPATH; on the device
# image the editable install wins, so those rows ran the new code: see README.md) for levels and GPU-only, three
# rounds more; the ratios to the output tail; then every GPU test.
set -u
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
PY=python3
OUT=$OUT bash benchmarks/gpu_run.sh levels_sitting > "$OUT/gpu_run.txt" 2>&1
T=.whl/mooncake_synthetic.jsonl; C="--limit 1000 --block-size 64 --reps 3"
L="--gpu-tokens 500000 --host-tokens 1000000 --disk-tokens 3000000"
O=$PWD/wip/old; OP=$O:$O/plugins/tiers:$O/plugins/kernels:$O/plugins/eviction:$O/plugins/codecs
for r in 1 2 3; do
  PYTHONPATH=$OP timeout 90 $PY -m kvcm_core.cli bench trace $T $C $L --out "$OUT/old_levels_r$r.json" > "$OUT/old_levels_r$r.log" 2>&1
  PYTHONPATH=$OP timeout 90 $PY -m kvcm_core.cli bench trace $T $C --gpu-tokens 4500000 --out "$OUT/old_gpu4.5M_r$r.json" > "$OUT/old_gpu4.5M_r$r.log" 2>&1
done
PYTHONPATH=$OP $PY -c "import kvcm_core; print('old code from', kvcm_core.__file__)"
$PY benchmarks/results/sitting-cpu-2core-20261206-s25/summarize.py "$OUT" 2>&1 | grep -v "vLLM\|vllm\|kvcm3M"
GPU_TESTS_LIMIT=420 OUT=$OUT bash benchmarks/gpu_run.sh gpu_tests >> "$OUT/gpu_run.txt" 2>&1
tail -2 "$OUT/tests_gpu.log"; grep -E "FAILED|ERROR" "$OUT"/*.log | head -20
