"""Heuristics-table building on synthetic trials: ties, failures, NaN; atomic writes."""
import math

import pandas as pd
import pytest

from splitkv_tune import table, table_schema
from splitkv_tune.table_schema import HEURISTICS_COLUMNS, SCHEMA_VERSION
from splitkv_tune.tunables import Shape

SHAPE = dict(dtype="bf16", head_dim=128, causal=0, batch=1, q_heads=32, kv_heads=8, q_len=1,
             kv_len=4096)


def trial(num_splits, median, status="ok", spread=0.01, block_kv=64, run_id="r1", **shape):
    return {**SHAPE, **shape, "num_splits": num_splits, "block_kv": block_kv,
            "reduce_threads": 128, "split_policy": "blocks", "median_us": median,
            "p20_us": median * (1 - spread / 2), "p80_us": median * (1 + spread / 2), "n": 20,
            "status": status, "reason": "" if status == "ok" else "boom", "gbps": 1.0,
            "frac_copy_bw": 0.5, "run_id": run_id}


def test_ties_go_to_smaller_splits_and_runner_up_is_next_fastest():
    trials = pd.DataFrame([trial(16, 10.0, spread=0.05), trial(8, 10.3), trial(4, 13.0),
                           trial(32, 9.9, spread=0.05)])
    out = table.build_heuristics(trials, gpu="nvidia_h200")
    assert list(out.columns) == HEURISTICS_COLUMNS
    row = out.iloc[0]
    # fastest is S=32 (9.9 us, margin 5%): 16 and 8 are within 5% -> smallest S (8) wins
    assert row.num_splits == 8
    assert row.runner_up_num_splits == 32 and row.runner_up_us == pytest.approx(9.9)
    assert row.noise_margin == pytest.approx(0.05)
    assert row.schema_version == SCHEMA_VERSION and row.gpu == "nvidia_h200"
    assert row.n_trials == 4


def test_failures_and_nan_are_ignored_even_when_faster():
    trials = pd.DataFrame([trial(1, 20.0), trial(2, 1.0, status="failed"),
                           trial(4, 0.5, status="wrong"), trial(8, float("nan")),
                           trial(16, float("inf")), trial(32, 15.0)])
    row = table.build_heuristics(trials, gpu="g").iloc[0]
    assert row.num_splits == 32 and row.median_us == 15.0
    assert row.runner_up_num_splits == 1 and row.n_trials == 2


def test_shape_with_only_failures_has_no_row_and_single_trial_has_no_runner_up():
    trials = pd.DataFrame([trial(1, 5.0, status="failed", kv_len=512), trial(1, 7.0)])
    out = table.build_heuristics(trials, gpu="g")
    assert len(out) == 1 and out.iloc[0].kv_len == 4096
    assert pd.isna(out.iloc[0].runner_up_num_splits) and pd.isna(out.iloc[0].runner_up_us)
    # The built frame's missing runner-up (pandas' NA in nullable columns) validates as missing.
    checked = table_schema.validate_heuristics(out, "built")
    assert pd.isna(checked.iloc[0].runner_up_num_splits)


def test_equal_splits_tie_goes_to_lower_median_and_latest_run_wins_repeats():
    trials = pd.DataFrame([trial(8, 10.0, block_kv=64), trial(8, 10.05, block_kv=128),
                           trial(4, 30.0, run_id="r1"), trial(4, 9.0, run_id="r2")])
    row = table.build_heuristics(trials, gpu="g").iloc[0]
    assert row.num_splits == 4 and row.median_us == 9.0   # r2 replaced r1's measurement


def test_shapes_are_separate_rows():
    trials = pd.DataFrame([trial(1, 5.0), trial(2, 4.0, kv_len=16384), trial(8, 2.0, kv_len=16384)])
    out = table.build_heuristics(trials, gpu="g")
    assert sorted(out.kv_len) == [4096, 16384]
    assert out.set_index("kv_len").loc[16384, "num_splits"] == 8


def test_empty_trials_give_empty_table_with_schema():
    out = table.build_heuristics(pd.DataFrame([trial(1, float("nan"))]), gpu="g")
    assert list(out.columns) == HEURISTICS_COLUMNS and len(out) == 0


def test_lookup_config_and_round_trip(tmp_path):
    trials = pd.DataFrame([trial(1, 5.0), trial(2, 3.0)])
    path = tmp_path / "trials.csv"
    table.atomic_write_csv(path, trials)
    out = table.write_heuristics(path, tmp_path / "h.csv", gpu="g")
    again = pd.read_csv(tmp_path / "h.csv")
    assert len(again) == len(out) == 1
    config = table.lookup_config(again, Shape("bf16", 128, 1, 32, 8, 1, 4096))
    assert config.num_splits == 2
    assert table.lookup_config(again, Shape("bf16", 128, 2, 32, 8, 1, 4096)) is None


