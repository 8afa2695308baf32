"""Per-batch speed-ups of our paged kernel, from ``compare-batch`` CSVs (``plot --batches``).

For each batch (label) of the files, ``plot_batches`` draws our time's speed-up (the rival's
median / ours) over ``ours_one_split`` (our kernel with one S for the whole batch) and over
each peer in the files (FlashInfer, XQA, padded cuDNN SDPA): horizontal bars from the 1.0x
line on a log2 axis, right of it where ours is faster. Each batch's label gives our time as a
multiple of the copy floor (``x_floor``). A rival that was skipped, failed or not run for a
batch keeps its slot, hatched and marked with the reason's first words.

The title names the GPU (the files' gpu column, else ``gpu``, else the ``results/<gpu>/``
folder they sit in), the run (the file names) and the batches' dtype, D, Hq, Hkv and page.
Files: ``paged_batches.png/.svg`` in an output directory, ``<base>_batches.png/.svg`` else.
"""
from __future__ import annotations

import textwrap
from pathlib import Path

import matplotlib.patches
import matplotlib.pyplot as plt
import matplotlib.ticker
import numpy as np
import pandas as pd

from splitkv_tune.gpus import profile_for, resolve_gpu
from splitkv_tune.plot import _save, fmt_count, out_base
from splitkv_tune.table_schema import TableError, _read_csv

OURS, ONE_SPLIT, FLOOR = "ours", "ours_one_split", "copy_floor"
NUMERIC = ["batch", "min_len", "max_len", "mean_len", "page_size", "q_heads", "kv_heads",
           "head_dim", "median_us", "x_floor"]
REQUIRED = ["label", "dtype", "impl", "status", "reason"] + NUMERIC
# Legend names; a peer not listed here is drawn under its impl name, after these.
RIVALS = {ONE_SPLIT: "ours, one S for the whole batch",
          "flashinfer_decode": "FlashInfer decode",
          "flashinfer_decode_tc": "FlashInfer decode, tensor cores",
          "flashinfer_xqa": "FlashInfer XQA",
          "sdpa_cudnn": "cuDNN SDPA, padded to max_len"}
SHAPE_KEYS = ["dtype", "head_dim", "q_heads", "kv_heads", "page_size"]


def read_batches(path) -> pd.DataFrame:
    """A ``compare-batch`` CSV with its numbers parsed and a ``run`` column (the file name)."""
    frame = _read_csv(path)
    missing = [c for c in REQUIRED if c not in frame.columns]
    if missing:
        raise TableError(path, "not a compare-batch CSV (`compare-batch`): missing columns: "
                               + ", ".join(missing))
    if not len(frame):
        raise TableError(path, "no batches (a header without rows)")
    if not (frame["impl"] == OURS).any():
        raise TableError(path, f"no `{OURS}` rows: nothing to take speed-ups of")
    for col in NUMERIC:
        frame[col] = pd.to_numeric(frame[col], errors="coerce")
    return frame.assign(run=Path(path).name)


def rivals_of(frame: pd.DataFrame) -> list[str]:
    """``ours_one_split`` and the peers present: every impl but ours' variants and the floor."""
    impls = set(frame["impl"])
    peers = sorted(i for i in impls if not i.startswith(OURS) and i != FLOOR)
    known = [r for r in RIVALS if r in impls]
    return known + [p for p in peers if p not in RIVALS]


def _timed(row) -> bool:
    return row is not None and row["status"] == "ok" and row["median_us"] > 0


def _why_missing(ours, rival) -> str:
    """Short reason a slot has no speed-up: the rival's status and the first words of why."""
    if not _timed(ours):
        return f"ours {'not run' if ours is None else ours['status']}"
    if rival is None:
        return "not run"
    if rival["status"] == "ok":
        return "no time"
    reason = textwrap.shorten(str(rival["reason"]), width=48, placeholder="…")
    return f"{rival['status']}: {reason}" if reason else str(rival["status"])


def _batches(frame: pd.DataFrame):
    """Each batch's rows as {impl: row}, in file order. A batch is its label and its head shape
    and page size: a sweep-batches CSV times one label under several of them."""
    for _, part in frame.groupby(["run", "label"] + SHAPE_KEYS, sort=False):
        yield {r["impl"]: r for _, r in part.iterrows()}


