"""CPU tests of ``splitkv_tune.peers_flashinfer`` (flashinfer itself is not needed).

* ``paged_cache``: gathering the pools back through the page table gives k/v exactly.
* ``available`` / ``factory``: clear reasons when flashinfer cannot be imported; names and
  shapes a peer cannot run are refused with ``ValueError`` before flashinfer is imported.
* The wiring of ``make``/``run`` against a stand-in ``flashinfer`` whose entry points take
  exactly the 0.7.2 parameter names used and compute paged attention the way FlashInfer
  defines its page table and causal mask: outputs match ``reference.attention_ref``, plan
  runs once per shape, and ``run()`` never plans.
"""
from __future__ import annotations

import itertools
import math
import os
import subprocess
import sys
import types

import pytest
import torch

from splitkv_tune import peers_flashinfer as pf
from splitkv_tune.reference import attention_ref
from splitkv_tune.tunables import Shape


def _shape(q_len=1, kv_len=70, batch=2, q_heads=4, kv_heads=2, head_dim=64, causal=False,
           dtype="bf16"):
    return Shape(dtype, head_dim, batch, q_heads, kv_heads, q_len, kv_len, causal)


def _kv(batch, kv_len, heads, head_dim, dtype=torch.bfloat16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(batch, kv_len, heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(batch, kv_len, heads, head_dim, generator=gen).to(dtype)
    return k, v


def _gather(pages, cache, batch, kv_len):
    """Sequence ``b`` read back through the table as FlashInfer reads it."""
    seqs = []
    for b in range(batch):
        table = cache.indices[cache.indptr[b]:cache.indptr[b + 1]].long()
        seqs.append(pages[table].flatten(0, 1)[:kv_len])
    return torch.stack(seqs)


# --- paged_cache ---------------------------------------------------------------------------

@pytest.mark.parametrize("batch,kv_len,page_size,shuffle_seed", [
    (b, s, p, seed) for b, s, p, seed in itertools.product(
        (1, 3), (1, 63, 64, 65, 200), (16, 64), (None, 0, 7))])
def test_paged_cache_round_trip(batch, kv_len, page_size, shuffle_seed):
    k, v = _kv(batch, kv_len, 2, 16, seed=kv_len)
    cache = pf.paged_cache(k, v, page_size, shuffle_seed=shuffle_seed)
    pages_per_seq = math.ceil(kv_len / page_size)
    num_pages = batch * pages_per_seq
    assert cache.k_pages.shape == cache.v_pages.shape == (num_pages, page_size, 2, 16)
    assert cache.k_pages.dtype == k.dtype
    for t in (cache.indptr, cache.indices, cache.last_page_len):
        assert t.dtype == torch.int32
    assert cache.indptr.tolist() == [b * pages_per_seq for b in range(batch + 1)]
    assert sorted(cache.indices.tolist()) == list(range(num_pages))
    assert cache.last_page_len.tolist() == [kv_len - (pages_per_seq - 1) * page_size] * batch
    assert all(1 <= n <= page_size for n in cache.last_page_len.tolist())
    # FlashInfer's length of a sequence: (pages - 1) * page_size + last_page_len.
    lens = (cache.indptr[1:] - cache.indptr[:-1] - 1) * page_size + cache.last_page_len
    assert lens.tolist() == [kv_len] * batch
    assert torch.equal(_gather(cache.k_pages, cache, batch, kv_len), k)
    assert torch.equal(_gather(cache.v_pages, cache, batch, kv_len), v)
    # The rest of each last page is zero, so nothing stale can leak in if it were read.
    tail = _gather(cache.k_pages, cache, batch, pages_per_seq * page_size)[:, kv_len:]
    assert not tail.any()
    assert torch.equal(cache.block_table, cache.indices.view(batch, pages_per_seq))


def test_paged_cache_identity_and_shuffled_tables():
    k, v = _kv(4, 640, 1, 16)
    identity = pf.paged_cache(k, v, 64)
    assert identity.indices.tolist() == list(range(40))
    shuffled = pf.paged_cache(k, v, 64, shuffle_seed=3)
    assert shuffled.indices.tolist() != list(range(40))
    again = pf.paged_cache(k, v, 64, shuffle_seed=3)
    assert torch.equal(again.indices, shuffled.indices)
    assert torch.equal(again.k_pages, shuffled.k_pages)
    # An identity table lays the pool out as the contiguous k, padded to whole pages.
    assert torch.equal(identity.k_pages.view(4, 640, 1, 16), k)


def test_paged_cache_rejects_bad_inputs():
    k, v = _kv(1, 8, 1, 16)
    with pytest.raises(ValueError, match="differ in shape"):
        pf.paged_cache(k, v[:, :4], 64)
    with pytest.raises(ValueError, match="kv_len >= 1"):
        pf.paged_cache(k[:, :0], v[:, :0], 64)


# --- available / factory without flashinfer ------------------------------------------------

def test_available_when_not_installed(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # `import flashinfer` now fails
    assert pf.available() == pf.NOT_INSTALLED
    assert "not installed" in pf.NOT_INSTALLED and "\n" not in pf.NOT_INSTALLED
    with pytest.raises(ImportError, match="not installed"):
        pf.factory("flashinfer_prefill", _shape(), 0.125)


def test_available_here_names_the_reason():
    reason = pf.available()
    if reason is None:
        pytest.skip("flashinfer is installed here")
    assert reason == pf.NOT_INSTALLED


@pytest.mark.parametrize("error,expected", [
    (OSError("libcuda.so.1: cannot open shared object file\nmore"),
     "flashinfer cannot be imported (OSError: libcuda.so.1: cannot open shared object file)"),
    (ModuleNotFoundError("No module named 'tvm_ffi'", name="tvm_ffi"),
     "flashinfer cannot be imported (ModuleNotFoundError: No module named 'tvm_ffi')"),
    (ModuleNotFoundError("No module named 'flashinfer.decode'", name="flashinfer.decode"),
     pf.NOT_INSTALLED),
])
def test_broken_install_reason(monkeypatch, error, expected):
    def broken():
        raise error
    monkeypatch.setattr(pf, "_import_flashinfer", broken)
    assert pf.available() == expected
    # compare records an ImportError as a failed peer with this reason.
    with pytest.raises(ImportError) as info:
        pf.factory("flashinfer_decode", _shape(), 0.125)
    assert str(info.value) == expected


def _refuse_import():
    raise AssertionError("flashinfer was imported before the shape was checked")


@pytest.mark.parametrize("name,shape,match", [
    ("flashinfer_nope", _shape(), "unknown FlashInfer peer"),
    ("sdpa_flash", _shape(), "unknown FlashInfer peer"),
    ("flashinfer_decode", _shape(q_len=4), "decode-only"),
    ("flashinfer_decode_tc", _shape(q_len=2, causal=True), "decode-only"),
    ("flashinfer_xqa", _shape(q_len=16), "decode-only"),
    ("flashinfer_prefill", _shape(head_dim=72), "multiple of 16"),
    ("flashinfer_xqa", _shape(head_dim=72), "multiple of 16"),
    ("flashinfer_xqa", _shape(head_dim=576), "up to 512"),
    ("flashinfer_xqa", _shape(head_dim=512, q_heads=64, kv_heads=2), "at most 16"),
    ("flashinfer_prefill", _shape(q_heads=6, kv_heads=4), "multiple of kv_heads"),
    ("flashinfer_decode", _shape(dtype="fp32"), "fp16 or bf16"),
    ("flashinfer_prefill", _shape(kv_len=0), "kv_len must be positive"),
])
def test_factory_refuses_before_importing(monkeypatch, name, shape, match):
    monkeypatch.setattr(pf, "_import_flashinfer", _refuse_import)
    with pytest.raises(ValueError, match=match):
        pf.factory(name, shape, 0.125)


@pytest.mark.parametrize("name,shape", [
    (n, _shape()) for n in pf.NAMES] + [
    ("flashinfer_prefill", _shape(q_len=8, causal=True)),
    ("flashinfer_xqa", _shape(head_dim=128, q_heads=32, kv_heads=4)),
])
def test_supported_shapes_pass_the_check(name, shape):
    pf.check_supported(name, shape)


def test_decode_only_reason_points_to_prefill():
    with pytest.raises(ValueError) as info:
        pf.check_supported("flashinfer_decode", _shape(q_len=3))
    assert "Sq = 3" in str(info.value) and "flashinfer_prefill" in str(info.value)


def test_module_import_does_not_import_flashinfer():
    code = ("import sys, splitkv_tune.peers_flashinfer; "
            "assert not [m for m in sys.modules if m.split('.')[0] == 'flashinfer']")
    subprocess.run([sys.executable, "-c", code], check=True, env=dict(os.environ))


# --- make/run wiring against a stand-in flashinfer -----------------------------------------

def _paged_attention(q_rows, qo_indptr, k_pages, v_pages, indptr, indices, last_page_len,
                     scale, causal):
    """Attention of ragged query rows over a paged NHD cache, FlashInfer's definitions:
    sequence b has (pages - 1) * page_size + last_page_len[b] keys, and the causal mask keeps
    key j for query i when j <= i + kv_len - qo_len."""
    page_size, kv_heads = k_pages.shape[1], k_pages.shape[2]
    out = torch.empty(q_rows.shape, dtype=torch.float64)
    for b in range(len(last_page_len)):
        table = indices[indptr[b]:indptr[b + 1]].long()
        kv_len = (len(table) - 1) * page_size + int(last_page_len[b])
        k = k_pages[table].flatten(0, 1)[:kv_len].double()
        v = v_pages[table].flatten(0, 1)[:kv_len].double()
        q = q_rows[qo_indptr[b]:qo_indptr[b + 1]].double()  # (qo_len, Hq, D)
        group = q.shape[1] // kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        if causal:
            i = torch.arange(q.shape[0])[:, None]
            j = torch.arange(kv_len)[None, :]
            scores = scores.masked_fill(j > i + kv_len - q.shape[0], float("-inf"))
        out[qo_indptr[b]:qo_indptr[b + 1]] = torch.einsum(
            "hqk,khd->qhd", scores.softmax(-1), v)
    return out


class _Recorder:
    def __init__(self):
        self.plans = []
        self.xqa_calls = []
        self.runs = 0
        self.workspaces = []

    def workspace(self, buffer):
        assert buffer.dtype == torch.uint8 and buffer.numel() == pf.WORKSPACE_BYTES
        assert not buffer.any(), "FlashInfer needs the workspace zeroed before first use"
        self.workspaces.append(buffer)


def _fake_flashinfer(rec: _Recorder):
    """Entry points with the parameter names of flashinfer 0.7.2 (decode.py, prefill.py) for
    every argument the module passes; an unknown keyword fails like the real one would."""

    def unpack(paged_kv_cache):
        k_pages, v_pages = paged_kv_cache
        assert k_pages.shape == v_pages.shape
        return k_pages, v_pages

    class BatchDecodeWithPagedKVCacheWrapper:
        def __init__(self, float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False,
                     use_tensor_cores=False, paged_kv_indptr_buffer=None,
                     paged_kv_indices_buffer=None, paged_kv_last_page_len_buffer=None,
                     backend="auto", jit_args=None):
            rec.workspace(float_workspace_buffer)
            self.init = dict(kv_layout=kv_layout, use_cuda_graph=use_cuda_graph,
                             use_tensor_cores=use_tensor_cores, backend=backend)

        def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim,
                 page_size, *, pos_encoding_mode="NONE", window_left=-1, window_right=0,
                 logits_soft_cap=None, q_data_type="float16", kv_data_type=None,
                 o_data_type=None, data_type=None, sm_scale=None, rope_scale=None,
                 rope_theta=None, non_blocking=True, block_tables=None, seq_lens=None,
                 fixed_split_size=None, disable_split_kv=False, q_len_per_req=1,
                 is_causal=None):
            self.table = (indptr, indices, last_page_len)
            self.sm_scale, self.q_data_type, self.page_size = sm_scale, q_data_type, page_size
            rec.plans.append(dict(self.init, kind="decode", num_qo_heads=num_qo_heads,
                                  num_kv_heads=num_kv_heads, head_dim=head_dim,
                                  page_size=page_size, pos_encoding_mode=pos_encoding_mode,
                                  q_data_type=q_data_type, kv_data_type=kv_data_type,
                                  sm_scale=sm_scale))

        def run(self, q, paged_kv_cache, *args, q_scale=None, k_scale=None, v_scale=None,
                out=None, lse=None, return_lse=False, enable_pdl=None, window_left=None,
                sinks=None, q_len_per_req=None, skip_softmax_threshold_scale_factor=None,
                kv_cache_sf=None):
            rec.runs += 1
            k_pages, v_pages = unpack(paged_kv_cache)
            assert k_pages.shape[1] == self.page_size
            assert q.dim() == 3 and q.dtype == self.q_data_type
            assert out is not None and out.shape == q.shape and out.dtype == q.dtype
            qo_indptr = torch.arange(q.shape[0] + 1)
            out.copy_(_paged_attention(q, qo_indptr, k_pages, v_pages, *self.table,
                                       self.sm_scale, causal=False))
            return out

    class BatchPrefillWithPagedKVCacheWrapper:
        def __init__(self, float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False,
                     qo_indptr_buf=None, paged_kv_indptr_buf=None, paged_kv_indices_buf=None,
                     paged_kv_last_page_len_buf=None, custom_mask_buf=None,
                     mask_indptr_buf=None, backend="auto", jit_args=None, jit_kwargs=None,
                     variant_owns_mask=False):
            rec.workspace(float_workspace_buffer)
            self.init = dict(kv_layout=kv_layout, use_cuda_graph=use_cuda_graph,
                             backend=backend)

        def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len,
                 num_qo_heads, num_kv_heads, head_dim_qk, page_size, head_dim_vo=None,
                 custom_mask=None, packed_custom_mask=None, causal=False,
                 pos_encoding_mode="NONE", use_fp16_qk_reduction=False, sm_scale=None,
                 window_left=-1, logits_soft_cap=None, rope_scale=None, rope_theta=None,
                 q_data_type="float16", kv_data_type=None, o_data_type=None,
                 non_blocking=True, **more):
            assert not more, f"unexpected plan arguments {sorted(more)}"
            self.qo_indptr = qo_indptr
            self.table = (paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len)
            self.sm_scale, self.causal, self.q_data_type = sm_scale, causal, q_data_type
            self.page_size = page_size
            rec.plans.append(dict(self.init, kind="prefill", num_qo_heads=num_qo_heads,
                                  num_kv_heads=num_kv_heads, head_dim=head_dim_qk,
                                  page_size=page_size, causal=causal,
                                  pos_encoding_mode=pos_encoding_mode,
                                  q_data_type=q_data_type, kv_data_type=kv_data_type,
                                  sm_scale=sm_scale))

        def run(self, q, paged_kv_cache, *args, q_scale=None, k_scale=None, v_scale=None,
                out=None, lse=None, return_lse=False, lse_base="log2", lse_layout="NH",
                enable_pdl=None, window_left=None, sinks=None, kv_cache_sf=None,
                skip_softmax_threshold_scale_factor=None, use_fp16_softmax=None,
                uses_spcompress=None):
            rec.runs += 1
            k_pages, v_pages = unpack(paged_kv_cache)
            assert k_pages.shape[1] == self.page_size
            assert q.shape[0] == int(self.qo_indptr[-1]) and q.dtype == self.q_data_type
            assert out is not None and out.shape == q.shape and out.dtype == q.dtype
            out.copy_(_paged_attention(q, self.qo_indptr, k_pages, v_pages, *self.table,
                                       self.sm_scale, self.causal))
            return out

    def xqa_batch_decode_with_kv_cache(query, kv_cache, workspace_buffer, block_tables,
                                       seq_lens, max_seq_len, bmm1_scale=1.0, bmm2_scale=1.0,
                                       window_left=-1, out=None, sinks=None, kv_layout="NHD",
                                       enable_pdl=None, q_len_per_req=1, o_scale=1.0,
                                       mask=None, kv_cache_sf=None, q_cu_seq_lens=None):
        rec.runs += 1
        if not any(w is workspace_buffer for w in rec.workspaces):
            rec.workspace(workspace_buffer)
        rec.xqa_calls.append(dict(kv_layout=kv_layout, max_seq_len=max_seq_len,
                              bmm1_scale=bmm1_scale, bmm2_scale=bmm2_scale,
                              seq_lens_dtype=seq_lens.dtype,
                              block_tables_dtype=block_tables.dtype))
        k_pages, v_pages = unpack(kv_cache)
        batch, page_size = block_tables.shape[0], k_pages.shape[1]
        assert query.shape[0] == batch and out is not None and out.shape == query.shape
        assert max_seq_len == int(seq_lens.max())
        # Sequence b reads the first ceil(seq_lens[b] / page_size) pages of its table row.
        pages = (seq_lens.long() + page_size - 1) // page_size
        indptr = torch.cat([torch.zeros(1, dtype=torch.long), pages.cumsum(0)])
        indices = torch.cat([block_tables[b, :int(p)] for b, p in enumerate(pages)])
        last = seq_lens.long() - (pages - 1) * page_size
        out.copy_(_paged_attention(query, torch.arange(batch + 1), k_pages, v_pages, indptr,
                                   indices, last, bmm1_scale * bmm2_scale, causal=False))
        return out

    flashinfer = types.ModuleType("flashinfer")
    decode = types.ModuleType("flashinfer.decode")
    decode.BatchDecodeWithPagedKVCacheWrapper = BatchDecodeWithPagedKVCacheWrapper
    decode.xqa_batch_decode_with_kv_cache = xqa_batch_decode_with_kv_cache
    flashinfer.decode = decode
    flashinfer.BatchDecodeWithPagedKVCacheWrapper = BatchDecodeWithPagedKVCacheWrapper
    flashinfer.BatchPrefillWithPagedKVCacheWrapper = BatchPrefillWithPagedKVCacheWrapper
    return flashinfer, decode


@pytest.fixture
def fake(monkeypatch):
    rec = _Recorder()
    flashinfer, decode = _fake_flashinfer(rec)
    monkeypatch.setitem(sys.modules, "flashinfer", flashinfer)
    monkeypatch.setitem(sys.modules, "flashinfer.decode", decode)
    monkeypatch.setattr(pf, "WORKSPACE_BYTES", 4096)  # the real 128 MiB is not needed here
    return rec


def _inputs(shape, n_sets, dtype=torch.float32):
    gen = torch.Generator().manual_seed(shape.q_len * 100 + shape.kv_len)
    sets = []
    for _ in range(n_sets):
        q = torch.randn(shape.batch, shape.q_len, shape.q_heads, shape.head_dim, generator=gen)
        k = torch.randn(shape.batch, shape.kv_len, shape.kv_heads, shape.head_dim,
                        generator=gen)
        v = torch.randn(shape.batch, shape.kv_len, shape.kv_heads, shape.head_dim,
                        generator=gen)
        sets.append((q.to(dtype), k.to(dtype), v.to(dtype)))
    return sets


WIRING = [(n, _shape(kv_len=kv)) for n in pf.NAMES for kv in (70, 128)] + [
    ("flashinfer_prefill", _shape(q_len=5, kv_len=70, causal=causal)) for causal in (0, 1)] + [
    ("flashinfer_prefill", _shape(q_len=1, kv_len=65, causal=True)),
    ("flashinfer_decode_tc", _shape(batch=3, q_heads=8, kv_heads=1, kv_len=200)),
]


@pytest.mark.parametrize("name,shape", WIRING)
def test_run_matches_reference_and_plans_once(fake, available_ok, name, shape):
    scale = 1.0 / math.sqrt(shape.head_dim)
    make = pf.factory(name, shape, scale)
    assert fake.plans == []  # nothing is planned before the first make
    runs = [make(*qkv) for qkv in _inputs(shape, 3)]
    plans_after_make, calls_after_make = len(fake.plans), fake.runs
    assert calls_after_make == 1  # one warm-up, by the first make only
    for run, (q, k, v) in zip(runs, _inputs(shape, 3)):
        out = run()
        ref = attention_ref(q.double(), k.double(), v.double(), causal=shape.causal,
                            softmax_scale=scale)[0]
        assert out.shape == (shape.batch, shape.q_len, shape.q_heads, shape.head_dim)
        assert out.dtype == q.dtype
        torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
        assert run() is out  # the same buffer every call: nothing allocated per call
    assert fake.runs == calls_after_make + 2 * len(runs)
    if name == "flashinfer_xqa":
        assert len(fake.workspaces) == 1 and fake.plans == []
        call = fake.xqa_calls[-1]
        assert call["kv_layout"] == "NHD" and call["max_seq_len"] == shape.kv_len
        assert call["bmm1_scale"] == scale and call["bmm2_scale"] == 1.0
        assert call["seq_lens_dtype"] == call["block_tables_dtype"] == torch.int32
        return
    assert plans_after_make == len(fake.plans) == 1  # plan once per shape, never in run()
    plan = fake.plans[0]
    assert plan["kv_layout"] == "NHD" and plan["backend"] == "fa2"
    assert plan["use_cuda_graph"] is False
    assert (plan["num_qo_heads"], plan["num_kv_heads"], plan["head_dim"]) == (
        shape.q_heads, shape.kv_heads, shape.head_dim)
    assert plan["page_size"] == pf.PAGE_SIZE and plan["pos_encoding_mode"] == "NONE"
    assert plan["q_data_type"] == plan["kv_data_type"] == torch.float32
    assert plan["sm_scale"] == scale
    if name == "flashinfer_prefill":
        assert plan["kind"] == "prefill" and plan["causal"] == shape.causal
    else:
        assert plan["kind"] == "decode"
        assert plan["use_tensor_cores"] is (name == "flashinfer_decode_tc")


@pytest.fixture
def available_ok(fake):
    assert pf.available() is None  # the stand-in imports


# --- paged_launcher: a paged batch of any lengths ------------------------------------------

@pytest.mark.parametrize("name,q_len", [(n, 1) for n in pf.NAMES] + [("flashinfer_prefill", 3)])
@pytest.mark.parametrize("page_size", [16, 64])
def test_paged_launcher_runs_variable_lengths(fake, name, q_len, page_size):
    from splitkv_tune.paged_batch import make_paged_batch
    from splitkv_tune.reference import splitkv_attention_ref

    lengths = (150, 1, 64, 17)
    batch = make_paged_batch(lengths, q_heads=4, kv_heads=2, head_dim=64, q_len=q_len,
                             dtype=torch.float32, page_size=page_size, device="cpu", seed=3,
                             extra_pages=2)
    shape = Shape("bf16", 64, len(lengths), 4, 2, q_len, max(lengths), False)
    launch = pf.paged_launcher(name, shape, 0.125, batch.flashinfer,
                               block_table=batch.block_table, seq_lens=batch.cache_seqlens)
    assert fake.runs == 0  # planned, not yet run
    rows = batch.q.reshape(-1, 4, 64)
    out = torch.empty_like(rows)
    launch(rows, (batch.k_pool, batch.v_pool), out)
    ref = splitkv_attention_ref(batch.q.double(), batch.k_pool.double(), batch.v_pool.double(),
                                softmax_scale=0.125, cache_seqlens=batch.cache_seqlens,
                                block_table=batch.block_table)
    assert not out.isnan().any()  # the NaN tails and spare pages were never read
    torch.testing.assert_close(out.view(batch.q.shape).double(), ref, rtol=1e-5, atol=1e-5)
    if name != "flashinfer_xqa":
        assert fake.plans[-1]["page_size"] == page_size
