"""``splitkv-tune sweep | table | restore-storage``: the Optuna sweep, the table it builds and
its storage rebuilt from the table's trials, as click commands.

Bad input (options, grids, tables, storages, output paths) ends in one ``error:`` line and
exit code 2 (``cli_errors``); nothing already stored is touched then.
"""
from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import click

from splitkv_tune.cli_errors import STDOUT, check_output, exit_2_on_bad_input, fail, number_not_nan
from splitkv_tune.cli_tune import (BACKEND_OPTION, _backend_or_exit, _grid_shapes, _num_sms,
                                   _smem_limit, _timing, _timing_options, grid_options,
                                   parse_duration)

SEED_RANGE = click.IntRange(min=0, max=2**32 - 1)  # what Optuna's samplers (numpy) accept


def _check_storage_path(storage: str | None) -> None:
    from splitkv_tune import storage as storage_mod
    if storage and not storage_mod.is_rdb_url(storage):
        check_output(storage, "--storage")


def _print_dry_run(summary: dict, plan, as_json: bool) -> None:
    from splitkv_tune import estimate
    if as_json:
        click.echo(json.dumps(summary, indent=2, default=str))
        return
    click.echo(f"grid {summary['grid']}  gpu {summary['gpu']}  backend {summary['backend']}  "
               f"storage {summary['storage']}")
    for row in summary["shapes"]:
        click.echo(f"  {row['shape']:<44} candidates {row['candidates']:>4}  "
                   f"{row['sampler']:<4}  trials {row['trials']:>4}  "
                   f"{'warm %2d  ' % row['warm'] if plan.warm_start is not None else ''}"
                   f"~{estimate.human_seconds(row['estimated_s']):>8}  "
                   f"{estimate.human_bytes(row['bytes']):>9}{'' if row['fits'] else '  TOO BIG'}")
    click.echo(f"{len(summary['shapes'])} shapes, {summary['total_trials']} trials, "
               f"estimated {estimate.human_seconds(summary['estimated_s'])} on the "
               f"{summary['backend']} backend (warm-up {plan.timing['warmup_s']}s, at least "
               f"{plan.timing['min_reps']} samples and {plan.timing['max_time_s']}s per trial)")


def _refuse_too_big(summary: dict) -> None:
    from splitkv_tune import estimate
    if summary["too_big"]:
        biggest = max(summary["shapes"], key=lambda r: r["bytes"])
        fail(f"{len(summary['too_big'])} shape(s) need more memory than the "
             f"{summary['backend']} backend has ({estimate.human_bytes(summary['available_bytes'])}"
             f" available), e.g. {biggest['shape']} needs about "
             f"{estimate.human_bytes(biggest['bytes'])}; leave them out with --shapes")


@click.command()
@click.option("--gpu", default="auto", show_default=True,
              help="Table name (a100, h100, h200, auto, ...); must match the device unless "
                   "--force. "
                   "On --backend reference the device is 'cpu_reference'.")
@grid_options
@click.option("--trials", type=click.IntRange(min=1), default=None,
              help="Configs to measure per shape "
                   "(default: every candidate with grid, 64 with tpe).")
@click.option("--time-budget", default=None,
              help="Wall-clock budget for this run (90s, 30m, 8h), shared evenly by the "
                   "shapes left.")
@click.option("--sampler", type=click.Choice(["auto", "grid", "tpe"]), default="auto",
              show_default=True)
@click.option("--storage", default=None,
              help="Optuna storage: an RDB URL or a journal file (default <out>/optuna.journal).")
@click.option("--study-prefix", default=None, help="Study names are PREFIX + shape key "
              "(default 'splitkv:<gpu>:').")
@BACKEND_OPTION
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default=None,
              help="Output directory (default results/<gpu>/).")
@click.option("--dry-run", is_flag=True,
              help="Print the grid, the trial count and time and memory estimates.")
@click.option("--json", "as_json", is_flag=True, help="With --dry-run: print JSON.")
@click.option("--resume", is_flag=True, help="Continue the studies in the storage.")
@click.option("--force", is_flag=True,
              help="Write a table named by --gpu on another device, and overwrite results in "
                   "--out that this storage did not write.")
@click.option("--seed", type=SEED_RANGE, default=0, show_default=True)
@click.option("--workers", "workers_text", default=None,
              help="Measure in N worker processes, or auto: one per visible GPU (each pinned "
                   "with CUDA_VISIBLE_DEVICES); on --backend reference, N CPU processes. "
                   "Default: measure in this process.")
@click.option("--progress/--no-progress", default=None,
              help="Progress bars (default: on a terminal).")
@click.option("--warm-start", "warm_paths", multiple=True, type=click.Path(dir_okay=False),
              help="A trials.csv of an earlier sweep (repeatable): each shape first measures the "
                   "configs that ran fastest on the same problem there, at the nearest dtype and "
                   "head dim, e.g. an fp16 sweep started from the bf16 part's trials.")
@click.option("--warm-start-top", type=click.IntRange(min=1, max=64), default=4, show_default=True,
              help="How many of those configs each shape measures first.")
