"""The paged call's knobs for one batch from a batch-class table (``batch_table``): a pure
function of the table and the batch, for a server to call when it captures a graph.

Among the table's rows of the batch's head configuration (dtype, head dim, Hq, Hkv, Sq) the
nearest class wins, by

    d = |log2 B - log2 B'| + |log2 len_max - log2 len_max'| + |log2 len_mean - log2 len_mean'|
        + PAGE_WEIGHT * |log2 page - log2 page'|

(a factor of two in any of them costs the same; the page size counts less, as pages of 64 cost
1-4% over a contiguous cache). The logarithms are ``selector.log2_q16``'s, integers in 16-bit
fixed point, so the exported C++ header (``export --batch-table``) finds the same class with
the same arithmetic. Equal distances go to the row that sorts first by (B, len_max,
len_mean, page size). A batch of equal lengths is the class with len_max == len_mean; it needs
no rule of its own. With no row of that head configuration, or none within
``MAX_CLASS_DISTANCE`` octaves, the knobs are the model's (live_model.h ``live_model_knobs``: the
fixed-plan point of the sweeps' space, the ``"auto"`` knobs or, at one CTA per SM, the one-wave
split count, whose launch a model of the persistent schedule finishes first on the batch's own
lengths) when the launch's CTAs per SM
are known, else ``live``'s ``"auto"`` rules (``live.resolve_knobs``); the reason says which.

Why the bound: held out in turn (``splitkv-tune cross-validate-batches`` on the rows of
``results/nvidia_h200/batches/batches.csv`` and ``batches_dense.csv``: each of their 50 batches
against a table of the others, less its own lengths at the other page size), the nearest
class's knobs had 9.9% geometric-mean regret and the ``"auto"`` rules 6.8%; taking the class
only within D octaves and ``"auto"`` beyond gave 6.8% for D below 1, 7.3% at 1, 7.5% at 1.5 and
9.3% at 2. So a class serves its own batch, and the same lengths at
another page size (0.5 octaves), not its neighbours: the knobs that win on one batch do not carry
over to a batch of another size or spread. The model carries over better: replayed on the
timed points of ``batches.csv``, ``batches_dense.csv`` and ``batches_split_plan.csv``
(``tools/plan_model.py rank``), its knobs had 2.3% geometric-mean regret on their 50 batches and
2.2% (max 6.6%) on the 12 held-out ones of ``holdout.csv``, where ``"auto"`` had 10.7% and 8.5%.
"""
from __future__ import annotations

import dataclasses

from splitkv_tune import _rules, batches, live
from splitkv_tune.interpolation import Q, log2_q16

PAGE_WEIGHT = 0.25
# The farthest class whose knobs a batch takes, in octaves of the distance (see the module).
MAX_CLASS_DISTANCE = 0.5
# The most CTAs per SM the model takes (rules.h kMaxCtasPerSm).
MAX_CTAS_PER_SM = _rules.LIVE_MODEL["max_ctas_per_sm"]
# d in integers: the page term once, the others PAGE_SCALE times, each log2 in 16-bit fixed point.
PAGE_SCALE = round(1 / PAGE_WEIGHT)
DISTANCE_ONE = PAGE_SCALE << Q
HEAD_COLUMNS = ["dtype", "head_dim", "q_heads", "kv_heads", "q_len"]
# Equal distances go to the row that sorts first by these.
TIE_COLUMNS = ["batch", "len_max", "len_mean", "page_size"]


@dataclasses.dataclass(frozen=True)
class LiveKnobs:
    """The knobs of one paged call and why; ``row``: the table row they came from, if any."""

    block_kv: int
    min_blocks_per_split: int
    max_splits: int
    merge: str
    reason: str
    row: dict | None = None
    split_plan: str = "fixed"

    def kwargs(self) -> dict:
        """The keyword arguments of ``splitkv_attention`` these knobs are."""
        return {"block_kv": self.block_kv, "min_blocks_per_split": self.min_blocks_per_split,
                "max_splits": self.max_splits, "merge": self.merge, "split_plan": self.split_plan}


def class_distance_q(row: dict, batch: int, len_max: int, len_mean: int, page_size: int) -> int:
    """The distance of a table row's class from a batch's (see the module), in units of
    ``1 / DISTANCE_ONE``."""
    return (PAGE_SCALE * (abs(log2_q16(row["batch"]) - log2_q16(batch))
                          + abs(log2_q16(row["len_max"]) - log2_q16(len_max))
                          + abs(log2_q16(row["len_mean"]) - log2_q16(len_mean)))
            + abs(log2_q16(row["page_size"]) - log2_q16(page_size)))


