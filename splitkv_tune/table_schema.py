"""Schema of the heuristics table (``results/<gpu>/heuristics.csv``): one row per shape.

Version 1 columns, in order:

* ``schema_version`` - this schema's version (``1``).
* ``gpu`` - normalised GPU name (``gpus.normalize_gpu_name``), e.g. ``nvidia_h200``.
* shape: ``dtype`` (fp16|bf16), ``head_dim``, ``causal`` (0|1), ``batch``, ``q_heads``,
  ``kv_heads``, ``q_len``, ``kv_len``.
* winner: ``num_splits``, ``block_kv``, ``reduce_threads``, ``split_policy``,
  ``median_us``, ``p20_us``, ``p80_us``, ``gbps`` (bytes moved / median), ``frac_copy_bw``.
* ``runner_up_num_splits``, ``runner_up_block_kv``, ``runner_up_reduce_threads``,
  ``runner_up_split_policy``, ``runner_up_us`` - the next best config (empty when none).
* ``noise_margin`` - relative noise used to call ties, ``(p80 - p20) / median`` of the winner.
* ``n_trials`` - successful trials behind the row; ``run_id`` - the sweep run that measured the winner.
* ``best_us_kv<b>``, ``best_splits_kv<b>`` for each ``block_kv`` b (32, 64, 128) - the winner
  among the trials at that ``block_kv`` (the same tie rule as the row's winner) and its split count, both empty when the sweep timed none (optional
  columns: tables written before them load, and the selector then knows only the winner's
  ``block_kv``). The interpolation chooses ``block_kv`` and the split count from them.

Tables come from other machines and people, so :func:`read_heuristics` checks every value
before anything else (selector, JSON or C++ export) sees it: integers are plain decimal
integers inside the kernel's ranges (``tunables``), names match ``[A-Za-z0-9_.-]+``, and
any problem raises :class:`TableError` naming the file and the problem.
"""
from __future__ import annotations

import collections
import contextlib
import csv
import json
import math
import re
from pathlib import Path

from splitkv_tune import tunables

SCHEMA_VERSION = 1

SHAPE_COLUMNS = ["dtype", "head_dim", "causal", "batch", "q_heads", "kv_heads", "q_len", "kv_len"]
CONFIG_COLUMNS = ["num_splits", "block_kv", "reduce_threads", "split_policy"]
# The fastest trial at each block_kv: (time column, split-count column) per tunables.BLOCK_KV.
PER_BLOCK_KV_COLUMNS = tuple((f"best_us_kv{b}", f"best_splits_kv{b}") for b in tunables.BLOCK_KV)
HEURISTICS_COLUMNS = (
    ["schema_version", "gpu"] + SHAPE_COLUMNS + CONFIG_COLUMNS
    + ["median_us", "p20_us", "p80_us", "gbps", "frac_copy_bw"]
    + ["runner_up_" + c for c in CONFIG_COLUMNS] + ["runner_up_us"]
    + ["noise_margin", "n_trials", "run_id"]
    + [c for pair in PER_BLOCK_KV_COLUMNS for c in pair]
)
# The trials.csv columns the selector, evaluation and plots read (sweep.py writes more).
TRIALS_REQUIRED_COLUMNS = (SHAPE_COLUMNS + CONFIG_COLUMNS
                           + ["median_us", "p20_us", "p80_us", "n", "status", "reason",
                              "gbps", "frac_copy_bw", "run_id"])
TRIAL_STATUSES = ("ok", "failed", "wrong")

# Largest value of one shape dimension: the C++ lookup takes int64 and must not overflow.
MAX_DIM = 2**31 - 1
NAME_RE = re.compile(r"[A-Za-z0-9_.-]+")
_INT_RE = re.compile(r"[+]?[0-9]+")

_SHAPE_INT = ["head_dim", "batch", "q_heads", "kv_heads", "q_len", "kv_len"]
_CHOICES = {"dtype": tunables.DTYPES, "split_policy": tunables.SPLIT_POLICIES,
            "runner_up_split_policy": tunables.SPLIT_POLICIES}
_INT_CHOICES = {"head_dim": tunables.HEAD_DIMS, "block_kv": tunables.BLOCK_KV,
                "reduce_threads": tunables.REDUCE_THREADS,
                "runner_up_block_kv": tunables.BLOCK_KV,
                "runner_up_reduce_threads": tunables.REDUCE_THREADS}
