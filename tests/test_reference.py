"""CPU tests of the PyTorch reference (``splitkv_tune.reference``) and the numeric contract.

Everything here runs without a GPU, in float64 unless the test is about fp16/bf16 inputs.
"""
from __future__ import annotations

import doctest
import itertools
import math

import pytest
import torch

from splitkv_tune import reference, tunables
from splitkv_tune.reference import (attention_ref, combine_partials_ref, pack_rows,
                                    splitkv_attention_ref, splitkv_partials_ref, unpack_rows)

F64 = torch.float64
SPLITS = (1, 2, 3, 5, 16, 64, 128)
COMBINE_SPLITS = (1, 2, 3, 5, 17, 32, 97, 128)


def _qkv(gen, b, sq, sk, hq, hkv, d, dtype=F64):
    q = torch.randn(b, sq, hq, d, generator=gen, dtype=F64)
    k = torch.randn(b, sk, hkv, d, generator=gen, dtype=F64)
    v = torch.randn(b, sk, hkv, d, generator=gen, dtype=F64)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def _naive_attention(q, k, v, causal, scale):
    """One row at a time, straight from the definition."""
    b_, sq, hq, _ = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    out = torch.zeros_like(q)
    lse = torch.full((b_, hq, sq), -math.inf, dtype=q.dtype)
    for b, h, i in itertools.product(range(b_), range(hq), range(sq)):
        last = i + sk - sq if causal else sk - 1
        if last < 0:
            continue
        x = k[b, :last + 1, h // (hq // hkv)] @ q[b, i, h] * scale
        lse[b, h, i] = torch.logsumexp(x, 0)
        out[b, i, h] = torch.softmax(x, 0) @ v[b, :last + 1, h // (hq // hkv)]
    return out, lse


def _assert_lse_equal(a, b, tol):
    assert torch.equal(torch.isinf(a), torch.isinf(b)), "-inf rows differ"
    fin = ~torch.isinf(b)
    assert torch.allclose(a[fin], b[fin], atol=tol, rtol=0)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """These problems are tiny: one thread avoids OpenMP contention on loaded CI runners."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_doctests():
    for module in (reference, tunables):
        result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
        assert result.failed == 0, f"{module.__name__}: {result.failed} doctest(s) failed"


# --------------------------------------------------------------------------- attention_ref
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("b,sq,sk,hq,hkv", [(2, 5, 7, 6, 2), (1, 9, 4, 4, 1), (2, 3, 3, 2, 2),
                                            (1, 1, 13, 4, 4), (1, 6, 1, 3, 1)])
def test_attention_ref_matches_naive(gen, causal, b, sq, sk, hq, hkv):
    q, k, v = _qkv(gen, b, sq, sk, hq, hkv, 8)
    out, lse = attention_ref(q, k, v, causal=causal, softmax_scale=0.3)
    n_out, n_lse = _naive_attention(q, k, v, causal, 0.3)
    assert torch.allclose(out, n_out, atol=1e-12)
    _assert_lse_equal(lse, n_lse, 1e-12)


def test_attention_ref_fully_masked_rows(gen):
    # Sq > Sk with causal: the first Sq - Sk queries see no key.
    q, k, v = _qkv(gen, 1, 7, 3, 2, 1, 16)
    out, lse = attention_ref(q, k, v, causal=True)
    assert not out.isnan().any() and not lse.isnan().any()
    assert torch.all(out[:, :4] == 0) and torch.all(lse[:, :, :4] == -math.inf)
    assert torch.isfinite(lse[:, :, 4:]).all()


def test_lse_is_natural_log_of_scaled_scores(gen):
    q, k, v = _qkv(gen, 1, 2, 37, 2, 1, 32)
    scale = 0.125
    _, lse = splitkv_attention_ref(q, k, v, softmax_scale=scale, num_splits=3, block_kv=32,
                                   return_lse=True)
    for h, i in itertools.product(range(2), range(2)):
        want = math.log(sum(math.exp(scale * float(k[0, j, 0] @ q[0, i, h])) for j in range(37)))
        assert abs(float(lse[0, h, i]) - want) < 1e-12


def test_default_softmax_scale(gen):
    q, k, v = _qkv(gen, 1, 3, 20, 2, 2, 64)
    a = splitkv_attention_ref(q, k, v, num_splits=2, return_lse=True)
    b = splitkv_attention_ref(q, k, v, softmax_scale=1 / 8, num_splits=2, return_lse=True)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


# ---------------------------------------------------------------- split reference vs ref
SHAPES = [  # (B, Sq, Sk, Hq, Hkv, D)
    (1, 1, 1, 4, 4, 16),       # Sk = 1
    (2, 1, 100, 8, 2, 16),     # GQA decode
    (1, 1, 777, 8, 1, 16),     # MQA decode, Sk not a tile multiple
    (2, 3, 50, 4, 4, 64),      # MHA, short
    (1, 17, 33, 6, 3, 16),
    (1, 40, 17, 4, 2, 16),     # Sq > Sk
    (1, 5, 1, 2, 1, 16),       # Sk = 1, Sq > Sk
    (1, 64, 300, 2, 2, 16),
    (1, 300, 300, 1, 1, 16),   # several query tiles of 64
    (1, 20, 1100, 16, 1, 16),  # MQA prefill, 320 packed rows
    (1, 600, 700, 2, 1, 16),   # 1200 packed rows: tiles of 128
    (2, 1, 300, 8, 1, 256),    # Gemma-like GQA-8 decode, D = 256
    (1, 3, 200, 4, 4, 96),     # Phi-3-like MHA, D = 96
]


def _split_cases():
    block_kvs = itertools.cycle(tunables.BLOCK_KV)
    for shape, causal, policy, s in itertools.product(SHAPES, (False, True),
                                                      tunables.SPLIT_POLICIES, SPLITS):
        yield pytest.param(shape, causal, policy, s, next(block_kvs),
                           id=f"{'x'.join(map(str, shape))}-{'causal' if causal else 'full'}"
                              f"-{policy}-S{s}")


@pytest.mark.parametrize("shape,causal,policy,num_splits,block_kv", list(_split_cases()))
def test_split_reference_matches_attention(gen, shape, causal, policy, num_splits, block_kv):
    q, k, v = _qkv(gen, *shape)
    out, lse = attention_ref(q, k, v, causal=causal)
    s_out, s_lse = splitkv_attention_ref(q, k, v, causal=causal, num_splits=num_splits,
                                         block_kv=block_kv, split_policy=policy,
                                         return_lse=True)
    assert s_out.dtype == F64 and s_lse.dtype == F64
    assert not s_out.isnan().any() and not s_lse.isnan().any()
    assert torch.allclose(s_out, out, atol=1e-12, rtol=0)
    _assert_lse_equal(s_lse, lse, 1e-12)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("policy", tunables.SPLIT_POLICIES)
@pytest.mark.parametrize("sq,sk,hq,hkv,num_splits,block_kv", [
    (1, 100, 4, 2, 7, 32), (3, 200, 2, 1, 16, 32), (70, 150, 1, 1, 5, 64),
    (9, 5, 4, 1, 3, 32), (40, 300, 2, 2, 128, 32), (600, 400, 2, 1, 4, 128)])
def test_split_key_sets(causal, policy, sq, sk, hq, hkv, num_splits, block_kv):
    """Which keys each split holds for each packed row, read from the partials themselves.

    With q = 0 every visible key has weight 1, and with v = one-hot(key) the un-normalised O
    of a split lists its keys. They must be exactly ``split_range`` of the row's tile
    intersected with the row's causal mask; the splits of a row are disjoint and cover
    every key the row sees.
    """
    q = torch.zeros(1, sq, hq, sk, dtype=F64)
    v = torch.eye(sk, dtype=F64)[None, :, None, :].expand(1, sk, hkv, sk)
    o, m, l = splitkv_partials_ref(q, v, v, causal=causal, softmax_scale=None,
                                   num_splits=num_splits, block_kv=block_kv,
                                   split_policy=policy)
    shape = tunables.Shape("fp64", sk, 1, hq, hkv, sq, sk, causal)
    group, rows = shape.group, shape.packed_rows
    assert o.shape == (num_splits, 1, hkv, rows, sk) and m.shape == l.shape == o.shape[:-1]
    bm = tunables.block_m_for(rows)
    keys = torch.arange(sk)
    for r in range(rows):
        kv_end = tunables.tile_kv_end(shape, r // bm)
        last = r // group + sk - sq if causal else sk - 1
        covered = torch.zeros(sk, dtype=F64)
        for s in range(num_splits):
            start, end = tunables.split_range(s, num_splits, sk, kv_end, block_kv, policy)
            want = ((keys >= start) & (keys < end) & (keys <= last)).to(F64)
            got = o[s, 0, :, r]
            assert torch.equal(got, want.expand_as(got)), (r, s)
            assert torch.all(l[s, 0, :, r] == want.sum())
            if want.sum() == 0:  # empty split: -inf / 0 / 0
                assert torch.all(m[s, 0, :, r] == -math.inf)
            else:
                assert torch.all(m[s, 0, :, r] == 0)
            covered += want
        assert torch.equal(covered, (keys <= last).to(F64)), f"row {r} not partitioned"


@pytest.mark.parametrize("policy", tunables.SPLIT_POLICIES)
def test_more_splits_than_kv_blocks(gen, policy):
    q, k, v = _qkv(gen, 1, 2, 70, 4, 2, 16)  # 3 blocks of 32, 128 splits
    o, m, l = splitkv_partials_ref(q, k, v, causal=False, softmax_scale=None, num_splits=128,
                                   block_kv=32, split_policy=policy)
    empty = l == 0
    live_splits = int((~empty).all(dim=(1, 2, 3)).sum())
    assert live_splits == (3 if policy == "blocks" else 70)
    assert torch.all(m[empty] == -math.inf) and torch.all(o[empty] == 0)
    assert torch.isfinite(m[~empty]).all() and torch.all(l[~empty] >= 1)
    out = splitkv_attention_ref(q, k, v, num_splits=128, block_kv=32, split_policy=policy)
    assert torch.allclose(out, attention_ref(q, k, v)[0], atol=1e-12)


def test_single_split_partials_are_the_softmax_state(gen):
    q, k, v = _qkv(gen, 2, 3, 50, 4, 2, 16)
    o, m, l = splitkv_partials_ref(q, k, v, causal=False, softmax_scale=None, num_splits=1,
                                   block_kv=64, split_policy="blocks")
    out, lse = attention_ref(q, k, v)
    packed_lse = pack_rows(lse.transpose(1, 2)[..., None], 2)[..., 0]
    assert torch.allclose(m[0] + torch.log(l[0]), packed_lse)
    assert torch.allclose(o[0] / l[0][..., None], pack_rows(out, 2))


# ---------------------------------------------------------------------------- combine
def _random_partials(gen, s, b=2, hkv=2, rows=6, d=8, p_empty=0.3, empty_rows=(1, 4)):
    m = torch.randn(s, b, hkv, rows, generator=gen, dtype=F64) * 20
    l = torch.rand(s, b, hkv, rows, generator=gen, dtype=F64) * 100 + 1e-3
    o = torch.randn(s, b, hkv, rows, d, generator=gen, dtype=F64) * l[..., None]
    empty = torch.rand(s, b, hkv, rows, generator=gen) < p_empty
    empty[:, :, :, list(empty_rows)] = True  # rows whose every split is empty
    m[empty], l[empty], o[empty] = -math.inf, 0.0, 0.0
    return o, m, l, empty


def _combine_loop(o, m, l):
    """The contract's merge, one row at a time in plain Python floats."""
    s_count, b_, h_, r_, d = o.shape
    out = torch.zeros(b_, h_, r_, d, dtype=F64)
    lse = torch.full((b_, h_, r_), -math.inf, dtype=F64)
    for b, h, r in itertools.product(range(b_), range(h_), range(r_)):
        live = [s for s in range(s_count) if l[s, b, h, r] > 0]
        if not live:
            continue
        mx = max(float(m[s, b, h, r]) for s in live)
        ls = sum(math.exp(float(m[s, b, h, r]) - mx) * float(l[s, b, h, r]) for s in live)
        out[b, h, r] = sum(math.exp(float(m[s, b, h, r]) - mx) * o[s, b, h, r] for s in live) / ls
        lse[b, h, r] = mx + math.log(ls)
    return out, lse


@pytest.mark.parametrize("num_splits", COMBINE_SPLITS)
def test_combine_formula_on_random_partials(gen, num_splits):
    o, m, l, _ = _random_partials(gen, num_splits)
    out, lse = combine_partials_ref(o, m, l)
    want_out, want_lse = _combine_loop(o, m, l)
    assert not out.isnan().any() and not lse.isnan().any()
    assert torch.allclose(out, want_out, atol=1e-12, rtol=1e-12)
    _assert_lse_equal(lse, want_lse, 1e-12)
    assert torch.all(out[:, :, [1, 4]] == 0) and torch.all(lse[:, :, [1, 4]] == -math.inf)


@pytest.mark.parametrize("num_splits", COMBINE_SPLITS)
def test_combine_equals_softmax_over_all_keys(gen, num_splits):
    """Partials built from explicit scores: merging them is softmax over the union."""
    lengths = torch.randint(0, 6, (num_splits,), generator=gen).tolist()
    lengths[0] = max(lengths[0], 1)
    x = torch.randn(sum(lengths), generator=gen, dtype=F64) * 5
    v = torch.randn(sum(lengths), 4, generator=gen, dtype=F64)
    o = torch.zeros(num_splits, 1, 1, 1, 4, dtype=F64)
    m = torch.full((num_splits, 1, 1, 1), -math.inf, dtype=F64)
    l = torch.zeros(num_splits, 1, 1, 1, dtype=F64)
    for s, (xs, vs) in enumerate(zip(x.split(lengths), v.split(lengths))):
        if len(xs):
            m[s] = xs.max()
            p = torch.exp(xs - xs.max())
            l[s], o[s] = p.sum(), p @ vs
    out, lse = combine_partials_ref(o, m, l)
    assert torch.allclose(out.flatten(), torch.softmax(x, 0) @ v, atol=1e-12)
    assert abs(float(lse) - float(torch.logsumexp(x, 0))) < 1e-12


def test_combine_skips_empty_splits_whatever_they_hold(gen):
    """``l == 0`` splits are skipped: garbage m and NaN O there must not leak."""
    o, m, l, empty = _random_partials(gen, 5)
    want = combine_partials_ref(o, m, l)
    o2, m2 = o.clone(), m.clone()
    o2[empty] = math.nan
    m2[empty] = 1e4
    got = combine_partials_ref(o2, m2, l)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_combine_all_splits_empty():
    o = torch.zeros(3, 1, 2, 4, 8, dtype=F64)
    m = torch.full((3, 1, 2, 4), -math.inf, dtype=F64)
    out, lse = combine_partials_ref(o, m, torch.zeros_like(m))
    assert torch.all(out == 0) and torch.all(lse == -math.inf)


def _as_partial(out, lse):
    """A merged result as one partial: m = lse, l = 1, O = out (or -inf / 0 / 0)."""
    empty = torch.isinf(lse)
    return (out[None], lse[None], torch.where(empty, 0.0, 1.0).to(F64)[None])


@pytest.mark.parametrize("num_splits", [2, 3, 5, 17, 32, 97, 128])
def test_merge_is_associative(gen, num_splits):
    o, m, l, _ = _random_partials(gen, num_splits)
    want_out, want_lse = combine_partials_ref(o, m, l)
    for cut in sorted({1, num_splits // 2, num_splits - 1}):
        a = _as_partial(*combine_partials_ref(o[:cut], m[:cut], l[:cut]))
        b = _as_partial(*combine_partials_ref(o[cut:], m[cut:], l[cut:]))
        out, lse = combine_partials_ref(*(torch.cat(pair) for pair in zip(a, b)))
        assert torch.allclose(out, want_out, atol=1e-12, rtol=1e-10), cut
        _assert_lse_equal(lse, want_lse, 1e-10)


@pytest.mark.parametrize("causal", [False, True])
def test_every_split_count_same_answer(gen, causal):
    q, k, v = _qkv(gen, 1, 5, 260, 4, 2, 16)
    ref = attention_ref(q, k, v, causal=causal)[0]
    for s, policy in itertools.product(range(1, 129, 9), tunables.SPLIT_POLICIES):
        out = splitkv_attention_ref(q, k, v, causal=causal, num_splits=s, block_kv=32,
                                    split_policy=policy)
        assert torch.allclose(out, ref, atol=1e-12), (s, policy)


# ---------------------------------------------------------------------- rows and dtypes
def test_pack_unpack_rows(gen):
    q = torch.randn(2, 3, 6, 4, generator=gen)
    packed = pack_rows(q, 2)  # G = 3
    for qi, g, hkv in itertools.product(range(3), range(3), range(2)):
        assert torch.equal(packed[:, hkv, qi * 3 + g], q[:, qi, hkv * 3 + g])
    assert torch.equal(unpack_rows(packed, 3, 3), q)
    lse = torch.randn(2, 6, 3, generator=gen)  # (B, Hq, Sq)
    packed_lse = pack_rows(lse.transpose(1, 2)[..., None], 2)[..., 0]
    assert torch.equal(unpack_rows(packed_lse, 3, 3), lse)
    with pytest.raises(ValueError):
        unpack_rows(packed, 2, 3)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
def test_half_precision_inputs(gen, dtype, causal):
    q, k, v = _qkv(gen, 2, 9, 5 if causal else 300, 8, 2, 64, dtype=dtype)
    out, lse = splitkv_attention_ref(q, k, v, causal=causal, num_splits=7, block_kv=32,
                                     split_policy="length", return_lse=True)
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert out.shape == q.shape and lse.shape == (2, 8, 9)
    assert not out.isnan().any() and not lse.isnan().any()
    ref_out, ref_lse = attention_ref(q.double(), k.double(), v.double(), causal=causal)
    # Computed in float32 from the same half inputs: only the final rounding differs.
    u = 2.0 ** -11 if dtype == torch.float16 else 2.0 ** -8
    assert torch.all((out.double() - ref_out).abs() <= u * ref_out.abs() + 1e-5)
    _assert_lse_equal(lse.double(), ref_lse, 1e-5)
    assert splitkv_attention_ref(q, k, v, causal=causal).dtype == dtype


def test_float32_stays_float32(gen):
    q, k, v = _qkv(gen, 1, 2, 40, 2, 1, 16, dtype=torch.float32)
    out, lse = splitkv_attention_ref(q, k, v, num_splits=3, block_kv=32, return_lse=True)
    assert out.dtype == lse.dtype == torch.float32


# --------------------------------------------------------------------------- validation
@pytest.mark.parametrize("kwargs,name", [
    (dict(num_splits=0), "num_splits"), (dict(num_splits=129), "num_splits"),
    (dict(num_splits=2.0), "num_splits"), (dict(block_kv=48), "block_kv"),
    (dict(split_policy="foo"), "split_policy")])
def test_invalid_config(gen, kwargs, name):
    q, k, v = _qkv(gen, 1, 1, 8, 2, 1, 16)
    with pytest.raises(ValueError, match=name):
        splitkv_attention_ref(q, k, v, **kwargs)


def test_invalid_shapes(gen):
    q, k, v = _qkv(gen, 1, 2, 8, 6, 4, 16)
    with pytest.raises(ValueError, match="multiple"):
        splitkv_attention_ref(q, k, v)
    q, k, v = _qkv(gen, 1, 2, 8, 4, 2, 16)
    with pytest.raises(ValueError, match="same shape"):
        splitkv_attention_ref(q, k, v[:, :4])
    with pytest.raises(ValueError, match="head_dim"):
        splitkv_attention_ref(q[..., :8], k, v)
    with pytest.raises(ValueError, match="4-D"):
        attention_ref(q[0], k, v)
    with pytest.raises(TypeError, match="dtype"):
        splitkv_attention_ref(q.float(), k, v)
    with pytest.raises(ValueError, match="q must have at least one entry"):
        splitkv_attention_ref(q[:0], k[:0], v[:0])
    with pytest.raises(TypeError, match="floating-point"):
        splitkv_attention_ref(q.int(), k.int(), v.int())
