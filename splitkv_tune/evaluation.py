"""Regret of split rules against measured trials (offline), and on a GPU (``evaluate``).

Regret of a config on a shape = ``time(config) / best - 1`` where ``best`` is the fastest
successful trial of that shape (the exhaustive search over the space). A rule's config is
timed from the trials with the first match of: the exact config; the same ``num_splits`` and
``block_kv`` (other tunables: the fastest measured); the same ``num_splits``; the measured
``num_splits`` nearest in log2 (ties -> smaller). ``match`` records which one was used, so a
sparse (Optuna-sampled) sweep is still usable and the approximation is visible.
"""
from __future__ import annotations

import math

import pandas as pd

from splitkv_tune import space
from splitkv_tune.baselines import baseline_configs
from splitkv_tune.gpus import GpuProfile, profile_for, resolve_gpu
from splitkv_tune.selector import GENERIC_PROFILE, HeuristicTable, select_shape
from splitkv_tune.table_schema import CONFIG_COLUMNS, SHAPE_COLUMNS
from splitkv_tune.tunables import Config, Shape

MATCHES = ("exact", "same S and block_kv", "same S", "nearest S")


def shape_of(row) -> Shape:
    return Shape(str(row["dtype"]), int(row["head_dim"]), int(row["batch"]), int(row["q_heads"]),
                 int(row["kv_heads"]), int(row["q_len"]), int(row["kv_len"]),
                 bool(int(row["causal"])))


def config_time(group: pd.DataFrame, cfg: Config) -> tuple[float, str]:
    """Time of ``cfg`` from one shape's successful trials, and how it was matched.

    >>> g = pd.DataFrame({"num_splits": [1, 8, 8], "block_kv": [64, 64, 128],
    ...                   "reduce_threads": [128] * 3, "split_policy": ["blocks"] * 3,
    ...                   "median_us": [30.0, 10.0, 9.0]})
    >>> config_time(g, Config(8, 64, 128, "blocks")), config_time(g, Config(8, 32, 64, "blocks"))
    ((10.0, 'exact'), (9.0, 'same S'))
    >>> config_time(g, Config(3, 64, 128, "blocks"))
    (9.0, 'nearest S')
    """
    same_s = group[group["num_splits"] == cfg.num_splits]
    exact = same_s[(same_s["block_kv"] == cfg.block_kv)
                   & (same_s["reduce_threads"] == cfg.reduce_threads)
                   & (same_s["split_policy"] == cfg.split_policy)]
    same_kv = same_s[same_s["block_kv"] == cfg.block_kv]
    for frame, how in ((exact, MATCHES[0]), (same_kv, MATCHES[1]), (same_s, MATCHES[2])):
        if len(frame):
            return float(frame["median_us"].min()), how
    target = math.log2(cfg.num_splits)
    splits = sorted(set(int(s) for s in group["num_splits"]),
                    key=lambda s: (abs(math.log2(s) - target), s))
    return float(group[group["num_splits"] == splits[0]]["median_us"].min()), MATCHES[3]


def summarize(regrets) -> dict:
    """Geometric-mean regret (``exp(mean(log(1 + r))) - 1``), max and count.

    >>> summarize([0.0, 0.21, 0.0])["geomean"].__round__(4), summarize([0.0, 0.21])["max"]
    (0.0656, 0.21)
    """
    rs = [float(r) for r in regrets if r == r]
    if not rs:
        return {"geomean": float("nan"), "max": float("nan"), "n": 0}
    gm = math.exp(sum(math.log1p(r) for r in rs) / len(rs)) - 1
    return {"geomean": gm, "max": max(rs), "n": len(rs)}


def _ok_trials(trials: pd.DataFrame) -> pd.DataFrame:
    ok = trials[(trials["status"] == "ok") & trials["median_us"].notna()]
    return ok[pd.to_numeric(ok["median_us"]) > 0]


def heuristics_from_trials(trials: pd.DataFrame, gpu: str) -> pd.DataFrame:
    """The heuristics table the sweep would write (``table.build_heuristics``)."""
    from splitkv_tune.table import build_heuristics
    return build_heuristics(trials.assign(gpu=resolve_gpu(gpu)), gpu=resolve_gpu(gpu))


