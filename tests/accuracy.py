"""The accuracy rule and NaN poisoning that the GPU tests share (DESIGN.md).

Correctness rule (after FlashAttention's tests): with ``ref`` = float64 attention on the upcast
inputs and ``pt`` = the same attention done by PyTorch in the input dtype, a kernel's max error
must be <= 2 * pt's max error + the rounding of ``ref`` to the output dtype + 1e-3. NaN/inf
never passes. Workspaces are filled with NaN bytes and the CUDA caching allocator is handed
NaN-filled blocks of the output's size before a call, so an element a kernel forgets to write
shows up as NaN.
"""
from __future__ import annotations

import torch

from splitkv_tune.reference import attention_ref

# The output dtypes' unit roundoff, for checks tighter than the rule (a fold of partials alone).
UNIT_ROUNDOFF = {torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}


def nan_workspace(nbytes):
    return torch.full((max(nbytes, 1),), 0xFF, dtype=torch.uint8, device="cuda")  # all NaN


def poison_allocator(*nbytes):
    """Hand the caching allocator NaN-filled blocks, so ``torch.empty`` outputs start as NaN."""
    blocks = [torch.full((n,), 0xFF, dtype=torch.uint8, device="cuda") for n in nbytes if n]
    del blocks


def poison_for_output(q, with_lse=True):
    b, sq, hq, d = q.shape
    poison_allocator(b * sq * hq * d * q.element_size(), b * hq * sq * 4 if with_lse else 0)


def references(q, k, v, causal, softmax_scale=None):
    ref_out, ref_lse = attention_ref(q.double(), k.double(), v.double(), causal=causal,
                                     softmax_scale=softmax_scale)
    pt_out, _ = attention_ref(q, k, v, causal=causal, softmax_scale=softmax_scale)
    return ref_out, ref_lse, pt_out


def assert_rule(out, ref_out, pt_out, what="out"):
    """DESIGN.md's rule: err <= 2 * err(PyTorch in the input dtype) + rounding + 1e-3."""
    assert out.shape == ref_out.shape, f"{what}: shape {tuple(out.shape)}"
    assert out.dtype == pt_out.dtype, f"{what}: dtype {out.dtype}, expected {pt_out.dtype}"
    bad = ~torch.isfinite(out)
    assert not bad.any(), f"{what}: {int(bad.sum())} NaN/inf elements, first at {bad.nonzero()[0].tolist()}"
    err = (out.double() - ref_out).abs().max().item()
    pt_err = (pt_out.double() - ref_out).abs().max().item()
    rounding = (ref_out.to(out.dtype).double() - ref_out).abs().max().item()
    bound = 2 * pt_err + rounding + 1e-3
    assert err <= bound, f"{what}: max error {err:.3g} > bound {bound:.3g} (PyTorch {pt_err:.3g})"


def assert_lse(lse, ref_lse):
    assert lse.dtype == torch.float32, f"lse dtype {lse.dtype}"
    assert lse.shape == ref_lse.shape, f"lse shape {tuple(lse.shape)}"
    assert not lse.isnan().any(), "lse has NaN"
    ref_inf = torch.isinf(ref_lse)
    assert torch.equal(torch.isneginf(lse), ref_inf), "lse -inf rows differ from the reference"
    diff = (lse.double() - ref_lse)[~ref_inf].abs()
    tol = 1e-3 + 1e-5 * ref_lse[~ref_inf].abs()
    assert torch.all(diff <= tol), f"lse max error {diff.max().item():.3g}"
