"""One progress view of a whole sweep, read from its storage: trials done, failed and running
per worker, and an ETA from the rate so far."""
from __future__ import annotations

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


# A snapshot reads every trial of the plan's studies (about half a second at 10,000): on a large
# storage the view waits this many times a snapshot's own time, when that is longer than every_s.
SNAPSHOT_TIME_FACTOR = 10.0


class ProgressView:
    """Prints the snapshot every ``every_s`` seconds, or ``SNAPSHOT_TIME_FACTOR`` times the last
    snapshot's own time when that is longer (and when asked to, at the end)."""

    def __init__(self, storage, plan, echo, every_s: float = 5.0):
        self.storage, self.plan, self.echo, self.every_s = storage, plan, echo, every_s
        self.start = time.monotonic()
        self.first_done = None
        self.last, self.took = 0.0, 0.0

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
        began = time.monotonic()
        if force or began - self.last >= max(self.every_s, SNAPSHOT_TIME_FACTOR * self.took):
            snap = snapshot(self.storage, self.plan)
            self.last = time.monotonic()
            self.took = self.last - began
            self.echo(self.line(snap))
