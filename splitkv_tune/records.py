"""How a sweep's trials are stored in Optuna, and which of them count as measurements.

* A trial's results are one user attr, ``record`` (a dict of every ``trials.csv`` field), set in
  one storage write and then told. A measurement is a finished trial whose state agrees with
  its record: COMPLETE with ``status == "ok"``, or FAIL with ``failed``/``wrong``. A kill (or
  Ctrl-C) between the write and the tell leaves a RUNNING trial that recovery tells FAIL; an
  ``ok`` record on a FAIL trial is therefore a half-recorded one, and its config is measured
  again. A kill during the write leaves no record at all.
* Each trial names its owner (host, process id and the process's start time) in the user attr
  ``owner``, with the config it measures, as soon as that is known. A RUNNING trial is stale,
  and told FAIL, only when its owner is a process of this host that no longer runs (or it never
  got an owner within ``UNCLAIMED_S``); a running trial of another live sweep is left alone.
  On an RDB storage, Optuna's heartbeat also fails trials of any host that stopped beating.
* ``trials.csv`` is rebuilt from the storage, never appended to, so it always matches it, with
  the first measurement of each config only. Two workers do not both measure one config (each
  steps back from a config another live trial claims, after naming itself its owner), but a
  trial wrongly judged stale could be measured again, and that second measurement counts once.
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime as _dt
import os
import platform
import threading
import warnings
from pathlib import Path

import optuna
import pandas as pd

from splitkv_tune import table
from splitkv_tune.table_schema import SHAPE_COLUMNS
from splitkv_tune.tunables import Config

RECORD_ATTR = "record"
RECORD_SCHEMA = 1  # study user attr ``record_schema``: how this version stores trials
OWNER_ATTR = "owner"
DUPLICATE_ATTR = "duplicate_of"
UNCLAIMED_S = 60.0
INT_COLUMNS = ["trial", "head_dim", "causal", "batch", "q_heads", "kv_heads", "q_len", "kv_len",
               "num_splits", "block_kv", "reduce_threads", "workspace_bytes", "n", "input_sets"]
FLOAT_COLUMNS = ["median_us", "p20_us", "p80_us", "iqr_us", "gbps", "frac_copy_bw", "copy_bw_gbps",
                 "max_abs_err"]
_STATE_OF_STATUS = {"ok": optuna.trial.TrialState.COMPLETE,
                    "failed": optuna.trial.TrialState.FAIL, "wrong": optuna.trial.TrialState.FAIL}
_RUNNING = optuna.trial.TrialState.RUNNING
_ACTIVE_TRIAL_IDS: set[int] = set()  # trials this process is measuring right now


def _proc_stat(pid: int) -> list[str] | None:
    """Fields of ``/proc/<pid>/stat`` after the command name, where /proc has them."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def _process_start(pid: int) -> str | None:
    """The kernel's start time of ``pid`` (tells a reused pid apart)."""
    fields = _proc_stat(pid)
    return fields[19] if fields else None


def this_process() -> dict:
    pid = os.getpid()
    return {"host": platform.node(), "pid": pid, "pid_start": _process_start(pid)}


def default_provenance(backend: str, worker: str | None = None) -> dict:
    """Who measured a trial: the worker's name, its host and the device it ran on."""
    host = platform.node()
    if backend == "reference":
        device = "cpu"
    else:
        device = "cuda:" + os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
    return {"worker": worker or f"{host}:{os.getpid()}", "host": host, "device": device}


