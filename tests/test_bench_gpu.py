"""GPU checks of the timing harness, the cuda backend and the peers (skipped without CUDA + _C)."""
import pytest
import torch
import yaml
from click.testing import CliRunner

from splitkv_tune import bench, breakdown, compare, eager_timing, gpus
from splitkv_tune.tunables import Config, Shape

pytestmark = pytest.mark.gpu
FAST = dict(warmup_s=0.01, min_reps=10, max_time_s=0.02)
SHAPE = Shape("bf16", 128, 1, 32, 8, 1, 4096)


def test_cuda_graph_timing_and_copy_bandwidth():
    x = torch.randn(1 << 22, device="cuda")
    timing = bench.time_callable([lambda: x.mul_(1.0)], device="cuda", **FAST)
    assert timing.method == "cuda_graph" and timing.n >= 10 and timing.median_us > 0
    bandwidth = bench.copy_bandwidth_gbps("cuda", warmup_s=0.01, min_reps=10, max_time_s=0.05)
    profile = gpus.profile_for(torch.cuda.get_device_name())
    if profile is not None:
        assert 0.8 * profile.copy_bw_gbps < bandwidth < 1.2 * profile.copy_bw_gbps


def test_host_time_counts_only_samples_the_gpu_slept_through():
    x = torch.randn(1024, device="cuda")
    x.mul_(1.0).sum().item()  # the kernels loaded (a first launch may wait for the GPU)
    host, asleep = eager_timing.queued_host_time([lambda: x.mul_(1.0)] * 64)
    assert asleep and 0 < host < 1000
    # A call that reads back waits for the sleep: the sample is not host time, and time_eager
    # says so rather than report it.
    _, asleep = eager_timing.queued_host_time([lambda: x.sum().item()] * 4)
    assert not asleep
    host_timing, eager = eager_timing.time_eager([lambda: x.sum().item()], "cuda", warmup_s=0.0, min_reps=3,
                                                 max_time_s=0.01)
    assert host_timing.status == "failed" and "waits for the GPU" in host_timing.reason
    assert host_timing.median_us != host_timing.median_us and eager.n >= 3
    host_timing, eager = eager_timing.time_eager([lambda: x.mul_(1.0)], "cuda", warmup_s=0.0, min_reps=5,
                                                 max_time_s=0.01)
    assert host_timing.n >= 1 and eager.n >= 5 and host_timing.median_us > 0


def test_rotating_inputs_cover_twice_the_l2():
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    assert bench.input_sets_needed(SHAPE, "cuda") * SHAPE.bytes_moved() >= 2 * l2


def test_cuda_config_is_checked_then_timed():
    timing = bench.measure_config(SHAPE, Config(4, 64, 128, "blocks"), backend="cuda", **FAST)
    assert timing.status == "ok", timing.reason
    assert timing.max_abs_err is not None and timing.median_us > 0


def test_breakdown_charges_each_kernel_once():
    kernel_merge = bench.ShapeBench(SHAPE, merge="kernel", **FAST)

    def kernel_rows(shape_bench, config):
        timing = shape_bench.measure(config)
        assert timing.status == "ok", timing.reason
        return {r["kernel"]: r for r in breakdown.config_breakdown(shape_bench, config, timing.median_us)}

    rows = kernel_rows(kernel_merge, Config(8, 64, 128, "blocks"))
    assert {"split_kv_kernel", "combine_kernel", "(gaps)"} == set(rows)
    assert rows["split_kv_kernel"]["launches_per_call"] == rows["combine_kernel"]["launches_per_call"] == 1
    assert 0.9 < sum(r["share"] for r in rows.values()) < 1.1
    assert set(kernel_rows(kernel_merge, Config(1, 64, 128, "blocks"))) == {"split_kv_kernel", "(gaps)"}
    # The last split CTA of each tile merges: one kernel.
    fused = kernel_rows(kernel_merge.with_launch(merge="fused"), Config(8, 64, 128, "blocks"))
    assert set(fused) == {"split_kv_kernel", "(gaps)"}


def test_wrong_output_is_never_timed(monkeypatch):
    original = bench.ShapeBench.launchers
    monkeypatch.setattr(bench.ShapeBench, "launchers",
                        lambda self, c: [(lambda f: (lambda: f() + 1))(f) for f in original(self, c)])
    timing = bench.measure_config(SHAPE, Config(4, 64, 128, "blocks"), backend="cuda", **FAST)
    assert timing.status == "wrong" and timing.n == 0


def test_sweep_on_cuda(tmp_path):
    from splitkv_tune.cli_sweep import sweep
    grid = tmp_path / "g.yaml"
    grid.write_text(yaml.safe_dump({
        "shapes": [{"dtype": "bf16", "head_dim": 128, "q_heads": 32, "kv_heads": 8, "batch": 1,
                    "q_len": 1, "kv_len": 4096}],
        "space": {"num_splits": [1, 4, 16], "block_kv": [64], "reduce_threads": [128]},
        "timing": FAST}))
    result = CliRunner().invoke(sweep, ["--grid", str(grid), "--out", str(tmp_path / "o"),
                                        "--no-progress"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert (tmp_path / "o" / "heuristics.csv").is_file()


def test_compare_with_sdpa_peers():
    results = compare.run_compare([SHAPE], backend="cuda", peers=("sdpa_flash", "sdpa_cudnn"),
                                  timing=FAST, progress=False, with_no_pdl=True)
    assert set(results.impl) == {"ours", "ours_no_pdl", "sdpa_flash", "sdpa_cudnn"}
    assert (results[results.impl.isin(["sdpa_flash", "ours_no_pdl"])].status == "ok").all()
    assert "speedup vs best peer" in compare.markdown_table(results)