def test_atomic_write_leaves_no_temp_files_and_keeps_old_file_on_error(tmp_path):
    path = tmp_path / "sub" / "x.txt"
    table.atomic_write_text(path, "one")
    table.atomic_write_text(path, "two")
    assert path.read_text() == "two"
    assert [p.name for p in path.parent.iterdir()] == ["x.txt"]

    class Boom:
        def __str__(self):
            raise RuntimeError("boom")

    with pytest.raises(TypeError):
        table.atomic_write_text(path, Boom())
    assert path.read_text() == "two"
    assert [p.name for p in path.parent.iterdir()] == ["x.txt"]


def test_fixture_trials_build():
    from pathlib import Path
    fixture = Path(__file__).parent / "fixtures" / "trials.csv"
    out = table.build_heuristics(table_schema.read_trials(fixture), gpu="nvidia_h200")
    assert len(out) > 0 and not out["median_us"].map(math.isnan).any()


def test_per_block_kv_columns_come_in_pairs_and_hold_the_winner_at_each_block():
    trials = pd.DataFrame([trial(16, 10.0, block_kv=64), trial(8, 10.05, block_kv=64),
                           trial(4, 12.0, block_kv=128)])
    row = table.build_heuristics(trials, gpu="nvidia_h200").iloc[0]
    assert (row.best_splits_kv64, row.best_us_kv64) == (8, 10.05)  # the tie rule: fewer splits
    assert (row.best_splits_kv128, row.best_us_kv128) == (4, 12.0)
    assert pd.isna(row.best_us_kv32) and pd.isna(row.best_splits_kv32)
    checked = table_schema.validate_heuristics(table.build_heuristics(trials, gpu="nvidia_h200"))
    with pytest.raises(table_schema.TableError, match="best_us_kv64 and best_splits_kv64 go together"):
        table_schema.validate_heuristics(checked.assign(best_splits_kv64=None))
    with pytest.raises(table_schema.TableError, match="best_us_kv128 must be > 0"):
        table_schema.validate_heuristics(checked.assign(best_us_kv128=0.0))
    with pytest.raises(table_schema.TableError, match="best_us_kv128 must be at most 1e"):
        table_schema.validate_heuristics(checked.assign(best_us_kv128=1e306))
    with pytest.raises(table_schema.TableError, match="the row's winner ran block_kv 64"):
        table_schema.validate_heuristics(checked.assign(best_us_kv64=None, best_splits_kv64=None))


def _pandas_tie_rule(group, min_margin=table.MIN_NOISE_MARGIN):
    """The tie rule as sorts of the DataFrame, as the module first wrote it (the fastest's
    spread read from its columns, which stay float whatever the workspace's dtype): the oracle
    of the list form."""
    ordered = group.sort_values("median_us", kind="stable")
    fastest = {c: float(ordered[c].iloc[0]) for c in ("median_us", "p20_us", "p80_us")}
    margin = table.noise_margin(fastest["median_us"], fastest["p20_us"], fastest["p80_us"], min_margin)
    ties = ordered[ordered["median_us"] <= fastest["median_us"] * (1 + margin)]
    winner = ties.sort_values(["num_splits", "workspace_bytes", "median_us"], kind="stable").iloc[0]
    rest = ordered.drop(index=winner.name)
    return winner.name, None if not len(rest) else rest.iloc[0].name, margin


def test_the_tie_rule_on_lists_is_the_rule_on_sorted_frames():
    import random
    rng = random.Random(7)
    for _ in range(500):
        n = rng.randint(1, 12)
        medians = [round(rng.choice([10.0, 10.05, 10.2, 11.0]) + rng.choice([0, 0, 0.01]), 3) for _ in range(n)]
        group = pd.DataFrame({
            "num_splits": [rng.choice([1, 2, 4, 8]) for _ in range(n)],
            "median_us": medians,
            "p20_us": [m * 0.99 if rng.random() > 0.1 else math.nan for m in medians],
            "p80_us": [m * 1.01 for m in medians],
            "workspace_bytes": [rng.choice([1.0, 2.0, math.nan]) for _ in range(n)],
            "block_kv": [rng.choice([32, 64, 128]) for _ in range(n)],
        }, index=rng.sample(range(100), n))
        # The workspace as the sweep's frame holds it (Int64, pd.NA where a restored cell was
        # empty), as an object column with None, or as floats with NaN.
        group["workspace_bytes"] = rng.choice([
            group["workspace_bytes"].astype("Int64"), group["workspace_bytes"].astype(object).where(
                group["workspace_bytes"].notna(), None), group["workspace_bytes"]])
        winner, runner, margin = table.pick_winner(group)
        want = _pandas_tie_rule(group)
        assert (winner.name, None if runner is None else runner.name, margin) == want
        for b in (32, 64, 128):
            at_b = group[group["block_kv"] == b]
            best = table.per_block_kv_bests(group)[f"best_splits_kv{b}"]
            assert best == (int(at_b.loc[_pandas_tie_rule(at_b)[0], "num_splits"]) if len(at_b) else None)
