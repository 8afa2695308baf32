"""GPU tests of the split-KV kernels through ``splitkv_tune.ops`` (all marked ``gpu``).

Correctness rule (DESIGN.md, after FlashAttention's tests): with ``ref`` = float64
attention on the upcast inputs and ``pt`` = the same attention done by PyTorch in the input
dtype, our max error must be <= 2 * pt's max error + the rounding of ``ref`` to the output
dtype + 1e-3. NaN/inf never passes. Inputs are fresh random numbers every run (the seed is
printed on failure; ``SPLITKV_TEST_SEED`` replays it). Before each call the workspace is
filled with NaN bytes and the CUDA caching allocator is handed NaN-filled blocks of the
output's size, so an element the kernels forget to write shows up as NaN.

The big grid is a deterministic sample (``SPLITKV_GPU_CASES``, default 800) of the grid of
issue 2, over every head dim and the block_kv values instantiated at it, plus every edge case
listed in ``EDGE_CASES``.
"""
from __future__ import annotations

import itertools
import math
import os
import random

import pytest
import torch

from accuracy import (UNIT_ROUNDOFF, assert_lse, assert_rule, nan_workspace, poison_for_output,
                      references)

from splitkv_tune import tunables, warm_start
from splitkv_tune.reference import splitkv_partials_ref

pytestmark = pytest.mark.gpu

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
HEADS = ((8, 8), (32, 8), (16, 1))
SPLITS = (1, 2, 3, 7, 16, 64, 128)
GRID = dict(dtype=tuple(DTYPES), head_dim=tunables.HEAD_DIMS, causal=(False, True),
            q_len=(1, 3, 64, 128, 333), kv_len=(1, 17, 128, 1000, 4096, 20000), heads=HEADS,
            num_splits=SPLITS, block_kv=tunables.BLOCK_KV, policy=tunables.SPLIT_POLICIES)
NUM_GRID_CASES = int(os.environ.get("SPLITKV_GPU_CASES", "800"))


# ------------------------------------------------------------------------------ cases
def _case(dtype, head_dim, causal, q_len, kv_len, heads, num_splits, block_kv, policy,
          reduce_threads=128, return_lse=True, merge="auto"):
    batch = 2 if q_len * kv_len <= 200_000 else 1
    return dict(dtype=dtype, head_dim=head_dim, causal=causal, q_len=q_len, kv_len=kv_len,
                q_heads=heads[0], kv_heads=heads[1], batch=batch, num_splits=num_splits,
                block_kv=block_kv, policy=policy, reduce_threads=reduce_threads,
                return_lse=return_lse, merge=merge)


def _case_id(c):
    return (f"{c['dtype']}-d{c['head_dim']}-{'causal' if c['causal'] else 'full'}"
            f"-b{c['batch']}-sq{c['q_len']}-sk{c['kv_len']}-h{c['q_heads']}x{c['kv_heads']}"
            f"-S{c['num_splits']}-bkv{c['block_kv']}-{c['policy']}-rt{c['reduce_threads']}"
            f"{'-lse' if c['return_lse'] else ''}{'-' + c['merge'] if c['merge'] != 'auto' else ''}")


