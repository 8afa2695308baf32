"""``splitkv-tune diff A B``: what changed between two tuning runs (a driver update, a new
kernel), per shape, against each run's own noise.

A and B are each a ``heuristics.csv`` or a ``trials.csv`` (a trials file is reduced to its
heuristics table first, with the sweep's tie rule). For every shape in both:

* ``winner_changed`` - the winning config (``num_splits``, ``block_kv``, ``reduce_threads``,
  ``split_policy``) differs;
* ``ratio`` - B's best time over A's (best = the faster of the winner and the runner-up:
  the tie rule may pick a winner up to its noise margin slower than the fastest config);
* ``margin`` - the larger of the two runs' noise margins (``noise_margin``, the tie rule's
  ``(p80 - p20) / median``), and at least ``min_margin``;
* ``verdict`` - ``regression`` when ``ratio > 1 + margin``, ``improvement`` when
  ``ratio < 1 - margin``, else ``same``;
* ``a_winner_regret_in_b`` - when B is a trials file that timed A's winner on the shape
  successfully: that config's time in B's trials over B's own winner's, less 1 (what keeping A's
  table costs on B's system, e.g. after a driver update; 0 where the winner is the same, and
  negative where B's tie rule kept a winner slower than A's within its noise); else None;
* ``a_winner_failed_in_b`` - B timed A's winner on the shape and every such trial failed or
  gave a wrong result.

Shapes in one run only are listed as ``only_in_a`` / ``only_in_b``. :func:`diff_tables`
returns the report; the command exits 1 when any shape regressed or A's winner failed in B
(for CI), 0 otherwise.
"""
from __future__ import annotations

import json
import math
import sys

import click

from splitkv_tune.cli_errors import number_not_nan
from splitkv_tune.table_schema import CONFIG_COLUMNS, SHAPE_COLUMNS, TableError, keep_gpu, with_gpu

DEFAULT_MIN_MARGIN = 0.01
VERDICTS = ("regression", "improvement", "same")


def read_run(path, gpu: str | None = None):
    """A heuristics table (DataFrame) from a heuristics.csv or a trials.csv, and the trials (of
    every status) it was reduced from (None for a heuristics.csv)."""
    from splitkv_tune.table_schema import _read_csv, validate_heuristics, validate_trials
    raw = _read_csv(path)
    if "status" in raw.columns:
        from splitkv_tune.evaluation import _ok_trials, heuristics_from_trials
        trials = with_gpu(validate_trials(raw, path), gpu, path)
        gpus = sorted(set(trials["gpu"])) if "gpu" in trials.columns else []
        name = gpu or (gpus[0] if len(gpus) == 1 else None)
        if name is None:
            raise TableError(path, "trials of several GPUs or none named; pass --gpu")
        ok = _ok_trials(trials)
        if not len(ok):
            raise TableError(path, "no successful trials")
        return heuristics_from_trials(ok, name), trials
    table = validate_heuristics(raw, path)
    if gpu is not None:
        table = keep_gpu(table, gpu, path)
    elif len(set(table["gpu"])) > 1:
        raise TableError(path, "rows for several GPUs; pass --gpu")
    return table, None


def _best_us(row) -> float:
    times = [float(row["median_us"])]
    runner = row.get("runner_up_us")
    if runner is not None and runner == runner:
        times.append(float(runner))
    return min(times)


def _margin(row) -> float:
    m = row.get("noise_margin")
    if m is not None and m == m:
        return float(m)
    p20, p80 = row.get("p20_us"), row.get("p80_us")
    if p20 is not None and p80 is not None and p20 == p20 and p80 == p80:
        return (float(p80) - float(p20)) / float(row["median_us"])
    return 0.0


def _config(row) -> dict:
    return {c: (row[c] if c == "split_policy" else int(row[c])) for c in CONFIG_COLUMNS}


def _shape(row) -> dict:
    return {c: (row[c] if c == "dtype" else int(row[c])) for c in SHAPE_COLUMNS}


