"""The batch-class table (schema v3) on the CPU: built from compare-batch CSVs written in their
real column layout, the winner and tie rule, the round trip, every validation error, the JSON
file and the ``batch-table`` command."""
import json
import sys
from pathlib import Path

import pytest
from batch_rows import (PAGED, SKEWED_RUN, UNIFORM, UNIFORM_RUN, as_read, compare_row, invoke, rewrite, write_csv,
                        write_table)

from splitkv_tune import batch_table as bt
from splitkv_tune import batch_table_json as btj
from splitkv_tune import compare_batch, live
from splitkv_tune.table_schema import TableError, read_heuristics, read_heuristics_records

V1_TABLE = Path(__file__).parent / "fixtures" / "heuristics.csv"


def test_the_table_reads_the_knob_columns_compare_batch_writes():
    assert compare_batch.KNOB_COLUMNS == bt.KNOB_COLUMNS
    assert set(bt.COMPARE_COLUMNS) <= set(compare_batch.COLUMNS)

@pytest.fixture
def table_file(tmp_path):
    return write_table(tmp_path)


# --- the builder -------------------------------------------------------------------------------

def test_one_row_per_class_with_the_fastest_knobs():
    table = bt.build_batch_table(as_read(SKEWED_RUN + UNIFORM_RUN), "NVIDIA H200")
    # In the order of their classes: the shorter uniform batch first.
    assert [(r["lengths"], r["len_max"], r["len_mean"]) for r in table] == [
        ("uniform:16:8192", 8192, 8192), ("skewed:16:65536:1024", 65536, 80896 // 16)]
    skewed = table[1]
    assert skewed["gpu"] == "nvidia_h200" and skewed["schema_version"] == 3
    assert [skewed[c] for c in bt.KNOB_COLUMNS] == [64, 4, 64, "fused", "fixed"]
    assert skewed["median_us"] == 93.4 and skewed["n_trials"] == 4  # ours, one split, two plans
    assert [skewed["runner_up_" + c] for c in bt.KNOB_COLUMNS] == [64, 16, 33, "fused", "fixed"]
    assert skewed["runner_up_us"] == 96.4
    assert skewed["noise_margin"] == pytest.approx(max(0.004 / 1.0, 0.01))
    assert skewed["source"] == "run.csv"


def test_a_plan_row_of_another_merge_is_a_candidate_and_its_merge_is_kept():
    rows = SKEWED_RUN + [compare_row("ours_m4_s64_kernel", 91.0, (64, 4, 64, "kernel"))]
    skewed = bt.build_batch_table(as_read(rows), "h200")[0]
    assert [skewed[c] for c in bt.KNOB_COLUMNS] == [64, 4, 64, "kernel", "fixed"] and skewed["n_trials"] == 5
    assert [skewed["runner_up_" + c] for c in bt.KNOB_COLUMNS] == [64, 4, 64, "fused", "fixed"]


def test_ties_go_to_the_smaller_max_splits_then_block_kv_64_then_fewer_min_blocks():
    rows = [compare_row("ours_m4_s64", 100.0, (64, 4, 64, "fused")),
            compare_row("ours_kv32_m4_s16", 100.5, (32, 4, 16, "fused")),  # within 1%: ties
            compare_row("ours_m8_s16", 100.6, (64, 8, 16, "fused")),
            compare_row("ours_m2_s16", 100.9, (64, 2, 16, "fused")),
            compare_row("ours_m1_s8", 102.0, (64, 1, 8, "fused"))]  # outside the margin
    winner, runner_up, margin = bt.pick_batch_winner([bt._candidate(r) for r in as_read(rows)], 0.01)
    assert (winner["block_kv"], winner["min_blocks_per_split"], winner["max_splits"]) == (64, 2, 16)
    assert runner_up["median_us"] == 100.0 and margin == 0.01
    # A wide spread of the fastest widens the margin: now m1_s8 ties too, and wins.
    noisy = [compare_row("ours_m4_s64", 100.0, (64, 4, 64, "fused"), spread=0.02)] + rows[1:]
    winner, _, margin = bt.pick_batch_winner([bt._candidate(r) for r in as_read(noisy)], 0.01)
    assert winner["max_splits"] == 8 and margin == pytest.approx(0.04)


def test_the_runner_up_has_other_knobs_and_may_be_none():
    same = [compare_row("ours", 96.0), compare_row("ours_m16_s33", 97.0)]  # ours' auto knobs again
    (row,) = bt.build_batch_table(as_read(same), "h200")
    assert row["runner_up_us"] is None and row["runner_up_block_kv"] is None and row["n_trials"] == 2


def test_rows_that_cannot_win_are_left_out():
    rows = [compare_row("ours", 96.0, status="failed"),
            compare_row("ours_one_split", 90.0, ("", "", "", "")),  # measured off a CUDA device
            compare_row("ours_m4_s64", 99.0, (64, 4, 64, "kernel"))]
    (row,) = bt.build_batch_table(as_read(rows), "h200")
    assert row["max_splits"] == 64 and row["merge"] == "kernel" and row["n_trials"] == 1
    with pytest.raises(TableError, match="run.csv: no candidate rows"):
        bt.build_batch_table(as_read(rows[:2]), "h200")


@pytest.mark.parametrize("change,problem", [
    (dict(median_us="nan"), "median_us is empty or NaN"),
    (dict(max_splits="1.5"), "max_splits must be an integer, got '1.5'"),
    (dict(block_kv=128, head_dim=256), "block_kv must be one of (32, 64) at head_dim 256"),
    (dict(label="skewed:16:65536:512"), "lengths 'skewed:16:65536:512' give batch"),
    (dict(label="1024;rm -rf"), "lengths must match"),
])
def test_a_bad_candidate_names_its_file_and_row(change, problem):
    with pytest.raises(TableError) as err:
        bt.build_batch_table(as_read([{**compare_row("ours", 96.0), **change}]), "h200")
    assert str(err.value).startswith("run.csv: row of ") and problem in str(err.value)


# --- the reader --------------------------------------------------------------------------------

def test_round_trip(table_file):
    table = bt.build_batch_table(as_read(SKEWED_RUN + UNIFORM_RUN), "h200")
    assert bt.read_batch_table(table_file) == table
    assert bt.read_batch_table(table_file, gpu="NVIDIA H200") == table
    with pytest.raises(TableError, match=r"unknown GPU 'h100' for this table \(it has rows for: nvidia_h200\)"):
        bt.read_batch_table(table_file, gpu="h100")


def test_reading_needs_no_pandas(table_file):
    import subprocess
    code = ("import sys; from splitkv_tune import batch_select, batch_table; "
            f"batch_table.read_batch_table({str(table_file)!r}); assert 'pandas' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("change,problem", [
    (dict(max_splits="1.5"), "max_splits must be an integer, got '1.5'"),
    (dict(max_splits="129"), "max_splits must be in [1, 128], got 129"),
    (dict(min_blocks_per_split="0"), "min_blocks_per_split must be in"),
    (dict(median_us="nan"), "median_us is empty or NaN"),
    (dict(median_us="inf"), "median_us must be a finite number >= 0, got 'inf'"),
    (dict(median_us="0"), "median_us must be > 0, got '0'"),
    (dict(noise_margin="-0.1"), "noise_margin must be a finite number >= 0"),
    (dict(dtype="fp32"), "dtype must be one of ('fp16', 'bf16')"),
    (dict(merge="none"), "merge must be one of ('auto', 'kernel', 'fused')"),
    (dict(runner_up_merge="x"), "runner_up_merge must be one of"),
    (dict(page_size="48"), "page_size must be one of (1, 16, 32, 64, 128, 256)"),
    (dict(head_dim="80"), "head_dim must be one of"),
    (dict(gpu='h200";drop'), "gpu must match [A-Za-z0-9_.-]+"),
    (dict(source="../x y"), "source must match"),
    (dict(lengths="uniform:16:8192;"), "lengths must match"),
    (dict(lengths="skewed:16:8192:1024"), "lengths 'skewed:16:8192:1024' give batch, len_max, len_mean"),
    (dict(len_mean="9000"), "len_mean (9000) exceeds len_max (8192)"),
    (dict(q_heads="12"), "q_heads (12) is not a multiple of kv_heads (8)"),
    (dict(schema_version="1"), "schema_version is 1; a table with split_plan columns is version 3"),
    (dict(runner_up_us=""), "the runner-up columns"),
    (dict(block_kv="128", head_dim="256"), "block_kv must be one of (32, 64) at head_dim 256"),
])
def test_every_bad_cell_is_named(table_file, change, problem):
    rewrite(table_file, **change)
    with pytest.raises(TableError) as err:
        bt.read_batch_table(table_file)
    assert str(err.value).startswith(f"{table_file}: row 1 (line 2): ")
    assert problem in str(err.value)


def test_bad_tables(table_file, tmp_path):
    with open(table_file) as f:
        header, first = f.readline(), f.readline()
    (tmp_path / "dup.csv").write_text(header + first + first)
    (tmp_path / "empty.csv").write_text(header)
    (tmp_path / "nothing.csv").write_text("")
    (tmp_path / "short.csv").write_text(header.replace(",source", "") + first)
    for name, problem in [("dup.csv", "row 2 (line 3): duplicate class"), ("empty.csv", "empty table (no rows)"),
                          ("nothing.csv", "empty file"), ("short.csv", "missing columns: source"),
                          ("absent.csv", "no such file")]:
        with pytest.raises(TableError) as err:
            bt.read_batch_table(tmp_path / name)
        assert str(err.value).startswith(f"{tmp_path / name}: ") and problem in str(err.value)


def test_a_v1_table_is_not_a_batch_table_and_back(table_file):
    with pytest.raises(TableError, match="this is a v1 shape table .* read it with table_schema.read_heuristics"
                                         ".* `splitkv-tune batch-table CSV... --gpu GPU -o FILE`"):
        bt.read_batch_table(V1_TABLE)
    for reader in (read_heuristics, read_heuristics_records):
        with pytest.raises(TableError, match="this is a batch-class table .* read it with "
                                             "splitkv_tune.batch_table.read_batch_table"):
            reader(table_file)


# --- the commands ------------------------------------------------------------------------------

def test_batch_table_command(tmp_path):
    a = write_csv(tmp_path / "skewed.csv", SKEWED_RUN)
    b = write_csv(tmp_path / "uniform run.csv", UNIFORM_RUN)
    out = tmp_path / "tables" / "batch.csv"
    result = invoke("batch-table", a, b, "--gpu", "NVIDIA H200", "-o", out)
    assert result.exit_code == 0, result.output
    assert f"wrote {out}: 2 batch classes from 10 rows of 2 CSV files" in result.output
    table = bt.read_batch_table(out)
    assert [r["source"] for r in table] == ["uniform_run.csv", "skewed.csv"]


def test_batch_table_command_bad_input(tmp_path, assert_clear_error):
    good = write_csv(tmp_path / "good.csv", SKEWED_RUN)
    old = write_csv(tmp_path / "old.csv", SKEWED_RUN, compare_batch.COLUMNS[:-5])
    peers = write_csv(tmp_path / "peers.csv", SKEWED_RUN[-2:])
    bad = write_csv(tmp_path / "bad.csv", [{**compare_row("ours", 96.0), "median_us": "fast"}])
    out = tmp_path / "t.csv"
    assert_clear_error(invoke("batch-table", old, "--gpu", "h200", "-o", out),
                       "old.csv: not a compare-batch CSV, missing columns: block_kv", "rerun compare-batch")
    assert_clear_error(invoke("batch-table", peers, "--gpu", "h200", "-o", out), "peers.csv: no candidate rows")
    assert_clear_error(invoke("batch-table", bad, "--gpu", "h200", "-o", out),
                       "bad.csv: row of 'skewed:16:65536:1024', impl 'ours': median_us must be a number")
    assert_clear_error(invoke("batch-table", tmp_path / "absent.csv", "--gpu", "h200", "-o", out), "no such file")
    assert_clear_error(invoke("batch-table", good, "--gpu", "--", "-o", out), "--gpu")
    assert_clear_error(invoke("batch-table", good, "--gpu", "h200", "-o", tmp_path), "-o", "is a directory")
    assert_clear_error(invoke("batch-table", good, "-o", out), "--gpu")
    assert not out.exists()


# --- the JSON file -----------------------------------------------------------------------------

def test_json_round_trip_and_the_schema(table_file, tmp_path):
    import jsonschema
    table = bt.read_batch_table(table_file)
    path = btj.write_batch_table_json(tmp_path / "batch_table.json", table)
    doc = json.loads(path.read_text())
    assert doc["_metadata"] == {"schema_version": 3, "gpu": "nvidia_h200", "device_name": "NVIDIA_H200",
                                "device_names": ["NVIDIA_H200"], "tool": "splitkv-tune",
                                "tool_version": doc["_metadata"]["tool_version"]}
    assert doc["classes"][1]["max_splits"] == 64 and doc["classes"][0]["page_size"] == 64
    assert btj.read_batch_table_json(path) == table
    assert btj.read_batch_table_file(path, gpu="NVIDIA H200") == btj.read_batch_table_file(table_file) == table
    with pytest.raises(TableError, match=r"unknown GPU 'h100' for this table"):
        btj.read_batch_table_json(path, gpu="h100")
    schema = json.loads(btj.SCHEMA_PATH.read_text())
    assert btj.SCHEMA_PATH.parent == Path(bt.__file__).parent / "schemas"  # in the package, as v1's is
    jsonschema.Draft202012Validator.check_schema(schema)
    assert not list(jsonschema.Draft202012Validator(schema).iter_errors(doc))
    entry = schema["$defs"]["class"]
    assert list(entry["properties"]) == btj.CLASS_KEYS
    assert set(entry["required"]) == set(btj.CLASS_KEYS) - set(bt.RUNNER_UP_COLUMNS)
    assert entry["properties"]["max_splits"]["maximum"] == live.tunables.MAX_SPLITS


def test_json_without_a_runner_up_and_needing_no_pandas(tmp_path):
    (row,) = bt.build_batch_table(as_read([compare_row("ours", 96.0)]), "h100")
    doc = btj.batch_table_json([row])
    assert doc["_metadata"]["device_names"] == ["NVIDIA_H100_80GB_HBM3", "NVIDIA_H100"]
    assert doc["classes"][0]["runner_up_block_kv"] is None
    path = tmp_path / "t.json"
    path.write_text(json.dumps({**doc, "classes": [{k: v for k, v in doc["classes"][0].items()
                                                    if not k.startswith("runner_up")}]}))
    assert btj.read_batch_table_json(path) == [row]  # runner-up keys absent: none
    import subprocess
    code = ("import sys; from splitkv_tune import batch_select, batch_table_json; "
            f"batch_table_json.read_batch_table_json({str(path)!r}); assert 'pandas' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)
    with pytest.raises(TableError, match="one JSON file holds one GPU's classes"):
        btj.batch_table_json([row, dict(row, gpu="nvidia_h200")])


@pytest.mark.parametrize("change,problem", [
    (dict(max_splits="16"), "classes[0]: max_splits must be an integer, got \"16\""),
    (dict(max_splits=16.0), "classes[0]: max_splits must be an integer, got '16.0'"),
    (dict(max_splits=129), "classes[0]: max_splits must be in [1, 128], got 129"),
    (dict(min_blocks_per_split=10 ** 9), "classes[0]: min_blocks_per_split must be an integer in [1, "),
    (dict(runner_up_min_blocks_per_split=10 ** 9), "classes[0]: runner_up_min_blocks_per_split must be an integer"),
    (dict(block_kv=True), "block_kv must be an integer, got true"),
    (dict(median_us=0), "classes[0]: median_us must be > 0"),
    (dict(median_us="1.0"), "median_us must be a number"),
    (dict(dtype=16), "dtype must be a string"),
    (dict(merge="none"), "merge must be one of ('auto', 'kernel', 'fused')"),
    (dict(source="../x y"), "source must match"),
    (dict(len_mean=9000), "len_mean (9000) exceeds len_max (8192)"),
    (dict(q_len=None), "q_len is null"),
    (dict(runner_up_us=None), "the runner-up columns"),
    (dict(extra=1), "classes[0]: unknown keys: extra"),
    (dict(page_size=...), "classes[0]: missing keys: page_size"),
    (dict(_metadata=dict(schema_version=4)), "classes[0]: schema_version is 4; a table with split_plan columns is "
                                             "version 3"),
    (dict(_metadata=dict(schema_version=1)), "classes[0]: schema_version is 1; a table with split_plan columns is "
                                             "version 3"),
    (dict(_metadata=dict(gpu='h200";x')), "gpu must match"),
    (dict(_metadata=dict(device_name="H100")), "the device_name among the device_names"),
    (dict(_metadata=dict(tool=None)), "tool must be 'splitkv-tune'"),
    (dict(classes=[]), "empty table (no rows)"),
    (dict(classes={}), "classes must be a list"),
])
def test_bad_json_is_named(table_file, tmp_path, change, problem):
    """Each bad file gives a TableError naming it and the problem, and the schema refuses it too."""
    import jsonschema
    doc = btj.batch_table_json(bt.read_batch_table(table_file))
    meta = {**doc["_metadata"], **change.pop("_metadata", {})}
    classes = change.pop("classes", None)
    if classes is None:
        classes = [{k: v for k, v in {**doc["classes"][0], **change}.items() if v is not ...}] + doc["classes"][1:]
    bad = {"_metadata": meta, "classes": classes}
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(bad))
    with pytest.raises(TableError) as err:
        btj.read_batch_table_json(path)
    assert str(err.value).startswith(f"{path}: ") and problem in str(err.value)
    schema = json.loads(btj.SCHEMA_PATH.read_text())
    # The reader's own checks: values that must agree, and 16.0 (an integer to JSON Schema, not to the CSV's cells).
    reader_only = ("len_mean", "runner-up", "among the device_names", "'16.0'", "min_blocks_per_split must be")
    assert list(jsonschema.Draft202012Validator(schema).iter_errors(bad)) or any(c in problem for c in reader_only)


def test_bad_json_files(tmp_path):
    (tmp_path / "text.json").write_text("gpu,dtype\n")
    (tmp_path / "list.json").write_text("[]")
    (tmp_path / "dir.json").mkdir()
    # A heuristics export (one entry per shape) of either version, given where a batch table goes.
    shipped = (Path(__file__).parents[1] / "results" / "nvidia_h200" / "export" / "json"
               / "device_name=NVIDIA_H200,dtype=bf16,head_dim=128.json")
    export = json.loads(shipped.read_text())
    (tmp_path / "heuristics.json").write_text(json.dumps(export))
    (tmp_path / "v1.json").write_text(json.dumps({**export, "_metadata": {**export["_metadata"], "schema_version": 1}}))
    heuristics = "this is a heuristics export (`splitkv-tune export --format json`: one entry per shape)"
    (tmp_path / "deep.json").write_text("[" * 100_000)
    (tmp_path / "twice.json").write_text('{"_metadata": {}, "_metadata": {}}')
    for name, problem in [("text.json", "not JSON"), ("list.json", "the document must be an object"),
                          ("deep.json", "nested too deeply"), ("twice.json", "duplicate keys: _metadata"),
                          ("dir.json", "is a directory"), ("absent.json", "no such file"),
                          ("heuristics.json", heuristics), ("v1.json", heuristics)]:
        with pytest.raises(TableError) as err:
            btj.read_batch_table_json(tmp_path / name)
        assert str(err.value).startswith(f"{tmp_path / name}: ") and problem in str(err.value)


def test_batch_table_command_writes_json_that_select_reads(tmp_path, table_file, assert_clear_error):
    out = tmp_path / "batch_table.json"
    result = invoke("batch-table", write_csv(tmp_path / "run.csv", SKEWED_RUN + UNIFORM_RUN), "--gpu", "h200",
                    "-o", out)
    assert result.exit_code == 0, result.output
    assert f"wrote {out}: 2 batch classes" in result.output
    assert btj.read_batch_table_json(out) == bt.read_batch_table(table_file)
    args = [*PAGED, "--lengths", "skewed:16:65536:1024", "--json"]
    from_json = json.loads(invoke(*args, "--batch-table", out).output)
    from_csv = json.loads(invoke(*args, "--batch-table", table_file).output)
    assert from_json.pop("batch_table") == str(out) and from_csv.pop("batch_table") == str(table_file)
    assert from_json == from_csv and from_json["max_splits"] == 64
    out.write_text(out.read_text().replace('"max_splits": 64', '"max_splits": 0'))
    assert_clear_error(invoke(*args, "--batch-table", out), f"{out}: classes[1]: max_splits must be in [1, 128]")


def test_a_load_aware_row_wins_only_when_faster_than_the_noise():
    uniform = [compare_row("ours", 141.7, (64, 16, 33, "fused"), batch=UNIFORM),
               compare_row("ours_load_aware", 129.1, (64, 16, 33, "fused", "load_aware"), batch=UNIFORM)]
    (row,) = bt.build_batch_table(as_read(uniform), "h200")
    assert [row[c] for c in bt.KNOB_COLUMNS] == [64, 16, 33, "fused", "load_aware"]
    assert row["runner_up_split_plan"] == "fixed" and row["n_trials"] == 2
    tie = [compare_row("ours_m16_s33_load_aware", 100.0, (64, 16, 33, "fused", "load_aware")),
           compare_row("ours_m16_s64", 100.5, (64, 16, 64, "fused"))]  # within 1%, a larger max_splits
    (row,) = bt.build_batch_table(as_read(tie), "h200")
    assert row["split_plan"] == "fixed" and row["max_splits"] == 64  # ties go to the fixed plan first


def test_files_written_before_the_split_plan_read_as_fixed(tmp_path):
    legacy = [c for c in compare_batch.COLUMNS if c != "split_plan"]
    run = write_csv(tmp_path / "v2_run.csv", SKEWED_RUN + [compare_row("ours_load_aware", 50.0, ("", "", "", ""))],
                    legacy)
    rows = bt.read_compare_batch_csv(run)
    assert {r["split_plan"] for r in rows if r["impl"] == "ours"} == {"fixed"}
    (row,) = bt.build_batch_table(rows, "h200")
    assert row["split_plan"] == "fixed" and row["median_us"] == 93.4  # the knob-less load-aware row is no candidate
    v2_columns = [c for c in bt.BATCH_TABLE_COLUMNS if c not in bt.SPLIT_PLAN_COLUMNS]
    v2 = write_csv(tmp_path / "v2.csv", [{**{c: "" if row[c] is None else row[c] for c in v2_columns},
                                          "schema_version": 2}], v2_columns)
    (old,) = bt.read_batch_table(v2)
    assert old == {**row, "schema_version": 2}
    doc = btj.batch_table_json([row])
    doc["_metadata"]["schema_version"] = 2
    for entry in doc["classes"]:
        for c in bt.SPLIT_PLAN_COLUMNS:
            del entry[c]
    path = tmp_path / "v2.json"
    path.write_text(json.dumps(doc))
    assert btj.read_batch_table_json(path) == [{**row, "schema_version": 2}]
    with pytest.raises(TableError, match="schema_version is 3; a table without split_plan columns is version 2"):
        v2.write_text(v2.read_text().replace("\n2,", "\n3,"))
        bt.read_batch_table(v2)


def test_a_class_timed_again_takes_the_later_runs_rows_only():
    first = as_read(SKEWED_RUN, source="batches.csv")
    again = as_read([compare_row("ours", 99.0), compare_row("ours_load_aware", 97.0, (64, 16, 33, "fused",
                                                                                      "load_aware"))],
                    source="batches_split_plan.csv")
    (row,) = bt.build_batch_table(first + again, "h200")
    assert row["source"] == "batches_split_plan.csv" and row["n_trials"] == 2 and row["split_plan"] == "load_aware"
    (row,) = bt.build_batch_table(again + first, "h200")
    assert row["source"] == "batches.csv" and row["n_trials"] == 4


def test_two_csvs_of_one_name_are_two_runs(tmp_path):
    (tmp_path / "old").mkdir()
    (tmp_path / "new").mkdir()
    old = write_csv(tmp_path / "old" / "batches.csv", [compare_row("ours", 90.0)])
    new = write_csv(tmp_path / "new" / "batches.csv", [compare_row("ours", 100.0),
                                                       compare_row("ours_m4_s64", 99.0, (64, 4, 64, "fused"))])
    (row,) = bt.build_batch_table(bt.read_compare_batch_csv(old) + bt.read_compare_batch_csv(new), "h200")
    assert row["median_us"] == 99.0 and row["n_trials"] == 2
