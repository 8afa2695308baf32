"""The tuning CLI end to end on the reference backend (CPU): sweep, resume, failures, table."""
import dataclasses
import json
from pathlib import Path

import optuna
import pandas as pd
import pytest
import torch
import yaml
from click.testing import CliRunner

from splitkv_tune import bench, compare, records, space, tunables
from splitkv_tune import sweep as sweep_mod
from splitkv_tune.cli_tune import bench as bench_cmd
from splitkv_tune.cli_tune import env as env_cmd
from splitkv_tune.cli_sweep import sweep as sweep_cmd
from splitkv_tune.cli_sweep import table as table_cmd
from splitkv_tune.table import TRIALS_COLUMNS
from splitkv_tune.table_schema import CONFIG_COLUMNS, HEURISTICS_COLUMNS, SHAPE_COLUMNS
from splitkv_tune.tunables import Config, Shape

TINY_GRID = yaml.safe_load((Path(__file__).parent / "fixtures" / "tiny_grid.yaml").read_text())


@pytest.fixture
def grid(tmp_path):
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(TINY_GRID))
    return path


def n_candidates(num_sms=132):
    total = 0
    grid = space.parse_grid(TINY_GRID)
    for shape in grid.shapes:
        extra = [space.fa2_config(shape, num_sms).num_splits]
        total += len(space.candidate_configs(shape, grid.space, extra_splits=extra))
    return total


def run_sweep(grid, out, *extra):
    args = ["--backend", "reference", "--grid", str(grid), "--out", str(out), "--no-progress",
            *extra]
    return CliRunner().invoke(sweep_cmd, args, catch_exceptions=False)


def read_trials(out):
    return pd.read_csv(out / "trials.csv", dtype={"reason": str})


def test_sweep_writes_trials_heuristics_and_run_meta(grid, tmp_path):
    out = tmp_path / "out"
    result = run_sweep(grid, out)
    assert result.exit_code == 0, result.output
    trials = read_trials(out)
    assert list(trials.columns) == TRIALS_COLUMNS
    assert len(trials) == n_candidates()
    assert (trials.status == "ok").all()
    assert (trials.median_us > 0).all() and (trials.p20_us <= trials.p80_us).all()
    assert (trials.gbps > 0).all() and (trials.frac_copy_bw > 0).all()
    assert trials.gpu.unique().tolist() == ["cpu_reference"]
    assert not trials.duplicated(SHAPE_COLUMNS + CONFIG_COLUMNS).any()
    assert set(trials.source) >= {"fa2", "grid"}
    heur = pd.read_csv(out / "heuristics.csv")
    assert list(heur.columns) == HEURISTICS_COLUMNS and len(heur) == 2
    runs = list((out / "runs").glob("*.json"))
    assert len(runs) == 1
    meta = json.loads(runs[0].read_text())
    assert meta["status"] == "completed" and meta["backend"] == "reference"
    assert meta["run_id"] == trials.run_id.iloc[0] and meta["copy_bw_gbps"] > 0
    assert {"torch", "cutlass", "git_sha", "device", "argv", "timestamp"} <= set(meta)


def test_a_run_stopped_in_its_last_rebuild_still_says_how_it_ended(grid, tmp_path, monkeypatch):
    """The run record is written before the files' last rebuild: a kill there (a scheduler's
    KILL after its grace) leaves the record, and the next start rebuilds the files."""
    out = tmp_path / "out"
    calls = []

    def rebuild_then_stop(*args, **kwargs):
        calls.append(1)
        if len(calls) > 1:  # the rebuild at the start goes through; the last one is cut
            raise KeyboardInterrupt
        return records.rebuild_trials_csv(*args, **kwargs)

    monkeypatch.setattr(sweep_mod, "REBUILD_EVERY_S", 3600.0)
    monkeypatch.setattr(sweep_mod, "rebuild_trials_csv", rebuild_then_stop)
    result = run_sweep(grid, out)
    assert result.exit_code == 130 and "Interrupted" in result.output and len(calls) == 2, result.output
    (run,) = (out / "runs").glob("*.json")
    record = json.loads(run.read_text())
    assert record["status"] == "completed" and record["timed"] == n_candidates()


