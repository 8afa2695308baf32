"""``splitkv_attention``: validation, workspace, dispatch and ``torch.library`` registration.

Everything is checked before a pointer reaches the kernels; bad input raises ``ValueError``
or ``TypeError`` naming the argument and what was expected. An eager equal-length call is one
crossing into C++ (``_C.attention``): the tensor checks, the plan of the call signature, the
allocations and the launch. The plan (``_Plan``: the scalar arguments checked, the tunables
resolved) is made here once per call signature and kept by ``_C.attention``, so that the host
path costs a few microseconds. Traced calls (``torch.compile``) are checked by ``problem_shape``
and lower to the registered op.
"""
from __future__ import annotations

import functools
import math

import torch

from splitkv_tune import _rules, tunables
from splitkv_tune.tunables import Config, Shape

_DTYPES = {torch.float16: "fp16", torch.bfloat16: "bf16"}
_DTYPE_NAMES = {code: name for name, code in tunables.dtype_codes().items()}
_MAX_GRID_Y = _rules.MAX_GRID_Y
_TUNABLES = ("num_splits", "block_kv", "reduce_threads", "split_policy")


@functools.lru_cache(maxsize=1)
def _extension():
    try:
        from splitkv_tune import _C
    except ImportError as err:
        raise RuntimeError(
            "the CUDA extension splitkv_tune._C is not built (it is built when a GPU is visible "
            "at install time, or with SPLITKV_BUILD_CUDA=1). Rebuild on a machine with nvcc: "
            "`pip install -e .`") from err
    return _C


@functools.cache
def extension_built() -> bool:
    """Whether the CUDA extension imports (the reference runs on CUDA tensors without it)."""
    try:
        _extension()
    except RuntimeError:
        return False
    return True


@functools.lru_cache(maxsize=None)
def _device_info(index: int) -> tuple[str, int]:
    props = torch.cuda.get_device_properties(index)
    return props.name, props.multi_processor_count


def check_tensor(name: str, t, rank: int) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in _DTYPES:
        raise TypeError(f"{name} must be float16 or bfloat16, got {t.dtype}")
    if t.device.type != "cuda":
        raise ValueError(f"{name} must be on a CUDA device, got {t.device}")
    if t.dim() != rank:
        raise ValueError(f"{name} must have {rank} dimensions (batch, seq, heads, head_dim), "
                         f"got shape {tuple(t.shape)}")


def check_tensors(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_name: str = "k", v_name: str = "v") -> None:
    """What q, k and v must agree on whatever the cache's layout: rank 4, one dtype and device,
    k and v of one shape, contiguous last dims, one head dim."""
    names = (("q", q), (k_name, k), (v_name, v))
    for name, t in names:
        check_tensor(name, t, 4)
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, {k_name} and {v_name} must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if k.device != q.device or v.device != q.device:
        raise ValueError(f"q, {k_name} and {v_name} must be on one device, got {q.device}, {k.device}, {v.device}")
    if k.shape != v.shape:
        raise ValueError(f"{k_name} and {v_name} must have the same shape, got {tuple(k.shape)} and "
                         f"{tuple(v.shape)}")
    for name, t in names:
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dim (stride 1), got stride {t.stride(-1)}")
    if k.shape[3] != q.shape[3]:
        raise ValueError(f"{k_name} head_dim ({k.shape[3]}) must equal q head_dim ({q.shape[3]})")


