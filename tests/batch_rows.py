"""compare-batch rows and a batch table built from them, as the batch-table and batch-select
tests use them."""
import csv

from click.testing import CliRunner

from splitkv_tune import batch_table as bt
from splitkv_tune import compare_batch
from splitkv_tune.cli import main

SKEWED = dict(label="skewed:16:65536:1024", batch=16, min_len=1024, max_len=65536, mean_len=5056.0,
              total_len=80896)
UNIFORM = dict(label="uniform:16:8192", batch=16, min_len=8192, max_len=8192, mean_len=8192.0, total_len=131072)
HEADS = dict(page_size=64, q_heads=32, kv_heads=8, head_dim=128, q_len=1, dtype="bf16")


def compare_row(impl, median_us, knobs=(64, 16, 33, "fused"), batch=SKEWED, spread=0.002, **change):
    """One compare-batch row, every column of ``compare_batch.COLUMNS`` as the CSV holds it."""
    row = dict.fromkeys(compare_batch.COLUMNS, "")
    row.update(batch, **HEADS, impl=impl, status="ok", median_us=median_us, p20_us=median_us * (1 - spread),
               p80_us=median_us * (1 + spread), n=128, method="cuda_graph", input_sets=1)
    row.update(zip(compare_batch.KNOB_COLUMNS, (*knobs, "fixed") if len(knobs) == 4 else knobs))
    row.update(change)
    return row


def write_csv(path, rows, columns=compare_batch.COLUMNS):
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, columns, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    return path


def as_read(rows, source="run.csv"):
    """Rows as ``read_compare_batch_csv`` gives them: strings, with the file's name."""
    return [{**{k: "" if v is None else str(v) for k, v in r.items()}, "source": source} for r in rows]


SKEWED_RUN = [
    compare_row("ours", 96.4),
    compare_row("ours_one_split", 104.5, (64, 1, 16, "fused")),
    compare_row("ours_m4_s64", 93.4, (64, 4, 64, "fused")),
    compare_row("ours_kv128_m4_s64", 125.6, (128, 4, 64, "fused")),
    compare_row("ours_wide4", 80.0),  # the layout at ours' knobs: never a candidate
    compare_row("ours_contiguous", 89.5),
    compare_row("flashinfer_decode_tc", 87.9, ("", "", "", "")),
    compare_row("copy_floor", 79.2, ("", "", "", "")),
]
UNIFORM_RUN = [compare_row("ours", 140.0, batch=UNIFORM),
               compare_row("ours_m2_s8", 120.0, (64, 2, 8, "fused"), batch=UNIFORM)]


def write_table(tmp_path):
    """The table of SKEWED_RUN and UNIFORM_RUN on the H200, written to tmp_path."""
    table = bt.build_batch_table(as_read(SKEWED_RUN + UNIFORM_RUN), "h200")
    return bt.write_batch_table(tmp_path / "batch_table.csv", table)


def rewrite(path, **change):
    """The table at ``path`` with the cells of its first row changed."""
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    rows[0].update({k: str(v) for k, v in change.items()})
    return write_csv(path, rows, list(rows[0]))


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


PAGED = ["select", "--paged", "--gpu", "h200", "--q-heads", "32", "--kv-heads", "8"]
