"""The Optuna sweep driver: one study per shape, durable storage, resume, failed-trial policy.

* Study grouping: one study per shape, named ``<study_prefix><shape_key>``; the default
  prefix is ``splitkv:<gpu>:`` so one storage can hold several GPUs.
* Storage: an Optuna journal file ``<out>/optuna.journal`` unless ``--storage`` gives an
  RDB URL (``sqlite:///...``) or another journal path (``storage``). Every finished trial is in the
  journal the moment it is told, so a kill loses at most the trial in flight.
* Sampler: ``grid`` measures every candidate of ``space.candidate_configs`` exactly once
  (the order: FlashAttention-2's config, the current table winner, the warm start's configs
  (``warm_start``: the fastest of the same problem at another dtype or head dim), then a
  seeded shuffle; a re-time, ``warm_start.retime``, measures the warm configs alone),
  each one enqueued with ``enqueue_trial`` so the study's sampler is never consulted.
  Optuna's GridSampler/BruteForceSampler are not used: they call ``study.stop()``, which
  only works inside ``study.optimize`` (this driver uses ask/tell), and they do not count
  enqueued points as visited, so a resumed grid would re-run them;
  ``tpe`` measures the same first configs, then uses ``TPESampler(constant_liar=True)`` over
  the four tunables, projecting an infeasible proposal onto the nearest candidate. ``auto``
  picks grid when the trial budget covers every candidate (or there is no budget and at most
  ``GRID_MAX`` candidates).
  A config already finished in the study is never timed again: a repeat proposal is told
  the earlier result (user attr ``duplicate_of``) and left out of ``trials.csv``.
* Failures (invalid config, launch error, wrong output) are FAIL trials whose record has a
  ``status`` and ``reason``; nothing is ever reported as infinity. A CUDA error that poisons
  the context stops the sweep after recording the trial; ``--resume`` goes on from there.
* Resume: finished trials stay; a trial left RUNNING by a killed process is told FAIL and its
  config is measured again (``records`` says which trials count and which are stale, so a
  second sweep on the same storage never fails the first one's trials). ``trials.csv`` and
  ``heuristics.csv`` are rebuilt from storage (atomically) at start, after the first trial
  timed ``REBUILD_EVERY_S`` seconds after the last rebuild, and on exit (SIGTERM included), so
  they follow the storage; a rebuild reads every trial of the storage (about a second at 6,000
  trials, a seventh of a dense-grid shape's sweep), so it is not done per shape. Results in
  ``--out`` that the storage did not produce are not overwritten without ``--force``
  (``outdir``). A lost storage is rebuilt from ``trials.csv`` (``restore``).
* SIGTERM stops the sweep once the trial in flight is recorded (``termination``): the files
  are rebuilt and the run is marked ``terminated``.
"""
from __future__ import annotations

import dataclasses
import datetime as _dt
import math
import random
import time
import warnings
from pathlib import Path

import optuna
import torch
from tqdm.auto import tqdm

from splitkv_tune import (bench, estimate, gpus, meta, outdir, records, space, table,
                          termination, tunables)
from splitkv_tune import storage as storage_mod
from splitkv_tune.records import rebuild_trials_csv
from splitkv_tune.table_schema import CONFIG_COLUMNS
from splitkv_tune.tunables import Config, Shape

GRID_MAX = 256
TPE_DEFAULT_TRIALS = 64
MAX_DUPLICATE_STREAK = 25
# TPE proposals of configs already measured, in a row, after which a study takes its next
# unmeasured candidate in grid order instead: on a shape of few candidates TPE keeps proposing
# the ones it has seen, and the shape would end short of its trial target.
FILL_AFTER_DUPLICATES = 5
REBUILD_EVERY_S = 30.0
REFERENCE_BACKEND_DEVICE = "cpu_reference"
FATAL_CUDA_MARKERS = ("illegal memory access", "unspecified launch failure",
                      "CUDA error: an illegal", "device-side assert", "misaligned address")


class GpuMismatch(Exception):
    def __init__(self, requested: str, present: str):
        self.requested, self.present = requested, present
        if requested == "auto":
            message = ("--gpu auto found no CUDA device; run on a GPU, or use --backend reference "
                       "to run the pipeline on the CPU")
        else:
            message = (f"--gpu names {requested!r} but the device present is {present!r}; "
                       f"pass --force to write a {requested!r} table anyway")
        super().__init__(message)


class SweepAborted(RuntimeError):
    """The sweep cannot go on in this process (e.g. the CUDA context is poisoned)."""


SweepTerminated = termination.Terminated