def test_gpu_mismatch_exits_2_naming_both(grid, tmp_path):
    result = run_sweep(grid, tmp_path / "out", "--gpu", "h200")
    assert result.exit_code == 2
    assert "nvidia_h200" in result.output and "cpu_reference" in result.output
    assert not (tmp_path / "out").exists()


def test_gpu_mismatch_with_force_writes_the_named_table(grid, tmp_path):
    result = run_sweep(grid, tmp_path / "out", "--gpu", "h200", "--force",
                       "--shapes", "bf16_*")
    assert result.exit_code == 0, result.output
    assert read_trials(tmp_path / "out").gpu.unique().tolist() == ["nvidia_h200"]


def test_dry_run_prints_grid_trials_and_estimate_and_writes_nothing(grid, tmp_path):
    result = run_sweep(grid, tmp_path / "out", "--dry-run")
    assert result.exit_code == 0, result.output
    assert "bf16_d64_nc_b1_hq4_hkv2_sq1_sk256" in result.output
    assert "fp16_d64_c_b2_hq4_hkv4_sq4_sk128" in result.output
    assert f"{n_candidates()} trials" in result.output and "estimated" in result.output
    assert not (tmp_path / "out").exists()


def test_interrupted_sweep_resumes_without_losing_or_redoing_trials(grid, tmp_path,
                                                                     monkeypatch):
    out = tmp_path / "out"
    calls = []
    original = bench.ShapeBench.measure

    def flaky_measure(self, config):
        calls.append(config)
        if len(calls) == 5:
            raise KeyboardInterrupt  # a kill in the middle of the fifth trial
        return original(self, config)

    monkeypatch.setattr(bench.ShapeBench, "measure", flaky_measure)
    result = run_sweep(grid, out)
    assert result.exit_code == 130
    assert "--resume" in result.output
    assert len(read_trials(out)) == 4          # every finished trial is already on disk

    refused = run_sweep(grid, out)              # a fresh sweep refuses to reuse the studies
    assert refused.exit_code == 2 and "--resume" in refused.output

    calls.clear()
    monkeypatch.setattr(bench.ShapeBench, "measure", original)
    counted = []
    monkeypatch.setattr(bench.ShapeBench, "measure",
                        lambda self, c: counted.append(c) or original(self, c))
    rebuilds = []
    monkeypatch.setattr(sweep_mod, "rebuild_trials_csv",
                        lambda *a, **k: rebuilds.append(a) or records.rebuild_trials_csv(*a, **k))
    monkeypatch.setattr(sweep_mod, "REBUILD_EVERY_S", 0.0)  # due after every trial
    monkeypatch.setattr(sweep_mod, "REBUILD_TIME_FACTOR", 0.0)
    result = run_sweep(grid, out, "--resume")
    assert result.exit_code == 0, result.output
    trials = read_trials(out)
    total = n_candidates()
    assert len(trials) == total
    assert len(counted) == total - 4            # only the unfinished configs were timed
    assert not trials.duplicated(SHAPE_COLUMNS + CONFIG_COLUMNS).any()
    assert trials.run_id.nunique() == 2
    # the files follow every trial once a rebuild is due, besides the start and the end
    shapes = len(space.parse_grid(TINY_GRID).shapes)
    assert len(rebuilds) == len(counted) + 2
    monkeypatch.setattr(sweep_mod, "REBUILD_EVERY_S", 3600.0)

    (out / "heuristics.csv").unlink()           # as a SIGKILL between two rebuilds can leave it
    with monkeypatch.context() as patched:      # a sweep that stops right after its start...
        patched.setattr(bench, "copy_bandwidth_gbps", lambda *a, **k: 1 / 0)
        with pytest.raises(ZeroDivisionError):
            run_sweep(grid, out, "--resume")
    assert len(pd.read_csv(out / "heuristics.csv")) == shapes  # ...has written it again

    rebuilds.clear()
    again = run_sweep(grid, out, "--resume")    # nothing left: no trial is timed again
    assert again.exit_code == 0 and len(counted) == total - 4
    assert len(read_trials(out)) == total
    # nothing timed, no rebuild due: the files are rebuilt at the start and the end only
    assert len(rebuilds) == 2
    assert len(pd.read_csv(out / "heuristics.csv")) == shapes


