"""GPU tests of paged and variable-length batches (``cache_seqlens`` / ``block_table``).

Every output is checked against float64 attention over each sequence's live keys with the
accuracy rule of ``accuracy.py``. Pages past a sequence's live keys, the rest of its last page
and every unused page of the pool are NaN, as are the outputs and the workspace before each
call, so a key read past a length or an element left unwritten shows up. Tables are shuffled.
"""
from __future__ import annotations

import random

import pytest
import torch

from accuracy import assert_lse, assert_rule, nan_workspace, poison_for_output, references

from splitkv_tune import live, plan, tunables

pytestmark = pytest.mark.gpu

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def _batch(gen, lengths, *, page_size, q_heads=32, kv_heads=8, head_dim=128, q_len=1, dtype="bf16",
           width_mult=1, extra_pages=3, capacity=None):
    """q, the caches (page pools with a shuffled table, or a contiguous cache) and each
    sequence's live K and V. The cache holds ``capacity`` keys per sequence (default: the
    longest length) times ``width_mult``."""
    dt = DTYPES[dtype]
    batch = len(lengths)
    q = torch.randn(batch, q_len, q_heads, head_dim, generator=gen, device="cuda").to(dt)
    keys = [(torch.randn(1, n, kv_heads, head_dim, generator=gen, device="cuda").to(dt),
             torch.randn(1, n, kv_heads, head_dim, generator=gen, device="cuda").to(dt)) for n in lengths]
    cap_keys = max(capacity or max(lengths), 1)
    if page_size is None:
        cache = [torch.full((batch, cap_keys * width_mult, kv_heads, head_dim), float("nan"), dtype=dt,
                            device="cuda") for _ in range(2)]
        for b, (kb, vb) in enumerate(keys):
            cache[0][b, :lengths[b]] = kb[0]
            cache[1][b, :lengths[b]] = vb[0]
        return q, cache[0], cache[1], None, keys
    width = -(-cap_keys // page_size) * width_mult
    num_pages = batch * width + extra_pages
    order = torch.randperm(num_pages, generator=torch.Generator().manual_seed(len(lengths) * 7919 + page_size))
    table = order[:batch * width].view(batch, width).to(torch.int32).cuda()
    pools = [torch.full((num_pages, page_size, kv_heads, head_dim), float("nan"), dtype=dt, device="cuda")
             for _ in range(2)]
    for b, (kb, vb) in enumerate(keys):
        n_pages = -(-lengths[b] // page_size)
        pages = table[b, :n_pages].long()
        for pool, x in zip(pools, (kb, vb)):
            padded = torch.full((n_pages * page_size, kv_heads, head_dim), float("nan"), dtype=dt, device="cuda")
            padded[:lengths[b]] = x[0]
            pool[pages] = padded.view(n_pages, page_size, kv_heads, head_dim)  # the rest of the last page: NaN
    return q, pools[0], pools[1], table, keys


def _check(q, out, lse, keys, lengths, causal):
    """Each sequence against float64 attention over its live keys; length 0: O = 0, lse = -inf."""
    for b, ((kb, vb), n) in enumerate(zip(keys, lengths)):
        if n == 0:
            assert torch.equal(out[b], torch.zeros_like(out[b])), f"sequence {b} (length 0): O is not 0"
            if lse is not None:
                assert torch.isneginf(lse[b]).all(), f"sequence {b} (length 0): lse is not -inf"
            continue
        ref_out, ref_lse, pt_out = references(q[b:b + 1], kb, vb, causal)
        assert_rule(out[b:b + 1], ref_out, pt_out, f"sequence {b} (length {n})")
        if lse is not None:
            assert_lse(lse[b:b + 1], ref_lse)


def _run(ops, q, k, v, table, lengths, **kw):
    seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    poison_for_output(q)
    return ops.splitkv_attention(q, k, v, cache_seqlens=seqlens, block_table=table, return_lse=True, **kw)


def _lengths_around(page_size, block_kv=64):
    edges = {0, 1, page_size - 1, page_size, page_size + 1, block_kv - 1, block_kv + 1, 3 * page_size + 5, 4097}
    return sorted(n for n in edges if n >= 0)


@pytest.mark.parametrize("page_size", (None,) + plan.PAGE_SIZES, ids=lambda p: f"page{p}" if p else "contiguous")
@pytest.mark.parametrize("dtype,causal,q_len", [("bf16", False, 1), ("fp16", True, 4), ("bf16", True, 13)])
@pytest.mark.parametrize("max_splits", [1, 3, "auto"])
def test_paged_and_contiguous_caches_with_live_lengths(ops, cuda_gen, page_size, dtype, causal, q_len, max_splits):
    lengths = _lengths_around(page_size or 64)
    q, k, v, table, keys = _batch(cuda_gen, lengths, page_size=page_size, q_len=q_len, dtype=dtype)
    out, lse = _run(ops, q, k, v, table, lengths, causal=causal, max_splits=max_splits, min_blocks_per_split=1)
    _check(q, out, lse, keys, lengths, causal)


@pytest.mark.parametrize("head_dim", tunables.HEAD_DIMS)
@pytest.mark.parametrize("heads", [(8, 8), (32, 8), (32, 4), (16, 1)], ids=["mha", "gqa4", "gqa8", "mqa"])
@pytest.mark.parametrize("merge", ["fused", "kernel"])
def test_head_dims_gqa_ratios_and_merges(ops, cuda_gen, head_dim, heads, merge):
    lengths = [700, 0, 2049, 64, 1, 3000]
    for block_kv in tunables.BLOCK_KV_BY_HEAD_DIM[head_dim]:
        q, k, v, table, keys = _batch(cuda_gen, lengths, page_size=32, q_heads=heads[0], kv_heads=heads[1],
                                      head_dim=head_dim, dtype="fp16" if head_dim == 96 else "bf16")
        out, lse = _run(ops, q, k, v, table, lengths, block_kv=block_kv, min_blocks_per_split=2, max_splits=16,
                        merge=merge, reduce_threads=64)
        _check(q, out, lse, keys, lengths, False)


# 300 and 1100: more sequences than a CTA has threads (the schedule's scan takes several rounds)
# and more than a warp's 32 per share of its sort.
@pytest.mark.parametrize("batch", [1, 2, 7, 64, 96, 300, 1100])
def test_batch_sizes_with_random_lengths(ops, cuda_gen, batch):
    rng = random.Random(batch)
    lengths = [rng.choice([0, 1, rng.randrange(1, 300), rng.randrange(1, 9000)]) for _ in range(batch)]
    q, k, v, table, keys = _batch(cuda_gen, lengths, page_size=16, kv_heads=4, q_heads=16)
    out, lse = _run(ops, q, k, v, table, lengths)
    _check(q, out, lse, keys, lengths, False)


def test_threads_launching_different_batch_sizes_at_once(ops, cuda_gen):
    """Two threads on their own streams, launching batches whose schedules take different shared
    memory (the kernel's limit is raised once per device, to one size whatever the batch): every
    call succeeds and gives the bits the thread's batch gave alone."""
    import threading
    rng = random.Random(5)
    batches = []
    for batch in (3, 1100):
        lengths = [rng.randrange(0, 3000) for _ in range(batch)]
        q, k, v, table, _ = _batch(cuda_gen, lengths, page_size=16, kv_heads=4, q_heads=16)
        seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
        alone = ops.splitkv_attention(q, k, v, cache_seqlens=seqlens, block_table=table)
        batches.append((q, k, v, table, seqlens, alone))
    torch.cuda.synchronize()
    errors, results = [], [[] for _ in batches]

    def launch(i):
        q, k, v, table, seqlens, _ = batches[i]
        try:
            with torch.cuda.stream(torch.cuda.Stream()):
                for _ in range(40):
                    results[i].append(ops.splitkv_attention(q, k, v, cache_seqlens=seqlens, block_table=table))
                torch.cuda.current_stream().synchronize()
        except Exception as exc:  # noqa: BLE001 - reported below, with the thread's batch
            errors.append((i, repr(exc)))

    threads = [threading.Thread(target=launch, args=(i,)) for i in range(len(batches))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for (*_, alone), outs in zip(batches, results):
        assert len(outs) == 40 and all(torch.equal(out, alone) for out in outs)


def test_long_sequences_up_to_128k(ops, cuda_gen):
    lengths = [131072, 65536, 1, 0, 4095]
    q, k, v, table, keys = _batch(cuda_gen, lengths, page_size=256, q_heads=16, kv_heads=2)
    for max_splits in (2, "auto", tunables.MAX_SPLITS):
        out, lse = _run(ops, q, k, v, table, lengths, max_splits=max_splits)
        _check(q, out, lse, keys, lengths, False)


# FlashAttention's test_flash_attn_kvcache grid (seqlen_q, seqlen_k pairs, MHA / MQA / GQA over six
# query heads, causal or not) on caches whose live lengths are random and shorter than the
# capacity seqlen_k, contiguous and paged (its page sizes above 256 are not ours).
FA_KVCACHE_SEQLENS = [(1, 128), (1, 339), (3, 1024), (64, 800), (64, 256), (3, 799), (64, 2048), (16, 20000),
                      (1, 128 * 1024), (16, 128 * 1024), (128, 128)]


@pytest.mark.parametrize("page_size", [None, 16, 256], ids=lambda p: f"page{p}" if p else "contiguous")
@pytest.mark.parametrize("q_len,capacity", FA_KVCACHE_SEQLENS)
@pytest.mark.parametrize("kv_heads", [6, 1, 3], ids=["mha", "mqa", "gqa"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_flash_attn_kvcache_style(ops, cuda_gen, page_size, q_len, capacity, kv_heads, head_dim, causal):
    rng = random.Random(f"{page_size}-{q_len}-{capacity}-{kv_heads}-{head_dim}-{causal}")
    lengths = [rng.randint(0, capacity) for _ in range(2)]
    q, k, v, table, keys = _batch(cuda_gen, lengths, page_size=page_size, q_heads=6, kv_heads=kv_heads,
                                  head_dim=head_dim, q_len=q_len, capacity=capacity)
    out, lse = _run(ops, q, k, v, table, lengths, causal=causal)
    _check(q, out, lse, keys, lengths, causal)


def test_every_length_zero(ops, cuda_gen):
    lengths = [0, 0, 0]
    q, k, v, table, keys = _batch(cuda_gen, lengths, page_size=64)
    out, lse = _run(ops, q, k, v, table, lengths)
    _check(q, out, lse, keys, lengths, False)


def test_capacity_and_batch_do_not_change_a_sequences_bits(ops, cuda_gen):
    """The same live lengths with a table 1x, 8x and 64x wider, and one sequence beside short
    or long neighbours at another index, give the same bits."""
    lengths = [5000, 77, 0, 20000]
    outs = []
    for mult in (1, 8, 64):
        gen = torch.Generator(device="cuda").manual_seed(5)
        q, k, v, table, _ = _batch(gen, lengths, page_size=64, width_mult=mult)
        outs.append(_run(ops, q, k, v, table, lengths, check_inputs=False))
    for out, lse in outs[1:]:
        assert torch.equal(out, outs[0][0]) and torch.equal(lse, outs[0][1]), "table width changed the output"
    knobs = dict(min_blocks_per_split=4, max_splits=33)  # "auto" follows the batch size
    q, k, v, table, keys = _batch(cuda_gen, [20000], page_size=64)
    alone = _run(ops, q, k, v, table, [20000], **knobs)
    for neighbours in ([1, 1, 1], [60000, 30000, 9]):
        lengths = neighbours[:1] + [20000] + neighbours[1:]
        qn, kn, vn, tn, keys_n = _batch(cuda_gen, lengths, page_size=64)
        qn[1] = q[0]
        pages = tn[1, :-(-20000 // 64)].tolist()
        for i, page in enumerate(pages):
            kn[page] = k[table[0, i]]
            vn[page] = v[table[0, i]]
        out, lse = _run(ops, qn, kn, vn, tn, lengths, **knobs)
        assert torch.equal(out[1], alone[0][0]) and torch.equal(lse[1], alone[1][0]), \
            f"neighbours {neighbours} changed the sequence's output"


@pytest.mark.parametrize("lengths,merge,base,want_coarser", [
    ([8192] * 16, "fused", "auto", True),                 # equal lengths: about one item per CTA
    ([32768] * 4, "kernel", "auto", True),                # the combine kernel reads the launch's choice
    ([65536] + [1024] * 15, "kernel", "auto", False),     # a long sequence and short ones: the knob itself
    ([3000, 0, 1, 130_000, 64, 70_000], "fused", 2, None),  # a base knob given
], ids=["16x8K", "4x32K", "64K+15x1K", "mixed"])
def test_load_aware_plan_is_the_hosts(ops, cuda_gen, lengths, merge, base, want_coarser):
    """With split_plan "load_aware" the launch chooses min_blocks_per_split among the base knob's
    multiples on the device; the host's rule (plan.plan_min_blocks for the launch's grid) names
    the same knob: the explicit call with it gives the same bits."""
    q, k, v, table, keys = _batch(cuda_gen, lengths, page_size=64)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    bkv, knob, bound = live.resolve_knobs(len(lengths), 128, 8, 4, sms, min_blocks_per_split=base)
    ctas = live.launch_grid(q, 8, bkv, knob, bound)
    chosen = plan.plan_min_blocks(lengths, kv_heads=8, packed_rows=4, ctas=ctas, block_kv=bkv,
                                  min_blocks_per_split=knob, max_splits=bound)
    if want_coarser is not None:
        assert (chosen > knob) == want_coarser, f"chose {chosen} from {knob} on {ctas} CTAs"
    out, lse = _run(ops, q, k, v, table, lengths, merge=merge, min_blocks_per_split=base, split_plan="load_aware",
                    workspace=nan_workspace(live.workspace_size(q, bound)))
    fixed = _run(ops, q, k, v, table, lengths, merge=merge, block_kv=bkv, min_blocks_per_split=chosen,
                 max_splits=bound)
    assert torch.equal(out, fixed[0]) and torch.equal(lse, fixed[1]), "the device chose another knob"
    _check(q, out, lse, keys, lengths, False)


@pytest.mark.parametrize("kv_heads", [1, 8])
def test_load_aware_plan_past_one_warp_is_the_hosts(ops, cuda_gen, kv_heads):
    """Batches of 40, 129 and 300 sequences (past one warp's 32 and the CTA's 128 threads, whose
    tally the device sums across warps) in many size classes, padded slots among them, at base
    knob 1 (five choices: warp 0 estimates two): the knob the device leaves in the workspace's
    plan slot is the host rule's, and the output is that knob's, bit for bit."""
    from splitkv_tune import _rules
    q_heads = 4 * kv_heads
    chosen = []
    for batch in (40, 129, 300):
        rnd = random.Random(batch)
        lengths = [0 if i % 7 == 3 else min(6000, int(rnd.lognormvariate(6.5, 1.2))) for i in range(batch)]
        q, k, v, table, _ = _batch(cuda_gen, lengths, page_size=64, q_heads=q_heads, kv_heads=kv_heads)
        bkv, knob, bound = live.resolve_knobs(batch, 128, kv_heads, 4, torch.cuda.get_device_properties(0)
                                              .multi_processor_count, min_blocks_per_split=1, max_splits=64)
        assert _rules.live_plan_choices(knob, bkv) == 5
        ctas = live.launch_grid(q, kv_heads, bkv, knob, bound)
        host = plan.plan_min_blocks(lengths, kv_heads=kv_heads, packed_rows=4, ctas=ctas, block_kv=bkv,
                                    min_blocks_per_split=knob, max_splits=bound)
        workspace = nan_workspace(live.workspace_size(q, bound))
        out, lse = _run(ops, q, k, v, table, lengths, min_blocks_per_split=knob, max_splits=bound,
                        split_plan="load_aware", workspace=workspace)
        plan_slot = _rules.workspace_plan_offset(bound, batch, q_heads, 1, 128)
        device = int(workspace[plan_slot:plan_slot + 4].view(torch.int32).item())
        assert device == host, f"{batch} sequences on {ctas} CTAs: the device chose {device}, the host {host}"
        fixed = _run(ops, q, k, v, table, lengths, block_kv=bkv, min_blocks_per_split=host, max_splits=bound)
        assert torch.equal(out, fixed[0]) and torch.equal(lse, fixed[1]), f"{batch} sequences: other bits"
        chosen.append(host)
    assert len(set(chosen)) > 1, f"every batch chose {chosen[0]}: the estimates were not told apart"


@pytest.mark.parametrize("dtype,head_dim,q_heads,kv_heads,q_len", [
    ("bf16", 128, 32, 8, 1), ("bf16", 128, 8, 1, 1), ("fp16", 64, 32, 32, 1), ("bf16", 256, 32, 8, 4),
    ("fp16", 96, 32, 4, 4)])
@pytest.mark.parametrize("batch", [1, 64, 1024])
def test_the_selectors_ctas_per_sm_is_the_fixed_launchs(dtype, head_dim, q_heads, kv_heads, q_len, batch):
    """The model of the selector sizes each candidate's grid as rules.h's live_grid on SMs x
    live.launch_ctas_per_sm; a fixed-plan launch of those knobs has that grid (its shared memory
    grows with the batch)."""
    from splitkv_tune import _rules
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    per_sm = live.launch_ctas_per_sm(dtype, head_dim, batch, q_heads, kv_heads, q_len)
    assert 1 <= per_sm <= _rules.LIVE_MODEL["max_ctas_per_sm"]
    q = torch.empty(batch, q_len, q_heads, head_dim, dtype=DTYPES[dtype], device="cuda")
    rows = q_len * (q_heads // kv_heads)
    for max_splits in (1, 8, 64):
        capacity = batch * kv_heads * _rules.num_m_blocks(rows) * max_splits
        min_blocks = 4096  # a knob whose launch does not choose (live_plan_choices 1)
        assert _rules.live_plan_choices(min_blocks, 64) == 1
        assert live.launch_grid(q, kv_heads, 64, min_blocks, max_splits) == min(capacity, sms * per_sm)


def test_graph_replays_any_length_mix(ops, cuda_gen):
    """Captured once with every length 1, replayed with 200 random mixes up to 64K: bit for bit
    the eager call's output each time."""
    batch, cap = 4, 65536
    q, k, v, table, _ = _batch(cuda_gen, [cap] * batch, page_size=64)
    seqlens = torch.ones(batch, dtype=torch.int32, device="cuda")
    call = lambda: ops.splitkv_attention(q, k, v, cache_seqlens=seqlens, block_table=table, return_lse=True)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        call()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_out, g_lse = call()
    rng = random.Random(11)
    for step in range(200):
        mix = [rng.choice([0, 1, rng.randrange(1, 4096), rng.randrange(1, cap + 1)]) for _ in range(batch)]
        seqlens.copy_(torch.tensor(mix, dtype=torch.int32))
        graph.replay()
        want_out, want_lse = call()
        assert torch.equal(g_out, want_out) and torch.equal(g_lse, want_lse), f"replay {step} ({mix}) differs"
    mix = [cap, 0, 3, 40000]
    seqlens.copy_(torch.tensor(mix, dtype=torch.int32))
    graph.replay()
    keys = [(k[table[b]].reshape(1, -1, *k.shape[2:])[:, :n], v[table[b]].reshape(1, -1, *v.shape[2:])[:, :n])
            for b, n in enumerate(mix)]
    _check(q, g_out, g_lse, keys, mix, False)


def test_fused_merge_counters_stay_zero(ops, cuda_gen):
    lengths = [9000, 0, 1, 300, 64]
    q, k, v, table, _ = _batch(cuda_gen, lengths, page_size=16)
    stream = torch.cuda.current_stream()
    outs = [_run(ops, q, k, v, table, lengths, merge="fused", max_splits=m)[0] for m in (17, 2, 17)]
    torch.cuda.synchronize()
    assert torch.equal(outs[0], outs[2])
    counters = ops._extension().read_eager_counters(stream.device.index, stream.cuda_stream)
    assert counters and not any(counters), "tile counters not back at zero"


def test_preallocated_workspace_and_compile(ops, cuda_gen):
    lengths = [3000, 5, 0]
    q, k, v, table, keys = _batch(cuda_gen, lengths, page_size=128)
    seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    ws = nan_workspace(live.workspace_size(q, 24))
    out, lse = ops.splitkv_attention(q, k, v, cache_seqlens=seqlens, block_table=table, max_splits=24,
                                     workspace=ws, return_lse=True)
    _check(q, out, lse, keys, lengths, False)
    compiled = torch.compile(lambda *a: ops.splitkv_attention(*a[:3], cache_seqlens=a[3], block_table=a[4],
                                                              max_splits=24, return_lse=True), fullgraph=True)
    c_out, c_lse = compiled(q, k, v, seqlens, table)
    assert torch.equal(c_out, out) and torch.equal(c_lse, lse)


def _bad_calls(q, k, v, table, seqlens):
    bad_pool = torch.zeros(k.shape[0], 8, *k.shape[2:], dtype=k.dtype, device="cuda")
    yield "cache_seqlens must be int32", dict(cache_seqlens=seqlens.long(), block_table=table)
    yield "cache_seqlens must be on", dict(cache_seqlens=seqlens.cpu(), block_table=table)
    yield "cache_seqlens must have 1 dimension", dict(cache_seqlens=seqlens[None], block_table=table)
    yield "one length per sequence", dict(cache_seqlens=seqlens[:1], block_table=table)
    yield "block_table must be int32", dict(cache_seqlens=seqlens, block_table=table.float())
    yield "block_table must have one row", dict(cache_seqlens=seqlens, block_table=table[:1])
    yield "page size", dict(k=bad_pool, v=bad_pool, cache_seqlens=seqlens, block_table=table)
    yield "wider", dict(cache_seqlens=seqlens, block_table=torch.zeros(2, k.shape[0] + 1, dtype=torch.int32,
                                                                      device="cuda"))
    yield "max_splits must be", dict(cache_seqlens=seqlens, block_table=table, max_splits=0)
    yield "max_splits must be", dict(cache_seqlens=seqlens, block_table=table, max_splits=129)
    yield "min_blocks_per_split must be", dict(cache_seqlens=seqlens, block_table=table, min_blocks_per_split=0)
    yield "num_splits applies", dict(cache_seqlens=seqlens, block_table=table, num_splits=4)
    yield "split_policy must be", dict(cache_seqlens=seqlens, block_table=table, split_policy="length")
    yield "split_plan must be", dict(cache_seqlens=seqlens, block_table=table, split_plan="greedy")
    yield "min_blocks_per_split must be", dict(cache_seqlens=seqlens, block_table=table,
                                               min_blocks_per_split="load_aware")
    yield "exceeds the cache's capacity", dict(cache_seqlens=seqlens + 10_000, block_table=table)
    yield "is not a page of the pool", dict(cache_seqlens=seqlens, block_table=table * 0 + k.shape[0])


def test_the_device_check_finds_the_entry_the_cpu_check_finds(cuda_gen):
    """check_inputs' kernel (live_check.h) against plan.first_bad_live_value's CPU path, on
    tables with bad pages past and inside the live keys, bad lengths, strided rows and grids of
    many CTAs."""
    rng = random.Random(5)
    for trial in range(60):
        batch, width, page_size, num_pages = (rng.choice((1, 3, 64, 300)), rng.choice((1, 7, 2048)),
                                              rng.choice((1, 16, 64)), rng.randint(1, 5000))
        width = min(width, num_pages)
        capacity = width * page_size
        wide = torch.randint(0, num_pages, (batch, width + 3), generator=cuda_gen.manual_seed(trial),
                             device="cuda", dtype=torch.int32)
        table = wide[:, :width] if trial % 2 else wide[:, :width].contiguous()
        lens = torch.randint(0, capacity + 1, (batch,), device="cuda", dtype=torch.int32)
        for _ in range(rng.choice((0, 1, 3))):
            b, p = rng.randrange(batch), rng.randrange(width)
            table[b, p] = rng.choice((-1, num_pages, num_pages + 100, -(2 ** 31)))
        if trial % 5 == 0:
            lens[rng.randrange(batch)] = rng.choice((-1, capacity + 1))
        k = torch.empty(num_pages, page_size, 1, 1, device="cuda")
        for seqlens in (lens, None):
            want = plan.first_bad_live_value(k.cpu(), None if seqlens is None else seqlens.cpu(), table.cpu(),
                                             capacity)
            assert plan.first_bad_live_value(k, seqlens, table, capacity) == want, (trial, seqlens is None)
    contiguous = torch.empty(4, 100, 1, 1, device="cuda")
    lens = torch.tensor([100, 0, 101, -3], dtype=torch.int32, device="cuda")
    assert plan.first_bad_live_value(contiguous, lens, None, 100) == 2


def test_a_repeated_call_is_still_checked(ops, cuda_gen):
    """The second call of a signature takes its launch arguments from the cache: its data are
    checked all the same, and an argument of another type is no repeat."""
    lengths = [100, 7]
    q, k, v, table, _ = _batch(cuda_gen, lengths, page_size=16)
    seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    first = ops.splitkv_attention(q, k, v, cache_seqlens=seqlens, block_table=table)
    again = ops.splitkv_attention(q, k, v, cache_seqlens=seqlens, block_table=table)
    assert torch.equal(first, again)
    with pytest.raises(ValueError, match="exceeds the cache's capacity"):
        ops.splitkv_attention(q, k, v, cache_seqlens=seqlens + 10_000, block_table=table)
    with pytest.raises(TypeError, match="check_inputs must be True or False"):
        ops.splitkv_attention(q, k, v, cache_seqlens=seqlens, block_table=table, check_inputs=1)
    with pytest.raises(TypeError, match="enable_pdl must be True or False"):
        ops.splitkv_attention(q, k, v, cache_seqlens=seqlens, block_table=table, enable_pdl=1)
    with pytest.raises(TypeError, match="workspace must be"):
        ops.splitkv_attention(q, k, v, cache_seqlens=seqlens, block_table=table, workspace=table)


def test_the_cached_launch_follows_the_call_signature(ops, cuda_gen):
    """The extension keeps a paged call's launch per signature (kernels/live_launch_cache.h): a
    table of another layout, another knob, a knob of another type or a tensor knob is another
    signature (or none), each call right."""
    lengths = [3000, 5]
    q, k, v, table, keys = _batch(cuda_gen, lengths, page_size=64)
    seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    call = lambda **kw: ops.splitkv_attention(q, k, v, cache_seqlens=seqlens, return_lse=True,
                                              **{"block_table": table, **kw})
    first = call(max_splits=8)
    # Rows further apart than their width: another layout that the kernel takes.
    strided = torch.empty(table.shape[0], table.shape[1] + 3, dtype=torch.int32, device="cuda")[:, :table.shape[1]]
    strided.copy_(table)
    assert strided.stride() != table.stride()
    for again in (call(max_splits=8), call(block_table=strided, max_splits=8), call(max_splits=8, causal=0),
                  call(max_splits=8, softmax_scale=1 / 128 ** 0.5)):
        assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])
    _check(q, *call(max_splits=2, min_blocks_per_split=1), keys, lengths, False)
    with pytest.raises(ValueError, match="max_splits"):
        call(max_splits=0)
    with pytest.raises(ValueError, match="split_plan"):
        call(split_plan="Fixed")
    from splitkv_tune import selector
    selector.clear_lookup_caches()
    assert torch.equal(call(max_splits=8)[0], first[0])


def test_a_batch_whose_schedule_does_not_fit_is_refused(ops):
    # 8 bytes of the persistent schedule's shared memory per sequence (rules.h): 32768 sequences
    # need 256 KiB, more than any GPU gives a CTA.
    batch = 32768
    q = torch.zeros(batch, 1, 1, 64, dtype=torch.bfloat16, device="cuda")
    k = torch.zeros(batch, 16, 1, 64, dtype=torch.bfloat16, device="cuda")
    seqlens = torch.ones(batch, dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="cache_seqlens: a batch of 32768 sequences needs"):
        ops.splitkv_attention(q, k, k, cache_seqlens=seqlens)


def test_bad_live_arguments_raise_naming_them(ops, cuda_gen):
    q, k, v, table, _ = _batch(cuda_gen, [100, 7], page_size=16)
    seqlens = torch.tensor([100, 7], dtype=torch.int32, device="cuda")
    for match, kw in _bad_calls(q, k, v, table, seqlens):
        args = {"k": k, "v": v, **kw}
        with pytest.raises((ValueError, TypeError), match=match):
            ops.splitkv_attention(q, args.pop("k"), args.pop("v"), **args)
