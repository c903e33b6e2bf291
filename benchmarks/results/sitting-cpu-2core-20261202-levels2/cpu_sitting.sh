#!/bin/bash
# cpu_sitting.sh ROUNDS BEFORE_DIR AFTER_DIR: alternating rounds of one replay per process
PY=/work/wt-perf-levels2/.venv/bin/python; export PYTHONHASHSEED=0
run() { (. /tmp/pl2/env.sh $1; cd /tmp/pl2 && $PY -S /tmp/pl2/replay.py $2); }
for r in $(seq 1 $1); do
  if [ $((r % 2)) = 1 ]; then order="ag al an bl bg"; else order="bg bl an al ag"; fi
  for c in $order; do
    case $c in
      ag) echo "r$r after gpu4.5M $(run $3 gpu)";;
      al) echo "r$r after levels $(run $3 levels)";;
      an) echo "r$r after levels-noframes $(NOFRAMES=1 run $3 levels)";;
      bl) echo "r$r before levels $(run $2 levels)";;
      bg) echo "r$r before gpu4.5M $(run $2 gpu)";;
    esac
  done
done
