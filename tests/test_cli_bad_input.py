"""Every bad argument or file of bench, sweep, table, compare, evaluate, export and plot: one clear line naming it,
exit code 2, no traceback, and nothing already stored touched."""
import json
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from splitkv_tune.cli_sweep import sweep as sweep_cmd
from splitkv_tune.cli_sweep import table as table_cmd
from splitkv_tune.cli_tune import bench as bench_cmd
from splitkv_tune.cli_tune import compare as compare_cmd
from splitkv_tune.cli_tune import env as env_cmd
from splitkv_tune.cli_worker import worker as worker_cmd

ROOT = Path(__file__).resolve().parent.parent

FIXTURES = Path(__file__).parent / "fixtures"
TINY_GRID = yaml.safe_load((FIXTURES / "tiny_grid.yaml").read_text())
TINY_BENCH = ["--backend", "reference", "--batch", "1", "--q-heads", "4", "--kv-heads", "2",
              "--kv-len", "256", "--head-dim", "64", "--splits", "1,2", "--min-reps", "3",
              "--max-time-s", "0", "--warmup-s", "0"]


@pytest.fixture
def grid(tmp_path):
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(TINY_GRID))
    return path


@pytest.fixture
def a_file(tmp_path):
    path = tmp_path / "a_file"
    path.write_text("not a directory")
    return path


def invoke(command, args):
    return CliRunner().invoke(command, args)


def sweep(grid, out, *extra):
    return invoke(sweep_cmd, ["--backend", "reference", "--grid", str(grid), "--out", str(out),
                              "--no-progress", *extra])


@pytest.mark.parametrize("option,value,expected", [
    ("--warmup-s", "nan", "finite"), ("--max-time-s", "nan", "finite"),
    ("--warmup-s", "-1", ">= 0"), ("--max-time-s", "-0.5", ">= 0"),
    ("--max-time-s", "inf", "finite"), ("--min-reps", "0", ">= 1"), ("--min-reps", "-3", ">= 1"),
])
def test_bad_timing_options(grid, tmp_path, option, value, expected, assert_clear_error):
    assert_clear_error(sweep(grid, tmp_path / "out", option, value), option, expected)
    assert_clear_error(invoke(bench_cmd, [*TINY_BENCH, option, value]), option, expected)
    assert not (tmp_path / "out").exists()


def test_timing_from_a_grid_file_is_checked_too(tmp_path, assert_clear_error):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({**TINY_GRID, "timing": {"warmup_s": 0.0, "min_reps": 0,
                                                            "max_time_s": 0.0}}))
    assert_clear_error(sweep(path, tmp_path / "out"), "min_reps", ">= 1")


def test_bad_seed(grid, tmp_path, assert_clear_error):
    assert_clear_error(sweep(grid, tmp_path / "out", "--seed", "-1"), "--seed")


def test_output_paths_under_a_file(grid, tmp_path, a_file, assert_clear_error):
    assert_clear_error(sweep(grid, a_file / "out"), "--out", "is a file")
    assert_clear_error(sweep(grid, tmp_path / "out", "--storage", str(a_file / "j.journal")),
                       "--storage", "is a file")
    assert_clear_error(invoke(bench_cmd, [*TINY_BENCH, "--csv", str(a_file / "b.csv")]),
                       "--csv", "is a file")
    assert not (tmp_path / "out").exists()


def test_output_paths_in_an_unwritable_place(grid, tmp_path, assert_clear_error):
    unwritable = "/proc/splitkv-tune-test/out"
    assert_clear_error(sweep(grid, unwritable), "--out")
    assert_clear_error(invoke(bench_cmd, [*TINY_BENCH, "--csv", unwritable + ".csv"]), "--csv")
    assert_clear_error(invoke(compare_cmd, ["--backend", "reference", "--grid", str(grid),
                                            "--out", unwritable]), "--out")


