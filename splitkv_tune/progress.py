"""One progress view of a whole sweep, read from its storage: trials done, failed and running
per worker, and an ETA from the rate so far."""
from __future__ import annotations

import math
import time

import optuna

from splitkv_tune import estimate, records


def snapshot(storage, plan) -> dict:
    """Counts per worker and in total over the plan's studies."""
    names = {plan.study_name(shape) for shape in plan.shapes}
    per_worker: dict[str, dict[str, int]] = {}
    done = 0
    for summary in optuna.get_all_study_summaries(storage, include_best_trial=False):
        if summary.study_name not in names:
            continue
        study = optuna.load_study(study_name=summary.study_name, storage=storage)
        for trial in study.get_trials(deepcopy=False):
            if trial.state == optuna.trial.TrialState.RUNNING:
                owner = trial.user_attrs.get(records.OWNER_ATTR) or {}
                key = owner.get("worker") or f"{owner.get('host', '?')}:{owner.get('pid', '?')}"
                per_worker.setdefault(key, {"done": 0, "failed": 0, "running": 0})
                per_worker[key]["running"] += 1
        # Each config once, as trials.csv holds it: a config measured again (its first trial
        # wrongly judged stale) is not progress.
        for trial in records.measured_trials(study).values():
            record = trial.user_attrs[records.RECORD_ATTR]
            counts = per_worker.setdefault(record.get("worker") or "?",
                                           {"done": 0, "failed": 0, "running": 0})
            counts["done"] += 1
            counts["failed"] += record.get("status") != "ok"
            done += 1
    planned = sum(plan.shape_target(shape) for shape in plan.shapes)
    return {"per_worker": per_worker, "done": done, "planned": planned}


class Pacer:
    """Runs ``action`` when it is due: ``every_s`` after the last run ended, or ``time_factor``
    times the last run's own time when that is longer. An action that reads every trial of a
    storage (a snapshot, a rebuild of trials.csv) grows with it; paced so, it keeps to about
    1 / time_factor of the time however large the storage gets."""

    def __init__(self, action, every_s: float, time_factor: float, *, first_at_once: bool = False):
        self.action, self.every_s, self.time_factor = action, every_s, time_factor
        self.last = -math.inf if first_at_once else time.monotonic()
        self.took = 0.0

    def __call__(self, force: bool = False) -> None:
        began = time.monotonic()
        if force or began - self.last >= max(self.every_s, self.time_factor * self.took):
            self.action()
            self.last = time.monotonic()
            self.took = self.last - began


# A snapshot reads every trial of the plan's studies (about half a second at 10,000).
SNAPSHOT_TIME_FACTOR = 10.0


class ProgressView:
    """Prints the snapshot every ``every_s`` seconds, paced by its own cost (``Pacer``,
    ``SNAPSHOT_TIME_FACTOR``), and when asked to (``force``, at the end)."""

    def __init__(self, storage, plan, echo, every_s: float = 5.0):
        self.storage, self.plan, self.echo = storage, plan, echo
        self.start = time.monotonic()
        self.first_done = None
        self._print = Pacer(lambda: self.echo(self.line(snapshot(self.storage, self.plan))), every_s,
                            SNAPSHOT_TIME_FACTOR, first_at_once=True)

    def line(self, snap: dict) -> str:
        elapsed = time.monotonic() - self.start
        if self.first_done is None:
            self.first_done = snap["done"]
        new = snap["done"] - self.first_done
        left = max(0, snap["planned"] - snap["done"])
        eta = "?" if new <= 0 else estimate.human_seconds(elapsed / new * left)
        workers = "  ".join(f"{name}: {c['done']} done, {c['failed']} failed, "
                            f"{c['running']} running"
                            for name, c in sorted(snap["per_worker"].items()))
        return (f"[{estimate.human_seconds(elapsed)}] {snap['done']}/{snap['planned']} trials, "
                f"ETA {eta}  |  {workers}")

    def __call__(self, force: bool = False) -> None:
        self._print(force)
