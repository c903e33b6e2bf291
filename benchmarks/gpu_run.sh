#!/usr/bin/env bash
# The GPU machine's run. Installs nothing from a registry: the checkout is installed
# editable without dependencies (entry points need an install; PYTHONPATH alone does not
# make the plugin manager find the plugins), everything else is already there.
#
#   bash benchmarks/gpu_run.sh tests    # GPU tests, kernel conformance, the manager suite
#                                       # on each GPU backend (KVCM_TEST_BACKEND)
#   bash benchmarks/gpu_run.sh bench    # kernel benchmark, simulate on the GPU
#   bash benchmarks/gpu_run.sh quick    # GPU tests and a quick benchmark
#   bash benchmarks/gpu_run.sh batch    # the Batch benchmark's device part
#   bash benchmarks/gpu_run.sh sparse   # sparse attention: GPU tests, benchmark, simulate
# Results under $OUT (default ./out).
set -uo pipefail
MODE="${1:-tests}"
OUT="${OUT:-$PWD/out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export KVCM_KERNEL_CACHE="${KVCM_KERNEL_CACHE:-/tmp/kvcm-kernel-cache}"
PY="${PYTHON:-python3}"

{
  date -u; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
  "$PY" -c 'import sys; print(sys.version)'
  "$PY" -m pip list 2>/dev/null | grep -iE '^(cupy|cuda-|numpy|pluggy|attrs|pytest|hypothesis|matplotlib|rich|torch)'
} >"$OUT/env.txt" 2>&1

"$PY" -m pip install -q --no-deps --no-build-isolation -e . -e examples/kvcm-tier-example \
  -e examples/tiny-engine \
  >>"$OUT/env.txt" 2>&1 || { echo "editable install failed"; cat "$OUT/env.txt"; exit 1; }
"$PY" - <<'PY' 2>&1 | tee -a "$OUT/env.txt"
from kvcm_core.plugins import get_plugin_manager
pm = get_plugin_manager()
for name, spec in pm.kernel_backends().items():
    print("backend", name, spec.priority, pm.availability_of(spec))
print("auto ->", pm.select_kernel_backend("auto").name)
PY

status=0
run() {  # run LOG TIMEOUT CMD...: tee into $OUT/LOG, keep the tail on stdout
  local log=$1 limit=$2; shift 2
  timeout "$limit" "$@" 2>&1 | tee "$OUT/$log" | tail -6 || status=1
}
MANAGER_TESTS="tests/test_batch.py tests/test_page_table_version.py tests/test_prefix_reuse.py tests/test_manager_lifecycle.py tests/test_levels.py tests/test_reuse_policies.py tests/test_faults.py tests/test_manager_errors.py tests/test_manager_properties.py tests/test_swa_scratch.py tests/test_beams.py tests/test_engine_loop.py"
case "$MODE" in
  tests)
    run tests_gpu.log 200 "$PY" -m pytest -q -m gpu -p no:cacheprovider --tb=short
    run conformance.log 200 "$PY" -m pytest -q tests/test_conformance_kernels.py \
      tests/test_conformance_codecs.py tests/test_conformance_tiers.py -p no:cacheprovider \
      --tb=short
    for b in cuda cupy; do
      KVCM_TEST_BACKEND=$b KVCM_PROPERTY_EXAMPLES=10 run "manager_$b.log" 150 \
        "$PY" -m pytest -q $MANAGER_TESTS -p no:cacheprovider --tb=short -x
    done
    ;;
  bench)
    run bench.log 330 "$PY" -m kvcm_core.bench.kernels --out "$OUT" --sweep-threads 128,512
    run simulate.log 120 "$PY" -m kvcm_core.cli simulate --quiet --out "$OUT/simulate"
    run batch.log 200 "$PY" -m kvcm_core.bench.batch --quick --device-rows 256 \
      --device-blocks 2048 --out "$OUT"
    ;;
  batch)  # the Batch benchmark's device part (its host part is measured beside vLLM)
    run batch.log 200 "$PY" -m kvcm_core.bench.batch --quick --device-rows 256 \
      --device-blocks 2048 --out "$OUT"
    ;;
  sparse)  # sparse attention: its GPU tests and conformance, the benchmark, simulate
    run sparse_tests.log 300 "$PY" -m pytest -q -p no:cacheprovider --tb=short \
      tests/test_sparse_gpu.py tests/test_conformance_sparse.py
    run sparse_bench.log 300 "$PY" -m kvcm_core.cli bench sparse --out "$OUT"
    for b in cuda cupy; do
      KVCM_KERNEL_BACKEND=$b run "sparse_simulate_$b.log" 200 "$PY" -m kvcm_core.cli \
        simulate --preset sparse --requests 60 --no-plots --quiet --out "$OUT/simulate-sparse-$b"
    done
    ;;
  quick)
    run tests_gpu.log 200 "$PY" -m pytest -q -m gpu -p no:cacheprovider --tb=short
    run bench.log 200 "$PY" -m kvcm_core.bench.kernels --quick --out "$OUT"
    ;;
esac
grep -hE "passed|failed|error" "$OUT"/*.log 2>/dev/null | tail -20
exit $status
