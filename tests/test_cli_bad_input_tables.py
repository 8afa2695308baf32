"""Bad arguments and files of the table-reading commands (evaluate, compare's --config, table,
batch-table, select, evaluate-batches, plot): one clear line naming the argument, exit code 2, no
traceback, and nothing written."""
from pathlib import Path

import pandas as pd
import pytest
import yaml
from click.testing import CliRunner

from splitkv_tune.cli import main

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = Path(__file__).parent / "fixtures"
TRIALS = FIXTURES / "trials.csv"
TINY_GRID = yaml.safe_load((FIXTURES / "tiny_grid.yaml").read_text())


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


@pytest.fixture
def grid(tmp_path):
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(TINY_GRID))
    return path


@pytest.mark.parametrize("extra", [
    ["--out-trials", "x.csv"], ["--shapes-file", "tiny.yaml"], ["--kv-len", "4096"], ["--backend", "reference"],
    ["--max-time-s", "1"], ["--force"], ["--causal"],
])
def test_evaluate_from_trials_refuses_what_only_a_measured_evaluate_uses(extra, assert_clear_error):
    result = invoke("evaluate", "--gpu", "h200", "--from-trials", TRIALS, *extra)
    assert_clear_error(result, extra[0], "--from-trials times nothing")


def test_evaluate_from_trials_takes_a_measuring_option_given_at_its_default(tmp_path):
    result = invoke("evaluate", "--gpu", "h200", "--from-trials", TRIALS, "--backend", "cuda", "--no-causal",
                    "--out-csv", tmp_path / "e.csv")
    assert result.exit_code == 0, result.output
    assert (tmp_path / "e.csv").is_file()


def test_evaluate_checks_its_timing_budget(grid, assert_clear_error):
    result = invoke("evaluate", "--gpu", "h200", "--backend", "reference", "--shapes-file", grid,
                    "--max-time-s", "-1")
    assert_clear_error(result, "--max-time-s", ">= 0")


def test_evaluate_on_the_reference_backend_without_a_gpu_name(grid, tmp_path, monkeypatch, assert_clear_error):
    """With --gpu auto and no CUDA device, the table's one GPU gives the table and profile (the
    timings are cpu_reference's); without a table, --gpu is asked for, not a traceback."""
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    timed = tmp_path / "timed.csv"
    result = invoke("evaluate", "--backend", "reference", "--shapes-file", grid,
                    "--table", FIXTURES / "heuristics.csv", "--out-trials", timed)
    assert result.exit_code == 0, result.output
    assert "measured on cpu_reference" in result.output and "rows of nvidia_h200" in result.output
    assert set(pd.read_csv(timed)["gpu"]) == {"cpu_reference"}
    assert_clear_error(invoke("evaluate", "--backend", "reference", "--shapes-file", grid), "--gpu", "e.g. --gpu h200")


def test_a_gpu_without_a_table_names_the_absolute_paths_searched(tmp_path, monkeypatch, assert_clear_error):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SPLITKV_TUNE_TABLES", "my-tables")
    result = invoke("select", "--gpu", "gpu_nobody_has", "--kv-len", "4096", "--kv-heads", "8")
    from splitkv_tune.selector import RESULTS_DIR
    assert_clear_error(result, str(tmp_path / "my-tables" / "gpu_nobody_has" / "heuristics.csv"),
                       str(RESULTS_DIR.absolute() / "gpu_nobody_has" / "heuristics.csv"))


@pytest.mark.parametrize("text,expected", [
    ("4,64", "four comma-separated fields"), ("", "four comma-separated fields"),
    ("4,64,128,blocks,extra", "four comma-separated fields"), ("x,64,128,blocks", "must be integers"),
    ("4,64,128,nope", "split_policy"), ("4,48,128,blocks", "block_kv"),
])
def test_compare_config_names_what_is_wrong(grid, tmp_path, text, expected, assert_clear_error):
    result = invoke("compare", "--backend", "reference", "--grid", grid, "--peers", "", "--config", text,
                    "--out", tmp_path / "out")
    assert_clear_error(result, "--config", expected)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("budget", ["0", "0s", "0h0m"])
def test_sweep_refuses_a_time_budget_of_nothing(grid, tmp_path, budget, assert_clear_error):
    result = invoke("sweep", "--backend", "reference", "--grid", grid, "--out", tmp_path / "out",
                    "--time-budget", budget)
    assert_clear_error(result, "--time-budget", "above 0")
    assert not (tmp_path / "out").exists()


def test_table_refuses_a_nan_margin(tmp_path, assert_clear_error):
    result = invoke("table", TRIALS, "--min-margin", "nan", "-o", tmp_path / "h.csv")
    assert_clear_error(result, "--min-margin", "nan")
    assert not (tmp_path / "h.csv").exists()


