"""The split plan of a paged or variable-length batch, and the checks of its arguments.

A batch whose sequences have their own live lengths (``cache_seqlens``, int32 ``[B]``) and,
optionally, keep their keys in pages of a pool (``block_table``, int32 ``[B, max_pages]``,
pages in any order, shared by K and V) is split per sequence, from its live length alone:
``rules.h``'s ``live_splits`` gives sequence ``b`` ``live_splits(len_b, block_kv,
min_blocks_per_split, max_splits)`` splits, and split ``s`` of them covers the keys
``split_range(s, S_b, len_b, tile_kv_end, block_kv, "blocks")``, with causal masks aligned to
the sequence's own end. Neither the cache's capacity nor the block table's width nor the other
sequences enter, so a sequence's output bits depend only on its own q, keys and length and the
knobs (``block_kv``, ``min_blocks_per_split``, ``max_splits``). When the call's
``split_plan`` is ``"load_aware"``, the launch first chooses that knob from all the lengths
(:func:`plan_min_blocks`, the load-aware plan): the bits then depend on the batch too.

Layouts: contiguous ``k``/``v`` ``(B, Sk_capacity, Hkv, D)``; paged pools
``(num_pages, page_size, Hkv, D)`` (NHD, as vLLM and FlashInfer store them).

This is the plan the reference (``reference.splitkv_attention_ref``) applies and the CUDA
kernel computes on the device, per CTA, from the lengths it reads there (``params.h``); both
call ``rules.h``'s functions.
"""
from __future__ import annotations

import dataclasses

import torch

from splitkv_tune import _rules, tunables

PAGE_SIZES = (1, 16, 32, 64, 128, 256)  # 1: SGLang's token-granular pool
# How a launch turns live lengths into split counts: "fixed", min_blocks_per_split as given;
# "load_aware", the launch chooses it among min_blocks_per_split x 1, 2, 4, ... from all the
# lengths (plan_min_blocks).
SPLIT_PLANS = ("fixed", "load_aware")
MAX_CTAS = _rules.MAX_LIVE_CTAS  # the most CTAs a launch's grid can have: the load-aware plan's range


@dataclasses.dataclass(frozen=True)
class LiveBatch:
    """Checked ``cache_seqlens``/``block_table`` of one call: live lengths on the host (the
    reference reads them; the kernel would read them on the device) and the cache's geometry."""

    lengths: tuple[int, ...]
    page_size: int | None  # None: contiguous k/v
    capacity: int          # keys a sequence can hold: Sk_capacity, or max_pages * page_size


def _check_int_tensor(name: str, t, rank: int, device) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.int32:
        raise TypeError(f"{name} must be int32, got {t.dtype}")
    if t.dim() != rank:
        raise ValueError(f"{name} must have {rank} dimension{'s' if rank > 1 else ''}, "
                         f"got shape {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} must be on {device} (q's device), got {t.device}")


def check_live_args(q: torch.Tensor, k: torch.Tensor, cache_seqlens, block_table) -> tuple[int | None, int]:
    """The checks of ``cache_seqlens`` and ``block_table`` that need no data from the device
    (dtype, device, rank, shape, layout, page size, table width); ``ValueError`` or ``TypeError``
    naming the argument. Returns ``(page_size or None, capacity)``."""
    batch = q.shape[0]
    if block_table is not None:
        _check_int_tensor("block_table", block_table, 2, q.device)
        if block_table.shape[0] != batch:
            raise ValueError(f"block_table must have one row per sequence ({batch}), got {block_table.shape[0]}")
        page_size = int(k.shape[1])
        if page_size not in PAGE_SIZES:
            raise ValueError(f"page size (k_cache.shape[1]) must be one of {PAGE_SIZES}, got {page_size}")
        num_pages = int(k.shape[0])
        if block_table.shape[1] < 1:
            raise ValueError("block_table must have at least one page per sequence")
        if block_table.shape[1] > num_pages:
            raise ValueError(f"block_table is wider ({block_table.shape[1]} pages per sequence) than the "
                             f"pool ({num_pages} pages)")
        if block_table.stride(1) != 1:
            raise ValueError(f"block_table must be contiguous in its last dim, got stride {block_table.stride(1)}")
        capacity = int(block_table.shape[1]) * page_size
    else:
        if k.shape[0] != batch:
            raise ValueError(f"k batch ({k.shape[0]}) must equal q batch ({batch}) without a block_table")
        page_size, capacity = None, int(k.shape[1])
    if capacity > _rules.MAX_KEYS:
        raise ValueError(f"the cache's capacity per sequence must be at most {_rules.MAX_KEYS} keys, got {capacity}")
    if cache_seqlens is not None:
        _check_int_tensor("cache_seqlens", cache_seqlens, 1, q.device)
        if cache_seqlens.shape[0] != batch:
            raise ValueError(f"cache_seqlens must have one length per sequence ({batch}), "
                             f"got {cache_seqlens.shape[0]}")
    return page_size, capacity


