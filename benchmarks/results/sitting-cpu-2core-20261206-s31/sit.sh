#!/bin/bash
# Session 31's final sittings: race, manager, levels, simulate-trace. Usage: sit.sh OUTDIR
O=$1; mkdir -p $O/race $O/manager $O/simulate-trace
cd /work/main
. .venv/bin/activate
export PYTHONPATH=$PWD:$PWD/plugins/tiers:$PWD/plugins/kernels:$PWD/plugins/eviction:$PWD/plugins/codecs
git rev-parse --short HEAD > $O/commit.txt
T=.whl/mooncake_synthetic.jsonl
for r in 1 2; do
  /tmp/vllm-venv/bin/python benchmarks/peer/vllm_trace_replay.py $T --limit 1000 --block-size 64 --gpu-tokens 3000000 --reps 3 --out $O/race/vllm$r.json > $O/race/vllm$r.log 2>&1
  python -m kvcm_core.cli bench trace $T --limit 1000 --block-size 64 --gpu-tokens 3000000 --reps 3 --out $O/race/kvcm$r.json > $O/race/kvcm$r.log 2>&1
done
echo race done $(date)
for r in 1 2; do
  /tmp/vllm-venv/bin/python benchmarks/peer/vllm_host_overhead.py --out $O/manager/vllm$r.json > $O/manager/vllm$r.log 2>&1
  python -m kvcm_core.cli bench manager --out $O/manager/kvcm$r.json > $O/manager/kvcm$r.log 2>&1
done
echo manager done $(date)
PY=python bash benchmarks/results/sitting-cpu-2core-20261206-s26/sitting.sh $O/levels wip/base31 15 > $O/levels.log 2>&1
echo levels done $(date)
( time python -m kvcm_core.cli simulate --trace $T --trace-limit 300 --out $O/simulate-trace ) > $O/simulate-trace/sim.log 2>&1; echo "rc=$?" >> $O/simulate-trace/sim.log
echo all done $(date)