@pytest.mark.parametrize("column,factor", [("p20_us", 2.0), ("p80_us", 0.5)])
def test_trials_whose_spread_does_not_hold_the_median_are_refused(tmp_path, column, factor, assert_clear_error):
    trials = pd.read_csv(TRIALS, dtype=str, keep_default_na=False)
    row = trials.index[trials["status"] == "ok"][3]
    trials.loc[row, column] = str(float(trials.loc[row, "median_us"]) * factor)
    path = tmp_path / "trials.csv"
    trials.to_csv(path, index=False)
    result = invoke("table", path, "-o", tmp_path / "h.csv")
    assert_clear_error(result, f"row {row + 1} (line {row + 2})", "p20_us <= median_us <= p80_us")
    assert not (tmp_path / "h.csv").exists()


@pytest.mark.parametrize("text", ["[]", '{"a": 1}', '{"_metadata": []}'])
def test_select_names_a_json_that_is_no_export(tmp_path, text, assert_clear_error):
    path = tmp_path / "t.json"
    path.write_text(text)
    result = invoke("select", "--table", path, "--kv-len", "4096", "--kv-heads", "8")
    assert_clear_error(result, str(path), "not an exported splitkv-tune JSON table", "_metadata")


def test_evaluate_batches_report_of_a_missing_csv(tmp_path, assert_clear_error):
    result = invoke("evaluate-batches", "--grid", ROOT / "configs" / "batches_holdout.yaml", "--gpu", "h200",
                    "--csv", tmp_path / "none.csv", "--report-only")
    assert_clear_error(result, "--csv", "does not exist")


def test_batch_table_on_stdout_is_the_file_it_writes(tmp_path):
    csvs = [ROOT / "results" / "nvidia_h200" / "batches" / name for name in ("batches.csv", "batches_dense.csv")]
    written = tmp_path / "t.csv"
    assert invoke("batch-table", *csvs, "--gpu", "h200", "-o", written).exit_code == 0
    result = invoke("batch-table", *csvs, "--gpu", "h200", "-o", "-")
    assert result.exit_code == 0, result.output
    assert written.read_text() in result.output and "wrote stdout" in result.output
    assert not Path("-").exists()


def test_plot_writes_no_figure_when_a_later_input_is_bad(tmp_path, assert_clear_error):
    bad = tmp_path / "bad.csv"
    bad.write_text("a,b\n1,2\n")
    for option in ("--regret", "--batch-regret", "--batches"):
        out = tmp_path / f"plots{option}"
        result = invoke("plot", FIXTURES / "heuristics.csv", "-o", f"{out}/", option, bad)
        assert_clear_error(result, str(bad))
        assert not out.exists() and not list(tmp_path.glob(".plot-*")), option  # no figure, folder or scratch
    out = tmp_path / "good"
    result = invoke("plot", FIXTURES / "heuristics.csv", "-o", f"{out}/")
    assert result.exit_code == 0, result.output
    assert {p.name for p in out.iterdir()} >= {"best_splits.png", "best_splits_noise.svg"}
    assert not [p for p in out.iterdir() if p.name.startswith(".")]


def test_a_dry_run_for_auto_with_no_gpu_asks_for_one(grid, monkeypatch, assert_clear_error):
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert_clear_error(invoke("sweep", "--gpu", "auto", "--grid", grid, "--dry-run"), "--gpu auto found no CUDA device",
                       "name the GPU the dry run plans for, e.g. --gpu h200")


@pytest.mark.parametrize("values,expected", [
    (["128:2", "128:3"], "head dim 128 is given twice"), (["2", "3"], "every head dim is given twice"),
])
def test_residency_given_twice_for_one_head_dim(values, expected, assert_clear_error):
    argv = ["cross-validate-batches", "--grid", ROOT / "configs" / "batches.yaml", "--csv",
            ROOT / "results" / "nvidia_h200" / "batches" / "batches.csv", "--gpu", "h200"]
    for value in values:
        argv += ["--ctas-per-sm", value]
    assert_clear_error(invoke(*argv), "--ctas-per-sm", expected)


def test_a_bad_cell_of_an_exported_json_names_its_entry(tmp_path, assert_clear_error):
    """A JSON file has no rows or lines: its errors name the entry, as the file writes its key."""
    import json
    assert invoke("export", "--format", "json", "--table", FIXTURES / "heuristics.csv", "-o", tmp_path).exit_code == 0
    path = sorted(tmp_path.glob("*.json"))[0]
    doc = json.loads(path.read_text())
    key = [k for k in doc if k != "_metadata"][1]
    doc[key]["num_splits"] = 999
    path.write_text(json.dumps(doc))
    result = invoke("select", "--table", path, "--kv-len", "4096", "--kv-heads", "8")
    assert_clear_error(result, f"entry {key!r}", "num_splits must be in [1, 128], got 999")
    assert "line" not in result.output
