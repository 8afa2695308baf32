"""FlashInfer (flashinfer-python 0.7.2.post1) as optional peers of ``compare``.

Every peer reads one paged copy of the inputs: k and v are copied into page pools of shape
``(num_pages, PAGE_SIZE, Hkv, D)`` (NHD layout, ``PAGE_SIZE = 64`` tokens a page) with an
identity page table, so the pages lie in memory in the order of the contiguous k/v our kernel
reads and the comparison is of kernels, not of page placement (``paged_cache`` can also
shuffle the table).

* ``flashinfer_decode``: ``BatchDecodeWithPagedKVCacheWrapper(use_tensor_cores=False)``,
  FlashInfer's CUDA-core decode kernel. Sq == 1 only.
* ``flashinfer_decode_tc``: the same wrapper with ``use_tensor_cores=True`` (the fa2 prefill
  kernel run on the decode rows; FlashInfer's choice for large GQA groups). Sq == 1 only.
* ``flashinfer_prefill``: ``BatchPrefillWithPagedKVCacheWrapper(backend="fa2")``, any Sq;
  its causal mask is bottom-right aligned like ours.
* ``flashinfer_xqa``: ``flashinfer.decode.xqa_batch_decode_with_kv_cache``, TensorRT-LLM's
  XQA decode kernel (SM90, SM100 and SM120 only). Sq == 1 only.

``paged_launcher`` plans any of them for a paged batch of given lengths and page size (the
batches of ``compare_batch``); ``factory`` calls the same planning with equal lengths.

What a timed ``run()`` is: the kernel launches FlashInfer issues for the planned batch (its
split-KV merge included, where it splits), writing into an output buffer made in ``make``.
Not timed (all in ``make``): the page-pool copies, the page table, the workspaces, the wrapper
and its ``plan()`` (host-side scheduling and its copies to the device), and one warm-up call
(JIT compilation on first use of a kernel configuration, FlashInfer's per-device caches).
``plan()`` depends only on the page table and lengths, which every input set of one shape
shares, so one wrapper is planned per ``factory`` call and runs every input set, the way
FlashInfer serves the layers of a model.

flashinfer is imported only by ``available`` and ``factory``; importing this module never
imports it.
"""
from __future__ import annotations

import math
from typing import Callable, NamedTuple

import torch

from splitkv_tune.tunables import Shape

NAMES = ("flashinfer_decode", "flashinfer_decode_tc", "flashinfer_prefill", "flashinfer_xqa")
DECODE_ONLY = ("flashinfer_decode", "flashinfer_decode_tc", "flashinfer_xqa")
PAGE_SIZE = 64
# FlashInfer's recommended float workspace (split-KV partials). XQA takes its first 8 MiB as
# semaphores and the rest as scratch; both kernels need it zeroed before first use, and the
# XQA kernel leaves its semaphores zero again after every launch.
WORKSPACE_BYTES = 128 * 1024 * 1024
DTYPES = ("fp16", "bf16")
NOT_INSTALLED = ("flashinfer is not installed (../shared/tools/flashinfer-wheelhouse.sh "
                 "brings it to an offline GPU host)")


class PagedKV(NamedTuple):
    """k and v in page pools, and the page table that FlashInfer's paged kernels read.

    Page ``p`` of sequence ``b`` is pool page ``indices[indptr[b] + p]``; the last page of
    each sequence holds ``last_page_len[b]`` tokens (1 to the page size), the rest is never
    read (``paged_cache`` zeroes it, ``paged_batch`` fills it with NaN).
    """

    k_pages: torch.Tensor  # (num_pages, page_size, Hkv, D)
    v_pages: torch.Tensor
    indptr: torch.Tensor  # int32 (B + 1,): first entry of each sequence in indices
    indices: torch.Tensor  # int32 (num_pages,): pool page of each (sequence, page)
    last_page_len: torch.Tensor  # int32 (B,)

    @property
    def block_table(self) -> torch.Tensor:
        """int32 ``(B, pages_per_seq)``: the same table as a dense block table (XQA's form),
        a view of ``indices`` when every sequence has the same number of pages (``paged_cache``)."""
        return self.indices.view(self.last_page_len.numel(), -1)