@pytest.mark.parametrize("url,expected", [
    ("foo://bar", "unknown database 'foo'"),
    ("sqlite:////nonexistent-dir-splitkv/optuna.db", "does not exist"),
    ("sqlite://", "in-memory"),
    ("postgresql://", "--storage"),  # no driver here, or no server: either is named
])
def test_bad_storage_urls(grid, tmp_path, url, expected, assert_clear_error):
    assert_clear_error(sweep(grid, tmp_path / "out", "--storage", url), url, expected)
    assert not (tmp_path / "out" / "trials.csv").exists()


def test_sqlite_is_refused_where_processes_share_it(grid, tmp_path, assert_clear_error):
    """Optuna's SQLite storage can hand one trial to two processes that ask at once; a single
    sweep may use it, several workers may not."""
    url = f"sqlite:///{tmp_path / 'optuna.db'}"
    assert_clear_error(sweep(grid, tmp_path / "out", "--storage", url, "--workers", "2"), url,
                       "--workers share the storage", "journal file")
    assert_clear_error(invoke(worker_cmd, ["--backend", "reference", "--grid", str(grid),
                                           "--storage", url]), url, "SQLite cannot")
    assert not (tmp_path / "optuna.db").exists() and not (tmp_path / "out" / "trials.csv").exists()


@pytest.mark.parametrize("args,expected", [
    (["--batch", "1000000000000"], "--batch"),
    (["--kv-len", str(2**40)], "--kv-len"),
    (["--batch", "4096", "--kv-len", "1048576"], "needs about"),
])
def test_bench_shapes_that_overflow_or_cannot_fit(args, expected, assert_clear_error):
    assert_clear_error(invoke(bench_cmd, ["--backend", "reference", *args]), expected)


def test_sweep_refuses_shapes_that_cannot_fit_and_dry_run_says_why(tmp_path, assert_clear_error):
    huge = {**TINY_GRID, "shapes": [{"dtype": "bf16", "head_dim": 128, "q_heads": 64,
                                     "kv_heads": 8, "batch": 512, "q_len": 1024,
                                     "kv_len": 131072}]}
    path = tmp_path / "huge.yaml"
    path.write_text(yaml.safe_dump(huge))
    result = sweep(path, tmp_path / "out", "--dry-run")
    assert_clear_error(result, "need more memory", "--shapes")
    assert "TOO BIG" in result.output
    assert_clear_error(sweep(path, tmp_path / "out"), "need more memory")
    assert not (tmp_path / "out" / "trials.csv").exists()


def test_dry_run_json_is_backend_aware(tmp_path):
    result = invoke(sweep_cmd, ["--backend", "reference", "--grid", "quick", "--dry-run",
                                "--json", "--out", str(tmp_path / "out")])
    summary = json.loads(result.stdout)
    # Shapes that cannot fit in this machine's memory make it exit 2, saying which.
    assert result.exit_code == (2 if summary["too_big"] else 0), result.output
    assert summary["backend"] == "reference" and summary["total_trials"] > 0
    assert {"estimated_s", "bytes", "fits"} <= set(summary["shapes"][0])
    assert max(r["bytes"] for r in summary["shapes"]) > 1e9
    on_gpu = json.loads(invoke(sweep_cmd, ["--backend", "cuda", "--gpu", "h200", "--grid",
                                           "quick", "--dry-run", "--json"]).stdout)
    assert on_gpu["backend"] == "cuda" and on_gpu["total_trials"] == summary["total_trials"]
    # The reference backend runs attention on the CPU: the quick grid takes far longer there.
    assert summary["estimated_s"] > 10 * on_gpu["estimated_s"]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("content", ["", "garbage,\n\x00\x01", "a,b\n1,2\n"])
def test_table_rejects_empty_and_garbage_trials(tmp_path, content, assert_clear_error):
    trials = tmp_path / "trials.csv"
    trials.write_text(content)
    result = invoke(table_cmd, [str(trials), "-o", str(tmp_path / "h.csv")])
    assert_clear_error(result, "trials.csv")
    assert not (tmp_path / "h.csv").exists()


