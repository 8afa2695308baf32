"""Regret of the batch selector on held-out batches (``splitkv-tune evaluate-batches``).

A held-out grid (a ``sweep-batches`` grid whose batches the table was not built from, e.g.
``configs/batches_holdout.yaml``) is timed as ``sweep-batches`` times it, every point of its
space, with each rule's knobs added as plan rows (``with_rule_plans``):

* ``selector`` - ``batch_select.select_live_knobs`` on the batch table (its model beyond the
  table's classes when the launch's CTAs per SM are given);
* ``auto`` - the paged call's ``"auto"`` knobs (``live.resolve_knobs``: the ``ours`` row);
* ``fa2``, ``fa3``, ``sglang`` - the other projects' rules on the batch as our plan's knobs
  (``baselines.live_baseline_plans``).

The oracle of a batch is its fastest row of our live path (``batch_table.CANDIDATE_IMPL``: the
space, the rules' rows, ``ours`` and ``ours_one_split`` when present); a rule's regret is
``time(rule's knobs) / oracle - 1``. The rows are matched by
their knob columns (``block_kv``, ``min_blocks_per_split``, ``max_splits``, ``merge``: what the
merge is when a sequence splits), so a rule whose knobs equal a point of the space or ``ours``
reads that row. The summary over batches is the
geometric mean of ``1 + regret`` minus one and the largest regret, per rule.
"""
from __future__ import annotations

import dataclasses
import math

from splitkv_tune import baselines, batch_select, batches, live, plan_points, tunables
from splitkv_tune.batch_sweep import KEY_COLUMNS, Batch, BatchGrid
from splitkv_tune.batch_table import CANDIDATE_IMPL
from splitkv_tune.tunables import Shape

RULES = ("selector", "auto", "fa2", "fa3", "sglang")
PLAN_KNOBS = ("block_kv", "min_blocks_per_split", "max_splits", "merge", "split_plan")


def _merge(batch: Batch, merge: str) -> str:
    """The merge a launch of the batch uses when a sequence splits (a row's ``merge`` column)."""
    h = batch.head
    shape = Shape(h["dtype"], h["head_dim"], len(batch.lengths), h["q_heads"], h["kv_heads"], h["q_len"],
                  max(1, max(batch.lengths)))
    return tunables.split_merge(shape, merge)


def _residency(ctas_per_sm, batch: Batch) -> int | None:
    """``ctas_per_sm`` of the selector for this batch: an int, None, or a function of the batch."""
    return ctas_per_sm(batch) if callable(ctas_per_sm) else ctas_per_sm


def rule_knobs(batch: Batch, table, num_sms: int, ctas_per_sm=None) -> dict[str, tuple[int, int, int, str, str]]:
    """``{rule: (block_kv, min_blocks_per_split, max_splits, merge, split_plan)}`` of every rule in
    ``RULES`` on this batch (``table``: batch-table records of one GPU; ``merge`` as the rows
    record it; every rule but the selector's table uses the fixed split plan).
    The selector and ``auto`` see the batch as the call does, empty slots included; the other
    projects' rules see its live sequences (they plan from the lengths, and an empty slot has
    none) and merge as our call does by default. ``ctas_per_sm``: the selector's (None: no model),
    or a function of the batch that gives it."""
    h = batch.head
    chosen = batch_select.select_live_knobs(table, **h, page_size=batch.page_size, lengths=batch.lengths,
                                            num_sms=num_sms, ctas_per_sm=_residency(ctas_per_sm, batch))
    auto = live.resolve_knobs(len(batch.lengths), h["head_dim"], h["kv_heads"],
                              batch_select.packed_rows(h["q_heads"], h["kv_heads"], h["q_len"]), num_sms)
    knobs = {"selector": (chosen.block_kv, chosen.min_blocks_per_split, chosen.max_splits,
                          _merge(batch, chosen.merge), chosen.split_plan),
             "auto": (*auto, _merge(batch, "auto"), "fixed")}
    live_lengths = [n for n in batch.lengths if n > 0] or [1]
    for name, (min_blocks, max_splits, block_kv) in baselines.live_baseline_plans(h, live_lengths, num_sms).items():
        knobs[name] = (block_kv, min_blocks, max_splits, _merge(batch, "auto"), "fixed")
    return knobs


