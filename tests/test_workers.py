"""Several worker processes on one storage (journal file), on the reference backend: every
grid point is measured exactly once, a killed worker's trial is retried by another, the merged
results equal a single worker's, and a worker of another GPU model is refused."""
import dataclasses
import multiprocessing
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pandas as pd
import pytest
import yaml
from click.testing import CliRunner

from splitkv_tune import records, shape_study, space, storage as storage_mod, table
from splitkv_tune.cli_sweep import sweep as sweep_cmd
from splitkv_tune.cli_worker import worker as worker_cmd
from splitkv_tune.table_schema import CONFIG_COLUMNS, SHAPE_COLUMNS, read_trials
from splitkv_tune.tunables import Config

REPO = Path(__file__).resolve().parents[1]
TINY_GRID = yaml.safe_load((Path(__file__).parent / "fixtures" / "tiny_grid.yaml").read_text())
POINT = SHAPE_COLUMNS + CONFIG_COLUMNS



@pytest.fixture
def grid(tiny_grid_file):
    return tiny_grid_file(0.2)


def sweep_args(grid, out, *extra):
    return ["--backend", "reference", "--grid", str(grid), "--out", str(out), "--no-progress",
            *extra]



def points(trials: pd.DataFrame) -> set:
    return set(map(tuple, trials[POINT].astype(str).to_numpy()))


def test_two_workers_merge_into_the_results_of_one(grid, tmp_path, assert_every_point_once):
    single, multi = tmp_path / "single", tmp_path / "multi"
    assert CliRunner().invoke(sweep_cmd, sweep_args(grid, single)).exit_code == 0
    result = CliRunner().invoke(sweep_cmd, sweep_args(grid, multi, "--workers", "2"))
    assert result.exit_code == 0, result.output
    trials = assert_every_point_once(multi)
    assert points(trials) == points(assert_every_point_once(single))
    raw = pd.read_csv(multi / "trials.csv")
    assert set(raw.worker) == {"w0", "w1"}  # both took part; each row names its worker
    assert (raw.host == os.uname().nodename).all() and (raw.device == "cpu").all()
    rebuilt = table.build_heuristics(read_trials(multi / "trials.csv"))
    written = pd.read_csv(multi / "heuristics.csv")
    assert len(written) == 2
    pd.testing.assert_frame_equal(written, pd.read_csv(pd.io.common.StringIO(
        rebuilt.to_csv(index=False))))


def test_workers_stop_at_the_trial_target(grid, tmp_path):
    """Three workers on a --trials target below each shape's candidates time exactly the target
    per shape: a worker counts the configs that the others are measuring, and one whose claim
    raced another's backs off (it was one to two over before)."""
    out = tmp_path / "out"
    result = CliRunner().invoke(sweep_cmd, sweep_args(grid, out, "--workers", "3", "--trials", "3"))
    assert result.exit_code == 0, result.output
    trials = read_trials(out / "trials.csv")
    assert trials.groupby(SHAPE_COLUMNS).size().tolist() == [3, 3]
    assert not trials.duplicated(POINT).any()
    storage = storage_mod.open_storage(None, out, repair=False)
    for summary in optuna.get_all_study_summaries(storage):
        study = optuna.load_study(study_name=summary.study_name, storage=storage)
        timed = [t for t in study.trials if records.RECORD_ATTR in t.user_attrs]
        assert len(timed) == 3  # no trial was timed and then dropped as a second measurement


def test_a_claim_steps_back_from_a_later_numbered_trial_that_claimed_first(tmp_path):
    """Trial numbers are given when a trial is asked for, not when it is claimed: a worker whose
    trial is numbered lower but claims a config second must still see the first claim (the lower
    number measured it too before, a one-in-a-few-runs duplicate in the test above)."""
    storage = storage_mod.open_storage(None, tmp_path, repair=False)
    study = optuna.create_study(storage=storage, study_name="race")
    lower, higher, other = study.ask(), study.ask(), study.ask()
    assert lower.number < higher.number
    config = Config(4, 128, 128, "blocks")
    try:
        assert records.claim(higher, config) is None
        assert records.claim(lower, config) == higher.number
        assert records.claim(other, Config(8, 128, 128, "blocks")) is None  # only one config's claims
    finally:
        for trial in (lower, higher, other):
            records.release(trial)


CHASED = [Config(s, b, 128, "blocks") for s in (1, 2, 4, 8) for b in (32, 64, 128)]


