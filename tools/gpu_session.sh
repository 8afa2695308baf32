#!/bin/bash
# Build, test and measure on a GPU host in one go; logs and results go under $OUT (or ./gpu-out).
# Usage: [GPU=h200] tools/gpu_session.sh MODE...   (GPU defaults to the one present; modes run in order)
# test: GPU tests (~1 min); head-dims: sweep and compare of the D = 96/256 shapes (~4 min);
# host-tuned: host cost with every tunable given (~30 s); host-floor: the host path piece by piece
# beside the bare CUDA launch (~1 min); eager: host cost and eager loops of the default call vs
# SDPA (~2 min); merge-ab: combine kernel vs fused merge on the small decode shapes (~2 min);
# pdl-ab: the table's config with and without programmatic dependent launch on the small
# decode shapes, two fixed-cost and two large ones (~1.5 min); sweep: quick grid
# (~3 min); evaluate: selector regret on the GPU (~2 min); evaluate-holdout: the same on the 36
# held-out real-model shapes, every timed config kept (~5 min); evaluate-confirm: the same on the
# second held-out set (32 shapes, ~5 min); breakdown: kernel time per call
# (~1.5 min); compare: quick grid and causal prefill against the peers (~6 min); compare-batch:
# the paged kernel on the issue's skewed batches and a uniform one vs FlashInfer and padded cuDNN
# SDPA (~5 min, FlashInfer's JIT included; compare_batch.md/.csv); profile-live: Nsight
# Compute's warp stalls by source line on a few paged launches (~2.5 min); profile-dense: CTAs and
# active cycles per SM of equal-length launches at block_kv 32/64/128 (~1.5 min); kv-cliff: those
# block_kv at one split with and without PDL, graph-replayed (~1.5 min); compare-batch-small: single
# sequences, 64 x 2K and a log-normal batch vs FlashInfer (~2 min); compare-batch-eager: the
# default paged call's eager loop and host cost beside FlashInfer's (~3 min); plan-default: the
# fixed and the load-aware split plan side by side on 15 batches at Hkv 8 and 1 (~4 min); batch-sweep: sweep-batches
# over configs/batches.yaml or $BATCH_GRID (~8 min, resumable; BATCH_SWEEP_TIMEOUT); batch-evaluate: the batch
# table, then evaluate-batches on configs/batches_holdout.yaml or $HOLDOUT_GRID (~4 min); dense-part: a part of
# configs/dense_decode.yaml, resumed (DENSE_PART, DENSE_TIMEOUT, DENSE_TRIALS, DENSE_WARM_START: a trials.csv
# whose fastest configs each shape measures first, DENSE_WARM_TOP of them); dense-retime: the part's configs whose
# launch this GPU now spreads, timed again under a second study prefix (DENSE_RETIME_TIMEOUT). COMPARE_BATCH_ARGS adds
# options (e.g. --plan 4:64 --peers sdpa_cudnn). The build
# takes ~2.5 min first (wheels installed, two split kernels per instantiation).
# Offline hosts: carry the wheels of gpu-wheelhouse.sh in .whl/ (installed to /tmp/site first),
# and .prebuilt/ (the extension a build returned as $OUT/extension.tar.xz.N) to skip the build.
# The carry limit (64 MiB with the tree) leaves no room for a dense part's optuna.journal beside
# all of .whl/: a dense-part or evaluate call, which needs no FlashInfer, can leave its tarball and
# the apache_tvm_ffi wheel out of .whl/ and carry the journal instead (no restore-storage).
# Logs are written to a scratch folder and, after every step, packed with results/<gpu> into
# one file, $OUT/session.tgz (default ./gpu-out): the GPU host returns only a few files per call.
set -uo pipefail
dest=${OUT:-gpu-out}; mkdir -p "$dest"
out=$(mktemp -d)
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
# FlashInfer, an optional peer of compare (../shared/tools/flashinfer-wheelhouse.sh); its kernels
# JIT-compile on first use.
if compgen -G ".whl/flashinfer-*-trimmed.tar.xz" >/dev/null; then
  tar -xJf .whl/flashinfer-*-trimmed.tar.xz -C /tmp/site
  export FLASHINFER_CUDA_ARCH_LIST=9.0a MAX_JOBS=$(nproc)