_INT_RANGES = {"num_splits": (1, tunables.MAX_SPLITS),
               "runner_up_num_splits": (1, tunables.MAX_SPLITS),
               **{splits: (1, tunables.MAX_SPLITS) for _, splits in PER_BLOCK_KV_COLUMNS},
               "schema_version": (0, 2**31), "n_trials": (0, 2**31), "n": (0, 2**31)}
_OPTIONAL = {"p20_us", "p80_us", "gbps", "frac_copy_bw", "noise_margin", "runner_up_us",
             "runner_up_num_splits", "runner_up_block_kv", "runner_up_reduce_threads",
             "runner_up_split_policy", *(c for pair in PER_BLOCK_KV_COLUMNS for c in pair)}
_FLOATS = {"median_us", "p20_us", "p80_us", "gbps", "frac_copy_bw", "noise_margin",
           "runner_up_us", *(us for us, _ in PER_BLOCK_KV_COLUMNS)}


class TableError(Exception):
    """A table that cannot be used; ``str()`` names the file, the row (``row``: its 0-based
    index, when the problem is one row's) and the problem.

    >>> str(TableError("t.csv", "missing columns: gpu"))
    't.csv: missing columns: gpu'
    >>> str(TableError("t.csv", "num_splits must be in [1, 128], got 999", row=2))
    't.csv: row 3 (line 4): num_splits must be in [1, 128], got 999'
    """

    def __init__(self, file, problem: str, row: int | None = None):
        self.file = str(file)
        self.problem = problem
        self.row = row
        where = "" if row is None else f"row {row + 1} (line {row + 2}): "
        super().__init__(f"{self.file}: {where}{problem}")


@contextlib.contextmanager
def rows_named(name_of):
    """Re-raise a :class:`TableError` of one row with the row named ``name_of(row) -> (file,
    name)`` instead of a row and line number: for files that have neither (JSON)."""
    try:
        yield
    except TableError as err:
        if err.row is None:
            raise
        file, name = name_of(err.row)
        raise TableError(file, f"{name}: {err.problem}") from None


def _show(value: str) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _parse_int(col: str, raw: str, choices=_INT_CHOICES, ranges=_INT_RANGES) -> int:
    """A plain decimal integer among ``choices[col]``, in ``ranges[col]`` (default ``[1, MAX_DIM]``)."""
    if not _INT_RE.fullmatch(raw):
        raise ValueError(f"{col} must be an integer, got {_show(raw)}")
    value = int(raw)
    if col in choices and value not in choices[col]:
        raise ValueError(f"{col} must be one of {choices[col]}, got {value}")
    lo, hi = ranges.get(col, (1, MAX_DIM))
    if not lo <= value <= hi:
        raise ValueError(f"{col} must be in [{lo}, {hi}], got {value}")
    return value


MAX_FLOAT = 1e12  # µs, GB/s or a ratio: far above any measurement, and safe to scale to ns


def _parse_float(col: str, raw: str) -> float:
    """A number in ``[0, MAX_FLOAT]``."""
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{col} must be a number, got {_show(raw)}") from None
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{col} must be a finite number >= 0, got {_show(raw)}")
    if value > MAX_FLOAT:
        raise ValueError(f"{col} must be at most {MAX_FLOAT:g}, got {_show(raw)}")
    return value


def _parse_value(col: str, raw: str, optional=frozenset(_OPTIONAL)):
    """One cell, as read from the CSV (a string; empty when missing)."""
    if raw == "" or raw.lower() == "nan":
        if col in optional or col == "reason":
            return None
        raise ValueError(f"{col} is empty or NaN")
    if col in ("gpu", "run_id"):
        if not NAME_RE.fullmatch(raw):
            raise ValueError(f"{col} must match [A-Za-z0-9_.-]+, got {_show(raw)}")
        return raw
    if col in _CHOICES:
        if raw not in _CHOICES[col]:
            raise ValueError(f"{col} must be one of {_CHOICES[col]}, got {_show(raw)}")
        return raw
    if col == "status":
        if raw not in TRIAL_STATUSES:
            raise ValueError(f"status must be one of {TRIAL_STATUSES}, got {_show(raw)}")
        return raw
    if col == "reason":
        return raw
    if col == "causal":
        flag = {"0": 0, "1": 1, "false": 0, "true": 1}.get(raw.lower())
        if flag is None:
            raise ValueError(f"causal must be 0 or 1, got {_show(raw)}")
        return flag
    if col in _FLOATS:
        return _parse_float(col, raw)
    return _parse_int(col, raw)


