"""``splitkv_attention``: validation, workspace, dispatch and ``torch.library`` registration.

Everything is checked here before a pointer reaches the kernels; bad input raises
``ValueError`` or ``TypeError`` naming the argument and what was expected.
"""
from __future__ import annotations

import functools
import math
import operator

import torch
from torch.utils.weak import WeakIdKeyDictionary

from splitkv_tune import tunables
from splitkv_tune.tunables import Config, Shape

_DTYPES = {torch.float16: ("fp16", 0), torch.bfloat16: ("bf16", 1)}
_POLICY_CODES = {"length": 0, "blocks": 1}
_MAX_GRID_Y = 65535
_workspaces: dict[tuple[int, int], torch.Tensor] = {}
# The fused merge's tile counters, one zeroed buffer per workspace tensor: launches that share
# a workspace are already ordered with each other, so they may share its counters too.
_counters = WeakIdKeyDictionary()


@functools.lru_cache(maxsize=1)
def _extension():
    try:
        from splitkv_tune import _C
    except ImportError as err:
        raise RuntimeError(
            "the CUDA extension splitkv_tune._C is not built (installed with SPLITKV_BUILD_CUDA=0 "
            "or without nvcc). Rebuild on a machine with nvcc: `pip install -e .`") from err
    return _C


@functools.lru_cache(maxsize=None)
def _device_info(index: int) -> tuple[str, int]:
    props = torch.cuda.get_device_properties(index)
    return props.name, props.multi_processor_count


def _check_tensor(name: str, t, rank: int) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in _DTYPES:
        raise TypeError(f"{name} must be float16 or bfloat16, got {t.dtype}")
    if t.device.type != "cuda":
        raise ValueError(f"{name} must be on a CUDA device, got {t.device}")
    if t.dim() != rank:
        raise ValueError(f"{name} must have {rank} dimensions (batch, seq, heads, head_dim), "
                         f"got shape {tuple(t.shape)}")


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """The tensor itself when its rows are 16-byte aligned (the kernels' vector loads), else a copy.

    ``clone`` rather than ``contiguous``: a contiguous view at an odd offset must be copied too.
    """
    ok = t.data_ptr() % 16 == 0 and all(s * t.element_size() % 16 == 0 for s in t.stride()[:-1])
    return t if ok else t.clone(memory_format=torch.contiguous_format)


