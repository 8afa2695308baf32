"""Selector on fixture tables: hits, interpolation, fallback, never an invalid config."""
import dataclasses
from pathlib import Path

import pandas as pd
import pytest

from splitkv_tune import analytic, evaluation, interpolation, lookup, selector, tunables
from splitkv_tune.evaluation import evaluate_trials, fallback_vs_fa2, shape_of
from splitkv_tune.gpus import profile_for
from splitkv_tune.selector import (HeuristicTable, auto_config, load_table_for_gpu, select_config,
                                   select_shape)
from splitkv_tune.table_schema import read_heuristics, read_trials
from splitkv_tune.tunables import Shape, block_m_for, ceil_div, smem_bytes

FIXTURES = Path(__file__).resolve().parent / "fixtures"
HEURISTICS = FIXTURES / "heuristics.csv"
TRIALS = FIXTURES / "trials.csv"
# Sweeps measured on an H200 (2026-11-29): the quick grid, and the GQA-8 decode part of the
# full grid.
MEASURED_H200 = [FIXTURES.parents[1] / "results" / "nvidia_h200" / "trials.csv",
                 FIXTURES.parents[1] / "results" / "full_grid" / "nvidia_h200" / "trials.csv"]


@pytest.fixture(scope="module")
def table():
    return HeuristicTable(read_heuristics(HEURISTICS), source=str(HEURISTICS))


def _kw(row):
    return dict(dtype=row["dtype"], head_dim=int(row["head_dim"]), batch=int(row["batch"]),
                q_heads=int(row["q_heads"]), kv_heads=int(row["kv_heads"]),
                q_len=int(row["q_len"]), kv_len=int(row["kv_len"]), causal=bool(row["causal"]))


def test_every_row_is_a_hit(table):
    df = read_heuristics(HEURISTICS)
    for _, row in df.iterrows():
        sel = select_config(table, **_kw(row))
        assert sel.kind == "hit" and sel.reason.startswith("table hit")
        assert (sel.config.num_splits, sel.config.block_kv, sel.config.split_policy) == (
            row["num_splits"], row["block_kv"], row["split_policy"])


def test_dataframe_and_table_agree(table, random_shapes):
    df = read_heuristics(HEURISTICS)
    for shape in list(random_shapes(100, seed=3)):
        assert select_shape(df, shape) == select_shape(table, shape)


def test_interpolation_between_rows(table):
    kw = dict(dtype="bf16", head_dim=128, batch=1, q_heads=32, kv_heads=8, q_len=1, causal=False)
    sel = select_config(table, kv_len=5000, **kw)
    assert sel.kind == "interpolated" and "interpolated from rows #" in sel.reason
    # The CTA count S * B*Hkv*m_blocks lands between the neighbours' CTA counts.
    ctas = [int(table.frame.iloc[i]["num_splits"]) * selector._work(shape_of(table.frame.iloc[i]))[1]
            for i in sel.rows]
    per_split = selector._work(Shape("bf16", 128, 1, 32, 8, 1, 5000))[1]
    assert min(ctas) // per_split <= sel.config.num_splits <= -(-max(ctas) // per_split)
    # Same work dimensions as a row (B*Hkv, Sk, Sq*G) -> that row's config.
    same = select_config(table, **{**kw, "batch": 2, "q_heads": 16, "kv_heads": 4}, kv_len=8192)
    assert same.config == select_config(table, kv_len=8192, **kw).config
    assert len(same.rows) == 1


def test_interpolation_follows_cta_count(table):
    kw = dict(dtype="bf16", head_dim=64, q_heads=32, kv_heads=8, q_len=1, kv_len=32768,
              causal=False)
    splits = [select_config(table, batch=b, **kw).config.num_splits for b in (1, 2, 3, 4, 8, 16)]
    assert splits == sorted(splits, reverse=True)  # more (B*Hkv) work -> fewer splits


def test_fallback_without_table_or_rows(table):
    sel = select_config(None, dtype="bf16", head_dim=128, batch=1, q_heads=32, kv_heads=8,
                        q_len=1, kv_len=16384, causal=False, gpu="h200")
    assert sel.kind == "fallback" and "analytic fallback (no table" in sel.reason
    assert sel.config.num_splits > 1
    # A batch that fills the GPU many times over is not split. (At B = 64 the model finds 1% in
    # splitting, as the dense sweep measured S4 kv64 0.1-1% ahead of S1 kv128 at B 16-64, Hkv 32.)
    big = select_config(None, dtype="bf16", head_dim=128, batch=32, q_heads=32, kv_heads=32,
                        q_len=1, kv_len=16384, causal=False, gpu="h200")
    assert big.config.num_splits == 1
    # No non-causal prefill rows with a 64-row tile in the fixture:
    sel = select_config(table, dtype="bf16", head_dim=128, batch=1, q_heads=32, kv_heads=8,
                        q_len=64, kv_len=4096, causal=False)
    assert sel.kind == "fallback" and "block_m=64" in sel.reason


