"""GPU tests of ``splitkv_attention``'s argument checks: every bad argument raises
``ValueError`` or ``TypeError`` whose message names it, before anything reaches a kernel."""
from __future__ import annotations

import re

import pytest
import torch

pytestmark = pytest.mark.gpu


def _bad_calls():
    def base(dtype=torch.bfloat16, b=(1, 1), sq=1, sk=32, hq=8, hkv=8, d=64, kd=None, dev="cuda"):
        q = torch.randn(b[0], sq, hq, d, device=dev).to(dtype)
        k = torch.randn(b[1], sk, hkv, kd or d, device=dev).to(dtype)
        return q, k, k.clone()

    def call(**kw):
        def run(ops, q, k, v):  # workspaces are built here, not at collection time
            args = {key: val() if callable(val) else val for key, val in kw.items()}
            return ops.splitkv_attention(q, k, v, **args)
        return run

    plain = call()
    yield "q float32", lambda: base(torch.float32), plain, r"\bq\b|dtype"
    yield "k dtype != q", lambda: (lambda q, k, v: (q, k.half(), v))(*base()), plain, r"\bk\b|dtype"
    yield "head_dim 80", lambda: base(d=80), plain, r"head_dim|head dim|\b80\b"
    yield "block_kv 128 at head_dim 256", lambda: base(d=256), call(block_kv=128), r"block_kv.*head_dim 256"
    yield "k/v shapes", lambda: (lambda q, k, v: (q, k, v[:, :16]))(*base()), plain, r"\bk\b|\bv\b|shape"
    yield "batch", lambda: base(b=(2, 1)), plain, r"batch|\bq\b|\bk\b"
    yield "q/k head_dim", lambda: base(kd=128), plain, r"head_dim|head dim|\bk\b"
    yield "Hq % Hkv", lambda: base(hq=8, hkv=3), plain, r"head|Hq|Hkv"
    yield "rank", lambda: (lambda q, k, v: (q[0], k, v))(*base()), plain, r"\bq\b|dim|rank"
    yield "cpu", lambda: base(dev="cpu"), plain, r"\bq\b|device|cuda|CUDA"
    yield "last dim stride", lambda: (lambda q, k, v: (
        torch.randn(1, 1, 8, 128, device="cuda").bfloat16()[..., ::2], k, v))(*base()), plain, \
        r"\bq\b|stride|contiguous"
    for kw, name in ((dict(num_splits=0), "num_splits"), (dict(num_splits=129), "num_splits"),
                     (dict(block_kv=48), "block_kv"), (dict(reduce_threads=100), "reduce_threads"),
                     (dict(split_policy="foo"), "split_policy"), (dict(merge="dsmem"), "merge"),
                     (dict(enable_pdl="yes"), "enable_pdl")):
        yield f"{name}={list(kw.values())[0]}", base, call(**kw), name
    for kw in (dict(max_splits=8), dict(min_blocks_per_split=2), dict(split_plan="load_aware")):
        yield f"{list(kw)[0]} without cache_seqlens", base, call(**kw), "apply to paged or variable-length"
    yield "workspace too small", base, call(
        num_splits=8, workspace=lambda: torch.empty(16, dtype=torch.uint8, device="cuda")), "workspace"
    yield "workspace dtype", base, call(
        num_splits=8, workspace=lambda: torch.empty(1 << 20, dtype=torch.float32, device="cuda")), "workspace"
    yield "workspace device", base, call(
        num_splits=8, workspace=lambda: torch.empty(1 << 22, dtype=torch.uint8)), "workspace"


@pytest.mark.parametrize("make,run,pattern",
                         [pytest.param(*rest, id=name) for name, *rest in _bad_calls()])
def test_bad_arguments_raise(ops, make, run, pattern):
    q, k, v = make()
    with pytest.raises((ValueError, TypeError)) as info:
        run(ops, q, k, v)
    assert re.search(pattern, str(info.value)), f"message does not name the argument: {info.value}"
