#!/bin/bash
# usage: cg.sh TAG DIR MODE  -> callgrind instruction count of one replay of code in DIR
export PYTHONHASHSEED=0; TAG=$1; DIR=$2; MODE=$3; PY=/work/wt-perf-levels2/.venv/bin/python
. /tmp/pl2/env.sh $DIR
cd /tmp/pl2 && valgrind --tool=callgrind --callgrind-out-file=/tmp/pl2/cg.$TAG.$MODE.out $PY -S /tmp/pl2/replay.py $MODE > /tmp/pl2/cg.$TAG.$MODE.log 2>&1
echo "$TAG $MODE $(grep -h 'Collected' /tmp/pl2/cg.$TAG.$MODE.log) $(head -1 /tmp/pl2/cg.$TAG.$MODE.log)"
