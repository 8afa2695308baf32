"""``compare_batch`` on the CPU: our kernel's call and FlashInfer's planned launchers are stood
in for by the reference, so the rows, skips, checks and the report are tested without a GPU."""
import math

import pandas as pd
import pytest
import torch

from splitkv_tune import batch_table, live, plan_points
from splitkv_tune import compare_batch as cb
from splitkv_tune import peers_flashinfer as pf
from splitkv_tune.reference import splitkv_attention_ref

TIMING = dict(warmup_s=0.0, min_reps=2, max_time_s=0.0)
DIMS = dict(q_heads=4, kv_heads=2, head_dim=64, page_size=16, device="cpu", timing=TIMING,
            copy_bw=100.0)


def _attention(q, k, v, seqlens, table):
    return splitkv_attention_ref(q.float(), k.float(), v.float(), cache_seqlens=seqlens,
                                 block_table=table).to(q.dtype)


@pytest.fixture
def calls(monkeypatch):
    """Our call and FlashInfer replaced by the reference; returns the keywords of our calls."""
    seen = []

    def ours(q, k, v, *, cache_seqlens, block_table, **knobs):
        seen.append(knobs)
        return _attention(q, k, v, cache_seqlens, block_table)

    def launcher(name, shape, scale, cache, *, block_table, seq_lens):
        pf.check_supported(name, shape)
        assert cache.k_pages.shape[1] == 16 and seq_lens.dtype == torch.int32

        def launch(q_rows, kv_pages, out_rows):
            q = q_rows.view(shape.batch, shape.q_len, *q_rows.shape[1:])
            out_rows.copy_(_attention(q, *kv_pages, seq_lens, block_table).flatten(0, 1))
        return launch

    monkeypatch.setattr(cb, "our_attention", ours)
    monkeypatch.setattr(pf, "paged_launcher", launcher)
    monkeypatch.setattr(pf, "available", lambda: None)
    return seen


def _by_impl(frame):
    return {r["impl"]: r for _, r in frame.iterrows()}


def test_every_implementation_gets_a_row(calls):
    frame = cb.run_compare_batch("40,7x3", peers=cb.PEERS, one_split=4, **DIMS)
    rows = _by_impl(frame)
    assert list(rows) == ["ours", "ours_one_split", "ours_load_aware", "ours_contiguous", *cb.PEERS, "copy_floor"]
    assert set(frame["label"]) == {"40,7x3"}
    assert frame["batch"].eq(4).all() and frame["max_len"].eq(40).all()
    assert frame["total_len"].eq(61).all()
    live = 61 * 2 * 64 * 2 * 2
    assert frame["live_kv_bytes"].eq(live).all()
    floor = rows["copy_floor"]
    assert floor["median_us"] == pytest.approx(live / 100.0 / 1e3) and floor["x_floor"] == 1.0
    for name in ("ours", "ours_one_split", *pf.NAMES):
        row = rows[name]
        assert row["status"] == "ok", (name, row["reason"])
        assert row["check"].startswith("ok vs reference"), row["check"]
        assert row["max_abs_err"] <= 2e-2
        assert row["x_floor"] == pytest.approx(row["median_us"] / floor["median_us"])
        assert row["ours_speedup"] == pytest.approx(row["median_us"] / rows["ours"]["median_us"])
    assert rows["ours"]["ours_speedup"] == 1.0
    # cuDNN SDPA cannot run on a CPU: a failed row with the reason, nothing raised.
    assert rows["sdpa_cudnn"]["status"] == "failed" and rows["sdpa_cudnn"]["reason"]
    assert rows["sdpa_cudnn"]["note"] == cb.SDPA_NOTE
    assert "max_splits=4" in rows["ours_one_split"]["note"]
    # The first call of each checks the inputs; the timed ones do not; one split count is pinned.
    assert calls[0] == {"check_inputs": True}
    assert {"check_inputs": False} in calls
    assert {"check_inputs": True, "min_blocks_per_split": 1, "max_splits": 4} in calls
    assert {"check_inputs": False, "min_blocks_per_split": 1, "max_splits": 4} in calls
    # Off a CUDA device there is no SM count to resolve "auto" with: no knobs are recorded.
    assert frame[cb.KNOB_COLUMNS].isna().all().all()


def test_flashinfer_missing_gives_skipped_rows(calls, monkeypatch):
    monkeypatch.setattr(pf, "available", lambda: pf.NOT_INSTALLED)
    rows = _by_impl(cb.run_compare_batch([20, 3], **DIMS))
    for name in ("flashinfer_decode", "flashinfer_decode_tc", "flashinfer_xqa"):
        assert rows[name]["status"] == "skipped" and rows[name]["reason"] == pf.NOT_INSTALLED
        assert math.isnan(rows[name]["median_us"])
    assert rows["ours"]["status"] == "ok"


