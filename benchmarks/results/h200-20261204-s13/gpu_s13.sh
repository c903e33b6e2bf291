#!/bin/bash
# Session 13's H200 calls: GPU_PART=1|2. Results under $OUT (summary.txt + logs).
set -u
export OUT=${OUT:-$PWD/out}; mkdir -p "$OUT/r"
cd "$(git rev-parse --show-toplevel 2>/dev/null || pwd)"
S="$OUT/summary.txt"
if [ "$GPU_PART" = 1 ]; then
  GPU_TESTS_LIMIT=330 OUT="$OUT/r" timeout 560 bash benchmarks/gpu_run.sh gpu_tests migrate_bench > "$OUT/r/run.log" 2>&1
else
  OUT="$OUT/r" timeout 560 bash benchmarks/gpu_run.sh manager_backends migrate_simulate kernels_quick > "$OUT/r/run.log" 2>&1
fi
{
  echo "== part $GPU_PART $(date -u)"; head -12 "$OUT/r/env.txt"
  for f in "$OUT"/r/*.log; do echo "== $(basename "$f")"; tail -8 "$f"; done
} > "$S" 2>&1
# Keep at most a few files: the JSON results and the logs, flattened.
cd "$OUT/r"; ls -R > "$OUT/listing.txt"
for f in $(find . -name '*.json' | head -4); do cp "$f" "$OUT/$(echo "$f" | tr '/' '_' | sed 's/^\._//')"; done
tar czf "$OUT/logs.tgz" *.log env.txt 2>/dev/null
rm -rf "$OUT/r"
