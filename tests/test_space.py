"""Search space constraints and grid-file validation."""
import pytest
import yaml

from splitkv_tune import space, tunables
from splitkv_tune.tunables import Config, Shape


def test_candidates_respect_kv_blocks_and_policy_rules():
    shape = Shape("bf16", 128, 1, 32, 8, 1, 512)
    cands = space.candidate_configs(shape, space.SearchSpace(block_kv=(64, 128)))
    assert all(c.num_splits <= tunables.kv_blocks(shape, c.block_kv) for c in cands)
    assert all(c.split_policy == "blocks" for c in cands
               if not space.policy_matters(shape, c.num_splits, c.block_kv))
    assert len(set(cands)) == len(cands)


def test_causal_shapes_try_both_policies_and_extra_splits_are_added():
    shape = Shape("bf16", 128, 1, 32, 8, 16, 16384, causal=True)
    cands = space.candidate_configs(shape, space.SearchSpace(num_splits=(1, 8), block_kv=(64,),
                                                             reduce_threads=(128,)),
                                    extra_splits=[15])
    assert {c.split_policy for c in cands if c.num_splits == 8} == {"blocks", "length"}
    assert 15 in {c.num_splits for c in cands}


def test_smem_limit_drops_big_blocks():
    shape = Shape("bf16", 128, 1, 8, 8, 2048, 2048)
    cands = space.candidate_configs(shape, smem_limit=140_000)
    assert 128 not in {c.block_kv for c in cands}


def test_candidates_use_the_block_kv_instantiated_at_the_head_dim():
    for d in tunables.HEAD_DIMS:
        shape = Shape("bf16", d, 2, 8, 1, 1, 40000)
        cands = space.candidate_configs(shape, space.SearchSpace(block_kv=tunables.BLOCK_KV))
        assert {c.block_kv for c in cands} == set(tunables.block_kvs_for(d))
        assert space.fa2_config(shape, 132).block_kv in tunables.block_kvs_for(d)


def test_head_dims_grid_loads():
    grid = space.load_grid(str(space.CONFIGS_DIR / "head_dims.yaml"))
    assert {s.head_dim for s in grid.shapes} == {96, 256}
    assert {s.dtype for s in grid.shapes} == {"fp16", "bf16"}
    assert Shape("bf16", 256, 2, 8, 1, 1, 40000) in grid.shapes
    assert set(grid.space.block_kv) == set(tunables.BLOCK_KV)


def test_shipped_grids_load():
    quick = space.load_grid("quick")
    assert len(quick.shapes) >= 18
    assert {s.kv_len for s in quick.shapes} >= {4096, 16384, 65536}
    assert {s.head_dim for s in quick.shapes} == {96, 128, 256}
    assert {Shape(dt, 256, 2, 8, 1, 1, 40000) for dt in ("bf16", "fp16")} <= set(quick.shapes)
    full = space.load_grid("full")
    assert {s.head_dim for s in full.shapes} == {64, 128}
    assert {s.dtype for s in full.shapes} == {"fp16", "bf16"}
    assert {s.q_len for s in full.shapes} >= {1, 4, 16}
    assert {s.group for s in full.shapes} >= {1, 4, 8, 32}
    kv_lens = {s.kv_len for s in full.shapes}
    assert min(kv_lens) == 512 and max(kv_lens) == 131072


@pytest.mark.parametrize("doc, message", [
    ({"shapes": []}, "non-empty list"),
    ({"shapes": [{"dtype": "bf16"}]}, "missing shape field"),
    ({"shapes": [{"dtype": "bf16", "head_dim": 128, "batch": 1, "q_heads": 8, "kv_heads": 8,
                  "q_len": 1, "kv_len": 64, "heads": 3}]}, "unknown shape field"),
    ({"shapes": [{"dtype": "fp8", "head_dim": 128, "batch": 1, "q_heads": 8, "kv_heads": 8,
                  "q_len": 1, "kv_len": 64}]}, "dtype must be one of"),
    ({"shapes": [{"dtype": "bf16", "head_dim": 128, "batch": 1, "q_heads": 8, "kv_heads": 8,
                  "q_len": 1, "kv_len": 64}], "space": {"block_kv": [48]}}, "block_kv: 48"),
    ({"shapes": [{"dtype": "bf16", "head_dim": 128, "batch": 1, "q_heads": 8, "kv_heads": 8,
                  "q_len": 1, "kv_len": 64}], "space": {"num_splits": [0]}}, "num_splits: 0"),
    ({"shapes": [{"dtype": "bf16", "head_dim": 128, "batch": 1, "q_heads": 8, "kv_heads": 8,
                  "q_len": 1, "kv_len": 64}], "bogus": 1}, "unknown key"),
])
def test_bad_grids_are_rejected_with_clear_errors(tmp_path, doc, message):
    path = tmp_path / "g.yaml"
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(space.GridError, match=message):
        space.load_grid(str(path))


def test_missing_grid_file_is_named():
    with pytest.raises(space.GridError, match="nope.yaml"):
        space.load_grid("nope.yaml")


def test_project_maps_infeasible_to_nearest_candidate():
    from splitkv_tune.shape_study import project
    cands = [Config(s, 64, 128, "blocks") for s in (1, 2, 4, 8)]
    assert project(Config(64, 64, 128, "blocks"), cands) == Config(8, 64, 128, "blocks")
    assert project(Config(3, 64, 128, "length"), cands).num_splits in (2, 4)
