"""Trials (long format, ``trials.csv``) -> heuristics table (``heuristics.csv``), and atomic writes.

``trials.csv`` columns (``TRIALS_COLUMNS``), one row per measured config:
``gpu, run_id, study, trial, backend``, the shape columns and the tunables of
``table_schema``, ``workspace_bytes``, ``median_us, p20_us, p80_us, iqr_us, n``,
``status`` (ok | failed | wrong), ``reason``, ``gbps`` (bytes moved / median, 1e9 B/s),
``frac_copy_bw`` (gbps / copy bandwidth measured in the same run), ``copy_bw_gbps``,
``method`` (cuda_graph | cuda_events | wallclock), ``input_sets``, ``max_abs_err``,
``source`` (fa2 | table | sampler | grid), ``finished_at``, and who measured it: ``worker``
(its name), ``host`` and ``device`` (``cuda:<index>`` or ``cpu``).

Choosing a winner per shape (``build_heuristics``): only ``status == "ok"`` rows with a
finite, positive median count. The fastest config sets the noise margin
``max((p80 - p20) / median, min_margin)``; every config within that margin of the fastest
is a tie, and ties go to the smaller ``num_splits``, then the smaller workspace, then the
lower median. The runner-up is the fastest of the other configs. Each row also keeps the winner
at every ``block_kv`` by the same rule (:func:`per_block_kv_bests`), which the interpolation reads.
"""
from __future__ import annotations

import math
import os
import tempfile
from pathlib import Path

import pandas as pd

from splitkv_tune import tunables
from splitkv_tune.table_schema import (CONFIG_COLUMNS, HEURISTICS_COLUMNS, PER_BLOCK_KV_COLUMNS,
                                       SCHEMA_VERSION, SHAPE_COLUMNS)

TRIALS_COLUMNS = (
    ["gpu", "run_id", "study", "trial", "backend"] + SHAPE_COLUMNS + CONFIG_COLUMNS
    + ["workspace_bytes", "median_us", "p20_us", "p80_us", "iqr_us", "n", "status", "reason",
       "gbps", "frac_copy_bw", "copy_bw_gbps", "method", "input_sets", "max_abs_err",
       "source", "finished_at", "worker", "host", "device"]
)
MIN_NOISE_MARGIN = 0.01


