"""PyTorch reference of the split-KV forward: the same split, partial softmax and merge.

Everything here follows the numeric contract in :mod:`splitkv_tune.tunables` (natural-log
``m``/``lse``, un-normalised partial ``O``, GQA row packing ``r = q_idx * G + g``, workspace
layout ``[S, B, Hkv, Sq*G, ...]``) and takes its split ranges from
:func:`~splitkv_tune.tunables.split_range`, so the reference and the CUDA kernel cut the keys
identically. The functions run on any device (CPU or CUDA).

* :func:`attention_ref` - plain softmax attention, the ground truth.
* :func:`splitkv_partials_ref` - per-split ``(O, m, l)`` in the workspace layout.
* :func:`combine_partials_ref` - the merge of the partials.
* :func:`splitkv_attention_ref` - partials + merge, the public reference backend.

>>> import torch
>>> g = torch.Generator().manual_seed(0)
>>> q = torch.randn(1, 3, 4, 64, generator=g, dtype=torch.float64)
>>> k, v = (torch.randn(1, 50, 2, 64, generator=g, dtype=torch.float64) for _ in range(2))
>>> out, lse = attention_ref(q, k, v, causal=True)
>>> out2, lse2 = splitkv_attention_ref(q, k, v, causal=True, num_splits=3, block_kv=32,
...                                    return_lse=True)
>>> bool(torch.allclose(out, out2)) and bool(torch.allclose(lse, lse2))
True
"""
from __future__ import annotations

import math

import torch

from splitkv_tune import tunables