def first_bad_live_value(k: torch.Tensor, cache_seqlens, block_table, capacity: int) -> int:
    """The first of the call's values that fails ``check_inputs``, as ``live_check.h`` keys it:
    ``b`` for ``cache_seqlens[b]`` outside ``[0, capacity]``, ``B + b * W + p`` for
    ``block_table[b, p]`` (``W`` the table's width) a page of a live key outside the pool;
    lengths first, then the table row by row; -1 when every value is good. On a CUDA device the
    extension's check kernel computes it (one launch, one 8-byte read back); on the CPU, or without
    the extension, torch."""
    if cache_seqlens is None and block_table is None:
        return -1
    batch = block_table.shape[0] if block_table is not None else k.shape[0]
    page_size, num_pages = int(k.shape[1]), int(k.shape[0])
    from splitkv_tune.ops import _extension, extension_built
    if k.is_cuda and extension_built():
        return _extension().live_check(cache_seqlens, block_table, batch, capacity, page_size, num_pages)
    device = (cache_seqlens if cache_seqlens is not None else block_table).device
    lens = (cache_seqlens.long() if cache_seqlens is not None
            else torch.full((batch,), capacity, dtype=torch.long, device=device))
    bad = ((lens < 0) | (lens > capacity)).nonzero()
    if len(bad):
        return int(bad[0, 0])
    if block_table is None:
        return -1
    live = (torch.arange(block_table.shape[1], device=device)[None, :] * page_size) < lens[:, None]
    bad = (live & ((block_table < 0) | (block_table >= num_pages))).flatten().nonzero()
    return batch + int(bad[0, 0]) if len(bad) else -1


def check_live_values(k: torch.Tensor, cache_seqlens, block_table, capacity: int) -> None:
    """The checks that read the call's data: every length in ``[0, capacity]``, and every page a
    sequence's live keys use within the pool; ``ValueError`` naming the first bad entry. This
    waits for the GPU."""
    key = first_bad_live_value(k, cache_seqlens, block_table, capacity)
    if key >= 0:
        raise_live_value_error(key, k, cache_seqlens, block_table, capacity)


def raise_live_value_error(key: int, k: torch.Tensor, cache_seqlens, block_table, capacity: int) -> None:
    """``ValueError`` naming the entry of ``first_bad_live_value``'s ``key`` (>= 0) and its value
    (the extension's eager paged call raises it after its own check)."""
    batch = block_table.shape[0] if block_table is not None else k.shape[0]
    if key < batch:
        n = int(cache_seqlens[key])
        what = "is negative" if n < 0 else f"exceeds the cache's capacity of {capacity} keys per sequence"
        raise ValueError(f"cache_seqlens[{key}] = {n} {what}")
    b, p = divmod(key - batch, block_table.shape[1])
    raise ValueError(f"block_table[{b}, {p}] = {int(block_table[b, p])} is not a page of the pool "
                     f"[0, {int(k.shape[0])})")


def check_live_batch(q: torch.Tensor, k: torch.Tensor, cache_seqlens, block_table) -> LiveBatch:
    """Check ``cache_seqlens`` and ``block_table`` against q and the cache; ``ValueError`` or
    ``TypeError`` naming the argument. Values are checked too (lengths within capacity, the
    pages of the live keys within the pool; pages past a sequence's length are never read and
    may hold anything): this reads them to the host.

    >>> q = torch.zeros(2, 1, 4, 64); k = torch.zeros(8, 16, 1, 64)
    >>> table = torch.tensor([[3, 1], [0, 7]], dtype=torch.int32)
    >>> check_live_batch(q, k, torch.tensor([17, 0], dtype=torch.int32), table)
    LiveBatch(lengths=(17, 0), page_size=16, capacity=32)
    >>> check_live_batch(q, k, torch.tensor([33, 0], dtype=torch.int32), table)
    Traceback (most recent call last):
    ...
    ValueError: cache_seqlens[0] = 33 exceeds the cache's capacity of 32 keys per sequence
    """
    page_size, capacity = check_live_args(q, k, cache_seqlens, block_table)
    check_live_values(k, cache_seqlens, block_table, capacity)
    lengths = (tuple(int(x) for x in cache_seqlens.tolist()) if cache_seqlens is not None
               else (capacity,) * q.shape[0])
    return LiveBatch(lengths, page_size, capacity)


def check_max_splits(max_splits: int) -> None:
    """``ValueError`` unless ``max_splits`` is an integer in ``[1, tunables.MAX_SPLITS]``."""
    if not isinstance(max_splits, int) or isinstance(max_splits, bool) or not 1 <= max_splits <= tunables.MAX_SPLITS:
        raise ValueError(f"max_splits must be an integer in [1, {tunables.MAX_SPLITS}], got {max_splits!r}")


