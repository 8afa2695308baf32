"""Worker processes that feed the same studies through Optuna's storage.

``sweep --workers N|auto`` starts one ``splitkv-tune worker`` process per visible GPU (each
pinned with ``CUDA_VISIBLE_DEVICES``), or N CPU processes on the reference backend, and
``splitkv-tune worker --storage URL`` joins a running sweep from another machine. There is no
scheduler: every worker walks the shapes in the grid's order and asks each study for the next
config that is neither measured nor being measured by a live worker (``records``); Optuna's
storage is the only thing the workers share. A worker that dies leaves its trial RUNNING; the
others see it stale (its process is gone, or on an RDB storage its heartbeat stopped), fail
it and measure the config themselves, so a worker keeps polling while another one still holds
an unmeasured config.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time

from splitkv_tune import bench, outdir, space, table
from splitkv_tune.shape_study import ShapeRunner

POLL_S = 0.5


class WorkerError(Exception):
    """A worker cannot join this storage (no such sweep, another GPU model)."""


def worker_count(requested: str, backend: str) -> int:
    """Workers for ``--workers``: a positive integer, or ``auto`` (every visible GPU; on the
    reference backend, the CPU cores)."""
    if requested == "auto":
        if backend == "reference":
            return max(1, os.cpu_count() or 1)
        import torch
        count = torch.cuda.device_count()
        if count < 1:
            raise ValueError("--workers auto found no CUDA device")
        return count
    try:
        count = int(requested)
    except ValueError:
        raise ValueError(f"--workers must be a positive integer or auto, got {requested!r}") \
            from None
    if count < 1:
        raise ValueError(f"--workers must be a positive integer or auto, got {requested!r}")
    return count


def check_joinable(plan, storage) -> None:
    """A worker joins only a sweep of its own GPU model: the storage must hold studies of
    ``plan``'s shapes, and every one must be for ``plan.gpu``."""
    import optuna
    studies = {s.study_name: s.user_attrs.get("gpu")
               for s in optuna.get_all_study_summaries(storage, include_best_trial=False)}
    mine = [plan.study_name(shape) for shape in plan.shapes]
    found = {name: studies[name] for name in mine if name in studies}
    if not found:
        gpus = sorted({g for g in studies.values() if g})
        raise WorkerError(f"the storage holds no sweep of {plan.gpu} with these shapes "
                          f"(study prefix {plan.prefix!r}; it holds sweeps of: "
                          f"{', '.join(gpus) or 'nothing'}); start one with splitkv-tune sweep")
    other = sorted({g for g in found.values() if g != plan.gpu})
    if other:
        raise WorkerError(f"the storage's studies are for {other[0]}, this worker measures "
                          f"{plan.gpu}: a worker must run on the study's GPU model")


def run_worker(plan, storage, run_id: str, provenance: dict) -> dict:
    """Measure until no shape of ``plan`` has a config left that nobody is measuring."""
    device = bench.default_device(plan.backend)
    copy_bw = bench.copy_bandwidth_gbps(device, **plan.timing)
    winners = outdir.current_winners(plan.out_dir, force=True) if plan.out_dir else None
    deadline = None if plan.time_budget_s is None else time.monotonic() + plan.time_budget_s
    # Each runner's run() fails the trials of workers that died (records.recover_interrupted)
    # before it picks a config, so the runners are built once; the benches are built per pass,
    # so that a shape's inputs leave the device when the worker moves on.
    runners = [(shape, ShapeRunner(plan, shape, storage, run_id, copy_bw, table.lookup_config(winners, shape),
                                   provenance)) for shape in plan.shapes]
    timed = measure_until_done(runners, plan, device, deadline)
    return {"timed": timed, "recovered": sum(runner.recovered for _, runner in runners), "copy_bw_gbps": copy_bw}


def measure_until_done(runners, plan, device, deadline, on_trial=None) -> int:
    """Passes over the (shape, runner) pairs until none has a config left that nobody is
    measuring, or the deadline (time.monotonic()); returns the trials timed."""
    timed = 0
    while True:
        waiting = False
        for shape, runner in runners:
            timed += runner.run(_lazy_bench(plan, shape, device), deadline, on_trial)
            waiting |= runner.running_elsewhere()
            if deadline is not None and time.monotonic() >= deadline:
                return timed
        if not waiting:
            return timed
        time.sleep(POLL_S)


