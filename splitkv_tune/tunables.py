"""Every tunable of the kernels, and the split math, in one place.

This module is the single source of truth: ``splitkv_tune.codegen`` writes the
C++ traits header and the kernel instantiations from it, the host-side
validation and heuristics read it, and ``reference.py`` uses the same split
ranges as the CUDA kernel.

Numeric contract of the partials (also written in ``kernels/include/splitkv/params.h``):

* ``x_j = softmax_scale * <q, k_j>`` in natural-log units.
* For split ``s`` covering keys ``[start, end)`` of one packed query row:
  ``m_s = max_j x_j`` (``-inf`` if the split has no unmasked key),
  ``l_s = sum_j exp(x_j - m_s)`` (``0`` if empty),
  ``O_s = sum_j exp(x_j - m_s) * v_j`` (un-normalised, fp32; ``0`` if empty).
* Merge: ``m = max_s m_s``; ``l = sum_s exp(m_s - m) * l_s``;
  ``O = sum_s exp(m_s - m) * O_s / l``; ``lse = m + log(l)``. Splits with
  ``l_s == 0`` are skipped; a row whose splits are all empty gets ``O = 0``
  and ``lse = -inf``.
* Packed rows: the ``G = Hq / Hkv`` query heads sharing one KV head are packed
  into one CTA; packed row ``r = q_idx * G + g`` is query position ``q_idx`` of
  query head ``h_kv * G + g``.
* Workspace layout (fp32, each section 128-byte aligned):
  ``O[S, B, Hkv, Sq*G, D]``, then ``m[S, B, Hkv, Sq*G]``, then ``l[S, B, Hkv, Sq*G]``.
  With ``S == 1`` the split kernel writes the final output and no workspace is used.
* Fused merge: each split CTA increments its query tile's counter modulo ``S`` once its
  partial is in the workspace; the CTA that sees ``S - 1`` merges the tile with the same
  formula, and its increment wraps the counter back to 0. The counters (int32, one per query
  tile and (batch, KV head)) are zeroed once when the extension allocates them (never by a
  kernel on the caller's stream), and every launch leaves them zero.

The rules that the kernels and the host both need (query-tile height, warp layout, shared
memory, causal tile ends, split ranges, workspace sections) are defined once, in
``kernels/include/splitkv/rules.h``; the functions below call them through
``splitkv_tune._rules``, which every install builds with the host compiler.
"""
from __future__ import annotations

import operator

import dataclasses
import math

try:
    from splitkv_tune import _rules
except ImportError as err:  # pragma: no cover - a broken install
    raise ImportError("splitkv_tune._rules (kernels/rules_binding.cpp) is not built: "
                      "reinstall with `pip install -e .`") from err

DTYPES = ("fp16", "bf16")
HEAD_DIMS = (64, 96, 128, 256)
BLOCK_KV = (32, 64, 128)
# The block_kv values instantiated per head dim. At 256 a 128-key block needs 270 KB of
# shared memory for Q and two stages of K and V (smem_bytes), more than any GPU's 227 KB.
BLOCK_KV_BY_HEAD_DIM = {64: BLOCK_KV, 96: BLOCK_KV, 128: BLOCK_KV, 256: (32, 64)}
REDUCE_THREADS = (64, 128, 256)
SPLIT_POLICIES = ("length", "blocks")
MAX_SPLITS = 128
# The split counts a sweep measures unless its grid says otherwise, and the ones the analytic
# fallback chooses from: neighbours at most 1.5x apart, so a table and the fallback choose
# among the same launches.
SPLIT_COUNTS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128)
# How the S partials are merged: "kernel" launches the combine kernel; "fused" lets the last
# split CTA of each query tile to finish merge them (no second launch); "auto" picks.
MERGES = ("auto", "kernel", "fused")
WORKSPACE_ALIGN = 128
KV_STAGES = 2
NUM_WARPS = 4
# Query-tile heights (packed rows per CTA); rules.h says which one a problem uses.
BLOCK_M = (16, 64)