def _unique_keys(pairs):
    repeated = sorted(k for k, n in collections.Counter(k for k, _ in pairs).items() if n > 1)
    if repeated:
        raise ValueError(f"duplicate keys: {', '.join(repeated[:3])}")
    return dict(pairs)


def _no_constant(name: str):
    raise ValueError(f"{name} is not a number JSON has (the writers never emit it)")


@contextlib.contextmanager
def opening_table(path, kind: str, parse_errors: tuple, unreadable: str):
    """A table file's reading errors as ``TableError`` naming it: no such file, a directory, or
    text that is not ``kind`` (``parse_errors`` and undecodable bytes: ``unreadable (detail)``)."""
    try:
        yield
    except FileNotFoundError:
        raise TableError(path, "no such file") from None
    except IsADirectoryError:
        raise TableError(path, f"is a directory, not a {kind} file") from None
    except (*parse_errors, UnicodeDecodeError) as exc:
        raise TableError(path, f"{unreadable} ({str(exc).strip()[:80]})") from None


def read_json(path, what: str):
    """The JSON document of a table file; ``TableError`` naming the file for a missing file, text
    that is not JSON, nesting too deep to parse, and what JSON parsers let through but the writers
    never emit: a repeated key (the last would win silently), NaN and Infinity. ``what`` names the
    kind of table in the last errors."""
    try:
        with opening_table(path, "JSON", (json.JSONDecodeError,), "not JSON"):
            return json.loads(Path(path).read_text(encoding="utf-8"), object_pairs_hook=_unique_keys,
                              parse_constant=_no_constant)
    except RecursionError:
        raise TableError(path, "not JSON this tool reads (nested too deeply)") from None
    except ValueError as exc:  # _unique_keys, _no_constant
        raise TableError(path, f"not {what}: {exc}") from None


def check_keys(where: str, obj: dict, required, allowed) -> None:
    """``ValueError`` naming the keys of a JSON object that are missing or unknown."""
    missing = [k for k in required if k not in obj]
    unknown = [str(k) for k in obj if k not in allowed]
    if len(unknown) > 5:
        unknown = unknown[:5] + [f"and {len(unknown) - 5} more"]
    if missing or unknown:
        raise ValueError(f"{where}: " + "; ".join(
            part for part in (missing and "missing keys: " + ", ".join(missing),
                              unknown and "unknown keys: " + ", ".join(unknown)) if part))


def check_export_metadata(meta: dict) -> None:
    """What both JSON exports' ``_metadata`` hold alike (schemas/*.schema.json): the device
    names, the device_name among them, the tool and its version; ``ValueError`` naming the key."""
    names = meta["device_names"]
    if not isinstance(names, list) or not names or not all(isinstance(n, str) and NAME_RE.fullmatch(n)
                                                            for n in names):
        raise ValueError(f"_metadata.device_names must be a list of names matching {NAME_RE.pattern}")
    if meta["device_name"] not in names:
        raise ValueError(f"_metadata.device_name must be a name matching {NAME_RE.pattern}, "
                         "the device_name among the device_names")
    if meta["tool"] != "splitkv-tune":
        raise ValueError("_metadata.tool must be 'splitkv-tune'")
    if not isinstance(meta["tool_version"], str) or not NAME_RE.fullmatch(meta["tool_version"]):
        raise ValueError(f"_metadata.tool_version must be a name matching {NAME_RE.pattern}")


def refuse_other_json_table(doc, kind: str) -> None:
    """A JSON table of the other kind than ``kind`` ("heuristics" or "batch"), as its
    ``_metadata`` or its ``classes`` tell: say which it is and what reads it (the CSVs'
    counterpart is ``_refuse_batch_table``)."""
    meta = doc.get("_metadata") if isinstance(doc, dict) else None
    if kind == "batch" and isinstance(meta, dict) and "key_format" in meta:
        raise ValueError("this is a heuristics export (`splitkv-tune export --format json`: one entry per shape), "
                         "not a batch-class table; it is a --table, read by splitkv_tune.export.load_json")
    if kind == "heuristics" and isinstance(doc, dict) and "classes" in doc:
        raise ValueError("this is a batch-class table (`splitkv-tune batch-table`), not a heuristics export; "
                         "it is a --batch-table")