@pytest.mark.parametrize("rows,kind", [(1, "fallback"), (3, "fallback"), (4, "interpolated")])
def test_a_class_of_fewer_rows_than_neighbours_uses_the_fallback(rows, kind):
    """Interpolating from one or two far rows chose S1 for D = 256 batches of 48 CTAs; a class
    needs the K rows the interpolation reads."""
    base = dict(schema_version=1, gpu="nvidia_h200", dtype="bf16", head_dim=256, causal=0, batch=1,
                q_heads=16, kv_heads=8, q_len=1, num_splits=16, block_kv=32, reduce_threads=128,
                split_policy="blocks", median_us=10.0, n_trials=40, run_id="r1")
    t = HeuristicTable(pd.DataFrame([{**base, "kv_len": 4096 << i} for i in range(rows)]))
    shape = Shape("bf16", 256, 6, 16, 8, 1, 24000)
    sel = select_shape(t, shape)
    assert sel.kind == kind
    if kind == "fallback":
        assert sel.config == select_shape(None, shape, "h200").config
    # The run-time lookup of "auto" takes the same path on every Sk.
    found = lookup.KvLenLookup(shape, t, "NVIDIA H200", 132)
    for sk in (1, 100, 4095, 4096, 5000, 24000, 40000, 2**20):
        s = dataclasses.replace(shape, kv_len=sk)
        assert found.config(sk) == select_shape(t, s, "NVIDIA H200", sms=132).config, sk
    if kind == "fallback":
        assert f"{rows} table row{'' if rows == 1 else 's'} for" in sel.reason
        assert "fewer than the 4" in sel.reason
        assert selector.class_rows(t, shape) == []
    else:
        assert len(selector.class_rows(t, shape)) == rows


@pytest.mark.parametrize("gpu", ["nvidia_h200", "nvidia_a100", "nvidia_l40s", "nvidia_b200", None])
def test_never_an_invalid_config(table, gpu, random_shapes):
    prof = profile_for(gpu) if gpu else None
    for i, shape in enumerate(random_shapes(600, seed=11)):
        for tab in (table, None) if i % 3 == 0 else (table,):
            cfg = select_shape(tab, shape, gpu).config.validate()
            assert cfg.num_splits <= ceil_div(shape.kv_len, cfg.block_kv)
            limit = (prof or selector.GENERIC_PROFILE).smem_per_sm
            if prof is not None or tab is None:
                assert smem_bytes(shape.head_dim, cfg.block_kv,
                                  block_m_for(shape.packed_rows)) <= limit


def test_bad_shapes_raise():
    for bad in (dict(head_dim=80), dict(q_heads=6), dict(kv_len=0), dict(batch=2**31)):
        kw = dict(dtype="bf16", head_dim=128, batch=1, q_heads=8, kv_heads=4, q_len=1,
                  kv_len=64, causal=False)
        with pytest.raises(ValueError):
            select_config(None, **{**kw, **bad})


def test_env_var_tables_and_auto_config(tmp_path, monkeypatch):
    (tmp_path / "nvidia_h200").mkdir()
    df = read_heuristics(HEURISTICS)
    df.assign(num_splits=3).to_csv(tmp_path / "nvidia_h200" / "heuristics.csv", index=False)
    monkeypatch.setenv(selector.TABLES_ENV, str(tmp_path))
    monkeypatch.setattr(selector, "RESULTS_DIR", tmp_path / "shipped")
    selector.clear_lookup_caches()
    loaded = load_table_for_gpu("NVIDIA H200")
    assert loaded is not None and loaded is load_table_for_gpu("h200")  # cached
    shape = Shape("bf16", 128, 1, 32, 8, 1, 8192)
    assert auto_config(shape, "NVIDIA H200", 132).num_splits == 3
    monkeypatch.setenv(selector.TABLES_ENV, str(tmp_path / "nothing"))
    assert load_table_for_gpu("NVIDIA H200") is None
    assert auto_config(shape, "NVIDIA H200", 132).num_splits == 3  # classes keep their table
    selector.clear_lookup_caches()
    assert auto_config(shape, "NVIDIA H200", 132).num_splits > 1  # analytic fallback
    assert auto_config(shape, "Unknown GPU", 20).validate()
    selector.clear_lookup_caches()


