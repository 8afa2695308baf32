"""The search space of a sweep: which shapes to measure and which configs to try on each.

A grid file (``configs/quick.yaml``, ``configs/full.yaml`` or any path) looks like::

    name: quick
    shapes:                      # each entry expands to the Cartesian product of its lists
      - {dtype: bf16, head_dim: 128, q_heads: 32, kv_heads: [8, 32],
         batch: [1, 4, 16], q_len: 1, kv_len: [4096, 16384, 65536]}
      - {dtype: bf16, head_dim: 128, q_heads: 32, kv_heads: 8, batch: 1,
         q_len: 16, kv_len: 16384, causal: true}
    space:                       # candidate tunables (each optional; defaults below)
      num_splits: [1, 2, 4, 8, 16, 32, 64, 128]
      block_kv: [64, 128]
      reduce_threads: [128]
      split_policy: [blocks, length]
    timing: {warmup_s: 0.02, min_reps: 20, max_time_s: 0.1}
    limits: {max_kv_bytes: 17179869184}   # shapes whose K+V exceed this are left out

Per shape, the candidates are the product of the space lists with these constraints:

* ``num_splits <= ceil(kv_len / block_kv)`` (more splits than KV blocks only adds empty
  splits); FlashAttention-2's ``S`` and any extra ``S`` (the current table winner) are
  always added to the list when they satisfy that bound.
* ``block_kv`` is instantiated at the shape's head dim (``tunables.block_kvs_for``: 32 and 64
  at D=256), and the split kernel's shared memory fits the GPU (``tunables.smem_bytes``) when
  a GPU profile is known.
* ``split_policy`` is only varied where it changes the split ranges (causal shapes, or
  ``kv_len`` not a whole number of blocks per split); elsewhere only ``blocks`` is tried.
"""
from __future__ import annotations

import dataclasses
import fnmatch
import itertools
import math
from pathlib import Path
from typing import Any, Iterable

import yaml

from splitkv_tune import tunables
from splitkv_tune.paths import data_dir
from splitkv_tune.tunables import Config, Shape

CONFIGS_DIR = data_dir("configs")
NAMED_GRIDS = ("quick", "full")
SHAPE_FIELDS = ("dtype", "head_dim", "batch", "q_heads", "kv_heads", "q_len", "kv_len", "causal")
REQUIRED_SHAPE_FIELDS = SHAPE_FIELDS[:-1]
TIMING_DEFAULTS = {"warmup_s": 0.05, "min_reps": 20, "max_time_s": 0.2}
TOP_LEVEL_KEYS = {"name", "description", "shapes", "space", "timing", "limits"}


class GridError(ValueError):
    """A grid file that cannot be used; the message names the file and the bad entry."""


@dataclasses.dataclass(frozen=True)
class SearchSpace:
    num_splits: tuple[int, ...] = tunables.SPLIT_COUNTS
    block_kv: tuple[int, ...] = tunables.BLOCK_KV
    reduce_threads: tuple[int, ...] = tunables.REDUCE_THREADS
    split_policy: tuple[str, ...] = tunables.SPLIT_POLICIES


@dataclasses.dataclass(frozen=True)
class Grid:
    name: str
    shapes: tuple[Shape, ...]
    space: SearchSpace
    timing: dict
    source: str


def shape_key(shape: Shape) -> str:
    """Stable, readable identifier of a shape (used in study names and ``--shapes`` filters).

    >>> shape_key(Shape("bf16", 128, 1, 32, 8, 1, 4096))
    'bf16_d128_nc_b1_hq32_hkv8_sq1_sk4096'
    """
    causal = "c" if shape.causal else "nc"
    return (f"{shape.dtype}_d{shape.head_dim}_{causal}_b{shape.batch}_hq{shape.q_heads}"
            f"_hkv{shape.kv_heads}_sq{shape.q_len}_sk{shape.kv_len}")


def config_key(config: Config) -> str:
    """Identifier of a config, e.g. ``S16_kv64_rt128_blocks``.

    >>> config_key(Config(16, 64, 128, "blocks"))
    'S16_kv64_rt128_blocks'
    """
    return (f"S{config.num_splits}_kv{config.block_kv}_rt{config.reduce_threads}"
            f"_{config.split_policy}")


def fa2_config(shape: Shape, num_sms: int) -> Config:
    """FlashAttention-2's choice for ``shape``: its split count (blocks counted with its own
    KV block, 256 keys for D=64, 128 up to D=128, 64 above), launched with ``block_kv=128``,
    or the largest block instantiated at the head dim (64 at D=256).

    >>> fa2_config(Shape("bf16", 256, 2, 8, 1, 1, 40000), 132).block_kv
    64
    """
    splits = tunables.fa2_num_splits(shape, num_sms)
    block_kv = min(128, max(tunables.block_kvs_for(shape.head_dim)))
    return Config(num_splits=splits, block_kv=block_kv, reduce_threads=128, split_policy="blocks")


