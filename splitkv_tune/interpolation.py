"""The selector interpolation's integer arithmetic: the fixed-point log2 that the Python rule,
the run-time lookup and the exported C++ header share, what a table row tells the interpolation
about each ``block_kv`` (:func:`row_votes`), and the whole-wave split count.

``selector`` holds the rule that puts these together (its module docstring states it).
"""
from __future__ import annotations

import math

from splitkv_tune import tunables
from splitkv_tune.analytic import residency
from splitkv_tune.gpus import GpuProfile
from splitkv_tune.table_schema import PER_BLOCK_KV_COLUMNS, missing_cell
from splitkv_tune.tunables import Config, smem_bytes

Q = 16  # fractional bits of the fixed-point log2


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


def time_ns(us: float) -> int:
    """A table time in whole nanoseconds (at least 1): ``floor(us * 1000 + 0.5)``."""
    return max(1, math.floor(us * 1000 + 0.5))


def row_votes(rec: dict, cfg: Config, ctas_per_split: int) -> tuple:
    """What a table row tells the interpolation about each ``block_kv`` b (``tunables.BLOCK_KV``
    order): ``(log2_q16(its fastest time at b) - log2_q16(its fastest time), log2_q16(that
    trial's S * ctas_per_split), that S)`` from the ``best_us_kv<b>`` / ``best_splits_kv<b>``
    columns (times in :func:`time_ns`), ``None`` for a b it did not time. A row without those
    columns (an older table) knows only its winner: ``(0, log2_q16(S * ctas_per_split), S)`` at
    its b.
    """
    timed = [(None, None) if missing_cell(rec.get(us)) else (rec[us], rec[splits])
             for us, splits in PER_BLOCK_KV_COLUMNS]
    if all(t is None for t, _ in timed):
        timed = [(1.0, cfg.num_splits) if b == cfg.block_kv else (None, None) for b in tunables.BLOCK_KV]
    fastest = log2_q16(min(time_ns(t) for t, _ in timed if t is not None))
    return tuple(None if t is None else (log2_q16(time_ns(t)) - fastest, log2_q16(int(sp) * ctas_per_split), int(sp))
                 for t, sp in timed)