def test_leave_one_out_and_fallback_vs_fa2():
    trials = read_trials(TRIALS)
    df = evaluate_trials(trials, "h200", leave_one_out=True)
    assert len(df) == len(read_heuristics(HEURISTICS))
    assert set(df["selector_kind"]) <= {"interpolated", "fallback"}  # never its own row
    for rule in ("selector", "fallback", "fa2", "fa3", "sglang"):
        assert (df[f"{rule}_regret"] >= 0).all()
        assert set(df[f"{rule}_match"]) <= set(evaluation.MATCHES)
    res = fallback_vs_fa2(trials, "h200")
    assert set(res) == {"fallback", "fa2", "better", "per_shape"}
    # The fixture's times come from the cost model itself, so the fallback must win here.
    assert res["better"] and isinstance(res["per_shape"], pd.DataFrame)


@pytest.mark.parametrize("path", MEASURED_H200, ids=["quick", "full_gqa8"])
def test_fallback_beats_fa2_on_measured_h200_trials(path):
    """Issue 4: the analytic fallback (no table) must beat FA2's rule on real H200 data."""
    res = fallback_vs_fa2(read_trials(path), "h200")
    assert res["fallback"]["n"] == res["fa2"]["n"] >= 20
    assert res["fallback"]["geomean"] < res["fa2"]["geomean"]
    assert res["fallback"]["max"] <= res["fa2"]["max"]


def test_the_fallback_rate_scaled_by_copy_bandwidth_chooses_better_on_measured_h100_trials():
    """The fallback's per-CTA rate, read off the H200, scaled to the H100's copy bandwidth beats
    the same rate unscaled on the H100's held-out shapes (every config timed, never in a table)."""
    h100 = profile_for("h100")
    unscaled = dataclasses.replace(analytic.MODEL, fitted_copy_bw_mbps=int(round(h100.copy_bw_gbps * 1000)))
    assert analytic.cta_stream_rate(h100, unscaled) == analytic.MODEL.cta_stream_mbps
    results = FIXTURES.parents[1] / "results" / "nvidia_h100"
    trials = pd.concat([read_trials(results / f"{name}_models_trials.csv") for name in ("holdout", "confirm")])
    ok = trials[trials["status"] == "ok"]
    regrets = {"scaled": [], "unscaled": []}
    for _, group in ok.groupby(list(evaluation.SHAPE_COLUMNS)):
        shape = shape_of(group.iloc[0])
        start = dataclasses.replace(shape, kv_len=selector.sk_bucket_start(shape.kv_len))
        best = group["median_us"].min()
        for name, model in (("scaled", analytic.MODEL), ("unscaled", unscaled)):
            cfg = analytic.analytic_config(start, h100, model)
            regrets[name].append(evaluation.config_time(group, cfg)[0] / best - 1)
    scaled, plain = (evaluation.summarize(regrets[n]) for n in ("scaled", "unscaled"))
    assert scaled["n"] == plain["n"] == 68
    assert scaled["geomean"] < plain["geomean"] - 0.01


def _tiny_grid(tmp_path, splits: str, max_time_s: float):
    """A one-shape grid YAML for the measured evaluate path."""
    grid = tmp_path / "tiny.yaml"
    grid.write_text(
        "name: tiny\n"
        "shapes:\n"
        "  - {dtype: bf16, head_dim: 64, q_heads: 4, kv_heads: 2, batch: 1, q_len: 1, kv_len: 300}\n"
        f"space: {{num_splits: {splits}, block_kv: [64], reduce_threads: [128], split_policy: [blocks]}}\n"
        f"timing: {{warmup_s: 0.0, min_reps: 3, max_time_s: {max_time_s}}}\n")
    return grid


def test_evaluate_times_every_rule_on_the_reference_backend(tmp_path):
    """The measured evaluate path, run on the CPU: each rule's time comes from the same sweep."""
    from click.testing import CliRunner

    from splitkv_tune.cli_tables import evaluate
    grid = _tiny_grid(tmp_path, "[1, 2, 4]", max_time_s=0.0)
    out = tmp_path / "ev.csv"
    result = CliRunner().invoke(evaluate, ["--gpu", "h200", "--backend", "reference", "--shapes-file",
                                           str(grid), "--table", str(FIXTURES / "heuristics.csv"),
                                           "--out-csv", str(out)])
    assert result.exit_code == 0, result.output
    row = pd.read_csv(out).iloc[0]
    for rule in ("selector", "fa2", "s1"):
        assert row[f"{rule}_us"] >= row["best_us"] > 0
        assert row[f"{rule}_regret"] == pytest.approx(row[f"{rule}_us"] / row["best_us"] - 1)
    assert "geometric-mean regret" in result.output