def _edge_cases():
    cases = []
    for dt, causal, sq, s in itertools.product(DTYPES, (False, True), (1, 333), (1, 128)):
        cases.append(_case(dt, 128, causal, sq, 1, (32, 8), s, 32, "blocks"))   # Sk = 1
    for policy, bkv in itertools.product(tunables.SPLIT_POLICIES, tunables.BLOCK_KV):
        # More splits than KV blocks (and, for "length", more splits than keys).
        cases.append(_case("bf16", 128, False, 1, 17, (16, 1), 128, bkv, policy))
        cases.append(_case("fp16", 64, True, 64, 128, (32, 8), 7, bkv, policy, 64))
        cases.append(_case("bf16", 64, False, 3, 1000, (8, 8), 64, bkv, policy, 256))
    for sq, sk, s in ((333, 1, 3), (333, 17, 7), (333, 128, 16), (128, 17, 2), (64, 17, 128),
                      (3, 1, 2)):  # Sq > Sk, causal: fully masked rows and empty tiles
        for policy, merge in itertools.product(tunables.SPLIT_POLICIES, ("kernel", "fused")):
            if merge == "fused" and s == 1:
                continue
            cases.append(_case("bf16", 128, True, sq, sk, (32, 8), s, 64, policy, merge=merge))
            cases.append(_case("fp16", 64, True, sq, sk, (16, 1), s, 32, policy, merge=merge))
    for bkv, s in itertools.product(tunables.BLOCK_KV, (2, 17, 128)):  # fused merge, every tile shape
        cases.append(_case("bf16", 128, False, 1, 4096, (32, 8), s, bkv, "blocks", merge="fused"))
        cases.append(_case("fp16", 64, True, 100, 3000, (8, 8), s, bkv, "length", merge="fused"))
    # Head dims 96 (Phi-3) and 256 (Gemma), every block_kv instantiated at each: GQA-packed
    # decode with one split and both merges (one and several load rounds of the fold), causal
    # prefill, and Sq > Sk (fully masked rows); then the Gemma shape of the issue (B=2 Hq=8
    # Hkv=1 Sk=40000) and a Phi-3-like MHA decode.
    for d, dt in itertools.product((96, 256), DTYPES):
        for bkv in tunables.block_kvs_for(d):
            for s, merge in ((1, "auto"), (16, "kernel"), (16, "fused"), (97, "fused")):
                cases.append(_case(dt, d, False, 1, 4096, (32, 8), s, bkv, "blocks", merge=merge))
            cases.append(_case(dt, d, True, 100, 3000, (8, 8), 7, bkv, "length", merge="kernel"))
            cases.append(_case(dt, d, True, 333, 17, (16, 1), 3, bkv, "blocks", merge="fused"))
        for s, merge in ((1, "auto"), (64, "kernel"), (128, "fused")):
            cases.append(_case(dt, 256, False, 1, 40000, (8, 1), s, 64, "blocks", merge=merge))
        cases.append(_case(dt, 96, False, 1, 20000, (32, 32), 8, 128, "blocks", merge="kernel"))
    # The largest problems of the grid.
    cases.append(_case("bf16", 128, True, 333, 20000, (32, 8), 128, 128, "blocks"))
    cases.append(_case("fp16", 128, False, 333, 20000, (16, 1), 64, 64, "length"))
    cases.append(_case("bf16", 64, False, 1, 20000, (32, 8), 128, 32, "length"))
    return cases


def _grid_cases(n=NUM_GRID_CASES, seed=20261129):
    """A fixed (seeded) sample of the full grid, so the ids are the same on every run."""
    rng = random.Random(seed)
    names = list(GRID)
    full = [v for v in itertools.product(*GRID.values())  # block_kv instantiated at the head dim
            if v[names.index("block_kv")] in tunables.block_kvs_for(v[names.index("head_dim")])]
    picked = []
    for values in rng.sample(full, min(n, len(full))):
        c = _case(*values, reduce_threads=rng.choice(tunables.REDUCE_THREADS),
                  return_lse=rng.random() < 0.5)
        if c["num_splits"] > 1:
            c["merge"] = rng.choice(("kernel", "fused"))
        picked.append(c)
    cases, seen = [], set()
    for c in _edge_cases() + picked:
        if _case_id(c) not in seen:
            seen.add(_case_id(c))
            cases.append(pytest.param(c, id=_case_id(c)))
    return cases


# ---------------------------------------------------------------------------- helpers
def _inputs(c, gen):
    dt = DTYPES[c["dtype"]] if isinstance(c["dtype"], str) else c["dtype"]
    q = torch.randn(c["batch"], c["q_len"], c["q_heads"], c["head_dim"], generator=gen,
                    device="cuda").to(dt)
    k, v = (torch.randn(c["batch"], c["kv_len"], c["kv_heads"], c["head_dim"], generator=gen,
                        device="cuda").to(dt) for _ in range(2))
    return q, k, v


def _shape(c):
    return tunables.Shape(c["dtype"], c["head_dim"], c["batch"], c["q_heads"], c["kv_heads"],
                          c["q_len"], c["kv_len"], c["causal"])


