"""The C++ header's analytic fallback skips (S, block_kv) candidates that provably cannot be
chosen (export_cpp.py, detail::analytic, claims 1-4): the claims checked on the Python model,
and the compiled header checked against the exhaustive Python fallback, with the fixed-point
log2 and Sk buckets that it rests on."""
import dataclasses
import random
import shutil
import subprocess

import pytest

from splitkv_tune import analytic, gpus, lookup, selector, tunables
from splitkv_tune.export_cpp import export_cpp_header
from splitkv_tune.selector import HeuristicTable, select_shape
from splitkv_tune.table_schema import read_heuristics
from splitkv_tune.tunables import DTYPES, SPLIT_POLICIES, Shape, block_m_for, ceil_div, smem_bytes
from test_export import HEURISTICS, KINDS

MODEL = analytic.MODEL
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
def test_pruned_fallback_matches_the_exhaustive_python_one(tmp_path, gpu):
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
    want += [str(selector.log2_q16(x)) for x in xs]
    assert len(got) == len(want)
    mismatches = [(w, g) for w, g in zip(want, got) if w != g]
    assert not mismatches, mismatches[:5]


def _claim_shapes(n, seed):
    rng = random.Random(seed)
    profiles = [gpus.profile_for("h200"), gpus.profile_for("l40s"), analytic.GENERIC_PROFILE]
    for _ in range(n):
        hkv, group = rng.choice([1, 2, 8, 32]), rng.choice([1, 4, 8])
        shape = Shape("bf16", rng.choice(tunables.HEAD_DIMS), max(1, int(2 ** rng.uniform(0, 7))),
                      hkv * group, hkv, rng.choice([1, 1, rng.randint(2, 64), rng.randint(65, 1024)]),
                      max(1, int(2 ** rng.uniform(0, 21))))
        profile = dataclasses.replace(rng.choice(profiles), sms=rng.choice([1, 7, 66, 132, 1000]))
        yield shape, profile


def _blocks(shape, profile):
    bm = block_m_for(shape.packed_rows)
    return [b for i, b in enumerate(tunables.BLOCK_KV)
            if i == 0 or smem_bytes(shape.head_dim, b, bm) <= profile.smem_per_block]


def _bounds(shape, profile, bkv):
    """The header's bounds for block bkv: claim 2/3's of every S' > S, claim 4's of every
    S' in [2, S], per S (floats as in the header, without its 1e-9 margin)."""
    m, d, sk, sms = MODEL, shape.head_dim, shape.kv_len, profile.sms
    rows_all = shape.packed_rows
    bm = block_m_for(rows_all)
    rows, base = min(bm, rows_all), shape.batch * shape.kv_heads * ceil_div(rows_all, bm)
    q_bytes, out_split = rows * d * 2, rows * (d + 2) * 4
    bw = int(round(profile.copy_bw_gbps * 1000))
    slots = sms * max(1, min(m.ctas_per_sm, profile.smem_per_sm // smem_bytes(d, bkv, bm)))
    tile = bkv * d * 4
    cta_bw = tile * 1000 // (m.block_ns + tile * 1000 // m.cta_stream_mbps)
    most_bw = max(slots, min(sms * cta_bw, bw))

    def combine(s):
        return _combine(shape, s, profile)

    def after(s):  # claim 2/3: every S' > s
        a = s + 1
        walk = max(base * (sk * d * 4 + a * (q_bytes + out_split)) * 1000 / most_bw,
                   base * 4 * bm * d * sk / (sms * m.mma_flop_per_ns_per_sm))
        return m.launch_ns + combine(a) + base * a * (m.tile_ns - 1) / slots + walk

    def before(s):  # claim 4: every S' in [2, s]
        keys = min(ceil_div(ceil_div(sk, bkv), s) * bkv, sk)
        walk = max((keys * d * 4 + q_bytes + out_split) * 1000 // max(1, min(cta_bw, bw)),
                   4 * bm * keys * d // m.mma_flop_per_ns_per_sm)
        return m.launch_ns + combine(2) + m.tile_ns + walk
    return after, before


def _combine(shape, s, profile):
    m, bw = MODEL, int(round(profile.copy_bw_gbps * 1000))
    ws = tunables.workspace_bytes(shape, s)
    comb_bw = bw * m.l2_speedup_pct // 100 if 2 * ws <= profile.l2_bytes else bw
    moved = ws + shape.batch * shape.q_heads * shape.q_len * shape.head_dim * 2
    return m.launch_ns + m.mem_latency_ns + moved * 1000 // comb_bw + s * m.combine_split_ns


def test_the_pruning_claims_hold_on_the_python_model():
    for shape, profile in _claim_shapes(150, seed=8):
        for bkv in _blocks(shape, profile):
            nblk = ceil_div(shape.kv_len, bkv)
            top = min(tunables.MAX_SPLITS, nblk)
            cost = {s: analytic.analytic_cost_ns(shape, s, bkv, profile) for s in range(1, top + 1)}
            for s in range(3, top + 1):  # claim 1: a larger S walking as many blocks never costs less
                if ceil_div(nblk, s) == ceil_div(nblk, s - 1):
                    assert cost[s] >= cost[s - 1], (shape, profile, bkv, s)
            for s in range(2, top):  # the combine does not fall with S
                assert _combine(shape, s + 1, profile) >= _combine(shape, s, profile)
            after, before = _bounds(shape, profile, bkv)
            for s in range(1, top):
                assert after(s) <= min(cost[t] for t in range(s + 1, top + 1)), (shape, profile, bkv, s)
            for s in range(2, top + 1):
                assert before(s) <= min(cost[t] for t in range(2, s + 1)), (shape, profile, bkv, s)
