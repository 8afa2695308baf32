"""The shared kernel rules (kernels/include/splitkv/rules.h) through splitkv_tune._rules, the
very functions the kernels compile: split ranges cover each tile's keys exactly once and
balance them, causal tile ends follow the bottom-right mask, and the layout rules agree with
each other. CPU only."""
from __future__ import annotations

import random

import pytest

from splitkv_tune import _rules, tunables

POLICIES = tunables.policy_codes()


def _ranges(policy: str, num_splits: int, kv_len: int, kv_end: int, block_kv: int):
    return [_rules.split_range(POLICIES[policy], s, num_splits, kv_len, kv_end, block_kv)
            for s in range(num_splits)]


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_split_ranges_cover_each_key_once(policy):
    rng = random.Random(0)
    for _ in range(3000):
        kv_len = rng.choice([1, 2, 31, 32, 33, 100, 4096, 65535, rng.randint(1, 200_000)])
        kv_end = rng.choice([kv_len, rng.randint(0, kv_len)])
        block_kv = rng.choice(tunables.BLOCK_KV)
        num_splits = rng.randint(1, tunables.MAX_SPLITS)
        covered = []
        for start, end in _ranges(policy, num_splits, kv_len, kv_end, block_kv):
            assert 0 <= start and end <= max(kv_end, 0)
            covered.extend(range(start, max(start, end)))
        assert covered == list(range(kv_end)), (policy, num_splits, kv_len, kv_end, block_kv)


