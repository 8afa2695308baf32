"""The run-time lookup behind num_splits="auto": the selector's answer, precomputed per shape
class, cheap on any Sk, and importing none of the tools' dependencies."""
import dataclasses
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

from splitkv_tune import analytic, gpus, lookup, selector
from splitkv_tune.table_schema import TableError, read_heuristics, read_heuristics_records
from splitkv_tune.tunables import Shape

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"
TOOL_MODULES = ("pandas", "optuna", "matplotlib", "yaml")


def test_runtime_path_imports_no_tool_dependencies():
    code = (
        "import sys, splitkv_tune, splitkv_tune.selector as s\n"
        "from splitkv_tune.tunables import Shape\n"
        "for sk in (4096, 5000, 123457):\n"
        "    s.auto_config(Shape('bf16', 128, 2, 32, 8, 1, sk), 'NVIDIA H200', 132)\n"
        "    s.auto_config(Shape('fp16', 64, 2, 32, 8, 1, sk), 'NVIDIA H100 80GB HBM3', 132)\n"
        "    s.auto_config(Shape('bf16', 64, 1, 8, 8, 1, sk), 'Some GPU', 40)\n"
        "import splitkv_tune.ops\n"
        f"print(sorted(m for m in {TOOL_MODULES!r} if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


@pytest.mark.parametrize("device,sms", [("NVIDIA H200", 132), ("NVIDIA H200", 78),
                                        ("NVIDIA L40S", 142), ("Some GPU 9000", 20)])
def test_auto_config_is_the_selector_rule(device, sms, random_shapes):
    """Every kv_len of a class, hits, bucket edges and capped small Sk included."""
    table = selector.load_table_for_gpu(device)
    rng = random.Random(sms)
    for shape in random_shapes(15, seed=sms):
        kv_lens = [rng.randint(1, 2**18) for _ in range(25)] + [1, 2, 3, 63, 64, 65, 4096,
                                                                 4141, 16384, 65536, 2**31 - 1]
        for kv_len in kv_lens:
            s = dataclasses.replace(shape, kv_len=kv_len)
            if s.batch * s.kv_heads * kv_len > 2**40:
                continue
            want = selector.select_shape(table, s, device, sms=sms).config
            assert selector.auto_config(s, device, sms) == want, s


def test_auto_config_reads_the_env_table(tmp_path, monkeypatch):
    (tmp_path / "nvidia_h200").mkdir()
    read_heuristics(FIXTURES / "heuristics.csv").assign(num_splits=3).to_csv(
        tmp_path / "nvidia_h200" / "heuristics.csv", index=False)
    monkeypatch.setenv(selector.TABLES_ENV, str(tmp_path))
    selector.clear_lookup_caches()  # classes built earlier keep the table they found
    try:
        table = selector.load_table_for_gpu("h200")
        for kv_len in range(3000, 3100):
            s = Shape("bf16", 128, 1, 32, 8, 1, kv_len)
            assert selector.auto_config(s, "NVIDIA H200", 132) == \
                selector.select_shape(table, s, "NVIDIA H200", sms=132).config
    finally:
        selector.clear_lookup_caches()


def test_auto_config_cost_does_not_depend_on_seen_kv_len():
    """Regression guard (the measurement is in the README): a decode loop's growing Sk."""
    for device, dtype in (("NVIDIA H200", "bf16"), ("NVIDIA H100 80GB HBM3", "fp16")):
        selector.auto_config(Shape(dtype, 128, 2, 32, 8, 1, 1000), device, 132)
        shapes = [Shape(dtype, 128, 2, 32, 8, 1, 1001 + i) for i in range(2000)]
        t0 = time.process_time()
        for s in shapes:
            selector.auto_config(s, device, 132)
        assert (time.process_time() - t0) / len(shapes) < 50e-6


def test_auto_config_rejects_out_of_range_kv_len():
    with pytest.raises(ValueError, match="kv_len"):
        selector.auto_config(Shape("bf16", 128, 2**20, 32, 8, 1, 2**21), "NVIDIA H200", 132)
    with pytest.raises(ValueError, match="kv_len"):
        selector.auto_config(Shape("bf16", 128, 1, 32, 8, 1, 0), "NVIDIA H200", 132)


def test_bucket_starts_are_the_first_kv_len_of_each_bucket():
    starts, coords = lookup.bucket_starts()
    assert starts[0] == 1 and list(starts) == sorted(set(starts))
    rng = random.Random(7)
    for kv_len in [rng.randint(1, 2**31 - 1) for _ in range(3000)] + list(range(1, 300)):
        i = lookup.bisect.bisect_right(starts, kv_len) - 1
        assert coords[i] == selector.sk_coord(kv_len)
        assert starts[i] == selector.sk_bucket_start(kv_len)
        assert starts[i] == 1 or selector.sk_coord(starts[i] - 1) < coords[i]


@pytest.mark.parametrize("gpu", ["h200", "l40s", "a100"])
def test_vectorised_analytic_model_matches_the_scalar_one(gpu, random_shapes):
    profile = gpus.profile_for(gpu)
    rng = random.Random(3)
    for shape in random_shapes(12, seed=5):
        kv_lens = [rng.randint(1, 2**20) for _ in range(40)] + [1, 31, 32, 33, 4096]
        splits, blocks = analytic.analytic_configs(shape, kv_lens, profile)
        for kv_len, s, b in zip(kv_lens, splits.tolist(), blocks.tolist()):
            cfg = analytic.analytic_config(dataclasses.replace(shape, kv_len=kv_len), profile)
            assert (cfg.num_splits, cfg.block_kv) == (s, b)


@pytest.mark.parametrize("value", [101, -1, 8.5, "85", True])
def test_a_profile_with_a_bad_sm_balance_pct_is_refused(tmp_path, value):
    path = tmp_path / "gpus.yaml"
    entry = {**gpus.read_profiles_yaml(gpus.PROFILES_PATH)["nvidia_h200"], "sm_balance_pct": value}
    import yaml
    path.write_text(yaml.safe_dump({"nvidia_h200": entry}))
    with pytest.raises(ValueError, match=r"nvidia_h200: sm_balance_pct must be an integer in \[0, 100\]"):
        gpus.load_profiles(path)


def test_generated_gpu_profiles_match_the_yaml():
    assert gpus.GENERATED_PATH.read_text() == gpus.render_profiles_module(), \
        "configs/gpus.yaml changed: run `python -m splitkv_tune.gpus`"
    assert gpus._raw_profiles(gpus.PROFILES_PATH) == gpus.read_profiles_yaml(gpus.PROFILES_PATH)


@pytest.mark.parametrize("path", [FIXTURES / "heuristics.csv",
                                  ROOT / "results" / "nvidia_h200" / "heuristics.csv"])
def test_plain_reader_matches_the_pandas_reader(path):
    want = read_heuristics(path).to_dict("records")
    got = read_heuristics_records(path)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert {k: g[k] for k in w} == {k: (None if v != v else v) for k, v in w.items()}


def test_plain_reader_gives_the_pandas_readers_errors(tmp_path):
    good = (FIXTURES / "heuristics.csv").read_text().splitlines()
    cases = {"bad_int": [good[0], good[1].replace(",blocks,", ",sideways,", 1)],
             "dup": [good[0], good[1], good[1]], "empty": [good[0]],
             "missing": [good[0].replace("num_splits", "splits"), good[1]]}
    for name, lines in cases.items():
        path = tmp_path / f"{name}.csv"
        path.write_text("\n".join(lines) + "\n")
        with pytest.raises(TableError) as pandas_err:
            read_heuristics(path)
        with pytest.raises(TableError) as plain_err:
            read_heuristics_records(path)
        assert str(plain_err.value) == str(pandas_err.value)


@pytest.mark.parametrize("device,sms", [("NVIDIA H200", 132), ("Some GPU 9000", 20)])
def test_the_default_calls_plan_resolves_every_kv_len_as_resolve_config(device, sms, random_shapes, monkeypatch):
    """The eager call's plan with every tunable "auto" answers a new KV length from the class's
    lookup; its launch arguments are those of the full resolution (table hits, bucket edges
    and the capped small Sk included)."""
    from splitkv_tune import ops
    monkeypatch.setattr(ops, "_device_info", lambda index: (device, sms))
    rng = random.Random(sms)
    for shape in random_shapes(10, seed=sms):
        plan = ops._Plan(shape, 0, None, "auto", True, dict.fromkeys(ops._TUNABLES, "auto"))
        assert plan.lookup is not None and plan.fixed is None
        kv_lens = [rng.randint(1, 2**17) for _ in range(25)] + [1, 2, 63, 64, 65, 4096, 4141, 16384]
        for kv_len in kv_lens + kv_lens:  # the second pass reads what the first one kept
            s = dataclasses.replace(shape, kv_len=kv_len)
            assert plan.launch_args(kv_len) == plan._resolve(s), s
