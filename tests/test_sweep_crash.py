"""Sweeps that survive kills, torn journals, full disks and a second sweep on the same storage.

Each test reproduces a way a sweep used to lose, redo or corrupt results, on the reference
backend (CPU). Processes are killed for real where the point is a real kill (``kill -9`` at
random points, a kill while the journal lock is held, SIGTERM); everything is bounded in time.
"""
import errno
import json
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

from splitkv_tune import records, storage as storage_mod
from splitkv_tune.cli_sweep import sweep as sweep_cmd
from splitkv_tune.cli_sweep import table as table_cmd
from splitkv_tune.table_schema import CONFIG_COLUMNS, SHAPE_COLUMNS, read_trials


REPO = Path(__file__).resolve().parents[1]
TINY_GRID = yaml.safe_load((Path(__file__).parent / "fixtures" / "tiny_grid.yaml").read_text())


@pytest.fixture
def slow_grid(tiny_grid_file):
    """The tiny grid with trials long enough (~0.2 s) for a kill to land inside one."""
    return tiny_grid_file(0.15, "slow.yaml")



def sweep_args(grid, out, *extra):
    return ["sweep", "--backend", "reference", "--grid", str(grid), "--out", str(out),
            "--no-progress", *extra]


@pytest.fixture
def spawn():
    """Start ``splitkv-tune ARGS`` in a session of its own; whatever is left of it (and of the
    workers it started) when the test ends is killed."""
    started = []

    def start(args, cwd):
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        proc = subprocess.Popen([sys.executable, "-m", "splitkv_tune.cli", *args], cwd=cwd,
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, start_new_session=True)
        started.append(proc)
        return proc

    yield start
    for proc in started:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.communicate()


def run_cli(command, args):
    return CliRunner().invoke(command, args, catch_exceptions=False)



def wait_for_journal_records(journal: Path, count: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if journal.exists() and journal.read_bytes().count(b"\n") >= count:
            return
        time.sleep(0.05)
    raise AssertionError(f"{journal} never reached {count} records")


def test_kill_9_at_random_points_then_resume_loses_and_redoes_nothing(slow_grid, tmp_path,
                                                                        monkeypatch, spawn,
                                                                        assert_every_point_once):
    """Relative --out, as the default results/<gpu>/ is: a kill while the journal lock is held
    used to make every later --resume wait forever."""
    rng = random.Random(os.environ.get("SPLITKV_TEST_SEED", "kill-9"))
    journal = tmp_path / "out" / "optuna.journal"
    for attempt in range(3):
        args = sweep_args(slow_grid, "out", *(["--resume"] if attempt else []))
        proc = spawn(args, tmp_path)
        wait_for_journal_records(journal, 4 + 6 * attempt)
        time.sleep(rng.uniform(0.0, 0.6))
        proc.kill()
        proc.communicate(timeout=30)
    monkeypatch.chdir(tmp_path)
    start = time.monotonic()
    result = run_cli(sweep_cmd, sweep_args(slow_grid, "out", "--resume")[1:])
    assert result.exit_code == 0, result.output
    assert time.monotonic() - start < storage_mod.JOURNAL_LOCK_GRACE_S + 30
    assert_every_point_once(tmp_path / "out")
    assert not list((tmp_path / "out").glob("optuna.journal.lock*"))


def test_a_lock_held_at_a_kill_does_not_hang_resume(slow_grid, tmp_path, monkeypatch,
                                                    assert_every_point_once):
    monkeypatch.chdir(tmp_path)
    assert run_cli(sweep_cmd, sweep_args(slow_grid, "out", "--shapes", "bf16_*")[1:]).exit_code == 0
    journal = storage_mod.journal_path(None, Path("out"))
    holder = (f"import os, sys; sys.path.insert(0, {str(REPO)!r}); "
              f"from splitkv_tune import storage; "
              f"storage._lock(storage.Path({str(journal)!r})).acquire(); "
              f"os.kill(os.getpid(), 9)")
    subprocess.run([sys.executable, "-c", holder], timeout=60)
    assert Path(str(journal) + ".lock").is_symlink()  # held by a process that is gone
    monkeypatch.setattr(storage_mod, "JOURNAL_LOCK_GRACE_S", 3)
    start = time.monotonic()
    result = run_cli(sweep_cmd, sweep_args(slow_grid, "out", "--resume")[1:])
    assert result.exit_code == 0, result.output
    assert time.monotonic() - start < 60
    assert_every_point_once(tmp_path / "out")


def test_a_relative_lock_left_by_an_older_version_is_removed(grid_path, tmp_path, monkeypatch,
                                                             assert_every_point_once):
    monkeypatch.chdir(tmp_path)
    Path("out").mkdir()
    os.symlink("out/optuna.journal", "out/optuna.journal.lock")  # dangles from inside out/
    result = run_cli(sweep_cmd, sweep_args(grid_path, "out")[1:])
    assert result.exit_code == 0, result.output
    assert "pointed nowhere" in result.output
    assert_every_point_once(tmp_path / "out")


@pytest.fixture
def grid_path(tmp_path):
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(TINY_GRID))
    return path


