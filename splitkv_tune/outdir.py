"""A sweep's output directory: whose results are in it, and what a kill left behind.

A sweep rewrites ``trials.csv`` and ``heuristics.csv`` from its storage. Before the first
write it checks that the files already there came from that same storage: every row of
``trials.csv`` is one of the storage's measurements and every ``run_id`` of ``heuristics.csv``
one of its runs. Anything else (a shipped table, another storage's sweep, a file that does not
parse) is results it did not write, and it is not overwritten without ``--force``.
"""
from __future__ import annotations

import time
from pathlib import Path

import pandas as pd

from splitkv_tune.table_schema import TableError, read_heuristics

STALE_TMP_S = 60.0  # an atomic write's temporary file lives milliseconds; older is a kill's
OWN_FILES = ("trials.csv", "heuristics.csv")


class ForeignResults(Exception):
    """The output directory holds results this sweep's storage did not produce."""


def _raw(path: Path) -> pd.DataFrame | None:
    try:
        return pd.read_csv(path, dtype=str, keep_default_na=False)
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError, ValueError):
        return None


def foreign_problem(out_dir: Path, stored: pd.DataFrame) -> str | None:
    """Why the results in ``out_dir`` are not the storage's (``stored``: its trials frame)."""
    keys = {(str(s), str(t)) for s, t in zip(stored["study"], stored["trial"])}
    run_ids = set(stored["run_id"].astype(str))
    trials_path, heuristics_path = out_dir / OWN_FILES[0], out_dir / OWN_FILES[1]
    if trials_path.is_file():
        raw = _raw(trials_path)
        if raw is None or not {"study", "trial"} <= set(raw.columns):
            return f"{trials_path} is not a trials.csv of this tool"
        extra = [k for k in zip(raw["study"], raw["trial"]) if k not in keys]
        if extra:
            return (f"{trials_path} has {len(extra)} of {len(raw)} rows that are not in the "
                    f"storage (e.g. study {extra[0][0]!r}, trial {extra[0][1]})")
    if heuristics_path.is_file():
        raw = _raw(heuristics_path)
        if raw is None or "run_id" not in raw.columns:
            return f"{heuristics_path} is not a heuristics.csv of this tool"
        extra = sorted(set(raw["run_id"]) - run_ids)
        if extra:
            return f"{heuristics_path} has winners of runs not in the storage (e.g. {extra[0]!r})"
    return None


def check_not_foreign(out_dir: Path, stored: pd.DataFrame, storage_name: str) -> None:
    problem = foreign_problem(Path(out_dir), stored)
    if problem:
        raise ForeignResults(f"{problem}; a sweep with storage {storage_name} did not write "
                             f"them. Pass --force to overwrite them, or choose another --out; if "
                             f"the storage that wrote them is lost, `splitkv-tune restore-storage "
                             f"{out_dir} --storage {storage_name}` rebuilds it from trials.csv")


def current_winners(out_dir: Path, force: bool = False) -> pd.DataFrame | None:
    """The validated ``heuristics.csv`` of ``out_dir`` (its winners are tried first), if any.

    A bad one is a TableError, unless ``force`` (it is overwritten then)."""
    path = Path(out_dir) / OWN_FILES[1]
    if not path.is_file():
        return None
    raw = _raw(path)
    if raw is not None and not len(raw) and "run_id" in raw.columns:
        return None  # a sweep's table before its first winner
    try:
        return read_heuristics(path)
    except TableError:
        if force:
            return None
        raise


def remove_stale_temporaries(out_dir: Path) -> list[Path]:
    """Delete the temporary files of atomic writes that a kill left in ``out_dir``."""
    now = time.time()
    removed = []
    for folder in (Path(out_dir), Path(out_dir) / "runs"):
        if not folder.is_dir():
            continue
        for tmp in folder.glob(".*.tmp"):
            try:
                if now - tmp.stat().st_mtime > STALE_TMP_S:
                    tmp.unlink()
                    removed.append(tmp)
            except FileNotFoundError:
                continue
    return removed
