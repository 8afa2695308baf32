"""Our kernel against its peers, all timed by ``bench`` in one run on the same inputs.

Peers: ``sdpa_flash`` and ``sdpa_cudnn`` (``torch.nn.functional.scaled_dot_product_attention``
under ``sdpa_kernel(FLASH_ATTENTION | CUDNN_ATTENTION)``, inputs copied to contiguous
``(B, H, S, D)`` before timing, ``enable_gqa`` for GQA/MQA, a lower-right causal mask when
``Sq > 1``) and ``flex`` (``torch.compile``'d ``flex_attention`` with the Dynamo recompile
limit raised so every shape compiles). A peer that raises or returns a wrong answer is
reported as failed with its reason. The floor is the bytes moved divided by the copy
bandwidth measured in the same run. ``ours`` is the call a user makes with default
arguments: no workspace passed, programmatic dependent launch on. ``with_no_pdl`` also times
it without programmatic launch (``ours_no_pdl``) and ``with_preallocated`` with one
preallocated workspace (``ours_preallocated``); neither is a peer. ``eager`` adds, for every
implementation, its host µs per call and its µs per call in an eager loop
(``eager_timing``) beside the graph-replay median.
"""
from __future__ import annotations

import contextlib
import math
from typing import Callable

import pandas as pd
import torch

from splitkv_tune import bench, peers_flashinfer, space, table
from splitkv_tune.table_schema import SHAPE_COLUMNS
from splitkv_tune.tunables import Config, Shape

PEERS = ("sdpa_flash", "sdpa_cudnn", "flex") + peers_flashinfer.NAMES
AUTO_CONFIG = Config("auto", "auto", "auto", "auto")
COMPARE_COLUMNS = SHAPE_COLUMNS + [
    "impl", "config", "median_us", "p20_us", "p80_us", "iqr_us", "n", "status", "reason",
    "gbps", "frac_copy_bw", "floor_us", "copy_bw_gbps", "method", "run_id", "host_us", "eager_us"]
DYNAMO_RECOMPILE_LIMIT = 1024
_compiled_flex = None


def _flex():
    """``torch.compile(flex_attention)`` once per process, with recompile headroom."""
    global _compiled_flex
    if _compiled_flex is None:
        import torch._dynamo
        from torch.nn.attention.flex_attention import flex_attention
        for name in ("cache_size_limit", "recompile_limit", "accumulated_cache_size_limit",
                     "accumulated_recompile_limit"):
            if hasattr(torch._dynamo.config, name):
                setattr(torch._dynamo.config, name, DYNAMO_RECOMPILE_LIMIT)
        _compiled_flex = torch.compile(flex_attention, dynamic=False)
    return _compiled_flex


def _causal_mask(shape: Shape):
    """Bottom-right aligned causal mask as SDPA takes it, or None when nothing is masked."""
    if not shape.causal or shape.q_len == 1:
        return None
    from torch.nn.attention.bias import causal_lower_right
    return causal_lower_right(shape.q_len, shape.kv_len)


def peer_backend(name: str):
    """The context in which peer ``name`` is built and timed: SDPA restricted to the peer's
    backend (so a call that backend cannot serve fails instead of falling back), else none."""
    if name not in ("sdpa_flash", "sdpa_cudnn"):
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    return sdpa_kernel(SDPBackend.FLASH_ATTENTION if name == "sdpa_flash" else SDPBackend.CUDNN_ATTENTION)


