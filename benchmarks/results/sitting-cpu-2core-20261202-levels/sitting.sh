#!/bin/bash
# The sitting of this folder: five alternating rounds of kvcm bench trace (first 1,000
# requests of the Mooncake synthetic trace, block 64, 3 repetitions each) on
#   after:  this branch (the worktree the script is run from, its .venv)
#   before: main at cd426c3 with only the bench's disk-quota fix applied (BEFORE_TREE,
#           made with `git archive cd426c3 | tar -x -C $BEFORE_TREE` and the
#           kvcm_core/bench/trace.py hunk of commit b9cb2d9)
# for GPU 4.5M tokens and for GPU 0.5M + host 1M + disk 3M tokens; then the levels with
# --tail-hint and a GPU level of 3M tokens (after) once each.
# Usage: sitting.sh OUT_DIR WORKTREE BEFORE_TREE
set -u
OUT=$1; WT=$2; B=$3
PY=$WT/.venv/bin/python
BP=$B:$B/plugins/tiers:$B/plugins/kernels:$B/plugins/codecs:$B/plugins/eviction
TRACE=/work/shared/traces/mooncake_synthetic.jsonl
COMMON="--limit 1000 --block-size 64 --reps 3"
LEVELS="--gpu-tokens 500000 --host-tokens 1000000 --disk-tokens 3000000"
GPU45="--gpu-tokens 4500000"
run() {  # name tree(after|before) args...
  local name=$1 tree=$2; shift 2
  local pp=""; [ "$tree" = before ] && pp=$BP
  local t0=$(date +%s.%N)
  (cd /tmp && PYTHONPATH=$pp $PY -m kvcm_core.cli bench trace $TRACE $COMMON "$@" \
      --out "$OUT/$name.json" > "$OUT/$name.log" 2>&1)
  local rc=$?
  echo "$(date -u +%H:%M:%S) $name rc=$rc $(grep '^rep' "$OUT/$name.log" | awk '{printf "%s ", $8}') load=$(cut -d' ' -f1 /proc/loadavg)"
}
for r in 1 2 3 4 5; do
  if [ $((r % 2)) = 1 ]; then order="ag al bl bg"; else order="bg bl al ag"; fi
  for c in $order; do
    case $c in
      ag) run after_gpu4.5M_r$r after $GPU45 ;;
      al) run after_levels_r$r after $LEVELS ;;
      bl) run before_levels_r$r before $LEVELS ;;
      bg) run before_gpu4.5M_r$r before $GPU45 ;;
    esac
  done
done
run after_levels_hint after $LEVELS --tail-hint
run after_gpu3M after --gpu-tokens 3000000
echo DONE
