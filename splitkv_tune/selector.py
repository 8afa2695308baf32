"""Dynamic split selector: a pure function from a problem shape to a kernel :class:`Config`.

The rule, in the order it is tried (the exported C++ header implements the same rule with
the same integer arithmetic, so both choose identically):

1. **Table hit** - a row of the heuristics table with exactly this shape
   (dtype, head_dim, causal, batch, q_heads, kv_heads, q_len, kv_len): its winner.
2. **Interpolation** - among the rows with the same dtype, head_dim, causal and query-tile
   height (``tunables.block_m_for(q_len * group)``: decode, small and large prefill run
   different tiles), take the K=4 nearest rows by L1 distance in log2 space over the work
   dimensions ``(B*Hkv, Sk, Sq*G)`` (``G = Hq/Hkv``; ties -> lower row number, rows in
   canonical order: sorted by shape). A row at distance 0 is used as it is. Otherwise the
   split count is interpolated through the split kernel's CTA count ``C = S * B*Hkv*m_blocks``:
   ``log2 C`` is the inverse-distance weighted mean of the neighbours' ``log2 C``, and ``S`` is
   the integer in ``[1, cap]`` whose log2 is nearest to ``log2 C - log2(B*Hkv*m_blocks)``
   (ties -> smaller S) and ``cap = min(128, ceil(Sk / block_kv))``. ``block_kv``,
   ``reduce_threads`` and ``split_policy`` are the nearest row's. Logs are fixed point
   (16 fractional bits) computed with integers only.
3. **Analytic fallback** (no table rows for that dtype/head_dim/causal/tile height): over
   every ``block_kv`` that fits the GPU's shared memory and every ``S`` in
   ``[1, min(128, kv blocks)]``, the fewest splits, then the largest block, whose modelled
   time (:func:`analytic_cost_ns`) is within ``CostModel.tie_pct`` of the least.

Every result is finalised the same way: ``block_kv`` lowered while its smem exceeds the GPU
profile's per-block shared memory (only when the profile is known), then ``S`` capped at
``min(128, ceil(kv_len / block_kv))``, so the kernel can always run what comes back.
"""
from __future__ import annotations

import dataclasses
import functools
import os
from pathlib import Path

import pandas as pd

from splitkv_tune import tunables
from splitkv_tune.gpus import GpuProfile, profile_for, resolve_gpu
from splitkv_tune.paths import data_dir
from splitkv_tune.table_schema import MAX_DIM, SHAPE_COLUMNS, TableError, validate_heuristics
from splitkv_tune.tunables import Config, Shape, block_m_for, ceil_div, smem_bytes

TABLES_ENV = "SPLITKV_TUNE_TABLES"
RESULTS_DIR = data_dir("results")
NEIGHBOURS = 4
Q = 16  # fractional bits of the fixed-point log2
DTYPE_CODES = {d: i for i, d in enumerate(tunables.DTYPES)}
POLICY_CODES = {p: i for i, p in enumerate(tunables.SPLIT_POLICIES)}
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
    cta_stream_mbps: int = 42500       # bytes/µs one CTA streams (H200, 2026-11-29 sweeps)
    ctas_per_sm: int = 2               # register-limited residency (smem may lower it)
    mma_flop_per_ns_per_sm: int = 2000  # achieved mma.sync throughput of one SM
    l2_speedup_pct: int = 250          # combine reading partials still in L2
    combine_split_ns: int = 15         # serial merge cost per split in the combine kernel
    block_ns: int = 230                # per KV block a CTA walks: barriers, softmax, MMAs
    tie_pct: int = 1                   # modelled gains below this are not worth more splits


MODEL = CostModel()


@dataclasses.dataclass(frozen=True)
class Selection:
    """A chosen config, how it was chosen (``kind``: hit|interpolated|fallback) and why."""

    config: Config
    reason: str
    kind: str
    rows: tuple = ()