def evaluate_trials(trials: pd.DataFrame, gpu: str, leave_one_out: bool = True,
                    table: HeuristicTable | None = None, profile: GpuProfile | None = None) -> pd.DataFrame:
    """Per measured shape: regret of the selector, the analytic fallback alone, the
    FA2, FA3 (varlen) and SGLang rules (``baselines``) and S=1. The selector reads ``table``
    when one is given (held-out shapes timed by ``evaluate --out-trials``, replayed against
    any table), else the table of ``trials`` themselves; with ``leave_one_out`` the shape's own
    row is removed from that table before selecting, so every selection is for a shape not in
    the table. ``profile`` replaces the GPU's profile for the selector (another
    ``sm_balance_pct``: tools/sm_balance_fit.py)."""
    gpu = resolve_gpu(gpu)
    chooser = profile or gpu
    profile = profile or profile_for(gpu) or GENERIC_PROFILE
    ok = _ok_trials(trials)
    heur = heuristics_from_trials(ok, gpu) if table is None else table.frame
    full = HeuristicTable(heur, gpu=gpu) if table is None else table
    out = []
    for _, group in ok.groupby(SHAPE_COLUMNS, sort=True):
        shape = shape_of(group.iloc[0])
        best = float(group["median_us"].min())
        if leave_one_out:
            keep = ~(heur[SHAPE_COLUMNS].astype(str) == pd.Series(
                {c: str(group.iloc[0][c]) for c in SHAPE_COLUMNS})).all(axis=1)
            table = HeuristicTable(heur[keep], gpu=gpu) if keep.any() else None
        else:
            table = full
        rec = {c: group.iloc[0][c] for c in SHAPE_COLUMNS}
        rec["best_us"] = best
        sel = select_shape(table, shape, chooser)
        rules = {"selector": sel.config, "fallback": select_shape(None, shape, gpu).config,
                 **baseline_configs(shape, profile.sms)}
        for name, cfg in rules.items():
            t, how = config_time(group, cfg)
            rec.update({f"{name}_splits": cfg.num_splits, f"{name}_us": t,
                        f"{name}_regret": t / best - 1, f"{name}_match": how})
        rec["s1_us"] = float(group[group["num_splits"] == 1]["median_us"].min())
        rec["s1_regret"] = rec["s1_us"] / best - 1
        rec["selector_kind"] = sel.kind
        out.append(rec)
    return pd.DataFrame(out)


def fallback_vs_fa2(trials_df: pd.DataFrame, gpu: str = "nvidia_h200") -> dict:
    """Regret of the analytic fallback (no table) and of FlashAttention-2's rule against
    measured trials: ``{"fallback": summary, "fa2": summary, "better": bool, "per_shape": df}``.
    ``better`` is true when the fallback's geometric-mean regret is lower."""
    df = evaluate_trials(trials_df, gpu, leave_one_out=False)
    res = {"fallback": summarize(df["fallback_regret"]), "fa2": summarize(df["fa2_regret"])}
    res["better"] = bool(res["fallback"]["geomean"] < res["fa2"]["geomean"])
    res["per_shape"] = df[SHAPE_COLUMNS + ["best_us", "fallback_splits", "fallback_regret",
                                           "fa2_splits", "fa2_regret"]]
    return res


def shape_columns(shape: Shape) -> dict:
    """The shape as the tables' shape columns (``causal`` as 0 or 1)."""
    return {c: (int(shape.causal) if c == "causal" else getattr(shape, c)) for c in SHAPE_COLUMNS}


def trial_row(shape: Shape, cfg: Config, timing, gpu: str, run_id: str) -> dict:
    """One timed config in the columns ``read_trials`` validates (a ``trials.csv`` row)."""
    ok = timing.status == "ok"
    row = shape_columns(shape) | {c: getattr(cfg, c) for c in CONFIG_COLUMNS}
    row.update(gpu=resolve_gpu(gpu), median_us=timing.median_us if ok else None,
               p20_us=timing.p20_us if ok else None, p80_us=timing.p80_us if ok else None,
               n=timing.n, status=timing.status, reason=timing.reason,
               gbps=timing.gbps(shape.bytes_moved()) if ok else None, frac_copy_bw=None, run_id=run_id)
    return row