def batch_ratios(frame: pd.DataFrame) -> pd.DataFrame:
    """One row per (run, label, rival) in file order: ``speedup`` (rival's median / ours; NaN
    when missing), ``missing`` (why, else ""), and ours' ``x_floor``."""
    rivals = rivals_of(frame)
    rows = []
    for by_impl in _batches(frame):
        ours, first = by_impl.get(OURS), next(iter(by_impl.values()))
        for rival in rivals:
            other = by_impl.get(rival)
            ok = _timed(ours) and _timed(other)
            rows.append({"run": first["run"], "label": first["label"], "rival": rival,
                         "speedup": other["median_us"] / ours["median_us"] if ok else np.nan,
                         "missing": "" if ok else _why_missing(ours, other),
                         "x_floor": ours["x_floor"] if _timed(ours) else np.nan})
    return pd.DataFrame(rows)


def gpu_label(path, frame: pd.DataFrame, gpu: str | None) -> str:
    """The file's gpu column, else ``gpu``, else the known GPU of a folder above the file."""
    if "gpu" in frame and frame["gpu"].nunique() == 1:
        return str(frame["gpu"].iloc[0])
    if gpu:
        return resolve_gpu(gpu)
    for folder in Path(path).resolve().parents:
        if profile_for(folder.name) is not None:
            return folder.name
    return "unknown GPU"


def _shapes(frame: pd.DataFrame) -> str:
    """``bf16 D=128 Hq=32 Hkv=8 page 64`` for each distinct head shape of the batches."""
    keys = frame[SHAPE_KEYS].drop_duplicates().itertuples(index=False)
    return "; ".join(f"{d} D={hd:.0f} Hq={hq:.0f} Hkv={hkv:.0f} page {pg:.0f}"
                     for d, hd, hq, hkv, pg in keys)


def _span(lo: float, hi: float) -> str:
    """``1K–64K``, or ``8K`` when every length is the same."""
    return fmt_count(lo) if lo == hi else f"{fmt_count(lo)}–{fmt_count(hi)}"


def _caption(by_impl: dict, runs: int, shapes: int) -> str:
    """Tick label of one batch: its label (and head shape and page when the figure has several),
    lengths, and our time against the copy floor."""
    first, ours = next(iter(by_impl.values())), by_impl.get(OURS)
    lines = [first["label"]] + ([first["run"]] if runs > 1 else [])
    if shapes > 1:
        d, hd, hq, hkv, pg = (first[k] for k in SHAPE_KEYS)
        lines.append(f"{d} D={hd:.0f} Hq={hq:.0f} Hkv={hkv:.0f} page {pg:.0f}")
    lines.append(f"B {first['batch']:.0f}, lengths {_span(first['min_len'], first['max_len'])}"
                 f" (mean {first['mean_len']:.0f})")
    lines.append(f"ours {ours['median_us']:.1f} µs = {ours['x_floor']:.2f}× copy floor"
                 if _timed(ours) else f"ours: {_why_missing(ours, None)}, no time")
    return "\n".join(lines)


def _bar(ax, y: float, value: float, colour) -> None:
    """A bar from the 1.0x line to ``value``, a dot at its end and its value past it."""
    ax.barh(y, value - 1.0, left=1.0, height=0.8, color=colour)
    ax.plot(value, y, marker="o", markersize=5, color=colour)  # a bar near 1x has no width
    ax.text(value * (1.04 if value >= 1 else 0.96), y, f"{value:.2f}×", va="center",
            ha="left" if value >= 1 else "right", fontsize=9)


def _hole(ax, y: float, why: str) -> None:
    """An empty, hatched slot with why it is empty."""
    ax.axhspan(y - 0.4, y + 0.4, facecolor="none", edgecolor="0.75", hatch="//", linewidth=0)
    ax.text(1.04, y, f"n/a ({why})", va="center", ha="left", fontsize=9, color="0.25",
            bbox={"facecolor": "white", "edgecolor": "none", "pad": 1})


