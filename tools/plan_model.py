"""The model behind the load-aware plan's constants (live_plan.h, kLivePlan*), and its check.

`fit` fits a list-scheduling model of the paged kernel's persistent schedule to compare-batch
rows (the `ours` and `ours_m<MIN>_s<MAX>` rows at block_kv 64 with the fused merge): each work
item (one split of one sequence and KV head) costs `a + b * rate * blocks` µs, where the rate is
`max(rho, items / ctas)` (fewer items than CTAs stream faster), the CTAs take items in the
kernel's order (size class, then batch order) as they come free, and the tile's last split adds
`m` for the fused merge; a launch takes `t0` more. It prints the parameters, the RMS error and,
per batch, how often the model's fastest knob is the measured fastest. live_plan.h's per-item cost
(kLivePlanItemKeys, `a / b` blocks of 64 keys) and rate floor (kLivePlanRateFloor16 / 16, rho)
come from it.

`check` replays the plan on knob curves (compare-batch run with `--plan-space` over
min_blocks_per_split): for each batch, the knob that `plan.plan_min_blocks` chooses from the
"auto" knob, looked up among the timed rows, against the "auto" knob itself and the best row.

`rank` replays the selector's model (live_model.h ``live_model_knobs``: the fixed-plan point of the
sweeps' space, or the "auto" knobs, that the model of the launch finishes first, on the batch's
lengths, ``--sms`` SMs and ``--ctas-per-sm``) on sweep-batches rows: for each batch, the timed row
at the model's knobs against the batch's best row of any knobs, beside the "auto" knobs' row:
regret per batch, geometric mean and max (a batch whose model knobs were not timed has none).

    python3 tools/plan_model.py fit results/nvidia_h200/batches/batches.csv ...   # needs scipy
    python3 tools/plan_model.py check --ctas 264 results/nvidia_h200/paged/plan_knob_curves_32_8_2026-12-02.csv
    python3 tools/plan_model.py rank --ctas-per-sm 2 results/nvidia_h200/batches/holdout.csv
"""
from __future__ import annotations

import argparse
import heapq

import numpy as np
import pandas as pd

from splitkv_tune import _rules, live, plan
from splitkv_tune.batches import parse_lengths

BLOCK_KV = 64


def _rows(paths) -> pd.DataFrame:
    d = pd.concat([pd.read_csv(p) for p in paths], ignore_index=True)
    d = d[(d["status"] == "ok") & (d["block_kv"] == BLOCK_KV) & (d["merge"] == "fused")
          & ((d["impl"] == "ours") | d["impl"].str.match(r"ours_m\d+_s\d+(_fused)?$"))]
    keys = ["label", "q_heads", "kv_heads", "min_blocks_per_split", "max_splits"]
    return d.drop_duplicates(keys).reset_index(drop=True)


