#!/bin/bash
# Wall time of one sweep of results/cpu_reference/scaling/grid.yaml on the reference backend
# (CPU) with 1, 2 and 4 worker processes, REPEATS times each (default 2, interleaved);
# writes results/cpu_reference/scaling/scaling.csv.
# Usage: [REPEATS=2] tools/cpu_worker_scaling.sh [WORKERS...]   (default: 1 2 4)
set -euo pipefail
cd "$(dirname "$0")/.."
dest=results/cpu_reference/scaling
grid=$dest/grid.yaml
counts=${*:-1 2 4}
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
echo "repeat,workers,wall_s,trials,cpu_count,load_avg_1m,host" > "$dest/scaling.csv"
for repeat in $(seq "${REPEATS:-2}"); do
  for n in $counts; do
    load=$(cut -d' ' -f1 /proc/loadavg)
    start=$(date +%s.%N)
    python3 -m splitkv_tune.cli sweep --backend reference --grid "$grid" \
      --out "$scratch/r$repeat-w$n" --workers "$n" --no-progress >/dev/null 2>&1
    end=$(date +%s.%N)
    trials=$(($(wc -l < "$scratch/r$repeat-w$n/trials.csv") - 1))
    printf '%s,%s,%.1f,%s,%s,%s,%s\n' "$repeat" "$n" "$(echo "$end - $start" | bc)" "$trials" \
      "$(nproc)" "$load" "$(hostname)" >> "$dest/scaling.csv"
  done
done
cat "$dest/scaling.csv"
