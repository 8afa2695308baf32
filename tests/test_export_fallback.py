"""The C++ header's analytic fallback (detail::analytic) against the Python one on seeded shapes
that reach it, with the fixed-point log2 and Sk buckets that the header's lookup rests on."""
import random
import shutil
import subprocess

import pytest

from splitkv_tune import interpolation, lookup, selector, tunables
from splitkv_tune.export_cpp import export_cpp_header
from splitkv_tune.selector import HeuristicTable, select_shape
from splitkv_tune.table_schema import read_heuristics
from splitkv_tune.tunables import DTYPES, SPLIT_POLICIES, Shape
from test_export import HEURISTICS, KINDS

DRIVER = r"""
#include "table.h"
#include <cstdio>
namespace t = splitkv_tune::@NS@;
int main() {
  char what[8];
  while (std::scanf("%7s", what) == 1) {
    long long sk;
    if (what[0] == 'b') {  // bucket start
      std::scanf("%lld", &sk);
      std::printf("%lld\n", static_cast<long long>(t::detail::sk_bucket_start(sk)));
      continue;
    }
    if (what[0] == 'l') {  // log2_q16
      unsigned long long x;
      std::scanf("%llu", &x);
      std::printf("%lld\n", static_cast<long long>(t::detail::log2_q16(x)));
      continue;
    }
    int dtype, d, causal; long long b, hq, hkv, sq, sms;
    std::scanf("%d %d %lld %lld %lld %lld %lld %d %lld", &dtype, &d, &b, &hq, &hkv, &sq, &sk, &causal, &sms);
    t::Config c{0, 0, 0, 0}; int kind = -1;
    if (t::select_config(dtype, d, b, hq, hkv, sq, sk, causal != 0, &c, &kind, sms))
      std::printf("%d %d %d %d %d\n", c.num_splits, c.block_kv, c.reduce_threads, c.split_policy, kind);
    else std::printf("invalid\n");
  }
}
"""


def _fallback_shapes(table, n, seed):
    """Seeded shapes that reach the fallback: decode and prefill, Sk up to 2^24, large batches."""
    rng = random.Random(seed)
    while n:
        hkv, group = rng.choice([1, 2, 4, 8, 16, 32]), rng.choice([1, 2, 4, 8])
        shape = Shape(rng.choice(DTYPES), rng.choice(tunables.HEAD_DIMS), max(1, int(2 ** rng.uniform(0, 8))),
                      hkv * group, hkv, rng.choice([1, 1, rng.randint(2, 16), rng.randint(17, 2048)]),
                      max(1, int(2 ** rng.uniform(0, 24))), causal=rng.random() < 0.3)
        sms = rng.choice([None, None, 1, 7, 60, 108, 142, 1000])
        try:
            if select_shape(table, shape, sms=sms).kind != "fallback":
                continue
        except ValueError:
            continue
        n -= 1
        yield shape, sms


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
@pytest.mark.parametrize("gpu", ["nvidia_h200", "my_gpu_9000"])
def test_header_fallback_matches_the_python_one(tmp_path, gpu):
    table = HeuristicTable(read_heuristics(HEURISTICS).assign(gpu=gpu))
    header = export_cpp_header(table, tmp_path / "table.h")
    (tmp_path / "driver.cpp").write_text(DRIVER.replace("@NS@", "gpu_" + gpu))
    exe = tmp_path / "driver"
    subprocess.run(["g++", "-std=c++17", "-O2", "-Wall", "-Wextra", "-Werror", "-pedantic",
                    f"-I{header.parent}", str(tmp_path / "driver.cpp"), "-o", str(exe)],
                   check=True, capture_output=True)
    cases = list(_fallback_shapes(table, 3000, seed=21))
    starts, _ = lookup.bucket_starts()
    rng = random.Random(4)
    sks = sorted({max(1, v) for s in starts for v in (s - 1, s, s + 1)}
                 | {rng.randint(1, 2**31 - 1) for _ in range(2000)})
    stdin = "".join(f"s {DTYPES.index(s.dtype)} {s.head_dim} {s.batch} {s.q_heads} {s.kv_heads} "
                    f"{s.q_len} {s.kv_len} {int(s.causal)} {sms or 0}\n" for s, sms in cases)
    stdin += "".join(f"b {sk}\n" for sk in sks if sk <= 2**31 - 1)
    # log2_q16 at each bit boundary (its highest set bit is found by halving) and in between
    xs = sorted({max(1, (1 << n) + e) for n in range(63) for e in (-1, 0, 1)}
                | {max(1, rng.randint(1, 2**63 - 1) >> rng.randint(0, 62)) for _ in range(2000)})
    stdin += "".join(f"l {x}\n" for x in xs)
    got = subprocess.run([str(exe)], input=stdin, capture_output=True, text=True,
                         check=True).stdout.splitlines()
    want = []
    for shape, sms in cases:
        c = select_shape(table, shape, sms=sms).config
        want.append(f"{c.num_splits} {c.block_kv} {c.reduce_threads} "
                    f"{SPLIT_POLICIES.index(c.split_policy)} {KINDS['fallback']}")
    want += [str(selector.sk_bucket_start(sk)) for sk in sks if sk <= 2**31 - 1]
    want += [str(interpolation.log2_q16(x)) for x in xs]
    assert len(got) == len(want)
    mismatches = [(w, g) for w, g in zip(want, got) if w != g]
    assert not mismatches, mismatches[:5]