def policy_matters(shape: Shape, num_splits: int, block_kv: int) -> bool:
    """Whether ``length`` and ``blocks`` give different split ranges for this launch.

    >>> policy_matters(Shape("bf16", 128, 1, 8, 8, 1, 4096), 4, 64)
    False
    >>> policy_matters(Shape("bf16", 128, 1, 8, 8, 1, 4096), 3, 64)
    True
    """
    if num_splits == 1:
        return False
    if shape.causal:
        return True
    ends = [tunables.split_range(i, num_splits, shape.kv_len, shape.kv_len, block_kv, p)
            for p in ("length", "blocks") for i in range(num_splits)]
    return ends[:num_splits] != ends[num_splits:]


def candidate_configs(shape: Shape, space: SearchSpace = SearchSpace(), *,
                      smem_limit: int | None = None,
                      extra_splits: Iterable[int] = ()) -> list[Config]:
    """Valid configs for ``shape``, ordered by ``num_splits`` then the other tunables.

    >>> cands = candidate_configs(Shape("bf16", 128, 1, 32, 8, 1, 256),
    ...                           SearchSpace(block_kv=(64, 128), reduce_threads=(128,)))
    >>> sorted({c.num_splits for c in cands}), len(cands)
    ([1, 2, 3, 4], 7)
    >>> sorted({c.block_kv for c in candidate_configs(Shape("bf16", 256, 1, 8, 1, 1, 4096))})
    [32, 64]
    """
    splits = sorted(set(space.num_splits) | {int(s) for s in extra_splits})
    block_m = tunables.block_m_for(shape.packed_rows)
    out = []
    for block_kv in sorted(space.block_kv):
        if block_kv not in tunables.block_kvs_for(shape.head_dim):
            continue
        if smem_limit is not None and tunables.smem_bytes(shape.head_dim, block_kv,
                                                          block_m) > smem_limit:
            continue
        max_s = min(tunables.MAX_SPLITS, tunables.kv_blocks(shape, block_kv))
        for s in (s for s in splits if 1 <= s <= max_s):
            policies = [p for p in space.split_policy if policy_matters(shape, s, block_kv)]
            if not policies:
                policies = ["blocks" if "blocks" in space.split_policy
                            else space.split_policy[0]]
            for rt in sorted(space.reduce_threads):
                for policy in policies:
                    out.append(Config(s, block_kv, rt, policy))
    return sorted(set(out), key=lambda c: (c.num_splits, c.block_kv, c.reduce_threads,
                                           c.split_policy))


def resolve_grid_path(grid: str) -> Path:
    """``quick``/``full`` name a shipped grid; anything else is a path."""
    if grid in NAMED_GRIDS:
        return CONFIGS_DIR / f"{grid}.yaml"
    path = Path(grid)
    if not path.is_file():
        raise GridError(f"grid {grid!r} is neither one of {NAMED_GRIDS} nor an existing file")
    return path


def _as_list(value: Any) -> list:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _expand_shape_entry(entry: Any, where: str) -> list[Shape]:
    if not isinstance(entry, dict):
        raise GridError(f"{where}: expected a mapping of shape fields, got {entry!r}")
    unknown = set(entry) - set(SHAPE_FIELDS)
    if unknown:
        raise GridError(f"{where}: unknown shape field(s) {sorted(unknown)}; "
                        f"allowed: {list(SHAPE_FIELDS)}")
    missing = [f for f in REQUIRED_SHAPE_FIELDS if f not in entry]
    if missing:
        raise GridError(f"{where}: missing shape field(s) {missing}")
    fields = {f: _as_list(entry.get(f, False)) for f in SHAPE_FIELDS}
    shapes = []
    for values in itertools.product(*(fields[f] for f in SHAPE_FIELDS)):
        kwargs = dict(zip(SHAPE_FIELDS, values))
        if not isinstance(kwargs["causal"], bool):
            raise GridError(f"{where}: causal must be true or false, got {kwargs['causal']!r}")
        try:
            shapes.append(Shape(**kwargs).validate())
        except (ValueError, TypeError) as err:
            raise GridError(f"{where}: {err}") from None
    return shapes


def _parse_space(raw: Any, where: str) -> SearchSpace:
    if raw is None:
        return SearchSpace()
    if not isinstance(raw, dict):
        raise GridError(f"{where}: expected a mapping, got {raw!r}")
    allowed = {"num_splits": None, "block_kv": tunables.BLOCK_KV,
               "reduce_threads": tunables.REDUCE_THREADS,
               "split_policy": tunables.SPLIT_POLICIES}
    unknown = set(raw) - set(allowed)
    if unknown:
        raise GridError(f"{where}: unknown tunable(s) {sorted(unknown)}; allowed: {list(allowed)}")
    values = {}
    for name, legal in allowed.items():
        if name not in raw:
            continue
        items = _as_list(raw[name])
        if not items:
            raise GridError(f"{where}.{name}: empty list")
        for item in items:
            if name == "num_splits":
                ok = isinstance(item, int) and not isinstance(item, bool) \
                    and 1 <= item <= tunables.MAX_SPLITS
                if not ok:
                    raise GridError(f"{where}.num_splits: {item!r} is not an integer in "
                                    f"[1, {tunables.MAX_SPLITS}]")
            elif item not in legal:
                raise GridError(f"{where}.{name}: {item!r} is not one of {legal}")
        values[name] = tuple(dict.fromkeys(items))
    return SearchSpace(**values)