class WorkersFailed(RuntimeError):
    """Worker processes stopped with errors before every trial was measured."""


class StudyExists(Exception):
    """The storage already holds trials for a study and ``--resume`` was not given."""


def present_device_name(backend: str) -> str:
    """Table name of what will be measured: the CUDA GPU, or ``cpu_reference``."""
    if backend == "reference":
        return REFERENCE_BACKEND_DEVICE
    if not torch.cuda.is_available():
        return "none (no CUDA device)"
    return gpus.resolve_gpu(torch.cuda.get_device_name())


def resolve_table_gpu(requested: str, backend: str, force: bool = False) -> str:
    """The table name a sweep writes; raise GpuMismatch when ``requested`` is not present.

    >>> resolve_table_gpu("auto", "reference")
    'cpu_reference'
    >>> resolve_table_gpu("h200", "reference", force=True)
    'nvidia_h200'
    """
    present = present_device_name(backend)
    if requested == "auto":
        if present.startswith("none"):
            raise GpuMismatch("auto", present)
        return present
    wanted = gpus.resolve_gpu(requested)
    if wanted != present and not force:
        raise GpuMismatch(wanted, present)
    return wanted


@dataclasses.dataclass
class SweepPlan:
    gpu: str
    grid: space.Grid
    shapes: list[Shape]
    backend: str = "reference"
    out_dir: Path = Path("results")
    storage: str | None = None
    study_prefix: str | None = None
    sampler: str = "auto"
    trials: int | None = None
    time_budget_s: float | None = None
    resume: bool = False
    seed: int = 0
    timing: dict = dataclasses.field(default_factory=lambda: dict(space.TIMING_DEFAULTS))
    num_sms: int = 132
    smem_limit: int | None = None
    force: bool = False
    workers: int = 0  # local worker processes; 0 measures in this process
    warm_start: object = None  # warm_start.WarmStart: configs each study measures first

    @property
    def prefix(self) -> str:
        return self.study_prefix if self.study_prefix is not None else f"splitkv:{self.gpu}:"

    def study_name(self, shape: Shape) -> str:
        return self.prefix + space.shape_key(shape)

    def candidates(self, shape: Shape, extra_splits=()) -> list[Config]:
        extra = [space.fa2_config(shape, self.num_sms).num_splits, *extra_splits]
        return space.candidate_configs(shape, self.grid.space, smem_limit=self.smem_limit,
                                       extra_splits=extra)

    def sampler_for(self, n_candidates: int) -> str:
        if self.sampler != "auto":
            return self.sampler
        if self.trials is None:
            return "grid" if n_candidates <= GRID_MAX else "tpe"
        return "grid" if self.trials >= n_candidates else "tpe"

    @property
    def warm_only(self) -> bool:
        """Whether each study measures its warm-start configs alone (a re-time)."""
        return self.warm_start is not None and self.warm_start.retime is not None

    def warm_configs(self, shape: Shape, candidates: list[Config]) -> list[Config]:
        """The warm start's configs for ``shape``, projected onto ``candidates``."""
        if self.warm_start is None:
            return []
        return self.warm_start.for_shape(shape, lambda c: project(c, candidates))

    def shape_target(self, shape: Shape, candidates: list[Config] | None = None) -> int:
        """Configs the study of ``shape`` measures (``candidates``: its own, when known)."""
        candidates = self.candidates(shape) if candidates is None else candidates
        if self.warm_only:
            return len(self.warm_configs(shape, candidates))
        return self.trial_target(len(candidates))

    def trial_target(self, n_candidates: int) -> int:
        if self.trials is not None:
            return min(self.trials, n_candidates)
        return n_candidates if self.sampler_for(n_candidates) == "grid" \
            else min(n_candidates, TPE_DEFAULT_TRIALS)