def class_distance(row: dict, batch: int, len_max: int, len_mean: int, page_size: int) -> float:
    """``class_distance_q`` in octaves.

    >>> row = dict(batch=16, len_max=65536, len_mean=5056, page_size=64)
    >>> class_distance(row, 16, 65536, 5056, 64), class_distance(row, 32, 65536, 5056, 16)
    (0.0, 1.5)
    """
    return class_distance_q(row, batch, len_max, len_mean, page_size) / DISTANCE_ONE


def max_class_distance_q() -> int:
    """``MAX_CLASS_DISTANCE`` in the units of ``class_distance_q``."""
    return round(MAX_CLASS_DISTANCE * DISTANCE_ONE)


def class_order(row: dict) -> tuple:
    """The order in which equal distances are broken: the head configuration, then
    ``TIE_COLUMNS``. The exported header lists its classes in this order and takes the first
    nearest."""
    return tuple(row[c] for c in HEAD_COLUMNS + TIE_COLUMNS)


def packed_rows(q_heads: int, kv_heads: int, q_len: int) -> int:
    """Query rows per (sequence, KV head) of a head configuration: Sq x the GQA group."""
    return q_len * (q_heads // kv_heads)


def _describe(batch: int, len_max: int, len_mean: int, page_size: int) -> str:
    return f"B={batch}, len_max={len_max}, len_mean={len_mean}, page {page_size}"


def select_live_knobs(table, *, dtype: str, head_dim: int, q_heads: int, kv_heads: int, q_len: int,
                      page_size: int, lengths, num_sms: int, ctas_per_sm: int | None = None) -> LiveKnobs:
    """The knobs of a paged call of this batch: the nearest class's in ``table`` (records of one
    GPU, ``batch_table.read_batch_table(path, gpu=...)``), else the model's on ``num_sms`` SMs
    holding ``ctas_per_sm`` CTAs of the paged kernel each (``live.launch_ctas_per_sm`` on the
    GPU), else, without ``ctas_per_sm``, the ``"auto"`` rules. ``lengths``: the live lengths
    (ints) or a ``batches`` text. ``ValueError`` naming the argument out of range (the ranges of
    ``rules.h``'s ``live_knob_args_ok`` and ``live_model_args_ok``), for a table of several
    GPUs, or for knobs the call would refuse."""
    lengths = batches.parse_lengths(lengths) if isinstance(lengths, str) else tuple(int(n) for n in lengths)
    if not lengths or min(lengths) < 0 or max(lengths) > _rules.MAX_KEYS:
        raise ValueError(f"lengths must be one or more live lengths in [0, {_rules.MAX_KEYS}] (padded slots are 0), "
                         f"got {lengths!r}")
    for name, value in (("kv_heads", kv_heads), ("q_len", q_len), ("page_size", page_size)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if not isinstance(q_heads, int) or q_heads < kv_heads or q_heads % kv_heads:
        raise ValueError(f"q_heads must be a multiple of kv_heads ({kv_heads}), got {q_heads!r}")
    if ctas_per_sm is not None and (not isinstance(ctas_per_sm, int) or isinstance(ctas_per_sm, bool)
                                    or not 1 <= ctas_per_sm <= MAX_CTAS_PER_SM):
        raise ValueError(f"ctas_per_sm must be None or an integer in [1, {MAX_CTAS_PER_SM}] (CTAs of the paged "
                         f"kernel per SM), got {ctas_per_sm!r}")
    summary = batches.describe(lengths)
    # A class of empty sequences is as near as one of single keys: distances are in log2.
    batch, len_max, len_mean = summary["batch"], max(1, summary["max"]), max(1, summary["total"] // summary["batch"])
    q_rows = packed_rows(q_heads, kv_heads, q_len)
    _rules.check_live_knob_args(batch, kv_heads, q_rows, num_sms)  # the C++ header's domain too
    gpus = sorted({r["gpu"] for r in table})
    if len(gpus) > 1:
        raise ValueError(f"the batch table holds rows of several GPUs ({', '.join(gpus)}): read it with "
                         "read_batch_table(path, gpu=...)")
    head = (dtype, head_dim, q_heads, kv_heads, q_len)
    rows = [r for r in table if tuple(r[c] for c in HEAD_COLUMNS) == head]
    config = f"{dtype} D{head_dim} Hq{q_heads}/Hkv{kv_heads} Sq{q_len}"

    def beyond_the_classes(why: str) -> LiveKnobs:
        if ctas_per_sm is not None:
            return model_knobs(lengths, kv_heads, q_rows, num_sms, ctas_per_sm, why)
        bkv, min_blocks, bound = live.resolve_knobs(batch, head_dim, kv_heads, q_rows, num_sms)
        return LiveKnobs(bkv, min_blocks, bound, "auto",
                         f"{why}; no ctas_per_sm for the model: the live defaults: "
                         f"{live.explain_knobs(batch, head_dim, kv_heads, q_rows, num_sms)}")

    if not rows:
        return beyond_the_classes(f"no batch-table row for {config} (of its {len(table)} rows)" if table
                             else f"no batch table for {config}")
    distance_q, row = min(((class_distance_q(r, batch, len_max, len_mean, page_size), r) for r in rows),
                          key=lambda pair: (pair[0], class_order(pair[1])))
    distance = distance_q / DISTANCE_ONE
    if distance_q > max_class_distance_q():
        return beyond_the_classes(f"batch table, {config}: the nearest class of {len(rows)} to "
                             f"{_describe(batch, len_max, len_mean, page_size)} is {row['lengths']} at distance "
                             f"{distance:.2f}, more than {MAX_CLASS_DISTANCE} (batch_select.MAX_CLASS_DISTANCE)")
    # The reader checked the row; resolve_knobs checks knobs from a table built any other way.
    bkv, min_blocks, bound = live.resolve_knobs(batch, head_dim, kv_heads, q_rows, num_sms, row["block_kv"],
                                                row["min_blocks_per_split"], row["max_splits"])
    runner_up = ("no runner-up" if row["runner_up_us"] is None
                 else f"runner-up {row['runner_up_us']:.1f} µs at block_kv={row['runner_up_block_kv']} "
                      f"min_blocks_per_split={row['runner_up_min_blocks_per_split']} "
                      f"max_splits={row['runner_up_max_splits']} split_plan={row['runner_up_split_plan']}")
    reason = (f"batch table, {config}: the nearest class of {len(rows)} to "
              f"{_describe(batch, len_max, len_mean, page_size)} is "
              f"{_describe(row['batch'], row['len_max'], row['len_mean'], row['page_size'])} "
              f"({row['lengths']}, distance {distance:.2f}), won at {row['median_us']:.1f} µs ({runner_up}; "
              f"noise margin {row['noise_margin']:.1%}, {row['n_trials']} candidates, {row['source']})")
    if row["split_plan"] == "load_aware":
        reason += (f"; its launches choose min_blocks_per_split among {min_blocks} x 1, 2, 4, ... from the "
                   "live lengths (split_plan='load_aware')")
    return LiveKnobs(bkv, min_blocks, bound, row["merge"], reason, row, row["split_plan"])


def model_knobs(lengths, kv_heads: int, packed_rows: int, num_sms: int, ctas_per_sm: int, why: str) -> LiveKnobs:
    """The model's knobs (live_model.h ``live_model_knobs``) for these live lengths, the reason
    starting with ``why``: block_kv 64, the call's default merge, the fixed split plan."""
    min_blocks, bound, score = _rules.live_model_knobs(list(lengths), kv_heads, packed_rows, num_sms, ctas_per_sm)
    model = _rules.LIVE_MODEL
    wave = _rules.live_model_wave_candidate(list(lengths), kv_heads, packed_rows, num_sms, ctas_per_sm)
    splits = (*model["max_splits"], wave) if wave else model["max_splits"]
    return LiveKnobs(_rules.LIVE_DEFAULTS["block_kv"], min_blocks, bound, "auto",
                     f"{why}: the model's knobs (live_model.h live_model_knobs on {num_sms} SMs x {ctas_per_sm} CTAs): "
                     f"min_blocks_per_split={min_blocks} max_splits={bound}, the least estimated finish "
                     f"({score}/16 of a block's time) among min_blocks_per_split {model['min_blocks_per_split']} x "
                     f"max_splits {splits}{' (the last: the one-wave count)' if wave else ''} and the auto knobs")