def _trial_times(trials) -> dict:
    """Per (shape, config) (their columns' values): the fastest successful trial's time, or
    ``math.inf`` where every trial of that config failed or was wrong."""
    from splitkv_tune.evaluation import _ok_trials
    times = {(tuple(_shape(r).values()), tuple(_config(r).values())): math.inf
             for r in trials.to_dict("records")}
    for r in _ok_trials(trials).to_dict("records"):
        key = (tuple(_shape(r).values()), tuple(_config(r).values()))
        times[key] = min(times[key], float(r["median_us"]))
    return times


def diff_tables(a, b, min_margin: float = DEFAULT_MIN_MARGIN, trials_b=None) -> dict:
    """Compare two heuristics tables (DataFrames); see the module docstring for the fields.
    ``trials_b``: B's trials, when B is a trials file (for ``a_winner_regret_in_b`` and
    ``a_winner_failed_in_b``).

    Returns ``{"shapes": [...], "only_in_a": [...], "only_in_b": [...], "summary": {...}}``.
    """
    if not (min_margin >= 0 and math.isfinite(min_margin)):
        raise ValueError(f"min_margin must be a finite number >= 0, got {min_margin}")
    from splitkv_tune.evaluation import summarize
    rows_a = {tuple(_shape(r).values()): r for r in a.to_dict("records")}
    rows_b = {tuple(_shape(r).values()): r for r in b.to_dict("records")}
    timed_b = _trial_times(trials_b) if trials_b is not None else {}
    shapes = []
    for key in sorted(set(rows_a) & set(rows_b)):
        ra, rb = rows_a[key], rows_b[key]
        best_a, best_b = _best_us(ra), _best_us(rb)
        ratio = best_b / best_a
        margin = max(_margin(ra), _margin(rb), min_margin)
        verdict = ("regression" if ratio > 1 + margin else
                   "improvement" if ratio < 1 - margin else "same")
        a_in_b = timed_b.get((key, tuple(_config(ra).values())))
        b_in_b = timed_b.get((key, tuple(_config(rb).values())), math.inf)
        timed = a_in_b is not None and math.isfinite(a_in_b) and math.isfinite(b_in_b)
        shapes.append({**_shape(ra), "winner_a": _config(ra), "winner_b": _config(rb),
                       "winner_changed": _config(ra) != _config(rb), "best_us_a": best_a,
                       "best_us_b": best_b, "ratio": ratio, "margin": margin, "verdict": verdict,
                       "a_winner_regret_in_b": a_in_b / b_in_b - 1 if timed else None,
                       "a_winner_failed_in_b": a_in_b == math.inf})
    only = {side: [_shape(rows[k]) for k in sorted(set(rows) - set(other))]
            for side, rows, other in (("only_in_a", rows_a, rows_b), ("only_in_b", rows_b, rows_a))}
    ratios = [s["ratio"] for s in shapes]
    summary = {v: sum(s["verdict"] == v for s in shapes) for v in VERDICTS}
    kept = summarize(s["a_winner_regret_in_b"] for s in shapes if s["a_winner_regret_in_b"] is not None)
    summary.update(compared=len(shapes), winners_changed=sum(s["winner_changed"] for s in shapes),
                   geomean_ratio=(math.exp(sum(map(math.log, ratios)) / len(ratios))
                                  if ratios else None),
                   a_winners_timed_in_b=kept["n"],
                   a_winner_regret_in_b_geomean=kept["geomean"] if kept["n"] else None,
                   a_winner_regret_in_b_max=kept["max"] if kept["n"] else None,
                   a_winners_failed_in_b=sum(s["a_winner_failed_in_b"] for s in shapes))
    return {"shapes": shapes, **only, "summary": summary}


def _cfg_text(c: dict) -> str:
    return f"S={c['num_splits']} kv{c['block_kv']} r{c['reduce_threads']} {c['split_policy']}"


