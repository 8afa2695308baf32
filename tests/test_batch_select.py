"""The paged knobs of a batch from a batch table (``batch_select``) on the CPU: the nearest
class within the distance bound, its ties, the model beyond it, the fallback to the live
defaults, and ``select --paged``."""
import functools
import json
from pathlib import Path

import pytest
from batch_rows import PAGED, invoke, rewrite, write_table

from splitkv_tune import _rules, batches, live
from splitkv_tune import batch_select as bs
from splitkv_tune import batch_table as bt

V1_TABLE = Path(__file__).parent / "fixtures" / "heuristics.csv"


@pytest.fixture
def table_file(tmp_path):
    return write_table(tmp_path)


def select(table, lengths, **change):
    args = dict(dtype="bf16", head_dim=128, q_heads=32, kv_heads=8, q_len=1, page_size=64, lengths=lengths,
                num_sms=132)
    return bs.select_live_knobs(table, **{**args, **change})


def test_the_nearest_class_gives_the_knobs(table_file, monkeypatch):
    table = bt.read_batch_table(table_file)
    exact = select(table, "skewed:16:65536:1024")
    assert exact.kwargs() == {"block_kv": 64, "min_blocks_per_split": 4, "max_splits": 64, "merge": "fused",
                             "split_plan": "fixed"}
    assert "distance 0.00" in exact.reason and "skewed:16:65536:1024" in exact.reason
    assert exact.row is table[1]
    # A class serves its batch and its lengths at another page size, not a neighbour.
    assert select(table, "skewed:16:65536:1024", page_size=16).row is table[1]  # 0.5 octaves
    far = select(table, [6000] * 12, page_size=16)
    assert far.row is None and far.merge == "auto" and "more than 0.5" in far.reason
    monkeypatch.setattr(bs, "MAX_CLASS_DISTANCE", 8.0)
    # The nearest rule: a uniform batch is a class like any other, 12 x 6000 nearer 16 x 8192 than
    # the skewed one.
    uniform = select(table, [6000] * 12, page_size=16)
    assert uniform.kwargs() == {"block_kv": 64, "min_blocks_per_split": 2, "max_splits": 8, "merge": "fused",
                               "split_plan": "fixed"}
    assert "uniform:16:8192" in uniform.reason
    # One long sequence pulls towards the skewed class.
    assert select(table, "skewed:32:131072:512").max_splits == 64


def test_padded_slots_and_bad_lengths(table_file):
    """A captured batch pads with empty sequences (length 0): they select like 1-key ones, never
    divide by zero; no length or a negative one is a ValueError naming lengths."""
    table = bt.read_batch_table(table_file)
    assert select(table, [0, 0, 0, 0]).kwargs() == select(table, [1, 1, 1, 1]).kwargs()
    assert select(table, [65536] + [0] * 15).row is not None
    for bad in ([], [5, -1]):
        with pytest.raises(ValueError, match="lengths"):
            select(table, bad)


def test_distance_and_its_ties(monkeypatch):
    monkeypatch.setattr(bs, "MAX_CLASS_DISTANCE", 8.0)
    row = dict(batch=16, len_max=65536, len_mean=4096, page_size=64)
    assert bs.class_distance(row, 8, 65536, 4096, 64) == 1.0
    assert bs.class_distance(row, 16, 65536, 4096, 16) == 2 * bs.PAGE_WEIGHT
    lo, hi = (dict(row, gpu="g", dtype="bf16", head_dim=128, q_heads=32, kv_heads=8, q_len=1, lengths="x",
                   block_kv=64, min_blocks_per_split=m, max_splits=8, merge="fused", split_plan="fixed", median_us=1.0,
                   runner_up_us=None, noise_margin=0.01, n_trials=1, source="s", batch=b)
              for b, m in ((8, 1), (32, 2)))
    assert select([hi, lo], "uniform:16:4096").min_blocks_per_split == 1  # equal distance: smaller batch


def test_no_row_of_the_head_configuration_falls_back_to_the_live_defaults(table_file):
    table = bt.read_batch_table(table_file)
    got = select(table, "skewed:16:65536:1024", head_dim=64)
    assert (got.block_kv, got.min_blocks_per_split, got.max_splits) == live.resolve_knobs(16, 64, 8, 4, 132)
    assert got.merge == "auto" and got.row is None
    assert got.reason.startswith("no batch-table row for bf16 D64 Hq32/Hkv8 Sq1")
    assert live.explain_knobs(16, 64, 8, 4, 132) in got.reason
    assert select([], "7").reason.startswith("no batch table for bf16 D128 Hq32/Hkv8 Sq1; no ctas_per_sm")