def test_failing_and_wrong_configs_are_recorded_with_reasons(grid, tmp_path, monkeypatch):
    original = bench.ShapeBench.launchers

    def launchers(self, config):
        if config.num_splits == 4:
            raise ValueError("num_splits=4 is not instantiated")
        fns = original(self, config)
        if config.num_splits == 2 and config.block_kv == 32:
            return [lambda f=f: f() + 1.0 for f in fns]
        return fns

    monkeypatch.setattr(bench.ShapeBench, "launchers", launchers)
    out = tmp_path / "out"
    result = run_sweep(grid, out)
    assert result.exit_code == 0, result.output
    trials = read_trials(out)
    failed = trials[trials.num_splits == 4]
    assert len(failed) > 0 and (failed.status == "failed").all()
    assert failed.reason.str.contains("ValueError: num_splits=4 is not instantiated").all()
    assert failed.median_us.isna().all()       # never infinity
    wrong = trials[(trials.num_splits == 2) & (trials.block_kv == 32)]
    assert (wrong.status == "wrong").all() and wrong.reason.str.contains("max abs error").all()
    heur = pd.read_csv(out / "heuristics.csv")
    assert not heur.num_splits.isin([4]).any()
    storage = optuna.storages.JournalStorage(
        optuna.storages.journal.JournalFileBackend(str(out / "optuna.journal")))
    states = [t.state for s in optuna.get_all_study_summaries(storage)
              for t in optuna.load_study(study_name=s.study_name, storage=storage).trials
              if t.user_attrs.get("record", {}).get("num_splits") == 4]
    assert states and all(s == optuna.trial.TrialState.FAIL for s in states)


def test_tpe_sampler_respects_trial_budget_and_enqueues_fa2_first(grid, tmp_path):
    out = tmp_path / "out"
    result = run_sweep(grid, out, "--sampler", "tpe", "--trials", "3")
    assert result.exit_code == 0, result.output
    trials = read_trials(out)
    assert trials.groupby("study").size().tolist() == [3, 3]
    first = trials.sort_values("trial").groupby("study").head(1)
    assert (first.source == "fa2").all()


def test_tpe_that_proposes_only_measured_configs_still_reaches_the_trial_target(grid, tmp_path, monkeypatch):
    # TPE on a shape of few candidates keeps proposing what it has seen; the study then takes
    # its unmeasured candidates in grid order instead of ending short.
    for sampler in (optuna.samplers.TPESampler, optuna.samplers.RandomSampler):  # TPE starts at random
        monkeypatch.setattr(sampler, "sample_independent",
                            lambda self, study, trial, name, distribution: distribution.choices[0])
    out = tmp_path / "out"
    result = run_sweep(grid, out, "--sampler", "tpe", "--trials", "4")
    assert result.exit_code == 0, result.output
    trials = read_trials(out)
    assert trials.groupby("study").size().tolist() == [4, 4]
    assert not trials.duplicated(["study"] + CONFIG_COLUMNS).any()
    assert (trials.groupby("study").source.apply(lambda s: (s == "grid").any())).all()