fi
export SPLITKV_GIT_SHA=${SPLITKV_GIT_SHA:-$(cat .git-sha 2>/dev/null)} PYTHONUNBUFFERED=1 SPLITKV_CUDA_ARCHS=${SPLITKV_CUDA_ARCHS:-90} CMAKE_BUILD_PARALLEL_LEVEL=$(nproc)
# Each call copies the tree afresh, so every source is newer than its object and a build on a
# still-warm host would redo everything (~2.5 min): skip it when the build's inputs are the ones
# this host last built and the extension imports.
build_inputs=$( { echo "$SPLITKV_CUDA_ARCHS"; python3 -c "import sys, torch; print(sys.version_info[:2], torch.__version__)";
                  nvcc --version | tail -1; c++ --version | head -1; find CMakeLists.txt pyproject.toml kernels -type f | LC_ALL=C sort | xargs sha256sum; } | sha256sum | cut -d' ' -f1)
# A fresh host has no build; a call that carries .prebuilt/extension.tar.xz.N (what an earlier call
# built from the same inputs, returned in 15-MiB parts: the device returns files of 16 MiB at most)
# installs the package without CUDA (~20 s) and drops that extension beside it instead of
# compiling the kernels (~2.5 min).
package_dir() { python3 -c "import os, splitkv_tune._rules as r; print(os.path.dirname(r.__file__))"; }
prebuilt=.prebuilt/extension.tar.xz
# use_prebuilt: installs the carried extension; says why not (into prebuilt.log) when it cannot.
use_prebuilt() {
  compgen -G "$prebuilt.[0-9]" >/dev/null || return 1
  local joined; joined=$(mktemp)
  cat "$prebuilt".[0-9] >"$joined"  # one-digit parts: the glob's order is theirs
  [ "$(tar -xJOf "$joined" inputs 2>/dev/null)" = "$build_inputs" ] \
    || { echo "build: the carried $prebuilt.* was built from other inputs" | tee "$out/prebuilt.log"; return 1; }
  { SPLITKV_BUILD_CUDA=0 python3 -m pip install --no-build-isolation --no-deps -e . \
      && tar -xJf "$joined" -C "$(package_dir)" --exclude inputs && python3 -c "import torch, splitkv_tune._C"; } \
    >"$out/prebuilt.log" 2>&1 || { echo "build: the carried $prebuilt.* did not install (prebuilt.log)"; return 1; }
}
if [ "$(cat build/.inputs 2>/dev/null)" = "$build_inputs" ] && python3 -c "import torch, splitkv_tune._C" 2>/dev/null; then
  echo "build: kept (this host built these inputs last)" | tee "$out/build.log"
elif use_prebuilt; then
  echo "build: the carried $prebuilt (built from these inputs)" | tee "$out/build.log"
else
  python3 -m pip install --no-build-isolation --no-deps -e . >"$out/build.log" 2>&1 || { tail -30 "$out/build.log"; cp "$out/build.log" "$dest/"; exit 1; }
  # Returned in 15-MiB parts (at most 3: the device returns 8 files, session.tgz among them);
  # carry them as .prebuilt/ next time.
  packed=$(mktemp -d)  # beside $out, whose files all go into session.tgz
  echo "$build_inputs" > "$packed/inputs"
  ext=$(python3 -c "import os, torch, splitkv_tune._C as c; print(os.path.basename(c.__file__))")
  XZ_OPT=-T0 tar -cJf "$packed/extension.tar.xz" -C "$(package_dir)" "$ext" -C "$packed" inputs \
    && [ "$(stat -c %s "$packed/extension.tar.xz")" -le $((45 << 20)) ] \
    && split -b 15M -d -a 1 "$packed/extension.tar.xz" "$dest/extension.tar.xz." \
    && echo "build: the extension returned as $(ls "$dest"/extension.tar.xz.* | wc -l) part(s), $(du -h "$packed/extension.tar.xz" | cut -f1)" | tee -a "$out/build.log" \
    || echo "build: the extension is not returned (over 45 MiB compressed, or not packed)" | tee -a "$out/build.log"
