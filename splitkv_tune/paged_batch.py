"""One paged, variable-length batch on a device, in the layouts of our kernel and FlashInfer.

Sequence ``b`` holds ``lengths[b]`` keys in ``ceil(lengths[b] / page_size)`` pages of a pool
``(num_pages, page_size, Hkv, D)`` (NHD). The pages of all sequences are a permutation of the
pool (``shuffle``), so neighbouring pages of a sequence are not neighbours in memory, as in a
server's cache after some turnover. Our kernel reads the pages through ``block_table`` (int32
``[B, max_pages]``) and ``cache_seqlens``; FlashInfer reads the same pools through its CSR view
(``indptr``/``indices``/``last_page_len``, :class:`peers_flashinfer.PagedKV`).

Everything that is not a live key or value is NaN: the rest of each sequence's last page and
the ``extra_pages`` no sequence owns. A kernel that reads outside the live keys, or weighs them
by zero instead of skipping them, then gives NaN and fails its check.

The keys and values are drawn by :func:`live_qkv` from ``seed`` alone (not from the page
placement), so a test can draw them again and compare.
"""
from __future__ import annotations

import dataclasses
import math

import torch

from splitkv_tune import bench, plan
from splitkv_tune.peers_flashinfer import PagedKV


def _torch_dtype(dtype) -> torch.dtype:
    return bench.TORCH_DTYPES.get(dtype, dtype)


