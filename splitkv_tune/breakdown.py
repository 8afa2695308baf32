"""Where one call's device time goes: per-kernel time under CUDA-graph replay.

The kernels of one call are traced with ``torch.profiler`` (CUPTI) while the graph that
``bench`` times is replayed. Kernels can overlap (the combine kernel is launched with
programmatic dependent launch and waits inside the split kernel's tail), so each kernel is
charged only the time it adds to the timeline: from the later of its start and the previous
kernel's end, to its own end. Whatever the kernels do not cover is launch gap.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Callable, Iterable, Sequence

import torch

from splitkv_tune import bench

TEMPLATE_ARGS = re.compile(r"<.*")


@dataclasses.dataclass(frozen=True)
class KernelSpan:
    """One kernel execution on the device timeline, in µs."""

    name: str
    start_us: float
    end_us: float


def short_name(name: str) -> str:
    """Kernel name without return type, namespaces and template arguments.

    >>> short_name("void splitkv::split_kv_kernel<splitkv::Traits<128, 16> >(splitkv::P)")
    'split_kv_kernel'
    >>> short_name("sm90_flash_fwd")
    'sm90_flash_fwd'
    """
    base = TEMPLATE_ARGS.sub("", name).split("(")[0].strip()
    return base.split(" ")[-1].split("::")[-1]


def exclusive_times(spans: Iterable[KernelSpan]) -> dict[str, tuple[int, float]]:
    """Per kernel name: (launches, µs it adds to the timeline), overlaps charged once.

    >>> spans = [KernelSpan("split", 0.0, 10.0), KernelSpan("combine", 8.0, 12.0),
    ...          KernelSpan("split", 20.0, 30.0), KernelSpan("combine", 31.0, 33.0)]
    >>> exclusive_times(spans)
    {'split': (2, 20.0), 'combine': (2, 4.0)}
    """
    out: dict[str, tuple[int, float]] = {}
    frontier = float("-inf")
    for span in sorted(spans, key=lambda s: s.start_us):
        added = max(0.0, span.end_us - max(span.start_us, frontier))
        frontier = max(frontier, span.end_us)
        count, total = out.get(span.name, (0, 0.0))
        out[span.name] = (count + 1, total + added)
    return out


def breakdown_rows(spans: Sequence[KernelSpan], calls: int, per_call_us: float) -> list[dict]:
    """Rows of the breakdown table: each kernel's share of one call, then the launch gap.

    >>> spans = [KernelSpan("split", 0.0, 9.0), KernelSpan("combine", 9.0, 10.0)]
    >>> [(r["kernel"], r["us_per_call"], r["share"]) for r in breakdown_rows(spans, 1, 12.5)]
    [('split', 9.0, 0.72), ('combine', 1.0, 0.08), ('(gaps)', 2.5, 0.2)]
    """
    rows = []
    covered = 0.0
    for name, (count, total) in exclusive_times(spans).items():
        us = total / calls
        covered += us
        rows.append({"kernel": name, "launches_per_call": count / calls, "us_per_call": us,
                     "share": us / per_call_us})
    gap = max(0.0, per_call_us - covered)
    rows.append({"kernel": "(gaps)", "launches_per_call": float("nan"), "us_per_call": gap,
                 "share": gap / per_call_us})
    return rows


def trace_graph(fns: Sequence[Callable[[], object]], device, replays: int = 10) -> tuple[
        list[KernelSpan], int]:
    """Replay the graph ``bench`` times for ``fns`` under the profiler; returns the kernel
    spans and the number of calls traced."""
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError("a kernel breakdown needs the cuda backend and a CUDA device")
    with torch.inference_mode():
        graph, launches = bench.capture_graph(list(fns), device)
        graph.replay()
        torch.cuda.synchronize(device)
        activities = [torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) as prof:
            for _ in range(replays):
                graph.replay()
            torch.cuda.synchronize(device)
    spans = [KernelSpan(short_name(e.name), e.time_range.start, e.time_range.end)
             for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
             and not e.name.startswith(("Memcpy", "Memset"))]
    if not spans:
        raise RuntimeError("the profiler recorded no kernel (is CUPTI available?)")
    return spans, replays * launches


def config_breakdown(shape_bench: "bench.ShapeBench", config, per_call_us: float) -> list[dict]:
    """Breakdown rows of one config on the inputs ``shape_bench`` times; shares are of
    ``per_call_us``, the config's measured (untraced) time per call."""
    spans, calls = trace_graph(shape_bench.launchers(config), shape_bench.device)
    return breakdown_rows(spans, calls, per_call_us)