def _chase_first_free_config(journal: Path, seed: int) -> None:
    """A worker that always takes the first config neither finished nor claimed, so that
    several of them race for the same one at every step, and 'measures' it when its claim
    holds."""
    random.seed(seed)
    study = optuna.load_study(study_name="race", storage=storage_mod.open_journal(journal, repair=False))
    while True:
        done, running = records.measured_trials(study), records.running_configs(study)
        free = [c for c in CHASED if c not in done and c not in running]
        if not free:
            if not running:
                return
            time.sleep(0.02)
            continue
        study.enqueue_trial(dataclasses.asdict(free[0]))
        trial = study.ask()
        config = Config(**{f: trial.suggest_categorical(f, sorted({getattr(c, f) for c in CHASED}))
                           for f in CONFIG_COLUMNS})
        # As the runner does: step back from another's live claim, and, read after claiming, from
        # a measurement another finished since `done` was read (its claim is no longer live).
        if records.claim(trial, config) is not None or config in records.measured_trials(study):
            study.tell(trial, state=optuna.trial.TrialState.FAIL)
            records.release(trial)
            time.sleep(random.uniform(0.0, 0.05))
            continue
        time.sleep(0.01)
        trial.set_user_attr(records.RECORD_ATTR, {**dataclasses.asdict(config), "status": "ok"})
        study.tell(trial, 1.0)
        records.release(trial)


def test_processes_racing_for_one_config_at_a_time_measure_each_once(tmp_path):
    """Four processes on one journal, all chasing the same next config: every config is
    measured, none twice (the rule before measured some twice in most such runs)."""
    journal = storage_mod.journal_path(str(tmp_path / "race.journal"), None)
    optuna.create_study(storage=storage_mod.open_journal(journal), study_name="race")
    context = multiprocessing.get_context("fork")
    procs = [context.Process(target=_chase_first_free_config, args=(journal, i)) for i in range(4)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=120)
    assert all(proc.exitcode == 0 for proc in procs)
    study = optuna.load_study(study_name="race", storage=storage_mod.open_journal(journal, repair=False))
    measured = [records.config_of(t) for t in study.get_trials() if records.RECORD_ATTR in t.user_attrs]
    assert len(measured) == len(set(measured)) and set(measured) == set(CHASED)


def test_a_sweep_and_a_worker_that_joins_it_stop_at_the_trial_target(tiny_grid_file, tmp_path, request):
    """A worker started beside a running sweep (no --workers) shares its shapes: together they
    time exactly --trials configs a shape, the sweep waiting on the configs the worker is
    finishing rather than timing more."""
    grid, out = tiny_grid_file(1.5, "slower.yaml"), tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cli = [sys.executable, "-m", "splitkv_tune.cli"]
    sweep_proc = subprocess.Popen([*cli, "sweep", *sweep_args(grid, out, "--trials", "3")], env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                  start_new_session=True)
    request.addfinalizer(lambda: kill_session(sweep_proc))
    journal, deadline = out / "optuna.journal", time.monotonic() + 60
    while time.monotonic() < deadline and not (journal.exists() and journal.stat().st_size > 0):
        time.sleep(0.1)
    worker = subprocess.run([*cli, "worker", "--storage", str(journal), "--backend", "reference",
                             "--grid", str(grid), "--trials", "3", "--name", "joined"],
                            env=env, capture_output=True, text=True, timeout=300)
    assert worker.returncode == 0, worker.stderr
    _, stderr = sweep_proc.communicate(timeout=300)
    assert sweep_proc.returncode == 0, stderr
    trials = pd.read_csv(out / "trials.csv")
    assert trials.groupby("study").size().tolist() == [3, 3]
    assert "joined" in set(trials.worker)  # the worker took part


