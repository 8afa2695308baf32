"""GPU tests of the combine kernel alone (all marked ``gpu``): random partials, with splits
and whole rows empty, folded by ``ops.combine_partials`` and checked against the float64
reference fold (``reference.combine_partials_ref``) within two units of roundoff of the output
dtype; the output is NaN-poisoned before each call (``accuracy``)."""
from __future__ import annotations

import math

import pytest
import torch

from accuracy import UNIT_ROUNDOFF, assert_lse, poison_allocator
from splitkv_tune import tunables
from splitkv_tune.reference import combine_partials_ref, unpack_rows

pytestmark = pytest.mark.gpu

COMBINE_SPLITS = (1, 2, 3, 5, 17, 32, 97, 128)


def _random_partials(gen, s, b, hkv, rows, d):
    m = torch.randn(s, b, hkv, rows, generator=gen, device="cuda") * 20
    l = torch.rand(s, b, hkv, rows, generator=gen, device="cuda") * 100 + 1e-3
    o = torch.randn(s, b, hkv, rows, d, generator=gen, device="cuda") * l[..., None]
    empty = torch.rand(s, b, hkv, rows, generator=gen, device="cuda") < 0.3
    empty[:, :, :, [1, rows - 1]] = True  # rows whose splits are all empty
    m[empty], l[empty], o[empty] = -math.inf, 0.0, 0.0
    return o, m, l, empty


def _check_combine(ops, o, m, l, q_len, group, reduce_threads, out_dtype):
    ref_out, ref_lse = combine_partials_ref(o.double(), m.double(), l.double())
    ref_out, ref_lse = unpack_rows(ref_out, q_len, group), unpack_rows(ref_lse, q_len, group)
    b, hkv, d = o.shape[1], o.shape[2], o.shape[4]
    poison_allocator(b * q_len * hkv * group * d * torch.empty((), dtype=out_dtype).element_size(),
                      b * hkv * group * q_len * 4)
    out, lse = ops.combine_partials(o, m, l, q_len=q_len, group=group,
                                    reduce_threads=reduce_threads, out_dtype=out_dtype)
    torch.cuda.synchronize()
    assert out.dtype == out_dtype and out.shape == ref_out.shape
    assert torch.isfinite(out).all(), "combine output has NaN/inf"
    u = UNIT_ROUNDOFF[out_dtype]
    err = (out.double() - ref_out).abs()
    assert torch.all(err <= 2 * u * ref_out.abs() + 1e-4), f"combine max error {err.max():.3g}"
    assert_lse(lse, ref_lse)
    empty_rows = torch.isinf(ref_lse)
    assert torch.all(out.transpose(1, 2)[empty_rows] == 0), "all-empty rows must be 0"


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("d", tunables.HEAD_DIMS)
@pytest.mark.parametrize("reduce_threads", tunables.REDUCE_THREADS)
@pytest.mark.parametrize("num_splits", COMBINE_SPLITS)
def test_combine_kernel_alone(ops, cuda_gen, num_splits, reduce_threads, d, out_dtype):
    o, m, l, _ = _random_partials(cuda_gen, num_splits, 2, 2, 3 * 4, d)
    _check_combine(ops, o, m, l, 3, 4, reduce_threads, out_dtype)


@pytest.mark.parametrize("reduce_threads", tunables.REDUCE_THREADS)
def test_combine_skips_empty_splits(ops, cuda_gen, reduce_threads):
    """The contract says splits with l == 0 are skipped: NaN O / garbage m there are ignored."""
    o, m, l, empty = _random_partials(cuda_gen, 17, 1, 2, 5, 128)
    o[empty], m[empty] = math.nan, 1e4
    _check_combine(ops, o, m, l, 5, 1, reduce_threads, torch.bfloat16)