def finest_split_cap(bucket_kv_len: int, neighbour_splits) -> int:
    """The interpolated S's ceiling: no more splits than keep ``bucket_kv_len`` (the first Sk of
    the shape's bucket) at the keys per split of the finest-split neighbour,
    ``max(1, floor(bucket_kv_len * S_i / Sk_i))`` at its largest over ``(S_i, Sk_i)`` pairs.
    Waves carried over from rows of larger B*Hkv would otherwise split a small batch into
    slivers (H200, B = 1, Hkv = 1, Sk = 50000 from GQA-8 rows of 4 KV heads: S = 121, where S = 128
    ran 17% behind the best and S = 48 within 3%).

    >>> finest_split_cap(50000, [(29, 65536), (29, 32768), (16, 65536)])
    44
    >>> finest_split_cap(100, [(4, 65536)])
    1
    """
    return max(1, max(bucket_kv_len * s // sk for s, sk in neighbour_splits))


def nearest_count(target: int) -> int:
    """The whole number of waves for a fixed-point ``target``: the largest n >= 1 with
    ``log2_q16(n) <= target``, or n + 1 when its ``log2_q16`` is nearer (ties: n); at most
    ``2**41 - 1``. (Above ``2**16`` neighbouring integers can share a ``log2_q16``: the largest
    of such a run is the one taken.)

    >>> nearest_count(log2_q16(3)), nearest_count(-5000), nearest_count(log2_q16(5) + 100)
    (3, 1, 5)
    """
    if target <= 0:
        return 1
    e = min(target >> Q, 40)
    lo, hi = 1 << e, (1 << (e + 1)) - 1  # the largest n with log2_q16(n) <= target is in here
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if log2_q16(mid) <= target else (lo, mid - 1)
    if lo < 1 << 40 and log2_q16(lo + 1) - target < target - log2_q16(lo):
        return lo + 1
    return lo


def choose_block_kv(scores: list) -> int:
    """Index into ``tunables.BLOCK_KV`` of the least score (``None``: not a candidate); ties
    go to the larger block."""
    best = None
    for j, score in enumerate(scores):
        if score is not None and (best is None or score <= scores[best]):
            best = j
    return best


# log2_q16(3/4): from three quarters of a wave on, the interpolated S fills whole waves.
WAVE_ROUNDING_FROM = log2_q16(3) - (2 << Q)


def fits_block_kv(head_dim: int, block_m: int, profile: GpuProfile | None) -> list[bool]:
    """Per ``tunables.BLOCK_KV``: whether the interpolation may choose it (the smallest always;
    the others when the profile is unknown or their shared memory fits its per-block limit)."""
    return [j == 0 or profile is None or smem_bytes(head_dim, b, block_m) <= profile.smem_per_block
            for j, b in enumerate(tunables.BLOCK_KV)]


def wave_slots(head_dim: int, block_m: int, profile: GpuProfile) -> list[int]:
    """Per ``tunables.BLOCK_KV``: CTAs one wave of the split kernel holds on the GPU,
    ``SMs * analytic.residency``."""
    return [profile.sms * residency(head_dim, b, block_m, profile) for b in tunables.BLOCK_KV]


def splits_from_waves(log_waves: int, slots: int, ctas_per_split: int) -> int:
    """S before the cap for a wave count in fixed point: at ``WAVE_ROUNDING_FROM`` waves or
    more, whole waves (:func:`nearest_count`) times ``slots`` CTAs over the shape's CTAs a
    split; below, the S nearest in log2 to that many waves' CTAs (ties: the smaller)."""
    if log_waves >= WAVE_ROUNDING_FROM:
        return max(1, nearest_count(log_waves) * slots // ctas_per_split)
    target = log_waves + log2_q16(slots) - log2_q16(ctas_per_split)
    best = 1
    for s in range(2, tunables.MAX_SPLITS + 1):
        if abs(log2_q16(s) - target) < abs(log2_q16(best) - target):
            best = s
    return best


def balance_splits(splits: int, ctas_per_split: int, sms: int, balance_pct: int) -> int:
    """The interpolated S, raised to the first S' in (S, min(2S, MAX_SPLITS)] whose CTAs the SMs
    share evenly when they do not share S's: CTAs c spread over ``sms`` SMs are even when they fit
    one CTA per SM or their mean per SM is at least ``balance_pct``% of the busiest SM's
    ``ceil(c / sms)``. ``balance_pct`` 0 (a GPU's profile without ``sm_balance_pct``) keeps S.

    Why: the rows a shape is interpolated from can sit on either side of a whole number of CTAs
    per SM, and the waves they vote for then put one CTA more on a few SMs: H200, bf16, head dim
    128, B 6 x 8 KV heads, Sq 4, Sk 6000 (48 CTAs a split, block_kv 64): S3 puts 144 CTAs on 132
    SMs and ran 13.4% behind the shape's best, S5 (240 CTAs, 0.91 of two a SM) 1.3%. The
    threshold is the profile's, chosen by leave-one-out over each GPU's table (on the H100 no
    threshold did better than none: docs/PERFORMANCE.md).

    >>> balance_splits(3, 48, 132, 85), balance_splits(3, 48, 132, 0), balance_splits(2, 48, 132, 85)
    (5, 3, 2)
    """
    def even(s: int) -> bool:
        ctas = s * ctas_per_split
        return ctas <= sms or 100 * ctas >= balance_pct * sms * -(-ctas // sms)

    if balance_pct <= 0 or even(splits):
        return splits
    for s in range(splits + 1, min(2 * splits, tunables.MAX_SPLITS) + 1):
        if even(s):
            return s
    return splits
