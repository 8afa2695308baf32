"""``sweep-batches`` on the CPU: our paged call is stood in for by the reference (as in
test_compare_batch), so the grid, the expansion of the space, the CSV written batch by batch,
resume, a killed run, the dry run and the batch table built from the CSV are tested without a GPU."""
import copy
import csv
from pathlib import Path

import pytest
import torch
import yaml
from click.testing import CliRunner

from splitkv_tune import batch_sweep as bsw
from splitkv_tune import batch_table, bench, live, plan_points, table
from splitkv_tune import compare_batch as cb
from splitkv_tune.cli import main
from splitkv_tune.reference import splitkv_attention_ref
from splitkv_tune.space import GridError
from splitkv_tune.table_schema import TableError

GRID = {
    "name": "tiny",
    "heads": [{"dtype": "bf16", "head_dim": 64, "q_heads": 4, "kv_heads": 2, "q_len": 1}],
    "page_size": [16, 32],
    "lengths": ["40,7x3", "uniform:2:33"],
    "space": {"block_kv": [64, 128], "min_blocks_per_split": [1, 2], "max_splits": [4]},
    "timing": {"warmup_s": 0.0, "min_reps": 2, "max_time_s": 0.0},
}
BATCHES = 4  # 1 head x 2 page sizes x 2 lengths
ROWS = 6  # ours, 4 space points, the floor


@pytest.fixture
def ours(monkeypatch):
    """Our call replaced by the reference; returns the labels of the batches timed."""
    timed = []

    def attention(q, k, v, *, cache_seqlens, block_table, **knobs):
        return splitkv_attention_ref(q.float(), k.float(), v.float(), cache_seqlens=cache_seqlens,
                                     block_table=block_table).to(q.dtype)
    run = cb.run_compare_batch

    def run_batch(label, **kwargs):
        timed.append(label)
        return run(label, **kwargs)
    monkeypatch.setattr(cb, "our_attention", attention)
    monkeypatch.setattr(cb, "run_compare_batch", run_batch)
    return timed