def problem_shape(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False) -> Shape:
    """Validate q, k, v against each other and return the problem's ``Shape``."""
    check_tensors(q, k, v)
    batch, q_len, q_heads, head_dim = (int(x) for x in q.shape)
    if k.shape[0] != batch:
        raise ValueError(f"k batch ({k.shape[0]}) must equal q batch ({batch})")
    if batch * k.shape[2] > _MAX_GRID_Y:
        raise ValueError(f"batch * kv_heads must be at most {_MAX_GRID_Y}, got {batch * k.shape[2]}")
    if max(k.shape[1], q_len * (q_heads // max(1, k.shape[2]))) > _rules.MAX_KEYS:
        raise ValueError(f"kv_len and q_len * (q_heads / kv_heads) must be at most {_rules.MAX_KEYS}")
    dtype = _DTYPES[q.dtype]
    return Shape(dtype, head_dim, batch, q_heads, int(k.shape[2]), q_len, int(k.shape[1]),
                 bool(causal)).validate()


@torch.compiler.assume_constant_result
def _traced_launch_args(shape_fields: tuple, device_index: int, num_splits, block_kv, reduce_threads,
                        split_policy, merge: str) -> tuple:
    # Reads tables and calls the compiled rules: evaluated once at trace time under torch.compile.
    shape = Shape(*shape_fields)
    config = resolve_config(shape, device_index, num_splits, block_kv, reduce_threads, split_policy)
    fused = resolve_merge(shape, config, merge) == "fused"
    return (config.num_splits, config.block_kv, config.reduce_threads,
            tunables.policy_codes()[config.split_policy], fused)


def _is_auto(value) -> bool:
    return isinstance(value, str) and value == "auto"


def resolve_config(shape: Shape, device_index: int, num_splits="auto", block_kv="auto",
                   reduce_threads="auto", split_policy="auto") -> Config:
    """Fill every ``"auto"`` tunable from the selector and validate the result.

    An automatic split count never exceeds the KV blocks of the block size in use.
    """
    given = {"num_splits": num_splits, "block_kv": block_kv, "reduce_threads": reduce_threads,
             "split_policy": split_policy}
    for name, value in given.items():
        if _is_auto(value):
            continue
        if name != "split_policy":
            value = tunables.integer_or_auto(name, value)
        given[name] = value
        Config(**{name: value}).validate()
    if any(_is_auto(v) for v in given.values()):
        from splitkv_tune import selector
        c = selector.auto_config(shape, *_device_info(device_index))
        auto = {"num_splits": c.num_splits, "block_kv": c.block_kv, "reduce_threads": c.reduce_threads,
                "split_policy": c.split_policy}
        given = {k: auto[k] if _is_auto(v) else v for k, v in given.items()}
        if _is_auto(num_splits):
            cap = tunables.kv_blocks(shape, given["block_kv"])
            given["num_splits"] = max(1, min(given["num_splits"], cap))
    return tunables.check_block_kv(shape, Config(**given).validate())


def resolve_merge(shape: Shape, config: Config, merge: str = "auto") -> str:
    """How a launch merges its partials: ``"none"`` (one split), ``"fused"`` or ``"kernel"``.

    ``"fused"``: the last split CTA of each query tile merges the tile (no combine kernel).
    ``"kernel"``: the combine kernel, with ``reduce_threads`` threads per block. ``"auto"``
    is ``"fused"`` where that merge is one round of loads per thread
    (``tunables.fused_merge_fits``), else ``"kernel"``.

    >>> decode, prefill = Shape("bf16", 128, 1, 32, 8, 1, 4096), Shape("bf16", 128, 1, 32, 8, 16, 4096)
    >>> [resolve_merge(s, Config(num_splits=8)) for s in (decode, prefill)]
    ['fused', 'kernel']
    >>> resolve_merge(decode, Config(num_splits=1), "kernel")
    'none'
    """
    tunables.check_merge(merge)
    return "none" if config.num_splits == 1 else tunables.split_merge(shape, merge)


def workspace_size(q: torch.Tensor, k: torch.Tensor, num_splits: int) -> int:
    """Bytes of workspace one call with ``num_splits`` splits needs (0 for one split)."""
    Config(num_splits=num_splits).validate()
    return tunables.workspace_bytes(problem_shape(q, k, k), num_splits)


def workspace_views(workspace: torch.Tensor, shape: Shape, num_splits: int):
    """fp32 views ``(O [S,B,Hkv,Sq*G,D], m [S,B,Hkv,Sq*G], l [S,B,Hkv,Sq*G])`` of a workspace."""
    m_off, l_off, total = tunables.workspace_sections(shape, num_splits)
    rows = (num_splits, shape.batch, shape.kv_heads, shape.packed_rows)
    n_rows = math.prod(rows)
    o = workspace[: n_rows * shape.head_dim * 4].view(torch.float32).view(*rows, shape.head_dim)
    m = workspace[m_off: m_off + n_rows * 4].view(torch.float32).view(*rows)
    l = workspace[l_off: l_off + n_rows * 4].view(torch.float32).view(*rows)
    return o, m, l


def _check_workspace(q: torch.Tensor, workspace) -> None:
    if workspace is None:
        return
    if not isinstance(workspace, torch.Tensor) or workspace.dtype != torch.uint8:
        raise TypeError("workspace must be a torch.uint8 tensor")
    if workspace.device != q.device or not workspace.is_contiguous():
        raise ValueError(f"workspace must be a contiguous tensor on {q.device}")


def _check_scalars(softmax_scale, merge: str, enable_pdl, head_dim: int) -> float:
    """The softmax scale to use; ``ValueError``/``TypeError`` for a bad scale, merge or PDL flag."""
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(head_dim)
    if (not isinstance(softmax_scale, (int, float)) or isinstance(softmax_scale, bool)
            or not math.isfinite(softmax_scale)):
        raise ValueError(f"softmax_scale must be a finite number, got {softmax_scale!r}")
    tunables.check_merge(merge)
    if not isinstance(enable_pdl, bool):
        raise TypeError(f"enable_pdl must be True or False, got {enable_pdl!r}")
    return float(softmax_scale)


class _Plan:
    """What one call signature (everything but the tensors' data and the KV length) launches
    with: the checked scalars, and the tunables per KV length (fixed when none is ``"auto"``)."""

    __slots__ = ("shape", "device", "scale", "merge", "given", "fixed", "by_kv_len", "lookup", "by_config")
    _MAX_KV_LENS = 4096  # distinct KV lengths remembered per signature (a decode loop grows it)

    def __init__(self, shape: Shape, device: int, softmax_scale, merge, enable_pdl, given: dict):
        self.shape, self.device, self.merge, self.given = shape, device, merge, given
        self.scale = _check_scalars(softmax_scale, merge, enable_pdl, shape.head_dim)
        self.by_kv_len: dict[int, tuple] = {}
        self.by_config: dict[Config, tuple] = {}
        self.fixed = self.lookup = None
        if not any(_is_auto(v) for v in given.values()):
            self.fixed = self._resolve(shape)
        elif all(_is_auto(v) for v in given.values()):
            # The default call: its config for any KV length is the class's precomputed answer
            # (resolve_config adds nothing to it), so a decode loop whose KV length grows every
            # step pays a bisection, not a resolution.
            from splitkv_tune import selector
            self.lookup = selector.class_lookup(shape, *_device_info(device))

    def _resolve(self, shape: Shape) -> tuple:
        return self._args(resolve_config(shape, self.device, **self.given))

    def _args(self, config: Config) -> tuple:
        fused = resolve_merge(self.shape, config, self.merge) == "fused"
        return (config.num_splits, config.block_kv, config.reduce_threads,
                tunables.policy_codes()[config.split_policy], fused)

    def launch_args(self, kv_len: int) -> tuple:
        """``(num_splits, block_kv, reduce_threads, split_policy code, fused merge)``."""
        if self.fixed is not None:
            return self.fixed
        if self.lookup is not None:
            config = self.lookup.config(kv_len)
            args = self.by_config.get(config)
            if args is None:
                args = self.by_config[config] = self._args(config)
            return args
        args = self.by_kv_len.get(kv_len)
        if args is None:
            if len(self.by_kv_len) >= self._MAX_KV_LENS:
                self.by_kv_len.clear()
            s = self.shape
            shape = Shape(s.dtype, s.head_dim, s.batch, s.q_heads, s.kv_heads, s.q_len, kv_len, s.causal)
            args = self.by_kv_len[kv_len] = self._resolve(shape)
        return args


def _plan_for(dims: tuple, causal, softmax_scale, num_splits, block_kv, reduce_threads, split_policy,
              merge, enable_pdl) -> _Plan:
    """The plan of an eager call whose tensors ``_C.attention`` checked; ``dims`` is
    ``(dtype code, head_dim, batch, q_heads, kv_heads, q_len, kv_len, device index)``. Raises
    for a bad scalar argument or tunable. ``_C.attention`` keeps the plan per call signature."""
    code, head_dim, batch, q_heads, kv_heads, q_len, kv_len, device = dims
    shape = Shape(_DTYPE_NAMES[code], head_dim, batch, q_heads, kv_heads, q_len, kv_len, bool(causal))
    given = dict(zip(_TUNABLES, (num_splits, block_kv, reduce_threads, split_policy)))
    return _Plan(shape, device, softmax_scale, merge, enable_pdl, given)


def _attention_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    workspace: torch.Tensor | None, causal: bool, softmax_scale: float, num_splits: int,
                    block_kv: int, reduce_threads: int, split_policy: int, return_lse: bool,
                    fused_merge: bool, pdl: bool, cache_seqlens: torch.Tensor | None,
                    block_table: torch.Tensor | None, min_blocks_per_split: int,
                    plan_choices: int) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse = _extension().forward(q, k, v, workspace, causal, softmax_scale, num_splits, block_kv,
                                    reduce_threads, split_policy, return_lse, fused_merge, pdl, cache_seqlens,
                                    block_table, min_blocks_per_split, plan_choices)
    return out, lse if return_lse else q.new_empty((0,), dtype=torch.float32)


# Registered for torch.compile; eager calls skip the dispatcher's per-call cost.
_attention_op = torch.library.custom_op("splitkv::attention", mutates_args=("workspace",))(
    _attention_impl)


@_attention_op.register_fake
def _(q, k, v, workspace, causal, softmax_scale, num_splits, block_kv, reduce_threads,
      split_policy, return_lse, fused_merge, pdl, cache_seqlens, block_table, min_blocks_per_split, plan_choices):
    batch, q_len, q_heads, _ = q.shape
    lse_shape = (batch, q_heads, q_len) if return_lse else (0,)
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            q.new_empty(lse_shape, dtype=torch.float32))


