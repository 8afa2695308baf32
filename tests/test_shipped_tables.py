"""Each GPU's shipped heuristics.csv is the table of the sweeps its table_parts.txt names, and its
batch_table.csv the table of the batch sweeps its batch_table_parts.txt names."""
from pathlib import Path

import pytest
from click.testing import CliRunner

from splitkv_tune.cli_batch import batch_table as batch_table_cmd
from splitkv_tune.cli_sweep import table as table_cmd

RESULTS = Path(__file__).resolve().parent.parent / "results"
MANIFESTS = sorted(RESULTS.glob("*/table_parts.txt"))
BATCH_MANIFESTS = sorted(RESULTS.glob("*/batch_table_parts.txt"))


def table_parts(manifest: Path) -> list[Path]:
    lines = (line.strip() for line in manifest.read_text().splitlines())
    return [manifest.parent / line for line in lines if line and not line.startswith("#")]


def test_every_gpu_with_a_shipped_table_names_its_parts():
    shipped = sorted(p.parent for p in RESULTS.glob("*/heuristics.csv"))
    assert shipped and shipped == [m.parent for m in MANIFESTS]


@pytest.mark.parametrize("manifest", MANIFESTS, ids=lambda m: m.parent.name)
def test_the_shipped_table_is_the_table_of_its_parts(manifest, tmp_path):
    parts = table_parts(manifest)
    assert parts and all((part / "trials.csv").is_file() for part in parts), parts
    out = tmp_path / "heuristics.csv"
    result = CliRunner().invoke(table_cmd, [*map(str, parts), "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert out.read_text() == (manifest.parent / "heuristics.csv").read_text()


def test_every_gpu_with_a_shipped_batch_table_names_its_sweeps():
    shipped = sorted(p.parent for p in RESULTS.glob("*/batch_table.csv"))
    assert shipped and shipped == [m.parent for m in BATCH_MANIFESTS]


@pytest.mark.parametrize("manifest", BATCH_MANIFESTS, ids=lambda m: m.parent.name)
def test_the_shipped_batch_table_is_the_table_of_its_batch_sweeps(manifest, tmp_path):
    sweeps = table_parts(manifest)
    assert sweeps and all(s.is_file() for s in sweeps), sweeps
    out = tmp_path / "batch_table.csv"
    gpu = manifest.parent.name.removeprefix("nvidia_")
    result = CliRunner().invoke(batch_table_cmd, [*map(str, sweeps), "--gpu", gpu, "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert out.read_text() == (manifest.parent / "batch_table.csv").read_text()
