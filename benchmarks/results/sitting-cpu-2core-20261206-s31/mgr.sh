#!/bin/bash
D=$1
cd /work/main
. .venv/bin/activate
export PYTHONPATH=$PWD:$PWD/plugins/tiers:$PWD/plugins/kernels:$PWD/plugins/eviction:$PWD/plugins/codecs
for r in 1 2; do
  /tmp/vllm-venv/bin/python benchmarks/peer/vllm_host_overhead.py --out $D/vllm$r.json > $D/vllm$r.log 2>&1
  python -m kvcm_core.cli bench manager --out $D/kvcm$r.json > $D/kvcm$r.log 2>&1
done
echo done
