"""The exported C++ header carries the batch classes: g++ compiles a driver against a header of
two GPUs, one with a batch table and one without, and for thousands of random batches its
``select_live_knobs_for_device`` gives the knobs of Python's ``batch_select.select_live_knobs``
(the nearest class, else the model's knobs for a given CTAs per SM, else the "auto" rules on
the GPU's SM count), and the split counts of ``plan.live_splits`` at those knobs."""
from __future__ import annotations

import random
import shutil
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

from splitkv_tune import batch_select, batches, plan, tunables
from splitkv_tune import batch_table as bt
from splitkv_tune.cli_tables import export
from splitkv_tune.export_cpp import export_cpp_header, render_cpp_header
from splitkv_tune.selector import HeuristicTable
from splitkv_tune.table_schema import TableError, read_heuristics

FIXTURES = Path(__file__).resolve().parent / "fixtures"
HEURISTICS = FIXTURES / "heuristics.csv"
HEADS = [("bf16", 128, 32, 8, 1), ("bf16", 128, 8, 1, 1), ("fp16", 64, 32, 32, 4)]
SMS = {"nvidia_h200": 132, "nvidia_a100": 108}
LAUNCH_CTAS = 264  # the grid a load-aware class's launch is taken to have

# Reads "gpu ctas_per_sm dtype head_dim q_heads kv_heads q_len page_size batch len..." per line
# (ctas_per_sm 0: none); prints the knobs, the class index and each sequence's split count, or "false".
DRIVER = r"""
#include <iostream>
#include <string>
#include <vector>
#include "tables.h"

int main() {
  std::string gpu;
  int ctas_per_sm, dtype, head_dim, q_heads, kv_heads, q_len, page_size, batch;
  while (std::cin >> gpu >> ctas_per_sm >> dtype >> head_dim >> q_heads >> kv_heads >> q_len >> page_size >> batch) {
    std::vector<std::int64_t> lengths(batch);
    for (auto& n : lengths) std::cin >> n;
    splitkv_tune::LiveKnobs k{};
    if (!splitkv_tune::select_live_knobs_for_device(gpu.c_str(), 0, dtype, head_dim, q_heads, kv_heads, q_len,
                                                    page_size, lengths.data(), batch, &k, ctas_per_sm)) {
      std::cout << "false\n";
      continue;
    }
    std::cout << k.block_kv << ' ' << k.min_blocks_per_split << ' ' << k.max_splits << ' '
              << splitkv::kMerges[k.merge] << ' ' << splitkv_tune::kSplitPlans[k.split_plan] << ' ' << k.batch_class;
    // A load-aware class's launch chooses its knob; here for a grid of LAUNCH_CTAS CTAs.
    std::vector<int> lens(lengths.begin(), lengths.end());
    const int tiles = kv_heads * splitkv::rules::num_m_blocks(q_len * (q_heads / kv_heads));
    const int min_blocks = k.split_plan == splitkv_tune::kSplitPlanLoadAware
        ? splitkv::rules::live_plan_min_blocks(lens.data(), batch, tiles, LAUNCH_CTAS, k.block_kv,
                                               k.min_blocks_per_split, k.max_splits,
                                               splitkv::rules::live_plan_choices(k.min_blocks_per_split, k.block_kv))
        : k.min_blocks_per_split;
    for (auto n : lengths)
      std::cout << ' ' << splitkv::rules::live_splits(int(n), k.block_kv, min_blocks, k.max_splits);
    std::cout << '\n';
  }
}
"""


# Pairs of classes a query lies exactly between: the same lengths at pages 16 and 64 (a query at
# page 32 is one octave of page from each), and batches of 2 and 8 at page 128 (a query of 4 is
# one octave of B from each). They break ties by the classes' order.
TIE_LENGTHS = ["uniform:4:3000", "333x4", "uniform:4:50000"]
TIE_BATCHES = [(2, 8, 777), (2, 8, 12345)]


def _record(rng, head, lengths: str, page_size: int) -> dict:
    dtype, head_dim, q_heads, kv_heads, q_len = head
    s = batches.describe(batches.parse_lengths(lengths))
    rec = {"schema_version": 3, "gpu": "nvidia_h200", "dtype": dtype, "head_dim": head_dim,
           "q_heads": q_heads, "kv_heads": kv_heads, "q_len": q_len, "page_size": page_size,
           "batch": s["batch"], "len_max": s["max"], "len_mean": s["total"] // s["batch"], "lengths": lengths,
           "block_kv": rng.choice([64, 128]), "min_blocks_per_split": rng.choice([1, 2, 4, 8, 16]),
           "max_splits": rng.choice([8, 16, 32, 64]), "merge": rng.choice(tunables.MERGES),
           "split_plan": rng.choice(plan.SPLIT_PLANS),
           "median_us": 50.0, "p20_us": 49.0, "p80_us": 51.0, "noise_margin": 0.01, "n_trials": 40,
           "source": "batches.csv"}
    rec.update({c: None for c in bt.RUNNER_UP_COLUMNS})
    return {c: rec[c] for c in bt.BATCH_TABLE_COLUMNS}


