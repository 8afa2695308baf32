"""Plots from fixture tables: the expected files, PNG sizes, SVG text, and the CLI."""
import struct
from pathlib import Path

from click.testing import CliRunner

from splitkv_tune.cli_tables import evaluate, plot
from splitkv_tune.plot import plot_all

FIXTURES = Path(__file__).resolve().parent / "fixtures"
SUFFIXES_TRIALS = ["", "_speedup_s1", "_speedup_fa2", "_noise", "_bandwidth"]


def png_size(path: Path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", head[16:24])


def test_plots_from_trials(tmp_path):
    files = plot_all(FIXTURES / "trials.csv", str(tmp_path / "out") + "/", "h200")
    expected = {f"best_splits{s}.{ext}" for s in SUFFIXES_TRIALS for ext in ("png", "svg")}
    assert {p.name for p in files} == expected
    for p in files:
        if p.suffix == ".png":
            w, h = png_size(p)
            assert w >= 600 and h >= 400, (p.name, w, h)
        else:
            text = p.read_text()
            assert "<svg" in text and "KV length Sk" in text
    # Six panels (dtype x head_dim x {decode, causal prefill}) in a 3-wide grid.
    w, h = png_size(tmp_path / "out" / "best_splits.png")
    assert 1300 <= w <= 1800 and 700 <= h <= 1000


def test_plots_from_heuristics_cli(tmp_path):
    out = tmp_path / "h200.png"
    r = CliRunner().invoke(plot, [str(FIXTURES / "heuristics.csv"), "-o", str(out)])
    assert r.exit_code == 0, r.output
    names = {p.name for p in tmp_path.iterdir()}
    # A heuristics table has no per-config times: no speed-up heatmaps.
    assert names == {f"h200{s}.{e}" for s in ("", "_noise", "_bandwidth") for e in ("png", "svg")}
    assert png_size(out)[0] >= 600


def test_titles_name_gpu_and_run_and_panels_share_one_colour_range(tmp_path):
    import matplotlib.collections

    from splitkv_tune.plot import heatmap, run_label
    from splitkv_tune.table_schema import read_heuristics
    heur = read_heuristics(FIXTURES / "heuristics.csv")
    assert run_label(heur) == "GPU nvidia_h200, run fixture-1"
    fig = heatmap(heur.assign(x=heur["median_us"]), "x", "t", "µs", lambda v: f"{v:.0f}")
    meshes = [c for ax in fig.axes for c in ax.collections
              if isinstance(c, matplotlib.collections.QuadMesh)]
    assert len(meshes) > 1
    assert {(m.norm.vmin, m.norm.vmax) for m in meshes} == {
        (heur["median_us"].min(), heur["median_us"].max())}
    files = plot_all(FIXTURES / "heuristics.csv", tmp_path / "h")
    svg = (tmp_path / "h_noise.svg").read_text()
    assert "nvidia_h200" in svg and "fixture-1" in svg and "(p80 − p20) / median" in svg
    assert len(files) == 6


def test_missing_cell_is_marked(tmp_path):
    from splitkv_tune.plot import heatmap
    from splitkv_tune.table_schema import read_heuristics
    heur = read_heuristics(FIXTURES / "heuristics.csv")
    part = heur[(heur["dtype"] == "bf16") & (heur["head_dim"] == 128) & (heur["q_len"] == 1)]
    fig = heatmap(part.iloc[1:], "num_splits", "t", "S", lambda v: f"{v:.0f}", log_color=True)
    texts = [t.get_text() for ax in fig.axes for t in ax.texts]
    assert texts.count("n/a") >= 1


def test_regret_plot_from_an_evaluation_csv(tmp_path):
    ev = tmp_path / "ev.csv"
    r = CliRunner().invoke(evaluate, ["--from-trials", str(FIXTURES / "trials.csv"), "--gpu",
                                      "h200", "--out-csv", str(ev)])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(plot, ["--regret", str(ev), "-o", str(tmp_path / "p")])
    assert r.exit_code == 0, r.output
    svg = (tmp_path / "p_regret.svg").read_text()
    for rule in ("selector", "fa2", "fa3", "sglang"):
        assert rule in svg
    assert png_size(tmp_path / "p_regret.png")[0] >= 600
    r = CliRunner().invoke(plot, ["--regret", str(FIXTURES / "heuristics.csv")])
    assert r.exit_code == 2 and "not an evaluation CSV" in r.output
    r = CliRunner().invoke(plot, [])
    assert r.exit_code == 2 and "--regret" in r.output
