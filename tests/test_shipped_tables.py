"""Each GPU's shipped heuristics.csv is the table of the sweeps its table_parts.txt names, and its
batch_table.csv the table of the batch sweeps its batch_table_parts.txt names."""
from pathlib import Path

import pytest
from click.testing import CliRunner

from splitkv_tune.cli_batch import batch_table as batch_table_cmd
from splitkv_tune.cli_sweep import table as table_cmd

RESULTS = Path(__file__).resolve().parent.parent / "results"
# kind: (its manifest, the table it names the parts of)
KINDS = {"table": ("table_parts.txt", "heuristics.csv"),
         "batch_table": ("batch_table_parts.txt", "batch_table.csv")}
MANIFESTS = [(kind, m) for kind, (name, _) in KINDS.items() for m in sorted(RESULTS.glob(f"*/{name}"))]


def table_parts(manifest: Path) -> list[Path]:
    lines = (line.strip() for line in manifest.read_text().splitlines())
    return [manifest.parent / line for line in lines if line and not line.startswith("#")]


@pytest.mark.parametrize("kind", KINDS)
def test_every_gpu_with_a_shipped_table_names_its_parts(kind):
    _, table = KINDS[kind]
    shipped = sorted(p.parent for p in RESULTS.glob(f"*/{table}"))
    assert shipped and shipped == sorted(m.parent for k, m in MANIFESTS if k == kind)


@pytest.mark.parametrize("kind, manifest", MANIFESTS, ids=lambda x: x if isinstance(x, str) else x.parent.name)
def test_the_shipped_table_is_the_table_of_its_parts(kind, manifest, tmp_path):
    parts = table_parts(manifest)
    if kind == "table":  # sweep folders
        assert parts and all((part / "trials.csv").is_file() for part in parts), parts
        command, options = table_cmd, []
    else:  # batch sweeps' CSVs, tabled for the manifest's GPU
        assert parts and all(part.is_file() for part in parts), parts
        command, options = batch_table_cmd, ["--gpu", manifest.parent.name.removeprefix("nvidia_")]
    out = tmp_path / KINDS[kind][1]
    result = CliRunner().invoke(command, [*map(str, parts), *options, "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert out.read_text() == (manifest.parent / KINDS[kind][1]).read_text()
