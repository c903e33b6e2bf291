#!/usr/bin/env bash
# The GPU machine's run: GPU tests, the kernel-backend conformance suite on the GPU
# backends, and the kernel benchmark. Installs nothing from a registry: the checkout is
# installed editable without dependencies (entry points need an install; PYTHONPATH alone
# does not make the plugin manager find the plugins), everything else is already there.
#
#   bash benchmarks/gpu_run.sh [full|quick|tests]     # results under $OUT (default ./out)
set -uo pipefail
MODE="${1:-full}"
OUT="${OUT:-$PWD/out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export KVCM_KERNEL_CACHE="${KVCM_KERNEL_CACHE:-/tmp/kvcm-kernel-cache}"
PY="${PYTHON:-python3}"

{
  date -u; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
  "$PY" -c 'import sys; print(sys.version)'
  "$PY" -m pip list 2>/dev/null | grep -iE '^(cupy|cuda-|numpy|pluggy|attrs|pytest|hypothesis|matplotlib)'
} >"$OUT/env.txt" 2>&1

"$PY" -m pip install -q --no-deps --no-build-isolation -e . >>"$OUT/env.txt" 2>&1 \
  || { echo "editable install failed"; cat "$OUT/env.txt"; exit 1; }
"$PY" - <<'PY' 2>&1 | tee -a "$OUT/env.txt"
from kvcm_core.plugins import get_plugin_manager
pm = get_plugin_manager()
for name, spec in pm.kernel_backends().items():
    print("backend", name, spec.priority, pm.availability_of(spec))
print("auto ->", pm.select_kernel_backend("auto").name)
PY

status=0
if [ "$MODE" != "bench" ]; then
  timeout 150 "$PY" -m pytest -q -m gpu tests/test_gpu_backends.py -p no:cacheprovider \
    --tb=short 2>&1 | tee "$OUT/tests_gpu.log" | tail -25 || status=1
  timeout 200 "$PY" -m pytest -q tests/test_conformance_kernels.py -p no:cacheprovider \
    --kvcm-plugin cupy --kvcm-plugin cuda --tb=short 2>&1 | tee "$OUT/conformance.log" \
    | tail -25 || status=1
fi
case "$MODE" in
  full|bench) timeout 240 "$PY" -m kvcm_core.bench.kernels --out "$OUT" --sweep-threads 128,256,512 2>&1 | tee "$OUT/bench.log" | tail -120 ;;
  quick) timeout 200 "$PY" -m kvcm_core.bench.kernels --quick --out "$OUT" 2>&1 | tee "$OUT/bench.log" | tail -80 ;;
esac
exit $status