def dry_run_summary(plan: SweepPlan) -> dict:
    """Per-shape candidates, sampler, trial count, time and memory estimates (``estimate``),
    and the shapes whose memory exceeds what the device has (``too_big``)."""
    profile = gpus.profile_for(plan.gpu)
    copy_bw = profile.copy_bw_gbps if profile else None
    l2_bytes = profile.l2_bytes if profile else None
    available = estimate.available_bytes(plan.backend)
    rows = []
    for shape in plan.shapes:
        candidates = plan.candidates(shape)
        n = len(candidates)
        trials = plan.shape_target(shape, candidates)
        seconds = trials * estimate.trial_seconds(shape, plan.backend, plan.timing, copy_bw)
        needs = estimate.shape_bytes(shape, plan.backend, l2_bytes)
        warm = trials if plan.warm_only else len(plan.warm_configs(shape, candidates))
        rows.append({"shape": space.shape_key(shape), "candidates": n,
                     "sampler": plan.sampler_for(n), "trials": trials, "warm": warm,
                     "estimated_s": seconds, "bytes": needs,
                     "fits": available is None or needs <= available})
    total = sum(r["trials"] for r in rows)
    seconds = sum(r["estimated_s"] for r in rows)
    if plan.time_budget_s is not None:
        seconds = min(seconds, plan.time_budget_s)
    return {"gpu": plan.gpu, "grid": plan.grid.source, "backend": plan.backend,
            "shapes": rows, "total_trials": total, "estimated_s": seconds,
            "available_bytes": available, "too_big": [r["shape"] for r in rows if not r["fits"]],
            "storage": storage_mod.describe(plan.storage, plan.out_dir)}


def project(config: Config, candidates: list[Config]) -> Config:
    """The candidate nearest ``config``: same block/reduce sizes, closest log2(S), same policy."""
    if config in candidates:
        return config
    same = [c for c in candidates if (c.block_kv, c.reduce_threads)
            == (config.block_kv, config.reduce_threads)] or candidates
    return min(same, key=lambda c: (abs(math.log2(c.num_splits) - math.log2(config.num_splits)),
                                    c.split_policy != config.split_policy, c.num_splits))


def check_existing_studies(plan: SweepPlan, storage) -> None:
    if plan.resume:
        return
    names = {s.study_name: s.n_trials for s in
             optuna.get_all_study_summaries(storage, include_best_trial=False)}
    taken = [n for n in (plan.study_name(s) for s in plan.shapes) if names.get(n)]
    if taken:
        raise StudyExists(f"the storage already holds {len(taken)} of these studies "
                          f"(e.g. {taken[0]!r}); pass --resume to continue them, or --out / "
                          f"--study-prefix for a fresh sweep")


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

    def _claim(self, trial, config: Config) -> int | None:
        """Name this process as the trial's owner; the number of an earlier live trial that
        measures the same config (another sweep on the storage got there first), if any."""
        records.claim(trial, config, self.provenance.get("worker"))
        earlier = records.running_configs(self.study).get(config)
        return earlier if earlier is not None and earlier < trial.number else None

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
        if sum(c in self.done() for c in self.counted) >= self.target:
            return False
        return bool(records.running_configs(self.study))

    def run(self, shape_bench_factory, deadline: float | None, on_trial=None) -> int:
        """Measure until the target, the candidates or the deadline run out; return trials timed."""
        timed, streak = 0, 0
        while True:
            termination.check()
            done = self.done()
            measured = sum(c in done for c in self.counted)
            if measured >= self.target:
                return timed
            if deadline is not None and time.monotonic() >= deadline:
                return timed
            if streak >= MAX_DUPLICATE_STREAK:
                return timed
            self.recovered += records.recover_interrupted(self.study)  # a worker may have died
            running = records.running_configs(self.study)
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
            taken_by = self._claim(trial, actual)
            if taken_by is not None:
                self._repeat(trial, taken_by, None)
                streak += 1
                continue
            streak = 0
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


