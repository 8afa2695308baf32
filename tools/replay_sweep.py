"""How close a sweep's winner comes to the best config after N trials: the sweep's own search
(``shape_study.ShapeRunner``: its first configs, then TPE) replayed against a trials file that holds
every config of each shape (``evaluate --out-trials``), each measurement answered from that
file (``evaluation.config_time``: a split count it lacks is answered by the nearest one
measured). Prints, per trial budget and seed, the geometric-mean and max regret of the winner
and how many shapes it leaves more than 2% behind. CPU only; no timing is done.

    PYTHONPATH=$PWD python3 tools/replay_sweep.py [--trials results/nvidia_h200/holdout_models_trials.csv]
        [--shapes configs/models_holdout.yaml] [--budgets 6,10,16,24,32] [--seeds 0,1,2]
"""
import argparse

import optuna

from splitkv_tune import bench, shape_study, sweep
from splitkv_tune.evaluation import config_time, summarize
from splitkv_tune.selector import shape_key
from splitkv_tune.space import load_grid
from splitkv_tune.table_schema import SHAPE_COLUMNS, read_trials


class Replay:
    """A stand-in for the sweep's shape bench: each config's time from the exhaustive trials."""

    def __init__(self, group):
        self.group = group

    def __call__(self):
        return self

    def measure(self, config):
        us, _ = config_time(self.group, config)
        return bench.Timing.from_samples([us], "replay")


def replay(grid, groups, budget: int, seed: int) -> tuple[dict, int]:
    """(regret summary, shapes more than 2% behind) of the sweep's winners after ``budget`` trials."""
    plan = sweep.SweepPlan(gpu="replay", grid=grid, shapes=list(grid.shapes), sampler="tpe",
                           trials=budget, seed=seed)
    storage = optuna.storages.InMemoryStorage()
    regrets = []
    for shape in grid.shapes:
        group = groups[shape_key(shape.dtype, shape.head_dim, shape.causal, shape.batch,
                                 shape.q_heads, shape.kv_heads, shape.q_len, shape.kv_len)]
        runner = shape_study.ShapeRunner(plan, shape, storage, "replay", 1.0, None)
        runner.run(Replay(group), None)
        found = min(t.value for t in runner.study.trials if t.value is not None)
        regrets.append(found / group["median_us"].min() - 1)
    return summarize(regrets), sum(r > 0.02 for r in regrets)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", default="results/nvidia_h200/holdout_models_trials.csv")
    ap.add_argument("--shapes", default="configs/models_holdout.yaml")
    ap.add_argument("--budgets", default="6,10,16,24,32")
    ap.add_argument("--seeds", default="0,1,2")
    args = ap.parse_args()
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    trials = read_trials(args.trials)
    trials = trials[trials["status"] == "ok"]
    groups = {shape_key(*key): g for key, g in trials.groupby(SHAPE_COLUMNS)}
    grid = load_grid(args.shapes)
    print("trials  per seed: geometric-mean regret / max / shapes > 2%")
    for budget in (int(b) for b in args.budgets.split(",")):
        cells = []
        for seed in (int(s) for s in args.seeds.split(",")):
            summary, behind = replay(grid, groups, budget, seed)
            cells.append(f"{100 * summary['geomean']:.2f}% / {100 * summary['max']:.1f}% / {behind}")
        print(f"{budget:6d}  " + "   ".join(cells), flush=True)


if __name__ == "__main__":
    main()
