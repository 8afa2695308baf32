"""What a sweep will cost before it runs: seconds per trial and bytes per shape, per backend.

* cuda: a call moves ``Shape.bytes_moved()`` at the GPU profile's copy bandwidth, and the
  inputs rotate over enough sets to fill twice the L2 (``bench.input_sets_needed``).
* reference: the PyTorch reference on the CPU does ``4·B·Hq·Sq·Sk·D`` flops per call at the
  rate it reaches on a calibration shape here (measured once, briefly), in float32, with K and V
  repeated to every query head and a few ``B·Hq·Sq·Sk`` score matrices alive at once.

A trial is the warm-up (at least one call), the samples (at least ``min_reps`` calls and at
least ``max_time_s``), one checking call and a fixed overhead. The numbers are estimates,
good to a small factor; what they are for is telling minutes from hours, and a shape that fits
from one that cannot.
"""
from __future__ import annotations

import functools
import math
import os
import time

from splitkv_tune.tunables import Shape

TRIAL_OVERHEAD_S = 0.05
SCORE_MATRICES = 3  # scores, probabilities and the mask's copy, as float32
FP32 = 4
CALIBRATION_SHAPE = Shape("bf16", 128, 1, 32, 8, 1, 4096)


@functools.lru_cache(maxsize=None)
def cpu_flops_per_s() -> float:
    """Attention flops per second the PyTorch reference reaches on this CPU: the best of a few
    calls on a calibration shape after a warm-up (about 0.1 s)."""
    import torch

    from splitkv_tune.reference import splitkv_attention_ref
    shape = CALIBRATION_SHAPE
    q = torch.randn(shape.batch, shape.q_len, shape.q_heads, shape.head_dim).bfloat16()
    k = torch.randn(shape.batch, shape.kv_len, shape.kv_heads, shape.head_dim).bfloat16()
    splitkv_attention_ref(q, k, k, num_splits=4)
    best = math.inf
    for _ in range(5):
        start = time.perf_counter()
        splitkv_attention_ref(q, k, k, num_splits=4)
        best = min(best, time.perf_counter() - start)
    return shape_flops(shape) / best


def shape_flops(shape: Shape) -> int:
    return 4 * shape.batch * shape.q_heads * shape.q_len * shape.kv_len * shape.head_dim


def call_seconds(shape: Shape, backend: str, copy_bw_gbps: float | None) -> float:
    if backend == "reference":
        return shape_flops(shape) / cpu_flops_per_s()
    return shape.bytes_moved() / ((copy_bw_gbps or 1000.0) * 1e9) + 5e-6


def trial_seconds(shape: Shape, backend: str, timing: dict,
                  copy_bw_gbps: float | None = None) -> float:
    call = call_seconds(shape, backend, copy_bw_gbps)
    sampling = max(timing["min_reps"] * call, timing["max_time_s"])
    return max(timing["warmup_s"], call) + sampling + call + TRIAL_OVERHEAD_S


def shape_bytes(shape: Shape, backend: str, l2_bytes: int | None = None) -> int:
    """Peak bytes one trial of ``shape`` holds on its device."""
    io = shape.bytes_moved()
    if backend == "reference":
        group = shape.q_heads // shape.kv_heads
        q_elems = shape.batch * shape.q_heads * shape.q_len * shape.head_dim
        kv_elems = 2 * shape.batch * shape.kv_heads * shape.kv_len * shape.head_dim
        scores = shape.batch * shape.q_heads * shape.q_len * shape.kv_len
        return io + FP32 * (q_elems + group * kv_elems + SCORE_MATRICES * scores)
    sets = 1 if not l2_bytes else max(1, math.ceil(2 * l2_bytes / io))
    return 2 * io * sets  # the kernel's inputs and outputs, and the reference's check


def available_bytes(backend: str) -> int | None:
    """Memory a trial may use: the CPU's available RAM, or the free memory of the GPU."""
    if backend == "reference":
        try:
            with open("/proc/meminfo") as handle:
                for line in handle:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    import torch
    if torch.cuda.is_available():
        return torch.cuda.mem_get_info()[0]
    return None


def human_bytes(n: float) -> str:
    """
    >>> human_bytes(17.2e9), human_bytes(3e6)
    ('17.2 GB', '3.0 MB')
    """
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


def human_seconds(s: float) -> str:
    """
    >>> human_seconds(90), human_seconds(7200), human_seconds(5)
    ('1.5 min', '2.0 h', '5 s')
    """
    if s >= 3600:
        return f"{s / 3600:.1f} h"
    if s >= 60:
        return f"{s / 60:.1f} min"
    return f"{s:.0f} s"