def test_evaluate_refuses_to_time_one_gpu_as_another(tmp_path, monkeypatch):
    """Timings on the GPU present are labelled with it: --gpu naming another GPU ends with exit
    2 and a line naming both, unless --force says the other GPU's table is wanted."""
    from click.testing import CliRunner

    from splitkv_tune import bench, sweep
    from splitkv_tune.cli_tables import evaluate
    monkeypatch.setattr(bench, "backend_problem", lambda backend: None)
    monkeypatch.setattr(sweep, "present_device_name", lambda backend: "nvidia_h100")
    labels = []

    def fake_measure(shape, gpu, bench_kwargs, table, search_space, trial_rows, run_id, measured_on=None):
        labels.append((gpu, measured_on))
        raise SystemExit(0)

    monkeypatch.setattr(evaluation, "measure_shape", fake_measure)
    argv = ["--gpu", "h200", "--shapes-file", str(_tiny_grid(tmp_path, "[1]", max_time_s=0.0)),
            "--table", str(HEURISTICS)]
    refused = CliRunner().invoke(evaluate, argv)
    assert refused.exit_code == 2 and not labels
    assert "nvidia_h200" in refused.output and "nvidia_h100" in refused.output and "--force" in refused.output
    forced = CliRunner().invoke(evaluate, [*argv, "--force"])
    assert forced.exit_code == 0, forced.output
    assert [measured for _, measured in labels] == ["nvidia_h100"]


def test_evaluate_keeps_its_timings_for_a_replay_against_another_table(tmp_path):
    """--out-trials writes every timed config as a valid trials.csv; --from-trials with --table
    replays the selector of that table on those shapes without timing anything, and the
    regrets of the rules that do not read the table come out as measured."""
    from click.testing import CliRunner

    from splitkv_tune.cli_tables import evaluate
    from splitkv_tune.table_schema import read_trials
    grid = _tiny_grid(tmp_path, "[1, 2, 4]", max_time_s=0.0)
    measured, timed = tmp_path / "ev.csv", tmp_path / "held_out_trials.csv"
    table = str(FIXTURES / "heuristics.csv")
    result = CliRunner().invoke(evaluate, ["--gpu", "h200", "--backend", "reference", "--shapes-file", str(grid),
                                           "--table", table, "--out-csv", str(measured),
                                           "--out-trials", str(timed)])
    assert result.exit_code == 0, result.output
    trials = read_trials(timed)
    assert set(trials["num_splits"]) >= {1, 2, 4} and (trials["status"] == "ok").all()
    assert set(trials["gpu"]) == {"cpu_reference"}  # CPU timings never read as the H200's
    assert trials["run_id"].nunique() == 1
    replayed = tmp_path / "replay.csv"
    result = CliRunner().invoke(evaluate, ["--gpu", "h200", "--from-trials", str(timed), "--table", table,
                                           "--out-csv", str(replayed)])
    assert result.exit_code == 0, result.output
    first, again = pd.read_csv(measured).iloc[0], pd.read_csv(replayed).iloc[0]
    assert again["best_us"] == pytest.approx(first["best_us"])
    for rule in ("selector", "fa2", "s1"):
        assert again[f"{rule}_regret"] == pytest.approx(first[f"{rule}_regret"])
    both = CliRunner().invoke(evaluate, ["--gpu", "h200", "--from-trials", str(timed), "--out-trials",
                                         str(tmp_path / "x.csv")])
    assert both.exit_code == 2 and "--out-trials" in both.output


