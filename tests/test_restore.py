"""restore-storage: a sweep's lost journal rebuilt from its trials.csv, and a resume on it."""
from pathlib import Path

import optuna
import pandas as pd
import pytest
import yaml
from click.testing import CliRunner

from splitkv_tune import bench, records, restore, storage as storage_mod
from splitkv_tune.cli_sweep import restore_storage as restore_cmd
from splitkv_tune.cli_sweep import sweep as sweep_cmd

TINY_GRID = yaml.safe_load((Path(__file__).parent / "fixtures" / "tiny_grid.yaml").read_text())


def killed_sweep(tmp_path, monkeypatch, *extra):
    """A tiny grid's sweep, killed in its seventh trial: (grid file, out dir, trials.csv text)."""
    grid = tmp_path / "tiny.yaml"
    grid.write_text(yaml.safe_dump(TINY_GRID))
    out = tmp_path / "out"
    original = bench.ShapeBench.measure
    calls = []

    def killed(self, config):
        calls.append(config)
        if len(calls) == 7:
            raise KeyboardInterrupt
        return original(self, config)

    monkeypatch.setattr(bench.ShapeBench, "measure", killed)
    result = sweep(grid, out, *extra)
    assert result.exit_code == 130
    monkeypatch.setattr(bench.ShapeBench, "measure", original)
    return grid, out, (out / "trials.csv").read_text()


@pytest.fixture
def swept(tmp_path, monkeypatch):
    return killed_sweep(tmp_path, monkeypatch)


def sweep(grid, out, *extra):
    args = ["--backend", "reference", "--grid", str(grid), "--out", str(out), "--no-progress", *extra]
    return CliRunner().invoke(sweep_cmd, args, catch_exceptions=False)


def restore_cli(*args):
    return CliRunner().invoke(restore_cmd, [str(a) for a in args], catch_exceptions=False)


def test_a_restored_journal_gives_back_the_same_trials_and_the_resume_goes_on(swept, monkeypatch):
    grid, out, before = swept
    frame = pd.read_csv(out / "trials.csv")
    assert 0 < len(frame) < 7 and frame.study.nunique() >= 1
    (out / "optuna.journal").unlink()
    refused = sweep(grid, out, "--resume")  # the storage is gone: the results are not its
    assert refused.exit_code == 2 and "restore-storage" in refused.output

    result = restore_cli(out)
    assert result.exit_code == 0, result.output
    assert f"restored {frame.study.nunique()} studies, {len(frame)} trials" in result.output
    opened = storage_mod.open_storage(None, out)
    rebuilt = records.trials_frame(opened)
    assert rebuilt.to_csv(index=False) == before  # the same rows, trial numbers, records

    timed = []
    original = bench.ShapeBench.measure
    monkeypatch.setattr(bench.ShapeBench, "measure", lambda self, c: timed.append(c) or original(self, c))
    resumed = sweep(grid, out, "--resume")
    assert resumed.exit_code == 0, resumed.output
    after = pd.read_csv(out / "trials.csv")
    key = ["study", "num_splits", "block_kv", "reduce_threads", "split_policy"]
    assert not after.duplicated(key).any()
    assert len(after) == len(frame) + len(timed)  # only configs trials.csv did not hold were timed
    kept = after.merge(frame, on=key, suffixes=("", "_before"))
    assert len(kept) == len(frame) and (kept.median_us == kept.median_us_before).all()


def test_a_gap_in_the_trial_numbers_is_a_failed_trial_without_a_record(swept, tmp_path):
    _, out, _ = swept
    frame = pd.read_csv(out / "trials.csv")
    study = frame.study.iloc[0]
    gapped = frame.copy()
    gapped.loc[gapped.study == study, "trial"] += 2  # numbers 0 and 1 are not in the file
    path = tmp_path / "gapped" / "trials.csv"
    path.parent.mkdir()
    gapped.to_csv(path, index=False)
    result = restore_cli(path)
    assert result.exit_code == 0, result.output
    loaded = optuna.load_study(study_name=study, storage=storage_mod.open_storage(None, path.parent))
    first = loaded.get_trials(deepcopy=False)[:2]
    assert [t.state for t in first] == [optuna.trial.TrialState.FAIL] * 2
    assert not any(records.is_measurement(t) for t in first)
    rebuilt = records.trials_frame(storage_mod.open_storage(None, path.parent))
    assert rebuilt[rebuilt.study == study].trial.tolist() == sorted(gapped[gapped.study == study].trial)


