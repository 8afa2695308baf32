"""The held-out real-model shapes (configs/models_holdout.yaml, and the second set measured after
the selector's class-size rule, models_holdout_confirm.yaml) stay out of every sweep grid, so
that the selector's regret on them is measured on shapes it was not tuned on."""
from __future__ import annotations

from pathlib import Path

import pytest

from splitkv_tune import tunables
from splitkv_tune.space import candidate_configs, load_grid

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
HOLDOUTS = [CONFIGS / "models_holdout.yaml", CONFIGS / "models_holdout_confirm.yaml"]
# Not shape grids of `sweep`: the held-out sets, the evaluation set, GPU profiles, and the batch
# grids of `sweep-batches` (batches*.yaml).
NOT_SWEPT = ({p.name for p in HOLDOUTS} | {"evaluate.yaml", "gpus.yaml"}
             | {p.name for p in CONFIGS.glob("batches*.yaml")})


@pytest.mark.parametrize("path", HOLDOUTS, ids=lambda p: p.stem)
def test_holdout_is_large_enough_and_runs_on_the_kernel(path):
    grid = load_grid(str(path))
    decode = [s for s in grid.shapes if s.q_len == 1]
    spec = [s for s in grid.shapes if s.q_len > 1]
    assert len(grid.shapes) >= 30 and len(decode) >= 25 and len(spec) >= 3
    assert {s.head_dim for s in grid.shapes} == set(tunables.HEAD_DIMS)
    assert {s.q_heads // s.kv_heads for s in grid.shapes} >= {1, 4, 8}
    for shape in grid.shapes:
        shape.validate()
        assert candidate_configs(shape, grid.space), shape


@pytest.mark.parametrize("path", HOLDOUTS, ids=lambda p: p.stem)
def test_holdout_shapes_are_in_no_sweep_grid(path):
    held = set(load_grid(str(path)).shapes)
    grids = sorted(p for p in CONFIGS.glob("*.yaml") if p.name not in NOT_SWEPT)
    assert {p.stem for p in grids} >= {"quick", "full", "head_dims"}
    for grid in grids:
        swept = set(load_grid(str(grid)).shapes)
        assert not held & swept, f"{grid.name} sweeps held-out shapes: {sorted(held & swept)}"


def test_the_confirming_set_shares_no_shape_with_the_first():
    first, second = (set(load_grid(str(p)).shapes) for p in HOLDOUTS)
    assert not first & second