def test_interrupt_while_recording_a_trial_leaves_no_half_measurement(grid_path, tmp_path,
                                                                       monkeypatch,
                                                                       assert_every_point_once):
    """Ctrl-C between the record and the tell: the trial is not a measurement, and it is
    measured again, with all its fields."""
    out = tmp_path / "out"
    original = optuna.Study.tell
    calls = []

    def interrupted_tell(self, trial, *args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return original(self, trial, *args, **kwargs)

    monkeypatch.setattr(optuna.Study, "tell", interrupted_tell)
    assert run_cli(sweep_cmd, sweep_args(grid_path, out)[1:]).exit_code == 130
    monkeypatch.setattr(optuna.Study, "tell", original)
    partial = read_trials(out / "trials.csv")
    assert len(partial) == 2 and partial.run_id.notna().all()
    result = run_cli(sweep_cmd, sweep_args(grid_path, out, "--resume")[1:])
    assert result.exit_code == 0, result.output
    assert_every_point_once(out)


def test_a_trial_killed_after_its_record_was_written_is_measured_again(grid_path, tmp_path):
    """What kill -9 between the record and the tell leaves: a RUNNING trial with an ok record,
    owned by a process that no longer exists."""
    out = tmp_path / "out"
    assert run_cli(sweep_cmd, sweep_args(grid_path, out, "--shapes", "bf16_*")[1:]).exit_code == 0
    storage = storage_mod.open_storage(None, out)
    study = optuna.load_study(study_name=optuna.get_all_study_summaries(storage)[0].study_name,
                              storage=storage)
    first = records.measured_trials(study)
    config, done = next(iter(first.items()))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    trial = study.ask()
    trial.set_user_attr(records.OWNER_ATTR, {**records.this_process(), "pid": dead.pid,
                                             "pid_start": None})
    trial.set_user_attr(records.RECORD_ATTR, {**done.user_attrs[records.RECORD_ATTR],
                                              "run_id": None, "p20_us": None})
    # the kill lands here, before study.tell
    result = run_cli(sweep_cmd, sweep_args(grid_path, out, "--resume", "--shapes", "bf16_*")[1:])
    assert result.exit_code == 0, result.output
    assert study.trials[trial.number].state == optuna.trial.TrialState.FAIL
    trials = read_trials(out / "trials.csv")
    assert not trials.duplicated(SHAPE_COLUMNS + CONFIG_COLUMNS).any()
    assert trials.run_id.notna().all() and trials.p20_us.notna().all()
    assert run_cli(table_cmd, [str(out), "-o", "-"]).exit_code == 0


def test_torn_journal_tail_is_cut_off_and_kept(grid_path, tmp_path, assert_every_point_once):
    out = tmp_path / "out"
    assert run_cli(sweep_cmd, sweep_args(grid_path, out, "--shapes", "bf16_*")[1:]).exit_code == 0
    journal = out / "optuna.journal"
    whole = journal.read_bytes()
    journal.write_bytes(whole + b'{"op_code": 5, "worker_id": "x", "study_id": 0, "us')
    for _ in range(2):  # the second resume reads what the first one appended after the cut
        result = run_cli(sweep_cmd, sweep_args(grid_path, out, "--resume")[1:])
        assert result.exit_code == 0, result.output
    assert "torn record" in result.output or list(out.glob("optuna.journal.torn-*"))
    kept = list(out.glob("optuna.journal.torn-*"))
    assert len(kept) == 1 and kept[0].read_bytes().startswith(b'{"op_code": 5')
    assert all(json.loads(line) for line in journal.read_bytes().splitlines())
    (out / "trials.csv").unlink()
    assert run_cli(table_cmd, [str(out), "--from-storage"]).exit_code == 0
    assert_every_point_once(out)


@pytest.mark.parametrize("content", [b"\x00\x9f\xff binary\n", b"hello\nworld\n",
                                     b'{"op_code": 0}\n{not json}\n{"op_code": 1}\n'])
def test_garbage_journal_is_a_clear_error_and_is_left_alone(grid_path, tmp_path, content):
    out = tmp_path / "out"
    out.mkdir()
    (out / "optuna.journal").write_bytes(content)
    for command, args in ((sweep_cmd, sweep_args(grid_path, out, "--resume")[1:]),
                          (table_cmd, [str(out), "--from-storage"])):
        result = CliRunner().invoke(command, args)
        assert result.exit_code == 2, result.output
        assert "is not an Optuna journal record" in result.output
        assert "Traceback" not in result.output
    assert (out / "optuna.journal").read_bytes() == content


def test_full_disk_is_one_clear_error_and_resume_completes(grid_path, tmp_path, monkeypatch,
                                                           assert_every_point_once):
    out = tmp_path / "out"
    backend = optuna.storages.journal.JournalFileBackend
    original = backend.append_logs
    writes = []

    def full_disk(self, logs):
        writes.append(1)
        if len(writes) < 12:
            return original(self, logs)
        with open(self._file_path, "ab") as handle:  # a part of the record reaches the disk
            handle.write(json.dumps(logs[0]).encode()[:10])
        raise OSError(errno.ENOSPC, "No space left on device", self._file_path)

    monkeypatch.setattr(backend, "append_logs", full_disk)
    result = CliRunner().invoke(sweep_cmd, sweep_args(grid_path, out)[1:])
    assert result.exit_code == 2, result.output
    assert "no space left" in result.output and "optuna.journal" in result.output
    assert isinstance(result.exception, SystemExit)  # one line, no traceback
    monkeypatch.setattr(backend, "append_logs", original)
    result = run_cli(sweep_cmd, sweep_args(grid_path, out, "--resume")[1:])
    assert result.exit_code == 0, result.output
    assert_every_point_once(out)


def test_two_sweeps_on_one_storage_finish_every_point_once(slow_grid, tmp_path, spawn,
                                                           assert_every_point_once):
    procs = [spawn(sweep_args(slow_grid, "out", "--resume"), tmp_path) for _ in range(2)]
    outputs = [p.communicate(timeout=300) for p in procs]
    for proc, (stdout, stderr) in zip(procs, outputs):
        assert proc.returncode == 0, stderr
        assert "UpdateFinishedTrialError" not in stderr
    trials = assert_every_point_once(tmp_path / "out")
    assert trials.run_id.nunique() == 2  # both did part of the work


def test_sigterm_marks_the_run_terminated(slow_grid, tmp_path, spawn):
    proc = spawn(sweep_args(slow_grid, "out"), tmp_path)
    wait_for_journal_records(tmp_path / "out" / "optuna.journal", 4)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 143, stderr[-3000:]
    runs = list((tmp_path / "out" / "runs").glob("*.json"))
    assert [json.loads(r.read_text())["status"] for r in runs] == ["terminated"]
    assert "Traceback" not in stderr


def test_stale_temporaries_of_a_killed_write_are_removed(grid_path, tmp_path):
    out = tmp_path / "out"
    (out / "runs").mkdir(parents=True)
    stale = [out / ".trials.csv.k1ll3d.tmp", out / "runs" / ".20261201T000000Z-dead.json.x.tmp"]
    fresh = out / ".heuristics.csv.wr1t1ng.tmp"  # another process's write in flight
    for path in (*stale, fresh):
        path.write_text("partial")
    old = time.time() - 3600
    for path in stale:
        os.utime(path, (old, old))
    assert run_cli(sweep_cmd, sweep_args(grid_path, out)[1:]).exit_code == 0
    assert not any(p.exists() for p in stale) and fresh.exists()


def test_fresh_sweep_never_overwrites_results_it_did_not_write(grid_path, tmp_path,
                                                               assert_every_point_once):
    out = tmp_path / "out"
    out.mkdir()
    shipped = REPO / "results" / "nvidia_h200"
    for name in ("trials.csv", "heuristics.csv"):
        (out / name).write_bytes((shipped / name).read_bytes())
    before = {n: (out / n).read_bytes() for n in ("trials.csv", "heuristics.csv")}
    result = CliRunner().invoke(sweep_cmd, sweep_args(grid_path, out)[1:])
    assert result.exit_code == 2 and "--force" in result.output, result.output
    assert {n: (out / n).read_bytes() for n in before} == before
    assert not (out / "optuna.journal").exists()
    result = run_cli(sweep_cmd, sweep_args(grid_path, out, "--force")[1:])
    assert result.exit_code == 0, result.output
    assert_every_point_once(out)
    again = run_cli(sweep_cmd, sweep_args(grid_path, out, "--resume")[1:])  # its own: no --force
    assert again.exit_code == 0, again.output


def test_trials_csv_of_a_sweep_with_failures_reads_back(grid_path, tmp_path, monkeypatch):
    """Failed rows have no n: it used to be written as 13.0 and fail every reader."""
    from splitkv_tune import bench
    original = bench.ShapeBench.launchers

    def launchers(self, config):
        if config.num_splits == 4:
            raise ValueError("not instantiated")
        return original(self, config)

    monkeypatch.setattr(bench.ShapeBench, "launchers", launchers)
    out = tmp_path / "out"
    assert run_cli(sweep_cmd, sweep_args(grid_path, out)[1:]).exit_code == 0
    trials = read_trials(out / "trials.csv")
    assert (trials.status == "failed").any() and (trials.status == "ok").any()
    raw = pd.read_csv(out / "trials.csv", dtype=str, keep_default_na=False)
    assert not raw["n"].str.contains(r"\.").any()
    from splitkv_tune.cli_tables import evaluate, plot
    result = run_cli(evaluate, ["--from-trials", str(out / "trials.csv"), "--gpu", "h200"])
    assert result.exit_code == 0 and "regret" in result.output, result.output
    result = run_cli(plot, [str(out / "trials.csv"), "-o", str(tmp_path / "plots" / "p.png")])
    assert result.exit_code == 0 and (tmp_path / "plots" / "p_noise.png").is_file(), result.output
