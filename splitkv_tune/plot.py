"""Plots of heuristics and trials tables (matplotlib, Agg backend; PNG and SVG).

``plot_all(path, out)`` writes, from a ``heuristics.csv`` or a ``trials.csv``:

* ``<base>.png/.svg`` - heatmap of the best S over (B*Hkv, Sk), one panel per
  (dtype, head_dim, causal, Sq, G), cells annotated;
* ``<base>_speedup_s1`` / ``<base>_speedup_fa2`` - best time over S=1 and over
  FlashAttention-2's heuristic (trials only: they need every config's time);
* ``<base>_bandwidth`` - achieved fraction of copy bandwidth of the winner against Sk;
* ``<base>_noise`` - the winner's ``(p80 - p20) / median``, the quantity the tie rule uses;
* ``<base>_regret`` (``plot_regret``, from an ``evaluate --out-csv`` file) - regret of the
  selector and of each baseline rule per shape;
* ``paged_batch_regret`` in a directory, else ``<base>_batch_regret``
  (``plot_batches.plot_batch_regret``, from an ``evaluate-batches --out-csv`` file) - the
  same per held-out paged batch;
* ``paged_batches`` in a directory, else ``<base>_batches`` (``plot_batches``, from
  ``compare-batch`` CSVs) - our speed-up per paged batch over one S and over the peers.

Every figure's title names the GPU and the sweep run(s); each panel names its dtype, head
dim, causality, Sq and G. Panels of one figure share one colour range, and a shape that was
not measured is a hatched cell marked "n/a".

``out`` is a directory (files ``best_splits*``) or a base name (a ``.png``/``.svg`` suffix is
dropped); each file is written whole, through a temporary file and a rename. Axes are log2
with ticks at the measured values (``4K`` = 4096).
"""
from __future__ import annotations

import math
import os
import tempfile
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.patheffects  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402
import matplotlib.ticker  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from splitkv_tune import space, tunables  # noqa: E402
from splitkv_tune.gpus import profile_for  # noqa: E402
from splitkv_tune.selector import GENERIC_PROFILE  # noqa: E402
from splitkv_tune.table_schema import (SHAPE_COLUMNS, TableError, _read_csv, with_gpu,  # noqa: E402
                                       validate_heuristics, validate_trials)

PANEL_KEYS = ["dtype", "head_dim", "causal", "q_len", "group"]
FORMATS = ("png", "svg")


def fmt_count(v: float) -> str:
    """Readable tick label: ``fmt_count(4096) == '4K'``.

    Counts that are no whole or half multiple of the unit are printed whole.

    >>> [fmt_count(v) for v in (8, 1024, 1536, 65536, 2**20, 40000)]
    ['8', '1K', '1.5K', '64K', '1M', '40000']
    """
    for div, unit in ((2**20, "M"), (2**10, "K")):
        if v >= div and (2 * v / div).is_integer():
            return f"{v / div:g}{unit}"
    return f"{v:g}"


def _edges(vals) -> np.ndarray:
    logs = np.log2(np.asarray(vals, dtype=float))
    if len(logs) == 1:
        return np.array([logs[0] - 0.5, logs[0] + 0.5])
    mids = (logs[1:] + logs[:-1]) / 2
    return np.concatenate([[2 * logs[0] - mids[0]], mids, [2 * logs[-1] - mids[-1]]])


def _with_work(df: pd.DataFrame) -> pd.DataFrame:
    df = df.copy()
    df["bh"] = df["batch"] * df["kv_heads"]
    df["group"] = df["q_heads"] // df["kv_heads"]
    return df


def _panels(df: pd.DataFrame):
    return list(df.groupby(PANEL_KEYS, sort=True))


def _title(key) -> str:
    dtype, d, causal, sq, g = key
    return f"{dtype} D={d} {'causal' if causal else 'non-causal'} Sq={sq} G={g}"