def live_qkv(lengths, *, q_heads: int, kv_heads: int, head_dim: int, q_len: int, dtype, device,
             seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``q`` ``(B, q_len, Hq, D)`` and the live keys and values of every sequence, one after the
    other: ``(sum(lengths), Hkv, D)`` (sequence ``b`` is rows ``sum(lengths[:b])`` on)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    dtype = _torch_dtype(dtype)
    q = torch.randn(len(lengths), q_len, q_heads, head_dim, generator=gen, device=device, dtype=dtype)
    kv = [torch.randn(sum(lengths), kv_heads, head_dim, generator=gen, device=device, dtype=dtype)
          for _ in range(2)]
    return q, kv[0], kv[1]


@dataclasses.dataclass
class PagedBatch:
    """The inputs of one paged call, and what the benchmark reports about them."""

    lengths: tuple[int, ...]
    q: torch.Tensor  # (B, q_len, Hq, D)
    k_pool: torch.Tensor  # (num_pages, page_size, Hkv, D)
    v_pool: torch.Tensor
    block_table: torch.Tensor  # int32 (B, max_pages)
    cache_seqlens: torch.Tensor  # int32 (B,)
    flashinfer: PagedKV  # the same pools in FlashInfer's CSR page table
    live_kv_bytes: int  # the keys and values a kernel must read: sum(lengths) * Hkv * D * 2 * elt

    @property
    def page_size(self) -> int:
        return int(self.k_pool.shape[1])

    @property
    def max_len(self) -> int:
        return max(self.lengths)

    def padded_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Contiguous ``(B, max_len, Hkv, D)`` copies of k and v, gathered through the block
        table, zero past each sequence's length (a padded batch, as an unpaged peer reads it)."""
        out = []
        for pool in (self.k_pool, self.v_pool):
            padded = pool.new_zeros(len(self.lengths), self.max_len, *pool.shape[2:])
            for b, n in enumerate(self.lengths):
                padded[b, :n] = plan.live_keys(pool, b, n, self.block_table)[0]
            out.append(padded)
        return out[0], out[1]

    def copy(self) -> "PagedBatch":
        """The same batch in new memory (q and the pools; the tables are shared): the input
        sets a timing rotates over so that no call finds the last one's keys in L2."""
        k_pool, v_pool = self.k_pool.clone(), self.v_pool.clone()
        return dataclasses.replace(
            self, q=self.q.clone(), k_pool=k_pool, v_pool=v_pool,
            flashinfer=self.flashinfer._replace(k_pages=k_pool, v_pages=v_pool))


    def widened(self, mult: int) -> "PagedBatch":
        """The same batch behind a block table ``mult`` times wider, as a larger cache capacity
        makes it: the extra entries are page 0 (never read), and the pools gain NaN pages up to
        the table's width, which a pool must at least have."""
        batch, width = self.block_table.shape
        table = torch.cat([self.block_table, self.block_table.new_zeros(batch, width * (mult - 1))], 1)
        extra = max(0, table.shape[1] - self.k_pool.shape[0])

        def pad(pool):
            return torch.cat([pool, pool.new_full((extra, *pool.shape[1:]), float("nan"))]) if extra else pool
        k_pool, v_pool = pad(self.k_pool), pad(self.v_pool)
        return dataclasses.replace(self, k_pool=k_pool, v_pool=v_pool, block_table=table,
                                   flashinfer=self.flashinfer._replace(k_pages=k_pool, v_pages=v_pool))


def _check(lengths, page_size: int, extra_pages: int) -> tuple[int, ...]:
    lengths = tuple(int(n) for n in lengths)
    if not lengths:
        raise ValueError("a batch needs at least one sequence")
    if min(lengths) < 1:
        raise ValueError(f"every length must be at least 1, got {min(lengths)}")
    if page_size < 1:
        raise ValueError(f"page_size must be at least 1, got {page_size}")
    if extra_pages < 0:
        raise ValueError(f"extra_pages must be >= 0, got {extra_pages}")
    return lengths


def make_paged_batch(lengths, *, q_heads: int, kv_heads: int, head_dim: int, q_len: int, dtype,
                     page_size: int, device, seed: int = 0, shuffle: bool = True,
                     extra_pages: int = 0) -> PagedBatch:
    """Draw q, k and v (:func:`live_qkv`) and lay k and v out in shuffled pages.

    The pool holds every sequence's pages plus ``extra_pages`` unused (NaN) ones. A sequence's
    block-table row lists its pages, then pads to ``max_pages`` with the first unused page
    (NaN) when there is one, else with page 0; no kernel may read a padding entry.
    """
    lengths = _check(lengths, page_size, extra_pages)
    device = torch.device(device)
    q, k_live, v_live = live_qkv(lengths, q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim,
                                 q_len=q_len, dtype=dtype, device=device, seed=seed)
    pages = torch.tensor([math.ceil(n / page_size) for n in lengths])
    used = int(pages.sum())
    num_pages = used + extra_pages
    order = (torch.randperm(num_pages, generator=torch.Generator().manual_seed(seed)) if shuffle
             else torch.arange(num_pages))
    first_page = torch.cumsum(pages, 0) - pages  # where each sequence's pages start in `order`
    max_pages = int(pages.max())
    column = torch.arange(max_pages)
    owned = column[None, :] < pages[:, None]
    pad = int(order[used]) if extra_pages else 0
    table = torch.where(owned, order[(first_page[:, None] + column).clamp(max=num_pages - 1)], pad)

    # Pool slot of every live token: token t of sequence b is at page table[b, t // page_size],
    # row t % page_size.
    lens = torch.tensor(lengths)
    seq = torch.repeat_interleave(torch.arange(len(lengths)), lens)
    pos = torch.arange(int(lens.sum())) - torch.repeat_interleave(torch.cumsum(lens, 0) - lens, lens)
    slot = (table[seq, pos // page_size] * page_size + pos % page_size).to(device)

    def pool(live: torch.Tensor) -> torch.Tensor:
        out = torch.full((num_pages, page_size, kv_heads, head_dim), float("nan"),
                         dtype=live.dtype, device=device)
        out.view(num_pages * page_size, kv_heads, head_dim)[slot] = live
        return out

    k_pool, v_pool = pool(k_live), pool(v_live)
    del k_live, v_live
    int32 = dict(dtype=torch.int32, device=device)
    flashinfer = PagedKV(
        k_pages=k_pool, v_pages=v_pool,
        indptr=torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(pages, 0)]).to(**int32),
        indices=order[:used].to(**int32),
        last_page_len=(lens - (pages - 1) * page_size).to(**int32))
    return PagedBatch(
        lengths=lengths, q=q, k_pool=k_pool, v_pool=v_pool, block_table=table.to(**int32),
        cache_seqlens=lens.to(**int32), flashinfer=flashinfer,
        live_kv_bytes=sum(lengths) * kv_heads * head_dim * 2 * k_pool.element_size())