fi
mkdir -p build && echo "$build_inputs" > build/.inputs
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee "$out/nvidia-smi.txt"
# Results go under the GPU present (a lent "h200" may be an H100); GPU=... names one explicitly, and
# the measuring commands refuse it when it is not the device present.
flag=${GPU:-$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)}
gpu=$(python3 -c "from splitkv_tune.gpus import resolve_gpu; print(resolve_gpu('$flag'))")
# SM clock, memory clock and power every 0.5 s while this runs: per-CTA stream rates follow the SM clock.
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv -lms 500 >"$out/clocks.csv" 2>&1 &
clock_log=$!
pack() { tar czf "$dest/session.tgz" -C "$out" . $( [ -d "results/$gpu" ] && echo "-C $PWD results/$gpu" ); }
trap 'kill $clock_log 2>/dev/null; pack' EXIT
trap 'exit 143' TERM  # packs once the step in flight has ended
trap 'exit 130' INT
# Every step's timeout (whole seconds) is cut to what is left of $CALL_BUDGET_S (default 540 s:
# the device's 600-s call limit, less a step's 15 s to stop after its TERM and the packing),
# counted from the start, build included: a call that ran past the limit was killed while
# packing and brought nothing back.
budget=${CALL_BUDGET_S:-540}
limit() {
  [[ $1 =~ ^[0-9]+$ ]] || { echo "$2: its timeout must be whole seconds, got '$1'; skipped" >&2; return 2; }
  local left=$((budget - SECONDS))
  [ "$left" -gt 10 ] || { echo "$2: skipped, the call's $budget s are spent" >&2; return 124; }
  timeout -k 15 "$(( $1 < left ? $1 : left ))" "${@:2}"
}
# The folder of the dense part DENSE_PART (bf16_d128 by default).
dense_dir() { echo "results/$gpu/dense_decode/${DENSE_PART:-bf16_d128}"; }
# A sweep of the dense part for at most $1 seconds with the options that follow, resumed on its
# optuna.journal (git-ignored: carried by run's carry, or else rebuilt from the part's
# trials.csv by restore-storage).
dense_sweep() {
  local seconds=$1 dir part=${DENSE_PART:-bf16_d128}
  shift
  dir=$(dense_dir)
  if [ -f "$dir/trials.csv" ] && [ ! -f "$dir/optuna.journal" ]; then
    limit 120 splitkv-tune restore-storage "$dir" 2>&1 | tee -a "$out/dense_part.log"
  fi
  limit "$seconds" splitkv-tune sweep --gpu "$flag" --grid configs/dense_decode.yaml --dtype "${part%%_*}" \
    --head-dim "${part##*_d}" --sampler tpe --out "$dir" --no-progress "$@" \
    $( [ -f "$dir/optuna.journal" ] && echo --resume ) 2>&1 | tail -8 | tee -a "$out/dense_part.log"
  shipped_table
}
# parts_of MANIFEST: the paths a results/<gpu>/*_parts.txt names (one a line, relative to
# results/<gpu>; '#' lines and blank ones skipped), one a line.
parts_of() { grep -v '^[[:space:]]*\(#\|$\)' "$1" | sed "s|^|results/$gpu/|"; }
# The table the selector ships for this GPU, rebuilt from the sweeps its table_parts.txt names
# (a sweep writes only its own folder's table); a GPU without that file ships none yet.
shipped_table() {
  local manifest=results/$gpu/table_parts.txt parts
  [ -f "$manifest" ] || return 0
  mapfile -t parts < <(parts_of "$manifest")
  splitkv-tune table "${parts[@]}" -o "results/$gpu/heuristics.csv" 2>&1 | tail -2 | tee -a "$out/table.log"
}
# evaluate_held_out SHAPES NAME: the selector's regret on a held-out set, every timed config kept
# (NAME_models_trials.csv) for offline replays against later tables (HOLDOUT_TIMEOUT).
evaluate_held_out() {
  limit ${HOLDOUT_TIMEOUT:-480} splitkv-tune evaluate --gpu "$flag" --shapes-file "$1" \
    --out-csv "results/$gpu/evaluate_$2.csv" --out-md "results/$gpu/evaluate_$2.md" \
    --out-trials "results/$gpu/$2_models_trials.csv" 2>&1 | tail -50 | tee "$out/evaluate_$2.log"
}
small_decode="1 8 1 4096|1 8 1 16384|1 8 1 65536|1 32 1 4096|4 8 1 4096|4 8 1 16384|1 8 4 16384|1 8 16 16384 --causal"
# compare_batch NAME TIMEOUT ARGS...: splitkv-tune compare-batch at page 64 with ARGS and
# $COMPARE_BATCH_ARGS (its timeout: $COMPARE_BATCH_TIMEOUT or TIMEOUT seconds), into NAME.{csv,md,log}.
compare_batch() {
  local name=$1 secs=$2
  shift 2
  limit ${COMPARE_BATCH_TIMEOUT:-$secs} splitkv-tune compare-batch --page-size 64 "$@" ${COMPARE_BATCH_ARGS:-} \
    --csv "$out/$name.csv" --out-md "$out/$name.md" 2>&1 | tail -80 | tee "$out/$name.log"
}
for mode in "$@"; do
  case "$mode" in
    test)
      date -u | tee "$out/gpu_tests.log"
      # The whole report goes to the log (the first failure's traceback included); the screen
      # gets its end.
      SPLITKV_REQUIRE_GPU=1 limit 300 python3 -m pytest -q -p no:cacheprovider --no-header -rf \
        tests/test_*_gpu.py \
        tests/test_build.py::test_extension_matches_tunables >>"$out/gpu_tests.log" 2>&1
      tail -15 "$out/gpu_tests.log"
      ;;
    profile-live)
      # Nsight Compute on one launch of each case ("LENGTHS KNOBS [OPTIONS]", tools/profile_live.py,
      # e.g. "lognormal:32:4096:1.0 load_aware --q-heads 8 --kv-heads 1"; $PROFILE_CASES,
      # '|'-separated): durations and occupancy (details_*.csv), warp stalls by source line
      # (source_*.csv, summed up in profile_live.log), ~20 s a case.
      IFS='|' read -ra cases <<<"${PROFILE_CASES:-4096 auto|4096 load_aware|4096 equal:16|uniform:16:8192 auto|uniform:16:8192 64:64|uniform:16:8192 equal:8|skewed:16:65536:1024 auto}"
      for c in "${cases[@]}"; do
        set -- $c
        name=$(echo "$*" | tr ' :' '_-' | tr -d '.')
        limit 120 ncu --clock-control none --cache-control none -k regex:split_kv --launch-skip 12 --launch-count 1 \
          --section SpeedOfLight --section WarpStateStats --section SourceCounters --section LaunchStats \
          --section Occupancy --import-source yes -f -o "$out/prof_$name" \
          python3 tools/profile_live.py --lengths "$1" --knobs "$2" "${@:3}" >>"$out/ncu.log" 2>&1
        ncu -i "$out/prof_$name.ncu-rep" --page details --csv >"$out/details_$name.csv" 2>>"$out/ncu.log"
        ncu -i "$out/prof_$name.ncu-rep" --page source --csv --print-source cuda,sass >"$out/source_$name.csv" 2>>"$out/ncu.log"
        python3 tools/ncu_source_summary.py "$out/source_$name.csv" --top 15 | tee -a "$out/profile_live.log"
      done
      ;;
    profile-dense)
      # The block_kv cliff at one split (B 8, 32 KV heads, 8K keys: kv64 ~1.33x kv32 and kv128):
      # CTAs per SM (min/max over SMs), active cycles per SM, DRAM throughput and occupancy of one
      # equal-length launch per "LENGTHS KNOBS" case ($PROFILE_DENSE_CASES, '|'-separated).
      IFS='|' read -ra cases <<<"${PROFILE_DENSE_CASES:-uniform:8:8192 equal:1:32|uniform:8:8192 equal:1:64|uniform:8:8192 equal:1:128|uniform:8:8192 equal:4:64|uniform:4:8192 equal:1:64|uniform:16:8192 equal:1:64}"
      metrics=sm__ctas_launched.sum,sm__ctas_launched.min,sm__ctas_launched.max,sm__cycles_active.min,sm__cycles_active.max,sm__cycles_active.avg,gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__warps_active.avg.pct_of_peak_sustained_active,launch__occupancy_limit_registers,launch__occupancy_limit_shared_mem,launch__registers_per_thread,launch__shared_mem_per_block_dynamic
      for c in "${cases[@]}"; do
        set -- $c
        echo "== $c" | tee -a "$out/profile_dense.log"
        name=$(echo "$1_$2" | tr ':' '-')
        limit 90 ncu --clock-control none --cache-control none -k regex:split_kv --launch-skip 12 --launch-count 1 \
          --metrics "$metrics" --csv python3 tools/profile_live.py --lengths "$1" --knobs "$2" --q-heads 32 --kv-heads 32 \
          >"$out/dense_$name.csv" 2>>"$out/ncu.log"
        grep '^"' "$out/dense_$name.csv" | python3 -c "import csv,sys; [print(f'{r[-3]:60s} {r[-2]:>8s} {r[-1]}') for r in list(csv.reader(sys.stdin))[1:] if len(r) > 3]" | tee -a "$out/profile_dense.log"
      done
      ;;
    kv-cliff)
      # block_kv 32/64/128 with and without programmatic dependent launch, graph-replayed, on
      # grids of 128 to 512 CTAs ("B HKV SK SPLITS"): one split of 32 KV heads, where block_kv 64
      # (3 CTAs a SM) lost up to 1.33x in the dense sweep, and short calls of one batch row.
      for s in "8 32 8192 1" "16 32 4096 1" "16 32 8192 1" "4 32 8192 1" "12 32 8192 1" "1 8 16384 16,24,32" "2 8 4096 8,16,24"; do
        set -- $s
        limit 60 splitkv-tune bench --batch $1 --q-heads 32 --kv-heads $2 --q-len 1 --kv-len $3 \
          --splits $4 --block-kv 32,64,128 --pdl on,off 2>&1 | grep -v '^$'
      done | tee "$out/kv_cliff.log"
      ;;
    merge-ab)
      # The combine kernel against the fused merge, side by side in one process per shape.
      IFS='|' read -ra shapes <<<"$small_decode"
      for s in "${shapes[@]}"; do
        set -- $s
        limit 90 splitkv-tune bench --batch $1 --kv-heads $2 --q-len $3 --kv-len $4 ${5:-} \
          --splits 4,8,16,32 --block-kv 64,128 --merge kernel,fused 2>&1 | tail -18
      done | tee "$out/merge_ab.log"
      ;;
    pdl-ab)
      IFS='|' read -ra shapes <<<"$small_decode|1 8 1 64|4 8 1 1024|16 8 1 65536|16 32 1 16384"
      for s in "${shapes[@]}"; do
        set -- $s
        limit 60 splitkv-tune bench --batch $1 --kv-heads $2 --q-len $3 --kv-len $4 ${5:-} --pdl on,off 2>&1 | tail -3
      done | tee "$out/pdl_ab.log"
      ;;
    eager)
      # Host cost and eager per-call time of the default call (and with every tunable given)
      # beside SDPA flash and cuDNN.
      IFS='|' read -ra shapes <<<"1 8 1 256|1 8 1 4096|1 8 1 16384|1 8 1 24576|4 8 1 4096|1 8 1 65536"
      for s in "${shapes[@]}"; do
        set -- $s
        limit 90 splitkv-tune bench --batch $1 --kv-heads $2 --q-len $3 --kv-len $4 --eager 2>&1
        limit 60 splitkv-tune bench --batch $1 --kv-heads $2 --q-len $3 --kv-len $4 --eager \
          --splits 4 --block-kv 64 --reduce-threads 128 --policy blocks 2>&1
      done | tee "$out/eager.log"
      ;;
    head-dims)
      # Head dims 96 and 256: the quick grid's shapes of those dims swept into a folder of their
      # own (their trials are appended to results/<gpu>/trials.csv afterwards), then compared with
      # SDPA and FlashInfer at the swept winners, graph-replayed and eager.
      limit 240 splitkv-tune sweep --gpu "$flag" --grid quick --head-dim 96 --head-dim 256 \
        --out "$out/sweep_hd" --no-progress 2>&1 | tail -12 | tee "$out/sweep_hd.log"
      limit 300 splitkv-tune compare --grid quick --head-dim 96 --head-dim 256 --table "$out/sweep_hd/heuristics.csv" \
        --peers sdpa_flash,sdpa_cudnn,flashinfer_decode,flashinfer_decode_tc,flashinfer_xqa --eager \
        --out "$out/compare_hd" --no-progress 2>&1 | tail -40 | tee "$out/compare_hd.log"
      ;;
    host-floor)
      # The host path piece by piece (tools/host_breakdown.py) beside what the CUDA calls under it
      # cost without torch or Python (tools/launch_floor.cu).
      { nvcc -O2 -std=c++17 -arch=sm_90 -Ikernels/include tools/launch_floor.cu -o "$out/launch_floor" &&
          limit 60 "$out/launch_floor"; limit 120 python3 tools/host_breakdown.py; } 2>&1 | tee "$out/host_floor.log"
      ;;
    host-tuned)
      # Host cost with every tunable given (S16 kv64, blocks) over the quick grid's D = 128 shapes.
      limit 120 splitkv-tune compare --grid quick --head-dim 128 --config 16,64,128,blocks --peers "" --eager \
        --out "$out/host_tuned" --no-progress 2>&1 | tail -30 | tee "$out/host_tuned.log"
      ;;
    sweep)
      limit 420 splitkv-tune sweep --gpu "$flag" --grid quick --no-progress 2>&1 | tail -25 | tee "$out/sweep.log"
      shipped_table
      ;;
    evaluate)
      limit 240 splitkv-tune evaluate --gpu "$flag" --shapes-file configs/evaluate.yaml \
        --out-csv results/$gpu/evaluate_gpu.csv --out-md results/$gpu/evaluate_gpu.md 2>&1 | tail -20 | tee "$out/evaluate.log"
      ;;
    evaluate-holdout)
      # The selector on the 36 held-out real-model shapes, every timed config kept
      # (holdout_models_trials.csv) for offline replays against later tables.
      evaluate_held_out configs/models_holdout.yaml holdout
      ;;
    evaluate-confirm)
      # The same on the second held-out set (32 shapes chosen after the class-size rule).
      evaluate_held_out configs/models_holdout_confirm.yaml confirm
      ;;
    breakdown)
      # Kernel time per call at the table's config (issue 2: the combine kernel's share).
      IFS='|' read -ra shapes <<<"$small_decode"
      for s in "${shapes[@]}"; do
        set -- $s
        limit 60 splitkv-tune bench --batch $1 --kv-heads $2 --q-len $3 --kv-len $4 ${5:-} --breakdown 2>&1 | tail -12
      done | tee "$out/breakdown.log"
      ;;
    compare)
      limit ${COMPARE_TIMEOUT:-300} splitkv-tune compare --grid quick ${COMPARE_TABLE---table results/$gpu/heuristics.csv} --out results/$gpu/compare \
        --peers "${PEERS:-sdpa_flash,sdpa_cudnn,flex}" ${COMPARE_FLAGS:---with-no-pdl} --no-progress 2>&1 | tail -80 | tee "$out/compare.log"
      [ -n "${SKIP_PREFILL:-}" ] || limit 120 splitkv-tune compare --grid configs/prefill.yaml --config 1,64,128,blocks --peers sdpa_flash,sdpa_cudnn \
        --out results/$gpu/compare_prefill --no-progress 2>&1 | tail -8 | tee "$out/prefill.log"
      splitkv-tune env > "$out/env.txt" 2>&1
      ;;
    compare-batch)
      # One 64K and fifteen 1K, one 128K and 255 of 512, eight from 256K down to 2K, and 16 x 8K;
      # ours also behind tables 8x and 64x wider (capacity invariance).
      compare_batch compare_batch 540 --lengths skewed:16:65536:1024 --lengths skewed:256:131072:512 \
        --lengths geometric:8:262144:2048 --lengths uniform:16:8192 --wider 8 --wider 64
      ;;
    compare-batch-small)
      # One sequence of 4K and of 32K, 64 x 2K and a log-normal batch (mean 4K): the paged kernel
      # where the batch holds few items or equal lengths, beside the equal-length call.
      compare_batch compare_batch_small 300 --lengths 4096 --lengths 32768 --lengths uniform:64:2048 \
        --lengths lognormal:32:4096:1.0 --peers flashinfer_decode_tc,flashinfer_xqa --one-split 8
      ;;
    compare-batch-eager)
      # The default paged call as an eager loop (check_inputs=True) and its host cost, beside
      # FlashInfer's planned wrappers and the graph-replayed times: one sequence, equal lengths,
      # a skewed and a log-normal batch ($EAGER_BATCHES, $EAGER_PEERS to change them).
      compare_batch compare_batch_eager 300 $(printf -- '--lengths %s ' ${EAGER_BATCHES:-4096 uniform:16:8192 skewed:16:65536:1024 lognormal:32:4096:1.0}) \
        --peers "${EAGER_PEERS-flashinfer_decode_tc,flashinfer_xqa}" --one-split 8 --eager
      ;;
    plan-default)
      # Whether split_plan="load_aware" beats the fixed plan as the paged call's default: both at
      # the "auto" knobs, side by side, at Hkv 8 and 1, on the held-out skewed batches and others
      # of every kind ($PLAN_BATCHES; ~4 min).
      for heads in "32 8" "8 1"; do
        set -- $heads
        compare_batch plan_default_$1_$2 240 $(printf -- '--lengths %s ' ${PLAN_BATCHES:-4096 32768 uniform:16:8192 \
          uniform:64:2048 skewed:16:65536:1024 skewed:8:32768:1024 skewed:32:65536:512 skewed:64:131072:1024 \
          skewed:24:16384:256 skewed:4:262144:4096 skewed:128:32768:256 geometric:8:262144:2048 \
          lognormal:16:8192:1.5 lognormal:64:2048:0.5 lognormal:128:1024:1.0}) --q-heads $1 --kv-heads $2 --peers ""
      done
      ;;
    batch-sweep)
      # A batch grid ($BATCH_GRID, default configs/batches.yaml) swept into
      # results/<gpu>/batches/<grid name>.csv; a rerun times only the batches not yet there, so a
      # timeout loses at most the batch in flight.
      grid=${BATCH_GRID:-configs/batches.yaml}
      mkdir -p results/$gpu/batches
      limit ${BATCH_SWEEP_TIMEOUT:-540} splitkv-tune sweep-batches --grid "$grid" \
        --csv results/$gpu/batches/$(basename "$grid" .yaml).csv 2>&1 | tail -40 | tee -a "$out/batch_sweep.log"
      ;;
    batch-evaluate)
      # The batch table from the batch sweeps its batch_table_parts.txt names, then the
      # selector's regret on held-out batches ($HOLDOUT_GRID, default configs/batches_holdout.yaml,
      # ~4 min, resumable; rows in results/<gpu>/batches/<grid name less batches_>.csv, the report
      # in evaluate_<that>.md/.csv) beside the auto knobs and FA2/FA3/SGLang. A GPU without that
      # file has no table: its selector is the model for every batch.
      grid=${HOLDOUT_GRID:-configs/batches_holdout.yaml}
      name=$(basename "$grid" .yaml); name=${name#batches_}
      table=()
      if [ -f results/$gpu/batch_table_parts.txt ]; then
        mapfile -t sweeps < <(parts_of results/$gpu/batch_table_parts.txt)
        splitkv-tune batch-table "${sweeps[@]}" --gpu "$flag" -o results/$gpu/batch_table.csv \
          2>&1 | tee -a "$out/batch_evaluate.log"
        table=(--batch-table results/$gpu/batch_table.csv)
      fi
      mkdir -p results/$gpu/batches
      limit ${BATCH_EVALUATE_TIMEOUT:-400} splitkv-tune evaluate-batches --grid "$grid" \
        --gpu "$flag" "${table[@]}" --csv results/$gpu/batches/$name.csv \
        --out-md results/$gpu/batches/evaluate_$name.md --out-csv results/$gpu/batches/evaluate_$name.csv \
        2>&1 | tail -40 | tee -a "$out/batch_evaluate.log"
      ;;
    dense-part)
      # One part of the dense decode grid (configs/dense_decode.yaml; DENSE_PART=bf16_d128 by
      # default), continued; DENSE_TIMEOUT seconds (~17.5 min a part, so a 10-minute call sweeps
      # part of it; a kill loses no finished trial).
      dense_sweep ${DENSE_TIMEOUT:-300} --trials ${DENSE_TRIALS:-24} \
        $( [ -n "${DENSE_WARM_START:-}" ] && echo --warm-start "$DENSE_WARM_START" --warm-start-top ${DENSE_WARM_TOP:-4} )
      ;;
    dense-retime)
      # The part's configs whose launch this GPU now spreads (docs/PERFORMANCE.md, "Back to
      # back"), timed again under a second study prefix that the table pools with the first.
      dense_sweep ${DENSE_RETIME_TIMEOUT:-300} --warm-start "$(dense_dir)/trials.csv" --warm-start-select spread \
        --warm-start-top 64 --study-prefix "splitkv:$gpu:spread:"
      ;;
    *) echo "usage: $0 MODE... (test, head-dims, host-floor, host-tuned, eager, merge-ab, pdl-ab, sweep, evaluate, breakdown, compare, compare-batch, compare-batch-small, compare-batch-eager, plan-default, profile-live, profile-dense, kv-cliff, evaluate-holdout, evaluate-confirm, batch-sweep, batch-evaluate, dense-part, dense-retime)" >&2; exit 2 ;;
  esac
  pack
done