def json_cell(col: str, value, *, optional=frozenset(_OPTIONAL), text=frozenset({*_CHOICES, "gpu", "run_id"}),
              floats=frozenset(_FLOATS)) -> str:
    """A value of a JSON table as the CSV cell it stands for, for the same checks; ``ValueError``
    for the wrong JSON type (a number as text, text as a number, true/false, null where a value
    must be). The column sets default to the heuristics table's (the batch table passes its own).

    >>> json_cell("num_splits", 16), json_cell("p20_us", None)
    ('16', '')
    >>> json_cell("num_splits", "16")
    Traceback (most recent call last):
    ...
    ValueError: num_splits must be an integer, got "16"
    """
    if value is None:
        if col in optional:
            return ""
        raise ValueError(f"{col} is null")
    is_text = col in text
    if isinstance(value, bool) or isinstance(value, str) != is_text or not isinstance(value, (str, int, float)):
        kind = "a string" if is_text else "a number" if col in floats else "an integer"
        raise ValueError(f"{col} must be {kind}, got {json.dumps(value)[:40]}")
    return value if is_text else str(value)  # 16.0 for an integer reads as '16.0', which the cell check refuses


def _validate_records(present, rows, columns: list[str], source,
                      optional=frozenset(_OPTIONAL)) -> list[dict]:
    """Typed records from raw rows (tuples in ``columns`` order) of a table whose header
    holds ``present``; plain Python, so the run-time lookup needs no pandas."""
    missing = [c for c in columns if c not in present]
    if missing:
        raise TableError(source, "missing columns: " + ", ".join(missing))
    records = []
    for i, row in enumerate(rows):
        rec = {}
        for col, raw in zip(columns, row):
            raw = "" if raw is None or (isinstance(raw, float) and math.isnan(raw)) else str(raw)
            try:
                rec[col] = _parse_value(col, raw.strip(), optional)
            except ValueError as exc:
                raise TableError(source, str(exc), row=i) from None
        if rec["q_heads"] % rec["kv_heads"]:
            raise TableError(source, f"q_heads ({rec['q_heads']}) is not a multiple of kv_heads ({rec['kv_heads']})",
                             row=i)
        spread = [rec.get(c) for c in ("p20_us", "median_us", "p80_us")]
        if None not in spread and not spread[0] <= spread[1] <= spread[2]:
            raise TableError(source, "p20_us <= median_us <= p80_us does not hold "
                                     f"({spread[0]!r}, {spread[1]!r}, {spread[2]!r})", row=i)
        records.append(rec)
    if not records:
        raise TableError(source, "empty table (no rows)")
    return records


def _validate_rows(df, columns: list[str], source, optional=frozenset(_OPTIONAL)):
    import pandas as pd
    if len(df) == 0 and all(c in df.columns for c in columns):
        raise TableError(source, "empty table (no rows)")
    # Missing cells as None: pandas' NA of nullable columns (Int64, string) is no empty string.
    frame = df[[c for c in columns if c in df.columns]].astype(object)
    frame = frame.where(frame.notna(), None)
    for col in frame.columns:  # an integer column that pandas made float for its NaN: 16.0 is 16
        values = frame[col].tolist()
        if col not in _FLOATS and any(isinstance(v, float) for v in values):
            frame[col] = pd.Series([int(v) if isinstance(v, float) and v.is_integer() else v for v in values],
                                   index=frame.index, dtype=object)
    rows = frame.itertuples(index=False, name=None)
    return records_frame(_validate_records(set(df.columns), rows, columns, source, optional), columns)


def records_frame(records: list[dict], columns: list[str]):
    """Validated records as a DataFrame in which an integer column with empty cells stays
    integer (pandas' nullable Int64, not float), so that the frame validates and writes again."""
    import pandas as pd
    out = pd.DataFrame.from_records(records, columns=columns)
    for col in columns:
        values = [r[col] for r in records if not missing_cell(r[col])]
        if len(values) < len(records) and values and all(isinstance(v, int) and not isinstance(v, bool)
                                                         for v in values):
            out[col] = out[col].astype("Int64")
    return out