def test_block_policy_balances_blocks_and_aligns_starts():
    rng = random.Random(1)
    for _ in range(2000):
        kv_end = rng.randint(1, 100_000)
        block_kv = rng.choice(tunables.BLOCK_KV)
        num_splits = rng.randint(1, tunables.MAX_SPLITS)
        ranges = _ranges("blocks", num_splits, kv_end, kv_end, block_kv)
        counts = [-(-max(0, e - s) // block_kv) for s, e in ranges]
        assert max(counts) - min(counts) <= 1
        assert all(s % block_kv == 0 for s, _ in ranges)


def test_length_policy_cuts_equal_lengths():
    ranges = _ranges("length", 7, 1000, 1000, 64)
    lengths = [e - s for s, e in ranges]
    assert max(lengths) - min(lengths) <= 1 and sum(lengths) == 1000


def test_tile_kv_end_is_the_last_visible_key_of_the_tile():
    rng = random.Random(2)
    for _ in range(2000):
        q_len, group = rng.randint(1, 300), rng.choice([1, 2, 4, 8])
        kv_len = rng.randint(1, 400)
        rows = q_len * group
        bm = _rules.block_m_for(rows)
        for m_block in range(_rules.num_m_blocks(rows)):
            last_q = (min((m_block + 1) * bm, rows) - 1) // group
            visible = [j for j in range(kv_len) if j <= last_q + kv_len - q_len]
            assert _rules.tile_kv_end(True, kv_len, q_len, group, rows, m_block) == len(visible)
            assert _rules.tile_kv_end(False, kv_len, q_len, group, rows, m_block) == kv_len


def test_layout_rules_agree():
    for bm in tunables.BLOCK_M:
        wm, wn = _rules.warp_layout(bm)
        assert wm * wn == tunables.NUM_WARPS and bm % (16 * wm) == 0
        for bkv in tunables.BLOCK_KV:
            owns = _rules.warps_own_keys(bm, bkv)
            assert owns == (wn > 1 and bkv // wn >= 16 and bkv % (16 * wn) == 0)
            for hd in tunables.HEAD_DIMS:
                base = 2 * (bm * hd + 2 * tunables.KV_STAGES * bkv * hd)
                extra = _rules.smem_bytes(2, hd, bm, bkv) - base
                # Only tiles whose warps share keys hold the P tile and the row exchange.
                assert (extra > 0) == (wn > 1 and not owns)
    assert [_rules.block_m_for(r) for r in (1, 16, 17)] == [16, 16, 64]


def test_workspace_sections_are_aligned_and_sized():
    m_off, l_off, total = _rules.workspace_sections(16, 2, 32, 3, 128)
    rows = 16 * 2 * 32 * 3
    align = tunables.WORKSPACE_ALIGN
    assert m_off >= rows * 128 * 4 and l_off - m_off >= rows * 4 and total - l_off >= rows * 4
    assert m_off % align == 0 and l_off % align == 0 and total % align == 0
    assert _rules.workspace_sections(1, 2, 32, 3, 128) == (0, 0, 0)
    # A live workspace's last aligned slot holds the load-aware plan's knob.
    plan_slot = _rules.workspace_plan_offset(16, 2, 32, 3, 128)
    assert plan_slot == total and _rules.workspace_sections(16, 2, 32, 3, 128, live=True)[2] == plan_slot + align


def test_split_range_rejects_bad_arguments():
    with pytest.raises(ValueError, match="split"):
        _rules.split_range(POLICIES["blocks"], 3, 3, 100, 100, 32)
    with pytest.raises(ValueError, match="policy"):
        _rules.split_range(7, 0, 3, 100, 100, 32)


def test_size_classes_are_octaves_of_blocks_per_split():
    """Class c holds splits of [2^(31-c), 2^(32-c)) blocks; an empty split shares class 31."""
    assert [_rules.size_class(n) for n in (0, 1, 2, 3, 4, 1 << 26)] == [31, 31, 30, 30, 29, 5]
    with pytest.raises(ValueError, match="blocks_per_split >= 0"):
        _rules.size_class(-1)


@pytest.mark.parametrize("ctas,resident,per_sm", [
    (132, 3, 0),   # one CTA a SM: nothing to spread
    (198, 3, 0),   # the 198 free slots hold a whole next grid: it lands balanced
    (199, 3, 2), (256, 3, 2), (264, 3, 2),  # one wave, two a SM, fewer slots free than CTAs
    (265, 3, 0),   # three a SM: the SMs are full
    (256, 4, 0), (265, 4, 3), (384, 4, 3), (396, 3, 0),
    (397, 3, 0), (1000, 3, 0),  # more than one wave
    (256, 2, 0), (256, 1, 0),
])
def test_spread_holds_a_one_wave_grid_to_its_even_share(ctas, resident, per_sm):
    assert _rules.spread_ctas_per_sm(ctas, 132, resident) == per_sm


@pytest.mark.parametrize("per_sm", [1, 2, 3, 5])
@pytest.mark.parametrize("kernel_bytes", [4 * 1024, 38400, 69632])
def test_spread_shared_memory_holds_the_sm_to_that_many_ctas(per_sm, kernel_bytes):
    """An H200 SM: 228 KiB of shared memory, 1 KiB reserved a CTA."""
    sm_bytes, reserved = 233472, 1024
    bytes_ = _rules.smem_for_ctas_per_sm(per_sm, sm_bytes, reserved, kernel_bytes)
    if per_sm * (kernel_bytes + reserved) > sm_bytes:
        assert bytes_ == 0
        return
    assert bytes_ >= kernel_bytes
    assert sm_bytes // (bytes_ + reserved) == per_sm
    # the least such size: one byte less lets another CTA in, unless it is the kernel's own
    assert bytes_ == kernel_bytes or sm_bytes // (bytes_ - 1 + reserved) == per_sm + 1


def test_register_residency_covers_every_instantiation():
    """The analytic model's residency (rules.h register_residency): each instantiation's count
    from its registers (tests/test_build.py checks the counts against ptxas), at most what the
    64K registers of an SM hold of 128-thread CTAs, and 2 a SM at the 255-register tiles."""
    from splitkv_tune import codegen
    for _, hd, bm, bkv in codegen.split_instances():
        regs = _rules.split_kernel_registers(hd, bm, bkv)
        assert 64 <= regs <= 255, (hd, bm, bkv)
        assert _rules.register_residency(hd, bm, bkv) == 65536 // (-(-regs // 8) * 8 * 128)
    assert [_rules.register_residency(128, 16, kv) for kv in (32, 64, 128)] == [4, 3, 2]
    assert _rules.register_residency(64, 64, 128) == 2