def draw(frame: pd.DataFrame, ratios: pd.DataFrame, title: str):
    """Grouped horizontal bars: one group per batch, one slot per rival."""
    rivals = list(dict.fromkeys(ratios["rival"]))
    colours = {r: f"C{i % 10}" for i, r in enumerate(rivals)}
    k = len(rivals)
    groups = len(ratios) // k
    # constrained: keeps the legend above the axes clear of the title at any height
    fig, ax = plt.subplots(figsize=(12, 2.0 + 0.32 * (k + 1) * groups), layout="constrained")
    for i, r in enumerate(ratios.itertuples()):
        y = (i // k) * (k + 1) + i % k
        if r.missing:
            _hole(ax, y, r.missing)
        else:
            _bar(ax, y, r.speedup, colours[r.rival])
    ax.axvline(1.0, color="black", linewidth=1)
    ax.set_xscale("log", base=2)
    shown = list(ratios["speedup"].dropna())  # room for the values written past the bars
    ax.set_xlim(min([0.5] + [v / 1.3 for v in shown]), max([2.0] + [v * 1.5 for v in shown]))
    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}×"))
    runs, shapes = frame["run"].nunique(), len(frame[SHAPE_KEYS].drop_duplicates())
    ax.set_yticks([g * (k + 1) + (k - 1) / 2 for g in range(groups)],
                  [_caption(by_impl, runs, shapes) for by_impl in _batches(frame)], fontsize=9)
    ax.set_ylim(groups * (k + 1) - 1, -1)
    ax.set_xlabel("speed-up of ours = rival's median time / ours (×, log2 axis; right of 1× "
                  "ours is faster)")
    handles = [matplotlib.patches.Patch(color=colours[r], label=f"{RIVALS.get(r, r)} ({r})")
               for r in rivals]
    handles.append(matplotlib.patches.Patch(facecolor="none", edgecolor="0.6", hatch="//",
                                            label="n/a: skipped, failed or not run"))
    ax.legend(handles=handles, fontsize=9, loc="lower center", bbox_to_anchor=(0.5, 1.0),
              ncol=3, frameon=False)
    fig.suptitle(title, fontsize=11)
    return fig


def plot_batches(paths, out, gpu: str | None = None) -> list[Path]:
    """Write the speed-up figure of the batches of ``paths``; return the files written."""
    frames = [read_batches(p) for p in paths]
    frame = pd.concat(frames, ignore_index=True)
    ratios = batch_ratios(frame)
    if ratios.empty:
        raise TableError(", ".join(map(str, paths)),
                         f"no `{ONE_SPLIT}` or peer rows to compare ours with")
    gpus = ", ".join(sorted({gpu_label(p, f, gpu) for p, f in zip(paths, frames)}))
    runs = ", ".join(Path(p).name for p in paths)
    where = textwrap.fill(f"GPU {gpus}, {'run' if len(paths) == 1 else 'runs'} {runs}; "
                          f"{_shapes(frame)}", width=120)
    title = ("Speed-up of our kernel over one S for the whole batch and over the peers, per "
             "paged batch\n" + where)
    fig = draw(frame, ratios, title)
    return _save(fig, out_base(out, "paged"), "_batches")


def plot_batch_regret(path, out, gpu: str | None = None) -> list[Path]:
    """Grouped bars of each rule's regret per held-out batch, from an ``evaluate-batches
    --out-csv`` file (``batch_evaluation.RULES``); a rule without a time for a batch is "n/a"."""
    from splitkv_tune.batch_evaluation import RULES
    from splitkv_tune.plot import regret_bars
    frame = _read_csv(path)
    needed = ["dtype", "head_dim", "q_heads", "kv_heads", "q_len", "page_size", "lengths"]
    missing = [c for c in needed + [f"{r}_regret" for r in RULES] if c not in frame.columns]
    if missing or not len(frame):
        raise TableError(path, "not an `evaluate-batches --out-csv` file" + (
            f"; missing: {', '.join(missing)}" if missing else ": no rows"))
    labels = [f"{r.dtype} D{r.head_dim} {r.q_heads}/{r.kv_heads} Sq{r.q_len} page {r.page_size} {r.lengths}"
              for r in frame.itertuples()]
    regrets = {rule: pd.to_numeric(frame[f"{rule}_regret"], errors="coerce").to_numpy() for rule in RULES}
    title = (f"Regret per held-out paged batch of the batch selector, the auto knobs and the baseline rules\n"
             f"(GPU {gpu_label(path, frame, gpu)}; {Path(path).name})")
    return _save(regret_bars(labels, regrets, title), out_base(out, "paged"), "_batch_regret")
