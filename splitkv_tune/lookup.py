"""The run-time side of the selector: one shape class's configs precomputed for every Sk.

:func:`selector.select_shape` is the rule. Within a shape class (dtype, head_dim, causal,
batch, q_heads, kv_heads, q_len) its answer depends on ``Sk`` only through three things:
an exact table row at that ``Sk``, the ``Sk`` bucket (``selector.sk_coord``: 1/64 octave),
and the final cap ``S <= ceil(Sk / block_kv)``. :class:`KvLenLookup` evaluates the rule once
for every bucket (numpy, the rows' distances and weights as integers exactly as the
selector computes them), merges neighbouring buckets with the same answer into segments,
and answers a call with a dict lookup, a bisection over the segments' first ``Sk`` and the
cap. A decode loop whose ``Sk`` grows by one per step therefore never interpolates.
"""
from __future__ import annotations

import bisect
import dataclasses
import functools
import math

from splitkv_tune import tunables
from splitkv_tune.analytic import analytic_configs
from splitkv_tune.interpolation import Q, WAVE_ROUNDING_FROM, balance_splits, fits_block_kv, log2_q16, wave_slots
from splitkv_tune.selector import (DTYPE_CODES, NEIGHBOURS, SK_DROP_BITS, HeuristicTable, _finalize, _work,
                                   check_domain, class_rows, profiles_for, sk_coord)
from splitkv_tune.table_schema import MAX_DIM
from splitkv_tune.tunables import Config, Shape, ceil_div


