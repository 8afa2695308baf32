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
from splitkv_tune.selector import (DTYPE_CODES, NEIGHBOURS, Q, SK_DROP_BITS, HeuristicTable, _finalize,
                                   _work, check_domain, class_rows, log2_q16, profiles_for, sk_coord)
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


def _interpolated_splits(cands, shape: Shape, coords):
    """Per bucket coordinate: (nearest row index, whether it is at distance 0, interpolated S
    before the cap), as ``selector._interpolate`` computes them."""
    import numpy as np
    _, w, (x0, _, x2) = _work(shape)
    index = np.array([i for i, _, _ in cands], dtype=np.int64)
    fixed = np.array([abs(x0 - c[0]) + abs(x2 - c[2]) for _, c, _ in cands], dtype=np.int64)
    row_sk = np.array([c[1] for _, c, _ in cands], dtype=np.int64)
    log_ctas = np.array([lc for _, _, lc in cands], dtype=np.int64)
    dist = fixed[None, :] + np.abs(np.asarray(coords, dtype=np.int64)[:, None] - row_sk[None, :])
    # Stable: equal distances keep canonical row order, the selector's tie rule.
    near = np.argsort(dist, axis=1, kind="stable")[:, :NEIGHBOURS]
    d = np.take_along_axis(dist, near, axis=1)
    weights = (1 << 32) // np.maximum(d, 1)
    target = (weights * log_ctas[near]).sum(axis=1) // weights.sum(axis=1) - log2_q16(w)
    # log2_q16 rises with S, so the nearest S in [1, cap] is min(nearest S in [1, 128], cap).
    splits = np.abs(_split_logs()[None, :] - target[:, None]).argmin(axis=1) + 1
    return index[near[:, 0]], d[:, 0] == 0, splits


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
            near, zero, splits = _interpolated_splits(cands, shape, coords)
            # A bucket's answer: its nearest row's config, with the interpolated S unless the
            # row is at distance 0; segments first, Config objects once per segment.
            answers = [(i, None if z else s) for i, z, s in
                       zip(near.tolist(), zero.tolist(), splits.tolist())]
            bases = {i: _finalize(table.rows[i][1], widest, profile) for i, _ in set(answers)}

            def make(answer):
                base = bases[answer[0]]
                return base if answer[1] is None else dataclasses.replace(base, num_splits=answer[1])
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
