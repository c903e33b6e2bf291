#!/bin/bash
# Instructions (valgrind callgrind "Ir") of one replay of issue 9's trace: the levels
# configuration (GPU 0.5M + host 1M + disk 3M tokens) and GPU-only 4.5M. A count, not a time:
# it does not move with other load on the machine the way wall-clock does, so it shows the
# effect of a change of a few percent. It still varies by a few percent between runs made
# under different load (the I/O thread's writes interleave differently): compare variants
# measured one after the other. Needs valgrind. The trace: $KVCM_TRACE (default
# .whl/mooncake_synthetic.jsonl). Usage: bash benchmarks/levels_ir.sh [levels|gpu|both]
# Session 25 (2-core VM): levels 5366-5614 M Ir by run at the session start, 5185-5312 at its
# end; GPU-only 3972-3987 throughout.
set -u
MODE=${1:-both}
export PYTHONHASHSEED=0 OPENBLAS_NUM_THREADS=1
export KVCM_TRACE=$(realpath "${KVCM_TRACE:-.whl/mooncake_synthetic.jsonl}")
PY=${PY:-python3}; HERE=$(cd "$(dirname "$0")" && pwd)
tmp=$(mktemp -d /tmp/levels_ir.XXXXXX)
run() {  # name, replay options...
  local name=$1; shift
  (cd "$tmp" && valgrind --tool=callgrind --dump-before=sched_yield \
    --callgrind-out-file="$tmp/$name.cg" "$PY" "$HERE/replay_once.py" "$@" > "$tmp/$name.log" 2>&1)
  if [ -f "$tmp/$name.cg.2" ]; then
    echo "$name: $(grep -m1 '^summary' "$tmp/$name.cg.2" | awk '{printf "%.1f M Ir", $2/1e6}'); $(grep '^replay' "$tmp/$name.log")"
  else
    echo "$name: failed, see $tmp/$name.log"; tail -5 "$tmp/$name.log"
  fi
}
[ "$MODE" != gpu ] && run levels --gpu-tokens 500000 --host-tokens 1000000 --disk-tokens 3000000
[ "$MODE" != levels ] && run gpu --gpu-tokens 4500000
echo "callgrind files: $tmp (callgrind_annotate FILE.cg.2 lists C-level functions)"