def run_sweep(plan: SweepPlan, *, argv=None, progress: bool | None = None) -> dict:
    """Run (or resume) the sweep; write trials.csv, heuristics.csv and the run's metadata."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    out_dir = Path(plan.out_dir)
    journal = None if storage_mod.is_rdb_url(plan.storage) \
        else storage_mod.journal_path(plan.storage, out_dir)
    new_journal = journal is not None and not journal.exists()
    storage = storage_mod.open_storage(plan.storage, out_dir)
    try:
        check_existing_studies(plan, storage)
        if not plan.force:
            outdir.check_not_foreign(out_dir, records.trials_frame(storage),
                                     storage_mod.describe(plan.storage, out_dir))
        winners = outdir.current_winners(out_dir, plan.force)
    except BaseException:
        if new_journal and journal.stat().st_size == 0:  # refused: leave no trace
            journal.unlink()
        raise
    out_dir.mkdir(parents=True, exist_ok=True)
    outdir.remove_stale_temporaries(out_dir)
    trials_path, heuristics_path = out_dir / "trials.csv", out_dir / "heuristics.csv"

    def rebuild_files():  # (trials, heuristics) frames, as written
        frame = rebuild_trials_csv(storage, trials_path, plan.gpu)
        heuristics = table.build_heuristics(frame)
        table.atomic_write_csv(heuristics_path, heuristics)
        return frame, heuristics

    rebuild_files()  # a killed run's heuristics.csv may be behind its trials
    device = bench.default_device(plan.backend)
    run_id = meta.make_run_id()
    copy_bw = bench.copy_bandwidth_gbps(device, **plan.timing)
    run_meta = meta.collect_meta(
        device=device, backend=plan.backend, run_id=run_id, argv=argv,
        timing_method="cuda_graph" if device.type == "cuda" else "wallclock",
        extra={"gpu": plan.gpu, "grid": plan.grid.source, "copy_bw_gbps": copy_bw,
               "timing": plan.timing, "sampler": plan.sampler, "trials": plan.trials,
               "time_budget_s": plan.time_budget_s, "study_prefix": plan.prefix,
               "resume": plan.resume, "status": "running", "shapes": len(plan.shapes)})
    meta.write_run_meta(out_dir, run_meta)
    start = time.monotonic()
    last_rebuild = [start]
    totals = {"timed": 0, "failed": 0, "recovered": 0}

    def after_trial(timing: bench.Timing) -> None:
        totals["timed"] += 1
        totals["failed"] += timing.status != "ok"
        trial_bar.update(1)
        if time.monotonic() - last_rebuild[0] >= REBUILD_EVERY_S:
            rebuild_files()
            last_rebuild[0] = time.monotonic()

    disable = None if progress is None else not progress  # None: only on a terminal
    bars_off = True if plan.workers else disable  # the workers' progress view replaces them
    shape_bar = tqdm(plan.shapes, desc="shapes", unit="shape", disable=bars_off)
    planned = sum(plan.shape_target(shape) for shape in plan.shapes)
    trial_bar = tqdm(total=planned, desc="trials", unit="trial", disable=bars_off)
    status = "interrupted"
    previous_handler = termination.install()
    try:
        if plan.workers:
            from splitkv_tune import workers
            codes = workers.run_local(plan, storage, run_id, copy_bw, winners, disable,
                                      rebuild_files)
            totals["workers"] = codes
            frame = rebuild_trials_csv(storage, trials_path, plan.gpu)
            mine = frame[frame["run_id"].astype(str).str.startswith(run_id + ".")]
            totals["timed"], totals["failed"] = len(mine), int((mine["status"] != "ok").sum())
            left = planned - len(frame)
            if any(codes.values()) and left > 0:
                raise WorkersFailed(f"workers {sorted(n for n, c in codes.items() if c)} "
                                    f"stopped with errors and {left} trials are left; "
                                    f"rerun with --resume")
        for i, shape in enumerate([] if plan.workers else shape_bar):
            shape_bar.set_postfix_str(space.shape_key(shape))
            deadline = None
            if plan.time_budget_s is not None:
                remaining = plan.time_budget_s - (time.monotonic() - start)
                deadline = time.monotonic() + remaining / (len(plan.shapes) - i)
            runner = ShapeRunner(plan, shape, storage, run_id, copy_bw,
                                 table.lookup_config(winners, shape))
            totals["recovered"] += runner.recovered
            already = sum(c in runner.done() for c in runner.candidates)
            trial_bar.update(min(already, runner.target))  # finished in an earlier run
            holder: list[bench.ShapeBench] = []

            def shape_bench(shape=shape, holder=holder) -> bench.ShapeBench:
                if not holder:
                    holder.append(bench.ShapeBench(
                        shape, backend=plan.backend, device=device, seed=plan.seed,
                        num_sms=plan.num_sms, **plan.timing))
                return holder[0]

            timed_before = totals["timed"]
            runner.run(shape_bench, deadline, after_trial)
            skipped = runner.target - min(already, runner.target) - (totals["timed"] - timed_before)
            trial_bar.update(max(0, skipped))  # budget or candidates ran out before the target
            holder.clear()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        status = "completed"
    except (SweepAborted, WorkersFailed):
        status = "aborted"
        raise
    except SweepTerminated:
        status = "terminated"
        raise
    finally:
        termination.restore(previous_handler)
        trial_bar.close()
        shape_bar.close()
        try:
            frame, heuristics = rebuild_files()
            run_meta.update(status=status, elapsed_s=round(time.monotonic() - start, 3),
                            **totals)
            meta.write_run_meta(out_dir, run_meta)
        except OSError:
            if status == "completed":
                raise
            # Another error is on its way out and says why; --resume rebuilds these files.
    return {"run_id": run_id, "trials_csv": trials_path, "heuristics_csv": heuristics_path,
            "trials": frame, "heuristics": heuristics, "copy_bw_gbps": copy_bw, **totals}