def test_evaluate_takes_the_grid_timing_unless_overridden(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from splitkv_tune import evaluation
    from splitkv_tune.cli_tables import evaluate
    grid = _tiny_grid(tmp_path, "[1, 2]", max_time_s=0.01)
    seen = []

    def fake_measure(shape, gpu, bench_kwargs, table, search_space, trial_rows, run_id, measured_on=None):
        seen.append((bench_kwargs, search_space.num_splits))
        return {c: getattr(shape, c) for c in ("dtype", "head_dim", "batch", "q_heads",
                                               "kv_heads", "q_len", "kv_len")} | {
            "causal": 0, "best_us": 1.0, "selector_regret": 0.0, "fa2_regret": 0.0,
            "s1_regret": 0.0}

    monkeypatch.setattr(evaluation, "measure_shape", fake_measure)
    base = ["--gpu", "h200", "--backend", "reference", "--shapes-file", str(grid),
            "--table", str(FIXTURES / "heuristics.csv")]
    for extra, want in (([], 0.01), (["--max-time-s", "0.5"], 0.5)):
        result = CliRunner().invoke(evaluate, base + extra)
        assert result.exit_code == 0, result.output
        kwargs, splits = seen.pop()
        assert kwargs["max_time_s"] == want and kwargs["min_reps"] == 3
        assert kwargs["backend"] == "reference" and splits == (1, 2)


def _per_block_kv_table(splits_at_64: int):
    """Four bf16 D128 decode rows (one class) whose fastest block_kv is 64 although each row's
    winner is 128, each with ``splits_at_64`` splits at 64."""
    base = dict(schema_version=1, gpu="nvidia_h200", dtype="bf16", head_dim=128, causal=0, batch=1,
                q_heads=32, kv_heads=8, q_len=1, num_splits=4, block_kv=128, reduce_threads=128,
                split_policy="blocks", median_us=10.4, n_trials=30, run_id="r1",
                best_us_kv32=12.0, best_splits_kv32=16, best_us_kv64=10.0, best_splits_kv64=splits_at_64,
                best_us_kv128=10.4, best_splits_kv128=4)
    return HeuristicTable(pd.DataFrame([{**base, "kv_len": sk} for sk in (2048, 4096, 8192, 16384)]))


def test_interpolation_takes_the_block_the_neighbours_ran_fastest_and_fills_whole_waves():
    shape = Shape("bf16", 128, 1, 32, 8, 1, 6000)
    slots = interpolation.wave_slots(128, 16, profile_for("h200"))[tunables.BLOCK_KV.index(64)]
    ctas_per_split = 8  # B * Hkv * one query tile
    # The neighbours ran about one wave at block_kv 64: S fills one whole wave here too.
    sel = selector.select_shape(_per_block_kv_table(slots // ctas_per_split), shape, "h200")
    assert sel.kind == "interpolated" and sel.config.block_kv == 64
    assert sel.config.num_splits == slots // ctas_per_split and "waves of" in sel.reason
    # Far below a wave the split count interpolates in log2 (the neighbours' 8 splits stay 8).
    sel = selector.select_shape(_per_block_kv_table(8), shape, "h200")
    assert (sel.config.block_kv, sel.config.num_splits) == (64, 8)
    # A table without the per-block_kv columns knows only the winners' block_kv.
    plain = HeuristicTable(_per_block_kv_table(8).frame.drop(
        columns=[c for c in _per_block_kv_table(8).columns if c.startswith("best_")]))
    assert selector.select_shape(plain, shape, "h200").config.block_kv == 128


def test_nearest_count_rounds_a_wave_count_in_log2():
    from splitkv_tune.lookup import nearest_counts
    targets = [-70000, 0, 1, 30000, 65536, 103872, 131072, 150000, interpolation.log2_q16(1000) + 7,
               41 << 16, 60 << 16]
    want = [min(range(1, 2000), key=lambda n: (abs(interpolation.log2_q16(n) - t), n)) if t < (11 << 16)
            else None for t in targets]
    got = [interpolation.nearest_count(t) for t in targets]
    assert [g for g, w in zip(got, want) if w is not None] == [w for w in want if w is not None]
    assert got[-2:] == [(1 << 41) - 1, (1 << 41) - 1]
    assert nearest_counts(targets).tolist() == got


def test_the_interpolated_s_is_raised_until_the_sms_share_its_ctas_evenly():
    """The H200's profile raises S3 (144 CTAs on 132 SMs: 12 SMs hold two) to S5 (240 CTAs, a
    mean 0.91 of the busiest SM's two) for a held-out shape where S3 ran 13.4% behind its best
    and S5 1.3%; a profile without sm_balance_pct keeps S3."""
    shipped = HeuristicTable(read_heuristics(FIXTURES.parents[1] / "results" / "nvidia_h200" / "heuristics.csv"))
    shape = Shape("bf16", 128, 6, 32, 8, 4, 6000)
    sel = selector.select_shape(shipped, shape, "h200")
    assert sel.kind == "interpolated" and sel.config.num_splits == 5
    assert "S=3 raised to 5 so that 132 SMs share its 240 CTAs evenly" in sel.reason
    plain = dataclasses.replace(profile_for("h200"), sm_balance_pct=0)
    assert selector.select_shape(shipped, shape, plain).config.num_splits == 3
    assert lookup.KvLenLookup(shape, shipped, "NVIDIA H200", 132).config(6000) == sel.config
    # Never past 2S or MAX_SPLITS, and S stays when no S' there is even.
    assert interpolation.balance_splits(tunables.MAX_SPLITS, 7, 132, 99) == tunables.MAX_SPLITS
    assert interpolation.balance_splits(3, 50, 132, 100) == 3