def missing_cell(value) -> bool:
    """An empty cell: ``None`` in plain records; NaN or pandas' NA in a validated frame's."""
    return value is None or type(value).__name__ == "NAType" or (isinstance(value, float) and math.isnan(value))


def _check_heuristics_records(records: list[dict], source) -> None:
    """Schema version, duplicate shapes and the per-block_kv pairs, the checks a heuristics
    table adds to its cells."""
    versions = sorted(set(r["schema_version"] for r in records))
    if versions != [SCHEMA_VERSION]:
        raise TableError(source, f"schema_version is {', '.join(map(str, versions))}, "
                                 f"this tool reads version {SCHEMA_VERSION}")
    seen = set()
    for i, r in enumerate(records):
        key = tuple(r[c] for c in ["gpu"] + SHAPE_COLUMNS)
        if key in seen:
            raise TableError(source, "duplicate shape (same GPU and shape as an earlier row)", row=i)
        seen.add(key)
        # Times are divided by: the noise margin, the ratios, the interpolation's votes.
        for us in ("median_us", "runner_up_us", *(us for us, _ in PER_BLOCK_KV_COLUMNS)):
            if not missing_cell(r.get(us)) and r[us] <= 0:
                raise TableError(source, f"{us} must be > 0, got {r[us]}", row=i)
        for us, splits in PER_BLOCK_KV_COLUMNS:
            if missing_cell(r.get(us)) != missing_cell(r.get(splits)):
                raise TableError(source, f"{us} and {splits} go together (both empty, or both given)", row=i)
        given = [b for b, (us, _) in zip(tunables.BLOCK_KV, PER_BLOCK_KV_COLUMNS) if not missing_cell(r.get(us))]
        if given and r["block_kv"] not in given:
            raise TableError(source, f"best_us_kv{r['block_kv']} is empty, but the "
                                     f"row's winner ran block_kv {r['block_kv']} (the per-block_kv columns give "
                                     "the winner at every block_kv timed)", row=i)


def _refuse_batch_table(columns, source) -> None:
    """A batch-class table (schema v2 or v3) is not a v1 shape table: say so, and what reads it."""
    if "len_max" in columns and "kv_len" not in columns:
        raise TableError(source, "this is a batch-class table (schema v3, from `splitkv-tune batch-table`), "
                                 "not a v1 shape table: read it with splitkv_tune.batch_table.read_batch_table")


def validate_heuristics(df, source="<table>"):
    """Check a raw heuristics table; return it typed, with only the schema's columns.

    Raises :class:`TableError` (file + problem) on missing columns, a wrong schema
    version, NaN or empty required cells, unknown dtype/head_dim, values outside the
    kernel's ranges, non-integers, names not matching ``[A-Za-z0-9_.-]+``, duplicate
    shapes and empty tables.

    >>> import pandas as pd
    >>> row = dict(schema_version=1, gpu="nvidia_h200", dtype="bf16", head_dim=128, causal=0,
    ...            batch=1, q_heads=32, kv_heads=8, q_len=1, kv_len=4096, num_splits=16,
    ...            block_kv=64, reduce_threads=128, split_policy="blocks", median_us=9.5,
    ...            n_trials=40, run_id="r1")
    >>> validate_heuristics(pd.DataFrame([row]))["num_splits"].tolist()
    [16]
    >>> def problem(**change):
    ...     try:
    ...         validate_heuristics(pd.DataFrame([{**row, **change}]))
    ...     except TableError as exc:
    ...         return str(exc)
    >>> print(problem(gpu='x";system("rm -rf /");//'))
    <table>: row 1 (line 2): gpu must match [A-Za-z0-9_.-]+, got 'x";system("rm -rf /");//'
    >>> problem(schema_version=2)
    '<table>: schema_version is 2, this tool reads version 1'
    >>> problem(num_splits=1.5)
    "<table>: row 1 (line 2): num_splits must be an integer, got '1.5'"
    """
    _refuse_batch_table(df.columns, source)
    df = df.copy()
    for col in _OPTIONAL:
        if col not in df.columns:
            df[col] = None
    out = _validate_rows(df, HEURISTICS_COLUMNS, source)
    _check_heuristics_records(out.to_dict("records"), source)
    return out


