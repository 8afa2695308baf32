"""The knob points of compare-batch's plan rows (``--plan``, ``--plan-space``, a sweep grid's
``space``): each point as the tuple the runs take, as the call's keywords, as a row name, and
spaces of them checked and expanded."""
from __future__ import annotations

import itertools

from splitkv_tune import plan, tunables

# block_kv of a plan row that names none.
PLAN_BLOCK_KV = 64


def plan_point(min_blocks: int, max_splits: int, block_kv: int = PLAN_BLOCK_KV, merge: str = "auto",
               split_plan: str = "fixed") -> tuple:
    """A plan row's knobs as the tuple ``plans`` take: ``(min_blocks_per_split, max_splits,
    block_kv)``, then the merge when it is not ``"auto"`` or the split plan is not ``"fixed"``,
    then the split plan when it is not ``"fixed"``.

    >>> plan_point(4, 32), plan_point(4, 32, 64, "kernel"), plan_point(4, 32, 64, "auto", "load_aware")
    ((4, 32, 64), (4, 32, 64, 'kernel'), (4, 32, 64, 'auto', 'load_aware'))
    """
    if split_plan != "fixed":
        return min_blocks, max_splits, block_kv, merge, split_plan
    return (min_blocks, max_splits, block_kv) if merge == "auto" else (min_blocks, max_splits, block_kv, merge)


def plan_knobs(point: tuple) -> dict:
    """A ``plan_point`` (or a shorter ``--plan`` tuple) as the call's keywords.

    >>> plan_knobs((4, 32))
    {'block_kv': 64, 'min_blocks_per_split': 4, 'max_splits': 32, 'merge': 'auto', 'split_plan': 'fixed'}
    >>> plan_knobs((4, 32, 128, "kernel"))["split_plan"], plan_knobs((4, 32, 64, "auto", "load_aware"))["merge"]
    ('fixed', 'auto')
    """
    min_blocks, max_splits, block_kv, *rest = plan_point(*point)
    merge = rest[0] if rest else "auto"
    split_plan = rest[1] if len(rest) > 1 else "fixed"
    return dict(block_kv=block_kv, min_blocks_per_split=min_blocks, max_splits=max_splits, merge=merge,
                split_plan=split_plan)


def plan_row_name(min_blocks: int, max_splits: int, block_kv: int = PLAN_BLOCK_KV, merge: str = "auto",
                  split_plan: str = "fixed") -> str:
    """The ``impl`` of a plan row: ``ours_m<min>_s<max>``, ``ours_kv<block_kv>_m<min>_s<max>``
    at a block_kv other than ``PLAN_BLOCK_KV``, then ``_fused`` or ``_kernel`` for a merge
    other than ``"auto"``, then ``_load_aware`` for that split plan."""
    prefix = "ours" if block_kv == PLAN_BLOCK_KV else f"ours_kv{block_kv}"
    return (f"{prefix}_m{min_blocks}_s{max_splits}" + ("" if merge == "auto" else f"_{merge}")
            + ("" if split_plan == "fixed" else f"_{split_plan}"))


def check_plan_space(block_kvs, min_blocks, max_splits, merges=("auto",), split_plans=("fixed",)) -> None:
    """``ValueError`` naming the knob of the first value in these lists that the paged call
    refuses (``plan.check_plan_knobs``, ``tunables.check_merge``, ``plan.check_split_plan``)."""
    for block_kv in block_kvs:
        plan.check_plan_knobs(block_kv, 1, 1)
    for value in min_blocks:
        plan.check_plan_knobs(PLAN_BLOCK_KV, value, 1)
    for value in max_splits:
        plan.check_plan_knobs(PLAN_BLOCK_KV, 1, value)
    for merge in merges:
        tunables.check_merge(merge)
    for split_plan in split_plans:
        plan.check_split_plan(split_plan)


def expand_plan_space(block_kvs, min_blocks, max_splits, head_dim: int, plans=(),
                      merges=("auto",), split_plans=("fixed",)) -> tuple[list[tuple], list[int]]:
    """Every ``plan_point`` of the product, block_kv outermost and the split plan innermost, less
    those already in ``plans`` (``--plan`` tuples; one without block_kv is at ``PLAN_BLOCK_KV``),
    and the block_kvs dropped as not instantiated at ``head_dim``
    (``tunables.BLOCK_KV_BY_HEAD_DIM``): ``(plans to add, dropped block_kvs)``.

    >>> expand_plan_space([64, 128], [1, 2], [8], 256, plans=[(2, 8)])
    ([(1, 8, 64)], [128])
    >>> expand_plan_space([64], [1], [8], 128, merges=["fused", "kernel"])
    ([(1, 8, 64, 'fused'), (1, 8, 64, 'kernel')], [])
    >>> expand_plan_space([64], [1], [8], 128, split_plans=["fixed", "load_aware"])
    ([(1, 8, 64), (1, 8, 64, 'auto', 'load_aware')], [])
    """
    allowed = tunables.BLOCK_KV_BY_HEAD_DIM[head_dim]
    taken = {plan_point(*p) for p in plans}
    added = []
    for block_kv in dict.fromkeys(block_kvs):
        if block_kv not in allowed:
            continue
        for min_b, max_s, merge, split_plan in itertools.product(
                dict.fromkeys(min_blocks), dict.fromkeys(max_splits), dict.fromkeys(merges),
                dict.fromkeys(split_plans)):
            point = plan_point(min_b, max_s, block_kv, merge, split_plan)
            if point not in taken:
                taken.add(point)
                added.append(point)
    return added, [b for b in dict.fromkeys(block_kvs) if b not in allowed]