def kill_session(proc) -> None:
    """Kill what is left of ``proc`` and the workers it started (its session)."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


@pytest.fixture
def slow_grid(tiny_grid_file):
    """Trials of a second each: a kill seen mid-trial lands before that trial ends."""
    return tiny_grid_file(1.0, "slow.yaml")


def test_kill_9_of_a_worker_mid_trial_then_the_others_complete(slow_grid, tmp_path, request,
                                                               assert_every_point_once):
    grid, out = slow_grid, tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    coordinator = subprocess.Popen(
        [sys.executable, "-m", "splitkv_tune.cli", "sweep", *sweep_args(grid, out, "--workers",
                                                                         "2")],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True)
    request.addfinalizer(lambda: kill_session(coordinator))
    journal = out / "optuna.journal"
    victim, deadline = None, time.monotonic() + 120
    while victim is None and time.monotonic() < deadline:
        time.sleep(0.1)
        workers = set(_children(coordinator.pid))
        if not workers or not journal.exists():
            continue
        storage = storage_mod.open_storage(None, out, repair=False)
        for summary in optuna.get_all_study_summaries(storage):
            study = optuna.load_study(study_name=summary.study_name, storage=storage)
            for trial in study.get_trials(states=(optuna.trial.TrialState.RUNNING,)):
                owner = trial.user_attrs.get(records.OWNER_ATTR, {})
                if owner.get("pid") in workers:
                    victim = (owner["pid"], summary.study_name, trial.number)
    assert victim is not None, "no worker was seen measuring"
    os.kill(victim[0], 9)
    _, stderr = coordinator.communicate(timeout=300)
    assert coordinator.returncode == 0, stderr
    assert_every_point_once(out)
    trials = pd.read_csv(out / "trials.csv")
    storage = storage_mod.open_storage(None, out, repair=False)
    killed = optuna.load_study(study_name=victim[1], storage=storage).trials[victim[2]]
    assert killed.state == optuna.trial.TrialState.FAIL  # failed as stale, then retried
    assert not ((trials.study == victim[1]) & (trials.trial == victim[2])).any()


def test_a_worker_joins_a_sweep_from_elsewhere(grid, tmp_path, assert_every_point_once):
    """The sweep measured one shape; a worker given the whole grid measures the other."""
    out = tmp_path / "out"
    first = CliRunner().invoke(sweep_cmd, sweep_args(grid, out, "--shapes", "bf16_*"))
    assert first.exit_code == 0, first.output
    journal = str(out / "optuna.journal")
    result = CliRunner().invoke(worker_cmd, ["--storage", journal, "--backend", "reference",
                                             "--grid", str(grid), "--name", "remote"])
    assert result.exit_code == 0, result.output
    resumed = CliRunner().invoke(sweep_cmd, sweep_args(grid, out, "--resume"))
    assert resumed.exit_code == 0, resumed.output
    assert_every_point_once(out)
    assert "remote" in set(pd.read_csv(out / "trials.csv").worker)


def test_a_worker_of_another_gpu_model_is_refused(grid, tmp_path):
    out = tmp_path / "out"
    assert CliRunner().invoke(sweep_cmd, sweep_args(grid, out)).exit_code == 0
    journal = out / "optuna.journal"
    before = journal.read_bytes()
    for extra in ([], ["--study-prefix", "splitkv:cpu_reference:"]):
        result = CliRunner().invoke(worker_cmd, ["--storage", str(journal), "--backend",
                                                 "reference", "--grid", str(grid), "--gpu",
                                                 "h200", "--force", *extra])
        assert result.exit_code == 2, result.output
        assert "nvidia_h200" in result.output and "cpu_reference" in result.output
    assert journal.read_bytes() == before


def test_bad_workers_option(grid, tmp_path):
    for value in ("0", "-2", "many"):
        result = CliRunner().invoke(sweep_cmd, sweep_args(grid, tmp_path / "out", "--workers",
                                                          value))
        assert result.exit_code == 2 and "--workers" in result.output, result.output


def test_progress_view_counts_per_worker_and_gives_an_eta(grid, tmp_path, tiny_grid_trials):
    from splitkv_tune import progress, sweep
    out = tmp_path / "out"
    assert CliRunner().invoke(sweep_cmd, sweep_args(grid, out, "--workers", "2")).exit_code == 0
    plan = sweep.SweepPlan(gpu="cpu_reference", grid=space.parse_grid(TINY_GRID),
                           shapes=list(space.parse_grid(TINY_GRID).shapes), out_dir=out)
    storage = storage_mod.open_storage(None, out)
    snap = progress.snapshot(storage, plan)
    assert snap["done"] == snap["planned"] == tiny_grid_trials
    assert sum(c["done"] for c in snap["per_worker"].values()) == tiny_grid_trials
    assert set(snap["per_worker"]) == {"w0", "w1"}
    lines = []
    view = progress.ProgressView(storage, plan, lines.append)
    view(force=True)
    assert f"{tiny_grid_trials}/{tiny_grid_trials} trials" in lines[0]
    assert "w0:" in lines[0] and "running" in lines[0] and "ETA" in lines[0]


@pytest.mark.parametrize("storage,expected", [("foo://bar", "unknown database"),
                                              ("missing.journal", "no journal")])
def test_worker_with_a_bad_storage(grid, tmp_path, storage, expected):
    target = storage if "://" in storage else str(tmp_path / storage)
    result = CliRunner().invoke(worker_cmd, ["--storage", target, "--backend", "reference",
                                             "--grid", str(grid)])
    assert result.exit_code == 2 and expected in result.output, result.output
    assert not (tmp_path / "missing.journal").exists()


def test_claims_that_race_do_not_end_a_shape_as_duplicates_would(grid, tmp_path, monkeypatch):
    """A run of claims that race another sweep's (more than MAX_DUPLICATE_STREAK of them) leaves
    each shape at its trial target: a race is no sign that the space is spent (they counted as
    duplicates before, and the first shape ended with no trial)."""
    real_claim, races = records.claim, iter(range(shape_study.MAX_DUPLICATE_STREAK + 5))

    def racing_claim(trial, config, worker=None):
        return 0 if next(races, None) is not None else real_claim(trial, config, worker)

    monkeypatch.setattr(records, "claim", racing_claim)
    monkeypatch.setattr(shape_study, "_back_off", lambda: None)
    out = tmp_path / "out"
    result = CliRunner().invoke(sweep_cmd, sweep_args(grid, out, "--trials", "3"))
    assert result.exit_code == 0, result.output
    assert next(races, None) is None  # every race was run into
    trials = read_trials(out / "trials.csv")
    assert trials.groupby(SHAPE_COLUMNS).size().tolist() == [3, 3]
