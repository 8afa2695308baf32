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
    (["{good}", "{good}", "--min-margin", "nan"], "--min-margin"),
    (["{tmp}/zero.csv", "{good}"], "median_us must be > 0"),
    (["{good}", "{tmp}/zero.csv"], "median_us must be > 0"),
    (["{tmp}/zero_trials.csv", "{good}", "--gpu", "h200"], "status ok but median_us is 0.0"),
])
def test_bad_input_exits_2(tmp_path, args, needle):
    (tmp_path / "bad.csv").write_text("a,b\n1,2\n")
    table = pd.read_csv(HEURISTICS, dtype=str, keep_default_na=False)
    table.loc[0, ["p20_us", "median_us"]] = "0"  # a time of 0 would be divided by
    table.to_csv(tmp_path / "zero.csv", index=False)
    trials = pd.read_csv(TRIALS, dtype=str, keep_default_na=False)
    trials.loc[trials["status"] == "ok", ["p20_us", "median_us"]] = "0"
    trials.to_csv(tmp_path / "zero_trials.csv", index=False)
    result = _run(*(a.format(tmp=tmp_path, good=HEURISTICS) for a in args))
    assert result.exit_code == 2 and needle in result.output
    assert "Traceback" not in result.output


def _config_time(trials: pd.DataFrame, row) -> float:
    """The fastest successful trial of ``row``'s shape and config, by pandas (NaN: none)."""
    ok = trials[trials["status"] == "ok"]
    same = ((ok[SHAPE_COLUMNS] == row[SHAPE_COLUMNS]).all(axis=1)
            & (ok[CONFIG_COLUMNS] == row[CONFIG_COLUMNS]).all(axis=1))
    return ok.loc[same, "median_us"].min()


def _slowed_trials(tmp_path, status=None, scale=1.5):
    """The fixture trials with A's first winner's trials ``scale`` times slower (or, with
    ``status``, of that status): the file and its trials."""
    trials = read_trials(TRIALS)
    table_a, _ = read_run(TRIALS, "h200")
    w = table_a.iloc[0]
    rows = ((trials[SHAPE_COLUMNS] == w[SHAPE_COLUMNS]).all(axis=1)
            & (trials[CONFIG_COLUMNS] == w[CONFIG_COLUMNS]).all(axis=1))
    assert rows.any()
    if status is None:
        trials.loc[rows, ["median_us", "p20_us", "p80_us"]] *= scale
    else:
        trials.loc[rows, "status"] = status
    path = tmp_path / "b.csv"
    trials.to_csv(path, index=False)
    return path, trials


@pytest.mark.parametrize("a", [TRIALS, HEURISTICS], ids=["trials", "heuristics"])
def test_a_winners_timed_in_b_trials(tmp_path, a):
    path_b, trials_b = _slowed_trials(tmp_path)
    table_a, _ = read_run(a, "h200")
    table_b, _ = read_run(path_b, "h200")
    result = _run(a, path_b, "--gpu", "h200", "--json")
    report = json.loads(result.output)
    winners_b = {tuple(r[SHAPE_COLUMNS]): r for _, r in table_b.iterrows()}
    expected = []
    for _, w in table_a.iterrows():
        t = _config_time(trials_b, w)
        if t == t:
            expected.append(t / _config_time(trials_b, winners_b[tuple(w[SHAPE_COLUMNS])]) - 1)
    got = [s["a_winner_regret_in_b"] for s in report["shapes"] if s["a_winner_regret_in_b"] is not None]
    assert len(got) == len(expected) == report["summary"]["a_winners_timed_in_b"] > 0
    assert got == pytest.approx(expected)
    assert report["summary"]["a_winner_regret_in_b_max"] == pytest.approx(max(expected))
    if a == TRIALS:  # the slowed winner lost its place, and costs its time over the new winner's
        assert got[0] > 0.0
    assert result.exit_code == (1 if report["summary"]["regression"] else 0)
    text = _run(a, path_b, "--gpu", "h200").output
    assert f"{len(expected)} shapes: geometric mean" in text and f"{got[0] * 100:+.1f}%" in text


def test_a_winners_in_b_are_zero_where_nothing_changed():
    report = json.loads(_run(TRIALS, TRIALS, "--gpu", "h200", "--json").output)
    assert report["summary"]["a_winners_timed_in_b"] == report["summary"]["compared"]
    assert all(s["a_winner_regret_in_b"] == 0.0 for s in report["shapes"])


@pytest.mark.parametrize("status", ["failed", "wrong"])
def test_a_winner_failed_in_b_is_reported_and_exits_1(tmp_path, status):
    path_b, _ = _slowed_trials(tmp_path, status=status)
    result = _run(TRIALS, path_b, "--gpu", "h200", "--json")
    report = json.loads(result.output)
    failed = [s for s in report["shapes"] if s["a_winner_failed_in_b"]]
    assert len(failed) == 1 == report["summary"]["a_winners_failed_in_b"]
    assert failed[0]["a_winner_regret_in_b"] is None and result.exit_code == 1
    text = _run(TRIALS, path_b, "--gpu", "h200").output
    assert "failed or was wrong in B on 1 shapes" in text and " failed  " in text


def test_a_winners_are_not_timed_in_a_heuristics_table():
    result = _run(TRIALS, HEURISTICS, "--gpu", "h200", "--json")
    report = json.loads(result.output)
    assert all(s["a_winner_regret_in_b"] is None for s in report["shapes"])
    assert report["summary"]["a_winners_timed_in_b"] == 0 == report["summary"]["a_winners_failed_in_b"]
    assert "timed in B" not in _run(TRIALS, HEURISTICS, "--gpu", "h200").output