def test_a_table_of_several_gpus_is_refused(table_file):
    table = bt.read_batch_table(table_file)
    with pytest.raises(ValueError, match="several GPUs .* read_batch_table"):
        select(table + [dict(table[0], gpu="nvidia_h100")], "7")


def test_select_paged_with_the_batch_table(table_file):
    result = invoke(*PAGED, "--lengths", "skewed:16:65536:1024", "--batch-table", table_file)
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0] == "paged knobs: block_kv=64 min_blocks_per_split=4 max_splits=64 merge=fused split_plan=fixed"
    assert lines[1].startswith("why: batch table, bf16 D128 Hq32/Hkv8 Sq1: the nearest class")
    assert lines[2] == f"batch table: {table_file}"
    assert "a sequence of 65536 keys (the capacity)" in lines[3]
    got = json.loads(invoke(*PAGED, "--lengths", "uniform:16:8192", "--page-size", "16", "--kv-len", "16384",
                            "--batch-table", table_file, "--json").output)
    assert (got["min_blocks_per_split"], got["max_splits"], got["merge"]) == (2, 8, "fused")
    assert got["batch_table"] == str(table_file) and "uniform:16:8192" in got["why"]
    assert got["splits_at_capacity"] == 8
    far = json.loads(invoke(*PAGED, "--lengths", "uniform:8:8192", "--page-size", "16", "--kv-len", "16384",
                            "--batch-table", table_file, "--json").output)
    assert far["merge"] == "auto" and "more than 0.5 (batch_select.MAX_CLASS_DISTANCE)" in far["why"]


def test_select_paged_falls_back_and_keeps_its_output_without_a_table(table_file):
    fallback = invoke(*PAGED, "--head-dim", "64", "--lengths", "uniform:16:8192", "--batch-table", table_file)
    assert fallback.exit_code == 0, fallback.output
    knobs = live.resolve_knobs(16, 64, 8, 4, 132)
    assert "paged knobs: block_kv={} min_blocks_per_split={} max_splits={} merge=auto".format(*knobs) in fallback.output
    assert "why: no batch-table row for bf16 D64" in fallback.output
    plain = invoke(*PAGED, "--lengths", "uniform:16:8192")
    same = invoke(*PAGED, "--batch", "16", "--kv-len", "8192")
    assert plain.exit_code == 0 and plain.output == same.output and "merge" not in plain.output


def test_select_paged_bad_input(table_file, assert_clear_error):
    assert_clear_error(invoke(*PAGED, "--kv-len", "8192", "--batch-table", table_file), "--batch-table and --ctas-per-sm need --lengths")
    assert_clear_error(invoke(*PAGED, "--kv-len", "8192", "--ctas-per-sm", "2"), "need --lengths")
    assert_clear_error(invoke(*PAGED, "--lengths", "8", "--ctas-per-sm", "0"), "--ctas-per-sm")
    assert_clear_error(invoke(*PAGED[:1], *PAGED[2:], "--kv-len", "8", "--ctas-per-sm", "2"), "apply to --paged")
    assert_clear_error(invoke(*PAGED[:1], *PAGED[2:], "--kv-len", "8", "--lengths", "8"), "apply to --paged")
    assert_clear_error(invoke(*PAGED, "--lengths", "8x0"), "--lengths", "repeat count")
    assert_clear_error(invoke(*PAGED, "--lengths", "8x4", "--batch", "3"), "--batch", "4 sequences")
    assert_clear_error(invoke(*PAGED, "--lengths", "8x4", "--kv-len", "4"), "--kv-len", "below the longest")
    assert_clear_error(invoke(*PAGED, "--lengths", "8", "--page-size", "48"), "--page-size")
    assert_clear_error(invoke(*PAGED, "--lengths", "8", "--batch-table", V1_TABLE),
                       "this is a v1 shape table")
    assert_clear_error(invoke(*PAGED, "--gpu", "h100", "--lengths", "8", "--batch-table", table_file),
                       "unknown GPU 'h100'")
    rewrite(table_file, max_splits="nan")
    assert_clear_error(invoke(*PAGED, "--lengths", "8", "--batch-table", table_file),
                       "row 1 (line 2): max_splits is empty or NaN")


def _model_choice(lengths, kv_heads, packed_rows, sms, ctas_per_sm):
    """The least (score, max_splits, min_blocks_per_split) over the model's candidates, scored one
    by one: what live_model_knobs must find."""
    model = _rules.LIVE_MODEL
    auto = live.resolve_knobs(len(lengths), 128, kv_heads, packed_rows, sms)[1:]
    wave = _rules.live_model_wave_splits(lengths, kv_heads, packed_rows, sms, ctas_per_sm) if ctas_per_sm == 1 else 0
    bounds = (*model["max_splits"], wave) if wave else model["max_splits"]
    points = {auto, *((m, s) for m in model["min_blocks_per_split"] for s in bounds)}
    scored = [(_rules.live_model_score(lengths, kv_heads, packed_rows, sms, ctas_per_sm, m, s), s, m)
              for m, s in points]
    score, bound, min_blocks = min(scored)
    return min_blocks, bound, score