def test_warm_start_measures_the_other_dtypes_fastest_configs_first(grid, tmp_path):
    # The earlier sweep: the tiny grid at the other dtype of each shape, two of its configs made
    # fastest (not FlashAttention-2's, which every study measures first anyway).
    assert run_sweep(grid, tmp_path / "earlier").exit_code == 0
    earlier = read_trials(tmp_path / "earlier")
    earlier["dtype"] = earlier["dtype"].map({"bf16": "fp16", "fp16": "bf16"})
    chosen = {}
    for study, rows in earlier.groupby("study"):
        fa2 = tuple(rows[rows.source == "fa2"][CONFIG_COLUMNS].iloc[0])
        picks = [i for i, r in rows.iterrows() if tuple(r[CONFIG_COLUMNS]) != fa2][-2:]
        for rank, i in enumerate(picks):
            earlier.loc[i, ["median_us", "p20_us", "p80_us"]] = 0.001 * (rank + 1)
        chosen[rows.kv_len.iloc[0]] = [tuple(earlier.loc[i, CONFIG_COLUMNS]) for i in picks]
    warm = tmp_path / "earlier_other_dtype.csv"
    earlier.to_csv(warm, index=False)
    out = tmp_path / "out"
    result = run_sweep(grid, out, "--sampler", "tpe", "--trials", "3", "--warm-start", str(warm),
                       "--warm-start-top", "2")
    assert result.exit_code == 0, result.output
    trials = read_trials(out).sort_values("trial")
    for _, rows in trials.groupby("study"):
        assert rows.source.tolist() == ["fa2", "warm", "warm"]
        assert [tuple(r) for r in rows[CONFIG_COLUMNS].values[1:]] == chosen[rows.kv_len.iloc[0]]
    bad = run_sweep(grid, tmp_path / "bad", "--warm-start", str(grid))
    assert bad.exit_code == 2 and str(grid) in bad.output and "Traceback" not in bad.output


def test_warm_start_can_take_the_configs_a_rule_keeps(grid, tmp_path):
    """select="spread" keeps, fastest first, the configs that the GPU's spread rule picks
    (warm_start.spread_on_this_gpu); without a GPU to ask, the CLI refuses it in one line."""
    from splitkv_tune import warm_start
    assert run_sweep(grid, tmp_path / "earlier").exit_code == 0
    path = tmp_path / "earlier" / "trials.csv"
    fastest = warm_start.load([path], top=64)
    shape = space.parse_grid(TINY_GRID).shapes[0]
    every = fastest.for_shape(shape)
    assert len(every) > 2
    keep = {every[-1], every[1]}
    kept = dataclasses.replace(fastest, retime=lambda s, c: s == shape and c in keep)
    assert kept.for_shape(shape) == [every[1], every[-1]]
    assert dataclasses.replace(kept, top=1).for_shape(shape) == [every[1]]
    assert warm_start.load([path], top=4, select="spread").retime is warm_start.spread_on_this_gpu
    with pytest.raises(ValueError, match="select"):
        warm_start.load([path], top=4, select="slowest")
    refused = run_sweep(grid, tmp_path / "spread", "--warm-start", str(path), "--warm-start-select", "spread")
    assert refused.exit_code == 2 and "--warm-start-select" in refused.output
    assert "Traceback" not in refused.output
    alone = run_sweep(grid, tmp_path / "alone", "--warm-start-select", "spread")
    assert alone.exit_code == 2 and "--warm-start" in alone.output