def _call(ops, q, k, v, c, workspace=None, return_lse=None, merge=None, enable_pdl=True):
    return ops.splitkv_attention(
        q, k, v, causal=c["causal"], num_splits=c["num_splits"], block_kv=c["block_kv"],
        reduce_threads=c["reduce_threads"], split_policy=c["policy"], workspace=workspace,
        return_lse=c["return_lse"] if return_lse is None else return_lse,
        merge=c["merge"] if merge is None else merge, enable_pdl=enable_pdl)


# ------------------------------------------------------------------- the grid (DESIGN.md)
@pytest.mark.parametrize("c", _grid_cases())
def test_grid(ops, cuda_gen, c):
    q, k, v = _inputs(c, cuda_gen)
    ref_out, ref_lse, pt_out = references(q, k, v, c["causal"])
    s = c["num_splits"]
    ws = nan_workspace(ops.workspace_size(q, k, s)) if s > 1 else None
    poison_for_output(q, c["return_lse"])
    res = _call(ops, q, k, v, c, workspace=ws)
    torch.cuda.synchronize()
    out, lse = res if c["return_lse"] else (res, None)
    assert_rule(out, ref_out, pt_out)
    if lse is not None:
        assert_lse(lse, ref_lse)
    if ws is not None:  # every row of every split was written (the workspace started NaN)
        o_part, m, l = ops.workspace_views(ws, _shape(c), s)
        assert torch.isfinite(o_part).all(), "partial O left unwritten (NaN)"
        assert torch.isfinite(l).all() and not m.isnan().any(), "m/l left unwritten (NaN)"


def _partial_cases():
    rng = random.Random(7)
    cases = [p for p in _grid_cases() if p.values[0]["num_splits"] > 1
             and p.values[0]["q_len"] * p.values[0]["kv_len"] <= 333 * 4096]
    edge_ids = {_case_id(c) for c in _edge_cases()}
    edge = [p for p in cases if p.id in edge_ids]
    rest = [p for p in cases if p.id not in edge_ids]
    return edge + rng.sample(rest, min(120, len(rest)))


@pytest.mark.parametrize("c", _partial_cases())
def test_partials_match_reference(ops, cuda_gen, c):
    """m, l and O of every split against ``splitkv_partials_ref`` in float64."""
    q, k, v = _inputs(c, cuda_gen)
    s = c["num_splits"]
    ws = nan_workspace(ops.workspace_size(q, k, s))
    _call(ops, q, k, v, c, workspace=ws, return_lse=False, merge="kernel")
    torch.cuda.synchronize()
    o_part, m, l = (t.double() for t in ops.workspace_views(ws, _shape(c), s))
    o_ref, m_ref, l_ref = splitkv_partials_ref(
        q.double(), k.double(), v.double(), causal=c["causal"], softmax_scale=None,
        num_splits=s, block_kv=c["block_kv"], split_policy=c["policy"])
    live = l_ref > 0
    # Where the reference split is empty the combine relies on l == 0 (and O == 0).
    assert torch.all(l[~live] == 0), "l != 0 for a split the reference finds empty"
    assert torch.all(o_part[~live] == 0), "O != 0 for a split the reference finds empty"
    dm = (m - m_ref)[live].abs()
    assert torch.all(dm <= 1e-3 + 1e-5 * m_ref[live].abs()), f"m max error {dm.max():.3g}"
    dl = (l - l_ref)[live].abs()
    assert torch.all(dl <= 1e-3 * l_ref[live]), f"l max rel error {(dl / l_ref[live]).max():.3g}"
    # P is rounded to the input dtype for the PV product: |dO| <= u * l * max|v| (+ slack).
    u = UNIT_ROUNDOFF[q.dtype]
    tol = (2 * u + 1e-3) * l_ref[..., None] * v.double().abs().max() + 1e-5
    do = (o_part - o_ref).abs()
    assert torch.all(do[live] <= tol[live]), f"O max error {do[live].max():.3g}"