def write_grid(tmp_path, grid=GRID, name="grid.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(grid))
    return path


def sweep(tmp_path, grid=GRID, peers=()):
    """Plan and run the grid into tmp_path/rows.csv on the CPU; (plan, skipped)."""
    out = tmp_path / "rows.csv"
    plan = bsw.plan_sweep(bsw.parse_batch_grid(copy.deepcopy(grid)), out, peers)
    return plan, bsw.run_sweep(plan, out, device="cpu", copy_bw=100.0)


def read_csv(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def batches_in(path):
    """{batch key: [impl, ...]} of a sweep's CSV."""
    out = {}
    for row in read_csv(path):
        out.setdefault(tuple(row[c] for c in bsw.KEY_COLUMNS), []).append(row["impl"])
    return out


def test_the_grid_expands_to_batches_and_plan_rows():
    grid = bsw.parse_batch_grid(copy.deepcopy(GRID), "tiny.yaml")
    assert len(grid.batches) == BATCHES and grid.timing["min_reps"] == 2
    first = grid.batches[0]
    assert first.key() == ("bf16", "64", "4", "2", "1", "16", "40,7x3")
    assert first.plans == ((1, 4, 64), (2, 4, 64), (1, 4, 128), (2, 4, 128))
    assert first.impls() == ["ours", "ours_m1_s4", "ours_m2_s4", "ours_kv128_m1_s4", "ours_kv128_m2_s4",
                             "copy_floor"]
    assert first.impls(["flashinfer_decode"])[-2:] == ["flashinfer_decode", "copy_floor"]


def test_a_space_with_merges_times_each_point_with_each():
    raw = copy.deepcopy(GRID)
    raw["space"]["merge"] = ["fused", "kernel"]
    first = bsw.parse_batch_grid(raw).batches[0]
    assert first.plans[:2] == ((1, 4, 64, "fused"), (1, 4, 64, "kernel")) and len(first.plans) == 8
    assert first.impls()[1:3] == ["ours_m1_s4_fused", "ours_m1_s4_kernel"]


def test_a_space_with_split_plans_times_each_point_with_each(tmp_path):
    raw = copy.deepcopy(GRID)
    raw["space"]["split_plan"] = ["fixed", "load_aware"]
    first = bsw.parse_batch_grid(raw).batches[0]
    assert first.plans[:2] == ((1, 4, 64), (1, 4, 64, "auto", "load_aware")) and len(first.plans) == 8
    assert first.impls()[1:3] == ["ours_m1_s4", "ours_m1_s4_load_aware"]
    raw["space"]["split_plan"] = ["greedy"]
    with pytest.raises(GridError, match="split_plan must be one of"):
        bsw.parse_batch_grid(raw)


def test_a_sweep_csv_from_before_the_split_plan_reads_and_is_rewritten_with_it(tmp_path, ours, monkeypatch):
    monkeypatch.setattr(cb, "_num_sms", lambda device: 132)  # knob columns filled, as on a GPU
    out = tmp_path / "rows.csv"
    sweep(tmp_path)
    rows = read_csv(out)
    legacy = [c for c in cb.COLUMNS if c != "split_plan"]
    with open(out, "w", newline="") as f:
        writer = csv.DictWriter(f, legacy, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    again = bsw.read_rows(out)
    assert [r["split_plan"] for r in again] == [r["split_plan"] for r in rows]
    assert {r["split_plan"] for r in again if r["impl"] != "copy_floor"} == {"fixed"}
    grid = copy.deepcopy(GRID)
    grid["lengths"].append("uniform:3:20")  # one batch more: the sweep writes the file again
    sweep(tmp_path, grid)
    with open(out, newline="") as f:
        assert next(csv.reader(f)) == cb.COLUMNS
    assert [r["split_plan"] for r in read_csv(out)][:len(rows)] == [r["split_plan"] for r in rows]


def test_the_space_drops_block_kvs_a_head_dim_does_not_build_and_repeats():
    grid = copy.deepcopy(GRID)
    grid["heads"].append({"dtype": "fp16", "head_dim": 256, "q_heads": 8, "kv_heads": 1, "q_len": 1})
    grid["heads"].append(dict(grid["heads"][0]))  # a repeated head configuration
    grid["lengths"].append("uniform:2:33")  # and a repeated batch
    grid["space"]["max_splits"] = [4, 4]
    batches = bsw.parse_batch_grid(grid).batches
    assert len(batches) == 2 * BATCHES
    assert {b.plans for b in batches if b.head["head_dim"] == 256} == {((1, 4, 64), (2, 4, 64))}
    assert plan_points.expand_plan_space([64, 128, 64], [1, 2], [8], 256, plans=[(2, 8), (1, 8, 32)]) == \
        ([(1, 8, 64)], [128])
    assert plan_points.expand_plan_space([32], [1], [8], 128, plans=[(1, 8)]) == ([(1, 8, 32)], [])


def _changed(path, value):
    grid = copy.deepcopy(GRID)
    *parents, last = path
    node = grid
    for key in parents:
        node = node[key]
    if value is KeyError:
        del node[last]
    else:
        node[last] = value
    return grid


@pytest.mark.parametrize("path,value,expected", [
    (["spaces"], {}, "unknown key(s) ['spaces']"),
    (["space"], KeyError, "missing key(s) ['space']"),
    (["heads"], [], "heads: expected a non-empty list"),
    (["heads", 0, "q_len"], KeyError, "heads[0]: unknown field(s) [], missing field(s) ['q_len']"),
    (["heads", 0, "batch"], 4, "heads[0]: unknown field(s) ['batch']"),
    (["heads", 0, "q_heads"], 3, "heads[0]: q_heads (3) must be a multiple of kv_heads (2)"),
    (["heads", 0, "dtype"], "fp32", "heads[0]: dtype must be one of"),
    (["heads", 0, "head_dim"], 80, "heads[0]: head_dim must be one of"),
    (["heads", 0], "bf16", "heads[0]: expected a mapping"),
    (["page_size"], [48], "page_size: expected values in"),
    (["page_size"], [], "page_size: expected a non-empty list of integers"),
    (["page_size"], ["16"], "page_size: expected a non-empty list of integers"),
    (["lengths"], [], "lengths: expected a non-empty list"),
    (["lengths", 1], "uniform:0:8", "lengths[1]: 'uniform:0:8': uniform: N must be at least 1"),
    (["lengths", 0], "40 x 3", "lengths[0]: expected a lengths text"),
    (["lengths", 0], 1024, "lengths[0]: expected a lengths text"),
    (["space", "max_splits"], KeyError, "space: expected a mapping of ['block_kv', 'min_blocks_per_split', 'max_splits']"),
    (["space", "merges"], ["fused"], "and optionally ['merge', 'split_plan']"),
    (["space", "merge"], "fused", "space.merge: expected a non-empty list of merges"),
    (["space", "merge"], ["fast"], "space: merge must be one of"),
    (["space", "block_kv"], [48], "space: block_kv must be one of"),
    (["space", "block_kv"], [], "space.block_kv: expected a non-empty list"),
    (["space", "max_splits"], [0], "space: max_splits must be an integer in [1, 128]"),
    (["space", "min_blocks_per_split"], [1, 0], "space: min_blocks_per_split must be an integer in [1, "),
    (["space", "min_blocks_per_split"], [True], "space.min_blocks_per_split: expected a non-empty list"),
    (["timing"], {"max_time_s": -1}, "timing.max_time_s"),
])
def test_a_bad_grid_names_the_field(path, value, expected):
    with pytest.raises(GridError) as err:
        bsw.parse_batch_grid(_changed(path, value), "g.yaml")
    assert str(err.value).startswith("g.yaml: ") and expected in str(err.value)


def test_a_space_no_head_dim_builds_is_an_error():
    grid = _changed(["space", "block_kv"], [128])
    grid["heads"][0]["head_dim"] = 256
    with pytest.raises(GridError, match=r"space.block_kv: none of \[128\] is built at head_dim 256 \(heads\[0\]\)"):
        bsw.parse_batch_grid(grid)


def test_grid_files(tmp_path):
    with pytest.raises(GridError, match="cannot read the grid"):
        bsw.load_batch_grid(tmp_path / "none.yaml")
    (tmp_path / "bad.yaml").write_text("heads: [")
    with pytest.raises(GridError, match="not valid YAML"):
        bsw.load_batch_grid(tmp_path / "bad.yaml")
    assert len(bsw.load_batch_grid(write_grid(tmp_path)).batches) == BATCHES


def test_the_shipped_grid():
    grid = bsw.load_batch_grid(Path(__file__).parents[1] / "configs" / "batches.yaml")
    assert len(grid.batches) == 28 and all(len(b.plans) == 40 for b in grid.batches)
    plan = bsw.plan_sweep(grid, "/nonexistent/rows.csv")
    assert plan.timed_rows() == 28 * 41
    assert plan.estimate_s() < 15 * 60  # its header says so


def test_a_sweep_writes_every_batch_in_compare_batchs_columns(ours, tmp_path):
    plan, skipped = sweep(tmp_path)
    assert not skipped and ours == ["40,7x3", "uniform:2:33"] * 2
    rows = read_csv(tmp_path / "rows.csv")
    assert list(rows[0]) == cb.COLUMNS and len(rows) == BATCHES * ROWS
    timed = [r for r in rows if r["impl"] != "copy_floor"]
    assert all(r["status"] == "ok" and r["check"].startswith("ok vs reference") for r in timed)
    assert {tuple(impls) for impls in batches_in(tmp_path / "rows.csv").values()} == {tuple(plan.todo[0].impls())}
    assert {r["page_size"] for r in rows} == {"16", "32"}
    note = next(r["note"] for r in rows if r["impl"] == "ours_kv128_m2_s4")
    assert note == "block_kv=128, min_blocks_per_split=2, max_splits=4"


def test_a_rerun_skips_the_complete_batches(ours, tmp_path):
    sweep(tmp_path)
    before = (tmp_path / "rows.csv").read_text()
    ours.clear()
    plan, _ = sweep(tmp_path)
    assert len(plan.complete) == BATCHES and not plan.todo and ours == []
    assert (tmp_path / "rows.csv").read_text() == before


def test_a_killed_sweep_keeps_whole_batches_and_resumes(ours, tmp_path, monkeypatch):
    run = cb.run_compare_batch

    def killed_at_the_third(label, **kwargs):
        if len(ours) == 2:
            raise KeyboardInterrupt
        return run(label, **kwargs)
    monkeypatch.setattr(cb, "run_compare_batch", killed_at_the_third)
    with pytest.raises(KeyboardInterrupt):
        sweep(tmp_path)
    done = batches_in(tmp_path / "rows.csv")
    assert len(done) == 2 and all(len(impls) == ROWS for impls in done.values())
    assert [p.name for p in tmp_path.iterdir()] == ["rows.csv"]  # no temporary file left

    monkeypatch.setattr(cb, "run_compare_batch", run)
    ours.clear()
    plan, _ = sweep(tmp_path)
    assert len(plan.complete) == 2 and len(plan.todo) == 2 and len(ours) == 2
    done = batches_in(tmp_path / "rows.csv")
    assert len(done) == BATCHES and all(len(impls) == ROWS for impls in done.values())


def test_a_failed_write_leaves_the_csv_as_it_was(ours, tmp_path, monkeypatch):
    writes = []
    write = table.atomic_write_text

    def full_disk_at_the_second(path, text):
        writes.append(path)
        if len(writes) == 2:
            raise OSError(28, "No space left on device")
        return write(path, text)
    monkeypatch.setattr(table, "atomic_write_text", full_disk_at_the_second)
    with pytest.raises(OSError):
        sweep(tmp_path)
    assert len(batches_in(tmp_path / "rows.csv")) == 1


def test_a_batch_missing_rows_of_the_space_is_timed_again_and_replaced(ours, tmp_path):
    sweep(tmp_path, _changed(["space", "max_splits"], [4]))
    ours.clear()
    grid = _changed(["space", "max_splits"], [4, 8])
    grid["lengths"] = ["40,7x3"]
    plan, _ = sweep(tmp_path, grid)
    assert len(plan.stale) == 2 and ours == ["40,7x3", "40,7x3"]
    done = batches_in(tmp_path / "rows.csv")
    assert len(done) == BATCHES
    for key, impls in done.items():
        assert len(impls) == len(set(impls)) == (10 if key[-1] == "40,7x3" else ROWS), key


def test_a_batch_with_a_failed_row_is_timed_again(ours, tmp_path):
    sweep(tmp_path)
    path = tmp_path / "rows.csv"
    rows = read_csv(path)
    failed_key = tuple(rows[0][c] for c in bsw.KEY_COLUMNS)
    rows[0]["status"] = "failed"
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, list(rows[0]), lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
    plan = bsw.plan_sweep(bsw.parse_batch_grid(copy.deepcopy(GRID)), path)
    assert [b.key() for b in plan.stale] == [failed_key] and len(plan.complete) == BATCHES - 1


def test_one_writer_per_csv(tmp_path):
    path = tmp_path / "rows.csv"
    with bsw.sole_writer(path):
        with pytest.raises(ValueError, match="another sweep-batches or evaluate-batches is writing it"):
            with bsw.sole_writer(path):
                pass
    with bsw.sole_writer(path):  # released with the block
        pass


def test_a_batch_the_call_refuses_is_a_grid_error():
    grid = _changed(["lengths"], ["uniform:40000:16"])
    with pytest.raises(GridError, match=r"batch \* kv_heads must be at most 65535, got 40000 \* 2"):
        bsw.parse_batch_grid(grid, "g.yaml")


def test_batches_that_do_not_fit_are_skipped_with_the_reason(ours, tmp_path, monkeypatch):
    monkeypatch.setattr(cb, "input_memory_problem",
                        lambda lengths, **kw: "too large" if kw["page_size"] == 32 else None)
    _, skipped = sweep(tmp_path)
    assert [(b.page_size, why) for b, why in skipped] == [(32, "too large")] * 2
    assert {key[5] for key in batches_in(tmp_path / "rows.csv")} == {"16"}


def test_the_memory_check_counts_every_input_set(monkeypatch):
    asked = []
    monkeypatch.setattr(cb, "_memory_problem", lambda needs, device, what: asked.append(needs) or "no room")
    monkeypatch.setattr(bench, "sets_for_bytes", lambda nbytes, device: 3)
    assert cb.input_memory_problem([40, 7], kv_heads=2, head_dim=64, page_size=16, device="cpu") == "no room"
    pools = 2 * (3 + 1) * 16 * 2 * 64  # K and V: 4 pages of 16 tokens
    assert asked == [pools * 2 * 3 + pools * 4]  # three bf16 sets and the reference's fp32 copies


def test_a_csv_of_other_columns_is_refused(tmp_path):
    out = tmp_path / "rows.csv"
    out.write_text("label,impl\nx,ours\n")
    with pytest.raises(TableError, match=r"rows.csv: not in compare-batch's columns \(missing \['batch'"):
        bsw.plan_sweep(bsw.parse_batch_grid(copy.deepcopy(GRID)), out)
    out.write_text(",".join(reversed(cb.COLUMNS)) + "\n")
    with pytest.raises(TableError, match="the same columns in another order"):
        bsw.plan_sweep(bsw.parse_batch_grid(copy.deepcopy(GRID)), out)
    out.write_text(",".join(cb.COLUMNS) + "\nx,ours\n")
    with pytest.raises(TableError, match=f"line 2: not {len(cb.COLUMNS)} cells"):
        bsw.plan_sweep(bsw.parse_batch_grid(copy.deepcopy(GRID)), out)


def invoke(*args):
    return CliRunner().invoke(main, ["sweep-batches", *args])


@pytest.fixture
def cpu_cli(ours, monkeypatch):
    """The command run on the CPU: no CUDA problem, the CPU as the device, a fixed bandwidth."""
    monkeypatch.setattr(bench, "backend_problem", lambda backend: None)
    monkeypatch.setattr(bench, "default_device", lambda backend: torch.device("cpu"))
    monkeypatch.setattr(bench, "copy_bandwidth_gbps", lambda device, **kw: 100.0)
    return ours


def test_the_dry_run_lists_the_batches_and_times_nothing(tmp_path, monkeypatch):
    def touched(*args, **kwargs):
        raise AssertionError("the dry run touched CUDA")
    monkeypatch.setattr(bench, "backend_problem", touched)
    monkeypatch.setattr(bsw, "run_sweep", touched)
    out = tmp_path / "rows.csv"
    result = invoke("--grid", str(write_grid(tmp_path)), "--csv", str(out), "--dry-run")
    assert result.exit_code == 0, result.output
    assert result.output.count("[to time] bf16 D64 Hq4/Hkv2 Sq1 page ") == BATCHES
    assert "page 32 uniform:2:33 (B 2, max 33, mean 33): 5 timed rows" in result.output
    assert f"to time: {BATCHES} batches (0 to re-time), {BATCHES * (ROWS - 1)} rows, about" in result.output
    assert "0 already complete" in result.output and not out.exists()


def test_the_dry_run_estimate():
    grid = bsw.parse_batch_grid(copy.deepcopy(GRID))
    timing = {"warmup_s": 0.05, "min_reps": 20, "max_time_s": 0.2}
    row = 0.05 + 0.2 + bsw.ROW_OVERHEAD_S  # a small batch: its samples take max_time_s
    assert bsw.batch_seconds(grid.batches[0], timing) == pytest.approx(bsw.BATCH_OVERHEAD_S + 5 * row)
    assert bsw.batch_seconds(grid.batches[0], timing, peers=2) == pytest.approx(bsw.BATCH_OVERHEAD_S + 7 * row)


def test_the_command_resumes_and_says_what_it_skipped(cpu_cli, tmp_path):
    grid, out = str(write_grid(tmp_path)), str(tmp_path / "rows.csv")
    result = invoke("--grid", grid, "--csv", out)
    assert result.exit_code == 0, result.output
    assert f"{BATCHES} batches timed, 0 complete before" in result.output
    assert f"batch 1/{BATCHES} bf16 D64" in result.output
    result = invoke("--grid", grid, "--csv", out)
    assert f"skipping {BATCHES} of {BATCHES} batches already complete" in result.output
    assert "0 batches timed" in result.output
    result = invoke("--grid", grid, "--csv", out, "--dry-run")
    assert result.output.count("[complete]") == BATCHES


def test_peers_are_timed_beside_ours(cpu_cli, tmp_path):
    result = invoke("--grid", str(write_grid(tmp_path)), "--csv", str(tmp_path / "rows.csv"), "--peers", "sdpa_cudnn")
    assert result.exit_code == 0, result.output
    assert all(impls[-2:] == ["sdpa_cudnn", "copy_floor"] for impls in batches_in(tmp_path / "rows.csv").values())


@pytest.mark.parametrize("args,expected", [
    (["--grid", "none.yaml"], "none.yaml: cannot read the grid"),
    (["--peers", "flex"], "--peers"),
    (["--csv", "."], "--csv"),
])
def test_bad_input_is_a_clear_error(args, expected, tmp_path, monkeypatch, assert_clear_error):
    monkeypatch.chdir(tmp_path)
    write_grid(tmp_path)
    options = dict(zip(["--grid", "--csv"], ["grid.yaml", "rows.csv"]))
    options.update(zip(args[::2], args[1::2]))
    assert_clear_error(invoke(*[x for kv in options.items() for x in kv]), expected)


def test_a_bad_grid_or_csv_is_a_clear_error(tmp_path, assert_clear_error):
    out = tmp_path / "rows.csv"
    assert_clear_error(invoke("--grid", str(write_grid(tmp_path, _changed(["page_size"], [48]))), "--csv", str(out)),
                       "page_size: expected values in")
    out.write_text("label,impl\n")
    assert_clear_error(invoke("--grid", str(write_grid(tmp_path)), "--csv", str(out)), "not in compare-batch's columns")


def test_the_batch_table_builds_from_the_sweeps_csv(cpu_cli, tmp_path, monkeypatch):
    monkeypatch.setattr(cb, "_num_sms", lambda device: 132)
    out = tmp_path / "rows.csv"
    assert invoke("--grid", str(write_grid(tmp_path)), "--csv", str(out)).exit_code == 0
    result = CliRunner().invoke(main, ["batch-table", str(out), "--gpu", "h200", "-o", str(tmp_path / "table.csv")])
    assert result.exit_code == 0, result.output
    rows = batch_table.read_batch_table(tmp_path / "table.csv")
    assert len(rows) == BATCHES and {r["n_trials"] for r in rows} == {ROWS - 1}
    assert {(r["page_size"], r["lengths"]) for r in rows} == {(p, s) for p in (16, 32) for s in GRID["lengths"]}
    auto = live.resolve_knobs(4, 64, 2, 2, 132)
    ours = [r for r in read_csv(out) if r["impl"] == "ours"]
    assert {tuple(int(r[c]) for c in cb.KNOB_COLUMNS[:3]) for r in ours} == {auto}