def peer_factory(name: str, shape: Shape, scale: float) -> Callable:
    """``make_fn(q, k, v)`` for ``bench.ShapeBench.measure_launcher``."""
    if name in peers_flashinfer.NAMES:
        return peers_flashinfer.factory(name, shape, scale)
    gqa = shape.q_heads != shape.kv_heads
    if name in ("sdpa_flash", "sdpa_cudnn"):

        def make(q, k, v):
            qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))
            mask = _causal_mask(shape)

            def run():
                # The backend is chosen around the whole measurement (peer_backend), not per
                # call: entering sdpa_kernel costs more host time than the call itself, and
                # a server sets its backend once.
                out = torch.nn.functional.scaled_dot_product_attention(
                    qt, kt, vt, attn_mask=mask, scale=scale, enable_gqa=gqa)
                return out.transpose(1, 2)
            return run
        return make
    if name == "flex":
        from torch.nn.attention.flex_attention import create_block_mask

        def make(q, k, v):
            qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))
            block_mask = None
            if shape.causal and shape.q_len > 1:
                offset = shape.kv_len - shape.q_len
                block_mask = create_block_mask(
                    lambda b, h, qi, ki: ki <= qi + offset, B=None, H=None,
                    Q_LEN=shape.q_len, KV_LEN=shape.kv_len, device=q.device)
            flex = _flex()

            def run():
                out = flex(qt, kt, vt, block_mask=block_mask, scale=scale, enable_gqa=gqa)
                return out.transpose(1, 2)
            return run
        return make
    raise ValueError(f"unknown peer {name!r}; choose from {PEERS}")


def our_config(shape: Shape, heuristics: pd.DataFrame | None, fixed: Config | None) -> Config:
    """The config we run: a fixed one, else the table's winner, else ``"auto"`` (selector)."""
    if fixed is not None:
        return fixed
    return table.lookup_config(heuristics, shape) or AUTO_CONFIG


def _row(shape: Shape, impl: str, config: str, timing: bench.Timing, copy_bw: float,
         run_id: str) -> dict:
    gbps = timing.gbps(shape.bytes_moved())
    row = {c: getattr(shape, c) for c in SHAPE_COLUMNS}
    row["causal"] = int(shape.causal)
    row.update(impl=impl, config=config, median_us=timing.median_us, p20_us=timing.p20_us,
               p80_us=timing.p80_us, iqr_us=timing.iqr_us, n=timing.n, status=timing.status,
               reason=timing.reason, gbps=gbps, frac_copy_bw=gbps / copy_bw,
               floor_us=shape.bytes_moved() / copy_bw / 1e3, copy_bw_gbps=copy_bw,
               method=timing.method, run_id=run_id, host_us=math.nan, eager_us=math.nan)
    return row


def run_compare(shapes: list[Shape], *, backend: str = "cuda", peers=PEERS,
                heuristics: pd.DataFrame | None = None, fixed: Config | None = None,
                timing: dict | None = None, run_id: str = "", device=None,
                progress=None, with_no_pdl: bool = False, with_preallocated: bool = False,
                eager: bool = False) -> pd.DataFrame:
    """Time ours and every peer on each shape; one row per (shape, implementation)."""
    from tqdm.auto import tqdm

    timing = timing or dict(space.TIMING_DEFAULTS)
    device = torch.device(device) if device is not None else bench.default_device(backend)
    copy_bw = bench.copy_bandwidth_gbps(device, **timing)
    eager = eager and backend == "cuda"
    rows = []
    disable = None if progress is None else not progress
    for shape in tqdm(shapes, desc="compare", unit="shape", disable=disable):
        shape_bench = bench.ShapeBench(shape, backend=backend, device=device, **timing)
        config = our_config(shape, heuristics, fixed)
        key = space.config_key(config)
        ours = [("ours", shape_bench)]
        if with_no_pdl and backend == "cuda":
            ours.append(("ours_no_pdl", shape_bench.with_launch(pdl=False)))
        if with_preallocated and backend == "cuda":
            ours.append(("ours_preallocated", shape_bench.with_launch(workspace="preallocated")))
        for name, launch_bench in ours:
            result = launch_bench.measure(config)
            rows.append(_row(shape, name, key, result, copy_bw, run_id))
            if eager and result.status == "ok":
                _add_eager(rows[-1], *launch_bench.measure_eager(config))
        for peer in peers:
            try:
                with peer_backend(peer):
                    make = peer_factory(peer, shape, shape_bench.scale)
                    result = shape_bench.measure_launcher(make)
                    if eager and result.status == "ok":
                        host, eager_timing = shape_bench.measure_launcher_eager(make)
            except (ImportError, AttributeError) + bench.FAILURE_EXCEPTIONS as err:
                result = bench.Timing.failure("failed", bench.describe_error(err))
            rows.append(_row(shape, peer, "", result, copy_bw, run_id))
            if eager and result.status == "ok":
                _add_eager(rows[-1], host, eager_timing)
        del shape_bench
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return pd.DataFrame(rows, columns=COMPARE_COLUMNS)


