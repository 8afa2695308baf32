"""Warm starts of a sweep: a shape's study first measures the configs that ran fastest on the
same problem in earlier sweeps, at another dtype or head dim.

The problem is the shape less its dtype and head dim: (causal, batch, q_heads, kv_heads, q_len,
kv_len). fp16 and bf16 move the same bytes through the same tiles, so one dtype's ranking is a
good first guess for the other; another head dim's is a rougher one. For each shape, the trials
of the nearest source are used (same head dim first, then same dtype), their ``top`` fastest
distinct ok configs in order, projected onto the shape's candidates by the sweep. The sampler
then goes on as without a warm start; the warm configs count towards ``--trials``.

With ``select="spread"`` the warm configs are instead those of the source whose programmatic
launch this GPU now spreads over its SMs (rules.h ``spread_ctas_per_sm``), fastest first, and
each study measures them alone: a sweep under a second study prefix then times again what an
earlier sweep timed without the spread (back to back, those configs ran up to 1.33x slow), and
its trials pool with the first's.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

from splitkv_tune.table_schema import read_trials
from splitkv_tune.tunables import Config, Shape

PROBLEM_COLUMNS = ("causal", "batch", "q_heads", "kv_heads", "q_len", "kv_len")
SELECTIONS = ("fastest", "spread")


def problem_key(shape) -> tuple:
    """The shape (a :class:`Shape` or a trials row) less its dtype and head dim."""
    return tuple(int(getattr(shape, c)) for c in PROBLEM_COLUMNS)


@dataclasses.dataclass(frozen=True)
class WarmStart:
    """Configs per problem and per (dtype, head_dim) of the trials, fastest first."""

    configs: dict  # problem key -> {(dtype, head_dim): [Config, ...]}
    top: int
    # A re-time: the configs it picks, which each study then measures alone (no sampler after
    # them); None: every config, the sampler going on after them.
    retime: Callable[[Shape, Config], bool] | None = None

    def for_shape(self, shape: Shape, project: Callable[[Config], Config] | None = None) -> list[Config]:
        """Up to ``top`` configs for ``shape``: those of the nearest (dtype, head_dim) that has any,
        each mapped by ``project`` (onto the shape's candidates) before ``retime`` sees it, once each.

        >>> ws = WarmStart({(0, 1, 32, 8, 1, 4096): {("bf16", 128): [Config(16, 64, 128, "blocks")],
        ...                                          ("bf16", 64): [Config(8, 128, 128, "blocks")]}}, top=4)
        >>> ws.for_shape(Shape("fp16", 128, 1, 32, 8, 1, 4096))
        [Config(num_splits=16, block_kv=64, reduce_threads=128, split_policy='blocks')]
        >>> ws.for_shape(Shape("fp16", 128, 2, 32, 8, 1, 4096))
        []
        """
        found = self.configs.get(problem_key(shape), {})
        if not found:
            return []
        nearest = min(found, key=lambda k: (k[1] != shape.head_dim, k[0] != shape.dtype, abs(k[1] - shape.head_dim), k))
        configs = list(dict.fromkeys(map(project, found[nearest]))) if project else found[nearest]
        if self.retime is not None:
            configs = [c for c in configs if self.retime(shape, c)]
        return configs[:self.top]


def spread_on_this_gpu(shape: Shape, config: Config) -> bool:
    """Whether the current GPU spreads the programmatic split launch of ``config`` on ``shape``
    over its SMs (``_C.equal_launch_residency``: rules.h ``spread_ctas_per_sm``)."""
    import torch

    from splitkv_tune import _C, tunables

    ctas = tunables.num_m_blocks(shape) * shape.batch * shape.kv_heads * config.num_splits
    try:
        per_sm, _, _ = _C.equal_launch_residency(torch.cuda.current_device(), tunables.dtype_codes()[shape.dtype],
                                                 shape.head_dim, tunables.block_m_for(shape.packed_rows),
                                                 config.block_kv, ctas, True)
    except ValueError:  # not instantiated: no launch to spread
        return False
    return per_sm > 0


def load(paths, top: int, select: str = "fastest") -> WarmStart:
    """Read trials files (validated as every ``trials.csv``) into a :class:`WarmStart` of the
    ``top`` fastest configs (``select="fastest"``) or of those the current GPU spreads
    (``"spread"``, :func:`spread_on_this_gpu`).

    A config timed more than once (several runs) counts at its fastest median."""
    if top < 1:
        raise ValueError(f"top must be >= 1, got {top}")
    if select not in SELECTIONS:
        raise ValueError(f"select must be one of {SELECTIONS}, got {select!r}")
    best: dict = {}
    for path in paths:
        frame = read_trials(path)
        frame = frame[frame["status"] == "ok"]
        for row in frame.itertuples(index=False):
            group = (str(row.dtype), int(row.head_dim))
            config = Config(int(row.num_splits), int(row.block_kv), int(row.reduce_threads), str(row.split_policy))
            times = best.setdefault(problem_key(row), {}).setdefault(group, {})
            times[config] = min(float(row.median_us), times.get(config, float("inf")))
    configs = {key: {group: sorted(times, key=lambda c: (times[c], dataclasses.astuple(c)))
                     for group, times in groups.items()}
               for key, groups in best.items()}
    if select == "spread":
        return WarmStart(configs, top, retime=spread_on_this_gpu)
    return WarmStart(configs, top)