def problem_shape(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False) -> Shape:
    """Validate q, k, v against each other and return the problem's ``Shape``."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_tensor(name, t, 4)
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k and v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if k.device != q.device or v.device != q.device:
        raise ValueError(f"q, k and v must be on one device, got {q.device}, {k.device}, {v.device}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dim (stride 1), got stride {t.stride(-1)}")
    batch, q_len, q_heads, head_dim = (int(x) for x in q.shape)
    if k.shape[0] != batch:
        raise ValueError(f"k batch ({k.shape[0]}) must equal q batch ({batch})")
    if k.shape[3] != head_dim:
        raise ValueError(f"k head_dim ({k.shape[3]}) must equal q head_dim ({head_dim})")
    if batch * k.shape[2] > _MAX_GRID_Y:
        raise ValueError(f"batch * kv_heads must be at most {_MAX_GRID_Y}, got {batch * k.shape[2]}")
    if max(k.shape[1], q_len * (q_heads // max(1, k.shape[2]))) >= 2**31:
        raise ValueError("kv_len and q_len * (q_heads / kv_heads) must be below 2**31")
    dtype = _DTYPES[q.dtype][0]
    return Shape(dtype, head_dim, batch, q_heads, int(k.shape[2]), q_len, int(k.shape[1]),
                 bool(causal)).validate()


@torch.compiler.assume_constant_result
def _auto_fields(shape_fields: tuple, device_index: int) -> tuple:
    # Reads tables from disk: evaluated once at trace time under torch.compile.
    from splitkv_tune import selector
    name, sms = _device_info(device_index)
    c = selector.auto_config(Shape(*shape_fields), name, sms)
    return c.num_splits, c.block_kv, c.reduce_threads, c.split_policy


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
        if name != "split_policy" and not isinstance(value, bool):
            try:
                value = operator.index(value)  # numpy and torch integers too
            except TypeError:
                raise ValueError(f"{name} must be an integer or 'auto', got {value!r}") from None
        given[name] = value
        Config(**{name: value}).validate()
    if any(_is_auto(v) for v in given.values()):
        fields = (shape.dtype, shape.head_dim, shape.batch, shape.q_heads, shape.kv_heads,
                  shape.q_len, shape.kv_len, shape.causal)
        auto = dict(zip(given, _auto_fields(fields, device_index)))
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
    if config.num_splits == 1:
        return "none"
    if merge == "auto":
        return "fused" if tunables.fused_merge_fits(shape) else "kernel"
    return merge


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


def _workspace_for(q: torch.Tensor, nbytes: int, workspace) -> torch.Tensor:
    if workspace is not None:
        if workspace.numel() < nbytes:
            raise ValueError(f"workspace must hold at least {nbytes} bytes, got {workspace.numel()}")
        if workspace.data_ptr() % tunables.WORKSPACE_ALIGN:
            raise ValueError(f"workspace must be {tunables.WORKSPACE_ALIGN}-byte aligned")
        return workspace
    if torch.cuda.is_current_stream_capturing():
        # Memory taken during capture belongs to the graph's pool: never cache it.
        return torch.empty(max(nbytes, 1), dtype=torch.uint8, device=q.device)
    # One buffer per (device, stream): calls on one stream run in order, so reuse is safe there;
    # the allocator keeps a replaced buffer alive until that stream's queued work has used it.
    key = (q.device.index, torch.cuda.current_stream(q.device).stream_id)
    cached = _workspaces.get(key)
    if cached is None or cached.numel() < nbytes:
        cached = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=q.device)
        _workspaces[key] = cached
    return cached


def _tile_counters(workspace: torch.Tensor, count: int) -> torch.Tensor:
    """The fused merge's int32 counters for ``workspace``, one per query tile: zeroed when
    allocated here, and every launch leaves them zero. A workspace first seen during CUDA-graph
    capture gets counters from the graph's pool, zeroed inside the graph."""
    counters = _counters.get(workspace)
    if counters is None or counters.numel() < count:
        counters = torch.zeros(max(count, 1024), dtype=torch.int32, device=workspace.device)
        _counters[workspace] = counters
    return counters


def _strides(prefix: str, t: torch.Tensor) -> dict:
    return {f"{prefix}_batch_stride": t.stride(0), f"{prefix}_row_stride": t.stride(1),
            f"{prefix}_head_stride": t.stride(2)}


def _attention_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  workspace: torch.Tensor | None, causal: bool, softmax_scale: float, num_splits: int, block_kv: int,
                  reduce_threads: int, split_policy: int, return_lse: bool, fused_merge: bool,
                  pdl: bool) -> tuple[torch.Tensor, torch.Tensor]:
    ext = _extension()
    q, k, v = _aligned(q), _aligned(k), _aligned(v)
    batch, q_len, q_heads, head_dim = q.shape
    kv_heads = k.shape[2]
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty((batch, q_heads, q_len) if return_lse else (0,), dtype=torch.float32,
                      device=q.device)
    shape = Shape(_DTYPES[q.dtype][0], head_dim, batch, q_heads, kv_heads, q_len, k.shape[1], causal)
    m_off, l_off, nbytes = tunables.workspace_sections(shape, num_splits)
    workspace = _workspace_for(q, nbytes, workspace)
    base = workspace.data_ptr()
    counters = 0
    if fused_merge and num_splits > 1:
        counters = _tile_counters(workspace, batch * kv_heads * tunables.num_m_blocks(shape)).data_ptr()
    stream = torch.cuda.current_stream(q.device).cuda_stream
    common = {"out": out.data_ptr(), "lse": lse.data_ptr() if return_lse else 0,
              "ws_o": base, "ws_m": base + m_off, "ws_l": base + l_off, "tile_counters": counters,
              "batch": batch, "q_len": q_len, "kv_heads": kv_heads,
              "dtype": _DTYPES[q.dtype][1], "head_dim": head_dim, "stream": stream, "pdl": pdl,
              **_strides("o", out)}
    with torch.cuda.device(q.device):
        ext.split_forward({**common, **_strides("q", q), **_strides("k", k), **_strides("v", v),
                           "q": q.data_ptr(), "k": k.data_ptr(), "v": v.data_ptr(),
                           "q_heads": q_heads, "kv_len": k.shape[1], "num_splits": num_splits,
                           "block_m": tunables.block_m_for(shape.packed_rows),
                           "block_kv": block_kv, "softmax_scale": softmax_scale,
                           "causal": causal, "split_policy": split_policy,
                           "device": q.device.index})
        if num_splits > 1 and not fused_merge:
            ext.combine_forward({**common, "group": q_heads // kv_heads, "num_splits": num_splits,
                                 "reduce_threads": reduce_threads})
    return out, lse