@click.option("--warm-start-select", type=click.Choice(["fastest", "spread"]), default="fastest",
              show_default=True,
              help="Which of those configs: the fastest, or (spread; CUDA only) those whose programmatic "
                   "launch this GPU now spreads over its SMs, to time them again under a new "
                   "--study-prefix (docs/PERFORMANCE.md, \"Back to back\").")
@_timing_options
@exit_2_on_bad_input
def sweep(gpu, grid, dtypes, head_dims, patterns, trials, time_budget, sampler, storage,
          study_prefix, backend, out_dir, dry_run, as_json, resume, force, seed, workers_text,
          progress, warm_paths, warm_start_top, warm_start_select, warmup_s, min_reps, max_time_s):
    """Search the best config per shape with Optuna; write trials.csv and heuristics.csv."""
    from splitkv_tune import gpus
    from splitkv_tune import storage as storage_mod
    from splitkv_tune import sweep as sweep_mod

    if as_json and not dry_run:
        raise click.UsageError("--json goes with --dry-run")
    grid_obj, shapes = _grid_shapes(grid, dtypes, head_dims, patterns)
    budget = parse_duration(time_budget)
    try:  # a dry run plans for whichever GPU --gpu names
        table_gpu = sweep_mod.resolve_table_gpu(gpu, backend, force or dry_run)
    except sweep_mod.GpuMismatch as err:
        fail(str(err) + ("; or name the GPU the dry run plans for, e.g. --gpu h200" if dry_run else ""))
    if not dry_run:
        _backend_or_exit(backend)
    out = Path(out_dir) if out_dir else Path("results") / table_gpu
    if not dry_run:
        check_output(out, "--out", directory=True)
        _check_storage_path(storage)
    count = 0
    if workers_text is not None:
        from splitkv_tune.workers import worker_count
        try:
            count = worker_count(workers_text, backend)
        except ValueError as err:
            raise click.BadParameter(str(err), param_hint="--workers")
        if count > 1:
            storage_mod.check_shared(storage, "--workers")
    profile = gpus.profile_for(table_gpu)
    plan = sweep_mod.SweepPlan(
        gpu=table_gpu, grid=grid_obj, shapes=shapes, backend=backend, out_dir=out,
        storage=storage, study_prefix=study_prefix, sampler=sampler, trials=trials,
        time_budget_s=budget, resume=resume, seed=seed,
        timing=_timing(grid_obj.timing, warmup_s, min_reps, max_time_s),
        num_sms=_num_sms(backend, table_gpu), smem_limit=_smem_limit(backend, profile),
        force=force, workers=count, warm_start=_warm_start(warm_paths, warm_start_top, warm_start_select, backend))
    if plan.warm_start is not None and count:
        raise click.UsageError("--warm-start measures in this process: leave out --workers")
    if plan.warm_only and study_prefix is None:
        raise click.UsageError("--warm-start-select spread times configs again: give a new --study-prefix, "
                               "or the first sweep's studies already hold them")
    summary = sweep_mod.dry_run_summary(plan)
    if plan.warm_only and summary["total_trials"] == 0:
        fail("--warm-start-select spread: this GPU spreads none of the --warm-start configs; nothing to time again")
    if dry_run:
        _print_dry_run(summary, plan, as_json)
        _refuse_too_big(summary)
        return
    _refuse_too_big(summary)
    _run(sweep_mod, plan, progress)


def _warm_start(paths, top, select, backend):
    """The warm start of --warm-start files, or None (a bad file ends in one error line)."""
    if not paths:
        if select != "fastest":
            raise click.UsageError("--warm-start-select goes with --warm-start")
        return None
    if select == "spread":
        from splitkv_tune import bench
        problem = "it needs --backend cuda" if backend != "cuda" else bench.backend_problem("cuda")
        if problem:
            raise click.BadParameter(f"spread asks the GPU which launches it spreads: {problem}",
                                     param_hint="--warm-start-select")
    from splitkv_tune import warm_start
    return warm_start.load(paths, top, select)


def _run(sweep_mod, plan, progress) -> None:
    from splitkv_tune.outdir import ForeignResults
    try:
        result = sweep_mod.run_sweep(plan, argv=sys.argv, progress=progress)
    except (sweep_mod.StudyExists, ForeignResults) as err:
        fail(str(err))
    except (sweep_mod.SweepAborted, sweep_mod.WorkersFailed) as err:
        click.echo(f"error: sweep stopped: {err}", err=True)
        sys.exit(3)
    except (KeyboardInterrupt, sweep_mod.SweepTerminated) as err:
        click.echo(f"\nInterrupted: finished trials are in the storage and "
                   f"{plan.out_dir / 'trials.csv'}; continue with --resume.", err=True)
        sys.exit(143 if isinstance(err, sweep_mod.SweepTerminated) else 130)
    ok = int((result["trials"]["status"] == "ok").sum()) if len(result["trials"]) else 0
    click.echo(f"run {result['run_id']}: timed {result['timed']} configs this run "
               f"({result['failed']} failed), {ok} ok in total; "
               f"{len(result['heuristics'])} shapes in {result['heuristics_csv']}")


