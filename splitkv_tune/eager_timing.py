"""What a call costs when it is not captured in a CUDA graph: the host path and eager loops.

Graph replay (``bench.time_callable``) hides the host: every call's launch was recorded once.
A server that does not capture, and every prefill path, pays the host cost on each call, so
both figures here come beside the graph time:

* ``host``: host time per call, from ``time.perf_counter`` around ``CALLS`` calls queued
  behind a GPU sleep long enough that the GPU never makes the host wait. This is the Python
  wrapper, the checks, the allocations and the launch itself. A sample counts only if the GPU
  is still asleep when its last call returns; otherwise a call waited for the GPU (a read-back,
  a sync) and the sample holds GPU time too.
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


def queued_host_time(calls: Sequence[Callable[[], object]]) -> tuple[float, bool]:
    """Host µs per call of ``calls`` queued behind a GPU sleep, and whether the GPU was still
    asleep when the last one returned (else a call waited for it, and the figure holds that wait)."""
    torch.cuda._sleep(SLEEP_CYCLES_PER_CALL * len(calls))
    woken = torch.cuda.Event()
    woken.record()
    t0 = time.perf_counter()
    for fn in calls:
        fn()
    host = (time.perf_counter() - t0) * 1e6 / len(calls)
    asleep = not woken.query()
    torch.cuda.synchronize()
    return host, asleep


def time_eager(fns: Sequence[Callable[[], object]], device, *, warmup_s: float = 0.05,
               min_reps: int = 20, max_time_s: float = 0.2) -> tuple[Timing, Timing]:
    """``(host, eager)`` timings of ``fns`` (one call per input set) on a CUDA device, µs per call.
    When no host sample was taken with the GPU still asleep (a call waits for the GPU, so every
    sample measured the GPU too), ``host`` is a failed Timing (NaN) that says so."""
    device = torch.device(device)
    calls = _calls(list(fns))
    with torch.inference_mode(), torch.cuda.device(device):
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
        while not sampling_done(len(eager), time.perf_counter() - start, min_reps, max_time_s):
            per_call, asleep = queued_host_time(calls)
            if asleep:
                host.append(per_call)

            begin = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            begin.record()
            for fn in calls:
                fn()
            end.record()
            torch.cuda.synchronize(device)
            eager.append(begin.elapsed_time(end) * 1e3 / len(calls))
    loop = Timing.from_samples(eager, "eager_events", len(fns))
    if not host:
        return (Timing.failure("failed", "no sample with the GPU still asleep after the queued calls: a call "
                               "waits for the GPU, so its host cost cannot be told apart from the GPU's",
                               "host_wallclock"), loop)
    return Timing.from_samples(host, "host_wallclock", len(fns)), loop