@contextlib.contextmanager
def heartbeat(storage, trial: optuna.Trial):
    """Beat for ``trial`` while the block runs, where the storage has Optuna's heartbeat (RDB
    with ``heartbeat_interval``): another worker's ``fail_stale_trials`` then fails it only
    when this process stops beating, on whatever host it runs."""
    interval = getattr(storage, "get_heartbeat_interval", lambda: None)()
    if not interval:
        yield
        return
    stop = threading.Event()

    def beat():
        while True:
            storage.record_heartbeat(trial._trial_id)
            if stop.wait(interval):
                return

    thread = threading.Thread(target=beat, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def claim(trial: optuna.Trial, config: Config, worker: str | None = None) -> int | None:
    """Record this process (and its worker name, which the progress view counts running trials
    under) as the owner of ``trial``, which measures ``config``; return the number of another
    live trial that claims ``config`` too, if any, in which case this one must not measure it.

    The rival is any other live claim, not only a lower-numbered one: trial numbers are given
    when a trial is asked for (or enqueued), not when it is claimed, so a lower number can claim
    later. Each claim is written before the claims are read, so of two claims of one config the
    later-written one sees the earlier: at most one of them measures (both may step back)."""
    _ACTIVE_TRIAL_IDS.add(trial._trial_id)
    named = {"worker": worker} if worker else {}
    trial.set_user_attr(OWNER_ATTR, {**this_process(), **dataclasses.asdict(config), **named})
    return min((number for claimed, number in _live_claims(trial.study)
                if claimed == config and number != trial.number), default=None)


def release(trial: optuna.Trial) -> None:
    _ACTIVE_TRIAL_IDS.discard(trial._trial_id)


def _process_alive(owner: dict, trial_id: int) -> bool:
    if owner == {**owner, **this_process()}:  # this process: alive only if still measuring it
        return trial_id in _ACTIVE_TRIAL_IDS
    pid = owner.get("pid")
    if not isinstance(pid, int):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    fields = _proc_stat(pid)
    if fields and fields[0] == "Z":  # exited, not yet reaped by its parent
        return False
    return owner.get("pid_start") in (None, _process_start(pid))


def config_of(trial: optuna.trial.FrozenTrial) -> Config | None:
    attrs = trial.user_attrs.get(RECORD_ATTR) or trial.user_attrs.get(OWNER_ATTR) or {}
    if "num_splits" not in attrs:
        return None
    return Config(int(attrs["num_splits"]), int(attrs["block_kv"]),
                  int(attrs["reduce_threads"]), str(attrs["split_policy"]))


def schema_problem(study: optuna.Study) -> str | None:
    """Why this version cannot continue ``study`` (written by another version), else None."""
    found = study.user_attrs.get("record_schema")
    if found is None and not study.get_trials(deepcopy=False):
        return None
    if found != RECORD_SCHEMA:
        return (f"study {study.study_name!r} was written by another version of splitkv-tune "
                f"(record schema {found!r}, this version reads {RECORD_SCHEMA}); use a new "
                f"--storage or --study-prefix")
    return None


def is_measurement(trial: optuna.trial.FrozenTrial) -> bool:
    record = trial.user_attrs.get(RECORD_ATTR)
    return (isinstance(record, dict) and DUPLICATE_ATTR not in trial.user_attrs
            and _STATE_OF_STATUS.get(record.get("status")) == trial.state)


def measured_trials(study: optuna.Study) -> dict[Config, optuna.trial.FrozenTrial]:
    """Finished measurements of a study, by config (the first one of each)."""
    done = {}
    for trial in study.get_trials(deepcopy=False):
        if is_measurement(trial):
            done.setdefault(config_of(trial), trial)
    return done


def is_stale(trial: optuna.trial.FrozenTrial) -> bool:
    """A RUNNING trial whose process is gone (see the module docstring)."""
    owner = trial.user_attrs.get(OWNER_ATTR)
    if not isinstance(owner, dict):
        now = _dt.datetime.now()
        started = trial.datetime_start or now
        return (now - started).total_seconds() > UNCLAIMED_S
    return owner.get("host") == platform.node() and not _process_alive(owner, trial._trial_id)


def _running_trials(study: optuna.Study) -> list[optuna.trial.FrozenTrial]:
    return study.get_trials(deepcopy=False, states=(_RUNNING,))


def _live_claims(study: optuna.Study):
    """``(config, trial number)`` of each live trial that has named its config."""
    for trial in _running_trials(study):
        config = config_of(trial)
        if config is not None and not is_stale(trial):
            yield config, trial.number


def running_configs(study: optuna.Study) -> dict[Config, int]:
    """Configs that live trials are measuring now, with the lowest such trial number."""
    running = {}
    for config, number in _live_claims(study):
        running.setdefault(config, number)
    return running


def recover_interrupted(study: optuna.Study) -> int:
    """Tell FAIL every stale RUNNING trial; return how many."""
    from optuna.storages import fail_stale_trials

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        fail_stale_trials(study)  # Optuna's heartbeat, where the storage has one
    stale = [t for t in _running_trials(study) if is_stale(t)]
    for trial in stale:
        study.tell(trial.number, state=optuna.trial.TrialState.FAIL, skip_if_finished=True)
    return len(stale)


def trial_rows(study: optuna.Study) -> list[dict]:
    """trials.csv rows of one study."""
    shape = study.user_attrs.get("shape")
    rows = []
    if shape is None:
        return rows
    seen = set()
    for trial in study.get_trials(deepcopy=False):
        if not is_measurement(trial) or config_of(trial) in seen:
            continue  # a config measured again (a trial wrongly judged stale) counts once
        seen.add(config_of(trial))
        record = trial.user_attrs[RECORD_ATTR]
        row = {"gpu": study.user_attrs.get("gpu"), "study": study.study_name,
               "trial": trial.number, "backend": study.user_attrs.get("backend")}
        row.update({c: shape[c] for c in SHAPE_COLUMNS})
        row["causal"] = int(bool(row["causal"]))
        row.update({c: record.get(c) for c in table.TRIALS_COLUMNS if c not in row})
        rows.append(row)
    return rows


def trials_frame(storage, gpu: str | None = None) -> pd.DataFrame:
    """Every measurement of the storage's studies for ``gpu`` (all when ``None``), whatever
    their study prefix; integer columns stay integers when some cells are empty."""
    rows = []
    for summary in optuna.get_all_study_summaries(storage, include_best_trial=False):
        if gpu is None or summary.user_attrs.get("gpu") == gpu:
            study = optuna.load_study(study_name=summary.study_name, storage=storage)
            rows.extend(trial_rows(study))
    frame = pd.DataFrame(rows, columns=table.TRIALS_COLUMNS)
    for col in INT_COLUMNS:
        frame[col] = pd.to_numeric(frame[col]).astype("Int64")
    return frame.sort_values(["study", "trial"], kind="stable").reset_index(drop=True)


def rebuild_trials_csv(storage, path: Path, gpu: str | None = None) -> pd.DataFrame:
    """Write :func:`trials_frame` to ``path`` atomically and return it."""
    frame = trials_frame(storage, gpu)
    table.atomic_write_csv(path, frame)
    return frame
