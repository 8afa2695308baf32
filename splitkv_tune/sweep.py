"""The Optuna sweep driver: one study per shape, durable storage, resume, failed-trial policy.

* Study grouping: one study per shape, named ``<study_prefix><shape_key>``; the default
  prefix is ``splitkv:<gpu>:`` so one storage can hold several GPUs.
* Storage: an Optuna journal file ``<out>/optuna.journal`` unless ``--storage`` gives an
  RDB URL (``sqlite:///...``) or another journal path (``storage``). Every finished trial is in the
  journal the moment it is told, so a kill loses at most the trial in flight.
* Sampler (each shape's study runs in a ``shape_study.ShapeRunner``): ``grid`` measures every
  candidate of ``space.candidate_configs`` exactly once
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
  the earlier result (user attr ``duplicate_of``) and left out of ``trials.csv``. A config that
  another live trial claims is stepped back from the same way (``duplicate_of`` names that
  trial, which may itself step back: ``records.claim``).
* Failures (invalid config, launch error, wrong output) are FAIL trials whose record has a
  ``status`` and ``reason``; nothing is ever reported as infinity. A CUDA error that poisons
  the context stops the sweep after recording the trial; ``--resume`` goes on from there.
* Resume: finished trials stay; a trial left RUNNING by a killed process is told FAIL and its
  config is measured again (``records`` says which trials count and which are stale, so a
  second sweep on the same storage never fails the first one's trials). ``trials.csv`` and
  ``heuristics.csv`` are rebuilt from storage (atomically) at start, after the first trial
  timed ``REBUILD_EVERY_S`` seconds after the last rebuild (or ``REBUILD_TIME_FACTOR`` times
  that rebuild's own time, when longer: ``progress.Pacer``), and on exit (SIGTERM included), so they follow the
  storage; a rebuild reads every trial of the storage (about a second at 10,000 trials), so it
  is not done per shape. Results in
  ``--out`` that the storage did not produce are not overwritten without ``--force``
  (``outdir``). A lost storage is rebuilt from ``trials.csv`` (``restore``).
* SIGTERM stops the sweep once the trial in flight is recorded (``termination``): the files
  are rebuilt and the run is marked ``terminated``.
"""
from __future__ import annotations

import contextlib
import dataclasses
import time
from pathlib import Path

import optuna
import torch
from tqdm.auto import tqdm

from splitkv_tune import (bench, estimate, gpus, meta, outdir, records, space, table,
                          termination)
from splitkv_tune import progress as progress_mod
from splitkv_tune import storage as storage_mod
from splitkv_tune.records import rebuild_trials_csv
from splitkv_tune.shape_study import ShapeRunner, SweepAborted, project
from splitkv_tune.tunables import Config, Shape

GRID_MAX = 256
TPE_DEFAULT_TRIALS = 64
REBUILD_EVERY_S = 30.0
# ...or this many times the last rebuild's own time, when that is longer: a rebuild reads every
# trial of the storage, so on a large one the files' upkeep stays within about 5% of the sweep.
REBUILD_TIME_FACTOR = 20.0
REFERENCE_BACKEND_DEVICE = "cpu_reference"


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
    rebuild_when_due = progress_mod.Pacer(rebuild_files, REBUILD_EVERY_S, REBUILD_TIME_FACTOR)
    totals = {"timed": 0, "failed": 0, "recovered": 0}

    def after_trial(timing: bench.Timing) -> None:
        totals["timed"] += 1
        totals["failed"] += timing.status != "ok"
        trial_bar.update(1)
        rebuild_when_due()

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
        pending = []  # shapes whose last configs a worker elsewhere on the storage is measuring
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
            if runner.running_elsewhere():
                pending.append((shape, runner))
            else:
                skipped = runner.target - min(already, runner.target) - (totals["timed"] - timed_before)
                trial_bar.update(max(0, skipped))  # budget or candidates ran out before the target
            holder.clear()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        if pending:
            from splitkv_tune import workers
            end = None if plan.time_budget_s is None else start + plan.time_budget_s
            workers.measure_until_done(pending, plan, device, end, after_trial)
            trial_bar.update(max(0, trial_bar.total - trial_bar.n))  # the rest: timed elsewhere or cut
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
        # The run's record first: a kill during the rebuild (a second SIGTERM, a scheduler's
        # KILL after its grace) then still leaves how the run ended, and the next start
        # rebuilds the files from the storage. When the run did not complete, another error is
        # on its way out and says why, so an OSError here only costs what --resume redoes.
        run_meta.update(status=status, elapsed_s=round(time.monotonic() - start, 3), **totals)
        os_errors = contextlib.nullcontext() if status == "completed" else contextlib.suppress(OSError)
        with os_errors:
            meta.write_run_meta(out_dir, run_meta)
        with os_errors:
            frame, heuristics = rebuild_files()
    return {"run_id": run_id, "trials_csv": trials_path, "heuristics_csv": heuristics_path,
            "trials": frame, "heuristics": heuristics, "copy_bw_gbps": copy_bw, **totals}