def test_a_retime_measures_its_warm_configs_alone_and_pools_with_the_first_sweep(grid, tmp_path, monkeypatch):
    """A warm start with ``retime`` (what --warm-start-select spread loads): under a second study
    prefix on the same folder, each study measures just the configs kept for its shape, none for
    a shape with none, and the table pools both prefixes' trials per shape."""
    from splitkv_tune import warm_start
    out = tmp_path / "out"
    assert run_sweep(grid, out).exit_code == 0
    first = read_trials(out)
    shapes = space.parse_grid(TINY_GRID).shapes
    source = warm_start.load([out / "trials.csv"], top=64)
    retimed = source.for_shape(shapes[0])[:2]
    load = warm_start.load
    monkeypatch.setattr(warm_start, "load", lambda paths, top, select="fastest": dataclasses.replace(
        load(paths, top, select), retime=lambda shape, c: shape == shapes[0] and c in retimed))
    result = run_sweep(grid, out, "--resume", "--study-prefix", "retime:", "--warm-start", str(out / "trials.csv"))
    assert result.exit_code == 0, result.output
    trials = read_trials(out)
    again = trials[trials.study.str.startswith("retime:")]
    assert len(again) == len(retimed) and set(again.source) == {"warm"}
    assert [Config(*r) for r in again.sort_values("trial")[CONFIG_COLUMNS].itertuples(index=False)] == retimed
    assert set(again.kv_len) == {shapes[0].kv_len}
    assert len(trials) == len(first) + len(retimed)
    assert len(pd.read_csv(out / "heuristics.csv")) == len(shapes)
    warm = ("--warm-start", str(out / "trials.csv"))
    same_prefix = run_sweep(grid, out, "--resume", *warm)
    assert same_prefix.exit_code == 2 and "--study-prefix" in same_prefix.output
    workers = run_sweep(grid, out, "--resume", "--study-prefix", "again:", "--workers", "2", *warm)
    assert workers.exit_code == 2 and "--workers" in workers.output
    monkeypatch.setattr(warm_start, "load", lambda paths, top, select="fastest": dataclasses.replace(
        load(paths, top, select), retime=lambda shape, c: False))
    nothing = run_sweep(grid, out, "--resume", "--study-prefix", "none:", *warm)
    assert nothing.exit_code != 0 and "nothing to time again" in nothing.output
    assert len(read_trials(out)) == len(trials)


def test_table_command_rebuilds_from_storage(grid, tmp_path):
    out = tmp_path / "out"
    assert run_sweep(grid, out).exit_code == 0
    (out / "trials.csv").unlink()
    result = CliRunner().invoke(table_cmd, [str(out), "--from-storage", "-o",
                                            str(tmp_path / "h.csv")])
    assert result.exit_code == 0, result.output
    assert len(pd.read_csv(tmp_path / "h.csv")) == 2
    assert len(read_trials(out)) == n_candidates()


def test_table_command_joins_the_parts_of_a_grid(grid, tmp_path):
    """A grid swept in parts (one folder each) gives one table over every part's shapes."""
    keys = [space.shape_key(s) for s in space.parse_grid(TINY_GRID).shapes]
    parts = [tmp_path / f"part{i}" for i in range(len(keys))]
    for key, out in zip(keys, parts):
        assert run_sweep(grid, out, "--shapes", key).exit_code == 0
    result = CliRunner().invoke(table_cmd, [*map(str, parts), "-o", str(tmp_path / "h.csv")])
    assert result.exit_code == 0, result.output
    joined = pd.read_csv(tmp_path / "h.csv")
    for out in parts:
        part = pd.read_csv(out / "heuristics.csv")
        assert len(part) == 1
        assert part[SHAPE_COLUMNS + CONFIG_COLUMNS].iloc[0].tolist() in \
            joined[SHAPE_COLUMNS + CONFIG_COLUMNS].values.tolist()
    assert len(joined) == len(keys)
    both = CliRunner().invoke(table_cmd, [*map(str, parts), "--from-storage"])
    assert both.exit_code == 2 and "one TRIALS" in both.output


