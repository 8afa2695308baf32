"""The analytic cost model behind the selector's fallback (a shape class with fewer table rows
than the selector interpolates from).

:func:`analytic_cost_ns` and :func:`analytic_config` are the rule (plain integers, the
exported C++ header repeats them); :func:`analytic_configs` evaluates the same model for
many ``kv_len`` at once with numpy, for the run-time lookup's precomputed classes (a test
checks the two agree).
"""
from __future__ import annotations

import dataclasses

from splitkv_tune import tunables
from splitkv_tune.gpus import GpuProfile, profile_for
from splitkv_tune.tunables import Config, Shape, block_m_for, ceil_div, smem_bytes

# Profile the analytic fallback uses for a GPU without one in configs/gpus.yaml: small
# shared memory so that whatever it picks runs on any sm80+ part.
GENERIC_PROFILE = GpuProfile("generic", sms=108, copy_bw_gbps=1500.0, l2_bytes=40 * 2**20,
                             smem_per_sm=101376)



@dataclasses.dataclass(frozen=True)
class CostModel:
    """Constants of the analytic model (integer nanoseconds; see :func:`analytic_cost_ns`)."""

    launch_ns: int = 2000              # one kernel launch, ramp-up and tail
    tile_ns: int = 600                 # per CTA: Q tile load, pipeline fill, epilogue
    mem_latency_ns: int = 700          # DRAM latency of the combine's first loads
    cta_stream_mbps: int = 42500       # bytes/µs one CTA streams (H200, 2026-11-29 sweeps) ...
    fitted_copy_bw_mbps: int = 4260000  # ... at the H200's copy bandwidth (cta_stream_rate)
    mma_flop_per_ns_per_sm: int = 2000  # achieved mma.sync throughput of one SM
    l2_speedup_pct: int = 250          # combine reading partials still in L2
    combine_split_ns: int = 15         # serial merge cost per split in the combine kernel
    block_ns: int = 230                # per KV block a CTA walks: barriers, softmax, MMAs
    tie_pct: int = 1                   # modelled gains below this are not worth more splits


MODEL = CostModel()