@pytest.mark.parametrize("policy", tunables.SPLIT_POLICIES)
@pytest.mark.parametrize("causal,sq,sk", [(False, 1, 70), (True, 333, 17), (True, 64, 1000)])
def test_empty_splits_write_contract_values(ops, cuda_gen, policy, causal, sq, sk):
    """Empty splits (S > KV blocks, causal tiles) write m = -inf, l = 0, O = 0."""
    c = _case("bf16", 64, causal, sq, sk, (16, 1), 128, 32, policy)
    q, k, v = _inputs(c, cuda_gen)
    ws = nan_workspace(ops.workspace_size(q, k, 128))
    _call(ops, q, k, v, c, workspace=ws, return_lse=False, merge="kernel")
    torch.cuda.synchronize()
    o_part, m, l = ops.workspace_views(ws, _shape(c), 128)
    _, _, l_ref = splitkv_partials_ref(q.double(), k.double(), v.double(), causal=causal,
                                       softmax_scale=None, num_splits=128, block_kv=32,
                                       split_policy=policy)
    empty = l_ref == 0
    assert empty.any()
    assert torch.all(m[empty] == -math.inf), "m of an empty split is not -inf"
    assert torch.all(l[empty] == 0) and torch.all(o_part[empty] == 0)


# -------------------------------------------------------------- every S, one answer
@pytest.mark.parametrize("dtype,d,causal,sq,sk,heads", [
    ("bf16", 128, False, 1, 4096, (32, 8)), ("fp16", 64, True, 128, 1000, (16, 1)),
    ("bf16", 256, False, 1, 4096, (8, 1)), ("fp16", 96, True, 128, 1000, (16, 1))])
def test_every_split_count_gives_the_same_answer(ops, cuda_gen, dtype, d, causal, sq, sk, heads):
    c = _case(dtype, d, causal, sq, sk, heads, 1, 64, "blocks")
    q, k, v = _inputs(c, cuda_gen)
    ref_out, _, pt_out = references(q, k, v, causal)
    base = ops.splitkv_attention(q, k, v, causal=causal, num_splits=1, block_kv=64)
    assert_rule(base, ref_out, pt_out, "S=1")
    pt_err = (pt_out.double() - ref_out).abs().max().item()
    for s, policy in itertools.product(range(1, tunables.MAX_SPLITS + 1), tunables.SPLIT_POLICIES):
        ws = nan_workspace(ops.workspace_size(q, k, s)) if s > 1 else None
        merges = ("kernel", "fused") if s > 1 else ("auto",)
        for merge in merges:
            out = ops.splitkv_attention(q, k, v, causal=causal, num_splits=s, block_kv=64,
                                        split_policy=policy, workspace=ws, merge=merge)
            what = f"S={s} {policy} merge={merge}"
            assert_rule(out, ref_out, pt_out, what)
            diff = (out.double() - base.double()).abs().max().item()
            assert diff <= 2 * pt_err + 1e-3, f"{what} differs from S=1 by {diff:.3g}"


@pytest.mark.parametrize("num_splits", [2, 3, 16, 17, 64, 128])
@pytest.mark.parametrize("dtype,d,causal,sq,sk,heads,bkv", [
    ("bf16", 128, False, 1, 16384, (32, 8), 128), ("fp16", 64, True, 77, 2000, (16, 1), 32),
    ("bf16", 128, True, 16, 5000, (32, 8), 64), ("bf16", 256, False, 1, 40000, (8, 1), 64),
    ("fp16", 256, True, 16, 5000, (32, 8), 32), ("fp16", 96, False, 1, 16384, (32, 8), 128),
    ("bf16", 96, True, 77, 2000, (16, 1), 64)])
def test_fused_merge_matches_combine_kernel(ops, cuda_gen, num_splits, dtype, d, causal, sq, sk,
                                            heads, bkv):
    """The fused merge and the combine kernel fold the same partials with the same code: the
    same bits."""
    c = _case(dtype, d, causal, sq, sk, heads, num_splits, bkv, "blocks")
    q, k, v = _inputs(c, cuda_gen)
    ref_out, ref_lse, pt_out = references(q, k, v, causal)
    poison_for_output(q)
    out_f, lse_f = _call(ops, q, k, v, c, return_lse=True, merge="fused")
    out_k, lse_k = _call(ops, q, k, v, c, return_lse=True, merge="kernel")
    assert_rule(out_f, ref_out, pt_out, "fused merge")
    assert_lse(lse_f, ref_lse)
    assert torch.equal(out_f, out_k) and torch.equal(lse_f, lse_k), "the two merges differ"


