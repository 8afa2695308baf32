"""Other projects' split-count rules, applied to this kernel, as baselines for ``evaluate``.

Each function returns a :class:`Config` of our kernel (``block_kv=128``, 128 reduce threads,
``blocks`` policy, as :func:`space.fa2_config` does) whose ``num_splits`` is the other rule's
choice for the shape, capped to what our kernel runs (``<= 128`` and ``<= ceil(Sk / 128)``).
They are our implementations of the rules as their public code states them:

* **FlashAttention-2** (``flash_api.cpp``): :func:`space.fa2_config`.
* **FlashAttention-3, varlen** (``hopper/heuristics.h`` ``num_splits_heuristic``, then the
  varlen scheduler's ``prepare_varlen_num_blocks``): a static split count from wave
  efficiency over the packed-GQA tiles of FA3's SM90 tile sizes, lowered per sequence to
  ``ceil(n_blocks / blocks_per_sm)`` with ``blocks_per_sm = ceil(1.1 * total tiles * Hkv / SMs)``.
* **SGLang** (``get_num_kv_splits`` of the Triton decode backend, dynamic mode, equal
  sequence lengths, ``max_kv_splits = 8``): the split budget grows with ``log2(Sk / 64)``
  times the SM count over the grid of (sequence, query token, head group) programs.
"""
from __future__ import annotations

import math

from splitkv_tune import space, tunables
from splitkv_tune.tunables import Config, Shape, ceil_div

BASELINE_BLOCK_KV = 128
SGLANG_MAX_KV_SPLITS = 8  # SGLANG_TRITON_ATTENTION_NUM_KV_SPLITS default
FA3_L2_BYTES = 50 * 1024 * 1024  # the L2 size FA3's heuristic assumes


def _ours(shape: Shape, splits: int) -> Config:
    cap = min(tunables.MAX_SPLITS, ceil_div(shape.kv_len, BASELINE_BLOCK_KV))
    return Config(max(1, min(splits, cap)), BASELINE_BLOCK_KV, 128, "blocks")


def fa3_tile(shape: Shape) -> tuple[int, int]:
    """FA3's SM90 (kBlockM, kBlockN) for a 16-bit shape without a local window or softcap.

    >>> fa3_tile(Shape("bf16", 128, 1, 32, 8, 1, 4096)), fa3_tile(Shape("bf16", 64, 1, 8, 8, 1, 64))
    ((64, 176), (192, 192))
    """
    if shape.head_dim <= 64:
        return 192, 128 if shape.causal else 192
    one_warpgroup = shape.head_dim == 128 and shape.packed_rows <= 64
    return (64 if one_warpgroup else 128), 128 if shape.causal else 176


def fa3_static_splits(total_mblocks: int, num_sms: int, n_blocks: int, m_blocks: int,
                      kv_head_bytes: int, causal: bool, max_splits: int = 128) -> int:
    """FA3's ``num_splits_heuristic``: 1 when the tiles nearly fill the GPU (unless one KV
    head overflows L2 and the queries walk it twice), else the fewest splits within 85% of
    the best wave efficiency."""
    if total_mblocks >= 0.8 * num_sms:
        if kv_head_bytes > FA3_L2_BYTES and m_blocks >= 2 * num_sms and not causal:
            return min(ceil_div(kv_head_bytes, FA3_L2_BYTES), max_splits)
        return 1
    if n_blocks <= 4:
        return 1
    limit = min(max_splits, num_sms, n_blocks)
    eff = []
    for s in range(1, limit + 1):
        waves = total_mblocks * s / num_sms
        eff.append(waves / math.ceil(waves))
    best = max(eff)
    return next(s for s, e in enumerate(eff, 1) if e >= 0.85 * best)


def fa3_config(shape: Shape, num_sms: int) -> Config:
    """FlashAttention-3's varlen split count (packed GQA) on our kernel.

    >>> fa3_config(Shape("bf16", 128, 1, 32, 8, 1, 16384), 132).num_splits
    14
    >>> fa3_config(Shape("bf16", 128, 64, 32, 8, 1, 16384), 132).num_splits
    1
    """
    block_m, block_n = fa3_tile(shape)
    n_blocks = ceil_div(shape.kv_len, block_n)
    m_blocks = ceil_div(shape.packed_rows, block_m)
    kv_head_bytes = shape.kv_len * 2 * shape.head_dim * 2
    static = fa3_static_splits(shape.batch * shape.kv_heads * m_blocks, num_sms, n_blocks,
                               m_blocks, kv_head_bytes, shape.causal)
    total_blocks = shape.batch * m_blocks * n_blocks
    blocks_per_sm = math.ceil(total_blocks * 1.1 * shape.kv_heads / num_sms)
    return _ours(shape, max(min(ceil_div(n_blocks, blocks_per_sm), static), 1))


def sglang_config(shape: Shape, num_sms: int) -> Config:
    """SGLang's Triton-decode split count (every sequence ``kv_len`` long, each of the
    ``q_len`` query tokens a program row like a speculative draft token) on our kernel.

    >>> sglang_config(Shape("bf16", 128, 1, 32, 8, 1, 16384), 132).num_splits
    8
    >>> sglang_config(Shape("bf16", 128, 64, 32, 32, 1, 4096), 132).num_splits
    1
    """
    ext = max(math.log2(shape.kv_len / 64.0), 1.0) if shape.kv_len > 0 else 1.0
    budget = int(num_sms * ext)
    group = shape.group
    rows = shape.batch * shape.q_len
    grid = rows * shape.q_heads if group == 1 else rows * ceil_div(shape.q_heads, min(16, group))
    max_splits = min(ceil_div(budget, grid), SGLANG_MAX_KV_SPLITS)
    chunk = ceil_div(shape.kv_len, max_splits)
    return _ours(shape, max(1, ceil_div(shape.kv_len, chunk)))


