#!/bin/bash
# CPU-time sitting: one replay per run (ab.py), alternating after/before x gpu/levels
B=/tmp/perf-levels-before
BP=$B:$B/plugins/tiers:$B/plugins/kernels:$B/plugins/codecs:$B/plugins/eviction
PY=/work/wt-perf-levels/.venv/bin/python
for r in $(seq 1 $1); do
  if [ $((r % 2)) = 1 ]; then order="ag al bl bg"; else order="bg bl al ag"; fi
  for c in $order; do
    case $c in
      ag) echo "r$r after  gpu4.5M $(cd /tmp && $PY /tmp/perf-levels-ab.py gpu)";;
      al) echo "r$r after  levels  $(cd /tmp && $PY /tmp/perf-levels-ab.py levels)";;
      bl) echo "r$r before levels  $(cd /tmp && PYTHONPATH=$BP $PY /tmp/perf-levels-ab.py levels)";;
      bg) echo "r$r before gpu4.5M $(cd /tmp && PYTHONPATH=$BP $PY /tmp/perf-levels-ab.py gpu)";;
    esac
  done
done
