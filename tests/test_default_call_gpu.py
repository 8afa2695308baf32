"""GPU tests of the call a server makes with default arguments: captured in a CUDA graph it
holds our kernels and nothing else (no fill, copy or allocation kernel), also when the
process's first call is a captured one; replays match eager bits; the cached default
workspace and counters are safe on concurrent streams; and the host path caches its plan per
call signature without going stale."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from splitkv_tune.reference import attention_ref

pytestmark = pytest.mark.gpu

OUR_KERNELS = ("split_kv_kernel", "combine_kernel")
# (B, Sq, Hq, Hkv, Sk, merge): the fused merge (auto at Sq = 1), S = 1, the combine kernel
# (auto at Sq = 4) and the combine kernel forced at Sq = 1.
CASES = [(1, 1, 32, 8, 16384, "auto"), (4, 1, 32, 8, 4096, "auto"), (1, 1, 32, 8, 64, "auto"),
         (1, 4, 32, 8, 16384, "auto"), (1, 1, 32, 8, 16384, "kernel")]


def _inputs(b, sq, hq, hkv, sk, gen, dtype=torch.bfloat16):
    q = torch.randn(b, sq, hq, 128, generator=gen, device="cuda").to(dtype)
    k, v = (torch.randn(b, sk, hkv, 128, generator=gen, device="cuda").to(dtype) for _ in range(2))
    return q, k, v


def _graph_kernels(graph) -> list[str]:
    """Names of the GPU activities (kernels, memsets, copies) of one replay, from the profiler."""
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def _check(out, q, k, v, causal=False):
    ref = attention_ref(q.double(), k.double(), v.double(), causal=causal)[0]
    low = attention_ref(q, k, v, causal=causal)[0]
    bound = 2 * (low.double() - ref).abs().max().item() + 2e-3
    assert torch.isfinite(out).all() and (out.double() - ref).abs().max().item() <= bound


@pytest.mark.parametrize("b,sq,hq,hkv,sk,merge", CASES)
def test_captured_default_call_holds_only_our_kernels(ops, cuda_gen, b, sq, hq, hkv, sk, merge):
    q, k, v = _inputs(b, sq, hq, hkv, sk, cuda_gen)
    side = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side):
        with torch.cuda.graph(graph, stream=side):
            outs = [ops.splitkv_attention(q, k, v, merge=merge) for _ in range(16)]
    names = _graph_kernels(graph)
    assert names, "the profiler saw no GPU activity in the replay"
    others = [n for n in names if not any(ours in n for ours in OUR_KERNELS)]
    assert not others, f"the graph holds more than our kernels: {sorted(set(others))}"
    splits = [n for n in names if "split_kv_kernel" in n]
    assert len(splits) == 16, f"expected 16 split-kernel launches, saw {len(splits)}"
    eager = ops.splitkv_attention(q, k, v, merge=merge)
    torch.cuda.synchronize()
    _check(eager, q, k, v)
    for out in outs:
        assert torch.equal(out, eager), "a replayed call differs from the eager call"


def test_first_call_of_the_process_captured():
    """A server's first call is often a captured one: the counters it needs are allocated and
    zeroed then, outside the graph, and replays are right from the first one."""
    script = textwrap.dedent("""
        import torch
        from splitkv_tune import ops
        from splitkv_tune.reference import attention_ref
        g = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(1, 1, 32, 128, generator=g, device="cuda").bfloat16()
        k, v = (torch.randn(1, 16384, 8, 128, generator=g, device="cuda").bfloat16() for _ in range(2))
        graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            with torch.cuda.graph(graph, stream=side):
                out = ops.splitkv_attention(q, k, v, num_splits=16, merge="fused")
        for _ in range(3):
            graph.replay()
            torch.cuda.synchronize()
            ref = attention_ref(q.double(), k.double(), v.double())[0]
            err = (out.double() - ref).abs().max().item()
            assert err < 2e-2, err
        print("ok")
    """)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env,
                          timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


def test_many_graphs_captured_and_dropped(ops, cuda_gen):
    """Graphs captured and dropped one after another (as the tuner does) each get zeroed
    counters, recycled from the dropped ones, and every replay is right."""
    q, k, v = _inputs(2, 1, 32, 8, 8192, cuda_gen)
    want = ops.splitkv_attention(q, k, v, num_splits=8, merge="fused")
    for _ in range(50):
        graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            with torch.cuda.graph(graph, stream=side):
                out = ops.splitkv_attention(q, k, v, num_splits=8, merge="fused")
        graph.replay()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want)
        del graph, out


def test_concurrent_streams_with_default_workspace(ops, cuda_gen):
    """Eager calls on two streams at once: each stream has its own cached workspace and
    counters, so neither overwrites the other's partials."""
    q, k, v = _inputs(1, 1, 32, 8, 65536, cuda_gen)
    q2 = torch.randn(q.shape, generator=cuda_gen, device="cuda").to(q.dtype)
    want1 = ops.splitkv_attention(q, k, v, num_splits=32, merge="fused")
    want2 = ops.splitkv_attention(q2, k, v, num_splits=32, merge="kernel")
    torch.cuda.synchronize()
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    for s in streams:
        s.wait_stream(torch.cuda.current_stream())
    outs = [[], []]
    for _ in range(20):
        for i, (s, x, merge) in enumerate(zip(streams, (q, q2), ("fused", "kernel"))):
            with torch.cuda.stream(s):
                outs[i].append(ops.splitkv_attention(x, k, v, num_splits=32, merge=merge))
    torch.cuda.synchronize()
    assert all(torch.equal(o, want1) for o in outs[0])
    assert all(torch.equal(o, want2) for o in outs[1])


