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
#   bash benchmarks/gpu_run.sh migrate  # overlapping migrations: GPU tests, bench, simulate
#   bash benchmarks/gpu_run.sh codecs   # page codecs: benchmark against copy bandwidth
#   bash benchmarks/gpu_run.sh quant    # quant codec kernels: variants bit for bit, sweep
#   bash benchmarks/gpu_run.sh sparse_tests sparse_sweep   # resolve kernels: tests, sweep
#   bash benchmarks/gpu_run.sh levels_sitting   # issue 9's levels replay on this host's CPU
#   bash benchmarks/gpu_run.sh gpu_tests codecs_bench ...   # any list of the steps below
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

# Wheels the image lacks (google-crc32c, zstandard, lz4), carried in .whl/ (gitignored):
#   pip download --only-binary=:all: --no-deps --python-version 3.12 \
#     --platform manylinux2014_x86_64 -d .whl google-crc32c zstandard lz4
if compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-deps --no-index .whl/*.whl >>"$OUT/env.txt" 2>&1
fi
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
step() {  # one named step; modes below are lists of steps
  case "$1" in
    gpu_tests)  # GPU_TESTS_K: a pytest -k filter; GPU_TESTS_LIMIT: seconds (default 240)
      local k=(); [ -n "${GPU_TESTS_K:-}" ] && k=(-k "$GPU_TESTS_K")
      run tests_gpu.log "${GPU_TESTS_LIMIT:-240}" "$PY" -m pytest -q -m gpu -p no:cacheprovider \
        --tb=short "${k[@]}" ;;
    conformance)
      run conformance.log 200 "$PY" -m pytest -q tests/test_conformance_kernels.py \
        tests/test_conformance_codecs.py tests/test_conformance_tiers.py \
        tests/test_conformance_sparse.py -p no:cacheprovider --tb=short ;;
    codecs_backends)  # page codecs, lossy levels and cold frames on each device backend
      for b in cuda cupy; do
        KVCM_KERNEL_BACKEND=$b KVCM_TEST_BACKEND=$b KVCM_PROPERTY_EXAMPLES=10 \
          run "codecs_$b.log" 200 "$PY" -m pytest -q tests/test_conformance_codecs.py \
          tests/test_lossy_levels.py tests/test_cold_frames.py -p no:cacheprovider --tb=short
      done ;;
    manager_backends)  # the manager's suite with pages on each device backend
      for b in cuda cupy; do
        KVCM_TEST_BACKEND=$b KVCM_PROPERTY_EXAMPLES=10 run "manager_$b.log" 150 \
          "$PY" -m pytest -q $MANAGER_TESTS -p no:cacheprovider --tb=short -x
      done ;;
    kernels_bench)
      run bench.log 330 "$PY" -m kvcm_core.bench.kernels --out "$OUT" --sweep-threads 128,512 ;;
    kernels_quick)
      run bench.log 200 "$PY" -m kvcm_core.bench.kernels --quick --out "$OUT" ;;
    simulate)
      run simulate.log 120 "$PY" -m kvcm_core.cli simulate --quiet --out "$OUT/simulate" ;;
    hybrid_simulate)  # the hybrid preset (SSM, SWA, int8 disk, images, Batch.resize/move,
      # rewinds) with pages on each device backend, every page verified
      for b in cuda cupy; do
        KVCM_KERNEL_BACKEND=$b run "hybrid_simulate_$b.log" 200 "$PY" -m kvcm_core.cli \
          simulate --preset hybrid --no-plots --quiet --out "$OUT/simulate-hybrid-$b"
      done ;;
    batch_bench)  # the Batch benchmark's device part (its host part is measured beside vLLM)
      run batch.log 200 "$PY" -m kvcm_core.bench.batch --quick --device-rows 256 \
        --device-blocks 2048 --out "$OUT" ;;
    codecs_bench)  # page codecs' encode/decode against the copy bandwidth of the same run
      run codecs_bench.log 300 "$PY" -m kvcm_core.cli bench codecs --out "$OUT" \
        --skip cpu simulate ;;
    sparse_tests)
      run sparse_tests.log 300 "$PY" -m pytest -q -p no:cacheprovider --tb=short \
        tests/test_sparse_gpu.py tests/test_conformance_sparse.py ;;
    sparse_bench)
      run sparse_bench.log 300 "$PY" -m kvcm_core.cli bench sparse --out "$OUT" ;;
    sparse_simulate)
      for b in cuda cupy; do
        KVCM_KERNEL_BACKEND=$b run "sparse_simulate_$b.log" 200 "$PY" -m kvcm_core.cli \
          simulate --preset sparse --requests 60 --no-plots --quiet \
          --out "$OUT/simulate-sparse-$b"
      done ;;
    remote)  # the shared Redis level (docs/remote.md) with pages on each device backend;
      # the image has no redis-server: carry one in .whl/rbin (the binaries renamed *.bin,
      # their libraries in .whl/rbin/lib, and two sh wrappers that set LD_LIBRARY_PATH for
      # them alone), and the redis wheel in .whl/ (pip download --no-deps redis)
      PATH="$PWD/.whl/rbin:$PATH"
      for b in cuda cupy; do
        KVCM_TEST_BACKEND=$b KVCM_KERNEL_BACKEND=$b run "remote_$b.log" 200 "$PY" -m pytest \
          -q -p no:cacheprovider --tb=short tests/test_remote_level.py \
          tests/test_simulate_two_engines.py
      done ;;
    quant_tests)  # issue 12: every quant codec kernel variant bit for bit, both backends
      # (KVCM_QUANT_TEST_VARIANTS=name,name,...: those and the default)
      KVCM_QUANT_TEST_VARIANTS=${KVCM_QUANT_TEST_VARIANTS:-all} run quant_tests.log 300 \
        "$PY" -m pytest -q -m gpu -p no:cacheprovider --tb=short tests/test_codecs_quant.py ;;
    quant_sweep)  # issue 12: quant kernel variants against the copy bandwidth, both backends
      # (the older variants' sweep: benchmarks/results/h200-20261202-quant)
      run quant_sweep.log 300 "$PY" -m kvcm_core.cli bench codecs --out "$OUT" \
        --skip cpu simulate --slots both --reps 50 --kernels \
        "${KVCM_QUANT_SWEEP:-hw4sx,hw4sxp,hw4sxm,hw4sxp2}" ;;
    migrate_tests)  # issue 16: orderings of overlapping migrations, fingerprint-checked
      run migrate_tests.log 150 "$PY" -m pytest -q -m gpu -p no:cacheprovider --tb=short \
        tests/test_migrate_overlap.py tests/test_gpu_manager.py ;;
    migrate_manager)  # issue 16: the manager files it touches, pages on each GPU backend
      for b in cuda cupy; do
        KVCM_TEST_BACKEND=$b KVCM_PROPERTY_EXAMPLES=10 run "migrate_manager_$b.log" 35 \
          "$PY" -m pytest -q -x -p no:cacheprovider --tb=short tests/test_levels.py \
          tests/test_manager_lifecycle.py tests/test_faults.py tests/test_io_deadline.py
      done ;;
    migrate_bench)  # issue 16: offload, swap, cascade against the limits, both backends
      run migrate_bench.log 150 "$PY" -m kvcm_core.cli bench migrate --reps 15 --profile --out "$OUT" ;;
    migrate_simulate)  # issue 16: the manager's time per step in kvcm simulate
      run migrate_simulate.log 60 "$PY" -m kvcm_core.cli simulate --no-plots \
        --out "$OUT/simulate" ;;
    sparse_tests_v3)  # issue 11: the v3 and v4 resolve kernels' settings, and the sparse
      # engine runs and conformance with v3 as the kernel (the v1/v2 settings: sparse_tests)
      KVCM_SPARSE_RESOLVE=v3 run sparse_tests_v3.log 300 "$PY" -m pytest -q \
        -p no:cacheprovider --tb=short tests/test_sparse_gpu.py tests/test_conformance_sparse.py \
        -k "not [v1- and not [v2-" ;;
    sparse_sweep)  # resolve kernels: rows 64/256 x selected (KVCM_SWEEP_SELECTED, default
      # 2048 4096 8192) for KVCM_SWEEP_VERSIONS (default v1,v2,v3,v4), 40 timed steps, burst
      # timing; SM clocks sampled meanwhile
      nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.max.sm,utilization.gpu --format=csv \
        -lms 250 >"$OUT/sparse_sweep_clocks.csv" 2>&1 &
      local smi=$!
      run sparse_sweep.log 300 "$PY" benchmarks/gpu_sweep_sparse.py --out "$OUT" --burst \
        --selected ${KVCM_SWEEP_SELECTED:-2048 4096 8192} \
        --versions "${KVCM_SWEEP_VERSIONS:-v1,v2,v3,v4}"
      kill "$smi" 2>/dev/null ;;
    simulate_profile)  # issue 16: where the slowest steps' manager time goes, per backend
      for b in cuda cupy; do
        KVCM_KERNEL_BACKEND=$b run "simulate_profile_$b.log" 120 "$PY" \
          benchmarks/simulate_profile.py --out "$OUT/simulate-profile-$b"
      done ;;
    levels_sitting)  # issue 9: the levels replay beside GPU-only on this host's CPU (the
      # trace bench keeps pages in NumPy memory); three alternating rounds of 3 repetitions;
      # sitting-cpu-2core-20261204-s14/summarize.py OUT prints the ratios. The trace is
      # carried in .whl/: cp ../shared/traces/mooncake_synthetic.jsonl .whl/
      local tr=${KVCM_TRACE:-.whl/mooncake_synthetic.jsonl} r
      local c="--limit 1000 --block-size 64 --reps 3"
      local lv="--gpu-tokens 500000 --host-tokens 1000000 --disk-tokens 3000000"
      for r in 1 2 3; do
        run "kvcm_levels_r$r.log" 90 "$PY" -m kvcm_core.cli bench trace "$tr" $c $lv \
          --out "$OUT/kvcm_levels_r$r.json"
        run "kvcm_gpu4.5M_r$r.log" 90 "$PY" -m kvcm_core.cli bench trace "$tr" $c \
          --gpu-tokens 4500000 --out "$OUT/kvcm_gpu4.5M_r$r.json"
        run "kvcm_levels_sync_r$r.log" 90 "$PY" \
          benchmarks/results/sitting-cpu-2core-20261202-s10/no_io_thread.py "$tr" $c $lv \
          --out "$OUT/kvcm_levels_sync_r$r.json"
      done ;;
    *) echo "unknown step $1"; status=2 ;;
  esac
}
case "$MODE" in
  tests) STEPS="gpu_tests conformance codecs_backends manager_backends" ;;
  bench) STEPS="kernels_bench simulate batch_bench" ;;
  batch) STEPS="batch_bench" ;;
  sparse) STEPS="sparse_tests sparse_bench sparse_simulate" ;;
  migrate) STEPS="migrate_bench migrate_tests migrate_manager migrate_simulate" ;;
  codecs) STEPS="codecs_bench" ;;
  quant) STEPS="quant_tests codecs_backends quant_sweep" ;;
  quick) STEPS="gpu_tests kernels_quick" ;;
  *) STEPS="$*" ;;  # a list of step names
esac
for s in $STEPS; do step "$s"; done
grep -hE "passed|failed|error" "$OUT"/*.log 2>/dev/null | tail -20
exit $status