def test_decode_only_peers_are_skipped_for_several_queries(calls):
    rows = _by_impl(cb.run_compare_batch("uniform:3:33", q_len=2, peers=cb.PEERS, **DIMS))
    for name in pf.DECODE_ONLY:
        assert rows[name]["status"] == "skipped" and "decode-only" in rows[name]["reason"]
    assert rows["flashinfer_prefill"]["status"] == "ok"
    assert rows["ours"]["check"].startswith("ok vs reference")


def test_a_wrong_output_is_marked_wrong(calls, monkeypatch):
    monkeypatch.setattr(cb, "our_attention", lambda q, *a, **kw: torch.zeros_like(q))
    rows = _by_impl(cb.run_compare_batch([50, 9], **DIMS))
    assert rows["ours"]["status"] == rows["ours_one_split"]["status"] == "wrong"
    assert rows["ours"]["check"].startswith("wrong vs reference")
    assert rows["flashinfer_decode"]["status"] == "ok"


def test_reading_past_the_live_keys_shows_up(calls, monkeypatch):
    def whole_pages(q, k, v, *, cache_seqlens, block_table, **knobs):
        full = torch.full_like(cache_seqlens, block_table.shape[1] * k.shape[1])
        return _attention(q, k, v, full, block_table)  # reads the NaN tails
    monkeypatch.setattr(cb, "our_attention", whole_pages)
    rows = _by_impl(cb.run_compare_batch([20, 3], **DIMS))
    assert rows["ours"]["status"] == "wrong" and rows["ours"]["check"].startswith("wrong vs")


def test_large_batches_are_checked_against_flashinfer(calls, monkeypatch):
    monkeypatch.setattr(cb, "REFERENCE_MAX_KEYS", 10)
    rows = _by_impl(cb.run_compare_batch([20, 3], **DIMS))
    assert rows["ours"]["check"].startswith("ok vs flashinfer_decode")
    assert rows["flashinfer_decode"]["check"] == "the yardstick of the check"
    assert rows["flashinfer_xqa"]["check"].startswith("ok vs flashinfer_decode")
    monkeypatch.setattr(pf, "available", lambda: pf.NOT_INSTALLED)
    rows = _by_impl(cb.run_compare_batch([20, 3], **DIMS))
    assert rows["ours"]["status"] == "ok"
    assert rows["ours"]["check"].startswith("not checked: 23 keys are more than")


