"""What a call costs when it is not captured in a CUDA graph: the host path and eager loops.

Graph replay (``bench.time_callable``) hides the host: every call's launch was recorded once.
A server that does not capture, and every prefill path, pays the host cost on each call, so
both figures here come beside the graph time:

* ``host``: host time per call, from ``time.perf_counter`` around ``CALLS`` calls queued
  behind a GPU sleep long enough that the GPU never makes the host wait. This is the Python
  wrapper, the checks, the allocations and the launch itself.
* ``eager``: device time per call of ``CALLS`` back-to-back eager calls, CUDA events around
  them and no sleep in front, so the GPU waits whenever the host is slower: the larger of the
  host cost and the kernel time, plus the launch gaps, as an eager loop sees it.

Both rotate over the same input sets as the graph timing (cold L2) and store median, p20/p80
and count like it.
"""
from __future__ import annotations

import time
from typing import Callable, Sequence

import torch

from splitkv_tune.bench import Timing, sampling_done

CALLS = 64
# Cycles of GPU sleep per queued call: ~50 µs at ~2 GHz, well above any host cost measured.
SLEEP_CYCLES_PER_CALL = 100_000


def _calls(fns: Sequence[Callable[[], object]]) -> list[Callable[[], object]]:
    return [fns[i % len(fns)] for i in range(max(CALLS, len(fns)))]


def time_eager(fns: Sequence[Callable[[], object]], device, *, warmup_s: float = 0.05,
               min_reps: int = 20, max_time_s: float = 0.2) -> tuple[Timing, Timing]:
    """``(host, eager)`` timings of ``fns`` (one call per input set) on a CUDA device, µs per call."""
    device = torch.device(device)
    calls = _calls(list(fns))
    with torch.inference_mode():
        start = time.perf_counter()
        while True:
            for fn in calls:
                fn()
            torch.cuda.synchronize(device)
            if time.perf_counter() - start >= warmup_s:
                break
        host: list[float] = []
        eager: list[float] = []
        start = time.perf_counter()
        while not sampling_done(len(host), time.perf_counter() - start, min_reps, max_time_s):
            torch.cuda._sleep(SLEEP_CYCLES_PER_CALL * len(calls))
            t0 = time.perf_counter()
            for fn in calls:
                fn()
            host.append((time.perf_counter() - t0) * 1e6 / len(calls))
            torch.cuda.synchronize(device)

            begin = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            begin.record()
            for fn in calls:
                fn()
            end.record()
            torch.cuda.synchronize(device)
            eager.append(begin.elapsed_time(end) * 1e3 / len(calls))
    return (Timing.from_samples(host, "host_wallclock", len(fns)),
            Timing.from_samples(eager, "eager_events", len(fns)))