def _save_atomic(fig, path: Path) -> None:
    """Through a temporary file and ``os.replace``: a reader (or a kill) never sees half a
    figure."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            fig.savefig(handle, format=path.suffix[1:], dpi=100, bbox_inches="tight")
        os.chmod(tmp, 0o644)  # mkstemp makes 0600 files; plots are meant to be shared
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _save(fig, base: Path, suffix: str) -> list[Path]:
    paths = []
    for ext in FORMATS:
        path = base.with_name(base.name + suffix + "." + ext)
        _save_atomic(fig, path)
        paths.append(path)
    plt.close(fig)
    return paths


def heatmap(df: pd.DataFrame, value: str, title: str, cbar: str, fmt, cmap="viridis",
            log_color: bool = False):
    """A figure with one heatmap panel per (dtype, head_dim, causal, Sq, G) of ``df[value]``,
    all panels on one colour range."""
    panels = _panels(_with_work(df))
    ncols = min(3, len(panels))
    nrows = math.ceil(len(panels) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(5.2 * ncols, 4.2 * nrows), squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.axis("off")
    values = df[value].astype(float)
    if log_color:
        lim = {"vmin": 0, "vmax": math.log2(tunables.MAX_SPLITS)}
    else:
        lo, hi = float(values.min()), float(values.max())
        lim = {"vmin": lo, "vmax": hi if hi > lo else lo + 1}
    for ax, (key, part) in zip(axes.flat, panels):
        bhs, sks = sorted(set(part["bh"])), sorted(set(part["kv_len"]))
        grid = np.full((len(bhs), len(sks)), np.nan)
        for _, r in part.sort_values(SHAPE_COLUMNS).iterrows():
            i, j = bhs.index(r["bh"]), sks.index(r["kv_len"])
            if np.isnan(grid[i, j]):
                grid[i, j] = r[value]
        shown = np.log2(grid) if log_color else grid
        ax.set_facecolor("0.9")
        ax.patch.set_hatch("//")  # shows through the masked (not measured) cells
        mesh = ax.pcolormesh(_edges(sks), _edges(bhs), np.ma.masked_invalid(shown), cmap=cmap,
                             **lim)
        for i, bh in enumerate(bhs):
            for j, sk in enumerate(sks):
                missing = np.isnan(grid[i, j])
                ax.text(math.log2(sk), math.log2(bh), "n/a" if missing else fmt(grid[i, j]),
                        ha="center", va="center", fontsize=8,
                        color="0.35" if missing else "white",
                        path_effects=[] if missing else [matplotlib.patheffects.withStroke(
                            linewidth=2, foreground="black")])
        ax.set_xticks(np.log2(sks), [fmt_count(v) for v in sks])
        ax.set_yticks(np.log2(bhs), [fmt_count(v) for v in bhs])
        ax.set_xlabel("KV length Sk (tokens, log2 axis)")
        ax.set_ylabel("B·Hkv (batch × KV heads, log2 axis)")
        ax.set_title(_title(key), fontsize=9)
        cb = fig.colorbar(mesh, ax=ax)
        cb.set_label(cbar + (" (log2 colour scale)" if log_color else ""))
        if log_color:
            ticks = range(int(math.log2(tunables.MAX_SPLITS)) + 1)
            cb.set_ticks(list(ticks), labels=[str(2**t) for t in ticks])
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def run_label(heur: pd.DataFrame) -> str:
    """``GPU nvidia_h200, run 2026...`` for a figure title."""
    gpus = ", ".join(sorted(set(map(str, heur["gpu"])))) if "gpu" in heur else "unknown GPU"
    runs = sorted(set(map(str, heur["run_id"]))) if "run_id" in heur else []
    what = "run" if len(runs) == 1 else "runs"
    return f"GPU {gpus}, {what} {', '.join(runs) if runs else 'unknown'}"


def _winners_from_trials(trials: pd.DataFrame, gpu: str) -> tuple[pd.DataFrame, pd.DataFrame]:
    from splitkv_tune.evaluation import config_time, heuristics_from_trials, shape_of
    ok = trials[(trials["status"] == "ok") & trials["median_us"].notna()]
    heur = heuristics_from_trials(ok, gpu)
    sms = (profile_for(gpu) or GENERIC_PROFILE).sms
    rows = []
    for _, group in ok.groupby(SHAPE_COLUMNS, sort=True):
        shape = shape_of(group.iloc[0])
        best = float(group["median_us"].min())
        s1 = group[group["num_splits"] == 1]["median_us"].min()
        fa2, _ = config_time(group, space.fa2_config(shape, sms))
        rows.append({**{c: group.iloc[0][c] for c in SHAPE_COLUMNS},
                     "speedup_s1": s1 / best, "speedup_fa2": fa2 / best})
    return heur, pd.DataFrame(rows)


def _trials_gpu(path, trials: pd.DataFrame) -> str:
    """The GPU of a trials file: its gpu column, else the ``results/<gpu>/`` folder it sits in
    when that names a known GPU."""
    from splitkv_tune.gpus import profile_for
    if "gpu" in trials and trials["gpu"].nunique() == 1:
        return str(trials["gpu"].iloc[0])
    folder = Path(path).resolve().parent.name
    if profile_for(folder) is not None:
        return folder
    raise TableError(path, "cannot tell which GPU these trials ran on: name it with --gpu")


def read_any(path, gpu: str | None = None) -> tuple[pd.DataFrame, pd.DataFrame | None]:
    """(heuristics, per-shape speedups or None) from a heuristics.csv or a trials.csv; a trials
    file's winners are taken for ``gpu`` (``None``: the one GPU its rows name). Of a file whose
    rows name several GPUs, ``gpu``'s rows only (one GPU a figure); without ``gpu``, an error."""
    raw = _read_csv(path)
    if "schema_version" in raw.columns:
        table = with_gpu(validate_heuristics(raw, path), gpu, path)
        if table["gpu"].nunique() > 1:  # no gpu named
            raise TableError(path, "rows for several GPUs: name one with --gpu")
        return table, None
    if "status" in raw.columns:
        trials = with_gpu(validate_trials(raw, path), gpu, path)
        if not (trials["status"] == "ok").any():
            raise TableError(path, "no successful trials")
        return _winners_from_trials(trials, gpu or _trials_gpu(path, trials))
    raise TableError(path, "neither a heuristics table (schema_version column) nor trials "
                           "(status column)")