def _parse_timing(raw: Any, where: str) -> dict:
    timing = dict(TIMING_DEFAULTS)
    if raw is None:
        return timing
    if not isinstance(raw, dict) or set(raw) - set(TIMING_DEFAULTS):
        raise GridError(f"{where}: expected a mapping with keys {list(TIMING_DEFAULTS)}, "
                        f"got {raw!r}")
    for key, value in raw.items():
        problem = timing_problem(key, value)
        if problem:
            raise GridError(f"{where}.{key}: {problem}")
        timing[key] = type(TIMING_DEFAULTS[key])(value)
    return timing


def timing_problem(key: str, value) -> str | None:
    """Why ``value`` cannot be the timing setting ``key``, else ``None``: seconds are finite
    and non-negative (NaN would never end a loop), and at least one sample is taken.

    >>> timing_problem("warmup_s", float("nan")), timing_problem("min_reps", 0)
    ('expected a finite number >= 0, got nan', 'expected an integer >= 1, got 0')
    """
    if key == "min_reps":
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            return f"expected an integer >= 1, got {value!r}"
        return None
    if not isinstance(value, (int, float)) or isinstance(value, bool) \
            or not math.isfinite(value) or value < 0:
        return f"expected a finite number >= 0, got {value!r}"
    return None


def parse_grid(raw: Any, source: str = "<grid>") -> Grid:
    """Validate a loaded grid document and expand its shapes (duplicates dropped, order kept)."""
    if not isinstance(raw, dict):
        raise GridError(f"{source}: expected a mapping at the top level")
    unknown = set(raw) - TOP_LEVEL_KEYS
    if unknown:
        raise GridError(f"{source}: unknown key(s) {sorted(unknown)}; "
                        f"allowed: {sorted(TOP_LEVEL_KEYS)}")
    entries = raw.get("shapes")
    if not isinstance(entries, list) or not entries:
        raise GridError(f"{source}: 'shapes' must be a non-empty list")
    limits = raw.get("limits") or {}
    if not isinstance(limits, dict) or set(limits) - {"max_kv_bytes"}:
        raise GridError(f"{source}: 'limits' may only hold max_kv_bytes, got {limits!r}")
    max_kv_bytes = limits.get("max_kv_bytes")
    shapes: dict[Shape, None] = {}
    for i, entry in enumerate(entries):
        for shape in _expand_shape_entry(entry, f"{source}: shapes[{i}]"):
            kv_bytes = 2 * shape.batch * shape.kv_heads * shape.kv_len * shape.head_dim * 2
            if max_kv_bytes is None or kv_bytes <= max_kv_bytes:
                shapes[shape] = None
    return Grid(name=str(raw.get("name", Path(source).stem)), shapes=tuple(shapes),
                space=_parse_space(raw.get("space"), f"{source}: space"),
                timing=_parse_timing(raw.get("timing"), f"{source}: timing"), source=source)


def load_grid(grid: str) -> Grid:
    """Load ``quick``, ``full`` or a YAML path; raise ``GridError`` with a clear message."""
    path = resolve_grid_path(grid)
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise GridError(f"{path}: not valid YAML: {err}") from None
    return parse_grid(raw, str(path))


def filter_shapes(shapes: Iterable[Shape], *, dtypes: Iterable[str] = (),
                  head_dims: Iterable[int] = (), patterns: Iterable[str] = ()) -> list[Shape]:
    """Shapes matching every given filter; ``patterns`` are globs on ``shape_key``.

    >>> s = [Shape("bf16", 128, 1, 8, 8, 1, 512), Shape("fp16", 64, 1, 8, 8, 1, 512)]
    >>> [shape_key(x) for x in filter_shapes(s, dtypes=["fp16"])]
    ['fp16_d64_nc_b1_hq8_hkv8_sq1_sk512']
    >>> len(filter_shapes(s, patterns=["*_d128_*"]))
    1
    """
    dtypes, head_dims, patterns = set(dtypes), set(head_dims), list(patterns)
    return [s for s in shapes
            if (not dtypes or s.dtype in dtypes)
            and (not head_dims or s.head_dim in head_dims)
            and (not patterns or any(fnmatch.fnmatch(shape_key(s), p) for p in patterns))]
