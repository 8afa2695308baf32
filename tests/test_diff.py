"""``splitkv-tune diff``: winners and time ratios per shape against the runs' noise, exit 1
on a regression beyond it, JSON output, trials or heuristics on either side."""
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from splitkv_tune.cli import main
from splitkv_tune.diff import diff_tables
from splitkv_tune.table_schema import read_heuristics

FIXTURES = Path(__file__).resolve().parent / "fixtures"
HEURISTICS = FIXTURES / "heuristics.csv"
TRIALS = FIXTURES / "trials.csv"


def _changed(tmp_path, name, **per_row):
    """The fixture table with row 0's columns changed (times scaled by ``scale``)."""
    df = read_heuristics(HEURISTICS)
    scale = per_row.pop("scale", 1.0)
    for col in ("median_us", "p20_us", "p80_us", "runner_up_us"):
        df.loc[0, col] = df.loc[0, col] * scale
    for col, value in per_row.items():
        df.loc[0, col] = value
    path = tmp_path / name
    df.to_csv(path, index=False)
    return path


def _run(*args):
    return CliRunner().invoke(main, ["diff", *map(str, args)])


def test_identical_runs_exit_0_and_report_every_shape():
    result = _run(HEURISTICS, HEURISTICS)
    n = len(read_heuristics(HEURISTICS))
    assert result.exit_code == 0, result.output
    assert f"{n} shapes compared: 0 regressions, 0 improvements, {n} within noise" in result.output


def test_regression_beyond_noise_exits_1(tmp_path):
    df = read_heuristics(HEURISTICS)
    margin = max(df.loc[0, "noise_margin"], 0.01)
    slower = _changed(tmp_path, "slower.csv", scale=1 + 3 * margin)
    result = _run(HEURISTICS, slower)
    assert result.exit_code == 1 and "1 regressions" in result.output
    noisy = _changed(tmp_path, "noisy.csv", scale=1 + 3 * margin, noise_margin=4 * margin)
    assert _run(HEURISTICS, noisy).exit_code == 0  # inside B's own noise
    faster = _changed(tmp_path, "faster.csv", scale=1 / (1 + 3 * margin))
    result = _run(HEURISTICS, faster)
    assert result.exit_code == 0 and "1 improvements" in result.output


def test_json_report_names_changed_winners(tmp_path):
    df = read_heuristics(HEURISTICS)
    other = _changed(tmp_path, "other.csv", num_splits=int(df.loc[0, "num_splits"]) % 128 + 1)
    result = _run(HEURISTICS, other, "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    changed = [s for s in report["shapes"] if s["winner_changed"]]
    assert len(changed) == 1 and report["summary"]["winners_changed"] == 1
    assert changed[0]["winner_a"]["num_splits"] == int(df.loc[0, "num_splits"])
    assert {"ratio", "margin", "verdict", "best_us_a", "best_us_b"} <= set(changed[0])


def test_trials_against_their_own_table_and_shapes_in_one_run_only():
    result = _run(TRIALS, HEURISTICS, "--gpu", "h200")
    assert result.exit_code == 0, result.output
    df = read_heuristics(HEURISTICS)
    report = diff_tables(df, df.iloc[1:])
    assert len(report["only_in_a"]) == 1 and not report["only_in_b"]
    assert report["summary"]["compared"] == len(df) - 1


@pytest.mark.parametrize("args,needle", [
    (["{tmp}/missing.csv", "{good}"], "no such file"),
    (["{tmp}/bad.csv", "{good}"], "missing columns"),
    (["{good}", "{good}", "--min-margin", "-1"], "--min-margin"),
])
def test_bad_input_exits_2(tmp_path, args, needle):
    (tmp_path / "bad.csv").write_text("a,b\n1,2\n")
    result = _run(*(a.format(tmp=tmp_path, good=HEURISTICS) for a in args))
    assert result.exit_code == 2 and needle in result.output
    assert "Traceback" not in result.output
