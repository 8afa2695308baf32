"""Per-call cost of the "auto" lookup: ``selector.auto_config`` (timeit, best of 7) and the
exported C++ header's ``select_config`` (``g++ -O2``): a loop with a new ``Sk`` every call
(an eager decode loop) on each path, and the median and worst per-call cost over seeded random
shapes of each path (hit: the table's rows; interpolated; analytic fallback), each shape timed
as the best of 5 runs of 100 calls. With ``--fallback-shapes N``, the same per-shape cost of
the analytic fallback over N more seeded shapes (Sk up to ``--max-kv-len``), with the worst
shapes listed.

    PYTHONPATH=$PWD python3 tools/bench_lookup.py [--table results/nvidia_h200/heuristics.csv]
        [--fallback-shapes 20000 [--max-kv-len 16777216] [--num-sms 0]]
"""
import argparse
import math
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
from splitkv_tune.tunables import DTYPES, HEAD_DIMS, Shape

CPP = r"""
#include "table.h"
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>
namespace t = splitkv_tune::@NS@;
template <class F> double per_call_us(int n, F f) {
  auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < n; ++i) f(i);
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() / n;
}
long sink = 0;
long long num_sms = 0;  // argv[1]: the SM count the fallback models (0: the profile's)
void run(int dtype, int d, long long b, long long hq, long long hkv, long long sq, long long sk, int causal) {
  t::Config c; int kind;
  t::select_config(dtype, d, b, hq, hkv, sq, sk, causal != 0, &c, &kind, num_sms);
  sink += c.num_splits + kind;
}
int main(int argc, char** argv) {
  if (argc > 1) num_sms = std::atoll(argv[1]);
  std::printf("C++ hit, one shape: %.3f us\n", per_call_us(200000, [&](int) { run(t::kBf16, 128, 4, 32, 8, 1, 4096, 0); }));
  std::printf("C++ interpolated, new Sk: %.3f us\n",
              per_call_us(200000, [&](int i) { run(t::kBf16, 128, 2, 32, 8, 1, 3000 + i, 0); }));
  std::printf("C++ fallback, new Sk: %.3f us\n",
              per_call_us(20000, [&](int i) { run(t::kFp16, 64, 2, 32, 8, 1, 3000 + i, 0); }));
  char word[32];  // "-" before a shape; after a path's shapes, its name and how many worst to list
  struct Timed { double us; int dtype, d, causal; long long b, hq, hkv, sq, sk; };
  std::vector<Timed> timed;
  auto report = [&](int list_worst) {
    std::sort(timed.begin(), timed.end(), [](const Timed& x, const Timed& y) { return x.us < y.us; });
    if (!timed.empty())
      std::printf("C++ %s, %zu shapes: median %.3f us, worst %.3f us\n", word, timed.size(),
                  timed[timed.size() / 2].us, timed.back().us);
    for (int i = 0; i < list_worst && i < static_cast<int>(timed.size()); ++i) {
      const Timed& w = timed[timed.size() - 1 - i];
      std::printf("  %.3f us: %s D %d B %lld Hq %lld Hkv %lld Sq %lld Sk %lld causal %d\n", w.us,
                  w.dtype == t::kFp16 ? "fp16" : "bf16", w.d, w.b, w.hq, w.hkv, w.sq, w.sk, w.causal);
    }
    timed.clear();
  };
  while (std::scanf("%31s", word) == 1) {
    if (word[0] != '-') {
      int list_worst = 0;
      std::scanf("%d", &list_worst);
      report(list_worst);
      continue;
    }
    Timed x;
    std::scanf("%d %d %lld %lld %lld %lld %lld %d", &x.dtype, &x.d, &x.b, &x.hq, &x.hkv, &x.sq, &x.sk, &x.causal);
    x.us = 1e30;
    for (int r = 0; r < 5; ++r)
      x.us = std::min(x.us, per_call_us(100, [&](int) { run(x.dtype, x.d, x.b, x.hq, x.hkv, x.sq, x.sk, x.causal); }));
    timed.push_back(x);
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


def fallback_shapes(table: selector.HeuristicTable, n: int, max_kv_len: int, seed: int = 12):
    """n seeded random shapes that reach the analytic fallback (a dtype/head_dim/causal/tile
    height with fewer table rows than the interpolation reads): decode and prefill, batches up
    to 256, Sk up to max_kv_len."""
    rng = random.Random(seed)
    out = []
    while len(out) < n:
        hkv, group = rng.choice([1, 2, 4, 8, 16, 32]), rng.choice([1, 2, 4, 8])
        shape = Shape(rng.choice(DTYPES), rng.choice(HEAD_DIMS), max(1, int(2 ** rng.uniform(0, 8))),
                      hkv * group, hkv, rng.choice([1, 1, rng.randint(2, 16), rng.randint(17, 2048)]),
                      max(1, int(2 ** rng.uniform(0, math.log2(max_kv_len)))), causal=rng.random() < 0.3)
        if not selector.class_rows(table, shape):
            out.append(shape)
    return out


def _stdin(shapes, path: str, list_worst: int = 0) -> str:
    return "".join(f"- {DTYPES.index(s.dtype)} {s.head_dim} {s.batch} {s.q_heads} {s.kv_heads} "
                   f"{s.q_len} {s.kv_len} {int(s.causal)}\n" for s in shapes) + f"{path} {list_worst}\n"


def cpp_costs(table: Path, fallback_n: int = 0, max_kv_len: int = 2**24, num_sms: int = 0) -> None:
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
        stdin = "".join(_stdin(shapes, kind) for kind, shapes in shapes_by_kind(tab).items())
        if fallback_n:
            stdin += _stdin(fallback_shapes(tab, fallback_n, max_kv_len), f"fallback(Sk<={max_kv_len})", 10)
        print(subprocess.run([str(tmp / "bench"), str(num_sms)], input=stdin, capture_output=True,
                             text=True, check=True).stdout, end="")


def _int_or_power(text: str) -> int:
    base, _, exponent = text.partition("**")
    return int(base) ** int(exponent) if exponent else int(base)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--table", type=Path,
                    default=Path(__file__).resolve().parents[1] / "results/nvidia_h200/heuristics.csv")
    ap.add_argument("--device", default="NVIDIA H200")
    ap.add_argument("--fallback-shapes", type=int, default=0, metavar="N",
                    help="also time the C++ fallback on N random shapes and list the worst")
    ap.add_argument("--max-kv-len", type=_int_or_power, default=2**24,
                    help="largest Sk of those shapes: an integer or a power such as 2**24")
    ap.add_argument("--num-sms", type=int, default=0,
                    help="SM count the C++ fallback models (0: the table's profile)")
    args = ap.parse_args()
    python_costs(args.device)
    cpp_costs(args.table, args.fallback_shapes, args.max_kv_len, args.num_sms)


if __name__ == "__main__":
    main()