def test_fused_merge_leaves_its_counters_zero(ops, cuda_gen):
    """Every launch sets the tile counters back to 0, including on a second stream."""
    c = _small_case(num_splits=13, kv_len=8192, q_len=40, heads=(16, 1))  # several query tiles
    q, k, v = _inputs(c, cuda_gen)
    want = _call(ops, q, k, v, c, return_lse=False, merge="kernel")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    for s in (torch.cuda.current_stream(), stream):
        with torch.cuda.stream(s):
            outs = [_call(ops, q, k, v, {**c, "num_splits": n}, return_lse=False, merge="fused")
                    for n in (13, 2, 128, 13)]
    torch.cuda.synchronize()
    assert torch.equal(outs[0], outs[3]) and torch.equal(outs[0], want)
    for s in (torch.cuda.current_stream(), stream):
        counters = ops._extension().read_eager_counters(s.device.index, s.cuda_stream)
        assert counters and not any(counters), f"counters of stream {s} not zero"


# ------------------------------------------------------------------- API behaviour
def _small_case(**kw):
    return _case(**{**dict(dtype="bf16", head_dim=128, causal=False, q_len=3, kv_len=1000,
                           heads=(32, 8), num_splits=7, block_kv=64, policy="blocks"), **kw})


@pytest.mark.parametrize("causal", [False, True])
def test_return_lse_and_determinism(ops, cuda_gen, causal):
    c = _small_case(causal=causal)
    q, k, v = _inputs(c, cuda_gen)
    ref_out, ref_lse, pt_out = references(q, k, v, causal)
    out1 = _call(ops, q, k, v, c, return_lse=False)
    out2, lse = _call(ops, q, k, v, c, return_lse=True)
    out3, lse3 = _call(ops, q, k, v, c, return_lse=True)
    assert_rule(out2, ref_out, pt_out)
    assert_lse(lse, ref_lse)
    assert torch.equal(out1, out2), "return_lse changed the output"
    assert torch.equal(out2, out3) and torch.equal(lse, lse3), "two identical calls differ"


@pytest.mark.parametrize("sq,sk,heads", [(1, 4096, (32, 8)), (1, 20000, (32, 32)),
                                         (64, 1000, (16, 1)), (333, 333, (8, 8))])
@pytest.mark.parametrize("causal", [False, True])
def test_auto_config(ops, cuda_gen, sq, sk, heads, causal):
    c = _small_case(q_len=sq, kv_len=sk, heads=heads, causal=causal)
    q, k, v = _inputs(c, cuda_gen)
    ref_out, ref_lse, pt_out = references(q, k, v, causal)
    poison_for_output(q)
    out, lse = ops.splitkv_attention(q, k, v, causal=causal, return_lse=True)
    assert_rule(out, ref_out, pt_out)
    assert_lse(lse, ref_lse)


def test_softmax_scale(ops, cuda_gen):
    c = _small_case(causal=True)
    q, k, v = _inputs(c, cuda_gen)
    ref_out, ref_lse, pt_out = references(q, k, v, True, softmax_scale=0.3)
    out, lse = ops.splitkv_attention(q, k, v, causal=True, softmax_scale=0.3, num_splits=5,
                                     return_lse=True)
    assert_rule(out, ref_out, pt_out)
    assert_lse(lse, ref_lse)


def test_workspace_size(ops):
    for c in (_small_case(), _small_case(q_len=333, heads=(16, 1), head_dim=64)):
        q = torch.empty(c["batch"], c["q_len"], c["q_heads"], c["head_dim"],
                        dtype=torch.bfloat16, device="cuda")
        k = torch.empty(c["batch"], c["kv_len"], c["kv_heads"], c["head_dim"],
                        dtype=torch.bfloat16, device="cuda")
        for s in (1, 2, 7, 128):
            assert ops.workspace_size(q, k, s) == tunables.workspace_bytes(_shape(c), s)


