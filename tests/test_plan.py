"""The split plan of paged and variable-length batches (splitkv_tune.plan, rules.h's
live_splits) and the reference that applies it, on the CPU: split counts follow each
sequence's live length alone, the splits cover its live keys once, a paged cache with a
shuffled table gives the dense answer, capacity and the other sequences change no bit, and
bad arguments name themselves."""
from __future__ import annotations

import random

import pytest
import torch

from splitkv_tune import _rules, plan, tunables
from splitkv_tune.reference import attention_ref, splitkv_attention_ref


def test_live_splits_follow_the_live_length():
    rng = random.Random(0)
    for _ in range(5000):
        n = rng.choice([0, 1, rng.randint(0, 300_000)])
        bkv = rng.choice(tunables.BLOCK_KV)
        chunk = rng.randint(1, 64)
        cap = rng.randint(1, tunables.MAX_SPLITS)
        s = plan.live_splits(n, bkv, chunk, cap)
        assert 1 <= s <= cap
        blocks = -(-n // bkv)
        if s < cap:
            assert s == max(1, -(-blocks // chunk))  # one split per `chunk` blocks
        # Longer never splits less; the blocks policy gives every split a block when it can.
        assert plan.live_splits(n + bkv, bkv, chunk, cap) >= s
        if blocks >= s:
            ranges = [tunables.split_range(i, s, n, n, bkv, "blocks") for i in range(s)]
            covered = [j for a, e in ranges for j in range(a, max(a, e))]
            assert covered == list(range(n))
            assert all(e > a for a, e in ranges)


@pytest.mark.parametrize("block_kv", tunables.BLOCK_KV)
def test_the_knob_bound_is_a_split_of_the_longest_sequence(block_kv):
    most = _rules.max_min_blocks_per_split(block_kv)
    assert most == _rules.MAX_KEYS // block_kv
    assert plan.live_splits(_rules.MAX_KEYS, block_kv, most, 1) == 1
    plan.check_plan_knobs(block_kv, most, 8)
    with pytest.raises(ValueError, match=rf"min_blocks_per_split must be an integer in \[1, {most}\]"):
        plan.check_plan_knobs(block_kv, most + 1, 8)
    with pytest.raises(ValueError, match="live_splits needs"):
        _rules.live_splits(100, block_kv, most + 1, 8)


def _paged(k, v, page_size, width, gen):
    """k, v (B, Sk, H, D) into shuffled page pools and a block table `width` pages wide."""
    b, sk, h, d = k.shape
    per_seq = width
    num_pages = b * per_seq + 3
    perm = torch.randperm(num_pages, generator=gen)[: b * per_seq].view(b, per_seq)
    pool_k = torch.full((num_pages, page_size, h, d), float("nan"), dtype=k.dtype)  # unused pages: NaN
    pool_v = pool_k.clone()
    pad = per_seq * page_size - sk
    kp = torch.cat([k, k.new_zeros(b, pad, h, d)], 1).view(b, per_seq, page_size, h, d)
    vp = torch.cat([v, v.new_zeros(b, pad, h, d)], 1).view(b, per_seq, page_size, h, d)
    for i in range(b):
        pool_k[perm[i]] = kp[i]
        pool_v[perm[i]] = vp[i]
    return pool_k, pool_v, perm.to(torch.int32)


def _dense(q, k, v, lengths, causal):
    outs, lses = [], []
    for b, n in enumerate(lengths):
        o, lse = attention_ref(q[b:b + 1], k[b:b + 1, :n], v[b:b + 1, :n], causal=causal)
        outs.append(torch.nan_to_num(o) if n == 0 else o)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


@pytest.mark.parametrize("page_size", plan.PAGE_SIZES)
@pytest.mark.parametrize("causal", [False, True])
def test_paged_variable_length_reference_matches_dense(gen, page_size, causal):
    hkv, group, d, sq = 2, 4, 64, (1 if not causal else 3)
    lengths = [0, 1, page_size - 1, page_size + 1, 63, 65, 3 * page_size + 7]
    cap = max(lengths) + 5
    b = len(lengths)
    q = torch.randn(b, sq, hkv * group, d, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(b, cap, hkv, d, generator=gen, dtype=torch.float64) for _ in range(2))
    want_out, want_lse = _dense(q, k, v, lengths, causal)
    seqlens = torch.tensor(lengths, dtype=torch.int32)
    width = -(-cap // page_size)
    pool_k, pool_v, table = _paged(k, v, page_size, width, gen)
    for kk, vv, tbl in ((k, v, None), (pool_k, pool_v, table)):
        out, lse = splitkv_attention_ref(q, kk, vv, causal=causal, cache_seqlens=seqlens, block_table=tbl,
                                         block_kv=32, max_splits=5, min_blocks_per_split=1, return_lse=True)
        assert torch.isfinite(out).all()
        assert torch.allclose(out, want_out, atol=1e-10)
        assert torch.equal(torch.isneginf(lse), torch.isneginf(want_lse))
        live = ~torch.isneginf(want_lse)
        assert torch.allclose(lse[live], want_lse[live], atol=1e-10)
    assert (out[0] == 0).all() and torch.isneginf(lse[0]).all()  # length 0: 0 and -inf, no NaN


def test_capacity_and_other_sequences_change_no_bit(gen):
    """Same live lengths with a table 1x, 8x and 64x wider, and a sequence moved into another
    batch with other lengths: bitwise the same output (the plan reads only its own length)."""
    hkv, d, page = 1, 64, 16
    lengths = [37, 300, 5]
    q = torch.randn(3, 1, 4, d, generator=gen)
    k, v = (torch.randn(3, 320, hkv, d, generator=gen) for _ in range(2))
    seqlens = torch.tensor(lengths, dtype=torch.int32)
    base = None
    for mult in (1, 8, 64):
        width = mult * 20
        pool_k, pool_v, table = _paged(torch.cat([k, k.new_zeros(3, width * page - 320, hkv, d)], 1),
                                       torch.cat([v, v.new_zeros(3, width * page - 320, hkv, d)], 1),
                                       page, width, gen)
        out = splitkv_attention_ref(q, pool_k, pool_v, cache_seqlens=seqlens, block_table=table,
                                    block_kv=32, max_splits=8, min_blocks_per_split=2)
        base = out if base is None else base
        assert torch.equal(out, base), f"table {mult}x wider changed the output"
    other_q = torch.randn(2, 1, 4, d, generator=gen)
    other_k, other_v = (torch.randn(2, 320, hkv, d, generator=gen) for _ in range(2))
    mixed = splitkv_attention_ref(torch.cat([other_q[:1], q[1:2], other_q[1:]]),
                                  torch.cat([other_k[:1], k[1:2], other_k[1:]]),
                                  torch.cat([other_v[:1], v[1:2], other_v[1:]]),
                                  cache_seqlens=torch.tensor([320, 300, 1], dtype=torch.int32),
                                  block_kv=32, max_splits=8, min_blocks_per_split=2)
    assert torch.equal(mixed[1], base[1])


def _bad_calls():
    table = torch.zeros(2, 2, dtype=torch.int32)
    lens = torch.tensor([3, 4], dtype=torch.int32)
    yield "seqlens dtype", dict(cache_seqlens=lens.long(), block_table=table), "cache_seqlens"
    yield "seqlens rank", dict(cache_seqlens=lens[None], block_table=table), "cache_seqlens"
    yield "seqlens batch", dict(cache_seqlens=lens[:1], block_table=table), "cache_seqlens"
    yield "seqlens type", dict(cache_seqlens=[3, 4], block_table=table), "cache_seqlens"
    yield "length over capacity", dict(cache_seqlens=torch.tensor([3, 33], dtype=torch.int32),
                                       block_table=table), "cache_seqlens"
    yield "negative length", dict(cache_seqlens=torch.tensor([-1, 3], dtype=torch.int32),
                                  block_table=table), "cache_seqlens"
    yield "table dtype", dict(cache_seqlens=lens, block_table=table.long()), "block_table"
    yield "table rank", dict(cache_seqlens=lens, block_table=table[0]), "block_table"
    yield "table rows", dict(cache_seqlens=lens, block_table=table[:1]), "block_table"
    yield "table wider than pool", dict(cache_seqlens=lens,
                                        block_table=torch.zeros(2, 9, dtype=torch.int32)), "block_table"
    yield "page out of pool", dict(cache_seqlens=lens,
                                   block_table=torch.tensor([[8, 0], [1, 2]], dtype=torch.int32)), "block_table"
    yield "max_splits", dict(cache_seqlens=lens, block_table=table, max_splits=0), "max_splits"
    yield "max_splits high", dict(cache_seqlens=lens, block_table=table, max_splits=129), "max_splits"
    yield "min_blocks", dict(cache_seqlens=lens, block_table=table, min_blocks_per_split=0), \
        "min_blocks_per_split"
    yield "num_splits", dict(cache_seqlens=lens, block_table=table, num_splits=4), "num_splits"
    yield "page size", dict(cache_seqlens=lens, block_table=table, k=torch.zeros(8, 24, 1, 64)), "page size"
    yield "plan_ctas", dict(cache_seqlens=lens, block_table=table, plan_ctas=0), "plan_ctas"
    yield "plan_ctas type", dict(cache_seqlens=lens, block_table=table, plan_ctas=2.5), "plan_ctas"
    yield "plan_ctas range", dict(cache_seqlens=lens, block_table=table, plan_ctas=2 ** 32), "plan_ctas"
    yield "split_policy", dict(cache_seqlens=lens, block_table=table, split_policy="length"), "split_policy"
    yield "q rank", dict(cache_seqlens=lens, block_table=table, q=torch.zeros(2, 4, 64)), "q must be a 4-D"
    yield "integer q", dict(cache_seqlens=lens, block_table=table, q=torch.zeros(2, 1, 4, 64, dtype=torch.int32)), \
        "q must be a floating-point"
    yield "no kv heads", dict(cache_seqlens=lens, block_table=table, k=torch.zeros(8, 16, 0, 64)), \
        "k must have at least one entry"
    yield "empty batch", dict(cache_seqlens=lens[:0], block_table=table[:0], q=torch.zeros(0, 1, 4, 64)), \
        "q must have at least one entry"
    # q, k and v are checked whatever the lengths: a batch of empty sequences reads no key.
    empty = torch.zeros(2, dtype=torch.int32)
    yield "heads, every length 0", dict(cache_seqlens=empty, block_table=table, q=torch.zeros(2, 1, 3, 64),
                                        k=torch.zeros(8, 16, 2, 64)), "multiple"
    yield "dtype, every length 0", dict(cache_seqlens=empty, block_table=table,
                                        q=torch.zeros(2, 1, 4, 64, dtype=torch.float64)), "dtype"
    yield "head_dim, every length 0", dict(cache_seqlens=empty, block_table=table, k=torch.zeros(8, 16, 1, 32)), \
        "head_dim"


@pytest.mark.parametrize("kwargs,pattern", [pytest.param(kw, p, id=name) for name, kw, p in _bad_calls()])
def test_bad_live_batch_arguments_name_themselves(kwargs, pattern):
    kwargs = dict(kwargs)
    q = kwargs.pop("q", torch.zeros(2, 1, 4, 64))
    k = kwargs.pop("k", torch.zeros(8, 16, 1, 64))
    with pytest.raises((ValueError, TypeError), match=pattern):
        splitkv_attention_ref(q, k, k.clone(), **kwargs)


def test_pages_past_the_live_length_are_neither_checked_nor_read(gen):
    """A table padded with -1 (or any value) past each sequence's live pages, as servers pad
    them, is valid: only the pages of the live keys must lie in the pool."""
    q = torch.randn(2, 1, 4, 64, generator=gen)
    k = torch.randn(8, 16, 1, 64, generator=gen)
    v = torch.randn(8, 16, 1, 64, generator=gen)
    table = torch.tensor([[3, -1, 1000], [5, 2, -7]], dtype=torch.int32)
    lens = torch.tensor([16, 20], dtype=torch.int32)
    out = splitkv_attention_ref(q, k, v, cache_seqlens=lens, block_table=table, max_splits=4)
    for b, pages in enumerate(([3], [5, 2])):
        kb = k[pages].reshape(1, -1, 1, 64)[:, :int(lens[b])]
        vb = v[pages].reshape(1, -1, 1, 64)[:, :int(lens[b])]
        want, _ = attention_ref(q[b:b + 1].double(), kb.double(), vb.double())
        torch.testing.assert_close(out[b:b + 1].double(), want, rtol=1e-5, atol=1e-5)


def test_the_first_bad_value_is_keyed_lengths_first_then_the_table_row_by_row():
    k = torch.zeros(8, 16, 1, 1)
    table = torch.tensor([[3, -1, 9], [9, 2, 1]], dtype=torch.int32)

    def first(lens, tab=table):
        return plan.first_bad_live_value(k, None if lens is None else torch.tensor(lens, dtype=torch.int32),
                                         tab, 48)
    assert first([16, 16]) == 2 + 1 * 3 + 0   # row 0's page 1 is past its 16 keys; row 1's page 0 is live
    assert first([17, 0]) == 2 + 0 * 3 + 1    # row 0's page 1 is live now, and comes first
    assert first([49, -1]) == 0 and first([0, -1]) == 1
    assert first([16, 0]) == -1
    assert first(None) == 2 + 0 * 3 + 1       # no lengths: every page of the table is live
    assert plan.first_bad_live_value(k, None, None, 48) == -1
    assert plan.first_bad_live_value(torch.zeros(2, 32, 1, 1), torch.tensor([32, 33], dtype=torch.int32),
                                     None, 32) == 1
    with pytest.raises(ValueError, match=r"block_table\[0, 1\] = -1 is not a page of the pool \[0, 8\)"):
        plan.check_live_values(k, torch.tensor([17, 0], dtype=torch.int32), table, 48)
    with pytest.raises(ValueError, match=r"cache_seqlens\[1\] = -1 is negative"):
        plan.check_live_values(k, torch.tensor([0, -1], dtype=torch.int32), table, 48)


def test_capacity_past_the_int32_block_arithmetic_is_refused():
    """Lengths within a block of 2**31 would overflow the plan's int32 arithmetic (rules.h's
    kMaxKeys); a pool (stride-0, no memory) and table that could hold them are refused."""
    pages = _rules.MAX_KEYS // 256 + 1
    pool = torch.zeros(1, 256, 1, 64).expand(pages, 256, 1, 64)
    table = torch.zeros(1, pages, dtype=torch.int32)
    with pytest.raises(ValueError, match="capacity per sequence must be at most 2147483392"):
        plan.check_live_args(torch.zeros(1, 1, 1, 64), pool, None, table)


def _plan(lengths, knob=16, ctas=264, kv_heads=8, max_splits=33):
    return plan.plan_min_blocks(lengths, kv_heads=kv_heads, packed_rows=4, ctas=ctas, block_kv=64,
                                min_blocks_per_split=knob, max_splits=max_splits)


def test_load_aware_plan_chooses_among_the_knobs_multiples():
    """The choice is the knob times a power of two, at most kLivePlanChoices of them and splits
    of at most 4096 keys; the order of the batch does not matter; one item per CTA for equal
    lengths that fill the grid, the knob itself where a long sequence needs the short ones'
    fine splits to fill the CTAs beside it."""
    rng = random.Random(4)
    for _ in range(400):
        lengths = [rng.choice([0, 1, rng.randrange(1, 5000), rng.randrange(1, 300_000)])
                   for _ in range(rng.randint(1, 40))]
        knob = rng.choice([1, 2, 4, 8, 16, 64])
        ctas, max_splits = rng.randint(1, 528), rng.randint(1, tunables.MAX_SPLITS)
        chosen = _plan(lengths, knob, ctas, rng.choice([1, 8]), max_splits)
        choices = _rules.live_plan_choices(knob, 64)
        assert chosen in [knob << j for j in range(choices)]
        assert chosen == knob or chosen * 64 <= 4096
        assert _plan(rng.sample(lengths, len(lengths)), knob, ctas, 8, max_splits) == \
            _plan(lengths, knob, ctas, 8, max_splits)
    assert _plan([8192] * 16) == 64                   # 256 items of 4096 keys on 264 CTAs
    assert _plan([2048] * 64) == 32                   # whole sequences
    assert _plan([65536] + [1024] * 15) == 16
    assert _plan([4096], knob=4) == 4                 # 8 heads of one short sequence: fine splits
    assert _plan([8192] * 16, ctas=1056) == 16        # four times the CTAs: finer splits fill them


def _fits_one_wave(lengths, knob, ctas, kv_heads, max_splits):
    return sum(_rules.live_splits(n, 64, knob, max_splits) for n in lengths) * kv_heads <= ctas


def test_the_plan_chooses_the_least_estimate_of_its_knobs():
    """live_plan_knob_estimate is the estimate the plan compares: its choice is the least of the
    multiples' estimates, the knob itself unless that gains 5% or the knob's items fit the
    CTAs."""
    rng = random.Random(9)
    for _ in range(300):
        lengths = [rng.choice([0, 1, rng.randrange(1, 5000), rng.randrange(1, 300_000)])
                   for _ in range(rng.randint(1, 40))]
        knob, ctas, max_splits = rng.choice([1, 2, 4, 16]), rng.randint(1, 528), rng.randint(1, tunables.MAX_SPLITS)
        choices = _rules.live_plan_choices(knob, 64)
        estimates = [_rules.live_plan_knob_estimate(lengths, 8, ctas, 64, knob << j, max_splits)
                     for j in range(choices)]
        best = min(range(choices), key=lambda j: (estimates[j], j))
        want = knob << best if estimates[best] * 100 <= estimates[0] * 95 else knob
        if _fits_one_wave(lengths, knob, ctas, 8, max_splits):
            want = knob
        assert _plan(lengths, knob, ctas, 8, max_splits) == want
    with pytest.raises(ValueError, match="live_plan_knob_estimate needs"):
        _rules.live_plan_knob_estimate([5], 8, 0, 64, 1, 1)


def test_a_batch_whose_items_fit_the_ctas_keeps_the_knob():
    """One item per CTA at the knob as given: the plan keeps it without comparing estimates
    (one 32K sequence at 8 KV heads: 33 splits x 8 heads = 264 items on 264 CTAs; the estimate
    alone coarsens it to m16, where the load-aware launch ran 5.7% behind the knob as given,
    docs/PERFORMANCE.md)."""
    lengths, knob, max_splits = [32768], 4, 33
    assert _fits_one_wave(lengths, knob, 264, 8, max_splits)
    estimates = [_rules.live_plan_knob_estimate(lengths, 8, 264, 64, knob << j, max_splits)
                 for j in range(_rules.live_plan_choices(knob, 64))]
    assert min(estimates) * 100 <= estimates[0] * 95  # the estimate would take another knob
    assert _plan(lengths, knob, 264, 8, max_splits) == knob
    # One CTA fewer and the items no longer fit: the estimate chooses again.
    assert not _fits_one_wave(lengths, knob, 263, 8, max_splits)
    assert _plan(lengths, knob, 263, 8, max_splits) != knob


def test_the_plan_knob_as_given_without_ctas(gen):
    """The reference applies the load-aware plan only when given the launch's CTAs; with them
    its output is the explicit call's at the chosen knob, bit for bit."""
    lengths = [8192, 8192, 8192, 8192]
    q = torch.randn(4, 1, 8, 64, generator=gen)
    k = torch.randn(4, 8192, 2, 64, generator=gen)
    v = torch.randn(4, 8192, 2, 64, generator=gen)
    lens = torch.tensor(lengths, dtype=torch.int32)
    chosen = plan.plan_min_blocks(lengths, kv_heads=2, packed_rows=4, ctas=32, block_kv=64,
                                  min_blocks_per_split=1, max_splits=32)
    assert chosen > 1
    planned = splitkv_attention_ref(q, k, v, cache_seqlens=lens, max_splits=32, plan_ctas=32, return_lse=True)
    fixed = splitkv_attention_ref(q, k, v, cache_seqlens=lens, max_splits=32, min_blocks_per_split=chosen,
                                  return_lse=True)
    given = splitkv_attention_ref(q, k, v, cache_seqlens=lens, max_splits=32, return_lse=True)
    assert all(torch.equal(a, b) for a, b in zip(planned, fixed))
    assert not torch.equal(planned[0], given[0])
    # Without cache_seqlens every sequence holds the capacity and the kernel keeps the knob.
    pool_k, pool_v = (x.reshape(128, 256, 2, 64) for x in (k, v))
    table = torch.arange(128, dtype=torch.int32).view(4, 32)
    full = splitkv_attention_ref(q, pool_k, pool_v, block_table=table, max_splits=32, plan_ctas=32,
                                 return_lse=True)
    assert all(torch.equal(a, b) for a, b in zip(full, given))
