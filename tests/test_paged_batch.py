"""``paged_batch.make_paged_batch`` on the CPU: tables, lengths, NaN placement, and that every
sequence read back through either page table is exactly the keys that were drawn for it."""
import math

import pytest
import torch

from splitkv_tune.paged_batch import live_qkv, make_paged_batch

DIMS = dict(q_heads=4, kv_heads=2, head_dim=16, q_len=1)


def _make(lengths, page_size, **kw):
    return make_paged_batch(lengths, **DIMS, dtype="bf16", page_size=page_size, device="cpu", **kw)


def _drawn(lengths, seed=0, q_len=1):
    """The contiguous copy: the keys and values drawn for each sequence, padded to the longest."""
    dims = dict(DIMS, q_len=q_len)
    q, k_live, v_live = live_qkv(lengths, **dims, dtype="bf16", device="cpu", seed=seed)
    out = []
    for live in (k_live, v_live):
        padded = torch.zeros(len(lengths), max(lengths), *live.shape[1:], dtype=live.dtype)
        for b, chunk in enumerate(live.split(list(lengths))):
            padded[b, :len(chunk)] = chunk
        out.append(padded)
    return q, out[0], out[1]


CASES = [(lengths, page_size, extra) for page_size in (1, 16, 64)
         for lengths, extra in (((1,), 0), ((70, 5, 64, 129), 0), ((3, 200, 1, 16, 17), 3))]


@pytest.mark.parametrize("lengths,page_size,extra", CASES)
def test_pages_hold_exactly_the_drawn_keys(lengths, page_size, extra):
    batch = _make(lengths, page_size, seed=5, extra_pages=extra)
    q, k, v = _drawn(lengths, seed=5)
    pages = [math.ceil(n / page_size) for n in lengths]
    num_pages = sum(pages) + extra
    assert batch.k_pool.shape == batch.v_pool.shape == (num_pages, page_size, 2, 16)
    assert batch.k_pool.dtype == torch.bfloat16 and batch.page_size == page_size
    assert torch.equal(batch.q, q)
    assert batch.block_table.dtype == batch.cache_seqlens.dtype == torch.int32
    assert batch.block_table.shape == (len(lengths), max(pages))
    assert batch.cache_seqlens.tolist() == list(lengths)
    assert batch.live_kv_bytes == sum(lengths) * 2 * 16 * 2 * 2
    owned = [batch.block_table[b, :p].tolist() for b, p in enumerate(pages)]
    flat = [page for row in owned for page in row]
    assert len(set(flat)) == len(flat) == sum(pages)  # no page is shared
    unused = sorted(set(range(num_pages)) - set(flat))
    assert len(unused) == extra
    for b, n in enumerate(lengths):
        rows = batch.block_table[b, :pages[b]].long()
        for pool, drawn in ((batch.k_pool, k), (batch.v_pool, v)):
            seq = pool[rows].flatten(0, 1)
            assert torch.equal(seq[:n], drawn[b, :n])
            assert seq[n:].isnan().all()  # the rest of the last page
        padding = batch.block_table[b, pages[b]:].tolist()
        if extra:
            assert len(set(padding)) <= 1 and set(padding) <= set(unused)
        else:
            assert set(padding) <= {0}
    for page in unused:
        assert batch.k_pool[page].isnan().all() and batch.v_pool[page].isnan().all()
    k_pad, v_pad = batch.padded_kv()
    assert torch.equal(k_pad, k) and torch.equal(v_pad, v)


@pytest.mark.parametrize("lengths,page_size,extra", CASES)
def test_flashinfer_view_reads_the_same_pages(lengths, page_size, extra):
    batch = _make(lengths, page_size, extra_pages=extra)
    fi = batch.flashinfer
    assert fi.k_pages is batch.k_pool and fi.v_pages is batch.v_pool
    for t in (fi.indptr, fi.indices, fi.last_page_len):
        assert t.dtype == torch.int32
    pages = [math.ceil(n / page_size) for n in lengths]
    assert fi.indptr.tolist() == [sum(pages[:b]) for b in range(len(lengths) + 1)]
    for b, n in enumerate(lengths):
        rows = fi.indices[fi.indptr[b]:fi.indptr[b + 1]]
        assert torch.equal(rows, batch.block_table[b, :pages[b]])
        last = int(fi.last_page_len[b])
        assert 1 <= last <= page_size and (pages[b] - 1) * page_size + last == n


def test_pages_are_shuffled_by_seed_and_in_order_without_shuffle():
    lengths = (300, 40, 129)
    plain = _make(lengths, 16, shuffle=False)
    assert plain.flashinfer.indices.tolist() == list(range(sum(math.ceil(n / 16) for n in lengths)))
    a, b = _make(lengths, 16, seed=1), _make(lengths, 16, seed=1)
    assert torch.equal(a.block_table, b.block_table) and torch.equal(a.k_pool.nan_to_num(), b.k_pool.nan_to_num())
    assert not torch.equal(a.block_table, plain.block_table)
    assert not torch.equal(_make(lengths, 16, seed=2).block_table, a.block_table)


def test_padding_entries_point_at_a_nan_page_when_there_is_one():
    batch = _make((100, 3), 16, extra_pages=2)
    pad = batch.block_table[1, 1:].unique()
    assert pad.numel() == 1 and batch.k_pool[int(pad)].isnan().all()
    assert not (batch.block_table[0] == pad).any()
    assert _make((100, 3), 16).block_table[1, 1:].eq(0).all()


def test_copy_is_new_memory_with_the_same_contents():
    batch = _make((33, 7), 16, extra_pages=1)
    other = batch.copy()
    for a, b in ((batch.q, other.q), (batch.k_pool, other.k_pool), (batch.v_pool, other.v_pool)):
        assert a.data_ptr() != b.data_ptr()
        assert torch.equal(a.nan_to_num(), b.nan_to_num())
    assert other.flashinfer.k_pages is other.k_pool and other.flashinfer.v_pages is other.v_pool
    assert other.block_table is batch.block_table


def test_widened_batch_reads_the_same_keys_behind_a_wider_table():
    from splitkv_tune import plan
    batch = _make((100, 3, 40), 16)
    wide = batch.widened(8)
    assert wide.block_table.shape == (3, 8 * batch.block_table.shape[1])
    assert wide.k_pool.shape[0] >= wide.block_table.shape[1] and wide.k_pool.shape == wide.v_pool.shape
    assert torch.equal(wide.block_table[:, :batch.block_table.shape[1]], batch.block_table)
    assert wide.block_table[:, batch.block_table.shape[1]:].eq(0).all()
    assert wide.k_pool[batch.k_pool.shape[0]:].isnan().all()
    for b, n in enumerate(batch.lengths):
        for old_pool, new_pool in ((batch.k_pool, wide.k_pool), (batch.v_pool, wide.v_pool)):
            assert torch.equal(plan.live_keys(new_pool, b, n, wide.block_table),
                               plan.live_keys(old_pool, b, n, batch.block_table))
    assert wide.flashinfer.k_pages is wide.k_pool


@pytest.mark.parametrize("kwargs,match", [
    (dict(lengths=()), "at least one sequence"),
    (dict(lengths=(4, 0)), "at least 1, got 0"),
    (dict(lengths=(4,), page_size=0), "page_size must be at least 1"),
    (dict(lengths=(4,), extra_pages=-1), "extra_pages must be >= 0"),
])
def test_bad_arguments(kwargs, match):
    args = dict(page_size=16) | kwargs
    with pytest.raises(ValueError, match=match):
        _make(args.pop("lengths"), args.pop("page_size"), **args)