@pytest.mark.parametrize("causal", [False, True])
def test_strided_inputs(ops, cuda_gen, causal):
    """Slices of bigger tensors (contiguous last dim only) give the contiguous answer."""
    c = _small_case(causal=causal, q_len=5, kv_len=777)
    b, sq, sk, hq, hkv, d = 2, 5, 777, 32, 8, 128
    big_q = torch.randn(b, hq, sq + 2, d, generator=cuda_gen, device="cuda").bfloat16()
    q = big_q[:, :, 1:1 + sq].transpose(1, 2)                  # (B, Sq, Hq, D), head-major
    kv = torch.randn(b, sk + 3, 2, hkv + 1, d, generator=cuda_gen, device="cuda").bfloat16()
    k, v = kv[:, 3:, 0, :hkv], kv[:, 3:, 1, 1:]                # interleaved K/V, padded heads
    assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous())
    ref_out, ref_lse, pt_out = references(q, k, v, causal)
    out, lse = _call(ops, q, k, v, c, return_lse=True)
    assert_rule(out, ref_out, pt_out)
    assert_lse(lse, ref_lse)
    out_c, lse_c = _call(ops, q.contiguous(), k.contiguous(), v.contiguous(), c, return_lse=True)
    assert torch.equal(out, out_c) and torch.equal(lse, lse_c)


def test_current_stream(ops, cuda_gen):
    """The kernels run on torch's current stream, ordered after the work queued there."""
    c = _small_case()
    q, k, v = _inputs(c, cuda_gen)
    q_fresh = torch.randn(q.shape, generator=cuda_gen, device="cuda").to(q.dtype)
    want = _call(ops, q_fresh, k, v, c, return_lse=False)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        torch.cuda._sleep(50_000_000)  # delay the copy: a launch on another stream reads old q
        q.copy_(q_fresh)
        got = _call(ops, q, k, v, c, return_lse=False)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    assert torch.equal(got, want)


