"""Timing used by every command (bench, sweep, compare): one measurement discipline.

* CUDA: the calls are captured in a CUDA graph and each sample is one graph replay
  bracketed by CUDA events, divided by the launches in the graph (``method="cuda_graph"``);
  when capture fails, events bracket one pass over the calls queued behind a GPU sleep
  (``"cuda_events"``). CPU: ``time.perf_counter`` around one pass (``"wallclock"``).
* Warm-up runs for ``warmup_s`` seconds first. Sampling then runs until ``max_time_s`` has
  passed and at least ``min_reps`` samples exist (``min_reps`` wins), at most ``max_reps``.
* Cold L2: the calls rotate over input sets whose total footprint is at least twice the
  device's L2 (``torch.cuda.get_device_properties(...).L2_cache_size``).
* Before a config is timed its output is checked against ``reference.attention_ref`` in
  fp32; the tolerance is twice the error of plain PyTorch attention computed in the input
  dtype plus a small absolute term. A wrong or NaN output gives ``status="wrong"`` and is
  never timed.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import math
import statistics
import time
from typing import Callable, Sequence

import torch

from splitkv_tune import tunables
from splitkv_tune.tunables import Config, Shape

BACKENDS = ("cuda", "reference")
TORCH_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
ABS_TOLERANCE = {"fp16": 1e-3, "bf16": 4e-3}
MAX_INPUT_SETS = 1024
MIN_LAUNCHES_PER_GRAPH = 16
MAX_REPS = 2000
# Workspace of our kernel's timed calls: none passed (the default call) or one preallocated.
WORKSPACES = ("default", "preallocated")
FAILURE_EXCEPTIONS = (ValueError, TypeError, RuntimeError, AssertionError)


@dataclasses.dataclass
class Timing:
    """One measurement: raw per-launch samples in µs and their summary."""

    samples_us: list[float]
    median_us: float
    p20_us: float
    p80_us: float
    iqr_us: float
    n: int
    status: str = "ok"
    reason: str = ""
    method: str = ""
    input_sets: int = 1
    max_abs_err: float | None = None

    @classmethod
    def from_samples(cls, samples_us: Sequence[float], method: str,
                     input_sets: int = 1) -> "Timing":
        """Summarise raw samples.

        >>> t = Timing.from_samples([float(x) for x in range(1, 11)], "wallclock")
        >>> t.median_us, t.p20_us, t.p80_us, t.iqr_us, t.n
        (5.5, 2.8, 8.2, 4.5, 10)
        """
        xs = sorted(float(x) for x in samples_us)
        return cls(samples_us=list(samples_us), median_us=statistics.median(xs),
                   p20_us=_quantile(xs, 0.2), p80_us=_quantile(xs, 0.8),
                   iqr_us=_quantile(xs, 0.75) - _quantile(xs, 0.25), n=len(xs),
                   method=method, input_sets=input_sets)

    @classmethod
    def failure(cls, status: str, reason: str, method: str = "",
                max_abs_err: float | None = None) -> "Timing":
        nan = float("nan")
        return cls([], nan, nan, nan, nan, 0, status=status, reason=reason, method=method,
                   max_abs_err=max_abs_err)

    def gbps(self, nbytes: int) -> float:
        """Bytes moved per second, 1e9 units (NaN unless ok)."""
        if self.status != "ok" or not self.median_us > 0:
            return float("nan")
        return nbytes / self.median_us / 1e3


def _quantile(sorted_xs: Sequence[float], q: float) -> float:
    """Linear-interpolated quantile of already sorted values."""
    pos = (len(sorted_xs) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return sorted_xs[lo] + (sorted_xs[hi] - sorted_xs[lo]) * (pos - lo)


def describe_error(err: BaseException, limit: int = 300) -> str:
    text = f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"
    return text[:limit]


def default_device(backend: str) -> torch.device:
    if backend == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def sampling_done(n: int, elapsed: float, min_reps: int, max_time_s: float) -> bool:
    """The sampling rule of every timing here: ``max_time_s`` passed and ``min_reps`` taken, or
    ``MAX_REPS`` taken."""
    return n >= MAX_REPS or (n >= min_reps and elapsed >= max_time_s)


def _time_wallclock(fns, warmup_s, min_reps, max_time_s) -> Timing:
    start = time.perf_counter()
    while True:
        for fn in fns:
            fn()
        if time.perf_counter() - start >= warmup_s:
            break
    samples = []
    start = time.perf_counter()
    while not sampling_done(len(samples), time.perf_counter() - start, min_reps, max_time_s):
        t0 = time.perf_counter()
        for fn in fns:
            fn()
        samples.append((time.perf_counter() - t0) * 1e6 / len(fns))
    return Timing.from_samples(samples, "wallclock", len(fns))


def capture_graph(fns, device) -> tuple["torch.cuda.CUDAGraph", int]:
    """The graph every CUDA timing replays: ``fns`` repeated to at least
    ``MIN_LAUNCHES_PER_GRAPH`` launches, after one warm-up pass on a side stream.
    Returns the graph and the launches it holds."""
    repeat = max(1, math.ceil(MIN_LAUNCHES_PER_GRAPH / len(fns)))
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for fn in fns:
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeat):
            for fn in fns:
                fn()
    torch.cuda.synchronize(device)
    return graph, repeat * len(fns)


def _time_cuda(fns, device, warmup_s, min_reps, max_time_s, method) -> Timing:
    run: Callable[[], object]
    launches = len(fns)
    used = "cuda_events"
    if method in ("auto", "cuda_graph"):
        try:
            graph, launches = capture_graph(fns, device)
            run, used = graph.replay, "cuda_graph"
        except RuntimeError:
            if method == "cuda_graph":
                raise
            torch.cuda.synchronize(device)
    if used == "cuda_events":
        def run():
            for fn in fns:
                fn()
    start = time.perf_counter()
    while True:
        run()
        torch.cuda.synchronize(device)
        if time.perf_counter() - start >= warmup_s:
            break
    pairs = []
    start = time.perf_counter()
    samples: list[float] = []
    while not sampling_done(len(samples), time.perf_counter() - start, min_reps, max_time_s):
        if used == "cuda_events":
            torch.cuda._sleep(200_000)  # lets the host queue the batch ahead of the GPU
        pairs = []
        for _ in range(8):
            begin = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            begin.record()
            run()
            end.record()
            pairs.append((begin, end))
        torch.cuda.synchronize(device)
        samples.extend(b.elapsed_time(e) * 1e3 / launches for b, e in pairs)
    return Timing.from_samples(samples, used, len(fns))


def time_callable(fns: Sequence[Callable[[], object]], *, device=None, warmup_s: float = 0.05,
                  min_reps: int = 20, max_time_s: float = 0.2, method: str = "auto") -> Timing:
    """Time ``fns`` (one call per input set, run in rotation); each sample is µs per call.

    >>> t = time_callable([lambda: sum(range(100))], warmup_s=0, min_reps=5, max_time_s=0)
    >>> t.n, t.method, t.status
    (5, 'wallclock', 'ok')
    """
    if not fns:
        raise ValueError("time_callable needs at least one callable")
    device = torch.device(device) if device is not None else torch.device("cpu")
    with torch.inference_mode():
        if device.type == "cuda":
            return _time_cuda(list(fns), device, warmup_s, min_reps, max_time_s, method)
        return _time_wallclock(list(fns), warmup_s, min_reps, max_time_s)


def copy_bandwidth_gbps(device=None, nbytes: int | None = None, **timing_kwargs) -> float:
    """Device-to-device copy bandwidth: (bytes read + bytes written) / median time, 1e9 B/s."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    if nbytes is None:
        if device.type == "cuda":
            l2 = torch.cuda.get_device_properties(device).L2_cache_size
            nbytes = max(512 << 20, 8 * l2)
        else:
            nbytes = 16 << 20
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    nbytes = src.numel() * 4
    # Events, not graph replay: graph-captured copy_ read 2.76 TB/s on an H200 (2026-11-29)
    # against 4.25-4.28 TB/s timed eagerly (DESIGN.md); capture likely makes it a memcpy node.
    timing_kwargs.setdefault("method", "cuda_events")
    timing = time_callable([lambda: dst.copy_(src)], device=device, **timing_kwargs)
    return 2 * nbytes / timing.median_us / 1e3


