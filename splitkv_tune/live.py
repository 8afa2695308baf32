"""The paged / variable-length call of ``splitkv_attention``: its checks, the plan's knobs and
the launch.

Each sequence ``b`` of the batch is split by its own live length, on the device, in every CTA
(``rules.h``'s ``live_splits``, see :mod:`splitkv_tune.plan`): nothing is planned on the host
and nothing is read back, so one captured CUDA graph replays any mix of lengths up to the
cache's capacity. The knobs are fixed per call signature (and so at capture):

* ``block_kv`` (keys per pipeline tile): ``"auto"`` is :data:`DEFAULT_BLOCK_KV`.
* ``min_blocks_per_split``: a sequence gets one split per this many blocks of ``block_kv``
  keys; ``"auto"`` is :func:`default_min_keys_per_split`'s keys' worth.
* ``split_plan``: ``"fixed"`` uses ``min_blocks_per_split`` as given; ``"load_aware"`` lets
  each launch with ``cache_seqlens`` choose it from the live lengths (the load-aware plan,
  :func:`splitkv_tune.plan.plan_min_blocks`): that knob times 1, 2, 4, ..., whichever the
  plan's estimate of the schedule finishes first. It wins on batches of similar lengths (16 x
  8K: 7-9% faster, 4 x 32K: 16-18%) and costs a launch 0.2-0.4 µs where the knob's items fit
  the GPU's CTAs and more where it estimates (2-3 µs at 16-32 sequences, 4.6-6.1 µs at 256-300 on
  an H100), so it is not the default (the batch table chooses it per class); a sequence's
  bits then depend on the other lengths.
* ``max_splits``: the bound on any sequence's splits, which sizes the workspace (the grid is
  persistent, ``tile_scheduler.h``); ``"auto"`` is :func:`default_max_splits` (enough splits
  for one sequence to fill the GPU twice over, fewer in a large batch).
"""
from __future__ import annotations

import functools

import torch

from splitkv_tune import _rules, plan, tunables
from splitkv_tune.tunables import Config, Shape

# The "auto" knobs are rules.h's (the exported C++ selector falls back to them too); their
# constants, as _rules exposes them:
# * block_kv: DEFAULT_BLOCK_KV.
# * keys per split: between MIN_KEYS_PER_SPLIT, scaled with the batch's (sequence, KV head, query
#   tile) count as if each sequence held TYPICAL_LEN keys (docs/PERFORMANCE.md, the paged batches).
# * max_splits: keeps the plan's capacity (batch x KV heads x query tiles x max_splits work
#   items, which sizes the workspace) within CAPACITY_ITEMS_PER_SM per SM: in a large batch more
#   splits of its long sequences measured slower (128K + 255 x 512: 262.6 µs at 16 splits, 276.4
#   at 64, docs/PERFORMANCE.md). Never below MIN_MAX_SPLITS, nor below the largest power of two
#   within half a wave of one sequence's CTAs, so that a long sequence in a large batch still
#   splits, over half the GPU when the batch has few KV heads (the batch sweep, docs/PERFORMANCE.md).
_DEFAULTS = _rules.LIVE_DEFAULTS
DEFAULT_BLOCK_KV = _DEFAULTS["block_kv"]
WAVES_PER_SEQUENCE = _DEFAULTS["waves_per_sequence"]
MIN_KEYS_PER_SPLIT = tuple(_DEFAULTS["min_keys_per_split"])
TYPICAL_LEN = _DEFAULTS["typical_len"]
CAPACITY_ITEMS_PER_SM = _DEFAULTS["capacity_items_per_sm"]
MIN_MAX_SPLITS = _DEFAULTS["min_max_splits"]