@pytest.mark.parametrize("merge", ["kernel", "fused"])
def test_cuda_graph_capture(ops, cuda_gen, merge):
    c = _small_case(num_splits=8, q_len=1, merge=merge)
    q, k, v = _inputs(c, cuda_gen)
    ws = torch.empty(ops.workspace_size(q, k, 8), dtype=torch.uint8, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        _call(ops, q, k, v, c, workspace=ws, return_lse=False)  # warm-up outside capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _call(ops, q, k, v, c, workspace=ws, return_lse=False)
    q2, k2, v2 = _inputs(c, cuda_gen)
    q.copy_(q2), k.copy_(k2), v.copy_(v2)
    graph.replay()
    graph.replay()  # the fused merge's counters are zero again for the second replay
    torch.cuda.synchronize()
    ref_out, _, pt_out = references(q, k, v, False)
    assert_rule(out, ref_out, pt_out, "graph replay")
    eager = _call(ops, q, k, v, c, workspace=ws, return_lse=False)  # the eager counters
    graph.replay()  # the graph's own counters, still zero
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


@pytest.mark.parametrize("head_dim", tunables.HEAD_DIMS)
@pytest.mark.parametrize("merge,num_splits", [("kernel", 8), ("fused", 8), ("auto", 1)])
def test_programmatic_launch_waits_for_the_previous_kernel(ops, cuda_gen, merge, num_splits, head_dim):
    """Calls that read the previous call's output and K/V written by the kernel just before
    them, sharing one workspace: with programmatic launch each call still sees those writes
    (eager and in a CUDA graph), and gives the bits of the plain launch."""
    c = _small_case(num_splits=num_splits, q_len=1, merge=merge, head_dim=head_dim)
    q, k, v = _inputs(c, cuda_gen)
    k_next = torch.randn(k.shape, generator=cuda_gen, device="cuda").to(k.dtype)
    ws = torch.empty(ops.workspace_size(q, k, num_splits), dtype=torch.uint8, device="cuda")

    def chain(enable_pdl):
        """The inputs and outputs of the four calls: x[i + 1] = attention(x[i], K, V)."""
        k_live = k.clone()
        xs = [q]
        for step in range(4):
            if step == 2:
                k_live.copy_(k_next)  # the kernel right before this call writes its K
            xs.append(_call(ops, xs[-1], k_live, v, c, workspace=ws, return_lse=False,
                            enable_pdl=enable_pdl))
        return xs

    plain = chain(False)
    _call(ops, q, k, v, c, workspace=ws, return_lse=False)  # warm-up outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = chain(True)
    eager = chain(True)
    graph.replay()
    torch.cuda.synchronize()
    for step in range(4):
        ref_out, _, pt_out = references(plain[step], k_next if step >= 2 else k, v, False)
        assert_rule(plain[step + 1], ref_out, pt_out, f"plain launch, call {step}")
    for step in range(1, 5):
        assert torch.equal(eager[step], plain[step]), f"eager PDL call {step - 1} differs"
        assert torch.equal(captured[step], plain[step]), f"graph PDL call {step - 1} differs"


def test_one_wave_launches_are_spread_over_the_sms(ops, cuda_gen):
    """A programmatic equal-length launch whose grid is one wave needing more than one CTA a SM
    takes the shared memory that holds each SM to ceil(CTAs / SMs) (rules.h spread_ctas_per_sm
    and smem_for_ctas_per_sm, the count confirmed by the occupancy calculator); every other
    launch keeps the kernel's own size. A spread launch gives the plain launch's bits."""
    from splitkv_tune import _C, _rules
    props = torch.cuda.get_device_properties(0)
    sms, sm_bytes = props.multi_processor_count, props.shared_memory_per_multiprocessor
    reserved = sm_bytes - props.shared_memory_per_block_optin
    code = tunables.dtype_codes()["bf16"]
    spread = []
    for block_kv in tunables.block_kvs_for(128):
        own = tunables.smem_bytes(128, block_kv, 16)
        for ctas in (sms, sms + 1, 2 * sms, 2 * sms + 1, 3 * sms, 33 * sms):
            plain = _C.equal_launch_residency(0, code, 128, 16, block_kv, ctas, False)
            assert plain == (0, own, 0)
            per_sm, bytes_, resident = _C.equal_launch_residency(0, code, 128, 16, block_kv, ctas, True)
            if props.major < 9 or resident == 0:  # resident 0: under three CTAs fit, nothing to spread
                assert (per_sm, bytes_) == (0, own)
                assert resident or 3 * (own + reserved) > sm_bytes or props.major < 9
                continue
            assert resident <= 32
            assert per_sm == _rules.spread_ctas_per_sm(ctas, sms, resident)
            if per_sm:
                assert bytes_ > own and per_sm * (bytes_ + reserved) <= sm_bytes < (per_sm + 1) * (bytes_ + reserved)
                spread.append((block_kv, ctas))
            else:
                assert bytes_ == own
    if props.major < 9:
        return
    assert spread, "no launch of the sample was spread"
    block_kv, ctas = spread[0]
    one_split = tunables.Config(1, block_kv, 128, "blocks")
    assert warm_start.spread_on_this_gpu(tunables.Shape("bf16", 128, 1, ctas, ctas, 1, 300, False), one_split)
    assert not warm_start.spread_on_this_gpu(tunables.Shape("bf16", 128, 1, sms, sms, 1, 300, False), one_split)
    # ctas CTAs: one sequence of ctas KV heads, one query row each, one split
    c = {**_case("bf16", 128, False, 1, 300, (ctas, ctas), 1, block_kv, "blocks", return_lse=False), "batch": 1}
    q, k, v = _inputs(c, cuda_gen)
    plain = _call(ops, q, k, v, c, enable_pdl=False)
    chained = [_call(ops, q, k, v, c, enable_pdl=True) for _ in range(3)]
    torch.cuda.synchronize()
    ref_out, _, pt_out = references(q, k, v, False)
    assert_rule(plain, ref_out, pt_out)
    assert all(torch.equal(out, plain) for out in chained)


def test_torch_compile(ops, cuda_gen):
    c = _small_case(num_splits=4)
    q, k, v = _inputs(c, cuda_gen)
    fn = torch.compile(lambda q, k, v: ops.splitkv_attention(q, k, v, num_splits=4,
                                                             return_lse=True), fullgraph=True)
    out, lse = fn(q, k, v)
    ref_out, ref_lse, pt_out = references(q, k, v, False)
    assert_rule(out, ref_out, pt_out, "torch.compile")
    assert_lse(lse, ref_lse)