def residency(head_dim: int, block_kv: int, block_m: int, profile: GpuProfile) -> int:
    """CTAs of one split-kernel config an SM holds: the fewer of what its registers and its
    shared memory allow, at least 1 (the registers as sm_90 builds use them, on every profile)."""
    return max(1, min(tunables.register_residency(head_dim, block_kv, block_m),
                      profile.smem_per_sm // smem_bytes(head_dim, block_kv, block_m)))


def cta_stream_rate(profile: GpuProfile, model: CostModel = MODEL) -> int:
    """Bytes/µs one CTA streams on ``profile``'s GPU: ``model.cta_stream_mbps``, read off the
    H200, scaled by the GPU's copy bandwidth over the H200's. A CTA's rate is bound by the
    latency of its loads in flight, which the DRAM's speed sets; held at the H200's rate on an
    H100 (3.0 against 4.26 TB/s) the model rated splits too dear: its fallback regret on the
    H100's 438 swept shapes is 6.76% unscaled, 4.31% scaled (docs/PERFORMANCE.md).

    >>> cta_stream_rate(profile_for("h200")), cta_stream_rate(profile_for("h100"))
    (42500, 29929)
    """
    return max(1, model.cta_stream_mbps * int(round(profile.copy_bw_gbps * 1000)) // model.fitted_copy_bw_mbps)


def analytic_cost_ns(shape: Shape, num_splits: int, block_kv: int, profile: GpuProfile,
                     model: CostModel = MODEL) -> int:
    """Modelled time of one launch (split kernel + combine) in integer nanoseconds.

    Split kernel: ``C = B*Hkv*m_blocks*S`` CTAs run in waves of ``slots = SMs * residency``
    (:func:`residency`: the fewer CTAs of the kernel's registers, rules.h, and of its shared
    memory); full waves and the tail wave are timed apart (wave quantisation). A CTA walks
    ``ceil(blocks/S)`` KV blocks; alone on an SM it streams one block in ``block_ns`` plus the
    block's bytes at ``cta_stream_mbps``. (The constants were read off the H200 sweeps of the
    loop with CTA barriers, ~32 GB/s per CTA at block_kv 64; refitting them to the current
    loop's 48-59 GB/s made the selection worse on its own sweep, docs/NOTES.md, so they act as
    an effective rate.) CTAs on one SM share that rate, all CTAs share the copy bandwidth, and
    a CTA takes the longer of its streaming and its MMAs, plus a fixed per-CTA cost. Combine
    (``S > 1``): a second launch, one memory latency, the workspace read and the output written
    at copy bandwidth (x2.5 when the workspace fits in half the L2, where the split kernel just
    wrote it), and a serial per-split merge term.

    >>> p = profile_for("h200")
    >>> s = Shape("bf16", 128, 1, 32, 8, 1, 16384)
    >>> analytic_cost_ns(s, 1, 64, p) > analytic_cost_ns(s, 16, 64, p)
    True
    """
    d, rows_all = shape.head_dim, shape.packed_rows
    bm = block_m_for(rows_all)
    ctas = shape.batch * shape.kv_heads * ceil_div(rows_all, bm) * num_splits
    keys = min(ceil_div(ceil_div(shape.kv_len, block_kv), num_splits) * block_kv, shape.kv_len)
    rows = min(bm, rows_all)
    out = rows * (d + 2) * 4 if num_splits > 1 else rows * d * 2
    cta_bytes = keys * d * 4 + rows * d * 2 + out
    cta_flops = 4 * bm * keys * d
    sms, bw = profile.sms, int(round(profile.copy_bw_gbps * 1000))  # MB/s = bytes per us
    slots = sms * residency(d, block_kv, bm, profile)
    # One CTA streams a KV block in a fixed per-block time plus its bytes at the CTA's peak rate.
    tile_bytes = block_kv * d * 4
    cta_bw = tile_bytes * 1000 // (model.block_ns + tile_bytes * 1000 // cta_stream_rate(profile, model))

    def wave(active: int) -> int:
        # CTAs sharing an SM share its issue rate; all share the DRAM bandwidth.
        rate = min(cta_bw // ceil_div(active, sms), bw // active)
        mem = cta_bytes * 1000 // max(1, rate)
        comp = cta_flops * ceil_div(active, sms) // model.mma_flop_per_ns_per_sm
        return model.tile_ns + max(mem, comp)

    full, tail = divmod(ctas, slots)
    t = model.launch_ns + full * wave(slots) + (wave(tail) if tail else 0)
    if num_splits > 1:
        ws = tunables.workspace_bytes(shape, num_splits)
        comb_bw = bw * model.l2_speedup_pct // 100 if 2 * ws <= profile.l2_bytes else bw
        moved = ws + shape.batch * shape.q_heads * shape.q_len * d * 2
        t += (model.launch_ns + model.mem_latency_ns + moved * 1000 // comb_bw
              + num_splits * model.combine_split_ns)
    return t


def analytic_config(shape: Shape, profile: GpuProfile, model: CostModel = MODEL) -> Config:
    """The fewest splits, then the largest block_kv (fitting smem), whose modelled time is
    within ``model.tie_pct`` percent of the least: as the table builder does with measured
    ties, since a gain that small is inside the model's error. The split counts are
    ``tunables.SPLIT_COUNTS`` up to the KV blocks: the launches a sweep measures, at most 42
    candidates, so that the exported C++ header models every one within its lookup's bound.

    >>> analytic_config(Shape("bf16", 128, 1, 32, 8, 1, 16384), profile_for("h200")).num_splits > 1
    True
    >>> analytic_config(Shape("bf16", 128, 32, 32, 32, 1, 16384), profile_for("h200")).num_splits
    1
    """
    bm = block_m_for(shape.packed_rows)
    costs = {}  # (splits, -block_kv) -> modelled ns
    for bkv in tunables.BLOCK_KV:
        if smem_bytes(shape.head_dim, bkv, bm) > profile.smem_per_block and bkv != tunables.BLOCK_KV[0]:
            continue
        top = min(tunables.MAX_SPLITS, ceil_div(shape.kv_len, bkv))
        for s in (s for s in tunables.SPLIT_COUNTS if s <= top):
            costs[(s, -bkv)] = analytic_cost_ns(shape, s, bkv, profile, model)
    least = min(costs.values())
    s, neg_bkv = min(k for k, t in costs.items() if t * 100 <= least * (100 + model.tie_pct))
    return Config(s, -neg_bkv, 128, "blocks")


def analytic_configs(shape: Shape, kv_lens, profile: GpuProfile, model: CostModel = MODEL):
    """:func:`analytic_config` of ``shape`` with each of ``kv_lens`` as its ``kv_len``, as two
    numpy arrays (``num_splits``, ``block_kv``): the same integer model, evaluated over a
    (kv_len, block_kv, splits) grid at once (``reduce_threads`` 128, policy ``blocks``)."""
    import numpy as np
    d, rows_all = shape.head_dim, shape.packed_rows
    bm = block_m_for(rows_all)
    sk = np.asarray(kv_lens, dtype=np.int64)[:, None]
    splits = np.array(tunables.SPLIT_COUNTS, dtype=np.int64)[None, :]
    rows = min(bm, rows_all)
    sms, bw = profile.sms, int(round(profile.copy_bw_gbps * 1000))
    stream = cta_stream_rate(profile, model)
    out = np.where(splits > 1, rows * (d + 2) * 4, rows * d * 2)
    ctas = shape.batch * shape.kv_heads * ceil_div(rows_all, bm) * splits
    ws = np.array([[tunables.workspace_bytes(shape, int(s)) for s in splits[0]]], dtype=np.int64)
    comb_bw = np.where(2 * ws <= profile.l2_bytes, bw * model.l2_speedup_pct // 100, bw)
    moved = ws + shape.batch * shape.q_heads * shape.q_len * d * 2
    combine = np.where(splits > 1, model.launch_ns + model.mem_latency_ns + moved * 1000 // comb_bw
                       + splits * model.combine_split_ns, 0)
    blocks = [b for i, b in enumerate(tunables.BLOCK_KV)
              if i == 0 or smem_bytes(d, b, bm) <= profile.smem_per_block]
    costs = []
    for bkv in blocks:
        nblk = ceil_div(sk, bkv)
        keys = np.minimum(ceil_div(nblk, splits) * bkv, sk)
        cta_bytes = keys * d * 4 + rows * d * 2 + out
        cta_flops = 4 * bm * keys * d
        slots = sms * residency(d, bkv, bm, profile)
        tile_bytes = bkv * d * 4
        cta_bw = tile_bytes * 1000 // (model.block_ns + tile_bytes * 1000 // stream)

        def wave(active):
            rate = np.minimum(cta_bw // ceil_div(active, sms), bw // active)
            mem = cta_bytes * 1000 // np.maximum(1, rate)
            comp = cta_flops * ceil_div(active, sms) // model.mma_flop_per_ns_per_sm
            return model.tile_ns + np.maximum(mem, comp)

        full, tail = np.divmod(ctas, slots)
        t = model.launch_ns + full * wave(slots) + np.where(tail > 0, wave(np.maximum(tail, 1)), 0)
        valid = splits <= np.minimum(tunables.MAX_SPLITS, nblk)
        costs.append(np.where(valid, t + combine, -1))
    cost = np.stack(costs, axis=1)                       # (kv_lens, blocks, splits); -1: no run
    big = np.iinfo(np.int64).max // 200
    least = np.where(cost < 0, big, cost).min(axis=(1, 2))
    ok = (cost >= 0) & (cost * 100 <= (least * (100 + model.tie_pct))[:, None, None])
    # Fewest splits first, then the largest block: flatten as (splits, blocks reversed).
    order = ok[:, ::-1, :].transpose(0, 2, 1).reshape(len(sk), -1)
    first = order.argmax(axis=1)
    bkv = np.array(blocks[::-1], dtype=np.int64)[first % len(blocks)]
    return splits[0, first // len(blocks)], bkv
