"""A sweep's storage rebuilt from its ``trials.csv``, when the storage itself is gone.

``trials.csv`` is the sweep's source of truth and holds every field of each measurement's
record (``records.py``), so a journal lost with a machine, or one that is git-ignored and did
not travel with the results, can be rebuilt from it. Each study gets back its shape, GPU,
backend and record schema, and each row becomes a finished trial with its record under its own
trial number. The numbers that ``trials.csv`` skips (a second measurement of a config, a trial
that a kill left half recorded) become failed trials with no record, which count as no
measurement. So the rebuilt storage writes the same ``trials.csv`` back, and a sweep with
``--resume`` goes on where the file stops. A study the storage already has is refused, never
merged.

The restored trials carry their records but no sampler parameters: a parameter's choices
(the shape's candidates, from the grid) are not in ``trials.csv``, and Optuna refuses a
parameter whose choices differ from the study's earlier trials'. The sweep reads a trial's
config from its record, so a measured config is still never timed again; only the TPE sampler
of a shape left half done starts its model afresh.
"""
from __future__ import annotations

import dataclasses
import math

import optuna
import pandas as pd

from splitkv_tune import records, table
from splitkv_tune.storage import StorageError
from splitkv_tune.table_schema import SHAPE_COLUMNS, TableError, read_trials
from splitkv_tune.tunables import Shape

_STUDY_FIELDS = ("gpu", "backend")
_NOT_RECORDED = {"gpu", "study", "trial", "backend", *SHAPE_COLUMNS}  # study attrs and keys
_GAP_ATTR = "restored_gap"  # a trial number that trials.csv does not hold
_FLOAT_COLUMNS = ["median_us", "p20_us", "p80_us", "iqr_us", "gbps", "frac_copy_bw", "copy_bw_gbps",
                  "max_abs_err"]


def _plain(value):
    """A cell as the JSON value the sweep stored: None for an empty cell, Python numbers."""
    if value is None or (isinstance(value, float) and math.isnan(value)) or value is pd.NA:
        return None
    return value.item() if hasattr(value, "item") else value


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


def read_sweep_trials(path) -> pd.DataFrame:
    """A sweep's ``trials.csv``, validated as ``read_trials`` does, with every column of its
    records (``read_trials`` keeps only the table's), typed as the sweep stored them."""
    read_trials(path)  # the range checks; a TableError names the row
    raw = pd.read_csv(path, dtype=str, keep_default_na=False)
    missing = [c for c in table.TRIALS_COLUMNS if c not in raw.columns]
    if missing:
        raise TableError(path, f"no {', '.join(missing[:4])} column: not a trials.csv that a sweep "
                               f"wrote (its rows name their study, trial and run)")
    if not len(raw):
        raise TableError(path, "no rows: there is nothing to restore")
    frame = raw[table.TRIALS_COLUMNS].replace("", None)
    for column in records.INT_COLUMNS:
        frame[column] = pd.to_numeric(frame[column]).astype("Int64")
    for column in _FLOAT_COLUMNS:
        frame[column] = pd.to_numeric(frame[column])
    return frame


def restore_storage(frame: pd.DataFrame, storage) -> dict:
    """Write the studies of ``frame`` (:func:`read_sweep_trials`) into ``storage``.

    Returns the counts of studies, trials and filled gaps. A study that ``storage`` already
    holds, or a study whose rows disagree on their shape, GPU or backend, is a StorageError,
    raised before anything is written.
    """
    taken = {s.study_name for s in optuna.get_all_study_summaries(storage, include_best_trial=False)}
    groups = list(frame.groupby("study", sort=True))
    clash = sorted(taken & {name for name, _ in groups})
    if clash:
        raise StorageError(f"the storage already holds study {clash[0]!r} ({len(clash)} of "
                           f"{len(groups)}); restore into an empty storage")
    for name, rows in groups:
        for column in (*SHAPE_COLUMNS, *_STUDY_FIELDS):
            if rows[column].nunique(dropna=False) != 1:
                raise StorageError(f"study {name!r}: its rows disagree on {column}")
        if rows["trial"].duplicated().any():
            raise StorageError(f"study {name!r}: trial {int(rows['trial'][rows['trial'].duplicated()].iloc[0])} "
                               f"appears twice")
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # no line per study created
    record_columns = [c for c in frame.columns if c not in _NOT_RECORDED]
    counts = {"studies": 0, "trials": 0, "gaps": 0}
    for name, rows in groups:
        first = rows.iloc[0]
        shape = Shape(**{c: _plain(first[c]) for c in SHAPE_COLUMNS})
        shape = dataclasses.replace(shape, causal=bool(shape.causal))
        study = optuna.create_study(storage=storage, study_name=name, direction="minimize")
        for key, value in (("shape", dataclasses.asdict(shape)), ("gpu", _plain(first["gpu"])),
                           ("backend", _plain(first["backend"])),
                           ("record_schema", records.RECORD_SCHEMA)):
            study.set_user_attr(key, value)
        trials = _study_trials(rows, record_columns)
        study.add_trials(trials)
        counts["studies"] += 1
        counts["trials"] += len(rows)
        counts["gaps"] += len(trials) - len(rows)
    return counts