def log2_q16(x: int) -> int:
    """``log2(x)`` in fixed point with 16 fractional bits, integers only (as in the C++ header).

    >>> log2_q16(1), log2_q16(2), log2_q16(4096), log2_q16(3)
    (0, 65536, 786432, 103872)
    """
    n = x.bit_length() - 1
    y = x << (30 - n) if n <= 30 else x >> (n - 30)
    r = n << Q
    for i in range(Q - 1, -1, -1):
        y = (y * y) >> 30
        if y >= 1 << 31:
            y >>= 1
            r |= 1 << i
    return r


def shape_key(dtype, head_dim, causal, batch, q_heads, kv_heads, q_len, kv_len) -> tuple:
    """The canonical key of a shape (the order of ``SHAPE_COLUMNS``; rows sort by it)."""
    return (DTYPE_CODES[dtype], int(head_dim), int(bool(causal)), int(batch), int(q_heads),
            int(kv_heads), int(q_len), int(kv_len))


def check_domain(shape: Shape) -> Shape:
    """Shape.validate() plus the sizes the integer lookup handles without overflow.

    >>> check_domain(Shape("bf16", 128, 2**21, 2**12, 2**12, 1, 64))
    Traceback (most recent call last):
    ...
    ValueError: batch*q_heads*q_len must be <= 2**32, got 8589934592 * 1
    """
    shape.validate()
    for name in ("batch", "q_heads", "kv_heads", "q_len", "kv_len"):
        if getattr(shape, name) > MAX_DIM:
            raise ValueError(f"{name} must be <= {MAX_DIM}, got {getattr(shape, name)}")
    if shape.batch * shape.q_heads > 2**32 or shape.batch * shape.q_heads * shape.q_len > 2**32:
        raise ValueError(f"batch*q_heads*q_len must be <= 2**32, got "
                         f"{shape.batch * shape.q_heads} * {shape.q_len}")
    if shape.batch * shape.kv_heads * shape.kv_len > 2**40:
        raise ValueError("batch*kv_heads*kv_len must be <= 2**40")
    return shape


def _work(shape: Shape) -> tuple[int, int, tuple[int, int, int]]:
    """(tile height, split-kernel CTAs per split, log2 coordinates) of a shape."""
    rows = shape.packed_rows
    bh = shape.batch * shape.kv_heads
    return (block_m_for(rows), bh * tunables.num_m_blocks(shape),
            (log2_q16(bh), log2_q16(shape.kv_len), log2_q16(rows)))


class HeuristicTable:
    """A validated heuristics table of one GPU, indexed for lookups (build once, reuse)."""

    def __init__(self, df: pd.DataFrame, gpu: str | None = None, source: str = "<table>"):
        self.source = str(source)
        if len(df):
            df = validate_heuristics(df, source)
        if gpu is not None and len(df):
            keep = df["gpu"].map(resolve_gpu) == resolve_gpu(gpu)
            if not keep.any():
                raise TableError(source, f"unknown GPU {gpu!r} for this table (it has rows for: "
                                         f"{', '.join(sorted(set(df['gpu'])))})")
            df = df[keep]
        gpus = sorted(set(df["gpu"])) if len(df) else []
        if len(gpus) > 1:
            raise TableError(source, f"rows for several GPUs ({', '.join(gpus)}); name one")
        self.gpu = gpus[0] if gpus else (resolve_gpu(gpu) if gpu else None)
        self.run_ids = tuple(sorted(set(df["run_id"]))) if len(df) else ()
        recs = df.to_dict("records") if len(df) else []
        recs.sort(key=lambda r: shape_key(*(r[c] for c in SHAPE_COLUMNS)))
        self.frame = pd.DataFrame.from_records(recs, columns=list(df.columns))
        self.rows = []      # (key, Config) in canonical order
        self.exact = {}     # key -> row index
        self.buckets = {}   # (dtype code, head_dim, causal, block_m) -> [(index, coords, logC)]
        for i, r in enumerate(recs):
            key = shape_key(*(r[c] for c in SHAPE_COLUMNS))
            cfg = Config(int(r["num_splits"]), int(r["block_kv"]), int(r["reduce_threads"]),
                         r["split_policy"])
            self.rows.append((key, cfg))
            self.exact[key] = i
            shape = Shape(r["dtype"], *key[1:2], *key[3:], causal=bool(key[2]))
            bm, w, coords = _work(shape)
            self.buckets.setdefault((key[0], key[1], key[2], bm), []).append(
                (i, coords, log2_q16(cfg.num_splits * w)))

    def __len__(self) -> int:
        return len(self.rows)