def atomic_write_text(path, text: str) -> Path:
    """Write ``text`` to ``path`` through a temporary file and ``os.replace``: a reader (or a
    kill) never sees a half-written file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", newline="") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes 0600 files; tables are meant to be shared
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def atomic_write_csv(path, frame: pd.DataFrame) -> Path:
    return atomic_write_text(path, frame.to_csv(index=False))


def _shape_of(row) -> tunables.Shape:
    return tunables.Shape(str(row["dtype"]), int(row["head_dim"]), int(row["batch"]),
                          int(row["q_heads"]), int(row["kv_heads"]), int(row["q_len"]),
                          int(row["kv_len"]), bool(int(row["causal"])))


def usable_trials(trials: pd.DataFrame) -> pd.DataFrame:
    """Rows that can win: status ok, finite positive median; one (the latest) per config.

    >>> t = pd.DataFrame({"status": ["ok", "failed", "ok", "ok"],
    ...                   "median_us": [1.0, 0.5, float("nan"), 2.0]})
    >>> usable_trials(t).median_us.tolist()
    [1.0, 2.0]
    """
    ok = trials[(trials["status"] == "ok")
                & pd.to_numeric(trials["median_us"], errors="coerce").gt(0)
                & pd.to_numeric(trials["median_us"], errors="coerce").map(
                    lambda x: math.isfinite(x) if x == x else False)]
    keys = [c for c in ["gpu"] + SHAPE_COLUMNS + CONFIG_COLUMNS if c in ok.columns]
    if not keys:
        return ok
    if "run_id" in ok.columns:
        ok = ok.sort_values("run_id", kind="stable")
    return ok.drop_duplicates(keys, keep="last")


def noise_margin(median_us: float, p20_us: float, p80_us: float, min_margin: float = MIN_NOISE_MARGIN) -> float:
    """The relative margin within which a candidate ties the fastest: the fastest's
    ``(p80 - p20) / median`` (0 when its spread is unknown), at least ``min_margin``, rounded
    to 6 places as the tables store it.

    >>> noise_margin(10.0, 9.9, 10.1), noise_margin(10.0, float("nan"), 10.1, 0.01)
    (0.02, 0.01)
    """
    spread = (p80_us - p20_us) / median_us
    return round(float(max(spread if math.isfinite(spread) else 0.0, min_margin)), 6)


def _winner_positions(median, p20, p80, splits, workspace, min_margin: float):
    """(winner, runner-up or None, noise margin) as positions in the arrays of one group's
    trials (``workspace`` None when unknown): :func:`pick_winner`'s rule without a DataFrame
    per step, since a table of a few hundred shapes runs it a thousand times."""
    order = sorted(range(len(median)), key=median.__getitem__)  # stable: equal medians keep their order
    fastest = order[0]
    margin = noise_margin(median[fastest], p20[fastest], p80[fastest], min_margin)
    ties = [i for i in order if median[i] <= median[fastest] * (1 + margin)]
    # The first of the least (num_splits, workspace, median): the stable sort's first, an
    # unknown workspace (NaN, None, pd.NA: a restored trial's empty cell) last, as pandas sorts it.
    def key(i):
        bytes_ = 0 if workspace is None else workspace[i]
        return splits[i], math.inf if pd.isna(bytes_) else bytes_, median[i]

    winner = min(ties, key=key)
    runner = next((i for i in order if i != winner), None)
    return winner, runner, margin


def pick_winner(group: pd.DataFrame, min_margin: float = MIN_NOISE_MARGIN):
    """(winner row, runner-up row or None, noise margin) of one shape's usable trials.

    >>> g = pd.DataFrame({"num_splits": [16, 8, 4], "median_us": [10.0, 10.05, 12.0],
    ...                   "p20_us": [9.9, 10.0, 11.9], "p80_us": [10.1, 10.1, 12.1],
    ...                   "workspace_bytes": [4, 2, 1]})
    >>> win, runner, margin = pick_winner(g)
    >>> int(win.num_splits), int(runner.num_splits), margin
    (8, 16, 0.02)
    """
    return _rows_of(group, _winner_positions(*_winner_columns(group), min_margin))


def _rows_of(group: pd.DataFrame, positions) -> tuple:
    winner, runner, margin = positions
    return group.iloc[winner], None if runner is None else group.iloc[runner], margin


def _winner_columns(group: pd.DataFrame) -> tuple:
    """The columns the tie rule reads, as lists (workspace None when the trials lack it)."""
    return (group["median_us"].astype(float).tolist(), group["p20_us"].astype(float).tolist(),
            group["p80_us"].astype(float).tolist(), group["num_splits"].tolist(),
            group["workspace_bytes"].tolist() if "workspace_bytes" in group else None)


def per_block_kv_bests(group: pd.DataFrame, min_margin: float = MIN_NOISE_MARGIN) -> dict:
    """What one shape's usable trials say about each ``block_kv``: the winner among the trials
    at that ``block_kv`` (:func:`pick_winner`'s tie rule, as the row's own winner) and its split
    count, as the ``best_us_kv<b>`` / ``best_splits_kv<b>`` columns (``None`` where none was timed).

    >>> g = pd.DataFrame({"block_kv": [64, 64, 32], "num_splits": [8, 4, 16],
    ...                   "median_us": [9.0, 9.05, 12.0], "p20_us": [8.9, 9.0, 11.9],
    ...                   "p80_us": [9.1, 9.1, 12.1]})
    >>> {k: v for k, v in per_block_kv_bests(g).items() if v is not None}
    {'best_us_kv32': 12.0, 'best_splits_kv32': 16, 'best_us_kv64': 9.05, 'best_splits_kv64': 4}
    """
    return _block_kv_bests(group, _winner_columns(group), min_margin)


def _block_kv_bests(group: pd.DataFrame, columns: tuple, min_margin: float) -> dict:
    """:func:`per_block_kv_bests` of the group whose :func:`_winner_columns` are ``columns``."""
    block_kv = [int(b) for b in group["block_kv"].tolist()]
    out = {}
    for b, (us, splits) in zip(tunables.BLOCK_KV, PER_BLOCK_KV_COLUMNS):
        at_b = [i for i, v in enumerate(block_kv) if v == b]
        winner = None
        if at_b:
            sub = [None if col is None else [col[i] for i in at_b] for col in columns]
            winner = at_b[_winner_positions(*sub, min_margin)[0]]
        out[us] = None if winner is None else float(columns[0][winner])
        out[splits] = None if winner is None else int(columns[3][winner])
    return out


def build_heuristics(trials: pd.DataFrame, gpu: str | None = None,
                     min_margin: float = MIN_NOISE_MARGIN) -> pd.DataFrame:
    """One ``table_schema`` row per (gpu, shape) with at least one usable trial.

    ``gpu`` fills the gpu column when ``trials`` has none (or overrides it).
    """
    trials = trials.copy()
    if gpu is not None or "gpu" not in trials.columns:
        trials["gpu"] = gpu or "unknown"
    if "workspace_bytes" not in trials.columns:
        trials["workspace_bytes"] = [
            tunables.workspace_bytes(_shape_of(r), int(r["num_splits"]))
            for _, r in trials.iterrows()]
    usable = usable_trials(trials)
    rows = []
    for _, group in usable.groupby(["gpu"] + SHAPE_COLUMNS, sort=True, dropna=False):
        columns = _winner_columns(group)  # read once for the winner and the per-block_kv bests
        winner, runner, margin = _rows_of(group, _winner_positions(*columns, min_margin))
        row = {"schema_version": SCHEMA_VERSION}
        for col in ["gpu"] + SHAPE_COLUMNS + CONFIG_COLUMNS + [
                "median_us", "p20_us", "p80_us", "gbps", "frac_copy_bw", "run_id"]:
            row[col] = winner.get(col)
        for col in CONFIG_COLUMNS:
            row["runner_up_" + col] = None if runner is None else runner[col]
        row["runner_up_us"] = None if runner is None else runner["median_us"]
        row["noise_margin"] = margin
        row["n_trials"] = len(group)
        row.update(_block_kv_bests(group, columns, min_margin))
        rows.append(row)
    table = pd.DataFrame(rows, columns=HEURISTICS_COLUMNS)
    if len(table):
        table["causal"] = table["causal"].astype(int)
        for col in ["runner_up_num_splits", "runner_up_block_kv", "runner_up_reduce_threads",
                    *(splits for _, splits in PER_BLOCK_KV_COLUMNS)]:
            table[col] = table[col].astype("Int64")
    return table.reset_index(drop=True)


def lookup_config(table: pd.DataFrame, shape: tunables.Shape) -> tunables.Config | None:
    """The winner config a heuristics table holds for exactly ``shape``, if any.

    >>> t = pd.DataFrame([{"dtype": "bf16", "head_dim": 128, "causal": 0, "batch": 1,
    ...     "q_heads": 8, "kv_heads": 8, "q_len": 1, "kv_len": 512, "num_splits": 4,
    ...     "block_kv": 64, "reduce_threads": 128, "split_policy": "blocks"}])
    >>> lookup_config(t, tunables.Shape("bf16", 128, 1, 8, 8, 1, 512))
    Config(num_splits=4, block_kv=64, reduce_threads=128, split_policy='blocks')
    """
    if table is None or not len(table):
        return None
    mask = pd.Series(True, index=table.index)
    for col in SHAPE_COLUMNS:
        value = int(shape.causal) if col == "causal" else getattr(shape, col)
        mask &= table[col].astype(type(value) if col != "causal" else int) == value
    hits = table[mask]
    if not len(hits):
        return None
    row = hits.iloc[0]
    return tunables.Config(int(row["num_splits"]), int(row["block_kv"]),
                           int(row["reduce_threads"]), str(row["split_policy"]))


def write_heuristics(trials_path, out_path, gpu: str | None = None,
                     min_margin: float = MIN_NOISE_MARGIN) -> pd.DataFrame:
    """Read trials.csv (validated), build the table and write it atomically; return it."""
    from splitkv_tune.table_schema import read_trials
    table = build_heuristics(read_trials(trials_path), gpu, min_margin)
    atomic_write_csv(out_path, table)
    return table