def _read_csv(path):
    import pandas as pd
    path = Path(path)
    try:
        return pd.read_csv(path, dtype=str, keep_default_na=False, skipinitialspace=True)
    except FileNotFoundError:
        raise TableError(path, "no such file") from None
    except pd.errors.EmptyDataError:
        raise TableError(path, "empty file (no header, no rows)") from None
    except (pd.errors.ParserError, UnicodeDecodeError) as exc:
        raise TableError(path, f"not a readable CSV ({str(exc).strip()[:80]})") from None


def read_heuristics(path, gpu: str | None = None):
    """Read and validate ``heuristics.csv``; with ``gpu``, keep that GPU's rows only.

    A ``gpu`` with no rows in the table is an error naming the GPUs the table has.
    """
    df = validate_heuristics(_read_csv(path), path)
    return df if gpu is None else keep_gpu(df, gpu, path)


def keep_gpu(df, gpu: str, source):
    """The rows of ``df`` (a heuristics or trials frame) for ``gpu``, under any of its names;
    an error naming the GPUs ``df`` has when there are none."""
    from splitkv_tune.gpus import resolve_gpu
    keep = df["gpu"].map(resolve_gpu) == resolve_gpu(gpu)
    if not keep.any():
        have = ", ".join(sorted(set(df["gpu"])))
        raise TableError(source, f"unknown GPU {gpu!r} for this table (it has rows for: {have})")
    return df[keep].reset_index(drop=True)


def validate_trials(df, source="<trials>"):
    """Check a raw ``trials.csv`` (one row per measured config) like :func:`validate_heuristics`.

    ``median_us``/``p20_us``/``p80_us``/``gbps``/``frac_copy_bw`` may be empty for failed trials.
    A ``gpu`` column is kept (validated) when present; other extra columns are dropped.
    """
    df = df.copy()
    for col in ("reason", "gbps", "frac_copy_bw", "n"):
        if col not in df.columns:
            df[col] = "" if col != "n" else "0"
    columns = TRIALS_REQUIRED_COLUMNS + (["gpu"] if "gpu" in df.columns else [])
    out = _validate_rows(df, columns, source, frozenset(_OPTIONAL | {"median_us"}))
    bad = (out["status"] == "ok") & ~(out["median_us"] > 0)
    if bad.any():
        i = int(bad.to_numpy().nonzero()[0][0])
        raise TableError(source, f"status ok but median_us is {out['median_us'].iloc[i]} (a timed trial takes "
                                 "some time)", row=i)
    return out


def with_gpu(df, gpu: str | None, source):
    """Validated trials (or heuristics) for ``gpu``: of rows that name several GPUs, that GPU's
    only (they must not be tabled as one GPU's); otherwise all of them, as the caller's ``gpu``
    names them (one GPU's rows, or rows without a ``gpu`` column)."""
    if gpu is None or "gpu" not in df.columns:
        return df
    labels = df["gpu"].fillna("")
    if labels[labels != ""].nunique() <= 1:
        return df
    if (labels == "").any():
        raise TableError(source, "trials of several GPUs mixed with trials that name no GPU: "
                                 "pass the files of one GPU")
    return keep_gpu(df, gpu, source)


def read_trials(path):
    """Read and validate ``trials.csv``."""
    return validate_trials(_read_csv(path), path)


def read_heuristics_records(path) -> list[dict]:
    """:func:`read_heuristics` without pandas: the validated rows as plain dicts (the run-time
    lookup's reader; same checks, same errors)."""
    path = Path(path)
    try:
        with open(path, newline="", encoding="utf-8") as f:
            reader = csv.reader(f, skipinitialspace=True)
            header = next(reader, None)
            if header is None:
                raise TableError(path, "empty file (no header, no rows)")
            _refuse_batch_table(header, path)
            where = {c: i for i, c in enumerate(header)}
            columns = [c for c in HEURISTICS_COLUMNS if c in where or c not in _OPTIONAL]
            rows = [tuple(r[where[c]] if c in where and where[c] < len(r) else ""
                          for c in columns) for r in reader if r]
    except FileNotFoundError:
        raise TableError(path, "no such file") from None
    except (csv.Error, UnicodeDecodeError) as exc:
        raise TableError(path, f"not a readable CSV ({str(exc).strip()[:80]})") from None
    records = _validate_records(set(header), rows, columns, path)
    for rec in records:
        for col in HEURISTICS_COLUMNS:
            rec.setdefault(col, None)
    _check_heuristics_records(records, path)
    return records