def with_rule_plans(grid: BatchGrid, table, num_sms: int, ctas_per_sm=None) -> BatchGrid:
    """The grid with each batch's rule knobs (but ``auto``, the ``ours`` row) added to its plan
    rows where the space lacks them; a rule's merge is named only where it is not the call's
    default. ``ctas_per_sm``: the selector's, as ``rule_knobs`` takes it."""
    out = []
    for batch in grid.batches:
        plans = list(batch.plans)
        default_merge = _merge(batch, "auto")
        for rule, (block_kv, min_blocks, max_splits, merge, split_plan) in rule_knobs(batch, table, num_sms, ctas_per_sm).items():
            point = plan_points.plan_point(min_blocks, max_splits, block_kv,
                                           "auto" if merge == default_merge else merge, split_plan)
            if rule != "auto" and point not in plans:
                plans.append(point)
        out.append(dataclasses.replace(batch, plans=tuple(plans)))
    return dataclasses.replace(grid, batches=tuple(out))


def _int(cell) -> int | None:
    try:
        return int(cell)
    except (TypeError, ValueError):
        return None


def _timed_knobs(rows: list[dict]) -> dict[tuple, float]:
    """The fastest median per knob point (``PLAN_KNOBS``) among a batch's ok rows of our live path."""
    times: dict[tuple, float] = {}
    for row in rows:
        if row["status"] != "ok" or not CANDIDATE_IMPL.fullmatch(row["impl"]):
            continue
        knobs = (*(_int(row[c]) for c in PLAN_KNOBS[:3]), row["merge"] or None, row["split_plan"] or None)
        median = float(row["median_us"])
        if None in knobs or not math.isfinite(median):
            continue
        times[knobs] = min(median, times.get(knobs, math.inf))
    return times


