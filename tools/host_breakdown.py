"""Host µs per eager call, piece by piece: the default call (also as in a decode loop, one more
key every call), every tunable given, the binding's one-crossing entry (`_C.attention`), the
launch alone with every argument resolved (`_C.forward`, with and without programmatic
launch), a bare `torch.empty_like(q)`, a pybind call of one int (the crossing alone) and SDPA,
each timed as `eager_timing` times host cost (64 calls queued behind a GPU sleep; median, p20
and p80 of 200 samples). A sample is host time only while the GPU is still sleeping when its
64th call returns (`eager_timing.queued_host_time`); "asleep" is the share of samples where it
was (below 100%, that row's figures include time spent waiting for the GPU). At Sq = 4 the call
with every tunable given launches the combine kernel as well; the row with `merge="fused"` is
the same call in one launch. On a GPU host with the extension built:

    python3 tools/host_breakdown.py
"""
import itertools

import torch

from splitkv_tune import _rules, eager_timing, ops
from splitkv_tune.bench import Timing

GROWING_CALLS = 20 + 200 * 64  # per_call's calls: each sees a KV length it has not seen


def per_call(fn, calls=64, reps=200):
    """Median, p20 and p80 host µs per call over `reps` samples of `calls` queued calls, and the
    percentage of samples with the GPU still asleep after the last call."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    samples = [eager_timing.queued_host_time([fn] * calls) for _ in range(reps)]
    timing = Timing.from_samples([t for t, _ in samples], "host_wallclock")
    return timing.median_us, timing.p20_us, timing.p80_us, 100 * sum(asleep for _, asleep in samples) // reps


def main():
    ext = ops._extension()
    with torch.inference_mode():
        for (b, hkv, sq, sk) in [(1, 8, 1, 4096), (4, 8, 1, 16384), (1, 8, 4, 16384)]:
            q = torch.randn(b, sq, 32, 128, device="cuda", dtype=torch.bfloat16)
            # One more key every call, as in an eager decode loop: views of longer K and V.
            k_long = torch.randn(b, sk + GROWING_CALLS, hkv, 128, device="cuda", dtype=torch.bfloat16)
            v_long = torch.randn_like(k_long)
            k, v = k_long[:, :sk], v_long[:, :sk]
            growing = itertools.cycle([(k_long[:, :n], v_long[:, :n]) for n in range(sk + 1, sk + GROWING_CALLS + 1)])
            plan = ops._plan_for((_rules.DTYPE_CODES["bf16"], 128, b, 32, hkv, sq, sk, 0), False, None,
                                 16, 64, 128, "blocks", "auto", True)
            args = plan.launch_args(sk)
            rows = {
                "splitkv_attention auto": lambda: ops.splitkv_attention(q, k, v),
                "splitkv_attention auto, Sk + 1 a call": lambda: ops.splitkv_attention(q, *next(growing)),
                "splitkv_attention tuned": lambda: ops.splitkv_attention(q, k, v, num_splits=16, block_kv=64,
                                                                        reduce_threads=128, split_policy="blocks"),
                "_C.attention tuned": lambda: ext.attention(q, k, v, False, None, 16, 64, 128, "blocks", "auto",
                                                            None, False, True),
                "_C.attention tuned, fused merge": lambda: ext.attention(q, k, v, False, None, 16, 64, 128, "blocks",
                                                                         "fused", None, False, True),
                "_C.forward resolved": lambda: ext.forward(q, k, v, None, False, plan.scale, *args[:4], False,
                                                           args[4], True, None, None, 1, 1),
                "_C.forward resolved no PDL": lambda: ext.forward(q, k, v, None, False, plan.scale, *args[:4], False,
                                                                  args[4], False, None, None, 1, 1),
                "torch.empty_like(q)": lambda: torch.empty_like(q),
                "a pybind call of one int": lambda: _rules.num_m_blocks(16),
                "sdpa (default backend)": lambda: torch.nn.functional.scaled_dot_product_attention(
                    q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), enable_gqa=True),
            }
            print(f"B={b} Hkv={hkv} Sq={sq} Sk={sk} launch args {args}")
            for name, fn in rows.items():
                med, p20, p80, asleep = per_call(fn)
                print(f"  {name:32s} median {med:6.2f}  p20 {p20:6.2f}  p80 {p80:6.2f} us  asleep {asleep:3d}%")


if __name__ == "__main__":
    main()