def test_a_failing_call_is_a_row(calls, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("CUDA error: an illegal memory access\nmore")
    monkeypatch.setattr(cb, "our_attention", broken)
    rows = _by_impl(cb.run_compare_batch([20, 3], **DIMS))
    assert rows["ours"]["status"] == "failed"
    assert rows["ours"]["reason"] == "RuntimeError: CUDA error: an illegal memory access"
    assert math.isnan(rows["flashinfer_decode"]["ours_speedup"])


def test_unknown_peer():
    with pytest.raises(ValueError, match="unknown peer"):
        cb.run_compare_batch([4], peers=["flex"], **DIMS)


def test_batches_share_one_copy_bandwidth_and_the_report(calls, monkeypatch):
    measured = []
    monkeypatch.setattr(cb.bench, "copy_bandwidth_gbps",
                        lambda device, **kw: measured.append(device) or 50.0)
    dims = {k: v for k, v in DIMS.items() if k not in ("copy_bw", "timing", "device")}
    frame = cb.run_compare_batches(["skewed:3:40:2", "17"], device="cpu", timing=TIMING, **dims)
    assert len(measured) == 1 and frame["copy_bw_gbps"].eq(50.0).all()
    assert list(dict.fromkeys(frame["label"])) == ["skewed:3:40:2", "17"]
    report = cb.markdown_report(frame)
    assert "### `skewed:3:40:2`" in report and "### `17`" in report
    assert "B = 3, lengths 2-40 (mean 15, 44 keys), page 16" in report
    assert report.count("| impl | µs |") == 2
    assert "| sdpa_cudnn | failed |" in report
    assert "| copy_floor |" in report and "1.00x" in report


def test_the_load_aware_row_leaves_the_knob_to_the_launch(calls):
    frame = cb.run_compare_batch("40,7x3", peers=(), one_split=4, plans=[(2, 8, 64, "auto", "load_aware")], **DIMS)
    rows = _by_impl(frame)
    row = rows["ours_load_aware"]
    assert row["status"] == "ok" and row["check"].startswith("ok")
    assert {"split_plan": "load_aware", "check_inputs": False} in calls
    assert {"block_kv": 64, "min_blocks_per_split": 2, "max_splits": 8, "merge": "auto", "split_plan": "load_aware",
            "check_inputs": False} in calls
    assert rows["ours_m2_s8_load_aware"]["note"] == "block_kv=64, min_blocks_per_split=2, max_splits=8, " \
                                                    "split_plan=load_aware"
    assert all(pd.isna(row[c]) for c in cb.KNOB_COLUMNS)  # no SM count off a GPU


def test_wider_tables_get_one_row_each(calls):
    frame = cb.run_compare_batch("40,7x3", peers=(), one_split=4, wider=[8, 2], **DIMS)
    rows = _by_impl(frame)
    assert list(rows) == ["ours", "ours_one_split", "ours_wide8", "ours_wide2", "ours_load_aware", "ours_contiguous",
                          "copy_floor"]
    assert rows["ours_wide8"]["status"] == "ok" and rows["ours_wide8"]["check"].startswith("ok")
    assert rows["ours_wide8"]["note"] == "block table 8x wider, pools padded to its width"


def test_plan_knobs_get_one_row_each(calls):
    frame = cb.run_compare_batch("40,7x3", peers=(), one_split=4, plans=[(2, 8), (16, 1), (4, 8, 128)], **DIMS)
    rows = _by_impl(frame)
    assert list(rows) == ["ours", "ours_one_split", "ours_m2_s8", "ours_m16_s1", "ours_kv128_m4_s8",
                          "ours_load_aware", "ours_contiguous", "copy_floor"]
    assert rows["ours_m2_s8"]["note"] == "block_kv=64, min_blocks_per_split=2, max_splits=8"
    assert rows["ours_kv128_m4_s8"]["note"] == "block_kv=128, min_blocks_per_split=4, max_splits=8"
    assert rows["ours_m16_s1"]["status"] == "ok"


def test_live_rows_record_their_knobs(calls, monkeypatch, tmp_path):
    monkeypatch.setattr(cb, "_num_sms", lambda device: 132)
    frame = cb.run_compare_batch("40,7x3", peers=cb.PEERS, one_split=4, plans=[(2, 8), (4, 8, 128)], wider=[2],
                                 **DIMS)
    rows = _by_impl(frame)

    def knobs(name):
        return tuple(rows[name][c] for c in cb.KNOB_COLUMNS)
    auto = (*live.resolve_knobs(4, 64, 2, 2, 132), "fused", "fixed")
    assert knobs("ours") == knobs("ours_wide2") == knobs("ours_contiguous") == auto
    assert knobs("ours_load_aware") == (*auto[:4], "load_aware")
    assert knobs("ours_one_split") == (64, 1, 4, "fused", "fixed")
    assert knobs("ours_m2_s8") == (64, 2, 8, "fused", "fixed")
    assert knobs("ours_kv128_m4_s8") == (128, 4, 8, "fused", "fixed")
    for name in (*cb.PEERS, "copy_floor"):
        assert frame[frame["impl"] == name][cb.KNOB_COLUMNS].isna().all().all(), name
    # Written as ints, and what the batch table is built from.
    path = tmp_path / "run.csv"
    frame.to_csv(path, index=False)
    assert ",64,1,4,fused,fixed\n" in path.read_text()
    (row,) = batch_table.build_batch_table(batch_table.read_compare_batch_csv(path), "h200")
    assert (row["lengths"], row["batch"], row["len_max"], row["len_mean"]) == ("40,7x3", 4, 40, 61 // 4)
    assert row["n_trials"] == 5 and row["source"] == "run.csv"  # ours, one split, the two plans, load-aware


def test_a_sweep_times_only_ours_and_the_plans(calls):
    frame = cb.run_compare_batch("uniform:3:33", peers=(), one_split=None, plans=[(1, 4, 64), (2, 4, 128)],
                                 layout_rows=False, **DIMS)
    assert list(frame["impl"]) == ["ours", plan_points.plan_row_name(1, 4), plan_points.plan_row_name(2, 4, 128),
                                   "copy_floor"]
    assert list(frame["impl"])[1:3] == ["ours_m1_s4", "ours_kv128_m2_s4"]


def test_eager_times_every_implementation_as_called_by_default(calls, monkeypatch):
    timed = {}

    def eager_times(calls, device, timing):
        timed[len(timed)] = ([fn.keywords.get("check_inputs") for fn in calls.eager if hasattr(fn, "keywords")],
                             [fn.keywords.get("check_inputs") for fn in calls.timed if hasattr(fn, "keywords")])
        return 7.0 + len(timed), 20.0
    monkeypatch.setattr(cb, "_eager_times", eager_times)
    frame = cb.run_compare_batch("40,7x3", peers=("flashinfer_decode",), one_split=None, **DIMS)
    assert not set(cb.EAGER_COLUMNS) & set(frame.columns)
    assert not timed
    frame = cb.run_compare_batch("40,7x3", peers=("flashinfer_decode",), one_split=None, eager=True, **DIMS)
    assert list(frame.columns) == cb.COLUMNS + cb.EAGER_COLUMNS
    rows = _by_impl(frame)
    assert rows["ours"]["host_us"] == 8.0 and rows["ours"]["eager_us"] == 20.0
    assert rows["flashinfer_decode"]["eager_us"] == 20.0
    assert math.isnan(rows["copy_floor"]["eager_us"])
    checked, unchecked = timed[0]  # ours: the loop of checked default calls, the host cost without the check
    assert checked and all(checked) and unchecked and not any(unchecked)
    assert "| eager µs | host µs |" in cb.markdown_report(frame)