def default_min_keys_per_split(batch: int, kv_heads: int, packed_rows: int, num_sms: int) -> int:
    """The ``"auto"`` minimum keys per split (rules.h ``live_min_keys_per_split``): what
    splitting ``batch`` sequences of ``TYPICAL_LEN`` keys over ``WAVES_PER_SEQUENCE`` waves of
    ``num_sms`` CTAs would give each CTA, rounded up to a power of two within
    ``MIN_KEYS_PER_SPLIT``. A small batch splits its sequences finely; a large one keeps its
    short sequences whole, so that its CTAs are few and its long sequences still split up to
    ``max_splits``.

    >>> [default_min_keys_per_split(b, 8, 4, 132) for b in (1, 8, 16, 256)]
    [256, 512, 1024, 1024]
    """
    return _rules.live_min_keys_per_split(batch, kv_heads, packed_rows, num_sms)


def default_max_splits(batch: int, kv_heads: int, packed_rows: int, num_sms: int) -> int:
    """The ``"auto"`` bound on splits (rules.h ``live_max_splits``): ``WAVES_PER_SEQUENCE``
    waves of ``num_sms`` CTAs for one sequence on its own, lowered for a large batch so that its
    capacity stays within ``CAPACITY_ITEMS_PER_SM`` work items per SM, but not below the floor
    (``MIN_MAX_SPLITS``, or the largest power of two within half a wave of one sequence's CTAs
    when that is more); at most ``tunables.MAX_SPLITS``.

    >>> [default_max_splits(b, 8, 4, 132) for b in (1, 16, 32, 256)]
    [33, 33, 16, 16]
    >>> default_max_splits(1, 1, 8, 132), default_max_splits(1, 32, 64, 132), default_max_splits(256, 1, 8, 132)
    (128, 9, 64)
    """
    return _rules.live_max_splits(batch, kv_heads, packed_rows, num_sms)


def explain_knobs(batch: int, head_dim: int, kv_heads: int, packed_rows: int, num_sms: int) -> str:
    """Why ``resolve_knobs`` picks its ``"auto"`` knobs for this batch, in one line.

    >>> explain_knobs(16, 128, 8, 4, 132).split("; ")[1]
    'keys per split 1024: 128 (sequence, KV head, query tile) CTAs of 2048 keys over 2 waves of 132 SMs, within [256, 1024]'
    """
    bkv, min_blocks, bound = resolve_knobs(batch, head_dim, kv_heads, packed_rows, num_sms)
    tiles = kv_heads * _rules.num_m_blocks(packed_rows)
    one_sequence, capacity_cap, floor = _rules.live_max_splits_bounds(batch, kv_heads, packed_rows, num_sms)
    low, high = MIN_KEYS_PER_SPLIT
    return (f"block_kv {bkv} (the paged default); keys per split {min_blocks * bkv}: {batch * tiles} (sequence, "
            f"KV head, query tile) CTAs of {TYPICAL_LEN} keys over {WAVES_PER_SEQUENCE} waves of {num_sms} SMs, "
            f"within [{low}, {high}]; max_splits {bound}: the least of {one_sequence} ({WAVES_PER_SEQUENCE} "
            f"waves for one sequence), {capacity_cap} (at most {CAPACITY_ITEMS_PER_SM} work items per SM, but at "
            f"least {floor}: {MIN_MAX_SPLITS} or a power of two within half a wave of one sequence) and "
            f"{tunables.MAX_SPLITS}; with split_plan='load_aware' each launch chooses min_blocks_per_split among "
            f"{', '.join(str(min_blocks << j) for j in range(_rules.live_plan_choices(min_blocks, bkv)))} "
            f"from the live lengths")


