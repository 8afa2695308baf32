"""Dynamic split selector: a pure function from a problem shape to a kernel :class:`Config`.

The rule, in the order it is tried (the exported C++ header implements the same rule with
the same integer arithmetic, so both choose identically):

1. **Table hit** - a row of the heuristics table with exactly this shape
   (dtype, head_dim, causal, batch, q_heads, kv_heads, q_len, kv_len): its winner.
2. **Interpolation** - when at least K=4 rows share the shape's dtype, head_dim, causal and
   query-tile height (``tunables.block_m_for(q_len * group)``: decode, small and large prefill
   run different tiles; a class of fewer rows goes to the fallback: interpolating from one or
   two far rows chose S1 for D = 256 batches of 48 CTAs), take the K nearest rows by L1
   distance in log2 space over the work dimensions ``(B*Hkv, Sk, Sq*G)`` (``G = Hq/Hkv``; ties
   -> lower row number, rows in canonical order: sorted by shape). ``Sk``'s coordinate is its
   log2 rounded down to a 1/64 octave (``log2_q16(Sk)`` with the low 10 bits cleared,
   :func:`sk_coord`), for the query and the rows alike: every ``Sk`` of one such bucket gets
   the same answer up to the final cap, so the run-time lookup (``splitkv_tune.lookup``)
   precomputes it per bucket. A row at distance 0 is used as it is. Otherwise, with weights
   ``2**32 // distance``:

   - ``block_kv``: for each ``b`` that fits the profile's per-block shared memory (the smallest
     always; all when none the neighbours timed fits), the weighted mean, over the neighbours
     that timed ``b``, of ``log2_q16(their time at b) - log2_q16(their fastest time)`` (times
     from the ``best_us_kv<b>`` columns in whole ns, :func:`time_ns`; a row without them knows
     only its winner). The least mean wins; ties go to the larger ``b``.
   - ``S``: ``log2 W``, the weighted mean of the neighbours' ``log2_q16(S_b * C)`` (``S_b``
     their split count at that ``b``, ``C`` their split kernel's CTAs per split, ``B*Hkv*m_blocks``)
     less ``log2_q16(slots)``, ``slots = SMs * analytic.residency`` of ``b``: the neighbours'
     waves. From 3/4 of a wave on (``WAVE_ROUNDING_FROM``), ``S = n * slots // C`` of this shape
     with ``n`` the whole number of waves nearest in log2 (:func:`nearest_count`); below, the
     ``S`` in ``[1, 128]`` nearest in log2 to ``log2 W + log2 slots - log2 C`` (ties ->
     smaller S). That ``S`` is at most the finest-split neighbour's keys per split allow at the
     first ``Sk`` of the shape's bucket (:func:`interpolation.finest_split_cap`): waves carried
     from rows of more KV heads would otherwise cut a small batch into slivers. On a GPU whose
     profile has ``sm_balance_pct`` (``configs/gpus.yaml``), that ``S`` (at most 128) is raised
     when its ``S * C`` CTAs fall unevenly on the SMs, to the first even ``S'`` up to ``2S``
     (:func:`interpolation.balance_splits`). ``reduce_threads`` and ``split_policy`` are the
     nearest row's. Logs are fixed
     point (16 fractional bits) computed with integers only; every division of the rule is a
     floor of non-negative integers.
3. **Analytic fallback** (fewer than K table rows for that dtype/head_dim/causal/tile height): over
   every ``block_kv`` that fits the GPU's shared memory and every ``S`` in
   ``[1, min(128, kv blocks)]``, the fewest splits, then the largest block, whose modelled
   time (:func:`analytic_cost_ns`) is within ``CostModel.tie_pct`` of the least; the model
   is evaluated at the first ``Sk`` of the shape's 1/64-octave bucket
   (:func:`sk_bucket_start`), for the same reason.

Every result is finalised the same way: ``block_kv`` lowered while its smem exceeds the GPU
profile's per-block shared memory (only when the profile is known), then ``S`` capped at
``min(128, ceil(kv_len / block_kv))``, so the kernel can always run what comes back.
"""
from __future__ import annotations

import dataclasses
import functools
import os
import sys
from pathlib import Path