def _traced_call(q, k, v, causal, softmax_scale, tunables_given: dict, merge, workspace, return_lse,
                 enable_pdl):
    """The call under ``torch.compile``: checked in Python at trace time, one registered op."""
    shape = problem_shape(q, k, v, causal)
    scale = _check_scalars(softmax_scale, merge, enable_pdl, shape.head_dim)
    fields = (shape.dtype, shape.head_dim, shape.batch, shape.q_heads, shape.kv_heads,
              shape.q_len, shape.kv_len, shape.causal)
    splits, bkv, threads, policy, fused = _traced_launch_args(
        fields, q.device.index, *(tunables_given[t] for t in _TUNABLES), merge)
    _check_workspace(q, workspace)
    return _attention_op(q, k, v, workspace, bool(causal), scale, splits, bkv, threads, policy,
                         bool(return_lse), fused, enable_pdl, None, None, 1, 1)


def splitkv_attention(q, k, v, *, causal=False, softmax_scale=None, num_splits="auto",
                      block_kv="auto", reduce_threads="auto", split_policy="auto",
                      merge="auto", workspace=None, return_lse=False, enable_pdl=True,
                      cache_seqlens=None, block_table=None, max_splits="auto",
                      min_blocks_per_split="auto", split_plan="fixed", check_inputs=True):
    """Split-KV attention forward.

    q ``(B, Sq, Hq, D)``, k and v ``(B, Sk, Hkv, D)``, fp16 or bf16 on one CUDA device,
    last dim contiguous; ``Hq`` a multiple of ``Hkv`` (GQA/MQA). Causal masks are aligned
    bottom-right. Returns ``out (B, Sq, Hq, D)`` in q's dtype, and with ``return_lse``
    also ``lse (B, Hq, Sq)`` float32 in natural log (``-inf`` for rows with no key).
    Tunables left at ``"auto"`` come from the heuristic table for this GPU (or the
    analytic fallback). ``merge``: ``"auto"``, ``"fused"`` (the last split CTA of each query
    tile merges it) or ``"kernel"`` (the combine kernel); see ``resolve_merge``. ``workspace``:
    optional uint8 tensor of at least ``workspace_size(q, k, num_splits)`` bytes, 128-byte
    aligned; otherwise one buffer per device and stream is cached, and a call under CUDA-graph
    capture takes its own from the graph's memory pool. ``enable_pdl``: launch the kernels with
    programmatic dependent launch (sm_90 and newer; ignored on older GPUs), so that the launch
    and the index arithmetic overlap the previous kernel of the stream; every memory access
    still waits until that kernel has finished.

    Paged and variable-length batches: with ``cache_seqlens`` (int32 ``[B]`` on q's device,
    each sequence's live length) and/or ``block_table`` (int32 ``[B, max_pages]``, pages in
    any order, shared by K and V; k and v are then page pools ``(num_pages, page_size, Hkv,
    D)``, page sizes ``plan.PAGE_SIZES``), keys at or past a sequence's length are never read,
    causal masks are aligned to each sequence's own end, and a sequence of length 0 gets
    ``out = 0`` and ``lse = -inf``. Each sequence is split by its own length on the device
    (``live_splits(len, block_kv, min_blocks_per_split, max_splits)``; see
    :mod:`splitkv_tune.live` for the ``"auto"`` knobs), so a captured graph replays any mix
    of lengths; ``num_splits`` and ``split_policy`` do not apply. ``max_splits`` sizes the
    workspace (``live.workspace_size(q, max_splits)``). With ``split_plan="load_aware"`` and
    ``cache_seqlens`` each launch chooses ``min_blocks_per_split`` among that knob times 1, 2,
    4, ... from all the live lengths (the load-aware plan, ``plan.plan_min_blocks``), and a
    sequence's bits depend on the batch. Otherwise a sequence's output bits depend only on its own q,
    keys, length and the knobs, never on the other sequences' lengths or the table's width;
    the ``"auto"`` knobs follow the batch size B (fixed in a captured graph), so pass them
    explicitly for bits that do not change with B either. ``check_inputs``
    (default True): check every length against the capacity and every live page against the
    pool on the device (one small kernel, ``live_check.h``), read its answer back, and raise
    ``ValueError`` naming the first bad entry; skipped under CUDA-graph capture and
    ``torch.compile``, and when False (then a wrong table is the caller's out-of-bounds read).
    The checks that need no data run on a call signature's first call only.
    """
    if cache_seqlens is not None or block_table is not None:
        if torch.compiler.is_compiling():
            return _traced_live_call(q, k, v, cache_seqlens, block_table, causal, softmax_scale, num_splits,
                                     block_kv, reduce_threads, split_policy, merge, workspace, return_lse,
                                     enable_pdl, max_splits, min_blocks_per_split, split_plan, check_inputs)
        return _extension().live_attention(q, k, v, cache_seqlens, block_table, causal, softmax_scale, num_splits,
                                           block_kv, reduce_threads, split_policy, merge, workspace, return_lse,
                                           enable_pdl, max_splits, min_blocks_per_split, split_plan, check_inputs)
    if not (max_splits == "auto" and min_blocks_per_split == "auto" and split_plan == "fixed"):
        raise ValueError("max_splits, min_blocks_per_split and split_plan apply to paged or variable-length "
                         "batches (cache_seqlens or block_table); an equal-length batch takes num_splits")
    if torch.compiler.is_compiling():
        given = dict(zip(_TUNABLES, (num_splits, block_kv, reduce_threads, split_policy)))
        out, lse = _traced_call(q, k, v, causal, softmax_scale, given, merge, workspace, return_lse,
                                enable_pdl)
        return (out, lse) if return_lse else out
    return _extension().attention(q, k, v, causal, softmax_scale, num_splits, block_kv, reduce_threads,
                                  split_policy, merge, workspace, return_lse, enable_pdl)