def _classes(seed: int = 5) -> list[dict]:
    """A batch table of the first two head configurations: random classes and knobs, and the
    pairs of TIE_LENGTHS and TIE_BATCHES."""
    rng = random.Random(seed)
    records = {}
    for head in HEADS[:2]:
        texts = []
        for _ in range(25):
            batch = rng.choice([1, 2, 3, 4, 8, 16, 24, 64, 256])
            len_max = rng.choice([512, 1000, 4096, 8192, 65536, 131072, 262144])
            len_mean = max(1, min(len_max, len_max // rng.choice([1, 1, 2, 5, 16, 64])))
            texts.append((f"{len_max}" if batch == 1 else f"{len_max},{len_mean}x{batch - 1}",
                          rng.choice(plan.PAGE_SIZES)))
        texts += [(text, page) for text in TIE_LENGTHS for page in (16, 64)]
        texts += [(f"uniform:{b}:{n}", 128) for low, high, n in TIE_BATCHES for b in (low, high)]
        for text, page in texts:
            rec = _record(rng, head, text, page)
            records[tuple(rec[c] for c in bt.CLASS_COLUMNS)] = rec
    return list(records.values())


def _tie_cases():
    """Queries midway between the pairs of ``_classes``, on the H200."""
    for head in HEADS[:2]:
        for text in TIE_LENGTHS:
            yield "NVIDIA H200", 0, head, 32, list(batches.parse_lengths(text))
        for low, high, n in TIE_BATCHES:
            yield "NVIDIA H200", 0, head, 128, [n] * int((low * high) ** 0.5)


def _random_batches(n: int, seed: int = 7):
    rng = random.Random(seed)
    for _ in range(n):
        gpu = rng.choice(["NVIDIA H200", "NVIDIA_A100-SXM4-80GB"])
        head = rng.choice(HEADS)
        batch = rng.choice([1, 2, 3, 5, 8, 16, 31, 64, 200])
        lengths = [rng.choice([0, 1, 63, 64, 1000, rng.randrange(1, 9000), rng.randrange(1, 300_000)])
                   for _ in range(batch)]
        yield gpu, rng.choice([0, 0, 1, 2, 3]), head, rng.choice(plan.PAGE_SIZES), lengths


def _python(table, gpu, ctas_per_sm, head, page_size, lengths) -> str:
    dtype, head_dim, q_heads, kv_heads, q_len = head
    name = "nvidia_h200" if "H200" in gpu else "nvidia_a100"
    rows = [r for r in table if r["gpu"] == name]
    k = batch_select.select_live_knobs(rows, dtype=dtype, head_dim=head_dim, q_heads=q_heads, kv_heads=kv_heads,
                                       q_len=q_len, page_size=page_size, lengths=lengths, num_sms=SMS[name],
                                       ctas_per_sm=ctas_per_sm or None)
    index = -1 if k.row is None else sorted(rows, key=batch_select.class_order).index(k.row)
    min_blocks = k.min_blocks_per_split
    if k.split_plan == "load_aware" and lengths:
        min_blocks = plan.plan_min_blocks(lengths, kv_heads=kv_heads, packed_rows=q_len * (q_heads // kv_heads),
                                          ctas=LAUNCH_CTAS, block_kv=k.block_kv, min_blocks_per_split=min_blocks,
                                          max_splits=k.max_splits)
    splits = [plan.live_splits(n, k.block_kv, min_blocks, k.max_splits) for n in lengths]
    return " ".join(map(str, [k.block_kv, k.min_blocks_per_split, k.max_splits, k.merge, k.split_plan, index,
                              *splits]))


def _driver_input(cases) -> str:
    codes = tunables.dtype_codes()
    return "".join(f"{gpu.replace(' ', '_')} {ctas_per_sm} {codes[h[0]]} {' '.join(map(str, h[1:]))} {page} "
                   f"{len(lengths)} {' '.join(map(str, lengths))}\n" for gpu, ctas_per_sm, h, page, lengths in cases)


def _ties(table, cases) -> int:
    """How many cases have two or more nearest classes."""
    ties = 0
    for gpu, _, (dtype, head_dim, q_heads, kv_heads, q_len), page, lengths in cases:
        rows = [r for r in table if (r["dtype"], r["head_dim"], r["q_heads"], r["kv_heads"], r["q_len"])
                == (dtype, head_dim, q_heads, kv_heads, q_len)]
        if "H200" not in gpu or not rows or not lengths:
            continue
        s = batches.describe(lengths)
        d = [batch_select.class_distance_q(r, s["batch"], max(1, s["max"]), max(1, s["total"] // s["batch"]), page)
             for r in rows]
        ties += d.count(min(d)) > 1
    return ties


def _tables():
    df = read_heuristics(HEURISTICS)
    h200 = HeuristicTable(df, gpu=sorted(set(df["gpu"]))[0], source=str(HEURISTICS))
    a100 = HeuristicTable(df.assign(gpu="nvidia_a100"), gpu="nvidia_a100", source=str(HEURISTICS))
    return [h200, a100]


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
@pytest.mark.parametrize("max_distance", [None, 64.0], ids=["bounded", "nearest-at-any-distance"])
def test_exported_header_selects_the_batch_knobs_python_does(tmp_path, monkeypatch, max_distance):
    """Bounded as shipped (batch_select.MAX_CLASS_DISTANCE), and with the bound lifted so that the
    random batches reach many classes and the tie cases meet equal distances."""
    if max_distance is not None:
        monkeypatch.setattr(batch_select, "MAX_CLASS_DISTANCE", max_distance)
    table = _classes()
    tables = _tables()
    assert tables[0].gpu == "nvidia_h200"
    export_cpp_header(tables, tmp_path / "tables.h", batch_classes=table)
    (tmp_path / "driver.cpp").write_text(DRIVER)
    exe = tmp_path / "driver"
    subprocess.run(["g++", "-std=c++17", "-O1", "-Wall", "-Wextra", "-Werror", "-pedantic",
                    f"-DLAUNCH_CTAS={LAUNCH_CTAS}", str(tmp_path / "driver.cpp"), "-o", str(exe)], check=True,
                   capture_output=True)
    cases = list(_random_batches(3000)) + list(_tie_cases())
    text = _driver_input(cases)
    got = subprocess.run([str(exe)], input=text, capture_output=True, text=True, check=True).stdout.splitlines()
    want = [_python(table, *case) for case in cases]
    mismatches = [(c, g, w) for c, g, w in zip(cases, got, want) if g != w]
    assert len(got) == len(cases) and not mismatches, mismatches[:3]
    chosen = {int(line.split()[5]) for line in want}
    # The model's knobs: every batch far from the classes, given the CTAs per SM.
    model = [line for case, line in zip(cases, want) if case[1] and int(line.split()[5]) < 0]
    assert len(model) > 100 and len({tuple(line.split()[1:3]) for line in model}) > 5, "the model chose little"

    plans = [line.split()[4] for line in want if int(line.split()[5]) >= 0]
    assert -1 in chosen and len(chosen) > (20 if max_distance else 3), "the batches reach few classes"
    if max_distance:
        assert set(plans) == set(plan.SPLIT_PLANS), "the batches reach classes of one split plan only"
        assert _ties(table, cases) >= len(list(_tie_cases())), "the tie cases do not meet equal distances"
    # Bad arguments (head dim, heads, a negative length, batch * kv_heads over the grid's limit,
    # packed rows over kMaxKeys, CTAs per SM out of range, a batch too large for the model's
    # arithmetic) are refused as Python refuses them, and an unknown device is no match.
    far = ("NVIDIA H200", 2, ("bf16", 128, 8, 8, 2**16), 64, [2**31 - 256] * 16)
    bad = [("NVIDIA H200", 0, ("bf16", 100, 32, 8, 1), 64, [5]), ("NVIDIA H200", 0, ("bf16", 128, 32, 6, 1), 64, [5]),
           ("NVIDIA H200", 0, ("bf16", 128, 32, 8, 1), 64, [5, -1]),
           ("NVIDIA H200", 0, ("bf16", 128, 8, 8, 1), 64, [5] * 8192),
           ("NVIDIA H200", 0, ("bf16", 128, 2**16, 1, 2**15), 64, [5]),
           ("NVIDIA H200", 33, ("bf16", 128, 32, 8, 1), 64, [5]), far,
           ("NVIDIA B200", 0, ("bf16", 128, 32, 8, 1), 64, [5])]
    out = subprocess.run([str(exe)], input=_driver_input(bad), capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == ["false"] * len(bad)
    for case in bad[:-1]:
        if case[2][1] in tunables.HEAD_DIMS:
            with pytest.raises(ValueError):
                _python(table, *case)
    assert _python(table, *far[:1], 0, *far[2:]).split()[5] == "-1"  # without the model, the auto knobs


def test_a_batch_table_of_a_gpu_without_a_heuristics_table_is_refused():
    with pytest.raises(TableError, match="a batch table of nvidia_b200"):
        render_cpp_header(_tables(), batch_classes=[dict(r, gpu="nvidia_b200") for r in _classes()])


def test_a_batch_class_given_twice_is_refused():
    with pytest.raises(TableError, match="is given twice"):
        render_cpp_header(_tables(), batch_classes=_classes() + [dict(_classes()[0], gpu="NVIDIA_H200")])


def test_the_command_exports_a_batch_table(tmp_path):
    table = bt.write_batch_table(tmp_path / "batch_table.csv", _classes())
    out = tmp_path / "t.h"
    result = CliRunner().invoke(export, ["--format", "cpp-header", "--table", str(HEURISTICS), "--batch-table",
                                         str(table), "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert f"inline constexpr int kNumBatchClasses = {len(_classes())};" in out.read_text()
    result = CliRunner().invoke(export, ["--format", "csv", "--table", str(HEURISTICS), "--batch-table",
                                         str(table), "-o", str(tmp_path / "t.csv")])
    assert result.exit_code == 2 and "--batch-table" in result.output
