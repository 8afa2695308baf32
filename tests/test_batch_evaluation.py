"""``evaluate-batches`` on the CPU: the rules' knobs on a batch (the selector's from the table,
the auto rules, FA2's, FA3's and SGLang's as plan knobs), the plan rows they add to a held-out
grid, the regret of each against the oracle of rows written in compare-batch's columns, and the
shipped held-out grid kept apart from the grid the H200 batch table is built from."""
import copy
import csv
import dataclasses
import itertools
import math
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from splitkv_tune import baselines, batch_evaluation as be, batch_select as bs, batch_sweep as bsw, batch_table as bt
from splitkv_tune import _rules, batches, compare_batch as cb, live, plan, plan_points
from splitkv_tune.cli import main
from splitkv_tune.tunables import Shape

CONFIGS = Path(__file__).parent.parent / "configs"
HEAD = {"dtype": "bf16", "head_dim": 128, "q_heads": 32, "kv_heads": 8, "q_len": 1}
GRID = {
    "heads": [HEAD],
    "page_size": [64],
    "lengths": ["skewed:8:32768:1024", "skewed:4:8192:512"],
    "space": {"block_kv": [64, 128], "min_blocks_per_split": [1, 4], "max_splits": [8, 32]},
}
SMS = 132


def table_row(lengths="skewed:16:65536:1024", knobs=(64, 4, 32, "fused", "fixed")):
    s = batches.describe(batches.parse_lengths(lengths))
    rec = {"schema_version": 3, "gpu": "nvidia_h200", **HEAD, "page_size": 64, "batch": s["batch"],
           "len_max": s["max"], "len_mean": s["total"] // s["batch"], "lengths": lengths,
           "median_us": 90.0, "p20_us": 89.0, "p80_us": 91.0, "noise_margin": 0.01, "n_trials": 20,
           "source": "batches.csv"}
    rec.update(zip(bt.KNOB_COLUMNS, knobs))
    rec.update({c: None for c in bt.RUNNER_UP_COLUMNS})
    return {c: rec[c] for c in bt.BATCH_TABLE_COLUMNS}


TABLE = [table_row()]


@pytest.fixture
def nearest_rule(monkeypatch):
    """The selector takes the nearest class at any distance: the table here has one class, not
    the grid's batches, and these tests follow the rules' knobs through the evaluation."""
    monkeypatch.setattr(bs, "MAX_CLASS_DISTANCE", 64.0)


@pytest.mark.parametrize("head_dim", [64, 96, 128])
def test_on_equal_lengths_the_live_rules_give_the_equal_length_rules_split_counts(head_dim):
    for q_heads, kv_heads, batch, kv_len in itertools.product([8, 32, 64], [1, 4, 8], [1, 3, 8, 32, 64],
                                                              [100, 2048, 5000, 32768, 131072]):
        head = dict(HEAD, head_dim=head_dim, q_heads=q_heads, kv_heads=kv_heads)
        shape = Shape("bf16", head_dim, batch, q_heads, kv_heads, 1, kv_len)
        equal = baselines.baseline_configs(shape, SMS)
        for rule, (min_blocks, max_splits, block_kv) in baselines.live_baseline_plans(head, [kv_len] * batch,
                                                                                      SMS).items():
            assert plan.live_splits(kv_len, block_kv, min_blocks, max_splits) == equal[rule].num_splits, (rule, shape)


def test_on_a_skewed_batch_the_longest_sequence_gets_the_rules_count_and_the_short_ones_no_fewer():
    head = dict(HEAD, q_heads=8, kv_heads=1)
    lengths = [65536] + [1024] * 15
    plans = baselines.live_baseline_plans(head, lengths, SMS)
    # SGLang: chunk 8192 keys (64 tiles), so the long sequence takes 8 splits and a short one 1.
    assert plans["sglang"] == (64, 8, 128)
    for rule, (min_blocks, max_splits, block_kv) in plans.items():
        assert plan.live_splits(65536, block_kv, min_blocks, max_splits) == max_splits, rule
    with pytest.raises(ValueError, match="lengths must be"):
        baselines.live_baseline_plans(head, [0, 5], SMS)