@functools.lru_cache(maxsize=1)
def bucket_starts() -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(first ``Sk`` of every non-empty ``sk_coord`` bucket up to ``MAX_DIM``, its coordinate)."""
    starts, coords = [], []
    for b in range((sk_coord(MAX_DIM) >> SK_DROP_BITS) + 1):
        want = b << SK_DROP_BITS
        sk = max(1, math.ceil(2 ** (want / (1 << Q))))
        while sk > 1 and log2_q16(sk - 1) >= want:
            sk -= 1
        while log2_q16(sk) < want:
            sk += 1
        if sk <= MAX_DIM and sk_coord(sk) == want:  # a bucket no integer falls in is skipped
            starts.append(sk)
            coords.append(want)
    return tuple(starts), tuple(coords)


@functools.lru_cache(maxsize=1)
def _split_logs():
    import numpy as np
    return np.array([log2_q16(s) for s in range(1, tunables.MAX_SPLITS + 1)], dtype=np.int64)


def log2_q16_array(x):
    """``interpolation.log2_q16`` of each element of an int64 array (elements in ``[1, 2**52]``)."""
    import numpy as np
    x = np.asarray(x, dtype=np.int64)
    n = np.frexp(x.astype(np.float64))[1].astype(np.int64) - 1  # exact below 2**53
    y = np.where(n <= 30, x << np.maximum(30 - n, 0), x >> np.maximum(n - 30, 0))
    r = n << Q
    for i in range(Q - 1, -1, -1):
        y = (y * y) >> 30
        bit = y >= 1 << 31
        y = np.where(bit, y >> 1, y)
        r = r | (bit.astype(np.int64) << i)
    return r


def nearest_counts(target):
    """``interpolation.nearest_count`` of each element of an int64 array."""
    import numpy as np
    target = np.asarray(target, dtype=np.int64)
    e = np.clip(target >> Q, 0, 40)
    lo, hi = np.int64(1) << e, (np.int64(1) << (e + 1)) - 1
    for _ in range(int(e.max(initial=0)) + 1):  # [2^e, 2^(e+1)) takes e + 1 halvings
        mid = (lo + hi + 1) // 2
        up = (lo < hi) & (log2_q16_array(mid) <= target)
        lo, hi = np.where(up, mid, lo), np.where((lo < hi) & ~up, mid - 1, hi)
    nxt = np.minimum(lo + 1, np.int64(1) << 41)
    above = (lo < np.int64(1) << 40) & (log2_q16_array(nxt) - target < target - log2_q16_array(lo))
    return np.where(target <= 0, 1, np.where(above, lo + 1, lo))


def _interpolated_configs(table: HeuristicTable, cands, shape: Shape, starts, coords, profile, fallback):
    """Per bucket (its first Sk and its coordinate): (nearest row index, whether it is at
    distance 0, block_kv index, S before the final cap), as ``selector._interpolate`` computes
    them."""
    import numpy as np
    bm, w, (x0, _, x2) = _work(shape)
    index = np.array([i for i, _ in cands], dtype=np.int64)
    fixed = np.array([abs(x0 - c[0]) + abs(x2 - c[2]) for _, c in cands], dtype=np.int64)
    row_sk = np.array([c[1] for _, c in cands], dtype=np.int64)
    coords = np.asarray(coords, dtype=np.int64)
    column = np.arange(len(cands), dtype=np.int64)
    k = min(NEIGHBOURS, len(cands))

    def nearest(dist):
        """The K least columns of each row of ``dist`` in order, equal distances in canonical
        row order (the selector's tie rule): one key of distance, then column, partitioned."""
        key = dist * len(cands) + column
        part = np.argpartition(key, k - 1, axis=-1)[..., :k]
        return np.take_along_axis(part, np.argsort(np.take_along_axis(key, part, axis=-1), axis=-1), axis=-1)

    # Outside the rows' Sk range every distance moves by the same amount from bucket to
    # bucket, so the neighbours stay those of the range's edge: only buckets inside it rank.
    below, above = coords <= row_sk.min(), coords >= row_sk.max()
    inside = ~(below | above)
    near = np.empty((len(coords), k), dtype=np.int64)
    near[below] = nearest(fixed + row_sk)
    near[above] = nearest(fixed - row_sk)
    near[inside] = nearest(fixed[None, :] + np.abs(coords[inside, None] - row_sk[None, :]))
    d = fixed[near] + np.abs(coords[:, None] - row_sk[near])
    weights = (1 << 32) // np.maximum(d, 1)
    nb = len(tunables.BLOCK_KV)
    has = np.array([[table.votes[i][j] is not None for j in range(nb)] for i in index.tolist()])[near]
    # The neighbours' row_votes parts, each (buckets, K, blocks): time ratio, log2 CTAs, S.
    time_votes, cta_votes, split_votes = (
        np.array([[v[which] if v else 0 for v in table.votes[i]] for i in index.tolist()], dtype=np.int64)[near]
        for which in (0, 1, 2))
    wt = weights[:, :, None] * has
    sums = [(wt * p).sum(axis=1) for p in (time_votes, cta_votes)]
    den = wt.sum(axis=1)
    scores = np.where(den > 0, sums[0] // np.maximum(den, 1), np.iinfo(np.int64).max)
    fit = np.array(fits_block_kv(shape.head_dim, bm, profile))
    fitted = np.where(fit[None, :], scores, np.iinfo(np.int64).max)
    none_fit = (fitted == np.iinfo(np.int64).max).all(axis=1)
    scores = np.where(none_fit[:, None], scores, fitted)
    # The least score, ties to the larger block: argmin over the blocks in reverse.
    j = nb - 1 - np.argmin(scores[:, ::-1], axis=1)
    slots = np.array(wave_slots(shape.head_dim, bm, fallback), dtype=np.int64)[j]
    pick = np.arange(len(j))
    log_waves = sums[1][pick, j] // den[pick, j] - log2_q16_array(slots)
    # Whole waves: any n of at least n_cap waves gives S >= MAX_SPLITS, so the search stops there.
    n_cap = tunables.MAX_SPLITS * w // slots + 2
    whole = np.maximum(1, nearest_counts(np.minimum(log_waves, log2_q16_array(n_cap))) * slots // w)
    # Below WAVE_ROUNDING_FROM: the S in [1, MAX_SPLITS] nearest in log2 (ties: the smaller).
    target = log_waves + log2_q16_array(slots) - log2_q16(w)
    nearest = np.abs(_split_logs()[None, :] - target[:, None]).argmin(axis=1) + 1
    splits = np.where(log_waves >= WAVE_ROUNDING_FROM, whole, nearest)
    # interpolation.finest_split_cap over the neighbours that timed the chosen block.
    row_sk = np.array([table.rows[i][0][7] for i in index.tolist()], dtype=np.int64)[near]
    keys = np.asarray(starts, dtype=np.int64)[:, None] * split_votes[pick, :, j] // row_sk
    cap = np.maximum(1, np.where(has[pick, :, j], keys, 0).max(axis=1))
    # interpolation.balance_splits, a function of S alone for this shape: looked up per S.
    even = np.array([balance_splits(s, w, fallback.sms, fallback.sm_balance_pct)
                     for s in range(tunables.MAX_SPLITS + 1)], dtype=np.int64)
    return index[near[:, 0]], d[:, 0] == 0, j, even[np.minimum(np.minimum(splits, cap), tunables.MAX_SPLITS)]


class KvLenLookup:
    """``select_shape(table, shape with kv_len=Sk, device, sms).config`` for every ``Sk``."""

    def __init__(self, shape: Shape, table: HeuristicTable | None, device_name, num_sms):
        check_domain(dataclasses.replace(shape, kv_len=1))
        profile, fallback = profiles_for(device_name, table, num_sms)
        bh = shape.batch * shape.kv_heads
        self.max_kv_len = min(MAX_DIM, 2**40 // bh)
        starts, coords = bucket_starts()
        cands = class_rows(table, shape)
        widest = dataclasses.replace(shape, kv_len=MAX_DIM)  # _finalize without the S cap
        if cands:
            near, zero, blocks, splits = _interpolated_configs(table, cands, shape, starts, coords, profile,
                                                               fallback)
            # A bucket's answer: its nearest row's config as it is at distance 0, else with the
            # interpolated block_kv and S; segments first, Config objects once per segment.
            answers = [(i, None) if z else (i, (tunables.BLOCK_KV[j], s)) for i, z, j, s in
                       zip(near.tolist(), zero.tolist(), blocks.tolist(), splits.tolist())]

            def make(answer):
                base = table.rows[answer[0]][1]
                if answer[1] is not None:
                    base = dataclasses.replace(base, block_kv=answer[1][0], num_splits=answer[1][1])
                return _finalize(base, widest, profile)
        else:
            splits, blocks = analytic_configs(shape, starts, fallback)
            answers = list(zip(splits.tolist(), blocks.tolist()))

            def make(answer):
                return _finalize(Config(answer[0], answer[1], 128, "blocks"), widest,
                                 profile or fallback)
        self.starts, self.configs, last = [], [], None
        for start, answer in zip(starts, answers):
            if answer != last:
                cfg = make(answer)
                if not self.configs or cfg != self.configs[-1]:
                    self.starts.append(start)
                    self.configs.append(cfg)
                last = answer
        # From this Sk on a segment's S is below the cap ceil(Sk / block_kv).
        self.uncapped_from = [(c.num_splits - 1) * c.block_kv + 1 for c in self.configs]
        self.hits = {}
        if table is not None:
            prefix = (DTYPE_CODES[shape.dtype], shape.head_dim, int(shape.causal), shape.batch,
                      shape.q_heads, shape.kv_heads, shape.q_len)
            for key, cfg in table.rows:
                if key[:7] == prefix:
                    self.hits[key[7]] = _finalize(cfg, dataclasses.replace(shape, kv_len=key[7]),
                                                  profile)
        self._capped = {}

    def config(self, kv_len: int) -> Config:
        if not 1 <= kv_len <= self.max_kv_len:
            raise ValueError(f"kv_len must be in [1, {self.max_kv_len}] for this shape, got {kv_len}")
        hit = self.hits.get(kv_len)
        if hit is not None:
            return hit
        i = bisect.bisect_right(self.starts, kv_len) - 1
        if kv_len >= self.uncapped_from[i]:
            return self.configs[i]
        cfg = self.configs[i]
        key = (i, max(1, ceil_div(kv_len, cfg.block_kv)))
        capped = self._capped.get(key)
        if capped is None:
            capped = self._capped[key] = dataclasses.replace(cfg, num_splits=key[1])
        return capped