def paged_cache(k: torch.Tensor, v: torch.Tensor, page_size: int = PAGE_SIZE,
                shuffle_seed: int | None = None) -> PagedKV:
    """Copy ``(B, Sk, Hkv, D)`` k and v into NHD page pools, with an identity page table, or
    a random permutation of the pool pages when ``shuffle_seed`` is given."""
    batch, kv_len, kv_heads, head_dim = k.shape
    if v.shape != k.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} differ in shape")
    if kv_len < 1 or page_size < 1:
        raise ValueError(f"need kv_len >= 1 and page_size >= 1, got {kv_len} and {page_size}")
    pages_per_seq = math.ceil(kv_len / page_size)
    num_pages = batch * pages_per_seq
    pool_page = torch.arange(num_pages)
    if shuffle_seed is not None:
        pool_page = torch.randperm(num_pages, generator=torch.Generator().manual_seed(shuffle_seed))

    def to_pages(x: torch.Tensor) -> torch.Tensor:
        padded = x.new_empty(batch, pages_per_seq * page_size, kv_heads, head_dim)
        padded[:, :kv_len] = x
        padded[:, kv_len:] = 0
        pages = padded.view(num_pages, page_size, kv_heads, head_dim)
        if shuffle_seed is None:
            return pages
        pool = torch.empty_like(pages)
        pool[pool_page.to(x.device)] = pages
        return pool

    device = k.device
    last = kv_len - (pages_per_seq - 1) * page_size
    return PagedKV(
        k_pages=to_pages(k), v_pages=to_pages(v),
        indptr=(torch.arange(batch + 1, dtype=torch.int32) * pages_per_seq).to(device),
        indices=pool_page.to(dtype=torch.int32, device=device),
        last_page_len=torch.full((batch,), last, dtype=torch.int32, device=device))


def _import_flashinfer():
    import flashinfer
    import flashinfer.decode  # xqa_batch_decode_with_kv_cache lives here
    return flashinfer


def _import_problem(err: Exception) -> str:
    if isinstance(err, ModuleNotFoundError) and (err.name or "").split(".")[0] == "flashinfer":
        return NOT_INSTALLED
    text = str(err).strip().splitlines()
    return f"flashinfer cannot be imported ({type(err).__name__}: {text[0] if text else ''})"


def available() -> str | None:
    """None when flashinfer imports, else a one-line reason why not."""
    try:
        _import_flashinfer()
    except Exception as err:  # a broken install can raise anything (OSError from a .so, ...)
        return _import_problem(err)
    return None


def check_supported(name: str, shape: Shape) -> None:
    """Raise ``ValueError`` naming why peer ``name`` cannot run ``shape``."""
    if name not in NAMES:
        raise ValueError(f"unknown FlashInfer peer {name!r}; choose from {NAMES}")
    if shape.dtype not in DTYPES:
        raise ValueError(f"{name} runs fp16 or bf16, got {shape.dtype!r}")
    for field in ("batch", "q_heads", "kv_heads", "q_len", "kv_len", "head_dim"):
        if getattr(shape, field) < 1:
            raise ValueError(f"{name}: {field} must be positive, got {getattr(shape, field)}")
    if shape.q_heads % shape.kv_heads:
        raise ValueError(f"{name}: q_heads ({shape.q_heads}) must be a multiple of "
                         f"kv_heads ({shape.kv_heads})")
    if name in DECODE_ONLY and shape.q_len != 1:
        raise ValueError(f"{name} is decode-only (Sq == 1), got Sq = {shape.q_len}; "
                         "flashinfer_prefill runs Sq > 1")
    # fa2 tiles the head dim in MMA steps of 16 (prefill.cuh: NUM_MMA_D_QK = HEAD_DIM_QK / 16);
    # XQA checks the same, and at most 512 (flashinfer/jit/xqa.py, gen_xqa_module).
    if shape.head_dim % 16:
        raise ValueError(f"{name} needs head_dim a multiple of 16, got {shape.head_dim}")
    if name == "flashinfer_xqa" and shape.head_dim > 512:
        raise ValueError(f"{name} supports head_dim up to 512, got {shape.head_dim}")
    if name == "flashinfer_xqa" and shape.head_dim > 256 and shape.group > 16:
        raise ValueError(f"{name} with head_dim > 256 needs a GQA group of at most 16, "
                         f"got {shape.group}")


# A launcher runs one input set: launch(q_rows, (k_pages, v_pages), out_rows), with q and the
# output as (B * Sq, Hq, D) rows, FlashInfer's ragged-query layout.
Launch = Callable[[torch.Tensor, tuple, torch.Tensor], object]


def _wrapper_launch(wrapper) -> Launch:
    """A planned FlashInfer wrapper's ``run`` as a launcher, into the caller's output rows."""
    def launch(q_rows, kv_pages, out_rows):
        return wrapper.run(q_rows, kv_pages, out=out_rows)
    return launch


def _decode_launch(flashinfer, shape: Shape, scale: float, cache: PagedKV,
                   use_tensor_cores: bool) -> Launch:
    dtype, device, page_size = cache.k_pages.dtype, cache.k_pages.device, cache.k_pages.shape[1]
    workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
    # backend="fa2" pins FlashInfer's own kernels: "auto" may route to cuDNN on SM100.
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
        workspace, "NHD", use_tensor_cores=use_tensor_cores, backend="fa2")
    wrapper.plan(cache.indptr, cache.indices, cache.last_page_len, shape.q_heads,
                 shape.kv_heads, shape.head_dim, page_size, pos_encoding_mode="NONE",
                 q_data_type=dtype, kv_data_type=dtype, sm_scale=scale)
    return _wrapper_launch(wrapper)