_NEG_INF = float("-inf")


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, same_batch: bool = True) -> tuple[int, int]:
    """Check the FlashAttention layout; return ``(Hkv, G)``. ``same_batch``: k's first dim is
    q's batch (False for page pools, whose first dim counts pages).

    Every dim but k's and v's second (keys, or a pool's page size) needs an entry; no key at
    all is a valid batch of empty sequences.

    >>> _check_qkv(torch.zeros(0, 1, 4, 8), torch.zeros(0, 5, 2, 8), torch.zeros(0, 5, 2, 8))
    Traceback (most recent call last):
    ...
    ValueError: q must have at least one entry in each dim (batch, seqlen, heads, head_dim), got shape (0, 1, 4, 8)
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            shape = f"got shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else f"got {type(t).__name__}"
            raise ValueError(f"{name} must be a 4-D tensor (batch, seqlen, heads, head_dim), {shape}")
        if not t.dtype.is_floating_point:
            raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")
        if min(t.shape[i] for i in ((0, 1, 2, 3) if name == "q" else (0, 2, 3))) < 1:
            dims = "batch, seqlen, heads, head_dim" if name == "q" else "batch or pages, heads, head_dim"
            raise ValueError(f"{name} must have at least one entry in each dim ({dims}), got shape {tuple(t.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if (same_batch and q.shape[0] != k.shape[0]) or q.shape[3] != k.shape[3]:
        agree = "batch and head_dim" if same_batch else "head_dim"
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must agree in {agree}")
    if q.dtype != k.dtype or q.dtype != v.dtype:
        raise TypeError(f"q, k and v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    hq, hkv = q.shape[2], k.shape[2]
    if hkv < 1 or hq % hkv:
        raise ValueError(f"q heads ({hq}) must be a multiple of k/v heads ({hkv})")
    return hkv, hq // hkv


def _scale(softmax_scale: float | None, head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim) if softmax_scale is None else float(softmax_scale)


def _shape(q: torch.Tensor, k: torch.Tensor, causal: bool) -> tunables.Shape:
    """A :class:`tunables.Shape` for the split math (not validated: any dtype/head dim)."""
    b, sq, hq, d = q.shape
    name = {torch.float16: "fp16", torch.bfloat16: "bf16"}.get(q.dtype, str(q.dtype))
    return tunables.Shape(name, d, b, hq, k.shape[2], sq, k.shape[1], bool(causal))


def attention_ref(q, k, v, *, causal=False, softmax_scale=None):
    """Plain softmax attention in the dtype of the inputs (upcast them for a reference).

    ``q`` is ``(B, Sq, Hq, D)``, ``k``/``v`` ``(B, Sk, Hkv, D)``; query head ``h`` uses KV
    head ``h // (Hq // Hkv)``. Causal masks are aligned bottom-right: query ``i`` sees keys
    ``j <= i + Sk - Sq``. Returns ``out (B, Sq, Hq, D)`` and ``lse (B, Hq, Sq)`` (natural
    log of the sum of ``exp(scale * q.k)``). Fully masked rows give ``out = 0`` and
    ``lse = -inf``, never NaN.

    >>> q = torch.zeros(1, 3, 1, 4); kv = torch.ones(1, 1, 1, 4)
    >>> out, lse = attention_ref(q, kv, kv, causal=True)
    >>> out[0, :, 0, 0].tolist(), lse[0, 0].tolist()
    ([0.0, 0.0, 1.0], [-inf, -inf, 0.0])
    """
    hkv, group = _check_qkv(q, k, v)
    sq, sk = q.shape[1], k.shape[1]
    scale = _scale(softmax_scale, q.shape[-1])
    b, hq, d = q.shape[0], q.shape[2], q.shape[3]
    # Fold the G query heads of each KV head into rows so K and V are never repeated.
    qg = q.reshape(b, sq, hkv, group, d).permute(0, 2, 3, 1, 4).reshape(b, hkv, group * sq, d)
    kt, vt = k.transpose(1, 2), v.transpose(1, 2)                          # [B,Hkv,Sk,D]
    scores = torch.matmul(qg, kt.transpose(-1, -2)).view(b, hq, sq, sk) * scale
    if causal:
        i = torch.arange(sq, device=q.device)[:, None]
        j = torch.arange(sk, device=q.device)[None, :]
        scores = scores.masked_fill(j > i + sk - sq, _NEG_INF)
    lse = torch.logsumexp(scores, dim=-1)  # -inf on fully masked rows
    lse_safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    p = torch.exp(scores - lse_safe[..., None])  # exp(-inf) = 0 on masked keys
    out = torch.matmul(p.view(b, hkv, group * sq, sk), vt)              # [B,Hkv,G*Sq,D]
    out = out.view(b, hkv, group, sq, d).permute(0, 3, 1, 2, 4).reshape(b, sq, hq, d)
    return out, lse


def pack_rows(q: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """``(B, Sq, Hq, D)`` -> packed ``(B, Hkv, Sq*G, D)`` with row ``r = q_idx * G + g``.

    >>> q = torch.arange(6.).view(1, 3, 2, 1)   # value = 2 * q_idx + head
    >>> pack_rows(q, 1).flatten().tolist()
    [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    """
    b, sq, hq, d = q.shape
    g = hq // num_kv_heads
    return q.reshape(b, sq, num_kv_heads, g, d).permute(0, 2, 1, 3, 4).reshape(
        b, num_kv_heads, sq * g, d)


def unpack_rows(x: torch.Tensor, q_len: int, group: int) -> torch.Tensor:
    """Undo the GQA packing of a combined result.

    A 4-D ``out`` ``[B, Hkv, Sq*G, D]`` becomes ``(B, Sq, Hq, D)``; a 3-D ``lse``
    ``[B, Hkv, Sq*G]`` becomes ``(B, Hq, Sq)``.

    >>> q = torch.randn(2, 3, 4, 8)
    >>> bool(torch.equal(unpack_rows(pack_rows(q, 2), 3, 2), q))
    True
    >>> unpack_rows(torch.arange(4.).view(1, 1, 4), q_len=2, group=2).tolist()
    [[[0.0, 2.0], [1.0, 3.0]]]
    """
    b, hkv, rows = x.shape[:3]
    if rows != q_len * group:
        raise ValueError(f"packed rows {rows} != q_len * group = {q_len * group}")
    if x.dim() == 4:
        d = x.shape[3]
        return x.reshape(b, hkv, q_len, group, d).permute(0, 2, 1, 3, 4).reshape(
            b, q_len, hkv * group, d)
    if x.dim() == 3:
        return x.reshape(b, hkv, q_len, group).permute(0, 1, 3, 2).reshape(
            b, hkv * group, q_len)
    raise ValueError(f"x must be 3-D (lse) or 4-D (out), got {x.dim()}-D")


def _tile_ranges(shape: tunables.Shape, num_splits: int, block_kv: int, policy: str):
    """Group query tiles by their split ranges: ``{((start, end), ...): [m_block, ...]}``."""
    groups: dict[tuple, list[int]] = {}
    for m_block in range(tunables.num_m_blocks(shape)):
        kv_end = tunables.tile_kv_end(shape, m_block)
        key = tuple(tunables.split_range(s, num_splits, shape.kv_len, kv_end, block_kv, policy)
                    for s in range(num_splits))
        groups.setdefault(key, []).append(m_block)
    return groups


def splitkv_partials_ref(q, k, v, *, causal, softmax_scale, num_splits, block_kv,
                         split_policy):
    """Per-split partials ``(o_part, m, l)`` in the workspace layout of the contract.

    ``o_part`` is ``[S, B, Hkv, Sq*G, D]``, ``m`` and ``l`` ``[S, B, Hkv, Sq*G]``, computed
    in the inputs' dtype (pass float64 for a reference). Packed row ``r`` lies in query tile
    ``r // block_m_for(Sq*G)``; its split ``s`` covers the keys
    ``split_range(s, S, Sk, tile_kv_end(tile), block_kv, policy)`` that the causal mask of
    the row leaves. An empty split has ``m = -inf``, ``l = 0``, ``O = 0``.

    Tiles sharing the same ranges (all of them when not causal) are computed together:
    scores are gathered into a ``[S, Lmax]`` grid so the softmax statistics are vectorised
    over splits; ``P @ V`` reads contiguous slices of ``V`` split by split.

    >>> q = torch.randn(1, 1, 1, 8, dtype=torch.float64); kv = torch.randn(1, 40, 1, 8)
    >>> o, m, l = splitkv_partials_ref(q, kv.double(), kv.double(), causal=False,
    ...     softmax_scale=None, num_splits=4, block_kv=32, split_policy="blocks")
    >>> l[:, 0, 0, 0].gt(0).tolist(), m[::2, 0, 0, 0].tolist()   # 2 blocks over 4 splits
    ([False, True, False, True], [-inf, -inf])
    """
    _, group = _check_qkv(q, k, v)
    shape = _shape(q, k, causal)
    scale = _scale(softmax_scale, shape.head_dim)
    b, hkv, rows, d, sk = shape.batch, shape.kv_heads, shape.packed_rows, shape.head_dim, shape.kv_len
    s_count, dev = num_splits, q.device
    qp = pack_rows(q, hkv)
    o_part = q.new_zeros(s_count, b, hkv, rows, d)
    m = q.new_full((s_count, b, hkv, rows), _NEG_INF)
    l = q.new_zeros(s_count, b, hkv, rows)
    bm = tunables.block_m_for(rows)
    kt, vt = k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()  # [B,Hkv,Sk,D]
    for ranges, m_blocks in _tile_ranges(shape, s_count, block_kv, split_policy).items():
        starts = torch.tensor([r[0] for r in ranges], device=dev)
        lens = torch.tensor([max(0, r[1] - r[0]) for r in ranges], device=dev)
        lmax = int(lens.max())
        if lmax == 0:
            continue  # every split of these tiles is empty: keep -inf / 0 / 0
        row_idx = torch.cat([torch.arange(t * bm, min((t + 1) * bm, rows), device=dev)
                             for t in m_blocks])
        offs = torch.arange(lmax, device=dev)
        valid = offs[None, :] < lens[:, None]                              # [S, L]
        key = torch.where(valid, starts[:, None] + offs[None, :], 0)       # [S, L]
        if causal:  # row r (query r // G) sees keys j <= q_idx + Sk - Sq
            limit = row_idx // group + sk - shape.q_len                    # [R]
            valid = valid[None] & (key[None] <= limit[:, None, None])      # [R, S, L]
        kv_end = int((starts + lens).max())
        x = torch.matmul(qp[:, :, row_idx], kt[:, :, :kv_end].transpose(-1, -2)) * scale
        x = x.gather(-1, key.flatten().expand(*x.shape[:-1], -1).clamp(max=kv_end - 1))
        x = x.view(b, hkv, -1, s_count, lmax).masked_fill(~valid, _NEG_INF)  # [B,Hkv,R,S,L]
        mt = x.amax(dim=-1)
        p = torch.exp(x - torch.where(torch.isinf(mt), 0, mt)[..., None])
        lt = p.sum(dim=-1)
        ot = o_part.new_zeros(s_count, b, hkv, len(row_idx), d)
        for s, (start, end) in enumerate(ranges):  # contiguous V slices: no gather copy
            if end > start:
                ot[s] = torch.matmul(p[:, :, :, s, :end - start], vt[:, :, start:end])
        m[:, :, :, row_idx] = mt.permute(3, 0, 1, 2)
        l[:, :, :, row_idx] = lt.permute(3, 0, 1, 2)
        o_part[:, :, :, row_idx] = ot
    return o_part, m, l


def combine_partials_ref(o_part, m, l):
    """Merge the partials as the contract says; returns ``(out_packed, lse)``.

    ``out_packed`` is ``[B, Hkv, Sq*G, D]`` and ``lse`` ``[B, Hkv, Sq*G]`` (use
    :func:`unpack_rows`). Splits with ``l == 0`` are skipped entirely (whatever their ``m``
    and ``O`` hold); rows with no non-empty split get ``0`` and ``-inf``, never NaN.

    >>> o = torch.tensor([[[[[2.0]]]], [[[[6.0]]]]]); m = torch.tensor([0.0, 0.0]).view(2, 1, 1, 1)
    >>> out, lse = combine_partials_ref(o, m, torch.tensor([1.0, 3.0]).view(2, 1, 1, 1))
    >>> out.item(), round(lse.item(), 6) == round(math.log(4), 6)
    (2.0, True)
    """
    live = l > 0
    m_live = torch.where(live, m, _NEG_INF)
    m_max = m_live.amax(dim=0)
    empty_row = torch.isinf(m_max)
    m_safe = torch.where(empty_row, 0, m_max)
    w = torch.where(live, torch.exp(m_live - m_safe), 0)                     # [S, B, H, R]
    l_sum = (w * torch.where(live, l, 0)).sum(dim=0)
    o_sum = torch.where(live[..., None], w[..., None] * o_part, 0).sum(dim=0)
    out = torch.where(empty_row[..., None], 0, o_sum / torch.where(empty_row, 1, l_sum)[..., None])
    lse = torch.where(empty_row, _NEG_INF, m_safe + torch.log(torch.where(empty_row, 1, l_sum)))
    return out, lse


def splitkv_attention_ref(q, k, v, *, causal=False, softmax_scale=None, num_splits=1,
                          block_kv=64, split_policy="blocks", return_lse=False,
                          cache_seqlens=None, block_table=None, max_splits=tunables.MAX_SPLITS,
                          min_blocks_per_split=1, plan_ctas=None):
    """Split-KV attention in PyTorch: :func:`splitkv_partials_ref` + :func:`combine_partials_ref`.

    The layouts and knob names of ``splitkv_tune.ops.splitkv_attention``, with the knobs given
    (no ``"auto"``, except a paged call's ``split_policy``, whose splits are whole blocks either
    way): returns ``out`` ``(B, Sq, Hq, D)``, or ``(out, lse)`` with ``lse`` ``(B, Hq, Sq)``.
    There is no merge, workspace or launch to choose, ``plan_ctas`` stands for
    ``split_plan="load_aware"``, and the paged values are always checked (``check_inputs``).
    Any floating dtype and head dim, with ``block_kv`` 32, 64 or 128 at any of them. float32/float64
    inputs are computed in their own dtype; fp16/bf16 inputs (the benchmark's reference
    backend, CPU or GPU) are upcast to float32, and ``out`` is cast back to ``q.dtype``
    while ``lse`` stays float32, as the kernel returns it. ``num_splits``, ``block_kv``
    and ``split_policy`` are checked with :meth:`tunables.Config.validate`.

    >>> q = torch.randn(1, 1, 2, 64, dtype=torch.bfloat16); kv = torch.randn(1, 9, 1, 64).bfloat16()
    >>> out, lse = splitkv_attention_ref(q, kv, kv, num_splits=2, block_kv=32, return_lse=True)
    >>> out.dtype, lse.dtype, tuple(lse.shape)
    (torch.bfloat16, torch.float32, (1, 2, 1))
    >>> splitkv_attention_ref(q, kv, kv, num_splits=0)
    Traceback (most recent call last):
    ...
    ValueError: num_splits must be an integer in [1, 128], got 0

    With ``cache_seqlens`` (int32 ``[B]``, each sequence's live length) and/or ``block_table``
    (int32 ``[B, max_pages]``; k and v are then page pools ``(num_pages, page_size, Hkv, D)``)
    the batch is split per sequence by :mod:`splitkv_tune.plan` (``max_splits`` and
    ``min_blocks_per_split`` are its knobs; ``num_splits`` must stay 1), causal masks are
    aligned to each sequence's own end, and a sequence of length 0 gets ``out = 0`` and
    ``lse = -inf``. ``plan_ctas``: apply the load-aware plan of a launch of that many CTAs
    (``live.launch_grid``), as the kernel does when its ``split_plan`` is ``"load_aware"`` and
    ``cache_seqlens`` is given (without it every sequence holds the
    capacity and the knob is used as given): ``min_blocks_per_split`` is then the base it
    chooses from
    (``plan.plan_min_blocks``); None uses the knob as given.
    """
    if cache_seqlens is not None or block_table is not None:
        return _live_batch_ref(q, k, v, causal, softmax_scale, num_splits, block_kv, split_policy, return_lse,
                               cache_seqlens, block_table, max_splits, min_blocks_per_split, plan_ctas)
    if plan_ctas is not None:
        raise ValueError("plan_ctas applies to paged or variable-length batches (cache_seqlens or block_table)")
    tunables.Config(num_splits=num_splits, block_kv=block_kv,
                    split_policy=split_policy).validate()
    hkv, group = _check_qkv(q, k, v)
    out_dtype = q.dtype
    if q.dtype in (torch.float16, torch.bfloat16):
        q, k, v = q.float(), k.float(), v.float()
    o_part, m, l = splitkv_partials_ref(q, k, v, causal=causal, softmax_scale=softmax_scale,
                                        num_splits=num_splits, block_kv=block_kv,
                                        split_policy=split_policy)
    out, lse = combine_partials_ref(o_part, m, l)
    out = unpack_rows(out, q.shape[1], group).to(out_dtype)
    if not return_lse:
        return out
    lse = unpack_rows(lse, q.shape[1], group)
    return out, lse.float() if out_dtype in (torch.float16, torch.bfloat16) else lse


def _live_batch_ref(q, k, v, causal, softmax_scale, num_splits, block_kv, split_policy, return_lse, cache_seqlens,
                    block_table, max_splits, min_blocks_per_split, plan_ctas):
    """:func:`splitkv_attention_ref` of a paged or variable-length batch, one sequence at a time
    with the split count :mod:`splitkv_tune.plan` gives it."""
    from splitkv_tune import plan

    _check_qkv(q, k, v, same_batch=block_table is None)
    if num_splits != 1:
        raise ValueError("num_splits applies to equal-length batches; a paged or variable-length "
                         "batch is split per sequence: pass max_splits (and min_blocks_per_split)")
    plan.check_live_split_policy(split_policy)
    plan.check_plan_knobs(block_kv, min_blocks_per_split, max_splits)
    batch = plan.check_live_batch(q, k, cache_seqlens, block_table)
    _, q_len, q_heads, _ = q.shape
    if plan_ctas is not None:
        plan.check_ctas(plan_ctas, "plan_ctas")
        if cache_seqlens is not None:  # without it every sequence holds the capacity: the knob as given
            min_blocks_per_split = plan.plan_min_blocks(
                batch.lengths, kv_heads=k.shape[2], packed_rows=q_len * (q_heads // k.shape[2]), ctas=plan_ctas,
                block_kv=block_kv, min_blocks_per_split=min_blocks_per_split, max_splits=max_splits)
    counts = plan.split_counts(batch, block_kv, min_blocks_per_split, max_splits)
    lse_dtype = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    outs, lses = [], []
    for b, (live_len, splits) in enumerate(zip(batch.lengths, counts)):
        if live_len == 0:
            outs.append(torch.zeros_like(q[b:b + 1]))
            lses.append(torch.full((1, q_heads, q_len), _NEG_INF, dtype=lse_dtype, device=q.device))
            continue
        kb = plan.live_keys(k, b, live_len, block_table)
        vb = plan.live_keys(v, b, live_len, block_table)
        out_b, lse_b = splitkv_attention_ref(q[b:b + 1], kb, vb, causal=causal, softmax_scale=softmax_scale,
                                             num_splits=splits, block_kv=block_kv, split_policy="blocks",
                                             return_lse=True)
        outs.append(out_b)
        lses.append(lse_b)
    out = torch.cat(outs)
    return (out, torch.cat(lses)) if return_lse else out
