"""Schema v3, the batch-class table: the paged call's knobs per GPU and batch class, from
``compare-batch`` CSVs (the source of truth; this table is derived from them).

Columns, in order (``BATCH_TABLE_COLUMNS``):

* ``schema_version`` - ``3``; ``gpu`` - the GPU that measured the row (``gpus.resolve_gpu``:
  the normalised name, its profile's key when one matches, e.g. ``nvidia_h200``).
* the class: ``dtype``, ``head_dim``, ``q_heads``, ``kv_heads``, ``q_len``, ``page_size``,
  ``batch``, ``len_max`` and ``len_mean`` (the batch's live keys // ``batch``).
* ``lengths`` - the ``compare-batch --lengths`` label the winner was measured on (it must parse
  with ``batches.parse_lengths`` and give the class's batch, ``len_max`` and ``len_mean``).
* the winner's knobs ``block_kv``, ``min_blocks_per_split``, ``max_splits``, ``merge``,
  ``split_plan`` (``plan.SPLIT_PLANS``: ``fixed``, or ``load_aware``, whose launches choose
  ``min_blocks_per_split`` among its multiples from the live lengths) and its ``median_us``,
  ``p20_us``, ``p80_us``.
* ``runner_up_block_kv`` ... ``runner_up_split_plan``, ``runner_up_us`` - the fastest row with
  other knobs (all empty when none).
* ``noise_margin`` - the margin that called ties; ``n_trials`` - the class's candidate rows;
  ``source`` - the CSV file the winner came from (compare-batch has no run id).

Choosing the winner (``build_batch_table``): the candidates are the rows that time the paged
call as a server makes it (``CANDIDATE_IMPL``: ``ours``, ``ours_one_split``, ``ours_load_aware``
and the ``--plan`` rows; ``ours_wide<N>`` and ``ours_contiguous`` measure the layout at
``ours``' knobs), with status ok and their knob columns filled. The noise margin is that of
``table.pick_winner``: ``(p80 - p20) / median`` of the fastest, at least
``table.MIN_NOISE_MARGIN``; every candidate within it of the fastest ties, and among ties the
fixed split plan wins (a sequence's bits then do not depend on the other lengths), then the
smallest ``max_splits`` (the smaller workspace), then ``block_kv`` 64 (the default, built at
every head dim), then the fewest ``min_blocks_per_split`` (the finer split), then the lower
median.

A class timed in several CSVs (a grid swept again with more knobs, say) takes its candidates
from the last CSV that has it (the ``source`` of the rows, in the order given): times of
different runs are not compared with each other.

Older files: a v2 table (no split plan columns) reads as ``split_plan`` ``fixed``; a
compare-batch CSV written before the ``split_plan`` column reads the same way (its load-aware
rows have no knob columns and are no candidates).

The reader checks every cell as ``table_schema`` checks a v1 table (plain decimal integers in
the kernel's ranges, finite numbers, names in ``NAME_RE``, labels in ``LABEL_RE``, no NaN) and
raises ``table_schema.TableError`` naming the file and the problem. It imports no pandas, so a
server can read the table when it captures its graphs.
"""
from __future__ import annotations

import csv
import io
import re
from pathlib import Path

from splitkv_tune import batches, live, plan, tunables
from splitkv_tune.gpus import resolve_gpu
from splitkv_tune.table_schema import MAX_DIM, NAME_RE, TableError, _parse_float, _parse_int, _show, opening_table

BATCH_SCHEMA_VERSION = 3
# Versions the reader takes: v2 had no split plan (every row "fixed").
READ_SCHEMA_VERSIONS = (2, 3)
CLASS_COLUMNS = ["dtype", "head_dim", "q_heads", "kv_heads", "q_len", "page_size", "batch", "len_max",
                 "len_mean"]