def check_plan_knobs(block_kv: int, min_blocks_per_split: int, max_splits: int) -> None:
    """``ValueError`` naming the knob that is out of range."""
    tunables.Config(block_kv=block_kv).validate()
    check_max_splits(max_splits)
    most = _rules.max_min_blocks_per_split(block_kv)
    if (not isinstance(min_blocks_per_split, int) or isinstance(min_blocks_per_split, bool)
            or not 1 <= min_blocks_per_split <= most):
        raise ValueError(f"min_blocks_per_split must be an integer in [1, {most}] (at block_kv {block_kv}), "
                         f"got {min_blocks_per_split!r}")


def check_live_split_policy(split_policy) -> None:
    """``ValueError`` unless ``split_policy`` is ``"blocks"`` or ``"auto"``: a paged or
    variable-length batch's splits are whole blocks."""
    if not isinstance(split_policy, str) or split_policy not in ("auto", "blocks"):
        raise ValueError(f"split_policy must be 'blocks' or 'auto' for a paged or variable-length batch "
                         f"(its splits are whole blocks), got {split_policy!r}")


def check_split_plan(split_plan) -> str:
    """``split_plan`` when it is one of ``SPLIT_PLANS``; ``ValueError`` naming it otherwise."""
    if not isinstance(split_plan, str) or split_plan not in SPLIT_PLANS:
        raise ValueError(f"split_plan must be one of {SPLIT_PLANS}, got {split_plan!r}")
    return split_plan


def live_splits(live_len: int, block_kv: int, min_blocks_per_split: int, max_splits: int) -> int:
    """Splits of one sequence (rules.h).

    >>> [live_splits(n, 64, 4, 16) for n in (0, 1, 256, 257, 100_000)]
    [1, 1, 1, 2, 16]
    """
    return _rules.live_splits(live_len, block_kv, min_blocks_per_split, max_splits)


def check_ctas(ctas, name: str = "ctas") -> None:
    """``ValueError`` naming ``name`` unless ``ctas`` is a launch's CTA count, in ``[1, MAX_CTAS]``."""
    if not isinstance(ctas, int) or isinstance(ctas, bool) or not 1 <= ctas <= MAX_CTAS:
        raise ValueError(f"{name} must be an integer in [1, {MAX_CTAS}] (the launch's CTAs), got {ctas!r}")


def plan_min_blocks(lengths, *, kv_heads: int, packed_rows: int, ctas: int, block_kv: int,
                    min_blocks_per_split: int, max_splits: int) -> int:
    """The load-aware plan's knob (live_plan.h ``live_plan_min_blocks``): what a launch of ``ctas``
    CTAs whose ``split_plan`` is ``"load_aware"`` (its base ``min_blocks_per_split`` as given,
    ``"auto"`` resolved) uses for these live lengths: that knob
    times 1, 2, 4, ... (``_rules.live_plan_choices``), the one whose schedule finishes first by
    the rule's estimate, and the knob itself unless another gains 5%. Splits of about one item
    per CTA for a batch of equal lengths, finer ones where a few long sequences leave CTAs to
    fill.

    >>> [plan_min_blocks(lengths, kv_heads=8, packed_rows=4, ctas=264, block_kv=64,
    ...                  min_blocks_per_split=16, max_splits=33)
    ...  for lengths in ([8192] * 16, [65536] + [1024] * 15)]
    [64, 16]
    """
    if not lengths:
        raise ValueError("lengths must name at least one sequence")
    check_plan_knobs(block_kv, min_blocks_per_split, max_splits)
    check_ctas(ctas)
    tiles = kv_heads * _rules.num_m_blocks(packed_rows)
    choices = _rules.live_plan_choices(min_blocks_per_split, block_kv)
    return _rules.live_plan_min_blocks(list(lengths), tiles, ctas, block_kv, min_blocks_per_split, max_splits,
                                       choices)


def split_counts(batch: LiveBatch, block_kv: int, min_blocks_per_split: int, max_splits: int) -> list[int]:
    """Each sequence's split count."""
    return [live_splits(n, block_kv, min_blocks_per_split, max_splits) for n in batch.lengths]


def live_keys(cache: torch.Tensor, b: int, live_len: int, block_table: torch.Tensor | None) -> torch.Tensor:
    """Keys ``[0, live_len)`` of sequence ``b`` as ``(1, live_len, Hkv, D)``: a slice of a
    contiguous cache, or its pages gathered through the block table."""
    if block_table is None:
        return cache[b:b + 1, :live_len]
    page_size = cache.shape[1]
    pages = block_table[b, :-(-live_len // page_size)].long()
    return cache[pages].reshape(1, -1, *cache.shape[2:])[:, :live_len]