@click.command()
@click.argument("trials", nargs=-1, required=True, type=click.Path(exists=True))
@click.option("-o", "--output", default=None,
              help="Where to write it; - for stdout. Default: heuristics.csv next to the (first) trials.")
@click.option("--gpu", default=None,
              help="The GPU the table is for: of trials that name several GPUs, its rows; otherwise "
                   "the gpu column is set to it.")
@click.option("--min-margin", type=click.FloatRange(min=0, max=1), default=None, callback=number_not_nan,
              help="Smallest relative noise margin for ties (default 0.01).")
@click.option("--from-storage", is_flag=True,
              help="First rebuild trials.csv from the sweep's storage (after a killed sweep).")
@click.option("--storage", default=None,
              help="With --from-storage: a database URL or journal file "
                   "(default <dir>/optuna.journal).")
@exit_2_on_bad_input
def table(trials, output, gpu, min_margin, from_storage, storage):
    """Build heuristics.csv (best config per shape) from trials.csv files or results directories.

    Several TRIALS are one measurement set: the parts of a grid swept into folders of their
    own (configs/dense_decode.yaml) give one table.
    """
    import pandas as pd

    from splitkv_tune import table as table_mod
    from splitkv_tune.gpus import resolve_gpu
    from splitkv_tune.table_schema import read_trials, validate_heuristics, with_gpu

    trials_paths = [path / "trials.csv" if path.is_dir() else path for path in map(Path, trials)]
    trials_path = trials_paths[0]
    out = Path(output) if output else trials_path.parent / "heuristics.csv"
    check_output(output if output == STDOUT else out, "-o", allow_stdout=True)
    if storage and not from_storage:
        raise click.UsageError("--storage goes with --from-storage")
    if from_storage and len(trials_paths) > 1:
        raise click.UsageError("--from-storage rebuilds one trials.csv: give one TRIALS")
    if from_storage:
        from splitkv_tune import records, storage as storage_mod
        if not storage_mod.is_rdb_url(storage):
            journal = storage_mod.journal_path(storage, trials_path.parent)
            if not journal.is_file():
                raise click.BadParameter(f"no {journal}", param_hint="--from-storage")
        check_output(trials_path, "TRIALS")
        opened = storage_mod.open_storage(storage, trials_path.parent, repair=False,
                                          create=False)
        records.rebuild_trials_csv(opened, trials_path)
    for path in trials_paths:
        if not path.is_file():
            raise click.BadParameter(f"{path} does not exist", param_hint="TRIALS")
    parts = [read_trials(path) for path in trials_paths]
    labelled = [path for path, part in zip(trials_paths, parts) if "gpu" in part.columns]
    if gpu is None and 0 < len(labelled) < len(parts):
        without = next(path for path in trials_paths if path not in labelled)
        raise click.BadParameter(f"{labelled[0]} has a gpu column and {without} has none: name the GPU with --gpu",
                                 param_hint="TRIALS")
    measured = pd.concat(parts, ignore_index=True)
    sources = ", ".join(map(str, trials_paths))
    if gpu is not None:
        measured = with_gpu(measured, gpu, sources)
        gpu = resolve_gpu(gpu)
    margin = table_mod.MIN_NOISE_MARGIN if min_margin is None else min_margin
    result = table_mod.build_heuristics(measured, gpu, margin)
    if not len(result):
        fail(f"{sources}: no trial with status ok, so no winner for any shape")
    text = result.to_csv(index=False)
    validate_heuristics(pd.read_csv(io.StringIO(text), dtype=str, keep_default_na=False),
                        f"the table built from {sources}")
    if output == STDOUT:
        click.echo(text, nl=False)
        return
    table_mod.atomic_write_text(out, text)
    click.echo(f"{len(result)} shapes -> {out}")


@click.command("restore-storage")
@click.argument("trials", type=click.Path(exists=True, path_type=Path))
@click.option("--storage", default=None,
              help="The storage to rebuild: a database URL, or a journal file that does not exist "
                   "yet (default <dir>/optuna.journal, next to trials.csv).")
@exit_2_on_bad_input
def restore_storage(trials, storage):
    """Rebuild a sweep's lost Optuna storage from its trials.csv (a file or results directory).

    Every row becomes a finished trial with its record, under its own trial number, so that
    `sweep --resume` on the same --out goes on where trials.csv stops. All or nothing.
    """
    import optuna

    from splitkv_tune import restore
    from splitkv_tune import storage as storage_mod

    trials_path = trials / "trials.csv" if trials.is_dir() else trials
    frame = restore.read_sweep_trials(trials_path)
    _check_storage_path(storage)
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # no line per study created
    counts = restore.restore_storage(frame, storage, trials_path.parent)
    click.echo(f"restored {counts['studies']} studies, {counts['trials']} trials "
               f"({counts['gaps']} numbers trials.csv skips kept as failed trials) into "
               f"{storage_mod.describe(storage, trials_path.parent)}")
