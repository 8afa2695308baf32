"""Plots from fixture tables: the expected files, PNG sizes, SVG text, and the CLI."""
import struct
from pathlib import Path

from click.testing import CliRunner

from splitkv_tune.cli_tables import plot
from splitkv_tune.plot import plot_all

FIXTURES = Path(__file__).resolve().parent / "fixtures"
SUFFIXES_TRIALS = ["", "_speedup_s1", "_speedup_fa2", "_noise", "_bandwidth"]


def png_size(path: Path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", head[16:24])


def test_plots_from_trials(tmp_path):
    files = plot_all(FIXTURES / "trials.csv", str(tmp_path / "out") + "/")
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
