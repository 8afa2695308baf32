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
    again = restore_cli(out)  # the storage is still there, with every study
    assert again.exit_code == 2 and "already holds study" in again.output and "Traceback" not in again.output

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
    assert str(frame.n.dtype) == "Int64" and frame.median_us.dtype.kind == "f"


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