def test_the_rules_knobs_and_the_plan_rows_they_add(nearest_rule):
    grid = bsw.parse_batch_grid(copy.deepcopy(GRID))
    batch = grid.batches[0]
    knobs = be.rule_knobs(batch, TABLE, SMS)
    assert set(knobs) == set(be.RULES)
    assert knobs["selector"] == (64, 4, 32, "fused", "fixed")  # the table's only class
    assert knobs["auto"] == (*live.resolve_knobs(8, 128, 8, 4, SMS), "fused", "fixed")
    timed = be.with_rule_plans(grid, TABLE, SMS)
    for before, after in zip(grid.batches, timed.batches):
        assert after.plans[:len(before.plans)] == before.plans
        added = set(after.plans[len(before.plans):])
        wanted = {(mb, ms, bkv) for rule, (bkv, mb, ms, *_) in be.rule_knobs(before, TABLE, SMS).items()
                  if rule != "auto"}
        assert added == wanted - set(before.plans) and len(after.plans) == len(set(after.plans))
    # With no row of the head configuration the selector falls back to the auto rules.
    assert be.rule_knobs(batch, [], SMS)["selector"] == knobs["auto"]


def timed_point(point) -> tuple:
    """The knob key of a plan row of this file's grid (``PLAN_KNOBS``): the merge is fused unless
    the plan names one."""
    knobs = plan_points.plan_knobs(point)
    return (knobs["block_kv"], knobs["min_blocks_per_split"], knobs["max_splits"],
            "fused" if knobs["merge"] == "auto" else knobs["merge"], knobs["split_plan"])


def rows_for(batch, times: dict, extra=()):
    """compare-batch rows of one batch: ``times`` maps (block_kv, min_blocks, max_splits, merge) to a
    median."""
    s = batches.describe(batch.lengths)
    rows = []
    for i, (knobs, median) in enumerate(times.items()):
        row = dict.fromkeys(cb.COLUMNS, "")
        row.update(batch.head, page_size=batch.page_size, label=batch.label, batch=s["batch"], max_len=s["max"],
                   total_len=s["total"],
                   impl="ours" if i == 0 else plan_points.plan_row_name(knobs[1], knobs[2], knobs[0]),
                   status="ok", median_us=median, p20_us=median, p80_us=median)
        row.update(zip(be.PLAN_KNOBS, knobs))
        rows.append({k: str(v) for k, v in row.items()})
    for impl, status, median in extra:
        row = dict.fromkeys(cb.COLUMNS, "")
        row.update(batch.head, page_size=batch.page_size, label=batch.label, impl=impl, status=status,
                   median_us=median)
        rows.append({k: str(v) for k, v in row.items()})
    return rows


def test_regret_is_each_rules_time_over_the_fastest_of_our_rows():
    grid = bsw.parse_batch_grid(copy.deepcopy(GRID))
    timed = be.with_rule_plans(grid, TABLE, SMS)
    batch = timed.batches[0]
    knobs = be.rule_knobs(batch, TABLE, SMS)
    points = [knobs["auto"]] + [p for p in map(timed_point, batch.plans) if p != knobs["auto"]]
    times = {p: 100.0 + 3 * i for i, p in enumerate(points)}
    oracle = min(times, key=times.get)
    # A peer faster than every row of ours, or a failed row of ours, is no oracle.
    rows = rows_for(batch, times, extra=[("flashinfer_decode_tc", "ok", 10.0), ("copy_floor", "ok", 5.0)])
    rows[-3]["median_us"], rows[-3]["status"] = "1.0", "failed"
    times.pop(points[-1])
    records = be.regret_records(grid, rows, TABLE, SMS)
    first, second = records
    assert first["oracle_us"] == times[oracle] and first["oracle_knobs"] == "/".join(map(str, oracle))
    for rule in be.RULES:
        t = times.get(knobs[rule])
        assert first[f"{rule}_us"] == t
        assert first[f"{rule}_regret"] == (None if t is None else pytest.approx(t / times[oracle] - 1))
    assert second["oracle_us"] is None and all(second[f"{r}_regret"] is None for r in be.RULES)
    summary = be.summarize(records)
    regrets = [first[f"{r}_regret"] for r in be.RULES if first[f"{r}_regret"] is not None]
    assert summary["auto"] == {"n": 1, "geomean": pytest.approx(first["auto_regret"]),
                               "max": first["auto_regret"]}
    assert max(regrets) > 0
    report = be.markdown_report(records, "held-out")
    assert "not timed" in report and "| selector |" in report


