"""One shape's study: the order its configs are measured in, and each trial's record.

A study measures FlashAttention-2's config, the table's winner and the warm start's configs
first, then the grid in a seeded shuffle (``grid``) or TPE's proposals projected onto the
candidates (``tpe``). Every trial is claimed before it is timed, so two sweeps on one storage
do not time one config twice, and told once with all its fields (``records``).
"""
from __future__ import annotations

import dataclasses
import datetime as _dt
import math
import random
import time
import warnings
from typing import TYPE_CHECKING

import optuna

from splitkv_tune import bench, records, space, termination, tunables
from splitkv_tune import storage as storage_mod
from splitkv_tune.table_schema import CONFIG_COLUMNS
from splitkv_tune.tunables import Config, Shape

if TYPE_CHECKING:
    from splitkv_tune.sweep import SweepPlan

MAX_DUPLICATE_STREAK = 25
# TPE proposals of configs already measured, in a row, after which a study takes its next
# unmeasured candidate in grid order instead: on a shape of few candidates TPE keeps proposing
# the ones it has seen, and the shape would end short of its trial target.
FILL_AFTER_DUPLICATES = 5
# Claims in a row that raced another sweep's claim of the same config, after which a study stops.
# They are not duplicates: a race says nothing of whether the space is spent, so it does not count
# towards MAX_DUPLICATE_STREAK. Each is followed by a back-off, so races end by themselves; this
# bound only keeps a storage whose every claim races from holding a worker for ever.
MAX_RACED_STREAK = 200
# The most a worker waits, at random, after stepping back from a claim that raced another's
# (both may step back; waiting apart, they do not race again).
BACK_OFF_S = 0.2
FATAL_CUDA_MARKERS = ("illegal memory access", "unspecified launch failure",
                      "CUDA error: an illegal", "device-side assert", "misaligned address")


def _back_off() -> None:
    """The wait after stepping back from a claim (BACK_OFF_S)."""
    time.sleep(random.uniform(0.0, BACK_OFF_S))


class SweepAborted(RuntimeError):
    """The sweep cannot go on in this process (e.g. the CUDA context is poisoned)."""


def project(config: Config, candidates: list[Config]) -> Config:
    """The candidate nearest ``config``: same block/reduce sizes, closest log2(S), same policy."""
    if config in candidates:
        return config
    same = [c for c in candidates if (c.block_kv, c.reduce_threads)
            == (config.block_kv, config.reduce_threads)] or candidates
    return min(same, key=lambda c: (abs(math.log2(c.num_splits) - math.log2(config.num_splits)),
                                    c.split_policy != config.split_policy, c.num_splits))