KNOB_COLUMNS = ["block_kv", "min_blocks_per_split", "max_splits", "merge", "split_plan"]
RUNNER_UP_COLUMNS = ["runner_up_" + c for c in KNOB_COLUMNS] + ["runner_up_us"]
SPLIT_PLAN_COLUMNS = ["split_plan", "runner_up_split_plan"]  # new in v3
BATCH_TABLE_COLUMNS = (["schema_version", "gpu"] + CLASS_COLUMNS + ["lengths"] + KNOB_COLUMNS
                       + ["median_us", "p20_us", "p80_us"] + RUNNER_UP_COLUMNS
                       + ["noise_margin", "n_trials", "source"])
# A --lengths label: a list with repeats or a named distribution (batches.parse_lengths).
LABEL_RE = re.compile(r"[A-Za-z0-9_.:,-]+")
CANDIDATE_IMPL = re.compile(
    r"ours|ours_one_split|ours_load_aware|ours(_kv[0-9]+)?_m[0-9]+_s[0-9]+(_fused|_kernel)?(_load_aware)?")
# The compare-batch columns the builder reads.
COMPARE_COLUMNS = ["label", "batch", "max_len", "total_len", "page_size", "q_heads", "kv_heads", "head_dim",
                   "q_len", "dtype", "impl", "status", "median_us", "p20_us", "p80_us"] + KNOB_COLUMNS

_INT_CHOICES = {"head_dim": tunables.HEAD_DIMS, "page_size": plan.PAGE_SIZES, "block_kv": tunables.BLOCK_KV,
                "runner_up_block_kv": tunables.BLOCK_KV}
_INT_RANGES = {"schema_version": (0, MAX_DIM), "len_max": (1, batches.MAX_LENGTH),
               "len_mean": (1, batches.MAX_LENGTH), "batch": (1, batches.MAX_BATCH),
               "max_splits": (1, tunables.MAX_SPLITS), "runner_up_max_splits": (1, tunables.MAX_SPLITS)}
_CHOICES = {"dtype": tunables.DTYPES, "merge": tunables.MERGES, "runner_up_merge": tunables.MERGES,
            "split_plan": plan.SPLIT_PLANS, "runner_up_split_plan": plan.SPLIT_PLANS}
# What a file written before the split plan existed holds in its place.
LEGACY_SPLIT_PLAN = "fixed"
# The key of a compare-batch row naming the file it was read from (not a table column).
RUN_KEY = "_run"
_FLOATS = {"median_us", "p20_us", "p80_us", "runner_up_us", "noise_margin"}
_NAMES = {"gpu": NAME_RE, "source": NAME_RE, "lengths": LABEL_RE}


def _cell(col: str, raw: str):
    """One cell of a batch table (or of the compare-batch columns it is built from), typed."""
    if raw == "" or raw.lower() == "nan":
        if col in RUNNER_UP_COLUMNS:
            return None
        raise ValueError(f"{col} is empty or NaN")
    if col in _NAMES and not _NAMES[col].fullmatch(raw):
        raise ValueError(f"{col} must match {_NAMES[col].pattern}, got {_show(raw)}")
    if col in _CHOICES and raw not in _CHOICES[col]:
        raise ValueError(f"{col} must be one of {_CHOICES[col]}, got {_show(raw)}")
    if col in _NAMES or col in _CHOICES:
        return raw
    if col in _FLOATS:
        value = _parse_float(col, raw)
        if value == 0 and col.endswith("_us"):  # times are divided by: the noise margin, the ratios
            raise ValueError(f"{col} must be > 0, got {_show(raw)}")
        return value
    return _parse_int(col, raw, _INT_CHOICES, _INT_RANGES)