def _add_eager(row: dict, host: bench.Timing, eager: bench.Timing) -> None:
    row.update(host_us=host.median_us, eager_us=eager.median_us)


def _fmt_us(value: float) -> str:
    return "failed" if not math.isfinite(value) else f"{value:.1f}"


def markdown_report(results: pd.DataFrame) -> str:
    """The graph-replay table, then, when the run timed them, the eager and host tables."""
    parts = [markdown_table(results)]
    for column, title in (("eager_us", "Eager loop, µs per call"), ("host_us", "Host µs per call")):
        if column in results and results[column].notna().any():
            parts.append(f"\n{title}:\n\n" + markdown_table(results, column))
    return "".join(parts)


def markdown_table(results: pd.DataFrame, column: str = "median_us") -> str:
    """Wide markdown: µs per implementation (graph-replay medians, or ``column``), ours as % of
    copy bandwidth, speedup vs the best peer (best peer µs / ours µs) and its geometric mean.
    Implementations named ``ours*`` are our own launch variants, never the best peer. Host time
    (``host_us``) moves no bytes: its table has no floor and no copy-bandwidth column.

    >>> r = pd.DataFrame([
    ...   dict(dtype="bf16", head_dim=128, causal=0, batch=1, q_heads=32, kv_heads=8, q_len=1,
    ...        kv_len=4096, impl=i, config="", median_us=us, status="ok", frac_copy_bw=f,
    ...        floor_us=3.9) for i, us, f in (("ours", 10.0, 0.4), ("sdpa_flash", 20.0, 0.2))])
    >>> print(markdown_table(r).splitlines()[2])
    | 1 | 32 | 8 | 1 | 4096 | 128 | bf16 | 0 | 3.9 | 10.0 | 20.0 | 40.0% | 2.00x |
    """
    impls = list(dict.fromkeys(results["impl"]))
    peers = [i for i in impls if not i.startswith("ours")]
    with_floor = column != "host_us"
    head = ["B", "Hq", "Hkv", "Sq", "Sk", "D", "dtype", "causal"] + ["floor µs"] * with_floor \
        + [f"{i} µs" for i in impls] + ["ours % copy bw"] * with_floor + ["speedup vs best peer"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    speedups = []
    keys = ["batch", "q_heads", "kv_heads", "q_len", "kv_len", "head_dim", "dtype", "causal"]
    for key, group in results.groupby(keys, sort=False):
        by_impl = {r["impl"]: r for _, r in group.iterrows()}
        us = {i: (float(by_impl[i][column]) if i in by_impl
                  and by_impl[i]["status"] == "ok" else float("nan")) for i in impls}
        ours = us.get("ours", float("nan"))
        best_peer = min((us[p] for p in peers if math.isfinite(us[p])), default=float("nan"))
        speed = best_peer / ours if math.isfinite(best_peer) and math.isfinite(ours) else None
        if speed is not None:
            speedups.append(speed)
        if "ours" not in by_impl:
            frac = float("nan")
        elif column == "median_us":
            frac = by_impl["ours"]["frac_copy_bw"]
        else:
            frac = by_impl["ours"]["floor_us"] / ours
        cells = [str(k) for k in key] + [f"{float(group['floor_us'].iloc[0]):.1f}"] * with_floor
        cells += [_fmt_us(us[i]) for i in impls]
        cells += [f"{100 * frac:.1f}%" if math.isfinite(ours) else "-"] * with_floor
        cells += [f"{speed:.2f}x" if speed is not None else "-"]
        lines.append("| " + " | ".join(cells) + " |")
    if speedups:
        geo = math.exp(sum(math.log(s) for s in speedups) / len(speedups))
        lines.append("")
        lines.append(f"Geometric mean speedup vs best peer: {geo:.2f}x over {len(speedups)} shapes")
    return "\n".join(lines) + "\n"