class ShapeRunner:
    """Runs the trials of one shape's study."""

    def __init__(self, plan: SweepPlan, shape: Shape, storage, run_id: str,
                 copy_bw_gbps: float, winner: Config | None, provenance: dict | None = None):
        self.plan, self.shape, self.run_id, self.copy_bw = plan, shape, run_id, copy_bw_gbps
        self.provenance = provenance or records.default_provenance(plan.backend)
        self.storage = storage
        extra = [winner.num_splits] if winner else []
        self.candidates = plan.candidates(shape, extra)
        self.mode = plan.sampler_for(len(self.candidates))
        self.target = plan.trial_target(len(self.candidates))
        sampler = (optuna.samplers.TPESampler(seed=plan.seed, constant_liar=True)
                   if self.mode == "tpe" else optuna.samplers.RandomSampler(seed=plan.seed))
        self.study = optuna.create_study(storage=storage, study_name=plan.study_name(shape),
                                         direction="minimize", sampler=sampler,
                                         load_if_exists=True)
        problem = records.schema_problem(self.study)
        if problem:
            raise storage_mod.StorageError(problem)
        for key, value in (("shape", dataclasses.asdict(shape)), ("gpu", plan.gpu),
                           ("backend", plan.backend), ("record_schema", records.RECORD_SCHEMA)):
            if self.study.user_attrs.get(key) != value:  # each worker opens every study
                self.study.set_user_attr(key, value)
        self.recovered = records.recover_interrupted(self.study)
        warm = [(c, "warm") for c in plan.warm_configs(shape, self.candidates)]
        priority = warm if plan.warm_only else \
            [(space.fa2_config(shape, plan.num_sms), "fa2")] + ([(winner, "table")] if winner else []) + warm
        self.priority = [(project(c, self.candidates), src) for c, src in priority]
        # What counts towards the target: a re-time's own configs, else any candidate.
        self.counted = [c for c, _ in self.priority] if plan.warm_only else self.candidates
        if plan.warm_only:
            self.target = len(self.counted)
        order = list(self.candidates)
        random.Random(f"{plan.seed}:{space.shape_key(shape)}").shuffle(order)
        self.grid_order = order
        self.choices = {f: sorted({getattr(c, f) for c in self.candidates})
                        for f in CONFIG_COLUMNS}

    def done(self) -> dict[Config, optuna.trial.FrozenTrial]:
        return records.measured_trials(self.study)

    def _next_enqueue(self, done, running, duplicates: int = 0) -> tuple[Config | None, str]:
        for config, source in self.priority:
            if config not in done and config not in running:
                return config, source
        if self.mode == "grid" or duplicates >= FILL_AFTER_DUPLICATES:
            return next(((c, "grid") for c in self.grid_order
                         if c not in done and c not in running), (None, ""))
        return None, "sampler"

    def _suggest(self, trial: optuna.Trial) -> Config:
        values = {f: trial.suggest_categorical(f, self.choices[f]) for f in CONFIG_COLUMNS}
        return project(Config(**values), self.candidates)

    def _beyond_target(self, config: Config) -> bool:
        """Whether the target is reached without this runner's claimed trial of ``config``: by
        the finished measurements and the configs other live trials measure (another worker may
        have claimed one since this runner counted them). Two workers that claimed at once may
        both back off and ask again, rather than both time one config past the target."""
        running = records.running_configs(self.study)  # first: a trial that ends meanwhile is in done
        done = self.done()
        if config in done:  # finished by another worker since this runner looked
            return True
        if config not in self.counted:
            return False
        ahead = sum(c in running and c not in done and c != config for c in self.counted)
        return sum(c in done for c in self.counted) + ahead >= self.target

    def _tell(self, trial, *args, **kwargs) -> None:
        """Tell the trial; one that another sweep already gave up as stale stays as it is."""
        try:
            self.study.tell(trial, *args, **kwargs)
        except optuna.exceptions.UpdateFinishedTrialError:
            pass
        finally:
            records.release(trial)

    def _record(self, trial, config: Config, timing: bench.Timing, source: str) -> None:
        gbps = timing.gbps(self.shape.bytes_moved())
        attrs = {**dataclasses.asdict(config), "status": timing.status,
                 "reason": timing.reason, "median_us": timing.median_us,
                 "p20_us": timing.p20_us, "p80_us": timing.p80_us, "iqr_us": timing.iqr_us,
                 "n": timing.n, "gbps": gbps, "frac_copy_bw": gbps / self.copy_bw,
                 "copy_bw_gbps": self.copy_bw, "method": timing.method,
                 "input_sets": timing.input_sets, "max_abs_err": timing.max_abs_err,
                 "workspace_bytes": tunables.workspace_bytes(self.shape, config.num_splits),
                 "run_id": self.run_id, "source": source,
                 "finished_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                 **self.provenance}
        record = {k: None if isinstance(v, float) and math.isnan(v) else v
                  for k, v in attrs.items()}
        trial.set_user_attr(records.RECORD_ATTR, record)  # one write: all fields or none
        if timing.status == "ok":
            self._tell(trial, timing.median_us)
        else:
            self._tell(trial, state=optuna.trial.TrialState.FAIL)

    def _repeat(self, trial, earlier_number: int, value: float | None) -> None:
        trial.set_user_attr(records.DUPLICATE_ATTR, earlier_number)
        if value is not None:
            self._tell(trial, value)
        else:
            self._tell(trial, state=optuna.trial.TrialState.FAIL)

    def running_elsewhere(self) -> bool:
        """Whether configs this runner left unmeasured are being measured by other workers
        (which may still die and leave them to be retried)."""
        done = self.done()
        if sum(c in done for c in self.counted) >= self.target:
            return False
        running = records.running_configs(self.study)
        return any(c in running and c not in done for c in self.counted)

    def run(self, shape_bench_factory, deadline: float | None, on_trial=None) -> int:
        """Measure until the target, the candidates or the deadline run out; return trials timed."""
        timed, streak, raced = 0, 0, 0
        while True:
            termination.check()
            done = self.done()
            measured = sum(c in done for c in self.counted)
            if measured >= self.target:
                return timed
            if deadline is not None and time.monotonic() >= deadline:
                return timed
            if streak >= MAX_DUPLICATE_STREAK or raced >= MAX_RACED_STREAK:
                return timed
            self.recovered += records.recover_interrupted(self.study)  # a worker may have died
            running = records.running_configs(self.study)
            if measured + sum(c in running for c in self.counted if c not in done) >= self.target:
                return timed  # other workers' trials reach the target (running_elsewhere waits on them)
            config, source = self._next_enqueue(done, running, streak)
            if config is None and (self.mode == "grid" or self.plan.warm_only):
                return timed
            if config is not None:
                self.study.enqueue_trial(dataclasses.asdict(config))
            with warnings.catch_warnings():  # ask/tell beats by itself (records.heartbeat)
                warnings.filterwarnings("ignore", "Heartbeat of storage", UserWarning)
                trial = self.study.ask()
            actual = self._suggest(trial)
            if actual in done:
                earlier = done[actual]
                self._repeat(trial, earlier.number,
                             earlier.value if earlier.state == optuna.trial.TrialState.COMPLETE
                             else None)
                streak += 1
                continue
            rival = records.claim(trial, actual, self.provenance.get("worker"))
            if rival is not None:  # another sweep on the storage claimed it too
                self._repeat(trial, rival, None)
                raced += 1
                _back_off()
                continue
            streak = raced = 0
            if self._beyond_target(actual):
                self._tell(trial, state=optuna.trial.TrialState.FAIL)  # no record: not a trial row
                _back_off()
                continue
            try:
                with records.heartbeat(self.storage, trial):
                    timing = shape_bench_factory().measure(actual)
                self._record(trial, actual, timing, source if config == actual else "sampler")
            except BaseException:  # Ctrl-C or SIGTERM: this trial is not finished (again)
                self._tell(trial, state=optuna.trial.TrialState.FAIL)
                raise
            timed += 1
            if on_trial is not None:
                on_trial(timing)
            if timing.status == "failed" and any(m in timing.reason for m in FATAL_CUDA_MARKERS):
                raise SweepAborted(f"{space.shape_key(self.shape)} {space.config_key(actual)}: "
                                   f"{timing.reason}; the CUDA context is unusable, "
                                   f"rerun with --resume")