def test_table_rejects_invalid_rows_instead_of_writing_an_invalid_table(tmp_path, assert_clear_error):
    rows = (FIXTURES / "trials.csv").read_text().splitlines()
    header = rows[0].split(",")
    bad = rows[1].split(",")
    bad[header.index("num_splits")] = "1.5"
    trials = tmp_path / "trials.csv"
    trials.write_text("\n".join([rows[0], ",".join(bad), *rows[2:]]) + "\n")
    assert_clear_error(invoke(table_cmd, [str(trials), "-o", str(tmp_path / "h.csv")]),
                       "num_splits must be an integer")
    assert not (tmp_path / "h.csv").exists()


def test_table_output_to_stdout_and_under_a_file(tmp_path, a_file, assert_clear_error):
    result = invoke(table_cmd, [str(FIXTURES / "trials.csv"), "-o", "-"])
    assert result.exit_code == 0, result.output
    assert result.output.startswith("schema_version,gpu,")
    assert_clear_error(invoke(table_cmd, [str(FIXTURES / "trials.csv"), "-o",
                                          str(a_file / "h.csv")]), "-o", "is a file")


def test_garbage_heuristics_at_sweep_start(grid, tmp_path, assert_clear_error):
    out = tmp_path / "out"
    assert sweep(grid, out).exit_code == 0
    (out / "heuristics.csv").write_text("schema_version,gpu\nnot,a table\n")
    assert_clear_error(sweep(grid, out, "--resume"), "heuristics.csv")
    assert (out / "heuristics.csv").read_text() == "schema_version,gpu\nnot,a table\n"


def test_garbage_table_given_to_compare(grid, tmp_path, assert_clear_error):
    bad = tmp_path / "h.csv"
    bad.write_bytes(b"\x00\xff\xfe garbage")
    result = invoke(compare_cmd, ["--backend", "reference", "--grid", str(grid), "--table",
                                  str(bad), "--out", str(tmp_path / "cmp")])
    assert_clear_error(result, "h.csv")
    assert not (tmp_path / "cmp").exists()


def test_bench_json_and_csv_to_stdout():
    result = invoke(bench_cmd, [*TINY_BENCH, "--json"])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.output)
    assert sorted(r["num_splits"] for r in payload["rows"]) == [1, 2]
    result = invoke(bench_cmd, [*TINY_BENCH, "--csv", "-"])
    assert result.exit_code == 0 and result.output.startswith("impl,num_splits,block_kv,")


def test_env_says_whether_the_cuda_extension_is_built():
    info = json.loads(invoke(env_cmd, ["--json"]).output)
    assert isinstance(info["cuda_extension"]["built"], bool)
    assert info["cuda_extension"]["built"] or info["cuda_extension"]["error"]


def _table_commands():
    from splitkv_tune.cli_tables import evaluate, export, plot
    trials = str(ROOT / "results" / "nvidia_h200" / "trials.csv")
    heur = str(ROOT / "results" / "nvidia_h200" / "heuristics.csv")
    yield "evaluate --out-csv", evaluate, ["--from-trials", trials, "--gpu", "h200", "--out-csv"]
    yield "evaluate --out-md", evaluate, ["--from-trials", trials, "--gpu", "h200", "--out-md"]
    yield "export -o", export, ["--format", "cpp-header", "--table", heur, "--gpu", "h200", "-o"]
    yield "plot -o", plot, [heur, "-o"]


@pytest.mark.parametrize("command,args", [pytest.param(c, a, id=n) for n, c, a in _table_commands()])
def test_table_command_outputs_under_a_regular_file(tmp_path, command, args, assert_clear_error):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    result = invoke(command, [*args, str(blocker / "out.x")])
    assert_clear_error(result, args[-1])
    assert blocker.read_text() == "x"


def test_select_json(tmp_path):
    from splitkv_tune.cli_tables import select
    result = invoke(select, ["--gpu", "h200", "--batch", "2", "--q-heads", "32", "--kv-heads", "8",
                             "--kv-len", "30000", "--json"])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.output)
    assert payload["num_splits"] >= 1 and payload["block_kv"] in (32, 64, 128) and payload["why"]
