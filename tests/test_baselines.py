"""The other projects' split rules applied to our kernel: always runnable, and their own
arithmetic on shapes worked out by hand from the rules' public code."""
import pytest

from splitkv_tune import baselines
from splitkv_tune.tunables import Shape, ceil_div


@pytest.mark.parametrize("rule", [baselines.fa3_config, baselines.sglang_config])
def test_baselines_are_runnable_configs(rule, random_shapes):
    for shape in random_shapes(400, seed=2):
        cfg = rule(shape, 132).validate()
        assert 1 <= cfg.num_splits <= ceil_div(shape.kv_len, cfg.block_kv)


def test_fa3_varlen_lowers_the_static_count():
    # B=1, Hkv=8, G=4, D=128: tile 64 x 176, 94 KV blocks; static 15 (first S with 8S/132 >=
    # 0.85), varlen: blocks_per_sm = ceil(94 * 1.1 * 8 / 132) = 7 -> ceil(94 / 7) = 14.
    shape = Shape("bf16", 128, 1, 32, 8, 1, 16384)
    assert baselines.fa3_static_splits(8, 132, 94, 1, 16384 * 512, False) == 15
    assert baselines.fa3_config(shape, 132).num_splits == 14
    # A KV head larger than the assumed 50 MiB L2, with enough query tiles, splits even
    # when the tiles fill the GPU; causal never does.
    big = 64 * 2**20
    assert baselines.fa3_static_splits(300, 132, 1000, 300, big, False) == 2
    assert baselines.fa3_static_splits(300, 132, 1000, 300, big, True) == 1
    assert baselines.fa3_static_splits(10, 132, 4, 1, 1, False) == 1  # too few KV blocks


def test_sglang_budget_grows_with_kv_len_and_caps_at_8():
    # G=4: programs = B * ceil(Hq / 4); budget = int(132 * log2(Sk / 64)).
    splits = [baselines.sglang_config(Shape("bf16", 128, 16, 32, 8, 1, sk), 132).num_splits
              for sk in (128, 1024, 8192, 65536)]
    # 128 programs: ceil(132 / 128) = 2, capped to our one 128-key block; ceil(528 / 128) = 5;
    # ceil(1320 / 128) = 11 and more, capped to SGLang's 8.
    assert splits == [1, 5, 8, 8]
    assert baselines.sglang_config(Shape("bf16", 128, 1, 8, 8, 1, 4096), 132).num_splits == 8