def out_base(out, name: str = "best_splits") -> Path:
    """Base path of the output files (see the module docstring); ``name`` is the base in a
    directory."""
    trailing = str(out).endswith(("/", "\\"))
    out = Path(out)
    if out.is_dir() or trailing:
        out.mkdir(parents=True, exist_ok=True)
        return out / name
    if out.suffix in (".png", ".svg"):
        out = out.with_suffix("")
    out.parent.mkdir(parents=True, exist_ok=True)
    return out


def plot_all(path, out, gpu: str | None = None) -> list[Path]:
    """Write every plot the input supports; return the files written."""
    heur, speed = read_any(path, gpu)
    base = out_base(out)
    where = run_label(heur)
    files = _save(heatmap(heur, "num_splits", f"Best number of KV splits S ({where})", "S",
                          lambda v: f"{v:.0f}", log_color=True), base, "")
    if speed is not None and len(speed):
        for col, what in (("speedup_s1", "S = 1"), ("speedup_fa2", "FlashAttention-2's heuristic")):
            fig = heatmap(speed, col, f"Speed-up of the best config over {what} ({where})",
                          "speed-up (×)", lambda v: f"{v:.2f}", cmap="magma")
            files += _save(fig, base, "_" + col)
    noisy = heur.assign(noise=(heur["p80_us"] - heur["p20_us"]) / heur["median_us"] * 100)
    noisy = noisy.dropna(subset=["noise"])
    if len(noisy):
        files += _save(heatmap(noisy, "noise", "Timing noise of the winner, (p80 − p20) / median "
                               f"(tie margin = max(this, 1%); {where})", "(p80 − p20) / median (%)",
                               lambda v: f"{v:.1f}%", cmap="cividis"), base, "_noise")
    bw = _with_work(heur.dropna(subset=["frac_copy_bw"]))
    if len(bw):
        fig, ax = plt.subplots(figsize=(11, 5))
        for key, part in bw.groupby(["dtype", "head_dim", "causal", "q_len", "group", "bh"]):
            part = part.sort_values("kv_len")
            ax.plot(part["kv_len"], part["frac_copy_bw"], marker="o",
                    label=f"{key[0]} D={key[1]} c={key[2]} Sq={key[3]} G={key[4]} B·Hkv={key[5]}")
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: fmt_count(v)))
        ax.set_xlabel("KV length Sk (tokens, log2 axis)")
        ax.set_ylabel("achieved fraction of copy bandwidth")
        ax.set_ylim(0, max(1.0, float(bw["frac_copy_bw"].max()) * 1.05))
        ax.set_title(f"Winner's bandwidth (bytes of Q, K, V, O / time) / copy bandwidth\n{where}",
                     fontsize=10)
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0,
                  ncol=1 + len(ax.get_lines()) // 24)
        files += _save(fig, base, "_bandwidth")
    return files


