# source env.sh DIR  -> PYTHONPATH for running code from DIR with python -S
SP=/work/wt-perf-levels2/.venv/lib/python3.11/site-packages; B=$1
export PYTHONPATH=$B:$B/plugins/tiers:$B/plugins/kernels:$B/plugins/codecs:$B/plugins/eviction:$B/examples/kvcm-tier-example:$B/examples/tiny-engine:$SP