def _lazy_bench(plan, shape, device):
    holder = []

    def factory():
        if not holder:
            holder.append(bench.ShapeBench(shape, backend=plan.backend, device=device,
                                           seed=plan.seed, num_sms=plan.num_sms, **plan.timing))
        return holder[0]
    return factory


def worker_argv(plan, storage: str, run_id: str, name: str) -> list[str]:
    """The ``splitkv-tune worker`` command line of one local worker of ``plan``."""
    argv = [sys.executable, "-m", "splitkv_tune.cli", "worker", "--storage", storage,
            "--gpu", plan.gpu, "--grid", plan.grid.source, "--backend", plan.backend,
            "--sampler", plan.sampler, "--seed", str(plan.seed), "--study-prefix", plan.prefix,
            "--out", str(plan.out_dir), "--name", name, "--run-id", run_id,
            "--warmup-s", repr(plan.timing["warmup_s"]),
            "--min-reps", str(plan.timing["min_reps"]),
            "--max-time-s", repr(plan.timing["max_time_s"])]
    if plan.trials is not None:
        argv += ["--trials", str(plan.trials)]
    if plan.time_budget_s is not None:
        argv += ["--time-budget", repr(plan.time_budget_s)]
    if plan.force:
        argv.append("--force")
    for shape in plan.shapes:
        argv += ["--shapes", space.shape_key(shape)]
    return argv


def start_local_workers(plan, count: int, storage: str, run_id: str) -> dict[str, subprocess.Popen]:
    """Start ``count`` workers; on the cuda backend worker ``i`` sees only GPU ``i``, on the
    reference backend the CPU's threads are shared out."""
    procs = {}
    threads = max(1, (os.cpu_count() or 1) // count)
    for index in range(count):
        name = f"w{index}"
        env = dict(os.environ)
        if plan.backend == "cuda":
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            devices = visible.split(",") if visible else [str(i) for i in range(count)]
            env["CUDA_VISIBLE_DEVICES"] = devices[index % len(devices)]
        else:
            env["OMP_NUM_THREADS"] = str(threads)
        procs[name] = subprocess.Popen(worker_argv(plan, storage, f"{run_id}.{name}", name),
                                       env=env, stdin=subprocess.DEVNULL)
    return procs


def wait_for_workers(procs: dict[str, subprocess.Popen], on_poll=None) -> dict[str, int]:
    """Wait for every worker; stop them all (SIGTERM: each finishes its trial in flight) if
    this process is interrupted or terminated."""
    from splitkv_tune import termination
    try:
        while [p for p in procs.values() if p.poll() is None]:  # poll (reap) every one
            termination.check()
            if on_poll is not None:
                on_poll()
            time.sleep(POLL_S)
    except BaseException:
        for proc in procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in procs.values():
            proc.wait()
        raise
    return {name: proc.returncode for name, proc in procs.items()}


def run_local(plan, storage, run_id, copy_bw, winners, quiet, rebuild) -> dict:
    """Create the studies (recovering stale trials), start the workers, show one progress
    view and keep trials.csv current until they all exit; return their exit codes."""
    from splitkv_tune import progress
    from splitkv_tune import storage as storage_mod
    from splitkv_tune.sweep import REBUILD_EVERY_S, REBUILD_TIME_FACTOR
    for shape in plan.shapes:
        ShapeRunner(plan, shape, storage, run_id, copy_bw, table.lookup_config(winners, shape))
    target = storage_mod.describe(plan.storage, plan.out_dir)
    show = not quiet if quiet is not None else sys.stderr.isatty()
    view = progress.ProgressView(storage, plan, lambda line: print(line, file=sys.stderr))
    rebuild_when_due = progress.Pacer(rebuild, REBUILD_EVERY_S, REBUILD_TIME_FACTOR)

    def on_poll() -> None:
        if show:
            view()
        rebuild_when_due()

    procs = start_local_workers(plan, plan.workers, target, run_id)
    codes = wait_for_workers(procs, on_poll)
    if show:
        view(force=True)
    return codes
