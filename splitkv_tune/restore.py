"""A sweep's storage rebuilt from its ``trials.csv``, when the storage itself is gone.

``trials.csv`` is the sweep's source of truth and holds every field of each measurement's
record (``records.py``), so a journal lost with a machine, or one that is git-ignored and did
not travel with the results, can be rebuilt from it. Each study gets back its shape, GPU,
backend and record schema, and each row becomes a finished trial with its record under its own
trial number. The numbers that ``trials.csv`` skips (a second measurement of a config, a trial
that a kill left half recorded) become failed trials with no record, which count as no
measurement. So the rebuilt storage writes the same ``trials.csv`` back, and a sweep with
``--resume`` goes on where the file stops.

It is all or nothing: a journal is written under a temporary name and renamed into place once
the storage gives back every row; on a database, the studies it created are deleted again when
it fails. A storage that already holds one of the studies, or a journal file that exists, is
refused, never merged.

The restored trials carry their records but no sampler parameters: a parameter's choices
(the shape's candidates, from the grid) are not in ``trials.csv``, and Optuna refuses a
parameter whose choices differ from the study's earlier trials'. The sweep reads a trial's
config from its record, so a measured config is still never timed again; only the TPE sampler
of a shape left half done starts its model afresh.
"""
from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path

import optuna
import pandas as pd

from splitkv_tune import records, storage as storage_mod, table
from splitkv_tune.storage import StorageError
from splitkv_tune.table_schema import SHAPE_COLUMNS, TableError, read_trials
from splitkv_tune.tunables import Shape

_STUDY_FIELDS = ("gpu", "backend")
_NOT_RECORDED = {"gpu", "study", "trial", "backend", *SHAPE_COLUMNS}  # study attrs and keys
_GAP_ATTR = "restored_gap"  # a trial number that trials.csv does not hold
# A study's trial numbers past its rows: the sweep's skipped numbers are about as many as its
# rows (the H200's dense part: 3,245 for 4,599 rows); far more is a typo, not a lost trial.
MAX_GAPS_PER_ROW, MAX_GAPS = 20, 1000


def _plain(value):
    """A cell as the JSON value the sweep stored: None for an empty cell, Python numbers."""
    if value is None or value is pd.NA or (isinstance(value, float) and math.isnan(value)):
        return None
    return value.item() if hasattr(value, "item") else value


def _numbers(raw: pd.DataFrame, column: str, path, integer: bool) -> pd.Series:
    """A column of numbers; a cell that is not one is a TableError naming its row."""
    cells = raw[column]
    values = pd.to_numeric(cells.where(cells != "", None), errors="coerce")
    bad = (cells != "") & (values.isna() | (integer & (values % 1 != 0)) | (integer & (values < 0)))
    if bad.any():
        i = int(bad.to_numpy().nonzero()[0][0])
        want = "an integer of 0 or more" if integer else "a number"
        raise TableError(path, f"{column} is {cells.iloc[i]!r}, not {want}", row=i)
    return values.astype("Int64") if integer else values


def read_sweep_trials(path) -> pd.DataFrame:
    """A sweep's ``trials.csv``, validated as ``read_trials`` does and with every column of its
    records (``read_trials`` keeps only the table's), typed as the sweep stored them."""
    validated = read_trials(path)  # the table's columns, range-checked; a TableError names the row
    raw = pd.read_csv(path, dtype=str, keep_default_na=False, skipinitialspace=True)
    missing = [c for c in table.TRIALS_COLUMNS if c not in raw.columns]
    if missing:
        raise TableError(path, f"no {', '.join(missing[:4])} column: not a trials.csv that a sweep "
                               f"wrote (its rows name their study, trial and run)")
    for column in ("study", "trial", "backend"):
        empty = raw[column] == ""
        if empty.any():
            i = int(empty.to_numpy().nonzero()[0][0])
            raise TableError(path, f"{column} is empty", row=i)
    frame = raw[table.TRIALS_COLUMNS].replace("", None)
    for column in validated.columns:
        if column != "reason":
            frame[column] = validated[column].to_numpy()
    for column in records.INT_COLUMNS:
        if column not in validated.columns:
            frame[column] = _numbers(raw, column, path, integer=True)
    for column in records.FLOAT_COLUMNS:
        if column not in validated.columns:
            frame[column] = _numbers(raw, column, path, integer=False)
    return frame