@functools.lru_cache(maxsize=1024)
def resolve_knobs(batch: int, head_dim: int, kv_heads: int, packed_rows: int, num_sms: int, block_kv="auto",
                  min_blocks_per_split="auto", max_splits="auto") -> tuple[int, int, int]:
    """``(block_kv, min_blocks_per_split, max_splits)`` with every ``"auto"`` filled and each
    checked; ``ValueError`` naming the knob.

    >>> resolve_knobs(16, 128, 8, 4, 132)
    (64, 16, 33)
    >>> resolve_knobs(1, 256, 8, 4, 132, block_kv=128)
    Traceback (most recent call last):
    ...
    ValueError: block_kv must be one of (32, 64) at head_dim 256, got 128
    """
    if block_kv == "auto":
        block_kv = DEFAULT_BLOCK_KV
    tunables.check_block_kv_at(block_kv, head_dim)
    if min_blocks_per_split == "auto":
        min_blocks_per_split = max(1, default_min_keys_per_split(batch, kv_heads, packed_rows, num_sms) // block_kv)
    elif isinstance(min_blocks_per_split, str):
        raise ValueError(f"min_blocks_per_split must be a positive integer or 'auto', got {min_blocks_per_split!r}")
    if max_splits == "auto":
        max_splits = default_max_splits(batch, kv_heads, packed_rows, num_sms)
    plan.check_plan_knobs(block_kv, min_blocks_per_split, max_splits)
    return block_kv, min_blocks_per_split, max_splits


def check_qkv(q, k, v) -> tuple[int, int]:
    """q ``(B, Sq, Hq, D)`` against page pools or a contiguous cache k, v; returns
    ``(kv_heads, group)``."""
    from splitkv_tune.ops import _DTYPES, _MAX_GRID_Y, check_tensors

    check_tensors(q, k, v, "k_cache", "v_cache")
    batch, q_len, q_heads, head_dim = (int(x) for x in q.shape)
    kv_heads = int(k.shape[2])
    Shape(_DTYPES[q.dtype], head_dim, batch, q_heads, kv_heads, q_len, 1).validate()
    if batch * kv_heads > _MAX_GRID_Y:
        raise ValueError(f"batch * kv_heads must be at most {_MAX_GRID_Y}, got {batch * kv_heads}")
    return kv_heads, q_heads // kv_heads


def workspace_size(q: torch.Tensor, max_splits: int) -> int:
    """Bytes of workspace one paged / variable-length call with this ``max_splits`` bound needs
    (0 for 1): the partials of every sequence's splits, sized from the bound, and the slot of
    the load-aware plan's knob."""
    plan.check_max_splits(max_splits)
    batch, q_len, q_heads, head_dim = (int(x) for x in q.shape)
    return _rules.workspace_sections(max_splits, batch, q_heads, q_len, head_dim, live=True)[2]


def launch_grid(q: torch.Tensor, kv_heads: int, block_kv: int, min_blocks_per_split: int, max_splits: int) -> int:
    """CTAs of a load-aware paged launch (``split_plan="load_aware"``, its ``min_blocks_per_split``
    resolved) of q's shape with these knobs on q's device: the persistent grid
    (as many CTAs as the GPU holds at once, fewer when the batch's work items are fewer), among
    which the plan divides the batch (``reference.splitkv_attention_ref(..., plan_ctas=...)``)."""
    from splitkv_tune.ops import _DTYPES, _extension

    batch, q_len, q_heads, head_dim = (int(x) for x in q.shape)
    plan.check_plan_knobs(block_kv, min_blocks_per_split, max_splits)
    return _extension().live_grid(q.device.index, _rules.DTYPE_CODES[_DTYPES[q.dtype]], head_dim, batch, kv_heads,
                                  q_len * (q_heads // kv_heads), block_kv, max_splits,
                                  _rules.live_plan_choices(min_blocks_per_split, block_kv))


def launch_ctas_per_sm(dtype: str, head_dim: int, batch: int, q_heads: int, kv_heads: int, q_len: int,
                       device: int | None = None) -> int:
    """CTAs of the fixed-plan paged kernel at the default block_kv that one SM of ``device`` (the
    current CUDA device by default) holds for a batch of this size and heads (its shared memory
    grows with the batch): the ``ctas_per_sm`` of ``batch_select.select_live_knobs``. Needs the
    extension and the GPU."""
    from splitkv_tune.ops import _device_info, _extension

    Shape(dtype, head_dim, batch, q_heads, kv_heads, q_len, 1).validate()
    index = torch.cuda.current_device() if device is None else device
    code = _rules.DTYPE_CODES[dtype]
    # A capacity beyond any grid, so that the grid is the GPU's residency.
    grid = _extension().live_grid(index, code, head_dim, batch, 1, q_len * (q_heads // kv_heads),
                                  _rules.LIVE_DEFAULTS["block_kv"], _rules.MAX_LIVE_CTAS, 1)
    return grid // _device_info(index)[1]


@torch.compiler.assume_constant_result
def _launch_knobs(device_index: int, dtype: str, batch: int, head_dim: int, kv_heads: int, q_len: int, group: int,
                  capacity: int, block_kv, min_blocks_per_split, max_splits, split_plan: str, uniform: bool,
                  merge: str) -> tuple[int, int, int, bool, int]:
    # The call's signature alone decides these (evaluated once at trace time under torch.compile):
    # (block_kv, min_blocks_per_split, launch splits, fused merge, the plan's choices).
    from splitkv_tune.ops import _device_info, resolve_merge

    bkv, min_blocks, bound = resolve_knobs(batch, head_dim, kv_heads, q_len * group, _device_info(device_index)[1],
                                           block_kv, min_blocks_per_split, max_splits)
    splits = _rules.live_splits(capacity, bkv, min_blocks, bound) if uniform else bound
    load_aware = plan.check_split_plan(split_plan) == "load_aware" and not uniform
    choices = _rules.live_plan_choices(min_blocks, bkv) if load_aware else 1
    shape = Shape(dtype, head_dim, 1, kv_heads * group, kv_heads, q_len, capacity)
    return bkv, min_blocks, splits, resolve_merge(shape, Config(num_splits=splits), merge) == "fused", choices


def launch_args(q, k, v, *, cache_seqlens, block_table, causal, block_kv, min_blocks_per_split, max_splits,
                split_plan, num_splits, split_policy, reduce_threads, merge, check_inputs) -> tuple:
    """Checks one paged / variable-length call (see ``splitkv_attention``) but its data (the
    lengths and the pages, ``plan.check_live_values``) and returns the launch arguments after
    ``softmax_scale``, then the cache's capacity: ``(splits, block_kv, reduce_threads, policy
    code, fused, min_blocks_per_split, plan choices, capacity)``. Without ``cache_seqlens``
    every sequence holds the cache's whole capacity: one split count for the batch, from the
    plan, and the knob as resolved. A function of the call's signature alone (each tensor's type,
    dtype, device, shape and strides; each other argument with its type), so a caller may keep
    its result per signature, as the extension's eager paged call does."""
    from splitkv_tune.ops import _DTYPES

    kv_heads, group = check_qkv(q, k, v)
    if not (isinstance(num_splits, str) and num_splits == "auto"):
        raise ValueError("num_splits applies to equal-length batches; a paged or variable-length batch is "
                         "split per sequence: pass max_splits (and min_blocks_per_split) instead")
    plan.check_live_split_policy(split_policy)
    if not isinstance(check_inputs, bool):
        raise TypeError(f"check_inputs must be True or False, got {check_inputs!r}")
    _, capacity = plan.check_live_args(q, k, cache_seqlens, block_table)
    q_len, head_dim = int(q.shape[1]), int(q.shape[3])
    knobs = {"block_kv": block_kv, "min_blocks_per_split": min_blocks_per_split, "max_splits": max_splits}
    block_kv, min_blocks_per_split, max_splits = (tunables.integer_or_auto(n, v) for n, v in knobs.items())
    bkv, min_blocks, splits, fused, choices = _launch_knobs(
        q.device.index, _DTYPES[q.dtype], int(q.shape[0]), head_dim, kv_heads, q_len, group, capacity, block_kv,
        min_blocks_per_split, max_splits, split_plan, cache_seqlens is None, merge)
    threads = 128 if reduce_threads == "auto" else reduce_threads
    Config(reduce_threads=threads).validate()
    policy = tunables.policy_codes()["blocks"]
    return splits, bkv, threads, policy, fused, 1 if cache_seqlens is None else min_blocks, choices, capacity