def _items(lengths, kv_heads: int, min_blocks: int, max_splits: int) -> list[tuple[int, int, int]]:
    """(tile, splits, blocks) per work item of a decode batch (one query tile per KV head), in
    the kernel's order (tile_scheduler.h: size class, then batch order)."""
    seqs = []
    for b, n in enumerate(lengths):
        splits = plan.live_splits(n, BLOCK_KV, min_blocks, max_splits)
        blocks = -(-n // BLOCK_KV)
        seqs.append((_rules.size_class(-(-blocks // splits)), b, splits, blocks))
    seqs.sort()
    return [(b * kv_heads + h, s, (i + 1) * nb // s - i * nb // s)
            for _, b, s, nb in seqs for i in range(s) for h in range(kv_heads)]


def _time(x, items, ctas: int) -> float:
    t0, a, b, rho, m = x
    rate = b * max(rho, min(1.0, len(items) / ctas))
    free = [(0.0, c) for c in range(min(ctas, len(items)))]
    arrived: dict[int, int] = {}
    finish = 0.0
    for tile, splits, blocks in items:
        start, cta = heapq.heappop(free)
        end = start + a + rate * blocks
        arrived[tile] = arrived.get(tile, 0) + 1
        if splits > 1 and arrived[tile] == splits:
            end += m
        finish = max(finish, end)
        heapq.heappush(free, (end, cta))
    return t0 + finish


def fit(paths, ctas: int) -> None:
    from scipy.optimize import minimize
    d = _rows(paths)
    items = [_items(parse_lengths(r.label), int(r.kv_heads), int(r.min_blocks_per_split), int(r.max_splits))
             for r in d.itertuples()]
    measured = d["median_us"].to_numpy()

    def loss(x):
        if min(x) < 0 or x[3] > 1:
            return 1e9
        return float(np.mean(np.log([_time(x, it, ctas) for it in items] / measured) ** 2))

    result = minimize(loss, [7.0, 3.5, 1.7, 0.7, 0.5], method="Nelder-Mead",
                      options={"maxiter": 200, "xatol": 1e-3, "fatol": 1e-6})
    t0, a, b, rho, m = result.x
    print(f"{len(d)} rows: t0 {t0:.2f} µs, a {a:.2f} µs/item, b {b:.3f} µs/block, rho {rho:.3f}, m {m:.2f} µs; "
          f"RMS log error {np.sqrt(result.fun):.3f}")
    print(f"item cost {a / b:.2f} blocks of {BLOCK_KV} keys ({a / b * BLOCK_KV:.0f} keys), "
          f"rate floor {rho * 16:.1f}/16")
    d = d.assign(model=[_time(result.x, it, ctas) for it in items])
    hits = sum(g.loc[g["model"].idxmin(), "median_us"] <= 1.02 * g["median_us"].min()
               for _, g in d.groupby(["label", "kv_heads"]))
    print(f"the model's fastest knob within 2% of the measured fastest on {hits} of "
          f"{d.groupby(['label', 'kv_heads']).ngroups} batches")


def check(paths, ctas: int, sms: int) -> None:
    d = pd.concat([pd.read_csv(p) for p in paths], ignore_index=True)
    d = d[(d["status"] == "ok") & (d["block_kv"] == BLOCK_KV)]
    if "split_plan" in d:  # the fixed plan's rows: the model estimates each knob as given
        d = d[d["split_plan"] == "fixed"]
    rows = []
    heads = ["head_dim", "q_heads", "kv_heads", "q_len"]
    for (label, head_dim, q_heads, kv_heads, q_len), g in d.groupby(["label", *heads]):
        lengths = parse_lengths(label)
        rows_per_knob = {(int(r.min_blocks_per_split), int(r.max_splits)): r.median_us
                         for r in g.itertuples() if r.impl.startswith("ours_m")}
        rows_of_head = int(q_len) * int(q_heads // kv_heads)
        _, knob, bound = live.resolve_knobs(len(lengths), int(head_dim), int(kv_heads), rows_of_head, sms)
        bounds = sorted({s for _, s in rows_per_knob})
        nearest = min(bounds, key=lambda s: abs(s - bound))
        chosen = plan.plan_min_blocks(lengths, kv_heads=int(kv_heads), packed_rows=rows_of_head, ctas=ctas,
                                      block_kv=BLOCK_KV, min_blocks_per_split=knob, max_splits=bound)
        rows.append({"batch": label, "kv_heads": kv_heads, "knob": knob, "chosen": chosen,
                     "at_knob": rows_per_knob.get((knob, nearest)), "at_choice": rows_per_knob.get((chosen, nearest)),
                     "best": min(rows_per_knob.values())})
    r = pd.DataFrame(rows).dropna()
    print(r.round(1).to_string(index=False))
    for col in ("at_knob", "at_choice"):
        gap = r[col] / r["best"] - 1
        print(f"{col}: mean gap to the best row {gap.mean():.1%}, max {gap.max():.1%}")
    change = r["at_choice"] / r["at_knob"] - 1
    print(f"choice against knob: mean {change.mean():+.1%}, best {change.min():+.1%}, worst {change.max():+.1%} "
          f"({len(r)} batches)")


def rank(paths, ctas_per_sm: int, sms: int) -> pd.DataFrame:
    """One row per batch: the model's knobs (live_model.h ``live_model_knobs``), their timed row, the
    auto row's and the best row's times, regrets (NaN where the model's knobs were not timed)."""
    d = pd.concat([pd.read_csv(p) for p in paths], ignore_index=True)
    d = d[(d["status"] == "ok") & d["impl"].str.startswith("ours")]  # the best row: any knobs, any plan
    if "split_plan" not in d:
        d = d.assign(split_plan="fixed")
    rows = []
    for (label, head_dim, q_heads, kv_heads, q_len, page), g in d.groupby(["label", "head_dim", "q_heads",
                                                                           "kv_heads", "q_len", "page_size"]):
        lengths = list(parse_lengths(label))
        packed_rows = int(q_len) * int(q_heads // kv_heads)
        min_blocks, max_splits, _ = _rules.live_model_knobs(lengths, int(kv_heads), packed_rows, sms, ctas_per_sm)
        fixed = g[(g["block_kv"] == BLOCK_KV) & (g["split_plan"].isna() | (g["split_plan"] == "fixed"))
                  & (g["min_blocks_per_split"] == min_blocks) & (g["max_splits"] == max_splits)]
        auto = g.loc[g["impl"] == "ours", "median_us"]
        rows.append({"batch": label, "head_dim": head_dim, "kv_heads": kv_heads, "page": page, "pick": f"m{min_blocks} s{max_splits}",
                     "pick_us": fixed["median_us"].min() if len(fixed) else np.nan,
                     "auto_us": auto.iloc[0] if len(auto) else np.nan, "best_us": g["median_us"].min()})
    r = pd.DataFrame(rows)
    for col in ("pick", "auto"):
        r[f"{col}_regret"] = r[f"{col}_us"] / r["best_us"] - 1
    return r


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=("fit", "check", "rank"))
    parser.add_argument("csv", nargs="+")
    parser.add_argument("--ctas", type=int, default=264, help="fit, check: the launch's CTAs (H200: 132 SMs x 2)")
    parser.add_argument("--sms", type=int, default=132)
    parser.add_argument("--ctas-per-sm", type=int, default=2,
                        help="rank: the paged kernel's CTAs per SM (H200, bf16 D 128 block_kv 64: 2)")
    args = parser.parse_args()
    if args.what == "fit":
        fit(args.csv, args.ctas)
    elif args.what == "check":
        check(args.csv, args.ctas, args.sms)
    else:
        r = rank(args.csv, args.ctas_per_sm, args.sms)
        print(r.round(3).to_string(index=False))
        for col in ("pick", "auto"):
            regret = r[f"{col}_regret"].dropna()
            print(f"{col}: geometric-mean regret {np.expm1(np.log1p(regret).mean()):.1%}, max {regret.max():.1%} "
                  f"({len(regret)} batches)")


if __name__ == "__main__":
    main()
