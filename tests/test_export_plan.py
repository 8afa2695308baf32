"""The exported C++ header carries the paged plan: g++ compiles a driver against it, and its
load-aware knob, split counts and key ranges for thousands of random variable-length batches
are the ones Python's plan (``splitkv_tune.plan``, the rules the kernel calls) gives, each
sequence's splits covering its live keys once."""
from __future__ import annotations

import random
import shutil
import subprocess
from pathlib import Path

import pytest

from splitkv_tune import _rules, plan, tunables
from splitkv_tune.export_cpp import export_cpp_header
from splitkv_tune.selector import HeuristicTable
from splitkv_tune.table_schema import read_heuristics

HEURISTICS = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "heuristics.csv"
BLOCKS = tunables.policy_codes()["blocks"]

# Reads "block_kv min_blocks max_splits kv_heads ctas choices batch len..." per line; prints the
# plan's knob, then per sequence its split count and the [start, end) of each split.
DRIVER = r"""
#include <iostream>
#include <vector>
#include "tables.h"

int main() {
  int block_kv, knob, max_splits, kv_heads, ctas, choices, batch;
  while (std::cin >> block_kv >> knob >> max_splits >> kv_heads >> ctas >> choices >> batch) {
    std::vector<int> lengths(batch);
    for (int& len : lengths) std::cin >> len;
    const int min_blocks = splitkv::rules::live_plan_min_blocks(lengths.data(), batch, kv_heads, ctas, block_kv,
                                                                knob, max_splits, choices);
    std::cout << min_blocks << " # ";
    for (int b = 0; b < batch; ++b) {
      const int len = lengths[b];
      const int splits = splitkv::rules::live_splits(len, block_kv, min_blocks, max_splits);
      std::cout << splits;
      for (int s = 0; s < splits; ++s) {
        const auto r = splitkv::rules::split_range(splitkv::SplitPolicy::kBlocks, s, splits, len, len, block_kv);
        std::cout << ' ' << r.start << ':' << r.end;
      }
      std::cout << (b + 1 < batch ? " | " : "\n");
    }
  }
}
"""


def _random_batches(n: int, seed: int = 3):
    rng = random.Random(seed)
    for _ in range(n):
        block_kv = rng.choice(tunables.BLOCK_KV)
        knob = rng.choice([1, 2, 3, 4, 8, 16, 64])
        load_aware = rng.random() < 0.5
        knobs = (block_kv, knob, rng.randint(1, tunables.MAX_SPLITS), rng.choice([1, 2, 8, 32]),
                 rng.randint(1, 1056), _rules.live_plan_choices(knob, block_kv) if load_aware else 1)
        lengths = [rng.choice([0, 1, block_kv - 1, block_kv, block_kv + 1, rng.randrange(1, 5000),
                               rng.randrange(1, 600_000)]) for _ in range(rng.randint(1, 12))]
        yield knobs, lengths


def _python_plan(knobs, lengths) -> str:
    block_kv, knob, max_splits, kv_heads, ctas, choices = knobs
    min_blocks = knob if choices == 1 else plan.plan_min_blocks(
        lengths, kv_heads=kv_heads, packed_rows=1, ctas=ctas, block_kv=block_kv, min_blocks_per_split=knob,
        max_splits=max_splits)
    live = plan.LiveBatch(tuple(lengths), None, max(lengths))
    parts = []
    for n, splits in zip(lengths, plan.split_counts(live, block_kv, min_blocks, max_splits)):
        ranges = [_rules.split_range(BLOCKS, s, splits, n, n, block_kv) for s in range(splits)]
        covered = [k for start, end in ranges for k in range(start, max(start, end))] if n < 5000 else None
        assert covered is None or covered == list(range(n)), "the splits must cover the live keys once"
        parts.append(" ".join([str(splits)] + [f"{start}:{end}" for start, end in ranges]))
    return f"{min_blocks} # " + " | ".join(parts)


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
def test_exported_header_plans_like_the_kernel(tmp_path):
    export_cpp_header([HeuristicTable(read_heuristics(HEURISTICS))], tmp_path / "tables.h")
    (tmp_path / "driver.cpp").write_text(DRIVER)
    exe = tmp_path / "driver"
    subprocess.run(["g++", "-std=c++17", "-O1", "-Wall", "-Wextra", "-Werror", "-pedantic",
                    str(tmp_path / "driver.cpp"), "-o", str(exe)], check=True, capture_output=True)
    batches = list(_random_batches(3000))
    text = "".join(f"{' '.join(map(str, knobs))} {len(lengths)} {' '.join(map(str, lengths))}\n"
                   for knobs, lengths in batches)
    got = subprocess.run([str(exe)], input=text, capture_output=True, text=True, check=True).stdout.splitlines()
    want = [_python_plan(knobs, lengths) for knobs, lengths in batches]
    mismatches = [(b, g, w) for b, g, w in zip(batches, got, want) if g != w]
    assert len(got) == len(batches) and not mismatches, mismatches[:3]
    counts = {int(part.split()[0]) for line in want for part in line.split(" # ")[1].split(" | ")}
    assert {1, tunables.MAX_SPLITS} <= counts and len(counts) > 50, "the batches reach few split counts"
    chose = sum(int(line.split(" # ")[0]) != knobs[1] for line, (knobs, _) in zip(want, batches))
    assert chose > 100, "the load-aware plan rarely chose another knob"