def to_text(report: dict, name_a: str, name_b: str) -> str:
    """The report as a fixed-width table and a summary line."""
    lines = [f"A: {name_a}", f"B: {name_b}", "",
             f"{'shape':<44} {'winner A':<26} {'winner B':<26} {'B/A':>7} {'noise':>6} {'A in B':>7}  verdict"]
    for s in report["shapes"]:
        shape = (f"{s['dtype']} D{s['head_dim']} c{s['causal']} B{s['batch']} Hq{s['q_heads']} "
                 f"Hkv{s['kv_heads']} Sq{s['q_len']} Sk{s['kv_len']}")
        changed = "" if not s["winner_changed"] else " *"
        regret = s["a_winner_regret_in_b"]
        a_in_b = ("failed" if s["a_winner_failed_in_b"] else "-" if regret is None
                  else f"{regret * 100:+.1f}%")
        lines.append(f"{shape:<44} {_cfg_text(s['winner_a']):<26} "
                     f"{_cfg_text(s['winner_b']) + changed:<26} {s['ratio']:>7.3f} "
                     f"{s['margin'] * 100:>5.1f}% {a_in_b:>7}  {s['verdict']}")
    for side in ("only_in_a", "only_in_b"):
        for shape in report[side]:
            lines.append(f"{side.replace('_', ' ')}: " + " ".join(f"{k}={v}" for k, v in shape.items()))
    m = report["summary"]
    gm = "n/a" if m["geomean_ratio"] is None else f"{m['geomean_ratio']:.3f}"
    lines += ["", f"{m['compared']} shapes compared: {m['regression']} regressions, "
                  f"{m['improvement']} improvements, {m['same']} within noise; "
                  f"{m['winners_changed']} winners changed (*); geometric-mean B/A {gm}"]
    if m["a_winners_timed_in_b"]:
        lines.append(f"A's winners timed in B ('A in B': their time in B's trials over B's own winner's, "
                     f"less 1), {m['a_winners_timed_in_b']} shapes: geometric mean "
                     f"{m['a_winner_regret_in_b_geomean'] * 100:+.2f}%, max "
                     f"{m['a_winner_regret_in_b_max'] * 100:+.2f}%")
    if m["a_winners_failed_in_b"]:
        lines.append(f"A's winner failed or was wrong in B on {m['a_winners_failed_in_b']} shapes ('failed')")
    return "\n".join(lines) + "\n"


@click.command("diff")
@click.argument("run_a", metavar="A", type=click.Path(dir_okay=False))
@click.argument("run_b", metavar="B", type=click.Path(dir_okay=False))
@click.option("--gpu", default=None, help="GPU of trials files without a gpu column, or the "
                                          "rows to compare in multi-GPU tables")
@click.option("--min-margin", type=click.FloatRange(min=0, max=math.inf, max_open=True), default=DEFAULT_MIN_MARGIN,
              show_default=True, callback=number_not_nan,
              help="smallest relative noise margin (the runs' own margins are used when larger)")
@click.option("--json", "as_json", is_flag=True, help="print the report as JSON")
def diff_command(run_a, run_b, gpu, min_margin, as_json):
    """Compare two heuristics or trials files per shape: winners changed, B/A time ratios
    against the runs' noise and, when B is a trials file, A's winners timed in B. Exit 1 when a
    shape got slower beyond the noise or A's winner failed in B (for CI)."""
    try:
        (table_a, _), (table_b, trials_b) = read_run(run_a, gpu), read_run(run_b, gpu)
        report = diff_tables(table_a, table_b, min_margin, trials_b)
    except TableError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(2)
    if as_json:
        click.echo(json.dumps({"a": str(run_a), "b": str(run_b), **report}, indent=1,
                              default=_json_value))
    else:
        click.echo(to_text(report, run_a, run_b), nl=False)
    sys.exit(1 if report["summary"]["regression"] or report["summary"]["a_winners_failed_in_b"] else 0)


def _json_value(value):
    # numpy scalars (from the tables' columns) as plain numbers
    if hasattr(value, "item"):
        return value.item()
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")
