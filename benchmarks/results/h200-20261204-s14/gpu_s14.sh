#!/bin/bash
# Session 14's H200 calls: GPU_PART=1 (every GPU test) | 2 (migrate bench, simulate, the
# manager suite on both GPU backends). Results under $OUT (summary.txt + logs).
set -u
export OUT=${OUT:-$PWD/out}; mkdir -p "$OUT/r"
cd "$(git rev-parse --show-toplevel 2>/dev/null || pwd)"
S="$OUT/summary.txt"
if [ "$GPU_PART" = 1 ]; then
  GPU_TESTS_LIMIT=${GPU_TESTS_LIMIT:-540} OUT="$OUT/r" timeout 580 bash benchmarks/gpu_run.sh gpu_tests > "$OUT/r/run.log" 2>&1
else
  OUT="$OUT/r" timeout 580 bash benchmarks/gpu_run.sh migrate_bench migrate_simulate manager_backends > "$OUT/r/run.log" 2>&1
fi
{
  echo "== part $GPU_PART $(date -u) $(git rev-parse --short HEAD 2>/dev/null)"; head -12 "$OUT/r/env.txt"
  for f in "$OUT"/r/*.log; do echo "== $(basename "$f")"; tail -8 "$f"; done
} > "$S" 2>&1
cd "$OUT/r"; ls -R > "$OUT/listing.txt"
for f in $(find . -name '*.json' | head -4); do cp "$f" "$OUT/$(echo "$f" | tr '/' '_' | sed 's/^\._//')"; done
tar czf "$OUT/logs.tgz" *.log env.txt 2>/dev/null
rm -rf "$OUT/r"