def regret_records(grid: BatchGrid, rows: list[dict], table, num_sms: int, ctas_per_sm=None) -> list[dict]:
    """One record per batch of the grid: the oracle's time and knobs, and per rule its knobs, time
    and regret (None when the CSV has no row at those knobs, e.g. a batch not yet timed).
    ``ctas_per_sm``: the selector's, as ``rule_knobs`` takes it."""
    by_batch: dict[tuple, list[dict]] = {}
    for row in rows:
        by_batch.setdefault(tuple(row[c] for c in KEY_COLUMNS), []).append(row)
    records = []
    for batch in grid.batches:
        s = batches.describe(batch.lengths)
        h = batch.head
        rec = {**h, "page_size": batch.page_size, "lengths": batch.label, "batch": s["batch"], "len_max": s["max"],
               "len_mean": s["total"] // s["batch"]}
        times = _timed_knobs(by_batch.get(batch.key(), []))
        oracle = min(times, key=times.get) if times else None
        rec["oracle_us"] = times[oracle] if oracle else None
        rec["oracle_knobs"] = "/".join(map(str, oracle)) if oracle else ""
        for rule, knobs in rule_knobs(batch, table, num_sms, ctas_per_sm).items():
            t = times.get(knobs)
            rec[f"{rule}_knobs"] = "/".join(map(str, knobs))
            rec[f"{rule}_us"] = t
            rec[f"{rule}_regret"] = None if t is None else t / rec["oracle_us"] - 1
        records.append(rec)
    return records


def last_run_rows(csv_paths) -> list[dict]:
    """The rows of sweep CSVs (``batch_sweep.read_rows``), each tagged with its run
    (``batch_table.tag_run``); a batch timed in several CSVs keeps the last one's rows only, as
    ``batch_table.build_batch_table`` takes a class's rows from one run."""
    from splitkv_tune.batch_sweep import read_rows
    from splitkv_tune.batch_table import tag_run
    rows, later = [], set()
    for path in reversed(csv_paths):
        mine = tag_run(read_rows(path), path)
        rows = [r for r in mine if tuple(r[c] for c in KEY_COLUMNS) not in later] + rows
        later |= {tuple(r[c] for c in KEY_COLUMNS) for r in mine}
    return rows


def leave_one_out_records(grid: BatchGrid, rows: list[dict], gpu: str, num_sms: int, ctas_per_sm=None) -> list[dict]:
    """``regret_records`` with each batch of the grid held out in turn: the selector reads a table
    built (``batch_table.build_batch_table``) from the rows of every other batch, less those of
    the same lengths and heads at another page size (a near twin would flatter the selector),
    and each rule is timed by the held-out batch's own rows. ``rows``: sweep CSV rows
    (``batch_sweep.read_rows``) of the grid's batches, with ``batch_table.RUN_KEY`` set when they
    come from several runs. Batches without timed rows, or whose table would be empty, are left
    out. No GPU: sweep-batches timed the rows. ``ctas_per_sm``: the selector's, as ``rule_knobs``
    takes it."""
    from splitkv_tune.batch_table import build_batch_table
    from splitkv_tune.table_schema import TableError
    twin = [c for c in KEY_COLUMNS if c != "page_size"]
    records = []
    for batch in grid.batches:
        key = dict(zip(KEY_COLUMNS, batch.key()))
        if not any(all(r[c] == key[c] for c in KEY_COLUMNS) for r in rows):
            continue  # the batch was not timed
        train = [r for r in rows if any(r[c] != key[c] for c in twin)]
        try:
            table = build_batch_table(train, gpu)
        except TableError:
            continue
        one = dataclasses.replace(grid, batches=(batch,))
        records += [r for r in regret_records(one, rows, table, num_sms, ctas_per_sm) if r["oracle_us"] is not None]
    return records


def summarize(records: list[dict]) -> dict[str, dict]:
    """Per rule, ``evaluation.summarize`` of its regrets over the records it has a time for:
    ``{"geomean": ..., "max": ..., "n": ...}`` (NaN without any)."""
    from splitkv_tune.evaluation import summarize as summarize_regrets
    return {rule: summarize_regrets([r[f"{rule}_regret"] for r in records if r[f"{rule}_regret"] is not None])
            for rule in RULES}


def _pct(x) -> str:
    return "n/a" if x is None or x != x else f"{x:.1%}"


def markdown_report(records: list[dict], title: str) -> str:
    """The summary per rule, then one line per batch (knobs as
    block_kv/min_blocks/max_splits/merge/split_plan)."""
    summary = summarize(records)
    lines = [f"# {title}", "", "| rule | geometric-mean regret | max regret | batches |", "|---|---|---|---|"]
    lines += [f"| {rule} | {_pct(s['geomean'])} | {_pct(s['max'])} | {s['n']} |" for rule, s in summary.items()]
    lines += ["", "| heads | page | lengths | B | max | mean | oracle µs (knobs) | "
              + " | ".join(RULES) + " |", "|" + "---|" * (7 + len(RULES))]
    for r in records:
        heads = f"{r['dtype']} D{r['head_dim']} {r['q_heads']}/{r['kv_heads']} Sq{r['q_len']}"
        oracle = "not timed" if r["oracle_us"] is None else f"{r['oracle_us']:.1f} ({r['oracle_knobs']})"
        cells = [f"{_pct(r[f'{rule}_regret'])} ({r[f'{rule}_knobs']})" for rule in RULES]
        lines.append(f"| {heads} | {r['page_size']} | {r['lengths']} | {r['batch']} | {r['len_max']} | "
                     f"{r['len_mean']} | {oracle} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