def _check(frame: pd.DataFrame, taken: set[str]) -> list[tuple[str, pd.DataFrame]]:
    """The studies of ``frame``, each with its rows; a StorageError if one cannot be restored."""
    groups = list(frame.groupby("study", sort=True, dropna=False))
    clash = sorted(taken & {name for name, _ in groups})
    if clash:
        raise StorageError(f"the storage already holds study {clash[0]!r} ({len(clash)} of "
                           f"{len(groups)}); restore into an empty storage")
    for name, rows in groups:
        for column in (*SHAPE_COLUMNS, *_STUDY_FIELDS):
            if rows[column].nunique(dropna=False) != 1:
                raise StorageError(f"study {name!r}: its rows disagree on {column}")
        twice = rows["trial"].duplicated()
        if twice.any():
            raise StorageError(f"study {name!r}: trial {int(rows['trial'][twice].iloc[0])} appears twice")
        gaps = int(rows["trial"].max()) + 1 - len(rows)
        if gaps > MAX_GAPS_PER_ROW * len(rows) + MAX_GAPS:
            raise StorageError(f"study {name!r}: trial numbers up to {int(rows['trial'].max())} for "
                               f"{len(rows)} rows; a sweep skips far fewer (a typo in the trial column?)")
    return groups


def _study_trials(rows: pd.DataFrame, record_columns: list[str]) -> list[optuna.trial.FrozenTrial]:
    """The study's trials in number order, with a failed trial for each number the rows skip."""
    by_number = {int(r["trial"]): r for _, r in rows.iterrows()}
    trials = []
    for number in range(max(by_number) + 1):
        row = by_number.get(number)
        if row is None:
            trials.append(optuna.trial.create_trial(state=optuna.trial.TrialState.FAIL,
                                                    user_attrs={_GAP_ATTR: True}))
            continue
        record = {c: _plain(row[c]) for c in record_columns}
        ok = record["status"] == "ok"
        trials.append(optuna.trial.create_trial(
            state=optuna.trial.TrialState.COMPLETE if ok else optuna.trial.TrialState.FAIL,
            value=record["median_us"] if ok else None,
            user_attrs={records.RECORD_ATTR: record}))
    return trials


def _write(frame: pd.DataFrame, groups, storage, created: list[str]) -> dict:
    record_columns = [c for c in frame.columns if c not in _NOT_RECORDED]
    counts = {"studies": 0, "trials": 0, "gaps": 0}
    for name, rows in groups:
        first = rows.iloc[0]
        shape = Shape(**{c: _plain(first[c]) for c in SHAPE_COLUMNS})
        shape = dataclasses.replace(shape, causal=bool(shape.causal))
        study = optuna.create_study(storage=storage, study_name=name, direction="minimize")
        created.append(name)
        for key, value in (("shape", dataclasses.asdict(shape)), ("gpu", _plain(first["gpu"])),
                           ("backend", _plain(first["backend"])),
                           ("record_schema", records.RECORD_SCHEMA)):
            study.set_user_attr(key, value)
        trials = _study_trials(rows, record_columns)
        study.add_trials(trials)
        counts["studies"] += 1
        counts["trials"] += len(rows)
        counts["gaps"] += len(trials) - len(rows)
    back = [(row["study"], row["trial"]) for name in created  # a database may hold other studies
            for row in records.trial_rows(optuna.load_study(study_name=name, storage=storage))]
    if sorted(back) != sorted(zip(frame["study"], frame["trial"].astype(int))):
        raise StorageError(f"the storage gave back {len(back)} of the {len(frame)} rows; nothing was kept")
    return counts


def restore_storage(frame: pd.DataFrame, storage: str | None, out_dir) -> dict:
    """Write the studies of ``frame`` (:func:`read_sweep_trials`) into the storage that
    ``--storage`` names (``<out_dir>/optuna.journal`` when ``None``), all or nothing.

    Returns the counts of studies, trials and filled gaps.
    """
    created: list[str] = []
    if storage_mod.is_rdb_url(storage):
        opened = storage_mod.open_rdb(storage)
        taken = {s.study_name for s in optuna.get_all_study_summaries(opened, include_best_trial=False)}
        groups = _check(frame, taken)
        try:
            return _write(frame, groups, opened, created)
        except BaseException:
            for name in created:
                optuna.delete_study(study_name=name, storage=opened)
            raise
    journal = storage_mod.journal_path(storage, out_dir)
    if journal.exists() and (not journal.is_file() or journal.stat().st_size):
        raise StorageError(f"{journal} exists: restore-storage writes a new journal (move that "
                           f"one away, or name another file with --storage)")
    groups = _check(frame, set())
    partial = journal.with_name(f".{journal.name}.restoring-{os.getpid()}")
    try:
        counts = _write(frame, groups, storage_mod.open_journal(partial), created)
        os.replace(partial, journal)
    finally:
        for leftover in (partial, Path(f"{partial}.lock")):
            leftover.unlink(missing_ok=True)
    return counts