def test_bad_input_is_refused_before_anything_is_written(swept, tmp_path):
    _, out, _ = swept
    again = restore_cli(out)  # the journal is still there
    assert again.exit_code == 2 and "optuna.journal exists" in again.output
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    optuna.create_study(storage=url, study_name="another sweep's study")
    assert restore_cli(out, "--storage", url).exit_code == 0  # beside studies of its own
    again = restore_cli(out, "--storage", url)  # a database that holds the studies already
    assert again.exit_code == 2 and "already holds study" in again.output

    table = tmp_path / "table"
    table.mkdir()
    (table / "trials.csv").write_text(
        pd.read_csv(out / "trials.csv").drop(columns=["study", "worker"]).to_csv(index=False))
    result = restore_cli(table)
    assert result.exit_code == 2 and "not a trials.csv that a sweep wrote" in result.output
    assert not (table / "optuna.journal").exists()

    broken = tmp_path / "broken"
    broken.mkdir()
    rows = pd.read_csv(out / "trials.csv", dtype=str, keep_default_na=False)
    rows.loc[0, "median_us"] = "soon"
    rows.to_csv(broken / "trials.csv", index=False)
    result = restore_cli(broken)
    assert result.exit_code == 2 and "median_us" in result.output
    assert not (broken / "optuna.journal").exists()

    twice = tmp_path / "twice"
    twice.mkdir()
    rows = pd.read_csv(out / "trials.csv")
    pd.concat([rows, rows.iloc[:1]]).to_csv(twice / "trials.csv", index=False)
    result = restore_cli(twice)
    assert result.exit_code == 2 and "appears twice" in result.output
    assert not (twice / "optuna.journal").exists()


def test_the_reader_keeps_every_record_column_typed_as_the_sweep_stored_it(swept):
    _, out, _ = swept
    frame = restore.read_sweep_trials(out / "trials.csv")
    assert list(frame.columns) == list(pd.read_csv(out / "trials.csv").columns)
    assert frame.n.dtype.kind == "i" and str(frame.input_sets.dtype) == "Int64"
    assert frame.median_us.dtype.kind == "f" and frame.iqr_us.dtype.kind == "f"


@pytest.mark.parametrize("column,value,message", [
    ("trial", "abc", "trial is 'abc', not an integer of 0 or more"),
    ("trial", "1.5", "trial is '1.5'"),
    ("trial", "-1", "trial is '-1'"),
    ("trial", "", "trial is empty"),
    ("study", "", "study is empty"),
    ("iqr_us", "abc", "iqr_us is 'abc', not a number"),
    ("input_sets", "2.5", "input_sets is '2.5'"),
    ("trial", "3000000", "a typo in the trial column"),
])
def test_a_bad_cell_is_one_error_line_and_no_journal(swept, tmp_path, column, value, message):
    _, out, _ = swept
    rows = pd.read_csv(out / "trials.csv", dtype=str, keep_default_na=False)
    rows.loc[len(rows) - 1, column] = value
    path = tmp_path / "bad"
    path.mkdir()
    rows.to_csv(path / "trials.csv", index=False)
    result = restore_cli(path)
    assert result.exit_code == 2 and message in result.output and "Traceback" not in result.output
    assert list(path.iterdir()) == [path / "trials.csv"]


def test_cells_padded_with_spaces_read_as_the_table_reader_reads_them(swept, tmp_path):
    _, out, before = swept
    rows = pd.read_csv(out / "trials.csv", dtype=str, keep_default_na=False)
    rows["status"] = " " + rows["status"]
    path = tmp_path / "padded"
    path.mkdir()
    rows.to_csv(path / "trials.csv", index=False)
    assert restore_cli(path).exit_code == 0
    assert records.trials_frame(storage_mod.open_storage(None, path)).to_csv(index=False) == before


def test_a_restore_that_fails_midway_leaves_nothing(swept, tmp_path, monkeypatch):
    _, out, _ = swept
    path = tmp_path / "midway"
    path.mkdir()
    (path / "trials.csv").write_text((out / "trials.csv").read_text())
    written = []
    original = restore._study_trials

    def fails(rows, columns):  # after its study was created
        written.append(rows)
        raise KeyboardInterrupt

    monkeypatch.setattr(restore, "_study_trials", fails)
    assert restore_cli(path).exit_code == 1  # click's "Aborted!"
    assert list(path.iterdir()) == [path / "trials.csv"]  # no journal, no temporary, no lock
    written.clear()
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    assert restore_cli(path, "--storage", url).exit_code == 1
    assert written and optuna.get_all_study_summaries(url) == []  # the study it created is deleted
    monkeypatch.setattr(restore, "_study_trials", original)
    assert restore_cli(path, "--storage", url).exit_code == 0


def test_a_tpe_study_left_half_done_resumes_on_a_restored_journal(tmp_path, monkeypatch):
    """Its sampler asks for parameters over the shape's candidates, which trials.csv does not
    list: the restored trials must not fix other choices for them."""
    args = ("--sampler", "tpe", "--trials", "5")
    grid, out, _ = killed_sweep(tmp_path, monkeypatch, *args)
    half = pd.read_csv(out / "trials.csv")
    assert half.study.value_counts().min() < 5  # a study with trials, and trials still to do
    (out / "optuna.journal").unlink()
    assert restore_cli(out).exit_code == 0
    resumed = sweep(grid, out, "--resume", *args)
    assert resumed.exit_code == 0, resumed.output
    after = pd.read_csv(out / "trials.csv")
    assert (after.study.value_counts() == 5).all() and len(after) > len(half)
    assert not after.duplicated(["study", "num_splits", "block_kv", "reduce_threads", "split_policy"]).any()
