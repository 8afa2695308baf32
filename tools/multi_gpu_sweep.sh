#!/bin/bash
# The quick grid swept with one worker and with one worker per GPU on one host, in one call:
# wall times and speed-up, the two tables compared within the noise (splitkv-tune diff), then a
# run in which one worker is killed with kill -9 mid-sweep and the sweep must still finish every
# grid point exactly once. Needs a host with at least two GPUs (the device kind nvidia-h200-x2)
# and the extension built (tools/gpu_session.sh builds it).
# Usage: [GPU=h200] [GRID=quick] tools/multi_gpu_sweep.sh   (writes under $OUT, default ./gpu-out)
set -uo pipefail
cd "$(dirname "$0")/.."
dest=${OUT:-gpu-out}/multi_gpu; mkdir -p "$dest"
gpu=${GPU:-h200}; grid=${GRID:-quick}
nvidia-smi --query-gpu=index,name,uuid,driver_version --format=csv > "$dest/gpus.csv"
gpus=$(($(wc -l < "$dest/gpus.csv") - 1))
[ "$gpus" -ge 2 ] || { echo "needs two GPUs, nvidia-smi lists $gpus" >&2; exit 2; }
echo "workers,wall_s,trials,host" > "$dest/wall.csv"
for n in 1 2; do
  start=$(date +%s.%N)
  PYTHONUNBUFFERED=1 splitkv-tune sweep --gpu "$gpu" --grid "$grid" --workers "$n" \
    --out "$dest/w$n" --no-progress > "$dest/sweep_w$n.log" 2>&1 || { tail -20 "$dest/sweep_w$n.log"; exit 1; }
  end=$(date +%s.%N)
  printf '%s,%.1f,%s,%s\n' "$n" "$(echo "$end - $start" | bc)" \
    "$(($(wc -l < "$dest/w$n/trials.csv") - 1))" "$(hostname)" >> "$dest/wall.csv"
done
cat "$dest/wall.csv"
splitkv-tune diff "$dest/w1/heuristics.csv" "$dest/w2/heuristics.csv" > "$dest/diff_w1_w2.txt" 2>&1
echo "diff exit $? (0: no change beyond the noise)" | tee -a "$dest/diff_w1_w2.txt"

# Kill one worker mid-sweep: the other (and Optuna's retry of the stale trial) finishes it.
PYTHONUNBUFFERED=1 splitkv-tune sweep --gpu "$gpu" --grid "$grid" --workers 2 --out "$dest/kill" \
  --no-progress > "$dest/sweep_kill.log" 2>&1 &
sweep=$!
sleep "${KILL_AFTER_S:-60}"
victim=$(pgrep -f "splitkv_tune.cli worker" | head -1)
[ -n "$victim" ] && kill -9 "$victim" && echo "killed worker pid $victim" | tee "$dest/kill.txt"
wait "$sweep"; echo "sweep after the kill exited $?" | tee -a "$dest/kill.txt"
python3 - "$dest/kill/trials.csv" <<'PY' | tee -a "$dest/kill.txt"
import sys
import pandas as pd
trials = pd.read_csv(sys.argv[1])
key = ["dtype", "head_dim", "causal", "batch", "q_heads", "kv_heads", "q_len", "kv_len",
       "num_splits", "block_kv", "reduce_threads", "split_policy"]
counts = trials.groupby(key).size()
print(f"{len(counts)} grid points, {int((counts > 1).sum())} recorded more than once")
PY
