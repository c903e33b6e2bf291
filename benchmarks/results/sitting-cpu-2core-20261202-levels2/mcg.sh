#!/bin/bash
# mcg.sh DIR SCRIPT N -> instructions
export PYTHONHASHSEED=0; . /tmp/pl2/env.sh $1
N=$3 valgrind --tool=callgrind --callgrind-out-file=/dev/null /work/wt-perf-levels2/.venv/bin/python -S $2 2>&1 | grep Collected | awk '{print $4}'
