"""A trials file whose rows name several GPUs is read, by every command that takes one with
``--gpu``, as that GPU's trials only: table, diff, plot and evaluate --from-trials; and plot draws
one GPU's rows of a heuristics table of several."""
import json
from pathlib import Path

import pandas as pd
import pytest
from click.testing import CliRunner

from splitkv_tune.cli import main
from splitkv_tune.diff import read_run
from splitkv_tune.plot import read_any
from splitkv_tune.table_schema import TableError, read_heuristics, read_trials, with_gpu

TRIALS = Path(__file__).resolve().parent / "fixtures" / "trials.csv"
SCALE = {"h200": 1.0, "h100": 0.5}  # the H100's copy of the fixture runs twice as fast


@pytest.fixture
def mixed(tmp_path):
    trials = read_trials(TRIALS)
    frames = [trials.assign(gpu=f"nvidia_{gpu}", **{c: trials[c] * scale for c in ("median_us", "p20_us", "p80_us")})
              for gpu, scale in SCALE.items()]
    path = tmp_path / "mixed.csv"
    pd.concat(frames).to_csv(path, index=False)
    return path, trials


@pytest.mark.parametrize("gpu", SCALE)
def test_with_gpu_keeps_the_named_gpus_rows(mixed, gpu):
    path, trials = mixed
    assert len(read_trials(path)) == 2 * len(trials)
    mine = with_gpu(read_trials(path), gpu, path)
    assert len(mine) == len(trials) and set(mine["gpu"]) == {f"nvidia_{gpu}"}
    with pytest.raises(TableError, match="unknown GPU"):
        with_gpu(read_trials(path), "l40s", path)


def test_several_gpus_mixed_with_unlabelled_trials_is_a_clear_error(mixed, tmp_path):
    path, trials = mixed
    result = CliRunner().invoke(main, ["evaluate", "--gpu", "h100", "--from-trials", str(path),
                                       "--from-trials", str(TRIALS)])
    assert result.exit_code == 2 and "mixed with trials that name no GPU" in result.output
    assert "Traceback" not in result.output


def test_a_file_of_one_gpu_is_read_as_the_named_gpus():
    # one GPU's trials (or none named) are the caller's, as a relabelled run's are
    assert len(with_gpu(read_trials(TRIALS), "h100", TRIALS)) == len(read_trials(TRIALS))


@pytest.mark.parametrize("gpu", SCALE)
def test_diff_plot_and_evaluate_read_one_gpus_trials(mixed, gpu):
    path, trials = mixed
    ok = trials[trials["status"] == "ok"]
    _, timed = read_run(path, gpu)
    assert len(timed) == len(trials) and set(timed["gpu"]) == {f"nvidia_{gpu}"}
    result = CliRunner().invoke(main, ["diff", str(TRIALS), str(path), "--gpu", gpu, "--json"])
    assert result.exit_code == 0, result.output  # as fast or faster: no regression
    report = json.loads(result.output)
    assert report["summary"]["geomean_ratio"] == pytest.approx(SCALE[gpu])
    winners, _ = read_any(path, gpu)
    base, _ = read_any(TRIALS, "h200")
    assert (winners["median_us"].to_numpy() == pytest.approx(base["median_us"].to_numpy() * SCALE[gpu]))
    result = CliRunner().invoke(main, ["evaluate", "--gpu", gpu, "--from-trials", str(path),
                                       "--out-csv", str(path.parent / "e.csv")])
    assert result.exit_code == 0, result.output
    best = pd.read_csv(path.parent / "e.csv")["best_us"]
    by_shape = ok.groupby(["dtype", "head_dim", "causal", "batch", "q_heads", "kv_heads", "q_len", "kv_len"])["median_us"].min()
    assert sorted(best) == pytest.approx(sorted(by_shape * SCALE[gpu]))


def test_plot_draws_one_gpus_rows_of_a_heuristics_table_of_several(tmp_path):
    table = read_heuristics(TRIALS.parent / "heuristics.csv")
    path = tmp_path / "two.csv"
    half = {c: table[c] * SCALE["h100"] for c in ("median_us", "p20_us", "p80_us")}
    pd.concat([table, table.assign(gpu="nvidia_h100", **half)]).to_csv(path, index=False)
    for gpu, scale in SCALE.items():
        rows, _ = read_any(path, gpu)
        assert len(rows) == len(table) and set(rows["gpu"]) == {f"nvidia_{gpu}"}
        assert rows["median_us"].to_numpy() == pytest.approx(table["median_us"].to_numpy() * scale)
    with pytest.raises(TableError, match="several GPUs"):
        read_any(path)
    assert len(read_any(TRIALS.parent / "heuristics.csv")[0]) == len(table)  # one GPU: as it is


@pytest.mark.parametrize("gpu", SCALE)
def test_table_of_one_gpu_from_trials_of_several(mixed, gpu, tmp_path):
    path, trials = mixed
    out = tmp_path / "h.csv"
    result = CliRunner().invoke(main, ["table", str(path), "--gpu", gpu, "-o", str(out)])
    assert result.exit_code == 0, result.output
    table, base = read_heuristics(out), read_heuristics(TRIALS.parent / "heuristics.csv")
    assert len(table) == len(base) and set(table["gpu"]) == {f"nvidia_{gpu}"}
    assert table["median_us"].to_numpy() == pytest.approx(base["median_us"].to_numpy() * SCALE[gpu])
    both = CliRunner().invoke(main, ["table", str(path), "-o", str(out)])  # no --gpu: a table of both
    assert both.exit_code == 0, both.output
    assert len(read_heuristics(out)) == 2 * len(base)