from splitkv_tune import tunables
from splitkv_tune.analytic import (GENERIC_PROFILE, MODEL, CostModel, analytic_config,  # noqa: F401
                                   analytic_cost_ns)
from splitkv_tune.gpus import GpuProfile, profile_for, resolve_gpu
from splitkv_tune.interpolation import (Q, balance_splits, choose_block_kv, finest_split_cap, fits_block_kv,
                                        log2_q16, row_votes, splits_from_waves, wave_slots)
from splitkv_tune.paths import data_dir
from splitkv_tune.table_schema import MAX_DIM, SHAPE_COLUMNS, TableError
from splitkv_tune.tunables import Config, Shape, block_m_for, ceil_div, smem_bytes

TABLES_ENV = "SPLITKV_TUNE_TABLES"
RESULTS_DIR = data_dir("results")
NEIGHBOURS = 4
SK_DROP_BITS = 10  # Sk's log2 is rounded down to 2**(SK_DROP_BITS - Q) octave (1/64)
DTYPE_CODES = tunables.dtype_codes()


@dataclasses.dataclass(frozen=True)
class Selection:
    """A chosen config, how it was chosen (``kind``: hit|interpolated|fallback) and why."""

    config: Config
    reason: str
    kind: str
    rows: tuple = ()


def sk_coord(kv_len: int) -> int:
    """``Sk``'s interpolation coordinate: ``log2_q16(Sk)`` rounded down to a 1/64 octave.

    >>> sk_coord(4096) == log2_q16(4096), sk_coord(4100) == sk_coord(4096), sk_coord(4141) > sk_coord(4096)
    (True, True, True)
    """
    return log2_q16(kv_len) >> SK_DROP_BITS << SK_DROP_BITS


def sk_bucket_start(kv_len: int) -> int:
    """The smallest ``Sk`` with the same :func:`sk_coord` as ``kv_len`` (where the fallback
    evaluates its model).

    >>> sk_bucket_start(4096), sk_bucket_start(4100), sk_bucket_start(1)
    (4096, 4096, 1)
    """
    want = sk_coord(kv_len)
    lo, hi = 1 << (want >> Q), kv_len  # log2_q16 of a power of two is exact
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (mid + 1, hi) if log2_q16(mid) < want else (lo, mid)
    return lo


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
            (log2_q16(bh), sk_coord(shape.kv_len), log2_q16(rows)))


class HeuristicTable:
    """A validated heuristics table of one GPU, indexed for lookups (build once, reuse).

    ``df``: a heuristics DataFrame (validated here), or with ``validated=True`` a list of
    records already checked by ``table_schema`` (the run-time reader's; no pandas).
    """

    def __init__(self, df, gpu: str | None = None, source: str = "<table>", validated=False):
        self.source = str(source)
        if validated:
            recs = [dict(r) for r in df]
        elif len(df):
            from splitkv_tune.table_schema import validate_heuristics
            recs = validate_heuristics(df, source).to_dict("records")
        else:
            recs = []
        self.columns = list(recs[0]) if recs else list(getattr(df, "columns", []))
        if gpu is not None and recs:
            want = resolve_gpu(gpu)
            kept = [r for r in recs if resolve_gpu(r["gpu"]) == want]
            if not kept:
                raise TableError(source, f"unknown GPU {gpu!r} for this table (it has rows for: "
                                         f"{', '.join(sorted(set(r['gpu'] for r in recs)))})")
            recs = kept
        gpus = sorted(set(r["gpu"] for r in recs))
        if len(gpus) > 1:
            raise TableError(source, f"rows for several GPUs ({', '.join(gpus)}); name one")
        self.gpu = gpus[0] if gpus else (resolve_gpu(gpu) if gpu else None)
        self.run_ids = tuple(sorted(set(r["run_id"] for r in recs)))
        recs.sort(key=lambda r: shape_key(*(r[c] for c in SHAPE_COLUMNS)))
        self.records = recs
        self.rows = []      # (key, Config) in canonical order
        self.exact = {}     # key -> row index
        self.buckets = {}   # (dtype code, head_dim, causal, block_m) -> [(index, coords)]
        self.votes = []     # per row: row_votes, one entry per tunables.BLOCK_KV
        for i, r in enumerate(recs):
            key = shape_key(*(r[c] for c in SHAPE_COLUMNS))
            cfg = Config(int(r["num_splits"]), int(r["block_kv"]), int(r["reduce_threads"]),
                         str(r["split_policy"]))
            self.rows.append((key, cfg))
            self.exact[key] = i
            shape = Shape(str(r["dtype"]), *key[1:2], *key[3:], causal=bool(key[2]))
            bm, w, coords = _work(shape)
            self.buckets.setdefault((key[0], key[1], key[2], bm), []).append((i, coords))
            self.votes.append(row_votes(r, cfg, w))

    @functools.cached_property
    def frame(self):
        """The rows as a DataFrame in canonical order (for the tools; imports pandas)."""
        from splitkv_tune.table_schema import records_frame
        return records_frame(self.records, self.columns)

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


