"""Per-call cost of the "auto" lookup: ``selector.auto_config`` (timeit, best of 7) and the
exported C++ header's ``select_config`` (``g++ -O2``): a loop with a new ``Sk`` every call
(an eager decode loop) on each path, and the median and worst per-call cost over seeded random
shapes of each path (hit: the table's rows; interpolated; analytic fallback), each shape timed
as the best of 5 runs of 100 calls.

    PYTHONPATH=$PWD python3 tools/bench_lookup.py [--table results/nvidia_h200/heuristics.csv]
"""
import argparse
import random
import shutil
import subprocess
import tempfile
import time
import timeit
from pathlib import Path

from splitkv_tune import selector
from splitkv_tune.export_cpp import export_cpp_header
from splitkv_tune.table_schema import read_heuristics
from splitkv_tune.tunables import DTYPES, Shape

CPP = r"""
#include "table.h"
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <vector>
namespace t = splitkv_tune::@NS@;
template <class F> double per_call_us(int n, F f) {
  auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < n; ++i) f(i);
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() / n;
}
long sink = 0;
void run(int dtype, int d, long long b, long long hq, long long hkv, long long sq, long long sk, int causal) {
  t::Config c; int kind;
  t::select_config(dtype, d, b, hq, hkv, sq, sk, causal != 0, &c, &kind);
  sink += c.num_splits + kind;
}
int main() {
  std::printf("C++ hit, one shape: %.3f us\n", per_call_us(200000, [&](int) { run(t::kBf16, 128, 4, 32, 8, 1, 4096, 0); }));
  std::printf("C++ interpolated, new Sk: %.3f us\n",
              per_call_us(200000, [&](int i) { run(t::kBf16, 128, 2, 32, 8, 1, 3000 + i, 0); }));
  std::printf("C++ fallback, new Sk: %.3f us\n",
              per_call_us(20000, [&](int i) { run(t::kFp16, 64, 2, 32, 8, 1, 3000 + i, 0); }));
  char word[32];  // "-" before a shape, its path after its shapes
  int dtype, d, causal;
  long long b, hq, hkv, sq, sk;
  std::vector<double> us;
  auto report = [&] {
    std::sort(us.begin(), us.end());
    if (!us.empty())
      std::printf("C++ %s, %zu shapes: median %.3f us, worst %.3f us\n", word, us.size(), us[us.size() / 2], us.back());
    us.clear();
  };
  while (std::scanf("%31s", word) == 1) {
    if (word[0] != '-') { report(); continue; }
    std::scanf("%d %d %lld %lld %lld %lld %lld %d", &dtype, &d, &b, &hq, &hkv, &sq, &sk, &causal);
    double best = 1e30;
    for (int r = 0; r < 5; ++r)
      best = std::min(best, per_call_us(100, [&](int) { run(dtype, d, b, hq, hkv, sq, sk, causal); }));
    us.push_back(best);
  }
  return sink == 0;
}
"""


def python_costs(device: str) -> None:
    for label, dtype, d in (("interpolated", "bf16", 128), ("fallback", "fp16", 64)):
        t0 = time.perf_counter()
        selector.auto_config(Shape(dtype, d, 2, 32, 8, 1, 3000), device, 132)
        first = time.perf_counter() - t0
        seen = Shape(dtype, d, 2, 32, 8, 1, 3000)
        hit = min(timeit.repeat(lambda: selector.auto_config(seen, device, 132),
                                number=20000, repeat=7)) / 20000
        shapes = [[Shape(dtype, d, 2, 32, 8, 1, 4000 + 200 * r + i) for i in range(200)]
                  for r in range(7)]
        batches = iter(shapes)
        miss = min(timeit.repeat(lambda: [selector.auto_config(s, device, 132)
                                          for s in next(batches)], number=1, repeat=7)) / 200
        print(f"Python {label}: first call of the class {first * 1e3:.1f} ms, "
              f"seen shape {hit * 1e6:.2f} us, new Sk {miss * 1e6:.2f} us")


def shapes_by_kind(table: selector.HeuristicTable, per_kind: int = 400, seed: int = 11):
    """Seeded random shapes of each path of the selector (decode and prefill, Sk up to 2^20),
    the hits being the table's own rows."""
    rng = random.Random(seed)
    out = {"hit": [Shape(*key_shape) for key_shape in _row_shapes(table)],
           "interpolated": [], "fallback": []}
    while min(len(out["interpolated"]), len(out["fallback"])) < per_kind:
        hkv, group = rng.choice([1, 2, 4, 8, 16, 32]), rng.choice([1, 2, 4, 8])
        q_len = rng.choice([1, 1, 1, rng.randint(2, 16), rng.randint(17, 512)])
        shape = Shape(rng.choice(["bf16", "fp16"]), rng.choice([64, 96, 128, 256]),
                      max(1, int(2 ** rng.uniform(0, 7))), hkv * group, hkv, q_len,
                      max(1, int(2 ** rng.uniform(0, 20))), causal=rng.random() < 0.2)
        try:
            kind = selector.select_shape(table, shape).kind
        except ValueError:
            continue
        if kind != "hit" and len(out[kind]) < per_kind:
            out[kind].append(shape)
    return out


def _row_shapes(table):
    for key, _ in table.rows:
        dtype, d, causal, b, hq, hkv, sq, sk = key
        yield DTYPES[dtype], d, b, hq, hkv, sq, sk, bool(causal)


def cpp_costs(table: Path) -> None:
    if shutil.which("g++") is None:
        print("C++: no g++")
        return
    df = read_heuristics(table)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        tab = selector.HeuristicTable(df, source=str(table))
        export_cpp_header(tab, tmp / "table.h")
        (tmp / "bench.cpp").write_text(CPP.replace("@NS@", "gpu_" + tab.gpu))
        subprocess.run(["g++", "-O2", "-std=c++17", str(tmp / "bench.cpp"), "-o",
                        str(tmp / "bench")], check=True)
        stdin = "".join(
            "".join(f"- {DTYPES.index(s.dtype)} {s.head_dim} {s.batch} {s.q_heads} {s.kv_heads} "
                    f"{s.q_len} {s.kv_len} {int(s.causal)}\n" for s in shapes) + f"{kind}\n"
            for kind, shapes in shapes_by_kind(tab).items())
        print(subprocess.run([str(tmp / "bench")], input=stdin, capture_output=True, text=True,
                             check=True).stdout, end="")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--table", type=Path,
                    default=Path(__file__).resolve().parents[1] / "results/nvidia_h200/heuristics.csv")
    ap.add_argument("--device", default="NVIDIA H200")
    args = ap.parse_args()
    python_costs(args.device)
    cpp_costs(args.table)


if __name__ == "__main__":
    main()