def input_sets_needed(shape: Shape, device) -> int:
    """Input sets to rotate so that their footprint is at least twice the L2 (1 on CPU)."""
    return sets_for_bytes(shape.bytes_moved(), device)


def sets_for_bytes(nbytes: int, device) -> int:
    """Input sets of ``nbytes`` each to rotate so that they cover twice the L2 (1 on CPU)."""
    device = torch.device(device)
    if device.type != "cuda":
        return 1
    l2 = torch.cuda.get_device_properties(device).L2_cache_size
    return int(min(MAX_INPUT_SETS, max(1, math.ceil(2 * l2 / nbytes))))


def make_inputs(shape: Shape, device, n_sets: int = 1, seed: int = 0) -> list[tuple]:
    """``n_sets`` fresh (q, k, v) triples in FlashAttention layout."""
    device = torch.device(device)
    dtype = TORCH_DTYPES[shape.dtype]
    gen = torch.Generator(device=device).manual_seed(seed)
    q_shape = (shape.batch, shape.q_len, shape.q_heads, shape.head_dim)
    kv_shape = (shape.batch, shape.kv_len, shape.kv_heads, shape.head_dim)
    return [tuple(torch.randn(s, generator=gen, device=device, dtype=dtype)
                  for s in (q_shape, kv_shape, kv_shape)) for _ in range(n_sets)]