def _prefill_launch(flashinfer, shape: Shape, scale: float, cache: PagedKV) -> Launch:
    dtype, device, page_size = cache.k_pages.dtype, cache.k_pages.device, cache.k_pages.shape[1]
    workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
    wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD", backend="fa2")
    qo_indptr = (torch.arange(shape.batch + 1, dtype=torch.int32) * shape.q_len).to(device)
    # FlashInfer's causal mask keeps key j for query i when j <= i + kv_len - qo_len, i.e.
    # bottom-right aligned as ours (include/flashinfer/attention/prefill.cuh, the
    # kv_idx + qo_len > kv_len + q_idx test in the mask of the fa2 kernel); with Sq == 1 it
    # masks nothing.
    wrapper.plan(qo_indptr, cache.indptr, cache.indices, cache.last_page_len, shape.q_heads,
                 shape.kv_heads, shape.head_dim, page_size, causal=shape.causal,
                 pos_encoding_mode="NONE", sm_scale=scale, q_data_type=dtype,
                 kv_data_type=dtype)
    return _wrapper_launch(wrapper)


def _xqa_launch(flashinfer, shape: Shape, scale: float, cache: PagedKV, block_table,
                seq_lens) -> Launch:
    workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=cache.k_pages.device)
    xqa = flashinfer.decode.xqa_batch_decode_with_kv_cache

    def launch(q_rows, kv_pages, out_rows):
        # bmm1_scale is the whole softmax scale on Q.K^T: the wrapper passes
        # q_scale = bmm1_scale * sqrt(D) and the kernel multiplies by rsqrt(D) (xqa/mha.cu).
        return xqa(q_rows, kv_pages, workspace, block_table, seq_lens, shape.kv_len,
                   bmm1_scale=scale, bmm2_scale=1.0, out=out_rows, kv_layout="NHD")
    return launch


def _plan(flashinfer, name: str, shape: Shape, scale: float, cache: PagedKV, block_table,
          seq_lens) -> Launch:
    if name == "flashinfer_prefill":
        return _prefill_launch(flashinfer, shape, scale, cache)
    if name == "flashinfer_xqa":
        return _xqa_launch(flashinfer, shape, scale, cache, block_table, seq_lens)
    return _decode_launch(flashinfer, shape, scale, cache,
                          use_tensor_cores=name == "flashinfer_decode_tc")


def _flashinfer():
    """flashinfer, or ``ImportError`` with ``available``'s one-line reason."""
    try:
        return _import_flashinfer()
    except Exception as err:  # compare records an ImportError as a failed peer, with this text
        raise ImportError(_import_problem(err)) from err


def paged_launcher(name: str, shape: Shape, scale: float, cache: PagedKV, *,
                   block_table: torch.Tensor, seq_lens: torch.Tensor) -> Launch:
    """Peer ``name`` planned for one paged batch of any lengths: sequence ``b`` has
    ``seq_lens[b]`` keys (int32 on the device) in the pages ``cache`` and ``block_table`` (int32
    ``(B, max_pages)``, XQA's form of the same table) list; ``shape.kv_len`` is the longest,
    every sequence has ``shape.q_len`` queries. The page size is the pools'.

    The launcher is not yet warmed up: its first call may JIT-compile. ``ValueError`` for a
    shape the peer cannot run (before importing flashinfer), ``ImportError`` without it.
    """
    check_supported(name, shape)
    return _plan(_flashinfer(), name, shape, scale, cache, block_table, seq_lens)


def factory(name: str, shape: Shape, scale: float) -> Callable:
    """``make(q, k, v)`` for ``bench.ShapeBench.measure_launcher``: it pages k/v and returns a
    zero-argument ``run()`` whose result is the output in ``(B, Sq, Hq, D)`` layout.

    Raises ``ValueError`` for a name or shape the peer cannot run (before importing
    flashinfer) and ``ImportError`` when flashinfer cannot be imported.
    """
    check_supported(name, shape)
    flashinfer = _flashinfer()
    shared: dict[str, Launch] = {}

    def make(q, k, v):
        batch, q_len, q_heads, head_dim = q.shape
        cache = paged_cache(k, v, PAGE_SIZE)
        kv_pages = (cache.k_pages, cache.v_pages)
        q_rows = q.reshape(batch * q_len, q_heads, head_dim)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        out_rows = out.view(batch * q_len, q_heads, head_dim)
        launch = shared.get("launch")
        if launch is None:
            # The identity tables of one shape are equal: the first input set's plan serves all.
            # XQA reads seq_lens as uint32; int32 holds the same bits for these lengths.
            seq_lens = torch.full((batch,), shape.kv_len, dtype=torch.int32, device=q.device)
            launch = shared["launch"] = _plan(flashinfer, name, shape, scale, cache,
                                              cache.block_table, seq_lens)
            # Warm-up: JIT compilation / module load and FlashInfer's lazy per-device buffers
            # happen here, never in a timed or captured call.
            launch(q_rows, kv_pages, out_rows)

        def run():
            launch(q_rows, kv_pages, out_rows)
            return out
        return run
    return make