def as_table(table, gpu=None) -> HeuristicTable | None:
    """Accept ``None``, a DataFrame (validated here) or a :class:`HeuristicTable`."""
    if table is None or isinstance(table, HeuristicTable):
        return table
    return HeuristicTable(table, gpu=gpu)


def _finalize(cfg: Config, shape: Shape, profile: GpuProfile | None) -> Config:
    bkv = cfg.block_kv
    if profile is not None:
        bm = block_m_for(shape.packed_rows)
        while bkv != tunables.BLOCK_KV[0] and smem_bytes(shape.head_dim, bkv, bm) > profile.smem_per_block:
            bkv = tunables.BLOCK_KV[tunables.BLOCK_KV.index(bkv) - 1]
    s = max(1, min(cfg.num_splits, tunables.MAX_SPLITS, ceil_div(shape.kv_len, bkv)))
    return dataclasses.replace(cfg, num_splits=s, block_kv=bkv)


def _describe(table: HeuristicTable, i: int) -> str:
    k, c = table.rows[i]
    return f"#{i + 1} (B={k[3]} Hq={k[4]} Hkv={k[5]} Sq={k[6]} Sk={k[7]} -> S={c.num_splits})"


def _interpolate(table: HeuristicTable, shape: Shape, profile) -> Selection | None:
    bm, w, coords = _work(shape)
    cands = table.buckets.get((DTYPE_CODES[shape.dtype], shape.head_dim, int(shape.causal), bm))
    if not cands:
        return None
    dist = sorted((sum(abs(a - b) for a, b in zip(coords, c)), i, lc)
                  for i, c, lc in cands)[:NEIGHBOURS]
    d0, i0 = dist[0][0], dist[0][1]
    base = _finalize(table.rows[i0][1], shape, profile)
    if d0 == 0:
        return Selection(base, f"interpolated from rows {_describe(table, i0)}: same work "
                               "dimensions (B*Hkv, Sk, Sq*G)", "interpolated", (i0,))
    weights = [(1 << 32) // d for d, *_ in dist]
    target = sum(wt * lc for wt, (_, _, lc) in zip(weights, dist)) // sum(weights) - log2_q16(w)
    cap = max(1, min(tunables.MAX_SPLITS, ceil_div(shape.kv_len, base.block_kv)))
    best = 1
    for s in range(2, cap + 1):
        if abs(log2_q16(s) - target) < abs(log2_q16(best) - target):
            best = s
    rows = tuple(i for _, i, *_ in dist)
    reason = "interpolated from rows " + ", ".join(_describe(table, i) for i in rows)
    return Selection(dataclasses.replace(base, num_splits=best), reason, "interpolated", rows)


def analytic_cost_ns(shape: Shape, num_splits: int, block_kv: int, profile: GpuProfile,
                     model: CostModel = MODEL) -> int:
    """Modelled time of one launch (split kernel + combine) in integer nanoseconds.

    Split kernel: ``C = B*Hkv*m_blocks*S`` CTAs run in waves of ``slots = SMs * residency``
    (residency = ``min(ctas_per_sm, smem_per_sm // smem)``); full waves and the tail wave are
    timed apart (wave quantisation). A CTA walks ``ceil(blocks/S)`` KV blocks; alone on an SM
    it streams one block in ``block_ns`` plus the block's bytes at ``cta_stream_mbps``. (The
    constants were read off the H200 sweeps of the loop with CTA barriers, ~32 GB/s per CTA
    at block_kv 64; refitting them to the current loop's 48-59 GB/s made the selection worse
    on its own sweep, docs/NOTES.md, so they act as an effective rate.) CTAs on one SM share
    that rate, all CTAs share the copy bandwidth, and a CTA takes the longer of
    its streaming and its MMAs, plus a fixed per-CTA cost. Combine (``S > 1``): a second
    launch, one memory latency, the workspace read and the output written at copy bandwidth
    (x2.5 when the workspace fits in half the L2, where the split kernel just wrote it), and
    a serial per-split merge term.

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
    slots = sms * max(1, min(model.ctas_per_sm,
                             profile.smem_per_sm // smem_bytes(d, block_kv, bm)))
    # One CTA streams a KV block in a fixed per-block time plus its bytes at the CTA's peak rate.
    tile_bytes = block_kv * d * 4
    cta_bw = tile_bytes * 1000 // (model.block_ns + tile_bytes * 1000 // model.cta_stream_mbps)

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
    ties, since a gain that small is inside the model's error.

    >>> analytic_config(Shape("bf16", 128, 1, 32, 8, 1, 16384), profile_for("h200")).num_splits > 1
    True
    >>> analytic_config(Shape("bf16", 128, 64, 32, 32, 1, 16384), profile_for("h200")).num_splits
    1
    """
    bm = block_m_for(shape.packed_rows)
    costs = {}  # (splits, -block_kv) -> modelled ns
    for bkv in tunables.BLOCK_KV:
        if smem_bytes(shape.head_dim, bkv, bm) > profile.smem_per_block and bkv != tunables.BLOCK_KV[0]:
            continue
        for s in range(1, min(tunables.MAX_SPLITS, ceil_div(shape.kv_len, bkv)) + 1):
            costs[(s, -bkv)] = analytic_cost_ns(shape, s, bkv, profile, model)
    least = min(costs.values())
    s, neg_bkv = min(k for k, t in costs.items() if t * 100 <= least * (100 + model.tie_pct))
    return Config(s, -neg_bkv, 128, "blocks")


def _profiles(gpu, table: HeuristicTable | None):
    """(profile for the smem check or None when unknown, profile for the fallback)."""
    if isinstance(gpu, GpuProfile):
        return gpu, gpu
    name = gpu if gpu is not None else (table.gpu if table is not None else None)
    prof = profile_for(name) if name else None
    return prof, prof or GENERIC_PROFILE


def select_shape(table, shape: Shape, gpu=None, sms: int | None = None) -> Selection:
    """:func:`select_config` for a :class:`~splitkv_tune.tunables.Shape`; ``sms`` overrides
    the profile's SM count (MIG slices, cut-down parts)."""
    check_domain(shape)
    table = as_table(table, gpu=gpu if isinstance(gpu, str) else None)
    profile, fallback = _profiles(gpu, table)
    if sms is not None:
        profile = profile and dataclasses.replace(profile, sms=int(sms))
        fallback = dataclasses.replace(fallback, sms=int(sms))
    if table is not None and len(table):
        i = table.exact.get(shape_key(shape.dtype, shape.head_dim, shape.causal, shape.batch,
                                      shape.q_heads, shape.kv_heads, shape.q_len, shape.kv_len))
        if i is not None:
            return Selection(_finalize(table.rows[i][1], shape, profile),
                             f"table hit: row {_describe(table, i)}", "hit", (i,))
        sel = _interpolate(table, shape, profile)
        if sel is not None:
            return sel
        why = (f"no table rows for {shape.dtype}/d{shape.head_dim}/causal={int(shape.causal)}"
               f"/block_m={block_m_for(shape.packed_rows)}")
    else:
        why = "no table"
    cfg = _finalize(analytic_config(shape, fallback), shape, profile or fallback)
    return Selection(cfg, f"analytic fallback ({why}; profile {fallback.name}: {fallback.sms} "
                          f"SMs, {fallback.copy_bw_gbps:g} GB/s, L2 {fallback.l2_bytes >> 20} MiB)",
                     "fallback")


def select_config(table, *, dtype, head_dim, batch, q_heads, kv_heads, q_len, kv_len, causal,
                  gpu=None) -> Selection:
    """Choose the kernel config for one shape (see the module docstring for the rule).

    ``table``: ``None``, a heuristics DataFrame or a :class:`HeuristicTable`; ``gpu``: a name
    (profile from ``configs/gpus.yaml``), a :class:`GpuProfile`, or ``None`` (the table's GPU).

    >>> row = dict(schema_version=1, gpu="nvidia_h200", dtype="bf16", head_dim=128, causal=0,
    ...            batch=1, q_heads=32, kv_heads=8, q_len=1, kv_len=4096, num_splits=16,
    ...            block_kv=64, reduce_threads=128, split_policy="blocks", median_us=9.5,
    ...            n_trials=40, run_id="r1")
    >>> t = HeuristicTable(pd.DataFrame([row, {**row, "kv_len": 16384, "num_splits": 32}]))
    >>> shape = dict(dtype="bf16", head_dim=128, batch=1, q_heads=32, kv_heads=8, q_len=1, causal=False)
    >>> select_config(t, kv_len=4096, **shape).config.num_splits, select_config(t, kv_len=4096, **shape).kind
    (16, 'hit')
    >>> select_config(t, kv_len=8192, **shape).config.num_splits
    23
    >>> select_config(None, kv_len=8192, gpu="h200", **shape).kind
    'fallback'
    """
    shape = Shape(dtype, int(head_dim), int(batch), int(q_heads), int(kv_heads), int(q_len),
                  int(kv_len), bool(causal))
    return select_shape(table, shape, gpu)


def table_path_for_gpu(gpu_name: str) -> Path | None:
    """Where the table of a GPU is read from: ``$SPLITKV_TUNE_TABLES/<gpu>/heuristics.csv``
    first, then the shipped ``results/<gpu>/heuristics.csv`` (``<gpu>`` = ``resolve_gpu``)."""
    key = resolve_gpu(gpu_name)
    env = os.environ.get(TABLES_ENV)
    for root in ([Path(env)] if env else []) + [RESULTS_DIR]:
        path = root / key / "heuristics.csv"
        if path.is_file():
            return path
    return None


@functools.lru_cache(maxsize=64)
def _load_cached(key: str, env: str | None) -> HeuristicTable | None:
    path = table_path_for_gpu(key)
    if path is None:
        return None
    from splitkv_tune.table_schema import read_heuristics
    return HeuristicTable(read_heuristics(path, gpu=key), gpu=key, source=str(path))


def load_table_for_gpu(gpu_name: str) -> HeuristicTable | None:
    """The GPU's table (cached per process and per ``$SPLITKV_TUNE_TABLES``), or ``None``."""
    return _load_cached(resolve_gpu(gpu_name), os.environ.get(TABLES_ENV))


@functools.lru_cache(maxsize=4096)
def _auto_cached(shape: Shape, device_name: str, num_sms: int, env: str | None) -> Config:
    table = _load_cached(resolve_gpu(device_name), env)
    return select_shape(table, shape, device_name, sms=num_sms).config


def auto_config(shape: Shape, device_name: str, num_sms: int) -> Config:
    """What ``splitkv_attention(num_splits="auto")`` runs: table cached per process, results
    cached per (shape, device, SM count); an exact hit is one dict lookup."""
    return _auto_cached(shape, device_name, num_sms, os.environ.get(TABLES_ENV))