def test_plan_cache_follows_every_argument(ops, cuda_gen):
    """The host path caches its plan per call signature: a change of any argument, or of the
    KV length under "auto", gives that call's own result, never a stale plan's."""
    q, k, v = _inputs(1, 1, 32, 8, 4096, cuda_gen)
    base = ops.splitkv_attention(q, k, v)
    scaled = ops.splitkv_attention(q, k, v, softmax_scale=0.5)
    ref = attention_ref(q.double(), k.double(), v.double(), softmax_scale=0.5)[0]
    assert (scaled.double() - ref).abs().max().item() < 2e-2
    assert not torch.equal(base, scaled)
    out, lse = ops.splitkv_attention(q, k, v, return_lse=True)
    assert torch.equal(out, base) and lse.shape == (1, 32, 1)
    from splitkv_tune import selector
    selector.clear_lookup_caches()  # the eager plans go too, and are made again
    assert torch.equal(ops.splitkv_attention(q, k, v), base)
    for sk in (4095, 4097, 100, 1):
        got = ops.splitkv_attention(q, k[:, :sk], v[:, :sk])
        _check(got, q, k[:, :sk], v[:, :sk])
    causal = ops.splitkv_attention(q, k, v, causal=True)
    _check(causal, q, k, v, causal=True)
    with pytest.raises(ValueError, match="num_splits"):
        ops.splitkv_attention(q, k, v, num_splits=0)
    with pytest.raises(ValueError, match="num_splits"):
        ops.splitkv_attention(q, k, v, num_splits=[4])
    ops.splitkv_attention(q, k, v, num_splits=1, split_policy="blocks")
    with pytest.raises(ValueError, match="num_splits"):
        ops.splitkv_attention(q, k, v, num_splits="blocks", split_policy="blocks")
    with pytest.raises(ValueError, match="split_policy"):
        ops.splitkv_attention(q, k, v, num_splits=1, split_policy=1)
    with pytest.raises(TypeError, match="enable_pdl"):
        ops.splitkv_attention(q, k, v, enable_pdl=1)
    with pytest.raises(ValueError, match="softmax_scale"):
        ops.splitkv_attention(q, k, v, softmax_scale=float("nan"))
    with pytest.raises(ValueError, match="merge"):
        ops.splitkv_attention(q, k, v, merge="fast")


def test_plan_cache_keys_plain_and_other_argument_types_alike(ops, cuda_gen):
    """Arguments the C++ plan cache does not key (numpy integers, an int scale, a truthy causal)
    take the uncached path and give the bits of their plain equivalents; a given tunable and
    "auto" on the same signature never share a plan."""
    import numpy as np
    q, k, v = _inputs(1, 1, 32, 8, 4096, cuda_gen)
    plain = ops.splitkv_attention(q, k, v, num_splits=4, block_kv=64, softmax_scale=1.0, causal=True)
    for _ in range(2):  # the second call of each would hit a cached plan
        assert torch.equal(ops.splitkv_attention(q, k, v, num_splits=np.int64(4), block_kv=np.int32(64),
                                                 softmax_scale=1, causal=1), plain)
        assert torch.equal(ops.splitkv_attention(q, k, v, num_splits=4, block_kv=64, softmax_scale=1.0,
                                                 causal=True), plain)
    one = ops.splitkv_attention(q, k, v, num_splits=1)
    _check(one, q, k, v)
    for merge in ("kernel", "fused"):
        got = ops.splitkv_attention(q, k, v, num_splits=4, block_kv=64, softmax_scale=1.0, causal=True, merge=merge)
        assert (got.float() - plain.float()).abs().max().item() < 2e-2
    assert torch.equal(ops.splitkv_attention(q, k, v, num_splits=4, block_kv=64, softmax_scale=1.0, causal=True,
                                             enable_pdl=False), plain)
