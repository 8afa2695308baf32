"""``splitkv-tune diff``: winners and time ratios per shape against the runs' noise, exit 1
on a regression beyond it, JSON output, trials or heuristics on either side, and A's winners
timed in B's trials."""
import json
from pathlib import Path

import pandas as pd
import pytest
from click.testing import CliRunner

from splitkv_tune.cli import main
from splitkv_tune.diff import diff_tables, read_run
from splitkv_tune.table_schema import CONFIG_COLUMNS, SHAPE_COLUMNS, read_heuristics, read_trials

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


def _winners_timed(trials: pd.DataFrame, table: pd.DataFrame) -> list[float]:
    """Each table winner's time in ``trials`` over the shape's fastest trial, less 1, by pandas."""
    ok = trials[trials["status"] == "ok"]
    out = []
    for _, w in table.iterrows():
        shape = ok[(ok[SHAPE_COLUMNS] == w[SHAPE_COLUMNS]).all(axis=1)]
        cfg = shape[(shape[CONFIG_COLUMNS] == w[CONFIG_COLUMNS]).all(axis=1)]
        if len(cfg):
            out.append(cfg["median_us"].min() / shape["median_us"].min() - 1)
    return out


def test_a_winners_timed_in_b_trials(tmp_path):
    trials = read_trials(TRIALS)
    table_a, _ = read_run(TRIALS, "h200")
    # B: A's first winner 1.5x slower, so another config of that shape may become B's fastest
    w = table_a.iloc[0]
    slower = trials.copy()
    rows = ((slower[SHAPE_COLUMNS] == w[SHAPE_COLUMNS]).all(axis=1)
            & (slower[CONFIG_COLUMNS] == w[CONFIG_COLUMNS]).all(axis=1))
    assert rows.any()
    slower.loc[rows, ["median_us", "p20_us", "p80_us"]] *= 1.5
    path_b = tmp_path / "b.csv"
    slower.to_csv(path_b, index=False)
    result = _run(TRIALS, path_b, "--gpu", "h200", "--json")
    report = json.loads(result.output)
    got = [s["a_winner_regret_in_b"] for s in report["shapes"]]
    expected = _winners_timed(slower, table_a)
    assert len(got) == len(expected) == report["summary"]["a_winners_timed_in_b"]
    assert got == pytest.approx(expected)
    assert got[0] > 0.0 and all(r >= 0.0 for r in got)
    assert report["summary"]["a_winner_regret_in_b_max"] == pytest.approx(max(expected))
    text = _run(TRIALS, path_b, "--gpu", "h200").output
    assert f"{len(expected)} shapes: geometric mean" in text and f"+{got[0] * 100:.1f}%" in text


def test_a_winners_are_not_timed_in_a_heuristics_table():
    result = _run(TRIALS, HEURISTICS, "--gpu", "h200", "--json")
    report = json.loads(result.output)
    assert all(s["a_winner_regret_in_b"] is None for s in report["shapes"])
    assert report["summary"]["a_winners_timed_in_b"] == 0
    assert "timed in B" not in _run(TRIALS, HEURISTICS, "--gpu", "h200").output

