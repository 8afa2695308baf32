"""The threshold of a GPU's ``sm_balance_pct`` (configs/gpus.yaml; ``interpolation.balance_splits``):
leave-one-out regret of the selector over the table's own trials at each threshold, which chooses
it (the least regret; of equal ones the lowest threshold, which raises S least often), and, read
after the choice, the regret on held-out trials files against the shipped table. CPU only; about
80 s a threshold for the H200's 754 shapes.

    python3 tools/sm_balance_fit.py --gpu h200 --table results/nvidia_h200/heuristics.csv \\
        --trials results/nvidia_h200/trials.csv --trials results/nvidia_h200/dense_decode/bf16_d128/trials.csv \\
        --trials results/nvidia_h200/dense_decode/fp16_d128/trials.csv \\
        --held-out results/nvidia_h200/holdout_models_trials.csv
"""
import argparse
import dataclasses

import pandas as pd

from splitkv_tune.evaluation import evaluate_trials, summarize
from splitkv_tune.gpus import profile_for, resolve_gpu
from splitkv_tune.selector import HeuristicTable
from splitkv_tune.table_schema import read_heuristics, read_trials

THRESHOLDS = (0, 60, 70, 75, 80, 85, 90, 95)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpu", required=True)
    parser.add_argument("--table", required=True, help="the shipped heuristics.csv (for --held-out)")
    parser.add_argument("--trials", action="append", required=True, help="the table's trials files")
    parser.add_argument("--held-out", action="append", default=[], help="trials of shapes not in the table")
    parser.add_argument("--thresholds", default=",".join(map(str, THRESHOLDS)),
                        help="sm_balance_pct values to try, comma-separated (0: none)")
    args = parser.parse_args()
    gpu = resolve_gpu(args.gpu)
    if profile_for(gpu) is None:
        parser.error(f"--gpu: no profile for {args.gpu!r} in configs/gpus.yaml")
    try:
        thresholds = [int(x) for x in args.thresholds.split(",")]
    except ValueError:
        parser.error(f"--thresholds must be integers, got {args.thresholds!r}")
    if not all(0 <= t <= 100 for t in thresholds):
        parser.error(f"--thresholds must be in [0, 100], got {args.thresholds!r}")
    trials = pd.concat([read_trials(p) for p in args.trials], ignore_index=True)
    table = HeuristicTable(read_heuristics(args.table), gpu=gpu)
    held_out = {p: read_trials(p) for p in args.held_out}
    rows = []
    for pct in thresholds:
        profile = dataclasses.replace(profile_for(gpu), sm_balance_pct=pct)
        loo = summarize(evaluate_trials(trials, gpu, leave_one_out=True, profile=profile)["selector_regret"])
        row = {"sm_balance_pct": pct, "leave-one-out": f"{loo['geomean']:.2%} (max {loo['max']:.1%})",
               "_loo": loo["geomean"]}
        for path, frame in held_out.items():
            s = summarize(evaluate_trials(frame, gpu, leave_one_out=False, table=table,
                                          profile=profile)["selector_regret"])
            row[path] = f"{s['geomean']:.2%} (max {s['max']:.1%})"
        rows.append(row)
        print(row, flush=True)
    frame = pd.DataFrame(rows)
    # Regrets equal to the printed 0.01% tie; the lowest threshold of those wins.
    best = frame.loc[frame["_loo"].round(4) == frame["_loo"].round(4).min(), "sm_balance_pct"].min()
    print(frame.drop(columns="_loo").to_string(index=False))
    print(f"\nchosen by leave-one-out: sm_balance_pct {best} (0: none)")


if __name__ == "__main__":
    main()
