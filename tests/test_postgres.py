"""Sweeps on a real PostgreSQL server through Optuna's RDB storage: several worker processes,
a worker killed mid-trial (its heartbeat stops, another worker retries it), bad URLs, an
unreachable server and a schema from another version.

The server is started for this module in a temporary directory (initdb, pg_ctl) on a free
loopback port and stopped afterwards. The tests skip when no PostgreSQL server binaries or no
psycopg driver are installed here; ``.ci/run`` installs both, so they run in CI.
"""
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import optuna
import pandas as pd
import pytest
import yaml
from click.testing import CliRunner

from splitkv_tune import records, space, storage as storage_mod
from splitkv_tune.cli_sweep import sweep as sweep_cmd
from splitkv_tune.cli_sweep import table as table_cmd
from splitkv_tune.cli_worker import worker as worker_cmd
from splitkv_tune.table_schema import CONFIG_COLUMNS, SHAPE_COLUMNS, read_trials

REPO = Path(__file__).resolve().parents[1]
TINY_GRID = yaml.safe_load((Path(__file__).parent / "fixtures" / "tiny_grid.yaml").read_text())


def _server_bin() -> Path | None:
    for candidate in [shutil.which("initdb"), *sorted(Path("/usr/lib/postgresql").glob(
            "*/bin/initdb"), reverse=True)]:
        if candidate and Path(candidate).exists():
            return Path(candidate).resolve().parent
    return None


SERVER_BIN = _server_bin()
DRIVER = importlib.util.find_spec("psycopg") or importlib.util.find_spec("psycopg2")
pytestmark = pytest.mark.skipif(
    (SERVER_BIN is None and not os.environ.get("SPLITKV_TEST_POSTGRES_URL")) or DRIVER is None,
    reason="needs the PostgreSQL server (Debian package postgresql) and psycopg; "
           ".ci/run installs both")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _as_postgres(cmd: list[str]) -> list[str]:
    """PostgreSQL refuses to run as root: run its tools as the postgres user there."""
    return ["runuser", "-u", "postgres", "--", *cmd] if os.geteuid() == 0 else cmd


@pytest.fixture(scope="module")
def postgres():
    """URL of a PostgreSQL server: ``SPLITKV_TEST_POSTGRES_URL`` (the one ``.ci/run`` starts),
    else a fresh one, stopped (and its files removed) afterwards."""
    given = os.environ.get("SPLITKV_TEST_POSTGRES_URL")
    if given:
        yield given
        return
    root = Path(tempfile.mkdtemp(prefix="splitkv-pg-"))  # not under pytest's root-only tmp
    data = root / "data"
    if os.geteuid() == 0:
        shutil.chown(root, "postgres")
    port = _free_port()
    subprocess.run(_as_postgres([str(SERVER_BIN / "initdb"), "-D", str(data), "-U", "splitkv",
                                 "--auth=trust"]), check=True, capture_output=True, timeout=120)
    subprocess.run(_as_postgres([str(SERVER_BIN / "pg_ctl"), "-D", str(data), "-l",
                                 str(root / "log"), "-w", "-t", "60", "-o",
                                 f"-p {port} -k {root} -c listen_addresses=127.0.0.1", "start"]),
                   check=True, capture_output=True, timeout=120)
    try:
        yield f"postgresql://splitkv@127.0.0.1:{port}/postgres"
    finally:
        subprocess.run(_as_postgres([str(SERVER_BIN / "pg_ctl"), "-D", str(data), "-m", "fast",
                                     "-w", "stop"]), capture_output=True, timeout=120)
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def database(postgres, request):
    """A database of its own for each test."""
    from sqlalchemy import create_engine, text
    name = "t_" + request.node.name.lower().replace("[", "_").replace("]", "")[:50]
    engine = create_engine(storage_mod._with_driver(postgres), isolation_level="AUTOCOMMIT")
    with engine.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{name}"'))
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    engine.dispose()
    return postgres.rsplit("/", 1)[0] + "/" + name


@pytest.fixture
def grid(tiny_grid_file):
    return tiny_grid_file(0.2)



def sweep_args(grid, out, storage, *extra):
    return ["--backend", "reference", "--grid", str(grid), "--out", str(out), "--storage",
            storage, "--no-progress", *extra]



def test_two_workers_on_postgres_merge_into_the_results_of_one(grid, tmp_path, database,
                                                               assert_every_point_once):
    single = CliRunner().invoke(sweep_cmd, sweep_args(grid, tmp_path / "single",
                                                      str(tmp_path / "single.journal")))
    assert single.exit_code == 0, single.output
    result = CliRunner().invoke(sweep_cmd, sweep_args(grid, tmp_path / "multi", database,
                                                      "--workers", "2"))
    assert result.exit_code == 0, result.output
    multi = assert_every_point_once(tmp_path / "multi")
    (tmp_path / "multi" / "trials.csv").unlink()
    rebuilt = CliRunner().invoke(table_cmd, [str(tmp_path / "multi"), "--from-storage",
                                             "--storage", database])
    assert rebuilt.exit_code == 0, rebuilt.output
    assert len(assert_every_point_once(tmp_path / "multi")) == len(multi)
    key = SHAPE_COLUMNS + CONFIG_COLUMNS
    assert set(map(tuple, multi[key].astype(str).to_numpy())) == \
        set(map(tuple, assert_every_point_once(tmp_path / "single")[key].astype(str).to_numpy()))
    assert set(pd.read_csv(tmp_path / "multi" / "trials.csv").worker) == {"w0", "w1"}


