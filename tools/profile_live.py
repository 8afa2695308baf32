"""Calls splitkv_attention on one paged batch again and again, for a profiler to catch one launch.

    ncu --clock-control none --cache-control none -k regex:split_kv --launch-skip 12 \
        --launch-count 1 --section SourceCounters -o REPORT \
        python3 tools/profile_live.py --lengths uniform:16:8192 --knobs auto

--knobs: ``auto``, ``load_aware``, ``M:S`` (min_blocks_per_split M, max_splits S), or
``equal:S[:BKV]`` (the equal-length call with num_splits S and block_kv BKV, default 64, on a
contiguous cache of the batch's first length: the kernel the live one is compared with). The
paged batch is compare-batch's (page 64, shuffled pages); its times are the profiler's
business, so this prints none.
"""
from __future__ import annotations

import argparse

import torch

from splitkv_tune import batches, paged_batch
from splitkv_tune.ops import splitkv_attention


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", required=True, help="as compare-batch takes them")
    parser.add_argument("--knobs", default="auto")
    parser.add_argument("--q-heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--calls", type=int, default=20)
    args = parser.parse_args(argv)
    lengths = batches.parse_lengths(args.lengths)
    if args.knobs.startswith("equal:"):  # no page pool: only the contiguous cache is read
        q = torch.randn(len(lengths), 1, args.q_heads, args.head_dim, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(len(lengths), lengths[0], args.kv_heads, args.head_dim, device="cuda", dtype=q.dtype)
        v = torch.randn_like(k)
        splits, block_kv = (int(x) for x in (args.knobs.split(":")[1:] + ["64"])[:2])

        def call():
            return splitkv_attention(q, k, v, num_splits=splits, block_kv=block_kv)
    else:
        batch = paged_batch.make_paged_batch(lengths, q_heads=args.q_heads, kv_heads=args.kv_heads,
                                             head_dim=args.head_dim, q_len=1, dtype="bf16",
                                             page_size=args.page_size, device="cuda")
        knobs = {}
        if args.knobs == "load_aware":
            knobs = {"split_plan": "load_aware"}
        elif args.knobs != "auto":
            min_blocks, max_splits = (int(x) for x in args.knobs.split(":"))
            knobs = {"min_blocks_per_split": min_blocks, "max_splits": max_splits}

        def call():
            return splitkv_attention(batch.q, batch.k_pool, batch.v_pool, cache_seqlens=batch.cache_seqlens,
                                     block_table=batch.block_table, **knobs)
    for _ in range(args.calls):
        call()
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
