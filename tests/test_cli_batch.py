"""``splitkv-tune compare-batch``: bad input ends in one line naming the option, exit 2, before
CUDA is touched (nothing is measured or written)."""
import pandas as pd
import pytest
from click.testing import CliRunner

from splitkv_tune import bench, compare_batch, plan
from splitkv_tune.cli import main


@pytest.fixture(autouse=True)
def no_cuda(monkeypatch):
    def touched(*args, **kwargs):
        raise AssertionError("CUDA was touched before the input was checked")
    monkeypatch.setattr(compare_batch, "run_compare_batches", touched)
    monkeypatch.setattr(bench, "backend_problem", touched)


def invoke(*args):
    return CliRunner().invoke(main, ["compare-batch", *args])


@pytest.mark.parametrize("lengths,expected", [
    ("", "lengths are empty"),
    ("1024,,5", "empty item"),
    ("1024x0", "repeat count"),
    ("-5", "is negative"),
    ("skewed:16:65536", "expected skewed:N:LONG:SHORT"),
    ("normal:4:10", "unknown distribution"),
    ("uniform:0:8", "N must be at least 1"),
])
def test_bad_lengths(lengths, expected, assert_clear_error):
    assert_clear_error(invoke("--lengths", lengths), "--lengths", expected)


def test_one_bad_batch_of_several(assert_clear_error):
    assert_clear_error(invoke("--lengths", "uniform:16:8192", "--lengths", "8x"),
                       "--lengths", "'8x'")


def test_lengths_are_required(assert_clear_error):
    assert_clear_error(invoke(), "--lengths")


@pytest.mark.parametrize("value", ["2", "48", "512", "0"])
def test_bad_page_size(value, assert_clear_error):
    assert_clear_error(invoke("--lengths", "4", "--page-size", value), "--page-size", str(plan.PAGE_SIZES))


@pytest.mark.parametrize("args,expected", [
    (["--q-heads", "6", "--kv-heads", "4"], "multiple of kv_heads"),
    (["--head-dim", "80"], "head_dim must be one of"),
    (["--q-len", "0"], "q_len must be a positive integer"),
    (["--kv-heads", "0"], "kv_heads must be a positive integer"),
])
def test_bad_shape(args, expected, assert_clear_error):
    assert_clear_error(invoke("--lengths", "65536,1024x15", *args), "bad shape", "65536,1024x15",
                       expected)


@pytest.mark.parametrize("args,names", [
    (["--peers", "flex,flashinfer_decode"], ["--peers", "flex"]),
    (["--one-split", "0"], ["--one-split"]),
    (["--one-split", "129"], ["--one-split"]),
    (["--dtype", "fp32"], ["--dtype"]),
])
def test_bad_options(args, names, assert_clear_error):
    assert_clear_error(invoke("--lengths", "4", *args), *names)


def test_bad_output_paths(tmp_path, assert_clear_error):
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    assert_clear_error(invoke("--lengths", "4", "--csv", str(a_file / "rows.csv")), "--csv",
                       "is a file")
    assert_clear_error(invoke("--lengths", "4", "--out-md", str(tmp_path)), "--out-md",
                       "is a directory")


def test_no_gpu_is_a_usage_error(monkeypatch, assert_clear_error):
    monkeypatch.setattr(bench, "backend_problem", lambda backend: "no GPU here")
    assert_clear_error(invoke("--lengths", "skewed:16:65536:1024"), "no GPU here")


def test_default_peers_are_the_modules():
    default = next(p for p in main.commands["compare-batch"].params if p.name == "peers").default
    assert tuple(default.split(",")) == compare_batch.DEFAULT_PEERS


@pytest.mark.parametrize("value", ["4", "0:8", "4:0", "4:129", "a:b", "1:2:3", "1:2:64:1", "1:2:64:none",
                                   "1:2:64:fused:1"])
def test_bad_plan_knobs(value, assert_clear_error):
    assert_clear_error(invoke("--lengths", "4", "--plan", value), "--plan", "MIN_BLOCKS:MAX_SPLITS")


@pytest.mark.parametrize("value", ["1", "0", "2000", "x"])
def test_bad_wider(value, assert_clear_error):
    assert_clear_error(invoke("--lengths", "4", "--wider", value), "--wider")


@pytest.mark.parametrize("value,expected", [
    ("64:1,2", "got 2"), ("64:1:8:fused:4", "split_plan must be one of"),
    ("64:1:8:fused:fixed:x", "got 6"), ("64:1:8:4", "merge must be one of"),
    ("48:1:8", "block_kv must be one of"),
    ("64:0:8", "min_blocks_per_split must be an integer in [1, "), ("64:1:0,8", "max_splits must be an integer"),
    ("64,:1:8", "invalid literal"), ("a:1:8", "invalid literal"),
])
def test_bad_plan_space(value, expected, assert_clear_error):
    assert_clear_error(invoke("--lengths", "4", "--plan-space", value), "--plan-space",
                       "BLOCK_KVS:MIN_BLOCKS:MAX_SPLITS", expected)


def test_a_plan_space_no_block_kv_of_which_is_built_at_the_head_dim(assert_clear_error):
    assert_clear_error(invoke("--lengths", "4", "--head-dim", "256", "--plan-space", "128:1:8"), "--plan-space",
                       "no block_kv of [128] is built at --head-dim 256")


def test_the_plan_space_adds_the_points_not_given_by_plan(monkeypatch):
    asked = {}
    monkeypatch.setattr(bench, "backend_problem", lambda backend: None)
    monkeypatch.setattr(compare_batch, "run_compare_batches",
                        lambda texts, **kw: asked.update(kw) or pd.DataFrame(columns=compare_batch.COLUMNS))
    result = invoke("--lengths", "4", "--head-dim", "256", "--plan", "2:8", "--plan-space", "64,128:1,2:8,8")
    assert result.exit_code == 0, result.output
    assert "leaving out block_kv [128], not built at head_dim 256" in result.output
    assert asked["plans"] == [(2, 8, 64), (1, 8, 64)]


def test_plans_and_a_plan_space_with_merges(monkeypatch):
    asked = {}
    monkeypatch.setattr(bench, "backend_problem", lambda backend: None)
    monkeypatch.setattr(compare_batch, "run_compare_batches",
                        lambda texts, **kw: asked.update(kw) or pd.DataFrame(columns=compare_batch.COLUMNS))
    result = invoke("--lengths", "4", "--plan", "4:32:64:kernel", "--plan", "4:32:128:auto",
                    "--plan-space", "64:4:32:fused,kernel")
    assert result.exit_code == 0, result.output
    assert asked["plans"] == [(4, 32, 64, "kernel"), (4, 32, 128), (4, 32, 64, "fused")]