def attention_in_dtype(q, k, v, causal: bool, scale: float) -> torch.Tensor:
    """Plain attention with matmuls in the input dtype (the error budget's yardstick)."""
    group = q.shape[2] // k.shape[2]
    qt = q.transpose(1, 2)
    kt = k.transpose(1, 2).repeat_interleave(group, dim=1)
    vt = v.transpose(1, 2).repeat_interleave(group, dim=1)
    scores = (qt @ kt.transpose(-1, -2)) * scale
    if causal:
        sq, sk = q.shape[1], k.shape[1]
        rows = torch.arange(sq, device=q.device)[:, None]
        cols = torch.arange(sk, device=q.device)[None, :]
        scores = scores.masked_fill(cols > rows + sk - sq, float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).nan_to_num(0.0).to(q.dtype)
    return (probs @ vt).transpose(1, 2)


def resolve_auto(shape: Shape, config: Config, num_sms: int = 132) -> Config:
    """Concrete config for the reference backend: ``"auto"`` fields get FA2's split count,
    ``block_kv=64``, ``reduce_threads=128`` and the ``blocks`` policy."""
    auto = {"num_splits": tunables.fa2_num_splits(shape, num_sms), "block_kv": 64,
            "reduce_threads": 128, "split_policy": "blocks"}
    return Config(**{f: auto[f] if getattr(config, f) == "auto" else getattr(config, f)
                     for f in auto})


