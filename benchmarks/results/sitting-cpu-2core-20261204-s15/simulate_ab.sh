#!/bin/bash
# Session 15: `kvcm simulate` (embedded default, verification on) on the 2-core machine,
# before (OLD: a checkout of the commit before direct reads) and after (this checkout),
# alternating, ROUNDS rounds. Prints the manager's time per step from each report.json.
set -u
OUT=$(realpath -m "$1"); OLD=$(realpath "$2"); ROUNDS=${ROUNDS:-5}; PY=${PY:-$PWD/.venv/bin/python}
NEW=$PWD
mkdir -p "$OUT"
git -C "$OLD" rev-parse HEAD > "$OUT/old_commit.txt"; git rev-parse HEAD > "$OUT/new_commit.txt"
for r in $(seq 1 "$ROUNDS"); do
  for side in old new; do
    dir=$OLD; [ $side = new ] && dir=$NEW
    rm -rf "$OUT/$side-r$r"
    (cd "$dir" && PYTHONPATH="$dir:$(ls -d "$dir"/plugins/*/ | tr "\n" ":")" $PY -m kvcm_core.cli simulate --no-plots --quiet --no-compare \
      --out "$OUT/$side-r$r" > /dev/null 2>&1) || echo "FAILED $side r$r"
    echo "$(date -u +%H:%M:%S) $side r$r load=$(cut -d' ' -f1 /proc/loadavg)" >> "$OUT/sitting.log"
  done
done
$PY - "$OUT" <<'PY'
import json, sys, glob, statistics as st
out = sys.argv[1]
for side in ("old", "new"):
    rs = [json.load(open(f))["run"] for f in sorted(glob.glob(f"{out}/{side}-r*/report.json"))]
    t = [r["timing"]["manager_us_per_step"] for r in rs]
    ok = all(r["verification"]["steps_fully_checked"] == r["steps"] for r in rs)
    print(f"{side}: {len(rs)} runs, all steps fully verified: {ok}; manager us/step "
          f"mean median {st.median(x['mean'] for x in t):.0f} (min {min(x['mean'] for x in t):.0f}), "
          f"p99 median {st.median(x['p99'] for x in t):.0f} (min {min(x['p99'] for x in t):.0f})")
PY