def _check_record(rec: dict) -> None:
    """What one row's cells must agree on; ``ValueError`` naming the columns."""
    if rec["q_heads"] % rec["kv_heads"]:
        raise ValueError(f"q_heads ({rec['q_heads']}) is not a multiple of kv_heads ({rec['kv_heads']})")
    for prefix in ("", "runner_up_"):  # the kernel's ranges: block_kv by head dim, the knob by block_kv
        if rec.get(prefix + "block_kv") is not None:
            try:
                tunables.check_block_kv_at(rec[prefix + "block_kv"], rec["head_dim"])
                plan.check_plan_knobs(rec[prefix + "block_kv"], rec[prefix + "min_blocks_per_split"],
                                      rec[prefix + "max_splits"])
            except ValueError as exc:
                raise ValueError(f"{prefix}{exc}") from None
    if rec["len_mean"] > rec["len_max"]:
        raise ValueError(f"len_mean ({rec['len_mean']}) exceeds len_max ({rec['len_max']})")


def _check_lengths(rec: dict) -> None:
    """The label must describe the class it is stored with."""
    lengths = batches.parse_lengths(rec["lengths"])
    got = (len(lengths), max(lengths), sum(lengths) // len(lengths))
    want = (rec["batch"], rec["len_max"], rec["len_mean"])
    if got != want:
        raise ValueError(f"lengths {rec['lengths']!r} give batch, len_max, len_mean {got}, the row says {want}")


def _text(raw: dict, col: str) -> str:
    value = raw.get(col)
    return "" if value is None else str(value).strip()


def _typed_row(raw: dict, columns) -> dict:
    rec = {c: _cell(c, _text(raw, c)) for c in columns}
    runner_up = [rec.get(c) is None for c in RUNNER_UP_COLUMNS]
    if any(runner_up) and not all(runner_up):
        raise ValueError(f"the runner-up columns ({', '.join(RUNNER_UP_COLUMNS)}) must be all filled or all empty")
    return rec


def _refuse_v1(header, source) -> None:
    if "kv_len" in header and "len_max" not in header:
        raise TableError(source, "this is a v1 shape table (heuristics.csv: one row per equal-length shape), "
                                 "not a batch-class table (schema v3); read it with table_schema.read_heuristics. "
                                 "It holds no batch classes to convert: build a batch table from compare-batch "
                                 "CSVs with `splitkv-tune batch-table CSV... --gpu GPU -o FILE`")


def read_csv_rows(path) -> tuple[list[str], list[dict]]:
    """(header, rows as dicts of strings) of a CSV; ``TableError`` when it cannot be read."""
    with opening_table(path, "CSV", (csv.Error,), "not a readable CSV"), open(path, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f, skipinitialspace=True)
        rows = list(reader)
        header = reader.fieldnames
    if header is None:
        raise TableError(path, "empty file (no header, no rows)")
    return header, rows


def validate_batch_records(header, rows, source="<batch table>") -> list[dict]:
    """Typed records of a batch table's raw rows (dicts of strings under ``header``):
    ``TableError`` naming ``source``, the row (``TableError.row``) and the problem (a v1 table,
    missing columns, a wrong schema version, a bad cell, cells that disagree, a duplicate
    class, no rows)."""
    _refuse_v1(header, source)
    legacy = not any(c in header for c in SPLIT_PLAN_COLUMNS)  # v2: every row's plan is fixed
    missing = [c for c in BATCH_TABLE_COLUMNS if c not in header and not (legacy and c in SPLIT_PLAN_COLUMNS)]
    if missing:
        raise TableError(source, "missing columns: " + ", ".join(missing))
    records, seen = [], set()
    for i, raw in enumerate(rows):
        try:
            if legacy:
                raw = {**raw, "split_plan": LEGACY_SPLIT_PLAN,
                       "runner_up_split_plan": LEGACY_SPLIT_PLAN if _text(raw, "runner_up_block_kv") else ""}
            rec = _typed_row(raw, BATCH_TABLE_COLUMNS)
            want = (2,) if legacy else (BATCH_SCHEMA_VERSION,)
            if rec["schema_version"] not in want:
                raise ValueError(f"schema_version is {rec['schema_version']}; a table "
                                 f"{'without' if legacy else 'with'} split_plan columns is version {want[0]} "
                                 f"(this reader reads versions {READ_SCHEMA_VERSIONS})")
            _check_record(rec)
            _check_lengths(rec)
            key = tuple(rec[c] for c in ["gpu"] + CLASS_COLUMNS)
            if key in seen:
                raise ValueError("duplicate class (same GPU and class as an earlier row)")
        except ValueError as exc:
            raise TableError(source, str(exc), row=i) from None
        seen.add(key)
        records.append(rec)
    if not records:
        raise TableError(source, "empty table (no rows)")
    return records


def read_batch_table(path, gpu: str | None = None) -> list[dict]:
    """Read and validate a batch table (plain dicts, no pandas); with ``gpu``, that GPU's rows
    only, and an error naming the GPUs the table has when there are none."""
    return keep_batch_gpu(validate_batch_records(*read_csv_rows(path), source=path), gpu, path)


def keep_batch_gpu(records: list[dict], gpu: str | None, path) -> list[dict]:
    """``gpu``'s records (all with None); ``TableError`` naming the GPUs there are when none."""
    if gpu is None:
        return records
    kept = [r for r in records if resolve_gpu(r["gpu"]) == resolve_gpu(gpu)]
    if not kept:
        have = ", ".join(sorted({r["gpu"] for r in records}))
        raise TableError(path, f"unknown GPU {gpu!r} for this table (it has rows for: {have})")
    return kept


def format_batch_table(records) -> str:
    """CSV text of batch-table records (``None`` written empty)."""
    out = io.StringIO()
    writer = csv.DictWriter(out, BATCH_TABLE_COLUMNS, lineterminator="\n")
    writer.writeheader()
    for rec in records:
        writer.writerow({c: "" if rec.get(c) is None else rec[c] for c in BATCH_TABLE_COLUMNS})
    return out.getvalue()


def write_batch_table(path, records) -> Path:
    """Write the table atomically (``table.atomic_write_text``: imported here, as it brings
    pandas, which the reader and the selector do without)."""
    from splitkv_tune.table import atomic_write_text
    return atomic_write_text(path, format_batch_table(records))


def with_legacy_split_plan(rows: list[dict]) -> list[dict]:
    """compare-batch rows written before the ``split_plan`` column, with it: ``fixed`` where the
    row has knobs, empty where it has none."""
    return [{**row, "split_plan": LEGACY_SPLIT_PLAN if _text(row, "block_kv") else ""} for row in rows]


def read_compare_batch_csv(path) -> list[dict]:
    """A compare-batch CSV's rows (dicts of strings), each with ``source``: the file's name
    (characters outside ``NAME_RE`` as ``_``). ``TableError`` when the knob columns are missing."""
    header, rows = read_csv_rows(path)
    if "split_plan" not in header:  # written before the split plan existed: its knobs are fixed plans
        rows = with_legacy_split_plan(rows)
        header = [*header, "split_plan"]
    missing = [c for c in COMPARE_COLUMNS if c not in header]
    if missing:
        hint = (": written before compare-batch recorded its knobs; rerun compare-batch"
                if set(missing) <= set(KNOB_COLUMNS) else "")
        raise TableError(path, f"not a compare-batch CSV, missing columns: {', '.join(missing)}{hint}")
    return tag_run(rows, path)


def tag_run(rows: list[dict], path) -> list[dict]:
    """The rows of the CSV at ``path`` with its name as ``source`` (characters outside
    ``NAME_RE`` as ``_``) and its resolved path as ``RUN_KEY``: two files of one name are two runs."""
    source = re.sub(r"[^A-Za-z0-9_.-]", "_", Path(path).name)
    run = str(Path(path).resolve())
    return [{**row, "source": source, RUN_KEY: run} for row in rows]


def _candidate(raw: dict) -> dict | None:
    """A compare-batch row as a candidate (typed, in the table's columns), or None when it is
    not one: another implementation, not ok, or without knobs (no SM count where it ran)."""
    if not CANDIDATE_IMPL.fullmatch(_text(raw, "impl")) or _text(raw, "status") != "ok":
        return None
    if any(_text(raw, c).lower() in ("", "nan") for c in KNOB_COLUMNS):
        return None
    renamed = {**raw, "lengths": raw.get("label"), "len_max": raw.get("max_len"), "source": _source(raw)}
    rec = _typed_row(renamed, CLASS_COLUMNS[:-1] + ["lengths"] + KNOB_COLUMNS + ["median_us", "p20_us",
                                                                                 "p80_us", "source"])
    rec["len_mean"] = _cell("total_len", _text(raw, "total_len")) // rec["batch"]
    rec[RUN_KEY] = raw.get(RUN_KEY) or rec["source"]
    _check_record(rec)
    _check_lengths(rec)
    return rec


def _source(raw: dict) -> str:
    return raw.get("source") or "compare_batch"


def _knobs(rec: dict) -> tuple:
    return tuple(rec[c] for c in KNOB_COLUMNS)


def _tie_order(rec: dict) -> tuple:
    return (rec["split_plan"] != "fixed", rec["max_splits"], rec["block_kv"] != live.DEFAULT_BLOCK_KV,
            rec["min_blocks_per_split"], rec["median_us"])


def pick_batch_winner(candidates: list[dict], min_margin: float) -> tuple[dict, dict | None, float]:
    """(winner, runner-up or None, noise margin) of one class's candidates (see the module)."""
    from splitkv_tune.table import noise_margin
    ordered = sorted(candidates, key=lambda r: r["median_us"])
    fastest = ordered[0]
    margin = noise_margin(fastest["median_us"], fastest["p20_us"], fastest["p80_us"], min_margin)
    ties = [r for r in ordered if r["median_us"] <= fastest["median_us"] * (1 + margin)]
    winner = min(ties, key=_tie_order)
    runner_up = next((r for r in ordered if _knobs(r) != _knobs(winner)), None)
    return winner, runner_up, margin


def build_batch_table(rows, gpu: str, min_margin: float | None = None) -> list[dict]:
    """One batch-table record per class of the compare-batch ``rows`` (dicts as
    ``read_compare_batch_csv`` gives them) that has a candidate; ``gpu``: the GPU that measured
    them. ``TableError`` for a candidate with a bad cell, or when no row is a candidate."""
    from splitkv_tune.table import MIN_NOISE_MARGIN
    min_margin = MIN_NOISE_MARGIN if min_margin is None else min_margin
    gpu = resolve_gpu(gpu)
    if not gpu:
        raise ValueError("gpu must name a GPU (letters and digits), got none")
    classes: dict[tuple, list[dict]] = {}
    for raw in rows:
        try:
            rec = _candidate(raw)
        except ValueError as exc:
            raise TableError(_source(raw), f"row of {raw.get('label')!r}, impl {raw.get('impl')!r}: {exc}") from None
        if rec is None:
            continue
        key = tuple(rec[c] for c in CLASS_COLUMNS)
        if classes.get(key) and classes[key][0][RUN_KEY] != rec[RUN_KEY]:
            classes[key] = []  # a later CSV's run of the class replaces the earlier one's
        classes.setdefault(key, []).append(rec)
    if not classes:
        raise TableError(", ".join(sorted({_source(r) for r in rows})) or "compare_batch",
                         "no candidate rows: none of ours, ours_one_split, ours_load_aware or ours_m<MIN>_s<MAX> "
                         "with status ok "
                         "and its knob columns filled (compare-batch fills them on a CUDA device)")
    table = []
    for key in sorted(classes):
        winner, runner_up, margin = pick_batch_winner(classes[key], min_margin)
        rec = {"schema_version": BATCH_SCHEMA_VERSION, "gpu": gpu, **winner}
        for col in KNOB_COLUMNS:
            rec["runner_up_" + col] = None if runner_up is None else runner_up[col]
        rec["runner_up_us"] = None if runner_up is None else runner_up["median_us"]
        rec.update(noise_margin=margin, n_trials=len(classes[key]))
        table.append({c: rec[c] for c in BATCH_TABLE_COLUMNS})
    return table