class ShapeBench:
    """Inputs, reference and timing for one shape, reused across the configs measured on it."""

    def __init__(self, shape: Shape, *, backend: str = "cuda", device=None,
                 warmup_s: float = 0.05, min_reps: int = 20, max_time_s: float = 0.2,
                 check: bool = True, seed: int = 0, num_sms: int = 132, merge: str = "auto",
                 pdl: bool = True, workspace: str = "default"):
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        self.merge = tunables.check_merge(merge)
        self.pdl = pdl
        if workspace not in WORKSPACES:
            raise ValueError(f"workspace must be one of {WORKSPACES}, got {workspace!r}")
        self.workspace = workspace
        self.shape = shape.validate()
        self.backend = backend
        self.device = torch.device(device) if device is not None else default_device(backend)
        self.timing_kwargs = {"warmup_s": warmup_s, "min_reps": min_reps,
                              "max_time_s": max_time_s}
        self.check = check
        self.num_sms = num_sms
        self.scale = 1.0 / math.sqrt(shape.head_dim)
        self.inputs = make_inputs(shape, self.device, input_sets_needed(shape, self.device), seed)
        # The reference and the workspace, shared with the copies ``with_launch`` makes.
        self._shared: dict = {}

    def resolve(self, config: Config) -> Config:
        """``config`` with its ``"auto"`` fields filled as the launch fills them."""
        if self.backend == "reference":
            return resolve_auto(self.shape, config, self.num_sms).validate()
        from splitkv_tune import ops
        index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        return ops.resolve_config(self.shape, index, config.num_splits, config.block_kv,
                                  config.reduce_threads, config.split_policy)

    def with_launch(self, *, merge: str | None = None, pdl: bool | None = None,
                    workspace: str | None = None) -> "ShapeBench":
        """This bench (same inputs, reference and workspace) launching with another ``merge``,
        programmatic-launch setting (``pdl``, the kernel's ``enable_pdl``) or ``workspace``."""
        other = copy.copy(self)
        if merge is not None:
            other.merge = tunables.check_merge(merge)
        if pdl is not None:
            other.pdl = pdl
        if workspace is not None:
            if workspace not in WORKSPACES:
                raise ValueError(f"workspace must be one of {WORKSPACES}, got {workspace!r}")
            other.workspace = workspace
        return other

    def resolve_merge(self, config: Config) -> str:
        """How the launch of ``config`` merges its partials (``ops.resolve_merge``)."""
        c = self.resolve(config)
        if self.backend == "reference":
            return "none" if c.num_splits == 1 else "reference"
        from splitkv_tune import ops
        return ops.resolve_merge(self.shape, c, self.merge)

    def launchers(self, config: Config) -> list[Callable[[], torch.Tensor]]:
        """One zero-argument callable per input set, each running ``config`` on its set.

        With ``workspace="default"`` the calls are the user's default call: ``config`` as
        given ("auto" resolved by ``splitkv_attention``) and no workspace (the extension's
        cached one eagerly, the graph pool's under capture). With ``"preallocated"`` the
        config is resolved once and the calls share one buffer sized for its split count, as a
        server may preallocate it.
        """
        shape, c = self.shape, self.resolve(config)
        if self.backend == "reference":
            from splitkv_tune import reference
            return [functools.partial(reference.splitkv_attention_ref, q, k, v, causal=shape.causal,
                                      softmax_scale=self.scale, num_splits=c.num_splits,
                                      block_kv=c.block_kv, split_policy=c.split_policy)
                    for q, k, v in self.inputs]
        from splitkv_tune import ops
        workspace = None
        if self.workspace == "preallocated":
            workspace = self._workspace(tunables.workspace_bytes(shape, c.num_splits))
        else:
            c = config  # the default call: "auto" stays "auto", resolved by splitkv_attention
        return [functools.partial(ops.splitkv_attention, q, k, v, causal=shape.causal,
                                  softmax_scale=self.scale, num_splits=c.num_splits,
                                  block_kv=c.block_kv, reduce_threads=c.reduce_threads,
                                  split_policy=c.split_policy, merge=self.merge,
                                  enable_pdl=self.pdl, workspace=workspace)
                for q, k, v in self.inputs]

    def _workspace(self, nbytes: int) -> torch.Tensor | None:
        """One workspace shared by every input set (the launches are stream-ordered)."""
        if not nbytes:
            return None
        buffer = self._shared.get("workspace")
        if buffer is None or buffer.numel() < nbytes:
            self._shared.pop("workspace", None)  # free the old one before taking a larger one
            buffer = self._shared["workspace"] = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return buffer[:nbytes]

    def reference(self) -> tuple[torch.Tensor, float]:
        """fp32 reference output of input set 0 and the tolerance of this shape."""
        if "reference" not in self._shared:
            from splitkv_tune import reference
            q, k, v = self.inputs[0]
            outs, lowp_err = [], 0.0
            for b in range(self.shape.batch):
                qb, kb, vb = q[b:b + 1], k[b:b + 1], v[b:b + 1]
                ref = reference.attention_ref(qb.float(), kb.float(), vb.float(),
                                              causal=self.shape.causal,
                                              softmax_scale=self.scale)[0].float()
                lowp = attention_in_dtype(qb, kb, vb, self.shape.causal, self.scale)
                lowp_err = max(lowp_err, (lowp.float() - ref).abs().max().item())
                outs.append(ref)
            tol = 2 * lowp_err + ABS_TOLERANCE[self.shape.dtype]
            self._shared["reference"] = (torch.cat(outs), tol)
        return self._shared["reference"]

    def verify(self, out: torch.Tensor) -> tuple[bool, float, float]:
        """(passed, max abs error, tolerance) of one output against the fp32 reference."""
        ref, tol = self.reference()
        if out.shape != ref.shape:
            return False, float("nan"), tol
        err = (out.float() - ref).abs().max().item()
        return bool(err <= tol), err, tol  # NaN compares false: never passes

    def measure(self, config: Config) -> Timing:
        """Check then time ``config``; failures come back as a Timing with a reason."""
        return self._measure(lambda: self.launchers(config))

    def measure_launcher(self, make_fn: Callable[..., Callable[[], object]]) -> Timing:
        """Check then time ``make_fn(q, k, v)`` over the rotating input sets.

        ``make_fn`` returns a zero-argument callable whose result is the output in
        ``(B, Sq, Hq, D)`` layout (or a tuple starting with it).
        """
        return self._measure(lambda: [make_fn(*qkv) for qkv in self.inputs])

    def measure_eager(self, config: Config) -> tuple[Timing, Timing]:
        """``(host, eager)`` timings of ``config`` (``eager_timing``); run ``measure`` first to
        check its output."""
        from splitkv_tune import eager_timing
        return eager_timing.time_eager(self.launchers(config), self.device, **self.timing_kwargs)

    def measure_launcher_eager(self, make_fn: Callable[..., Callable[[], object]]) -> tuple[Timing, Timing]:
        """``(host, eager)`` timings of ``make_fn(q, k, v)`` over the rotating input sets."""
        from splitkv_tune import eager_timing
        return eager_timing.time_eager([make_fn(*qkv) for qkv in self.inputs], self.device,
                                       **self.timing_kwargs)

    def _measure(self, build: Callable[[], list[Callable[[], object]]]) -> Timing:
        """Check the first of the callables ``build()`` returns (one per input set), then time
        them all; failures, building included, come back as a Timing with a reason."""
        with torch.inference_mode():
            try:
                fns = build()
                out = fns[0]()
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
            except FAILURE_EXCEPTIONS as err:
                return Timing.failure("failed", describe_error(err))
            err_value = None
            if self.check:
                if isinstance(out, tuple):
                    out = out[0]
                try:
                    passed, err_value, tol = self.verify(out)
                except FAILURE_EXCEPTIONS as err:  # e.g. out of memory building the reference
                    return Timing.failure("failed", "reference: " + describe_error(err))
                if not passed:
                    return Timing.failure(
                        "wrong", f"max abs error {err_value:.3g} > tolerance {tol:.3g}",
                        max_abs_err=err_value)
            try:
                timing = time_callable(fns, device=self.device, **self.timing_kwargs)
            except FAILURE_EXCEPTIONS as err:
                return Timing.failure("failed", describe_error(err), max_abs_err=err_value)
        timing.max_abs_err = err_value
        return timing


def measure_config(shape: Shape, config: Config, *, backend: str = "cuda", device=None,
                   warmup_s: float = 0.05, min_reps: int = 20, max_time_s: float = 0.2,
                   check: bool = True) -> Timing:
    """Check and time one config on one shape (builds inputs; use ShapeBench for many)."""
    return ShapeBench(shape, backend=backend, device=device, warmup_s=warmup_s,
                      min_reps=min_reps, max_time_s=max_time_s, check=check).measure(config)


def backend_problem(backend: str) -> str | None:
    """Why ``backend`` cannot run here, or ``None`` when it can."""
    if backend == "reference":
        try:
            from splitkv_tune import reference  # noqa: F401
        except ImportError as err:
            return f"the reference backend cannot be imported ({describe_error(err)})"
        return None
    if not torch.cuda.is_available():
        return "the cuda backend needs a CUDA GPU and none is present"
    try:
        from splitkv_tune import ops  # noqa: F401
    except ImportError as err:
        return (f"the CUDA extension cannot be imported ({describe_error(err)}); "
                "run pip install -e .")
    return None