def _live_launch(q, k, v, cache_seqlens, block_table, causal, softmax_scale, num_splits, block_kv, reduce_threads,
                 split_policy, merge, enable_pdl, max_splits, min_blocks_per_split, split_plan, check_inputs) -> tuple:
    """A paged / variable-length call's launch: ``live.launch_args``'s tuple (every check but the
    data's), then the softmax scale and causal. The extension's ``live_attention`` keeps it per
    call signature (``kernels/live_launch_cache.h``), so a repeated eager call runs no Python."""
    from splitkv_tune import live

    args = live.launch_args(q, k, v, cache_seqlens=cache_seqlens, block_table=block_table, causal=causal,
                            block_kv=block_kv, min_blocks_per_split=min_blocks_per_split, max_splits=max_splits,
                            split_plan=split_plan, num_splits=num_splits, split_policy=split_policy,
                            reduce_threads=reduce_threads, merge=merge, check_inputs=check_inputs)
    return (*args, _check_scalars(softmax_scale, merge, enable_pdl, int(q.shape[3])), bool(causal))


def _traced_live_call(q, k, v, cache_seqlens, block_table, causal, softmax_scale, num_splits, block_kv,
                      reduce_threads, split_policy, merge, workspace, return_lse, enable_pdl, max_splits,
                      min_blocks_per_split, split_plan, check_inputs):
    """A paged / variable-length call under torch.compile: the launch resolved at trace time,
    the data unchecked (as under capture), the registered op."""
    splits, bkv, threads, policy, fused, min_blocks, choices, _, scale, causal = _live_launch(
        q, k, v, cache_seqlens, block_table, causal, softmax_scale, num_splits, block_kv, reduce_threads,
        split_policy, merge, enable_pdl, max_splits, min_blocks_per_split, split_plan, check_inputs)
    _check_workspace(q, workspace)
    out, lse = _attention_op(q, k, v, workspace, causal, scale, splits, bkv, threads, policy, bool(return_lse),
                             fused, enable_pdl, cache_seqlens, block_table, min_blocks, choices)
    return (out, lse) if return_lse else out


