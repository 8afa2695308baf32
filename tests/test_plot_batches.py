"""``plot --batches``: per-batch speed-ups from committed compare-batch CSVs (CPU only)."""
from pathlib import Path

import pandas as pd
import pytest
from click.testing import CliRunner

from splitkv_tune.cli_tables import plot
from splitkv_tune.plot_batches import (batch_ratios, draw, gpu_label, plot_batches,
                                       read_batches, rivals_of)
from test_plot import FIXTURES, png_size

PAGED = Path(__file__).resolve().parent.parent / "results" / "nvidia_h200" / "paged"
STATIC = PAGED / "static_first_wave_2026-12-02.csv"


def test_figure_for_a_committed_csv(tmp_path):
    r = CliRunner().invoke(plot, ["--batches", str(STATIC), "-o", str(tmp_path) + "/"])
    assert r.exit_code == 0, r.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["paged_batches.png",
                                                          "paged_batches.svg"]
    w, h = png_size(tmp_path / "paged_batches.png")
    assert w >= 900 and h >= 600
    svg = (tmp_path / "paged_batches.svg").read_text()
    for text in ("nvidia_h200", "static_first_wave_2026-12-02.csv",
                 "bf16 D=128 Hq=32 Hkv=8 page 64", "skewed:16:65536:1024", "1.25× copy floor",
                 "ours_one_split", "1.69×"):
        assert text in svg, text


def test_base_name_output_and_several_runs(tmp_path):
    files = plot_batches([STATIC, PAGED / "persistent_2026-12-02.csv"], tmp_path / "p")
    assert [p.name for p in files] == ["p_batches.png", "p_batches.svg"]
    svg = files[1].read_text()
    assert "runs static_first_wave_2026-12-02.csv, persistent_2026-12-02.csv" in svg


def test_ratios_are_the_csvs(tmp_path):
    raw = pd.read_csv(STATIC)
    ratios = batch_ratios(read_batches(STATIC))
    assert rivals_of(raw) == ["ours_one_split", "flashinfer_decode_tc", "flashinfer_xqa",
                              "sdpa_cudnn"]
    assert len(ratios) == 4 * raw["label"].nunique()
    both = ratios.merge(raw, left_on=["label", "rival"], right_on=["label", "impl"])
    timed = both[both["status"] == "ok"]
    assert len(timed) == 15
    assert timed["speedup"].to_numpy() == pytest.approx(timed["ours_speedup"].to_numpy())
    ours = raw[raw["impl"] == "ours"].set_index("label")["x_floor"]
    assert ratios["x_floor"].to_numpy() == pytest.approx(ours[ratios["label"]].to_numpy())