# Registered for torch.compile; eager calls skip the dispatcher's per-call cost.
_attention_op = torch.library.custom_op("splitkv::attention", mutates_args=("workspace",))(
    _attention_impl)


@_attention_op.register_fake
def _(q, k, v, workspace, causal, softmax_scale, num_splits, block_kv, reduce_threads,
      split_policy, return_lse, fused_merge, pdl):
    batch, q_len, q_heads, _ = q.shape
    lse_shape = (batch, q_heads, q_len) if return_lse else (0,)
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            q.new_empty(lse_shape, dtype=torch.float32))


def splitkv_attention(q, k, v, *, causal=False, softmax_scale=None, num_splits="auto",
                      block_kv="auto", reduce_threads="auto", split_policy="auto",
                      merge="auto", workspace=None, return_lse=False, enable_pdl=True,
                      cache_seqlens=None, block_table=None):
    """Split-KV attention forward.

    q ``(B, Sq, Hq, D)``, k and v ``(B, Sk, Hkv, D)``, fp16 or bf16 on one CUDA device,
    last dim contiguous; ``Hq`` a multiple of ``Hkv`` (GQA/MQA). Causal masks are aligned
    bottom-right. Returns ``out (B, Sq, Hq, D)`` in q's dtype, and with ``return_lse``
    also ``lse (B, Hq, Sq)`` float32 in natural log (``-inf`` for rows with no key).
    Tunables left at ``"auto"`` come from the heuristic table for this GPU (or the
    analytic fallback). ``merge``: ``"auto"``, ``"fused"`` (the last split CTA of each query
    tile merges it) or ``"kernel"`` (the combine kernel); see ``resolve_merge``. ``workspace``:
    optional uint8 tensor of at least ``workspace_size(q, k, num_splits)`` bytes, 128-byte
    aligned; otherwise a per-device buffer is cached (preallocate one before CUDA-graph capture).
    ``enable_pdl``: launch the kernels with programmatic dependent launch (sm_90 and newer;
    ignored on older GPUs), so that the launch and the index arithmetic overlap the previous
    kernel of the stream; every memory access still waits until that kernel has finished.
    """
    if cache_seqlens is not None or block_table is not None:
        raise ValueError("cache_seqlens and block_table (paged / variable-length KV) are not "
                         "supported by this release; pass None")
    shape = problem_shape(q, k, v, causal)
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(shape.head_dim)
    if not isinstance(softmax_scale, (int, float)) or not math.isfinite(softmax_scale):
        raise ValueError(f"softmax_scale must be a finite number, got {softmax_scale!r}")
    config = resolve_config(shape, q.device.index, num_splits, block_kv, reduce_threads, split_policy)
    fused_merge = resolve_merge(shape, config, merge) == "fused"
    _check_workspace(q, workspace)
    if not isinstance(enable_pdl, bool):
        raise TypeError(f"enable_pdl must be True or False, got {enable_pdl!r}")
    op = _attention_op if torch.compiler.is_compiling() else _attention_impl
    out, lse = op(q, k, v, workspace, bool(causal), float(softmax_scale), config.num_splits,
                  config.block_kv, config.reduce_threads, _POLICY_CODES[config.split_policy],
                  bool(return_lse), fused_merge, enable_pdl)
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
    with torch.cuda.device(o_part.device):
        _extension().combine_forward({
            "ws_o": o_part.data_ptr(), "ws_m": m.data_ptr(), "ws_l": l.data_ptr(),
            "out": out.data_ptr(), "lse": lse.data_ptr(), **_strides("o", out),
            "batch": batch, "kv_heads": kv_heads, "group": group, "q_len": q_len,
            "num_splits": splits, "dtype": _DTYPES[out_dtype][1], "head_dim": head_dim,
            "reduce_threads": reduce_threads, "pdl": False,
            "stream": torch.cuda.current_stream(o_part.device).cuda_stream})
    return out, lse