def test_bench_command_on_reference_backend(tmp_path):
    csv = tmp_path / "bench.csv"
    result = CliRunner().invoke(bench_cmd, [
        "--backend", "reference", "--batch", "1", "--q-heads", "4", "--kv-heads", "2",
        "--kv-len", "256", "--head-dim", "64", "--splits", "1,2", "--splits", "auto",
        "--block-kv", "64", "--min-reps", "3", "--max-time-s", "0", "--warmup-s", "0",
        "--csv", str(csv)])
    assert result.exit_code == 0, result.output
    frame = pd.read_csv(csv)
    # "auto" is shown as the config it resolves to (FA2's split count on this backend);
    # a duplicate of a listed config is measured once.
    auto_splits = tunables.fa2_num_splits(Shape("bf16", 64, 1, 4, 2, 1, 256), 132)
    assert sorted(frame.num_splits) == sorted({1, 2, auto_splits})
    assert (frame.status == "ok").all() and (frame.block_kv == 64).all()
    assert "pct_copy_bw" in frame.columns and "GB/s" in result.output
    assert set(frame["merge"]) == {"none", "reference"}  # S=1 merges nothing
    assert set(frame["pdl"]) == {"-"}  # a CUDA launch setting; --pdl on,off adds no rows here


def test_bench_breakdown_needs_the_cuda_backend():
    result = CliRunner().invoke(bench_cmd, ["--backend", "reference", "--breakdown"])
    assert result.exit_code == 2 and "--backend cuda" in result.output


def test_bench_command_rejects_bad_values():
    result = CliRunner().invoke(bench_cmd, ["--backend", "reference", "--splits", "x"])
    assert result.exit_code == 2 and "--splits" in result.output
    result = CliRunner().invoke(bench_cmd, ["--backend", "reference", "--head-dim", "80"])
    assert result.exit_code == 2 and "head_dim" in result.output
    result = CliRunner().invoke(bench_cmd, ["--backend", "reference", "--merge", "dsmem"])
    assert result.exit_code == 2 and "--merge" in result.output
    result = CliRunner().invoke(bench_cmd, ["--backend", "reference", "--pdl", "maybe"])
    assert result.exit_code == 2 and "--pdl" in result.output


def test_compare_markdown_never_takes_our_variant_for_the_best_peer():
    rows = [dict(dtype="bf16", head_dim=128, causal=0, batch=1, q_heads=32, kv_heads=8, q_len=1,
                 kv_len=4096, impl=impl, config="", median_us=us, status="ok", frac_copy_bw=0.5,
                 floor_us=3.9) for impl, us in (("ours", 10.0), ("ours_no_pdl", 11.0),
                                                ("sdpa_flash", 20.0))]
    line = compare.markdown_table(pd.DataFrame(rows)).splitlines()[2]
    assert line.endswith("| 10.0 | 11.0 | 20.0 | 50.0% | 2.00x |")
    # Host time moves no bytes: no floor, no copy-bandwidth share.
    host = pd.DataFrame(rows).assign(host_us=[5.0, 6.0, 25.0])
    head, _, line = compare.markdown_table(host, "host_us").splitlines()[:3]
    assert "floor" not in head and "copy bw" not in head
    assert line == "| 1 | 32 | 8 | 1 | 4096 | 128 | bf16 | 0 | 5.0 | 6.0 | 25.0 | 5.00x |"


def test_resolve_merge():
    from splitkv_tune import ops
    decode = Shape("bf16", 128, 1, 32, 8, 1, 4096)
    with pytest.raises(ValueError, match="merge must be one of"):
        ops.resolve_merge(decode, tunables.Config(num_splits=4), "dsmem")
    assert ops.resolve_merge(decode, tunables.Config(num_splits=1), "fused") == "none"
    assert ops.resolve_merge(decode, tunables.Config(num_splits=4), "kernel") == "kernel"
    assert ops.resolve_merge(decode, tunables.Config(num_splits=4), "auto") == "fused"
    # One float4 per thread: 4 rows at head dim 128, 8 at 64; MQA decode packs 32 rows.
    for hq, hkv, d, fused in ((32, 8, 128, True), (64, 8, 64, True), (32, 1, 128, False)):
        shape = Shape("bf16", d, 1, hq, hkv, 1, 4096)
        assert ops.resolve_merge(shape, tunables.Config(num_splits=4)) == ("fused" if fused else "kernel")
    for force in ("fused", "kernel"):
        assert ops.resolve_merge(Shape("bf16", 128, 1, 32, 1, 1, 4096), tunables.Config(4), force) == force


