"""``splitkv-tune worker``: join a running sweep through its storage, from this or another
machine, and measure until no config is left that nobody is measuring.

Give it the sweep's storage and the same grid options as the sweep (grid, shape filters,
sampler, trials, seed, timing); ``--gpu`` must name this machine's GPU model, which must be
the one the sweep's studies are for.
"""
from __future__ import annotations

import os
import platform
import sys

import click

from splitkv_tune.cli_errors import check_output, exit_2_on_bad_input, fail
from splitkv_tune.cli_sweep import SEED_RANGE
from splitkv_tune.cli_tune import (BACKEND_OPTION, _backend_or_exit, _grid_shapes, _num_sms,
                                   _smem_limit, _timing, _timing_options, grid_options,
                                   parse_duration)


@click.command()
@click.option("--storage", required=True,
              help="The sweep's storage: a postgresql:// URL, or its journal file.")
@click.option("--gpu", default="auto", show_default=True,
              help="Table name; must match this machine's device and the sweep's studies.")
@grid_options
@click.option("--trials", type=click.IntRange(min=1), default=None,
              help="Configs to measure per shape, as given to the sweep.")
@click.option("--time-budget", default=None, help="Stop after this long (90s, 30m, 8h).")
@click.option("--sampler", type=click.Choice(["auto", "grid", "tpe"]), default="auto",
              show_default=True)
@click.option("--study-prefix", default=None, help="As given to the sweep.")
@BACKEND_OPTION
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default=None,
              help="Where to write this worker's run metadata (runs/<run_id>.json); "
                   "none when not given.")
@click.option("--name", default=None, help="This worker's name in the results "
              "(default HOST:PID).")
@click.option("--run-id", default=None, hidden=True)
@click.option("--force", is_flag=True, help="Measure on a device other than --gpu names.")
@click.option("--seed", type=SEED_RANGE, default=0, show_default=True)
@_timing_options
@exit_2_on_bad_input
def worker(storage, gpu, grid, dtypes, head_dims, patterns, trials, time_budget, sampler,
           study_prefix, backend, out_dir, name, run_id, force, seed, warmup_s, min_reps,
           max_time_s):
    """Join a running sweep (its storage) and measure its configs."""
    from pathlib import Path

    from splitkv_tune import gpus, meta, records, storage as storage_mod, termination
    from splitkv_tune import sweep as sweep_mod
    from splitkv_tune import workers

    import optuna
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    grid_obj, shapes = _grid_shapes(grid, dtypes, head_dims, patterns)
    budget = parse_duration(time_budget)
    try:
        table_gpu = sweep_mod.resolve_table_gpu(gpu, backend, force)
    except sweep_mod.GpuMismatch as err:
        fail(str(err))
    _backend_or_exit(backend)
    if out_dir:
        check_output(out_dir, "--out", directory=True)
    storage_mod.check_shared(storage, "a worker and the sweep it joins")
    opened = storage_mod.open_storage(storage, ".", create=False)  # --storage names it
    plan = sweep_mod.SweepPlan(
        gpu=table_gpu, grid=grid_obj, shapes=shapes, backend=backend,
        out_dir=Path(out_dir) if out_dir else None, storage=storage, study_prefix=study_prefix,
        sampler=sampler, trials=trials, time_budget_s=budget, resume=True, seed=seed,
        timing=_timing(grid_obj.timing, warmup_s, min_reps, max_time_s),
        num_sms=_num_sms(backend, table_gpu), smem_limit=_smem_limit(backend, gpus.profile_for(table_gpu)),
        force=force)
    try:
        workers.check_joinable(plan, opened)
    except workers.WorkerError as err:
        fail(str(err))
    run_id = run_id or meta.make_run_id()
    provenance = records.default_provenance(backend, name or f"{platform.node()}:{os.getpid()}")
    termination.install()
    try:
        totals = workers.run_worker(plan, opened, run_id, provenance)
    except (KeyboardInterrupt, sweep_mod.SweepTerminated) as err:
        sys.exit(143 if isinstance(err, sweep_mod.SweepTerminated) else 130)
    except sweep_mod.SweepAborted as err:
        click.echo(f"error: worker stopped: {err}", err=True)
        sys.exit(3)
    if out_dir:
        meta.write_run_meta(Path(out_dir), meta.collect_meta(
            backend=backend, run_id=run_id,
            extra={"command": "worker", "gpu": table_gpu, "storage": storage, **provenance,
                   **totals}))
    click.echo(f"worker {provenance['worker']}: timed {totals['timed']} configs", err=True)