def _class_of(table: HeuristicTable, shape: Shape) -> list:
    """Every row of ``shape``'s class (dtype, head_dim, causal, query-tile height), as
    ``(index, coords)``."""
    key = (DTYPE_CODES[shape.dtype], shape.head_dim, int(shape.causal), block_m_for(shape.packed_rows))
    return table.buckets.get(key, [])


def class_rows(table: HeuristicTable | None, shape: Shape) -> list:
    """The rows of ``shape``'s class that the interpolation reads; none when the class has
    fewer than ``NEIGHBOURS`` rows (the fallback's case)."""
    rows = _class_of(table, shape) if table is not None else []
    return rows if len(rows) >= NEIGHBOURS else []


def _interpolate(table: HeuristicTable, shape: Shape, profile, fallback) -> Selection | None:
    bm, w, coords = _work(shape)
    cands = class_rows(table, shape)
    if not cands:
        return None
    dist = sorted((sum(abs(a - b) for a, b in zip(coords, c)), i) for i, c in cands)[:NEIGHBOURS]
    d0, i0 = dist[0][0], dist[0][1]
    rows = tuple(i for _, i in dist)
    if d0 == 0:
        return Selection(_finalize(table.rows[i0][1], shape, profile),
                         f"interpolated from rows {_describe(table, i0)}: same work "
                         "dimensions (B*Hkv, Sk, Sq*G)", "interpolated", (i0,))
    weights = [(1 << 32) // d for d, _ in dist]

    def weighted(j: int, part: int):
        """(sum of weight * vote part, sum of weights) over the neighbours that timed b_j."""
        pairs = [(wt, table.votes[i][j][part]) for wt, i in zip(weights, rows) if table.votes[i][j]]
        return sum(wt * v for wt, v in pairs), sum(wt for wt, _ in pairs)

    fits = fits_block_kv(shape.head_dim, bm, profile)
    sums = [weighted(j, 0) for j in range(len(tunables.BLOCK_KV))]
    scores = [num // den if den and fit else None for (num, den), fit in zip(sums, fits)]
    if all(score is None for score in scores):  # every timed block is too large here
        scores = [num // den if den else None for num, den in sums]
    j = choose_block_kv(scores)
    slots = wave_slots(shape.head_dim, bm, fallback)[j]
    num, den = weighted(j, 1)
    log_waves = num // den - log2_q16(slots)
    base = table.rows[i0][1]
    splits = splits_from_waves(log_waves, slots, w)
    cap = finest_split_cap(sk_bucket_start(shape.kv_len),
                           [(table.votes[i][j][2], table.rows[i][0][7]) for i in rows if table.votes[i][j]])
    capped = min(splits, cap, tunables.MAX_SPLITS)
    even = balance_splits(capped, w, fallback.sms, fallback.sm_balance_pct)
    cfg = Config(even, tunables.BLOCK_KV[j], base.reduce_threads, base.split_policy)
    reason = ("interpolated from rows " + ", ".join(_describe(table, i) for i in rows)
              + f": block_kv {tunables.BLOCK_KV[j]} (their least weighted time ratio), "
              f"{(2 ** (log_waves / (1 << Q))):.2f} waves of {slots} CTAs"
              + (f", at most S={cap} (their finest split's keys per split)" if cap < splits else "")
              + (f", S={capped} raised to {even} so that {fallback.sms} SMs share its {w * even} CTAs "
                 f"evenly (at least {fallback.sm_balance_pct}% of the busiest SM's)" if even != capped else ""))
    final = _finalize(cfg, shape, profile)
    if final.num_splits < even:
        reason += f", then S={final.num_splits}: at most ceil(Sk / block_kv)"
    return Selection(final, reason, "interpolated", rows)


def _profiles(gpu, table: HeuristicTable | None):
    """(profile for the smem check or None when unknown, profile for the fallback and the
    interpolation's waves)."""
    if isinstance(gpu, GpuProfile):
        return gpu, gpu
    name = gpu if gpu is not None else (table.gpu if table is not None else None)
    prof = profile_for(name) if name else None
    return prof, prof or GENERIC_PROFILE


def profiles_for(gpu, table: HeuristicTable | None, sms: int | None = None):
    """:func:`_profiles` with the SM count overridden by ``sms`` when given."""
    profile, fallback = _profiles(gpu, table)
    if sms is not None:
        profile = profile and dataclasses.replace(profile, sms=int(sms))
        fallback = dataclasses.replace(fallback, sms=int(sms))
    return profile, fallback


def select_shape(table, shape: Shape, gpu=None, sms: int | None = None) -> Selection:
    """:func:`select_config` for a :class:`~splitkv_tune.tunables.Shape`; ``sms`` overrides
    the profile's SM count (MIG slices, cut-down parts)."""
    check_domain(shape)
    table = as_table(table, gpu=gpu if isinstance(gpu, str) else None)
    profile, fallback = profiles_for(gpu, table, sms)
    if table is not None and len(table):
        i = table.exact.get(shape_key(shape.dtype, shape.head_dim, shape.causal, shape.batch,
                                      shape.q_heads, shape.kv_heads, shape.q_len, shape.kv_len))
        if i is not None:
            return Selection(_finalize(table.rows[i][1], shape, profile),
                             f"table hit: row {_describe(table, i)}", "hit", (i,))
        sel = _interpolate(table, shape, profile, fallback)
        if sel is not None:
            return sel
        have = len(_class_of(table, shape))
        why = (f"{have} table row{'' if have == 1 else 's'} for {shape.dtype}/d{shape.head_dim}"
               f"/causal={int(shape.causal)}/block_m={block_m_for(shape.packed_rows)}, fewer than the "
               f"{NEIGHBOURS} it interpolates from")
    else:
        why = "no table"
    start = sk_bucket_start(shape.kv_len)
    cfg = analytic_config(dataclasses.replace(shape, kv_len=start), fallback)
    cfg = _finalize(cfg, shape, profile or fallback)
    return Selection(cfg, f"analytic fallback ({why}; profile {fallback.name}: {fallback.sms} "
                          f"SMs, {fallback.copy_bw_gbps:g} GB/s, L2 {fallback.l2_bytes >> 20} MiB;"
                          f" modelled at Sk={start})", "fallback")


def select_config(table, *, dtype, head_dim, batch, q_heads, kv_heads, q_len, kv_len, causal,
                  gpu=None) -> Selection:
    """Choose the kernel config for one shape (see the module docstring for the rule).

    ``table``: ``None``, a heuristics DataFrame or a :class:`HeuristicTable`; ``gpu``: a name
    (profile from ``configs/gpus.yaml``), a :class:`GpuProfile`, or ``None`` (the table's GPU).

    >>> row = dict(schema_version=1, gpu="nvidia_h200", dtype="bf16", head_dim=128, causal=0,
    ...            batch=1, q_heads=32, kv_heads=8, q_len=1, kv_len=4096, num_splits=16,
    ...            block_kv=64, reduce_threads=128, split_policy="blocks", median_us=9.5,
    ...            n_trials=40, run_id="r1")
    >>> import pandas as pd
    >>> t = HeuristicTable(pd.DataFrame([row, {**row, "kv_len": 16384, "num_splits": 32},
    ...                                  {**row, "kv_len": 2048, "num_splits": 8},
    ...                                  {**row, "kv_len": 32768, "num_splits": 48}]))
    >>> shape = dict(dtype="bf16", head_dim=128, batch=1, q_heads=32, kv_heads=8, q_len=1, causal=False)
    >>> select_config(t, kv_len=4096, **shape).config.num_splits, select_config(t, kv_len=4096, **shape).kind
    (16, 'hit')
    >>> import dataclasses
    >>> plain = dataclasses.replace(profile_for("h200"), sm_balance_pct=0)  # no SM balance
    >>> select_config(t, kv_len=8192, gpu=plain, **shape).config.num_splits  # between the rows' waves
    22
    >>> select_config(t, kv_len=8192, **shape).config.num_splits  # the H200's 176 CTAs evened out to 232
    29
    >>> select_config(None, kv_len=8192, gpu="h200", **shape).kind
    'fallback'
    """
    shape = Shape(dtype, int(head_dim), int(batch), int(q_heads), int(kv_heads), int(q_len),
                  int(kv_len), bool(causal))
    return select_shape(table, shape, gpu)


def table_locations(gpu_name: str) -> list[Path]:
    """Where the table of a GPU is looked for, in order: ``$SPLITKV_TUNE_TABLES/<gpu>/heuristics.csv``,
    then the shipped ``results/<gpu>/heuristics.csv`` of the package (``<gpu>`` = ``resolve_gpu``)."""
    key = resolve_gpu(gpu_name)
    env = os.environ.get(TABLES_ENV)
    return [root.absolute() / key / "heuristics.csv" for root in ([Path(env)] if env else []) + [RESULTS_DIR]]


def table_path_for_gpu(gpu_name: str) -> Path | None:
    """The first of :func:`table_locations` that is a file, or ``None``."""
    return next((path for path in table_locations(gpu_name) if path.is_file()), None)


@functools.lru_cache(maxsize=64)
def _load_cached(key: str, env: str | None) -> HeuristicTable | None:
    path = table_path_for_gpu(key)
    if path is None:
        return None
    from splitkv_tune.table_schema import read_heuristics_records
    return HeuristicTable(read_heuristics_records(path), gpu=key, source=str(path), validated=True)


def load_table_for_gpu(gpu_name: str) -> HeuristicTable | None:
    """The GPU's table (cached per process and per ``$SPLITKV_TUNE_TABLES``), or ``None``."""
    return _load_cached(resolve_gpu(gpu_name), os.environ.get(TABLES_ENV))


# (shape class, device, SM count) -> lookup.KvLenLookup
_CLASSES: dict = {}
MAX_CLASSES = 4096


def clear_lookup_caches() -> None:
    """Forget the loaded tables, the precomputed classes and the eager call's plans (which hold
    the tunables ``"auto"`` resolved to): call it after changing ``$SPLITKV_TUNE_TABLES`` or a
    table on disk in a running process."""
    _load_cached.cache_clear()
    _CLASSES.clear()
    extension = sys.modules.get("splitkv_tune._C")  # loaded only where kernels were called
    if extension is not None:
        extension.clear_plans()


def _new_class(shape: Shape, device_name: str, num_sms: int, key: tuple):
    from splitkv_tune.lookup import KvLenLookup
    if len(_CLASSES) >= MAX_CLASSES:
        _CLASSES.clear()
    found = _CLASSES[key] = KvLenLookup(shape, load_table_for_gpu(device_name), device_name, num_sms)
    return found


def class_lookup(shape: Shape, device_name: str, num_sms: int):
    """The precomputed answers (``lookup.KvLenLookup``) of ``shape``'s class: the shape but
    ``kv_len``, on a device. The first call of a class finds the table (``$SPLITKV_TUNE_TABLES``
    as it is then, see :func:`clear_lookup_caches`) and precomputes the answer for every
    ``kv_len``."""
    key = (shape.dtype, shape.head_dim, shape.causal, shape.batch, shape.q_heads,
           shape.kv_heads, shape.q_len, device_name, num_sms)
    found = _CLASSES.get(key)
    if found is None:
        found = _new_class(shape, device_name, num_sms, key)
    return found


def auto_config(shape: Shape, device_name: str, num_sms: int) -> Config:
    """What ``splitkv_attention(num_splits="auto")`` runs: :func:`select_shape`'s config,
    from :func:`class_lookup`: after a class's first call, whatever the ``kv_len``, a dict
    lookup and a bisection."""
    return class_lookup(shape, device_name, num_sms).config(shape.kv_len)