def test_env_command_prints_metadata():
    result = CliRunner().invoke(env_cmd, ["--json"])
    assert result.exit_code == 0, result.output
    info = json.loads(result.output)
    assert info["torch"] == torch.__version__ and "device" in info


def test_time_callable_and_copy_bandwidth_on_cpu():
    timing = bench.time_callable([lambda: None, lambda: None], min_reps=5, max_time_s=0,
                                 warmup_s=0)
    assert timing.n == 5 and timing.input_sets == 2 and timing.method == "wallclock"
    assert bench.copy_bandwidth_gbps("cpu", 1 << 20, warmup_s=0, min_reps=3, max_time_s=0) > 0


def test_second_study_prefix_in_one_out_dir_keeps_the_first_runs_rows(grid, tmp_path):
    out = tmp_path / "out"
    assert run_sweep(grid, out).exit_code == 0
    first = len(read_trials(out))
    result = run_sweep(grid, out, "--study-prefix", "again:")
    assert result.exit_code == 0, result.output
    trials = read_trials(out)
    assert len(trials) == 2 * first
    assert trials.study.str.startswith("again:").sum() == first


def test_git_sha_variable_overrides_a_stale_checkout(monkeypatch):
    from splitkv_tune import meta
    monkeypatch.setenv("SPLITKV_GIT_SHA", "0123abc")
    assert meta.git_info() == {"git_sha": "0123abc", "git_dirty": None}
    monkeypatch.delenv("SPLITKV_GIT_SHA")
    assert meta.git_info()["git_sha"] != "0123abc"


def test_breakdown_shares_are_of_the_measured_call(monkeypatch):
    from splitkv_tune import breakdown
    spans = [breakdown.KernelSpan("split", 0.0, 8.0), breakdown.KernelSpan("combine", 8.0, 10.0)]
    monkeypatch.setattr(breakdown, "trace_graph", lambda fns, device: (spans, 1))
    shape_bench = bench.ShapeBench(Shape("bf16", 64, 1, 4, 2, 1, 256), backend="reference")
    rows = breakdown.config_breakdown(shape_bench, tunables.Config(2, 64, 128, "blocks"), 12.5)
    assert [r["kernel"] for r in rows] == ["split", "combine", "(gaps)"]
    assert [r["share"] for r in rows] == pytest.approx([0.64, 0.16, 0.2])


def test_our_calls_pass_the_default_or_a_preallocated_workspace(monkeypatch):
    """bench and compare time the default call (no workspace) unless asked to preallocate one;
    then an "auto" config gets the workspace of the split count it resolves to."""
    from splitkv_tune.compare import AUTO_CONFIG
    resolved = tunables.Config(num_splits=8, block_kv=64, reduce_threads=128, split_policy="blocks")
    monkeypatch.setattr(bench.ShapeBench, "resolve", lambda self, config: resolved)
    shape = Shape("bf16", 128, 1, 32, 8, 1, 4096)
    default = bench.ShapeBench(shape, backend="cuda", device="cpu")
    assert {f.keywords["workspace"] for f in default.launchers(AUTO_CONFIG)} == {None}
    shape_bench = default.with_launch(workspace="preallocated")
    fns = shape_bench.launchers(AUTO_CONFIG)
    assert shape_bench._shared["workspace"].numel() == tunables.workspace_bytes(shape, 8) > 0
    # Each launch gets the config it was sized for, not "auto" to resolve again.
    assert {f.keywords["num_splits"] for f in fns} == {8}
    assert {f.keywords["block_kv"] for f in fns} == {64}
    with pytest.raises(ValueError, match="workspace"):
        default.with_launch(workspace="pinned")