@dataclasses.dataclass(frozen=True)
class Shape:
    """One attention problem."""

    dtype: str
    head_dim: int
    batch: int
    q_heads: int
    kv_heads: int
    q_len: int
    kv_len: int
    causal: bool = False

    @property
    def group(self) -> int:
        """Query heads per KV head (1 for MHA)."""
        return self.q_heads // self.kv_heads

    @property
    def packed_rows(self) -> int:
        """Rows of one (batch, KV head) problem after GQA packing."""
        return self.q_len * self.group

    def validate(self) -> "Shape":
        """Raise ``ValueError`` naming the field that is out of range.

        >>> Shape("bf16", 80, 1, 8, 8, 1, 128).validate()
        Traceback (most recent call last):
        ...
        ValueError: head_dim must be one of (64, 96, 128, 256), got 80
        """
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.head_dim not in HEAD_DIMS:
            raise ValueError(f"head_dim must be one of {HEAD_DIMS}, got {self.head_dim}")
        for name in ("batch", "q_heads", "kv_heads", "q_len", "kv_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.q_heads % self.kv_heads:
            raise ValueError(
                f"q_heads ({self.q_heads}) must be a multiple of kv_heads ({self.kv_heads})")
        return self

    def element_bytes(self) -> int:
        return 2

    def bytes_moved(self) -> int:
        """Fewest bytes a forward pass moves: Q, K, V read once and O written once.

        >>> Shape("bf16", 128, 1, 32, 8, 1, 4096).bytes_moved()
        16793600
        """
        e = self.element_bytes()
        qo = 2 * self.batch * self.q_heads * self.q_len * self.head_dim * e
        kv = 2 * self.batch * self.kv_heads * self.kv_len * self.head_dim * e
        return qo + kv

    def flops(self) -> float:
        """Matrix FLOPs (QK^T and PV), halved-ish for causal as FlashAttention counts them."""
        f = 4.0 * self.batch * self.q_heads * self.q_len * self.kv_len * self.head_dim
        if self.causal:
            # Keys each query sees under bottom-right alignment, summed over queries.
            seen = sum(min(self.kv_len, max(0, i + 1 + self.kv_len - self.q_len))
                       for i in range(self.q_len))
            f *= seen / (self.q_len * self.kv_len)
        return f


@dataclasses.dataclass(frozen=True)
class Config:
    """The run-time tunables of one launch."""

    num_splits: int = 1
    block_kv: int = 64
    reduce_threads: int = 128
    split_policy: str = "blocks"

    def validate(self) -> "Config":
        """Raise ``ValueError`` naming the tunable that is out of range.

        >>> Config(num_splits=0).validate()
        Traceback (most recent call last):
        ...
        ValueError: num_splits must be an integer in [1, 128], got 0
        >>> Config(block_kv=48).validate()
        Traceback (most recent call last):
        ...
        ValueError: block_kv must be one of (32, 64, 128), got 48
        """
        s = self.num_splits
        if not isinstance(s, int) or isinstance(s, bool) or not 1 <= s <= MAX_SPLITS:
            raise ValueError(f"num_splits must be an integer in [1, {MAX_SPLITS}], got {s!r}")
        for name in ("block_kv", "reduce_threads"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"{name} must be an integer, got {value!r}")
        if self.block_kv not in BLOCK_KV:
            raise ValueError(f"block_kv must be one of {BLOCK_KV}, got {self.block_kv!r}")
        if self.reduce_threads not in REDUCE_THREADS:
            raise ValueError(
                f"reduce_threads must be one of {REDUCE_THREADS}, got {self.reduce_threads!r}")
        if self.split_policy not in SPLIT_POLICIES:
            raise ValueError(
                f"split_policy must be one of {SPLIT_POLICIES}, got {self.split_policy!r}")
        return self


def block_kvs_for(head_dim: int) -> tuple[int, ...]:
    """The ``block_kv`` values instantiated at ``head_dim`` (codegen, validation, search space).

    >>> block_kvs_for(256)
    (32, 64)
    """
    return BLOCK_KV_BY_HEAD_DIM[head_dim]


def integer_or_auto(name: str, value):
    """A tunable as a plain int (numpy and torch integers too; bools are left for the range
    checks to refuse) or ``"auto"``; ``ValueError`` naming it otherwise.

    >>> integer_or_auto("max_splits", 2.5)
    Traceback (most recent call last):
    ...
    ValueError: max_splits must be an integer or 'auto', got 2.5
    """
    if isinstance(value, (str, bool)):
        return value
    try:
        return operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an integer or 'auto', got {value!r}") from None


def check_block_kv(shape: Shape, config: Config) -> Config:
    """``config`` itself when its ``block_kv`` is instantiated at the shape's head dim.

    >>> check_block_kv(Shape("bf16", 256, 1, 8, 1, 1, 4096), Config(block_kv=128))
    Traceback (most recent call last):
    ...
    ValueError: block_kv must be one of (32, 64) at head_dim 256, got 128
    """
    check_block_kv_at(config.block_kv, shape.head_dim)
    return config


def check_block_kv_at(block_kv, head_dim: int) -> None:
    """``ValueError`` unless ``block_kv`` is instantiated at ``head_dim``, one of the kernel's."""
    allowed = block_kvs_for(head_dim)
    if isinstance(block_kv, bool) or block_kv not in allowed:
        raise ValueError(f"block_kv must be one of {allowed} at head_dim {head_dim}, got {block_kv!r}")


def lanes_per_row(head_dim: int) -> int:
    """Lanes that fold one row of the merge (``kLanesPerRow`` in merge_state.h): one float4
    each at 64 and 128, three floats each at 96, two float4 each at 256.

    >>> [lanes_per_row(d) for d in HEAD_DIMS]
    [16, 32, 32, 32]
    """
    return _rules.lanes_per_row(head_dim)


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def dtype_codes() -> dict[str, int]:
    """The element types' codes in launch arguments (rules.h).

    >>> dtype_codes()
    {'fp16': 0, 'bf16': 1}
    """
    return dict(_rules.DTYPE_CODES)


def policy_codes() -> dict[str, int]:
    """The split policies' codes in launch arguments (rules.h).

    >>> policy_codes()
    {'length': 0, 'blocks': 1}
    """
    return _rules.POLICY_CODES


def block_m_for(packed_rows: int) -> int:
    """Query-tile height for a problem with ``packed_rows`` rows per (batch, KV head) (rules.h).

    >>> [block_m_for(r) for r in (1, 16, 17, 8192)]
    [16, 16, 64, 64]
    """
    return _rules.block_m_for(packed_rows)


def warp_layout(block_m: int) -> tuple[int, int]:
    """``(warps along the rows, warps along the keys)`` of a ``block_m``-row tile (rules.h).

    >>> warp_layout(16), warp_layout(64)
    ((1, 4), (4, 1))
    """
    return _rules.warp_layout(block_m)


def warps_own_keys(block_m: int, block_kv: int) -> bool:
    """Whether each warp of a tile owns its own keys of every K/V stage (the decode loop).

    Needs warps along N and at least 16 keys per warp (the k of the P V MMA); otherwise the
    warps share each key block and exchange row statistics and P through shared memory.

    >>> [warps_own_keys(16, bkv) for bkv in BLOCK_KV], warps_own_keys(64, 128)
    ([False, True, True], False)
    """
    return _rules.warps_own_keys(block_m, block_kv)


def smem_bytes(head_dim: int, block_kv: int, block_m: int) -> int:
    """Shared memory of one split-kernel CTA (rules.h; both element types are 2 bytes).

    >>> smem_bytes(128, 128, 16), smem_bytes(128, 32, 16), smem_bytes(256, 64, 16), smem_bytes(256, 64, 64)
    (135168, 38400, 139264, 163840)
    """
    return _rules.smem_bytes(2, head_dim, block_m, block_kv)


def register_residency(head_dim: int, block_kv: int, block_m: int) -> int:
    """CTAs of the equal-length split kernel that one SM's registers hold on sm_90 (rules.h, from
    the kernel's ptxas register count).

    >>> [register_residency(128, kv, 16) for kv in (32, 64, 128)], register_residency(256, 32, 16)
    ([4, 3, 2], 2)
    """
    return _rules.register_residency(head_dim, block_m, block_kv)


def check_merge(merge: str) -> str:
    """``merge`` itself when it names a way to merge partials, else ``ValueError``.

    >>> check_merge("fused")
    'fused'
    """
    if merge not in MERGES:
        raise ValueError(f"merge must be one of {MERGES}, got {merge!r}")
    return merge


def split_merge(shape: Shape, merge: str = "auto") -> str:
    """How a launch of ``shape`` whose sequences split merges: ``merge``, or for ``"auto"`` the
    fused merge where it fits (``fused_merge_fits``), else the combine kernel.

    >>> split_merge(Shape("bf16", 128, 1, 32, 8, 1, 4096)), split_merge(Shape("bf16", 128, 1, 32, 8, 4, 4096))
    ('fused', 'kernel')
    """
    check_merge(merge)
    if merge != "auto":
        return merge
    return "fused" if fused_merge_fits(shape) else "kernel"


def fused_merge_fits(shape: Shape) -> bool:
    """Whether the fused merge of one query tile is one row fold per thread of the last CTA
    (``lanes_per_row`` lanes per row, so one float4 per thread at head dims 64 and 128).

    Past that, the last CTA merges rows one after another and the combine kernel, spread over
    many CTAs, is faster (H200: 15% slower fused at Sq = 4, 56% at a 16-query causal chunk;
    ``docs/PERFORMANCE.md``).

    >>> [fused_merge_fits(Shape("bf16", 128, 1, 32, 8, q, 4096)) for q in (1, 2)]
    [True, False]
    >>> [fused_merge_fits(Shape("bf16", 256, 1, g, 1, 1, 4096)) for g in (4, 8)]
    [True, False]
    """
    return _rules.fused_merge_fits(shape.packed_rows, shape.head_dim)


def num_m_blocks(shape: Shape) -> int:
    return _rules.num_m_blocks(shape.packed_rows)


def tile_kv_end(shape: Shape, m_block: int) -> int:
    """One past the last key any row of query tile ``m_block`` may attend.

    Causal masks are aligned bottom-right (query ``i`` sees keys ``<= i + Sk - Sq``).

    >>> s = Shape("bf16", 128, 1, 1, 1, q_len=100, kv_len=100, causal=True)
    >>> tile_kv_end(s, 0)
    64
    """
    return _rules.tile_kv_end(shape.causal, shape.kv_len, shape.q_len, shape.group,
                              shape.packed_rows, m_block)


def split_range(split: int, num_splits: int, kv_len: int, kv_end: int,
                block_kv: int, policy: str) -> tuple[int, int]:
    """Keys ``[start, end)`` of one split for a query tile whose keys end at ``kv_end``.

    ``"length"`` cuts ``[0, kv_len)`` into equal lengths (clipped to the tile's causal
    end, so trailing splits of early tiles are empty); ``"blocks"`` gives every split the
    same count (within one) of ``block_kv`` blocks of ``[0, kv_end)``. ``end <= start``
    means an empty split.

    >>> [split_range(i, 3, 100, 100, 32, "length") for i in range(3)]
    [(0, 33), (33, 66), (66, 100)]
    >>> [split_range(i, 3, 100, 100, 32, "blocks") for i in range(3)]
    [(0, 32), (32, 64), (64, 100)]
    >>> split_range(2, 4, 100, 40, 32, "length")
    (50, 40)
    """
    return _rules.split_range(_rules.POLICY_CODES[policy], split, num_splits, kv_len, kv_end,
                              block_kv)


def workspace_sections(shape: Shape, num_splits: int) -> tuple[int, int, int]:
    """Byte offsets of the m and l sections and the total size; O starts at 0 (module contract)."""
    return _rules.workspace_sections(num_splits, shape.batch, shape.q_heads, shape.q_len,
                                     shape.head_dim)


def workspace_bytes(shape: Shape, num_splits: int) -> int:
    """Bytes of workspace a launch needs (0 when ``num_splits == 1``).

    >>> workspace_bytes(Shape("bf16", 128, 1, 32, 8, 1, 4096), 16)
    266240
    """
    return workspace_sections(shape, num_splits)[2]


def kv_blocks(shape: Shape, block_kv: int) -> int:
    return ceil_div(shape.kv_len, block_kv)


def fa2_num_splits(shape: Shape, num_sms: int, max_splits: int = MAX_SPLITS) -> int:
    """FlashAttention-2's split heuristic: the smallest S within 85% of the best wave efficiency.

    It counts KV blocks of its own size (256 keys up to head dim 64, 128 up to 128, 64 above;
    ``flash_api.cpp``'s ``block_n``). Its query
    tile is 64 rows; for decode (Sq = 1) it packs the GQA heads into the query dimension,
    otherwise it counts query heads.

    >>> fa2_num_splits(Shape("bf16", 128, 1, 32, 8, 1, 16384), num_sms=132)
    15
    >>> fa2_num_splits(Shape("bf16", 128, 16, 32, 32, 1, 16384), num_sms=132)
    1
    """
    if shape.q_len == 1:
        work = shape.batch * shape.kv_heads * ceil_div(shape.group, 64)
    else:
        work = shape.batch * shape.q_heads * ceil_div(shape.q_len, 64)
    if work >= 0.8 * num_sms:
        return 1
    n_blocks = ceil_div(shape.kv_len, 256 if shape.head_dim <= 64 else 128 if shape.head_dim <= 128 else 64)
    limit = min(max_splits, num_sms, n_blocks)

    def eligible(s: int) -> bool:
        return s == 1 or ceil_div(n_blocks, s) != ceil_div(n_blocks, s - 1)

    eff = {}
    for s in range(1, limit + 1):
        if eligible(s):
            waves = work * s / num_sms
            eff[s] = waves / math.ceil(waves)
    best = max(eff.values())
    return next(s for s in sorted(eff) if eff[s] >= 0.85 * best)