REGRET_RULES = ("selector", "fallback", "fa2", "fa3", "sglang", "s1")


def plot_regret(path, out) -> list[Path]:
    """Grouped bars of each rule's regret per shape, from an ``evaluate --out-csv`` file."""
    df = _read_csv(path)
    rules = [r for r in REGRET_RULES if f"{r}_regret" in df.columns]
    missing = [c for c in SHAPE_COLUMNS if c not in df.columns]
    if missing or not rules or not len(df):
        raise TableError(path, "not an evaluation CSV (`evaluate --out-csv`): needs the shape "
                               "columns and <rule>_regret columns" + (
                                   f"; missing: {', '.join(missing)}" if missing else ""))
    for col in [f"{r}_regret" for r in rules]:
        df[col] = pd.to_numeric(df[col], errors="coerce")
    labels = [f"{r.dtype} D{r.head_dim} c{r.causal} B{r.batch} Hq{r.q_heads} Hkv{r.kv_heads} "
              f"Sq{r.q_len} Sk{fmt_count(int(r.kv_len))}" for r in df.itertuples()]
    gpus = ", ".join(sorted(set(map(str, df["gpu"])))) if "gpu" in df else Path(path).parent.name
    fig = regret_bars(labels, {rule: df[f"{rule}_regret"].to_numpy() for rule in rules},
                      f"Regret per shape of the selector and the baseline rules\n(GPU {gpus}; {Path(path).name})")
    return _save(fig, out_base(out), "_regret")


def regret_bars(labels: list[str], regrets: dict, title: str):
    """A figure of grouped bars, per label, of each rule's regret (fractions; NaN: "n/a"), on a
    symlog axis of percent."""
    width = 0.8 / len(regrets)
    fig, ax = plt.subplots(figsize=(min(18.0, 4 + 0.6 * len(labels)), 6.5))
    x = np.arange(len(labels))
    for k, (rule, values) in enumerate(regrets.items()):
        vals = np.asarray(values, dtype=float) * 100
        ax.bar(x + (k - (len(regrets) - 1) / 2) * width, np.nan_to_num(vals, nan=0.0), width, label=rule)
        for xi in x[np.isnan(vals)]:
            ax.text(xi + (k - (len(regrets) - 1) / 2) * width, 0, "n/a", rotation=90, fontsize=7,
                    ha="center", va="bottom", color="0.35")
    ax.set_yscale("symlog", linthresh=1.0)
    ax.set_ylabel("regret: time / best − 1 (%, symlog axis)")
    ax.set_xticks(x, labels, rotation=60, ha="right", fontsize=8)
    fig.suptitle(title, fontsize=11)
    ax.legend(fontsize=9, ncol=len(regrets), loc="lower center", bbox_to_anchor=(0.5, 1.0))
    fig.tight_layout()
    return fig