def test_the_geometric_mean_of_regret():
    records = [{f"{r}_regret": None for r in be.RULES} for _ in range(2)]
    records[0]["fa2_regret"], records[1]["fa2_regret"] = 0.0, 0.21
    summary = be.summarize(records)["fa2"]
    assert summary["geomean"] == pytest.approx(math.sqrt(1.21) - 1) and summary["max"] == 0.21


def batch_classes(path):
    grid = bsw.load_batch_grid(path)
    out = set()
    for batch in grid.batches:
        s = batches.describe(batch.lengths)
        out.add((tuple(batch.head[f] for f in bsw.HEAD_FIELDS), s["batch"], s["max"], s["total"] // s["batch"]))
    return grid, out


@pytest.mark.parametrize("training", ["batches.yaml", "batches_dense.yaml", "batches_split_plan.yaml",
                                      "batches_head_dims.yaml"])
def test_the_held_out_batches_are_skewed_and_apart_from_the_tables_grids(training):
    held_out, held_classes = batch_classes(CONFIGS / "batches_holdout.yaml")
    grid, trained = batch_classes(CONFIGS / training)
    assert len(held_out.batches) >= 10
    assert all(b.label.startswith("skewed:") for b in held_out.batches)
    assert not held_classes & trained
    assert {b.label for b in held_out.batches}.isdisjoint(b.label for b in grid.batches)


@pytest.mark.parametrize("held,size", [("batches_holdout_models.yaml", 30), ("batches_holdout_models2.yaml", 18),
                                       ("batches_holdout_models3.yaml", 24), ("batches_holdout_models4.yaml", 24),
                                       ("batches_holdout_models5.yaml", 24), ("batches_holdout_models6.yaml", 24)])
@pytest.mark.parametrize("training", ["batches.yaml", "batches_dense.yaml", "batches_split_plan.yaml",
                                      "batches_head_dims.yaml", "batches_holdout.yaml",
                                      "batches_holdout_models.yaml", "batches_holdout_models2.yaml",
                                      "batches_holdout_models3.yaml", "batches_holdout_models4.yaml",
                                      "batches_holdout_models5.yaml"])
def test_the_held_out_model_batches_are_real_heads_apart_from_every_other_grid(held, size, training):
    if held == training:
        return
    held_out, held_classes = batch_classes(CONFIGS / held)
    grid, trained = batch_classes(CONFIGS / training)
    assert len(held_out.batches) >= size and len({tuple(b.head.values()) for b in held_out.batches}) >= 6
    assert not held_classes & trained
    assert {b.label for b in held_out.batches}.isdisjoint(b.label for b in grid.batches)


def write_rows(path, rows):
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, cb.COLUMNS)
        writer.writeheader()
        writer.writerows(rows)


def test_the_command_reports_from_the_rows(tmp_path):
    grid_path = tmp_path / "grid.yaml"
    grid_path.write_text(yaml.safe_dump(GRID))
    table_path = bt.write_batch_table(tmp_path / "table.csv", TABLE)
    grid = be.with_rule_plans(bsw.parse_batch_grid(copy.deepcopy(GRID)), TABLE, SMS)
    rows = []
    for batch in grid.batches:
        knobs = be.rule_knobs(batch, TABLE, SMS)
        points = [knobs["auto"]] + [timed_point(p) for p in batch.plans]
        rows += rows_for(batch, {p: 50.0 + i for i, p in enumerate(dict.fromkeys(points))})
    write_rows(tmp_path / "rows.csv", rows)
    out_md, out_csv = tmp_path / "report.md", tmp_path / "regret.csv"
    result = CliRunner().invoke(main, ["evaluate-batches", "--grid", str(grid_path), "--batch-table", str(table_path),
                                       "--gpu", "h200", "--csv", str(tmp_path / "rows.csv"), "--report-only",
                                       "--out-md", str(out_md), "--out-csv", str(out_csv)])
    assert result.exit_code == 0, result.output
    assert "| auto | 0.0% | 0.0% | 2 |" in result.output  # the auto knobs were the fastest row
    assert out_md.read_text() in result.output + "\n"
    with open(out_csv, newline="") as f:
        regret = list(csv.DictReader(f))
    assert [r["lengths"] for r in regret] == GRID["lengths"]
    assert {(r["gpu"], r["num_sms"]) for r in regret} == {("nvidia_h200", "132")}
    # Rows of another grid's batches are no report.
    write_rows(tmp_path / "other.csv", rows_for(dataclasses.replace(grid.batches[0], label="uniform:2:64"),
                                                {(64, 1, 8, "fused"): 5.0}))
    result = CliRunner().invoke(main, ["evaluate-batches", "--grid", str(grid_path), "--batch-table", str(table_path),
                                       "--gpu", "h200", "--csv", str(tmp_path / "other.csv"), "--report-only"])
    assert result.exit_code == 2 and "has no timed rows of any batch" in result.output, result.output


def test_timing_on_another_gpu_than_the_tables_is_refused(tmp_path, monkeypatch):
    """Rows timed here are labelled with --gpu: an H100 timing an H200 table would read as H200 data."""
    from splitkv_tune import cli_batch, sweep
    grid_path = tmp_path / "grid.yaml"
    grid_path.write_text(yaml.safe_dump(GRID))
    table_path = bt.write_batch_table(tmp_path / "table.csv", TABLE)
    monkeypatch.setattr(cli_batch, "_check_cuda", lambda: None)
    monkeypatch.setattr(sweep, "present_device_name", lambda backend: "nvidia_h100")
    result = CliRunner().invoke(main, ["evaluate-batches", "--grid", str(grid_path), "--batch-table", str(table_path),
                                       "--gpu", "h200", "--csv", str(tmp_path / "rows.csv")])
    assert result.exit_code == 2 and "--gpu" in result.output and "nvidia_h100" in result.output, result.output
    assert not (tmp_path / "rows.csv").exists()


@pytest.mark.parametrize("args, expected", [
    (["--batch-table", "missing.csv"], "missing.csv"),
    (["--gpu", "my-gpu"], "--num-sms"),
    (["--num-sms", "0"], "--num-sms"),
])
def test_bad_input_is_a_clear_error(args, expected, tmp_path, assert_clear_error, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("grid.yaml").write_text(yaml.safe_dump(GRID))
    bt.write_batch_table(tmp_path / "table.csv", [dict(r, gpu="my_gpu") for r in TABLE]
                         if "my-gpu" in args else TABLE)
    base = {"--grid": "grid.yaml", "--batch-table": "table.csv", "--gpu": "h200", "--csv": "rows.csv"}
    base.update(zip(args[::2], args[1::2]))
    argv = ["evaluate-batches", "--report-only", *itertools.chain.from_iterable(base.items())]
    assert_clear_error(CliRunner().invoke(main, argv), expected)


def test_a_rule_reads_the_row_of_its_own_merge(nearest_rule):
    table = [table_row(knobs=(64, 4, 32, "kernel", "fixed"))]
    grid = bsw.parse_batch_grid(copy.deepcopy(GRID))
    batch = grid.batches[0]
    knobs = be.rule_knobs(batch, table, SMS)
    assert knobs["selector"] == (64, 4, 32, "kernel", "fixed") and knobs["fa2"][3] == "fused"
    added = be.with_rule_plans(grid, table, SMS).batches[0].plans[len(batch.plans):]
    assert (4, 32, 64, "kernel") in added
    times = {knobs["auto"]: 70.0, (64, 4, 32, "fused", "fixed"): 50.0, (64, 4, 32, "kernel", "fixed"): 60.0}
    first = be.regret_records(grid, rows_for(batch, times), table, SMS)[0]
    assert first["selector_us"] == 60.0 and first["selector_regret"] == pytest.approx(0.2)
    assert first["oracle_knobs"] == "64/4/32/fused/fixed"


def test_a_load_aware_class_is_timed_and_read_at_its_split_plan(nearest_rule):
    table = [table_row(knobs=(64, 4, 32, "fused", "load_aware"))]
    grid = bsw.parse_batch_grid(copy.deepcopy(GRID))
    batch = grid.batches[0]
    knobs = be.rule_knobs(batch, table, SMS)
    assert knobs["selector"] == (64, 4, 32, "fused", "load_aware")
    added = be.with_rule_plans(grid, table, SMS).batches[0].plans[len(batch.plans):]
    assert (4, 32, 64, "auto", "load_aware") in added
    times = {knobs["auto"]: 70.0, (64, 4, 32, "fused", "fixed"): 66.0, (64, 4, 32, "fused", "load_aware"): 55.0}
    first = be.regret_records(grid, rows_for(batch, times), table, SMS)[0]
    assert first["selector_us"] == 55.0 and first["selector_regret"] == 0.0


def test_each_batch_held_out_reads_the_table_of_the_others(tmp_path, nearest_rule):
    grid = bsw.parse_batch_grid(copy.deepcopy(GRID))
    first, second = grid.batches
    x, y = (64, 4, 32, "fused", "fixed"), (128, 1, 8, "fused", "fixed")
    rows = (rows_for(first, {x: 100.0, y: 150.0}, extra=[("copy_floor", "ok", 50.0)])
            + rows_for(second, {x: 90.0, y: 60.0}))
    records = be.leave_one_out_records(grid, rows, "nvidia_h200", SMS)
    assert [r["lengths"] for r in records] == [first.label, second.label]
    # Held out, each batch gets the other's winner: y on the first (150 / 100), x on the second (90 / 60).
    assert records[0]["selector_knobs"] == "128/1/8/fused/fixed" and records[0]["selector_regret"] == 0.5
    assert records[1]["selector_knobs"] == "64/4/32/fused/fixed" and records[1]["selector_regret"] == 0.5
    assert be.leave_one_out_records(grid, rows_for(first, {x: 1.0}), "nvidia_h200", SMS) == []  # no other batch
    twins = bsw.parse_batch_grid({**copy.deepcopy(GRID), "page_size": [16, 64], "lengths": [first.label]})
    twin_rows = [row for b in twins.batches for row in rows_for(b, {x: 100.0, y: 90.0})]
    assert be.leave_one_out_records(twins, twin_rows, "nvidia_h200", SMS) == []  # the other page size is no other batch
    (tmp_path / "grid.yaml").write_text(yaml.safe_dump(GRID))
    (tmp_path / "rows.csv").write_text(bsw._csv_text(rows))
    result = CliRunner().invoke(main, ["cross-validate-batches", "--grid", str(tmp_path / "grid.yaml"),
                                       "--csv", str(tmp_path / "rows.csv"), "--gpu", "h200",
                                       "--out-md", str(tmp_path / "loo.md")])
    assert result.exit_code == 0, result.output
    assert "| selector | 50.0% | 50.0% | 2 |" in (tmp_path / "loo.md").read_text()
    result = CliRunner().invoke(main, ["cross-validate-batches", "--grid", str(tmp_path / "grid.yaml"),
                                       "--csv", str(tmp_path / "none.csv"), "--gpu", "h200"])
    assert result.exit_code == 2 and "no batch of" in result.output


def test_beyond_the_classes_the_selector_is_the_model_given_ctas_per_sm(tmp_path):
    grid = bsw.parse_batch_grid(copy.deepcopy(GRID))
    batch = grid.batches[0]
    knobs = be.rule_knobs(batch, [], SMS, 2)
    want = _rules.live_model_knobs(list(batch.lengths), 8, 4, SMS, 2)[:2]
    assert knobs["selector"] == (64, *want, "fused", "fixed") != knobs["auto"]
    assert be.rule_knobs(batch, [], SMS, lambda b: 2) == knobs  # or a function of the batch
    assert (want[0], want[1], 64) in be.with_rule_plans(grid, [], SMS, 2).batches[0].plans
    # The reports say which CTAs per SM the selector had.
    (tmp_path / "grid.yaml").write_text(yaml.safe_dump(GRID))
    rows = [row for b in grid.batches for row in rows_for(b, {be.rule_knobs(b, [], SMS, 2)["selector"]: 50.0,
                                                               be.rule_knobs(b, [], SMS)["auto"]: 60.0})]
    (tmp_path / "rows.csv").write_text(bsw._csv_text(rows))
    table_path = bt.write_batch_table(tmp_path / "table.csv", TABLE)
    common = ["--grid", str(tmp_path / "grid.yaml"), "--csv", str(tmp_path / "rows.csv"), "--gpu", "h200"]
    for argv, title in ((["evaluate-batches", "--batch-table", str(table_path), "--report-only"], "2 CTAs per SM"),
                        (["cross-validate-batches"], "2 CTAs per SM")):
        result = CliRunner().invoke(main, [*argv, *common, "--ctas-per-sm", "2"])
        assert result.exit_code == 0 and title in result.output, result.output
        result = CliRunner().invoke(main, [*argv, *common])
        assert result.exit_code == 0 and "the selector's model off" in result.output, result.output
    by_head_dim = CliRunner().invoke(main, ["evaluate-batches", "--batch-table", str(table_path), *common,
                                            "--ctas-per-sm", "1", "--ctas-per-sm", "128:2", "--report-only"])
    assert "1 CTAs per SM, 2 at head dim 128" in by_head_dim.output, by_head_dim.output
    assert "| selector | 0.0% | 0.0% | 2 |" in by_head_dim.output  # the grid's head dim is 128: 2 CTAs
    for bad in ("0", "33", "100:2", "128:x", "x"):
        result = CliRunner().invoke(main, ["cross-validate-batches", *common, "--ctas-per-sm", bad])
        assert result.exit_code == 2 and "expected N or HEAD_DIM:N" in result.output, (bad, result.output)
    evaluated = CliRunner().invoke(main, ["evaluate-batches", "--batch-table", str(table_path), *common,
                                          "--ctas-per-sm", "2", "--report-only"])
    assert "| selector | 0.0% | 0.0% | 2 |" in evaluated.output and "| auto | 20.0% | 20.0% | 2 |" in evaluated.output
    # Without a batch table (a GPU never batch-swept) the selector is the model for every batch.
    untabled = CliRunner().invoke(main, ["evaluate-batches", *common, "--ctas-per-sm", "2", "--report-only"])
    assert untabled.exit_code == 0 and "no batch table" in untabled.output, untabled.output
    assert "| selector | 0.0% | 0.0% | 2 |" in untabled.output and "| auto | 20.0% | 20.0% | 2 |" in untabled.output