def baseline_configs(shape: Shape, num_sms: int) -> dict[str, Config]:
    """``{"fa2": ..., "fa3": ..., "sglang": ...}`` for one shape."""
    return {"fa2": space.fa2_config(shape, num_sms), "fa3": fa3_config(shape, num_sms),
            "sglang": sglang_config(shape, num_sms)}


# The rules on a variable-length batch, as the paged call's plan knobs. Our plan gives sequence i
# ``clamp(ceil(ceil(len_i / block_kv) / min_blocks_per_split), 1, max_splits)`` splits
# (rules.h ``live_splits``). A rule of K keys per split and S splits on the longest sequence
# becomes ``(max(1, floor(K / block_kv)), S)``. When K >= block_kv the longest sequence gets
# exactly S splits (the tiles round K down, so it needs at least S, and the cap holds it there)
# and a shorter one at least the rule's count, one more where the rounding of K to whole tiles
# crosses a boundary. When K < block_kv (a rule that splits finer than our tile), each split is
# one tile, so the longest sequence gets min(S, its tiles).

def _live_block_kv(head_dim: int) -> int:
    return min(BASELINE_BLOCK_KV, max(tunables.block_kvs_for(head_dim)))


def _plan(keys_per_split: float, splits: int, block_kv: int) -> tuple[int, int, int]:
    return max(1, int(keys_per_split // block_kv)), max(1, min(splits, tunables.MAX_SPLITS)), block_kv


def live_baseline_plans(head: dict, lengths, num_sms: int) -> dict[str, tuple[int, int, int]]:
    """``{"fa2" | "fa3" | "sglang": (min_blocks_per_split, max_splits, block_kv)}``: each rule on
    the batch ``lengths`` (live lengths, every one at least 1) of ``head`` (dtype, head_dim,
    q_heads, kv_heads, q_len), as the paged call's knobs (see above).

    * FlashAttention-2 (``mha_fwd_kvcache``): one split count for the batch, from its longest
      sequence.
    * FlashAttention-3 (``prepare_varlen_num_blocks``): per sequence
      ``min(static, ceil(n_blocks_i / blocks_per_sm))``, with the static count of the longest
      sequence and ``blocks_per_sm`` from the batch's total tiles, FA3's tiles of ``kBlockN``
      keys: ``blocks_per_sm * kBlockN`` keys per split.
    * SGLang (``get_num_kv_splits_triton``): one chunk of keys per split for the batch, the
      smaller of ``max / min(ceil(max / min), 8)`` and ``max / min(ceil(cores' budget / grid), 8)``;
      8 splits at most.

    >>> head = dict(dtype="bf16", head_dim=128, q_heads=8, kv_heads=1, q_len=1)
    >>> live_baseline_plans(head, [65536] + [1024] * 15, 132)
    {'fa2': (1, 7, 128), 'fa3': (5, 8, 128), 'sglang': (64, 8, 128)}
    """
    lengths = [int(n) for n in lengths]
    if not lengths or min(lengths) < 1:
        raise ValueError(f"lengths must be one or more live lengths >= 1, got {lengths!r}")
    longest, shortest, batch = max(lengths), min(lengths), len(lengths)
    shape = Shape(head["dtype"], head["head_dim"], batch, head["q_heads"], head["kv_heads"], head["q_len"], longest)
    block_kv = _live_block_kv(shape.head_dim)
    plans = {"fa2": _plan(block_kv, tunables.fa2_num_splits(shape, num_sms), block_kv)}

    block_m, block_n = fa3_tile(shape)
    m_blocks = ceil_div(shape.packed_rows, block_m)
    static = fa3_static_splits(batch * shape.kv_heads * m_blocks, num_sms, ceil_div(longest, block_n), m_blocks,
                               longest * 2 * shape.head_dim * 2, shape.causal)
    total_blocks = sum(m_blocks * ceil_div(n, block_n) for n in lengths)
    blocks_per_sm = math.ceil(total_blocks * 1.1 * shape.kv_heads / num_sms)
    longest_splits = max(min(ceil_div(ceil_div(longest, block_n), blocks_per_sm), static), 1)
    plans["fa3"] = _plan(blocks_per_sm * block_n, longest_splits, block_kv)

    if longest * 8 < shortest * 10:  # lengths within 25% count as equal
        shortest = longest
    chunk_by_lengths = ceil_div(longest, min(ceil_div(longest, shortest), SGLANG_MAX_KV_SPLITS))
    budget = int(num_sms * max(math.log2(longest / 64.0), 1.0))
    group = shape.group
    rows = batch * shape.q_len
    grid = rows * shape.q_heads if group == 1 else rows * ceil_div(shape.q_heads, min(16, group))
    chunk_by_cores = ceil_div(longest, min(ceil_div(budget, grid), SGLANG_MAX_KV_SPLITS))
    chunk = min(chunk_by_lengths, chunk_by_cores)
    plans["sglang"] = _plan(chunk, ceil_div(longest, chunk), block_kv)
    return plans
