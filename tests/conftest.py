"""Shared test set-up: the ``gpu`` marker and fresh, recorded random seeds.

* ``@pytest.mark.gpu`` tests are skipped unless CUDA is available and the extension
  ``splitkv_tune._C`` imports. Set ``SPLITKV_REQUIRE_GPU=1`` to run them anyway, so they
  fail (use it on the GPU box so a broken build cannot pass as "all skipped").
* The ``seed`` fixture draws a fresh seed per test (or takes ``SPLITKV_TEST_SEED``), seeds
  torch with it, and a failing test's report says how to rerun it with that seed.
"""
from __future__ import annotations

import functools
import os
import random
import secrets
from pathlib import Path

import pytest
import torch  # before the extension: it links against libtorch's libraries
import yaml

from splitkv_tune.tunables import Shape

REQUIRE_GPU = os.environ.get("SPLITKV_REQUIRE_GPU", "") not in ("", "0")


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "gpu: needs a CUDA device and the built splitkv_tune._C extension")


@functools.lru_cache(maxsize=None)
def gpu_unavailable_reason() -> str | None:
    """Why ``gpu`` tests cannot run here, or ``None`` when they can."""
    if not torch.cuda.is_available():
        return "CUDA is not available"
    try:
        import splitkv_tune._C  # noqa: F401
    except Exception as exc:  # ImportError, or an undefined symbol from a stale build
        return f"splitkv_tune._C cannot be imported: {exc!r}"
    return None


def pytest_collection_modifyitems(config, items):
    reason = None
    for item in items:
        if item.get_closest_marker("gpu") is None:
            continue
        reason = reason or gpu_unavailable_reason()
        if reason is None:
            return
        if not REQUIRE_GPU:  # else let them run and fail on the missing GPU/extension
            item.add_marker(pytest.mark.skip(reason=reason))


def fresh_seed() -> int:
    """``SPLITKV_TEST_SEED`` when set (to reproduce a failure), else a new random seed."""
    env = os.environ.get("SPLITKV_TEST_SEED")
    return int(env) if env else secrets.randbits(31)


@pytest.fixture
def seed(request) -> int:
    """A fresh seed, applied to torch's global generators and recorded on the test."""
    value = fresh_seed()
    torch.manual_seed(value)  # also seeds every CUDA device
    request.node.user_properties.append(("seed", value))
    request.node._splitkv_seed = value
    return value


@pytest.fixture
def gen(seed) -> torch.Generator:
    """A CPU ``torch.Generator`` seeded with :func:`seed`."""
    return torch.Generator().manual_seed(seed)


@pytest.fixture
def cuda_gen(seed) -> torch.Generator:
    """A CUDA ``torch.Generator`` seeded with :func:`seed` (GPU tests only)."""
    return torch.Generator(device="cuda").manual_seed(seed)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    seed = getattr(item, "_splitkv_seed", None)
    if seed is not None and report.failed:
        report.sections.append(
            ("random seed", f"rerun with SPLITKV_TEST_SEED={seed} pytest '{item.nodeid}'"))


def _random_shapes(n: int, seed: int = 0):
    """Seeded random shapes: near the fixture grid, far from it, decode and prefill."""
    rng = random.Random(seed)
    for _ in range(n):
        hkv = rng.choice([1, 2, 4, 8, 16, 32])
        group = rng.choice([1, 2, 4, 8])
        q_len = rng.choice([1, 1, 1, rng.randint(2, 16), rng.randint(17, 4096)])
        kv_len = max(1, int(2 ** rng.uniform(0, 17)))
        if rng.random() < 0.3:
            kv_len = rng.choice([512, 2048, 8192, 32768, 1024]) + rng.choice([0, 0, 1, -1, 64])
        batch = max(1, int(2 ** rng.uniform(0, 6)))
        yield Shape(rng.choice(["bf16", "fp16"]), rng.choice([64, 128]), batch, hkv * group, hkv,
                    q_len, kv_len, causal=rng.random() < 0.3)


@pytest.fixture
def random_shapes():
    """Seeded random shape generator shared by the selector and export tests."""
    return _random_shapes


@pytest.fixture(scope="module")
def ops():
    """``splitkv_tune.ops``, imported by the GPU tests only, so CPU collection never needs it."""
    from splitkv_tune import ops as module
    return module


TINY_GRID_FILE = Path(__file__).parent / "fixtures" / "tiny_grid.yaml"


@pytest.fixture
def tiny_grid_file(tmp_path):
    """``write(max_time_s=None)``: the tiny sweep grid written under tmp_path, with trials of
    about ``max_time_s`` seconds each (long enough for a kill to land inside one) when given."""
    def write(max_time_s: float | None = None, name: str = "tiny.yaml") -> Path:
        grid = yaml.safe_load(TINY_GRID_FILE.read_text())
        if max_time_s is not None:
            grid["timing"] = {"warmup_s": 0.0, "min_reps": 3, "max_time_s": max_time_s}
        path = tmp_path / name
        path.write_text(yaml.safe_dump(grid))
        return path
    return write


@pytest.fixture(scope="session")
def tiny_grid_trials() -> int:
    """Trials a whole sweep of the tiny grid measures: every candidate of the sweep's plan."""
    from splitkv_tune import space, sweep
    grid = space.load_grid(str(TINY_GRID_FILE))
    plan = sweep.SweepPlan(gpu="cpu_reference", grid=grid, shapes=list(grid.shapes))
    return sum(len(plan.candidates(shape)) for shape in grid.shapes)


@pytest.fixture
def assert_every_point_once(tiny_grid_trials):
    """``check(out)``: ``out/trials.csv`` of a tiny-grid sweep passes the validated reader, every
    candidate was measured exactly once with all its fields, and the trials come back."""
    from splitkv_tune.table_schema import CONFIG_COLUMNS, SHAPE_COLUMNS, read_trials

    def check(out: Path):
        trials = read_trials(out / "trials.csv")
        assert len(trials) == tiny_grid_trials
        assert not trials.duplicated(SHAPE_COLUMNS + CONFIG_COLUMNS).any()
        assert (trials.status == "ok").all() and trials.run_id.notna().all()
        assert trials.p20_us.notna().all() and trials.p80_us.notna().all() and (trials.n >= 3).all()
        return trials
    return check


@pytest.fixture
def assert_clear_error():
    """``check(result, *names)``: a CLI run ended in a clear usage error: exit code 2 from
    ``SystemExit``, no traceback, and every one of ``names`` in its output."""
    def check(result, *names):
        assert result.exit_code == 2, result.output
        assert isinstance(result.exception, SystemExit), result.exception
        assert "Traceback" not in result.output
        for name in names:
            assert name in result.output, result.output
    return check
