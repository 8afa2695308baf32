"""Per-call cost of the "auto" lookup: ``selector.auto_config`` (timeit, best of 7) and the
exported C++ header's ``select_config`` (``g++ -O2``), on a hit, on a new ``Sk`` every call
(an eager decode loop) and on the analytic fallback.

    PYTHONPATH=$PWD python3 tools/bench_lookup.py [--table results/nvidia_h200/heuristics.csv]
"""
import argparse
import shutil
import subprocess
import tempfile
import time
import timeit
from pathlib import Path

from splitkv_tune import selector
from splitkv_tune.export_cpp import export_cpp_header
from splitkv_tune.table_schema import read_heuristics
from splitkv_tune.tunables import Shape

CPP = r"""
#include "table.h"
#include <chrono>
#include <cstdio>
namespace t = splitkv_tune::@NS@;
template <class F> double per_call_us(int n, F f) {
  auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < n; ++i) f(i);
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() / n;
}
int main() {
  long sink = 0;
  auto run = [&](int dtype, int d, long long b, long long sk) {
    t::Config c; int kind;
    t::select_config(dtype, d, b, 32, 8, 1, sk, false, &c, &kind);
    sink += c.num_splits + kind;
  };
  std::printf("C++ hit: %.3f us\n", per_call_us(200000, [&](int) { run(t::kBf16, 128, 4, 4096); }));
  std::printf("C++ interpolated, new Sk: %.3f us\n",
              per_call_us(200000, [&](int i) { run(t::kBf16, 128, 2, 3000 + i); }));
  std::printf("C++ fallback, new Sk: %.3f us\n",
              per_call_us(5000, [&](int i) { run(t::kFp16, 64, 2, 3000 + i); }));
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
        print(subprocess.run([str(tmp / "bench")], capture_output=True, text=True).stdout, end="")


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