@pytest.mark.parametrize("text", ["skewed:16:65536:1024", "uniform:64:2048", "geometric:8:262144:2048",
                                  "lognormal:32:4096:1.0", "4096", [0] * 8, [65536, 0, 0, 7], "skewed:256:131072:512"])
@pytest.mark.parametrize("kv_heads,ctas_per_sm", [(8, 2), (1, 2), (1, 1), (8, 3)])
def test_the_model_takes_the_least_score_of_its_candidates(text, kv_heads, ctas_per_sm):
    lengths = text if isinstance(text, list) else list(batches.parse_lengths(text))
    rows = 32 // kv_heads
    assert _rules.live_model_knobs(lengths, kv_heads, rows, 132, ctas_per_sm) == \
        _model_choice(lengths, kv_heads, rows, 132, ctas_per_sm)


def test_the_one_wave_split_count_fills_the_resident_ctas_with_the_live_tiles():
    # 5 sequences x 4 KV heads on 132 SMs x 1 CTA: 6 splits (120 items); empty slots do not count.
    assert _rules.live_model_wave_splits([20000] * 5 + [0] * 3, 4, 2, 132, 1) == 6
    assert _rules.live_model_wave_splits([20000] * 5, 4, 2, 132, 2) == 13
    assert _rules.live_model_wave_splits([9] * 2, 1, 1, 132, 2) == 64  # 2 tiles: 132, capped at 64
    rows = 512  # query tiles of several rows' blocks per KV head
    assert _rules.live_model_wave_splits([9] * 3, 2, rows, 132, 2) == 264 // (6 * _rules.num_m_blocks(rows))
    assert _rules.live_model_wave_splits([100] * 300, 1, 1, 132, 2) == 1  # the tiles fill a wave alone
    assert _rules.live_model_wave_splits([0] * 4, 8, 4, 132, 2) == 0
    # the model's candidate: the one-wave count at one CTA per SM only
    assert _rules.live_model_wave_candidate([20000] * 5 + [0] * 3, 4, 2, 132, 1) == 6
    assert _rules.live_model_wave_candidate([100] * 300, 1, 1, 132, 1) == 1
    assert _rules.live_model_wave_candidate([20000] * 5, 4, 2, 132, 2) == 0
    for bad in ({"ctas_per_sm": 0}, {"ctas_per_sm": 33}, {"num_sms": 0}, {"kv_heads": 0}, {"lengths": [-1]}):
        args = {"lengths": [9], "kv_heads": 1, "packed_rows": 1, "num_sms": 132, "ctas_per_sm": 1, **bad}
        with pytest.raises(ValueError, match="live_model_wave_splits"):
            _rules.live_model_wave_splits(**args)
        with pytest.raises(ValueError, match="live_model_wave_candidate"):
            _rules.live_model_wave_candidate(**args)
    # A candidate at one CTA per SM only: the H200's 5 x 20000 keys at head dim 256, Hq/Hkv 8/4 ran
    # fastest at 6 splits; with two CTAs per SM the space's own points stand.
    lengths = [20000] * 5
    got = _rules.live_model_knobs(lengths, 4, 2, 132, 1)
    assert got[1] == 6 and got[2] < min(_rules.live_model_score(lengths, 4, 2, 132, 1, m, s)
                                        for m in (1, 2, 4, 8, 16) for s in (8, 16, 32, 64))
    assert _rules.live_model_knobs(lengths, 4, 2, 132, 2)[1] in _rules.LIVE_MODEL["max_splits"]


