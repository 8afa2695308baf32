#!/bin/bash
# Build, test and measure on a GPU host in one go; logs and results go under $OUT (or ./gpu-out).
# Usage: [GPU=h100] tools/gpu_session.sh build-test-sweep | compare-evaluate   (GPU defaults to h200)
# Offline hosts: carry the wheels of gpu-wheelhouse.sh in .whl/ (installed to /tmp/site first).
set -uo pipefail
out=${OUT:-gpu-out}; mkdir -p "$out"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
export SPLITKV_GIT_SHA=${SPLITKV_GIT_SHA:-$(cat .git-sha 2>/dev/null)} PYTHONUNBUFFERED=1 SPLITKV_CUDA_ARCHS=${SPLITKV_CUDA_ARCHS:-90} CMAKE_BUILD_PARALLEL_LEVEL=$(nproc)
python3 -m pip install --no-build-isolation --no-deps -e . >"$out/build.log" 2>&1 || { tail -30 "$out/build.log"; exit 1; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee "$out/nvidia-smi.txt"
flag=${GPU:-h200}
gpu=$(python3 -c "from splitkv_tune.gpus import resolve_gpu; print(resolve_gpu('$flag'))")
case "${1:-}" in
  build-test-sweep)
    date -u | tee "$out/gpu_tests.log"
    SPLITKV_REQUIRE_GPU=1 timeout 300 python3 -m pytest -q -p no:cacheprovider --no-header -rf \
      tests/test_kernel_gpu.py tests/test_bench_gpu.py 2>&1 | tail -15 | tee -a "$out/gpu_tests.log"
    timeout 420 splitkv-tune sweep --gpu "$flag" --grid quick --no-progress 2>&1 | tail -25 | tee "$out/sweep.log"
    tar czf "$out/results.tgz" results/$gpu
    ;;
  compare-evaluate)
    SPLITKV_REQUIRE_GPU=1 timeout 120 python3 -m pytest -q -p no:cacheprovider --no-header -rf \
      tests/test_kernel_gpu.py -k "compile or bad_arguments or graph" 2>&1 | tail -4 | tee "$out/gpu_tests2.log"
    timeout 240 splitkv-tune compare --grid quick --table results/$gpu/heuristics.csv --out results/$gpu/compare \
      --peers "${PEERS:-sdpa_flash,sdpa_cudnn,flex}" --no-progress 2>&1 | tail -30 | tee "$out/compare.log"
    timeout 120 splitkv-tune compare --grid configs/prefill.yaml --config 1,64,128,blocks --peers sdpa_flash,sdpa_cudnn \
      --out results/$gpu/compare_prefill --no-progress 2>&1 | tail -8 | tee "$out/prefill.log"
    [ -n "${SKIP_EVALUATE:-}" ] || timeout 200 splitkv-tune evaluate --gpu "$flag" --shapes configs/evaluate.yaml --out-csv results/$gpu/evaluate_gpu.csv \
      --out-md results/$gpu/evaluate_gpu.md 2>&1 | tail -20 | tee "$out/evaluate.log"
    splitkv-tune env > "$out/env.txt" 2>&1
    tar czf "$out/results.tgz" results/$gpu
    ;;
  *) echo "usage: $0 build-test-sweep | compare-evaluate" >&2; exit 2 ;;
esac