def test_a_killed_workers_trial_is_retried_after_its_heartbeat_stops(grid, tmp_path, database,
                                                                      monkeypatch):
    """A worker on "another machine" (a foreign host name, so only the heartbeat can tell it
    is gone) dies mid-trial; a second worker fails it as stale, and it is retried."""
    out = tmp_path / "out"
    first = CliRunner().invoke(sweep_cmd, sweep_args(grid, out, database, "--shapes", "bf16_*",
                                                     "--trials", "1", "--sampler", "grid"))
    assert first.exit_code == 0, first.output
    storage = storage_mod.open_storage(database, out)
    name = optuna.get_all_study_summaries(storage)[0].study_name
    study = optuna.load_study(study_name=name, storage=storage)
    victim = study.ask()
    victim.set_user_attr(records.OWNER_ATTR, {"host": "elsewhere", "pid": 1, "pid_start": None})
    storage.record_heartbeat(victim._trial_id)  # it beat once, then its machine went away
    monkeypatch.setattr(storage_mod, "HEARTBEAT_GRACE_S", 2)
    time.sleep(3)
    result = CliRunner().invoke(worker_cmd, ["--storage", database, "--backend", "reference",
                                             "--grid", str(grid), "--shapes", "bf16_*"])
    assert result.exit_code == 0, result.output
    trials = study.trials
    assert trials[victim.number].state == optuna.trial.TrialState.FAIL
    retried = [t for t in trials if t.system_attrs.get("failed_trial") == victim.number]
    assert len(retried) == 1 and retried[0].state.is_finished()  # Optuna's retry, run once
    resumed = CliRunner().invoke(sweep_cmd, sweep_args(grid, out, database, "--resume",
                                                       "--shapes", "bf16_*"))
    assert resumed.exit_code == 0, resumed.output
    done = read_trials(out / "trials.csv")
    assert not done.duplicated(SHAPE_COLUMNS + CONFIG_COLUMNS).any()
    shape = space.parse_grid(TINY_GRID).shapes[0]
    assert len(done) == len(space.candidate_configs(
        shape, space.parse_grid(TINY_GRID).space,
        extra_splits=[space.fa2_config(shape, 132).num_splits]))


def kill_session(proc) -> None:
    """Kill what is left of ``proc`` and the workers it started (its session)."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()


def test_kill_9_of_a_postgres_worker_then_completion(grid, tmp_path, database, request,
                                                     assert_every_point_once):
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "splitkv_tune.cli", "sweep",
           *sweep_args(grid, out, database, "--workers", "2")]
    coordinator = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   text=True, start_new_session=True)
    request.addfinalizer(lambda: kill_session(coordinator))
    deadline, killed = time.monotonic() + 120, None
    storage = None
    while killed is None and time.monotonic() < deadline:
        time.sleep(0.2)
        try:
            storage = storage or storage_mod.open_storage(database, out)
            summaries = optuna.get_all_study_summaries(storage)
        except storage_mod.StorageError:
            continue
        for summary in summaries:
            study = optuna.load_study(study_name=summary.study_name, storage=storage)
            for trial in study.get_trials(states=(optuna.trial.TrialState.RUNNING,)):
                pid = trial.user_attrs.get(records.OWNER_ATTR, {}).get("pid")
                if pid and pid != coordinator.pid:
                    os.kill(pid, 9)
                    killed = pid
                    break
            if killed:
                break
    assert killed, "no worker was seen measuring"
    _, stderr = coordinator.communicate(timeout=300)
    assert coordinator.returncode == 0, stderr
    assert_every_point_once(out)


@pytest.mark.parametrize("url", ["postgresql://splitkv@127.0.0.1:1/none",
                                 "postgresql://splitkv@no-such-host.invalid/db"])
def test_unreachable_database_is_a_clear_error(grid, tmp_path, url):
    result = CliRunner().invoke(sweep_cmd, sweep_args(grid, tmp_path / "out", url))
    assert result.exit_code == 2, result.output
    assert "cannot use the database" in result.output and "Traceback" not in result.output
    assert not (tmp_path / "out").exists()


def test_schema_of_another_version_is_refused_and_left_alone(grid, tmp_path, database):
    from sqlalchemy import create_engine, text
    assert CliRunner().invoke(sweep_cmd, sweep_args(grid, tmp_path / "a", database)).exit_code == 0
    engine = create_engine(storage_mod._with_driver(database))
    with engine.begin() as conn:
        conn.execute(text("UPDATE version_info SET schema_version = 1, library_version = '1.0.0'"))
        conn.execute(text("UPDATE alembic_version SET version_num = 'v1.3.0.a'"))
    result = CliRunner().invoke(sweep_cmd, sweep_args(grid, tmp_path / "b", database, "--resume"))
    assert result.exit_code == 2, result.output
    assert "--storage" in result.output and "Traceback" not in result.output
    with engine.connect() as conn:
        assert conn.execute(text("SELECT version_num FROM alembic_version")).scalar() == "v1.3.0.a"
    engine.dispose()


def test_studies_of_another_splitkv_version_are_refused(grid, tmp_path, database):
    storage = storage_mod.open_storage(database, tmp_path)
    name = "splitkv:cpu_reference:" + space.shape_key(space.parse_grid(TINY_GRID).shapes[0])
    study = optuna.create_study(study_name=name, storage=storage)
    trial = study.ask()
    trial.set_user_attr("status", "ok")  # how earlier versions stored a trial: one attr per field
    study.tell(trial, 1.0)
    result = CliRunner().invoke(sweep_cmd, sweep_args(grid, tmp_path / "out", database,
                                                      "--resume", "--force"))
    assert result.exit_code == 2, result.output
    assert "another version of splitkv-tune" in result.output
    assert len(optuna.load_study(study_name=name, storage=storage).trials) == 1