def measure_shape(shape: Shape, gpu: str, bench_kwargs: dict, table,
                  search_space: space.SearchSpace = space.SearchSpace(),
                  trial_rows: list | None = None, run_id: str = "", measured_on: str | None = None) -> dict:
    """Time the selected config, the baselines' (FA2, FA3, SGLang), S=1 and every config of
    ``search_space``; each timed config is appended to ``trial_rows`` (when given) as a
    ``trials.csv`` row of run ``run_id`` and GPU ``measured_on`` (default ``gpu``, whose table
    and profile are used), so that the shapes can be replayed against other
    tables without a GPU (:func:`evaluate_trials` with ``table``).

    ``bench_kwargs`` go to :class:`bench.ShapeBench` (``backend="reference"`` runs on the CPU).
    """
    from splitkv_tune.bench import ShapeBench
    profile = profile_for(gpu) or GENERIC_PROFILE
    sel = select_shape(table, shape, gpu)
    bases = baseline_configs(shape, profile.sms)
    cands = space.candidate_configs(
        shape, search_space, smem_limit=profile.smem_per_block,
        extra_splits=(sel.config.num_splits, *(c.num_splits for c in bases.values())))
    bench = ShapeBench(shape, num_sms=profile.sms, **bench_kwargs)
    times = {}
    for cfg in dict.fromkeys(cands + [sel.config, *bases.values()]):
        timing = bench.measure(cfg)
        times[cfg] = timing.median_us if timing.status == "ok" else float("nan")
        if trial_rows is not None:
            trial_rows.append(trial_row(shape, cfg, timing, measured_on or gpu, run_id))
    good = {c: t for c, t in times.items() if t == t}
    if not good:
        raise RuntimeError(f"every config failed on {space.shape_key(shape)}")
    best_cfg = min(good, key=good.get)
    s1 = min((t for c, t in good.items() if c.num_splits == 1), default=float("nan"))
    rec = shape_columns(shape)
    rec.update(best_us=good[best_cfg], best_config=space.config_key(best_cfg),
               selector_config=space.config_key(sel.config), selector_kind=sel.kind,
               selector_us=times[sel.config], s1_us=s1)
    for name, cfg in bases.items():
        rec.update({f"{name}_config": space.config_key(cfg), f"{name}_us": times[cfg]})
    for name in ("selector", *bases, "s1"):
        rec[f"{name}_regret"] = rec[f"{name}_us"] / rec["best_us"] - 1
    return rec


def to_markdown(df: pd.DataFrame,
                names=("selector", "fallback", "fa2", "fa3", "sglang", "s1")) -> str:
    """A per-shape regret table and a summary line per rule, as markdown. Where a rule's config
    was not timed on the shape (offline, its ``_match`` is not exact) its regret is the reading
    of another config (:func:`config_time`), marked ``*``, and the summary adds the figures over
    the shapes whose choice was timed as chosen.

    >>> df = pd.DataFrame({"dtype": ["bf16"] * 2, "head_dim": [128] * 2, "causal": [0] * 2,
    ...                    "batch": [1, 2], "q_heads": [8] * 2, "kv_heads": [1] * 2, "q_len": [1] * 2,
    ...                    "kv_len": [4096] * 2, "best_us": [10.0, 20.0], "selector_regret": [0.1, 0.5],
    ...                    "selector_match": ["exact", "same S"]})
    >>> print(to_markdown(df).splitlines()[3])
    | bf16 | 128 | 0 | 2 | 8 | 1 | 1 | 4096 | 20.00 | 50.0%* |
    >>> print(to_markdown(df).splitlines()[-1])
    - selector: geometric-mean regret 28.45%, max 50.00% over 2 shapes; timed as chosen on 1: 10.00%, max 10.00%
    """
    names = [n for n in names if f"{n}_regret" in df]
    head = ["dtype", "D", "causal", "B", "Hq", "Hkv", "Sq", "Sk", "best µs"] + [
        f"{n} regret" for n in names]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def read_off(r, n) -> bool:
        return f"{n}_match" in r and r[f"{n}_match"] != MATCHES[0]

    for _, r in df.iterrows():
        cells = [str(r[c]) for c in SHAPE_COLUMNS] + [f"{r['best_us']:.2f}"] + [
            f"{r[f'{n}_regret'] * 100:.1f}%" + ("*" if read_off(r, n) else "") for n in names]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    if any(f"{n}_match" in df for n in names):
        lines += ["\\* the rule's config was not timed on that shape: the regret is read off the same S "
                  "(or the nearest S) the trials timed, not measured.", ""]
    for n in names:
        s = summarize(df[f"{n}_regret"])
        line = (f"- {n}: geometric-mean regret {s['geomean'] * 100:.2f}%, "
                f"max {s['max'] * 100:.2f}% over {s['n']} shapes")
        if f"{n}_match" in df and (df[f"{n}_match"] != MATCHES[0]).any():
            e = summarize(df.loc[df[f"{n}_match"] == MATCHES[0], f"{n}_regret"])
            line += (f"; timed as chosen on {e['n']}: {e['geomean'] * 100:.2f}%, max {e['max'] * 100:.2f}%"
                     if e["n"] else "; timed as chosen on none")
        lines.append(line)
    return "\n".join(lines) + "\n"