def test_one_label_under_two_page_sizes_is_two_batches(tmp_path):
    """A sweep-batches CSV times one label under several head shapes and page sizes: each is a
    batch of its own, named by its shape and page on the figure."""
    raw = pd.read_csv(STATIC)
    one = raw[raw["label"] == raw["label"].iloc[0]]
    other = one.assign(page_size=16, median_us=one["median_us"] * 2)
    other.loc[other["impl"] == "ours", "median_us"] = one.loc[one["impl"] == "ours", "median_us"].to_numpy()
    path = tmp_path / "two_pages.csv"
    pd.concat([one, other]).to_csv(path, index=False)
    ratios = batch_ratios(read_batches(path))
    timed = ratios.dropna(subset=["speedup"])
    assert len(ratios) == 2 * len(rivals_of(one))
    first, second = (timed.iloc[: len(timed) // 2], timed.iloc[len(timed) // 2:])
    assert second["speedup"].to_numpy() == pytest.approx(2 * first["speedup"].to_numpy())
    svg = next(p for p in plot_batches([path], tmp_path / "fig", "h200") if p.suffix == ".svg").read_text()
    assert "page 16" in svg and "page 64" in svg


def _edited(tmp_path) -> Path:
    """The committed CSV with a failed peer, a peer not run, and a batch whose ours failed."""
    df = pd.read_csv(STATIC)
    xqa = (df["label"] == "geometric:8:262144:2048") & (df["impl"] == "flashinfer_xqa")
    df.loc[xqa, ["status", "median_us", "reason"]] = ["failed", None,
                                                      "CUDA error: an illegal memory access"]
    df = df[~((df["label"] == "uniform:16:8192") & (df["impl"] == "flashinfer_decode_tc"))]
    ours = (df["label"] == "skewed:16:65536:1024") & (df["impl"] == "ours")
    df.loc[ours, ["status", "median_us"]] = ["failed", None]
    path = tmp_path / "edited.csv"
    df.to_csv(path, index=False)
    return path


def test_missing_peers_are_marked(tmp_path):
    frame = read_batches(_edited(tmp_path))
    ratios = batch_ratios(frame).set_index(["label", "rival"])
    assert ratios.loc[("skewed:256:131072:512", "sdpa_cudnn"), "missing"].startswith(
        "skipped: the padded batch's copies take")
    assert ratios.loc[("geometric:8:262144:2048", "flashinfer_xqa"), "missing"] == (
        "failed: CUDA error: an illegal memory access")
    assert ratios.loc[("uniform:16:8192", "flashinfer_decode_tc"), "missing"] == "not run"
    assert set(ratios.loc["skewed:16:65536:1024", "missing"]) == {"ours failed"}
    assert ratios["speedup"].isna().sum() == 7  # nothing is drawn for a missing slot
    fig = draw(frame, ratios.reset_index(), "t")
    texts = [t.get_text() for t in fig.axes[0].texts]
    assert "n/a (skipped: the padded batch's copies take 256.0 GiB, more…)" in texts
    assert "n/a (not run)" in texts and texts.count("n/a (ours failed)") == 4
    labels = [t.get_text() for t in fig.axes[0].get_yticklabels()]
    assert labels[0].endswith("ours: ours failed, no time")


def test_title_gpu(tmp_path):
    frame = read_batches(STATIC)
    assert gpu_label(STATIC, frame, None) == "nvidia_h200"  # the results/<gpu>/ folder
    assert gpu_label(STATIC, frame, "NVIDIA H100") == "nvidia_h100"
    assert gpu_label(tmp_path / "x.csv", frame, None) == "unknown GPU"
    assert gpu_label(tmp_path / "x.csv", frame.assign(gpu="nvidia_b200"), "h100") == "nvidia_b200"


@pytest.mark.parametrize("text, problem", [
    ("", "empty file"),
    (STATIC.read_text().splitlines()[0] + "\n", "no batches"),
    ((FIXTURES / "heuristics.csv").read_text(), "not a compare-batch CSV"),
    (STATIC.read_text().replace(",ours,", ",mine,"), "no `ours` rows"),
])
def test_bad_csvs_exit_2_naming_the_file(tmp_path, text, problem):
    bad = tmp_path / "bad.csv"
    bad.write_text(text)
    r = CliRunner().invoke(plot, ["--batches", str(bad), "-o", str(tmp_path / "out") + "/"])
    assert r.exit_code == 2, r.output
    assert str(bad) in r.output and problem in r.output
    assert not (tmp_path / "out" / "paged_batches.png").exists()


HOLDOUT = PAGED.parent / "batches" / "evaluate_holdout.csv"


def test_batch_regret_figure_of_the_committed_evaluation(tmp_path):
    r = CliRunner().invoke(plot, ["--batch-regret", str(HOLDOUT), "-o", str(tmp_path) + "/"])
    assert r.exit_code == 0, r.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["paged_batch_regret.png", "paged_batch_regret.svg"]
    svg = (tmp_path / "paged_batch_regret.svg").read_text()
    for text in ("nvidia_h200", "evaluate_holdout.csv", "skewed:24:16384:256", "selector", "auto", "sglang"):
        assert text in svg, text


def test_batch_regret_marks_a_rule_without_a_time(tmp_path):
    frame = pd.read_csv(HOLDOUT)
    frame.loc[0, "selector_regret"] = None
    path = tmp_path / "eval.csv"
    frame.to_csv(path, index=False)
    r = CliRunner().invoke(plot, ["--batch-regret", str(path), "-o", str(tmp_path / "out.png")])
    assert r.exit_code == 0, r.output
    assert "n/a" in (tmp_path / "out_batch_regret.svg").read_text()
    bad = tmp_path / "bad.csv"
    bad.write_text("dtype,head_dim\nbf16,128\n")
    r = CliRunner().invoke(plot, ["--batch-regret", str(bad), "-o", str(tmp_path) + "/"])
    assert r.exit_code == 2 and "not an `evaluate-batches --out-csv` file" in r.output and "bad.csv" in r.output