def test_at_one_cta_per_sm_idle_ctas_buy_the_model_less_speed():
    """The model's rate is the plan's with two CTAs per SM or more; with one, idle CTAs buy less
    speed, the less the more items run (a rate from its idle value up to 16 in proportion to the
    items). The score uses it. At head dim 256 on the H200 (one CTA per SM), 4 x 24000 keys with
    one KV head ran 128 items of 750 keys in 40.3 us and 96 of 1000 in 47.3, and 12 x 8000 keys
    with 8 KV heads ran 8 splits in 235 us and 1 (its one-wave count) in 284: the model picks those."""
    plan = _rules.live_model_rate(2)
    assert [_rules.live_model_rate(c) for c in (2, 3, 32)] == [plan] * 3 and plan[0] == 0
    idle, floor = _rules.live_model_rate(1)
    assert plan[1] <= floor == idle < 16
    estimate = functools.partial(_rules.live_plan_knob_estimate, [64 * 100] * 3, 1, 132, 64, 1, 1)
    assert estimate() == estimate(0, plan[1])
    # 3 items of 100 blocks on 132 CTAs: the plan's rate is its floor; the model's one grows with the items.
    assert estimate(idle, floor) == 132 * (100 * (idle + (16 - idle) * 3 // 132) + 2 * 16) > estimate()
    for lengths, kv_heads, rows, want in (([24000] * 4, 1, 8, (1, 32)), ([8000] * 12, 8, 1, (1, 8))):
        for ctas_per_sm in (1, 2):
            ctas = 132 * ctas_per_sm
            for min_blocks, bound in ((1, 32), (16, 32), (4, 64)):
                most = max(_rules.live_splits(n, 64, min_blocks, bound) for n in lengths)
                tiles = kv_heads * _rules.num_m_blocks(rows)
                want_score = (_rules.live_plan_knob_estimate(lengths, tiles, ctas, 64, min_blocks, bound,
                                                             *_rules.live_model_rate(ctas_per_sm)) // ctas
                              + _rules.LIVE_MODEL["merge_cost16"] * most)
                assert _rules.live_model_score(lengths, kv_heads, rows, 132, ctas_per_sm, min_blocks, bound) == want_score
        assert _rules.live_model_knobs(lengths, kv_heads, rows, 132, 1)[:2] == want
    with pytest.raises(ValueError, match=r"live_model_rate needs ctas_per_sm in \[1, 32\], got 0"):
        _rules.live_model_rate(0)
    with pytest.raises(ValueError, match=r"rate_idle16 in \[0, 16\] and rate_floor16 in \[1, 16\], got 0 and 17"):
        _rules.live_plan_knob_estimate([24000], 1, 132, 64, 1, 32, 0, 17)
    for idle in (-1, 17):
        with pytest.raises(ValueError, match=rf"rate_idle16 in \[0, 16\] .* got {idle} and 11"):
            _rules.live_plan_knob_estimate([24000], 1, 132, 64, 1, 32, idle, 11)


def test_the_model_scores_the_launch_it_describes():
    """The score is the load-aware plan's estimate on the GPU's resident CTAs (SMs x CTAs per SM,
    the rate's reference, whatever the grid), per CTA, plus the merge cost per split of the
    most-split sequence."""
    for lengths in ([65536] + [1024] * 15, [4096], [12000] * 3):
        for min_blocks, bound in ((1, 8), (4, 64), (16, 32)):
            most = max(_rules.live_splits(n, 64, min_blocks, bound) for n in lengths)
            want = (_rules.live_plan_knob_estimate(lengths, 8, 264, 64, min_blocks, bound) // 264
                    + _rules.LIVE_MODEL["merge_cost16"] * most)
            assert _rules.live_model_score(lengths, 8, 4, 132, 2, min_blocks, bound) == want


def test_beyond_the_classes_the_model_chooses_given_ctas_per_sm(table_file):
    table = bt.read_batch_table(table_file)
    far = select(table, [6000] * 12, page_size=16, ctas_per_sm=2)
    want = _rules.live_model_knobs([6000] * 12, 8, 4, 132, 2)[:2]
    assert (far.block_kv, far.min_blocks_per_split, far.max_splits) == (64, *want)
    assert far.row is None and far.merge == "auto" and far.split_plan == "fixed"
    assert "more than 0.5" in far.reason and "the model's knobs (live_model.h live_model_knobs on 132 SMs x 2 CTAs)" \
        in far.reason
    # A near class still wins, and no table at all is the model's too.
    assert select(table, "skewed:16:65536:1024", ctas_per_sm=2).row is table[1]
    none = select([], [6000] * 12, ctas_per_sm=2)
    assert none.kwargs() == far.kwargs() and none.reason.startswith("no batch table for")
    for bad in (0, 33, True, 2.0, "2"):
        with pytest.raises(ValueError, match="ctas_per_sm must be None or an integer in \\[1, 32\\]"):
            select(table, [6000] * 12, ctas_per_sm=bad)


def test_select_paged_with_ctas_per_sm(table_file):
    got = json.loads(invoke(*PAGED, "--lengths", "uniform:8:8192", "--page-size", "16", "--kv-len", "16384",
                            "--batch-table", table_file, "--ctas-per-sm", "2", "--json").output)
    assert (got["min_blocks_per_split"], got["max_splits"]) == _rules.live_model_knobs([8192] * 8, 8, 4, 132, 2)[:2]
    assert "the model's knobs" in got["why"] and got["merge"] == "auto"
    alone = json.loads(invoke(*PAGED, "--lengths", "uniform:8:8192", "--page-size", "16", "--kv-len", "16384",
                              "--ctas-per-sm", "2", "--json").output)
    assert alone["why"].startswith("no batch table for") and alone["max_splits"] == got["max_splits"]
