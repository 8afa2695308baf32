"""The paged call's knobs on the CPU (splitkv_tune.live): the "auto" rules, the checks that name
the knob, and the workspace a server preallocates."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from splitkv_tune import _rules, live, tunables


def test_auto_knobs_follow_the_batch_and_the_sm_count():
    # (B, Hkv, packed rows) -> (block_kv, min_blocks_per_split, max_splits) on 132 SMs.
    assert live.resolve_knobs(1, 128, 8, 4, 132) == (64, 4, 33)
    assert live.resolve_knobs(16, 128, 8, 4, 132) == (64, 16, 33)
    assert live.resolve_knobs(32, 128, 8, 4, 132) == (64, 16, 16)
    assert live.resolve_knobs(256, 128, 8, 4, 132) == (64, 16, 16)
    assert live.resolve_knobs(1, 128, 1, 8, 132)[2] == tunables.MAX_SPLITS  # MQA: one tile per sequence
    # One KV head in a large batch: the capacity cap (16) is raised to 64, a power of two within
    # half a wave of the sequence's 132 SMs.
    assert live.resolve_knobs(256, 128, 1, 8, 132) == (64, 16, 64)
    for batch in (1, 3, 64, 1000):
        keys = live.default_min_keys_per_split(batch, 8, 4, 132)
        assert live.MIN_KEYS_PER_SPLIT[0] <= keys <= live.MIN_KEYS_PER_SPLIT[1] and keys & (keys - 1) == 0
        assert 1 <= live.default_max_splits(batch, 8, 4, 132) <= tunables.MAX_SPLITS


def test_the_auto_rules_are_rules_h_as_written():
    """rules.h's live_min_keys_per_split and live_max_splits (the exported header falls back to
    them) against their definition in words, over batches, head configurations and SM counts."""
    low, high = live.MIN_KEYS_PER_SPLIT
    for batch, kv_heads, packed_rows, sms in ((1, 8, 4, 132), (3, 1, 8, 108), (7, 32, 64, 16), (64, 4, 17, 132),
                                              (1000, 2, 1, 1024), (256, 8, 128, 1), (256, 1, 8, 132),
                                              (96, 1, 8, 132), (4096, 1, 1, 65536)):
        tiles = kv_heads * _rules.num_m_blocks(packed_rows)
        keys = -(-batch * tiles * live.TYPICAL_LEN // (live.WAVES_PER_SEQUENCE * sms))
        power = 1 << max(0, keys - 1).bit_length()
        assert live.default_min_keys_per_split(batch, kv_heads, packed_rows, sms) == min(high, max(low, power))
        one_sequence = -(-live.WAVES_PER_SEQUENCE * sms // tiles)
        half_wave = -(-sms // (2 * tiles))
        floor = max(live.MIN_MAX_SPLITS, 1 << (half_wave.bit_length() - 1))
        capacity = max(floor, live.CAPACITY_ITEMS_PER_SM * sms // (batch * tiles))
        assert _rules.live_max_splits_bounds(batch, kv_heads, packed_rows, sms) == (one_sequence, capacity, floor)
        assert live.default_max_splits(batch, kv_heads, packed_rows, sms) == max(
            1, min(tunables.MAX_SPLITS, one_sequence, capacity))
    # The edges of the domain: every product fits in int64 there.
    assert _rules.live_min_keys_per_split(1, 65535, _rules.MAX_KEYS, 1) == high
    assert _rules.live_max_splits(1, 65535, _rules.MAX_KEYS, 1 << 16) == 1
    assert _rules.live_max_splits(1, 1, 1, 1 << 16) == tunables.MAX_SPLITS
    bad = [(1, 8, 4, 0), (0, 8, 4, 132), (2, 65535, 4, 132), (2**24, 2**24, 2**30, 1), (1, 8, 2**31 - 1, 132),
           (1, 8, 4, 2**40)]
    for rule in (_rules.live_min_keys_per_split, _rules.live_max_splits, _rules.live_max_splits_bounds,
                 _rules.check_live_knob_args):
        for args in bad:
            with pytest.raises(ValueError, match="needs batch, kv_heads >= 1 with batch [*] kv_heads <= 65535"):
                rule(*args)


def test_given_knobs_are_kept_and_bad_ones_named():
    assert live.resolve_knobs(4, 256, 8, 4, 132, block_kv=32, min_blocks_per_split=3, max_splits=7) == (32, 3, 7)
    for kwargs, match in ((dict(block_kv=128), "block_kv must be one of"),
                          (dict(min_blocks_per_split=0), "min_blocks_per_split must be"),
                          (dict(max_splits=tunables.MAX_SPLITS + 1), "max_splits must be"),
                          (dict(max_splits=True), "max_splits must be")):
        with pytest.raises(ValueError, match=match):
            live.resolve_knobs(4, 256, 8, 4, 132, **kwargs)
    with pytest.raises(ValueError, match="min_blocks_per_split must be a positive integer or 'auto'"):
        live.resolve_knobs(16, 128, 8, 4, 132, min_blocks_per_split="load_aware")
    assert tunables.integer_or_auto("max_splits", np.int32(9)) == 9
    assert tunables.integer_or_auto("block_kv", "auto") == "auto"
    with pytest.raises(ValueError, match="min_blocks_per_split must be an integer or 'auto', got 2.5"):
        tunables.integer_or_auto("min_blocks_per_split", 2.5)


def test_workspace_is_sized_from_the_bound():
    q = torch.zeros(3, 2, 8, 128)
    assert live.workspace_size(q, 1) == 0
    assert live.workspace_size(q, 5) == _rules.workspace_sections(5, 3, 8, 2, 128, live=True)[2] > 5 * 3 * 8 * 2 * 128 * 4
    assert live.workspace_size(q, 5) == _rules.workspace_sections(5, 3, 8, 2, 128)[2] + tunables.WORKSPACE_ALIGN
    with pytest.raises(ValueError, match="max_splits must be"):
        live.workspace_size(q, 0)


def test_select_paged_prints_the_knobs_the_call_uses():
    import json

    from click.testing import CliRunner

    from splitkv_tune.cli import main
    args = ["select", "--paged", "--gpu", "h200", "--batch", "32", "--q-heads", "32", "--kv-heads", "8",
            "--kv-len", "65536"]
    result = CliRunner().invoke(main, args + ["--json"])
    assert result.exit_code == 0, result.output
    got = json.loads(result.output)
    want = live.resolve_knobs(32, 128, 8, 4, 132)
    assert (got["block_kv"], got["min_blocks_per_split"], got["max_splits"]) == want
    assert got["splits_at_capacity"] == _rules.live_splits(65536, *want)
    assert got["workspace_bytes"] == live.workspace_size(torch.zeros(32, 1, 32, 128), want[2])
    assert got["why"] == live.explain_knobs(32, 128, 8, 4, 132) and got["sms"] == 132
    text = CliRunner().invoke(main, args).output
    assert f"paged knobs: block_kv=64 min_blocks_per_split={want[1]} max_splits={want[2]}" in text
    bad = CliRunner().invoke(main, args[:3] + ["no_such_gpu"] + args[4:])
    assert bad.exit_code != 0 and "Traceback" not in bad.output
    # The equal-length table is no paged call's: refused, not ignored (even a file that does not exist).
    bad = CliRunner().invoke(main, args + ["--table", "no_such_table.csv"])
    assert bad.exit_code == 2 and "a paged call's knobs come from --batch-table" in bad.output
    modelled = CliRunner().invoke(main, args + ["--lengths", "65536,1024", "--batch", "2", "--ctas-per-sm", "2"])
    assert modelled.exit_code == 0 and "batch table: none (the model of --ctas-per-sm)" in modelled.output