def combine_partials(o_part: torch.Tensor, m: torch.Tensor, l: torch.Tensor, *, q_len: int,
                     group: int, reduce_threads: int = 128, out_dtype=torch.bfloat16):
    """Run the combine kernel alone on fp32 partials ``O [S,B,Hkv,Sq*G,D]``, ``m``, ``l``.

    Returns ``out (B, Sq, Hkv*G, D)`` in ``out_dtype`` and ``lse (B, Hkv*G, Sq)``.
    """
    for name, t in (("o_part", o_part), ("m", m), ("l", l)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.device.type != "cuda":
            raise TypeError(f"{name} must be a float32 CUDA tensor")
    if o_part.dim() != 5 or m.shape != o_part.shape[:4] or l.shape != m.shape:
        raise ValueError("o_part must be [S, B, Hkv, Sq*G, D] with m and l [S, B, Hkv, Sq*G]")
    splits, batch, kv_heads, rows, head_dim = o_part.shape
    if rows != q_len * group:
        raise ValueError(f"o_part rows ({rows}) must equal q_len * group ({q_len * group})")
    if out_dtype not in _DTYPES:
        raise TypeError(f"out_dtype must be float16 or bfloat16, got {out_dtype}")
    if head_dim not in tunables.HEAD_DIMS:
        raise ValueError(f"head_dim must be one of {tunables.HEAD_DIMS}, got {head_dim}")
    Config(num_splits=splits, reduce_threads=reduce_threads).validate()
    o_part, m, l = (t.clone(memory_format=torch.contiguous_format)
                    if not t.is_contiguous() or t.data_ptr() % 16 else t for t in (o_part, m, l))
    out = torch.empty(batch, q_len, kv_heads * group, head_dim, dtype=out_dtype, device=o_part.device)
    lse = torch.empty(batch, kv_heads * group, q_len, dtype=torch.float32, device=o_part.device)
    _extension().combine(o_part, m, l, out, lse, q_len, group, reduce_threads)
    return out, lse
