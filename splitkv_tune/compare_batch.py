"""Our paged kernel against FlashInfer and padded SDPA on one variable-length batch.

One batch (``paged_batch.make_paged_batch``: shuffled pages, NaN outside the live keys) is
timed, in one process and one run, by every implementation:

* ``ours``: the default paged call (``block_kv``, ``min_blocks_per_split``, ``max_splits`` and
  ``merge`` all ``"auto"``), each sequence split by its own length;
* ``ours_one_split``: ``min_blocks_per_split=1, max_splits=S``, so every sequence of at least
  ``S`` blocks gets the same ``S`` splits, as a kernel with one split count per batch would;
* ``flashinfer_decode`` / ``flashinfer_decode_tc`` (``BatchDecodeWithPagedKVCacheWrapper``,
  CUDA cores / tensor cores, planned by its own ``plan()`` for these lengths),
  ``flashinfer_xqa`` (decode only) and ``flashinfer_prefill`` (any Sq; not in the defaults);
* ``sdpa_cudnn``: cuDNN SDPA on the batch padded to its longest sequence, unmasked: it reads
  ``max_len`` keys per sequence, so its output is not checked;
* ``ours_load_aware``: ours with ``split_plan="load_aware"``, ``min_blocks_per_split`` chosen
  per launch from the lengths among the ``"auto"`` knob's multiples (``plan.plan_min_blocks``);
* ``ours_contiguous``: ours with the same lengths in a padded contiguous cache (the paged
  path's overhead); for a batch of equal lengths also ``ours_equal_length`` (the equal-length
  call without ``cache_seqlens``, at the plan's split count and ``block_kv``) and ``ours_table``
  (that call with every tunable ``"auto"``, from the shipped table);
* ``copy_floor``: the live keys and values (``live_kv_bytes``) over the device's copy bandwidth.

Every row that runs our live path (``ours``, ``ours_one_split``, ``ours_load_aware``, the plan
rows, ``ours_wide<N>`` and ``ours_contiguous``) records its knobs in the columns
``KNOB_COLUMNS``, its ``"auto"`` knobs resolved as the call resolves them on this device's SM
count (``live.resolve_knobs``) and ``merge`` as what the call's ``"auto"`` merge becomes when a
sequence splits; the batch-class table (``batch_table``) is built from them. Peers, the floor and the equal-length rows leave
them empty, and so does every row off a CUDA device (no SM count to resolve ``"auto"`` with).

Timing is ``bench.time_callable`` with ``method="cuda_graph"`` (each sample a graph replay of
at least 16 calls, rotating over copies of the batch that cover twice the L2), the discipline
of ``compare``; a failure to capture or run is that row's ``reason``, never raised. Our calls
pass ``check_inputs=False``: a captured call must not read the check's answer back to the
host. The untimed first call of each implementation (``check_inputs=True`` for ours) gives the
output that is checked: against ``reference.splitkv_attention_ref`` in fp32 when the batch has at most
``REFERENCE_MAX_KEYS`` keys, else against the first FlashInfer peer that ran. With ``eager``
each implementation's eager loop and host cost are timed too (``EAGER_COLUMNS``): ours as a
user calls it, ``check_inputs=True``, in the loop, and without the check for the host cost.
"""
from __future__ import annotations

import functools
import math
from typing import Callable, NamedTuple

import pandas as pd
import torch

from splitkv_tune import batches, bench, compare, paged_batch, plan, space, tunables
from splitkv_tune.plan_points import plan_knobs, plan_row_name
from splitkv_tune import peers_flashinfer as pf
from splitkv_tune.tunables import Shape

PEERS = ("flashinfer_decode", "flashinfer_decode_tc", "flashinfer_xqa", "flashinfer_prefill",
         "sdpa_cudnn")
DEFAULT_PEERS = ("flashinfer_decode", "flashinfer_decode_tc", "flashinfer_xqa", "sdpa_cudnn")
ONE_SPLIT = 16
REFERENCE_MAX_KEYS = 300_000
TOLERANCE = {"bf16": 2e-2, "fp16": 1e-2}
# Of the device's free memory, what the padded copies of sdpa_cudnn may take.
PADDED_MEMORY_SHARE = 0.8
SDPA_NOTE = "padded to max_len and unmasked: reads max_len keys per sequence; output not checked"
KNOB_COLUMNS = ["block_kv", "min_blocks_per_split", "max_splits", "merge", "split_plan"]
# The knobs come last, so that a reader of the older CSVs finds their columns where they were.
COLUMNS = [
    "label", "batch", "min_len", "max_len", "mean_len", "total_len", "page_size", "q_heads",
    "kv_heads", "head_dim", "q_len", "dtype", "impl", "status", "median_us", "p20_us", "p80_us",
    "n", "method", "input_sets", "x_floor", "ours_speedup", "floor_us", "live_kv_bytes",
    "copy_bw_gbps", "max_abs_err", "check", "note", "reason"] + KNOB_COLUMNS
# With eager timing (run_compare_batch(eager=True)), after all others: a batch sweep's CSV keeps
# COLUMNS.
EAGER_COLUMNS = ["host_us", "eager_us"]


def check_peers(peers) -> None:
    """``ValueError`` naming the peers this benchmark does not know."""
    unknown = sorted(set(peers) - set(PEERS))
    if unknown:
        raise ValueError(f"unknown peer(s) {unknown}; choose from {PEERS}")


def our_attention(q, k_cache, v_cache, **kwargs):
    """Our kernel's paged call, ``splitkv_tune.ops.splitkv_attention``."""
    from splitkv_tune import ops
    return ops.splitkv_attention(q, k_cache, v_cache, **kwargs)


class Calls(NamedTuple):
    """One implementation's calls: the untimed first (its output is checked), one per input set
    for graph replay and for the host cost, and one per set for the eager loop (the call as a
    user makes it: ours checks its inputs there, as by default; a check waits for the GPU, so
    its host cost is timed on the unchecked calls)."""

    first: Callable
    timed: list[Callable]
    eager: list[Callable]


def _calls(first: Callable, timed: list[Callable], eager: list[Callable] | None = None) -> Calls:
    return Calls(first, timed, timed if eager is None else eager)


def _ours(sets: list[paged_batch.PagedBatch], **knobs) -> Calls:
    """The checked first call (lengths and pages validated), one unchecked call per set (a
    captured call checks nothing) and one checked call per set for the eager loop."""
    def call(s, check_inputs):
        return functools.partial(our_attention, s.q, s.k_pool, s.v_pool,
                                 cache_seqlens=s.cache_seqlens, block_table=s.block_table,
                                 check_inputs=check_inputs, **knobs)
    return _calls(call(sets[0], True), [call(s, False) for s in sets], [call(s, True) for s in sets])


def _ours_contiguous(sets: list[paged_batch.PagedBatch], uniform_splits: int | None = None,
                     **knobs) -> Calls:
    """Our kernel on the same batch in a contiguous cache, ``(B, max_len, Hkv, D)``: with the
    live lengths (``uniform_splits`` None), or, for a batch of equal lengths, as an equal-length
    call without them (``num_splits=uniform_splits``, or the table's ``"auto"`` when 0)."""
    padded = [s.padded_kv() for s in sets]

    def call(s, kv, check_inputs):
        if uniform_splits is None:
            return functools.partial(our_attention, s.q, *kv, cache_seqlens=s.cache_seqlens,
                                     check_inputs=check_inputs, **knobs)
        if uniform_splits == 0:
            return functools.partial(our_attention, s.q, *kv)
        return functools.partial(our_attention, s.q, *kv, num_splits=uniform_splits, split_policy="blocks",
                                 **knobs)
    return _calls(call(sets[0], padded[0], True), [call(s, kv, False) for s, kv in zip(sets, padded)],
                  [call(s, kv, True) for s, kv in zip(sets, padded)])


def _memory_problem(needs: int, device, what: str) -> str | None:
    """Why ``needs`` bytes of ``what`` do not fit in the device's free memory, or None."""
    if device.type != "cuda":
        return None
    free = torch.cuda.mem_get_info(device)[0]
    if needs > PADDED_MEMORY_SHARE * free:
        return (f"{what} take {needs / 2**30:.1f} GiB, more than {PADDED_MEMORY_SHARE:.0%} of the "
                f"{free / 2**30:.1f} GiB free")
    return None


def _ours_widened(sets: list[paged_batch.PagedBatch], mult: int) -> Calls:
    return _ours([s.widened(mult) for s in sets])


def _num_sms(device) -> int | None:
    """The SM count ``"auto"`` knobs are resolved with; None off a CUDA device."""
    if device.type != "cuda":
        return None
    from splitkv_tune import ops
    return ops._device_info(device.index)[1]


def _knob_columns(shape: Shape, num_sms: int | None, block_kv="auto", min_blocks_per_split="auto",
                  max_splits="auto", merge="auto", split_plan="fixed") -> dict:
    """A live-path row's ``KNOB_COLUMNS``, resolved as the call resolves them; empty without an
    SM count. ``merge``: what the call's merge is when a sequence splits (``tunables.split_merge``);
    ``min_blocks_per_split`` of a load-aware row: the base its launches choose from."""
    if num_sms is None:
        return {}
    from splitkv_tune import live
    try:
        knobs = live.resolve_knobs(shape.batch, shape.head_dim, shape.kv_heads, shape.packed_rows, num_sms,
                                   block_kv, min_blocks_per_split, max_splits)
    except ValueError:  # knobs the call refuses: its row fails and says why
        return {}
    return dict(zip(KNOB_COLUMNS, (*knobs, tunables.split_merge(shape, merge), split_plan)))


def _plan_splits(shape: Shape, device) -> int:
    """The split count the default paged call gives a sequence of ``shape.kv_len`` keys."""
    from splitkv_tune import live
    bkv, min_blocks, bound = live.resolve_knobs(shape.batch, shape.head_dim, shape.kv_heads, shape.packed_rows,
                                                _num_sms(device))
    return plan.live_splits(shape.kv_len, bkv, min_blocks, bound)


def _flashinfer_run(launch: pf.Launch, s: paged_batch.PagedBatch) -> Callable:
    q_rows = s.q.reshape(-1, *s.q.shape[2:])
    out = torch.empty_like(s.q)
    out_rows = out.view(q_rows.shape)

    def run():
        launch(q_rows, (s.k_pool, s.v_pool), out_rows)
        return out
    return run


def _flashinfer(name, shape, scale, sets) -> Calls:
    first = sets[0]
    launch = pf.paged_launcher(name, shape, scale, first.flashinfer,
                               block_table=first.block_table, seq_lens=first.cache_seqlens)
    fns = [_flashinfer_run(launch, s) for s in sets]
    return _calls(fns[0], fns)


def _padded_bytes(shape: Shape) -> int:
    """What one padded input set of sdpa_cudnn holds: k and v, (B, Hkv, max_len, D) each."""
    return 2 * shape.batch * shape.kv_heads * shape.kv_len * shape.head_dim * shape.element_bytes()


def _sdpa_needs(shape: Shape, device) -> int:
    # The padded copies of every set, and the one gathered from the pages before transposing.
    return _padded_bytes(shape) * (bench.sets_for_bytes(_padded_bytes(shape), device) + 1)


def _sdpa(shape, scale, sets, device) -> Calls:
    make = compare.peer_factory("sdpa_cudnn", shape, scale)
    k_pad, v_pad = sets[0].padded_kv()
    # make() keeps transposed copies of its own: each set is distinct memory.
    fns = [make(sets[0].q, k_pad, v_pad)
           for _ in range(bench.sets_for_bytes(_padded_bytes(shape), device))]
    return _calls(fns[0], fns)


def _measure(build: Callable[[], Calls], device, timing: dict,
             eager: bool) -> tuple[bench.Timing, torch.Tensor | None, float, float]:
    """Run the first call (its output is kept for the check), then time every call; with
    ``eager``, also its host and eager-loop µs per call (``eager_timing``; NaN without)."""
    none = (math.nan, math.nan)
    with torch.inference_mode():
        try:
            calls = build()
            out = calls.first()
            out = (out[0] if isinstance(out, tuple) else out).detach().float().clone()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        except (ImportError, AttributeError) + bench.FAILURE_EXCEPTIONS as err:
            return bench.Timing.failure("failed", bench.describe_error(err)), None, *none
        try:
            result = bench.time_callable(calls.timed, device=device, **timing)
        except bench.FAILURE_EXCEPTIONS as err:  # a graph that cannot be captured, among others
            return bench.Timing.failure("failed", bench.describe_error(err)), out, *none
    if not (eager and result.status == "ok"):
        return result, out, *none
    return result, out, *_eager_times(calls, device, timing)


def _eager_times(calls: Calls, device, timing: dict) -> tuple[float, float]:
    """Host µs per call of ``calls.timed`` and eager-loop µs per call of ``calls.eager``
    (``eager_timing``); NaN off a CUDA device."""
    if device.type != "cuda":
        return math.nan, math.nan
    from splitkv_tune import eager_timing
    kwargs = {k: v for k, v in timing.items() if k != "method"}
    host, loop = eager_timing.time_eager(calls.timed, device, **kwargs)
    if calls.eager is not calls.timed:
        loop = eager_timing.time_eager(calls.eager, device, **kwargs)[1]
    return host.median_us, loop.median_us


def _peer_problem(name: str, shape: Shape) -> str | None:
    """Why FlashInfer's peer ``name`` cannot run this batch, or None."""
    missing = pf.available()
    if missing:
        return missing
    try:
        pf.check_supported(name, shape)
    except ValueError as err:
        return str(err)
    return None


def _reference(batch: paged_batch.PagedBatch) -> torch.Tensor:
    from splitkv_tune import reference
    with torch.inference_mode():
        return reference.splitkv_attention_ref(
            batch.q.float(), batch.k_pool.float(), batch.v_pool.float(),
            cache_seqlens=batch.cache_seqlens, block_table=batch.block_table, block_kv=64,
            max_splits=1, min_blocks_per_split=1)


def _yardstick(batch, outputs: dict) -> tuple[torch.Tensor | None, str]:
    """The output to check against and its name, or None and why there is none."""
    total = sum(batch.lengths)
    if total <= REFERENCE_MAX_KEYS:
        try:
            return _reference(batch), "reference"
        except bench.FAILURE_EXCEPTIONS as err:
            return None, f"the reference failed ({bench.describe_error(err)})"
    for name in pf.NAMES:
        if outputs.get(name) is not None:
            return outputs[name], name
    return None, (f"{total} keys are more than the reference's {REFERENCE_MAX_KEYS} "
                  "and no FlashInfer peer ran")


def _check(name, out, expected, source, tol) -> tuple[str, float, bool]:
    """(check text, max abs error, passed) of one implementation's output."""
    if out is None:
        return "", math.nan, True
    if expected is None:
        return f"not checked: {source}", math.nan, True
    if name == source:
        return "the yardstick of the check", math.nan, True
    err = (out - expected.float()).abs().max().item() if out.shape == expected.shape else math.nan
    if err <= tol:  # NaN compares false: never passes
        return f"ok vs {source} (max abs {err:.2g})", err, True
    return f"wrong vs {source}: max abs {err:.3g} > {tol:g}", err, False


def input_memory_problem(lengths, *, kv_heads: int, head_dim: int, page_size: int, device) -> str | None:
    """Why one batch's inputs do not fit in the device's free memory (``_memory_problem``), or
    None: the K and V page pools of every rotated input set, and their fp32 copies when the
    output is checked against the reference."""
    device = torch.device(device)
    element = 2  # both DTYPES are 16-bit
    row = kv_heads * head_dim
    live = 2 * sum(lengths) * row * element
    pools = 2 * sum(math.ceil(n / page_size) for n in lengths) * page_size * row
    needs = pools * element * bench.sets_for_bytes(live, device)
    if sum(lengths) <= REFERENCE_MAX_KEYS:
        needs += pools * 4
    return _memory_problem(needs, device, "the batch's page pools")


def run_compare_batch(lengths, *, q_heads: int = 32, kv_heads: int = 8, head_dim: int = 128,
                      q_len: int = 1, dtype: str = "bf16", page_size: int = 64,
                      peers=DEFAULT_PEERS, one_split: int | None = ONE_SPLIT, device=None,
                      timing: dict | None = None, copy_bw: float | None = None,
                      label: str | None = None, seed: int = 0, plans=(), wider=(),
                      layout_rows: bool = True, eager: bool = False) -> pd.DataFrame:
    """Time ours, ours_one_split, ``peers`` and the copy floor on one batch; one row each.

    ``lengths`` is a ``batches`` text or a sequence of ints; ``copy_bw`` (GB/s) is measured
    when not given. ``one_split`` None: no ours_one_split row. ``plans``:
    ``(min_blocks_per_split, max_splits[, block_kv[, merge[, split_plan]]])`` tuples
    (``plan_points.plan_point``), each
    timed as one more row of ours (named by ``plan_row_name``). ``wider``: factors ``N``, each timed as ours behind a
    block table ``N`` times wider (``ours_wide<N>``: capacity invariance). ``layout_rows``
    False: no ours_load_aware, ours_contiguous, ours_equal_length and ours_table rows (a sweep
    of the paged knobs needs none of them). ``eager``: the columns ``EAGER_COLUMNS`` too, each
    implementation's host µs and eager-loop µs per call (ours with ``check_inputs=True``, the
    default call; its host µs without the check, which waits for the GPU).
    """
    check_peers(peers)
    if label is None:
        label = lengths if isinstance(lengths, str) else ",".join(str(n) for n in lengths)
    lengths = batches.parse_lengths(lengths) if isinstance(lengths, str) else tuple(lengths)
    summary = batches.describe(lengths)
    device = torch.device(device) if device is not None else bench.default_device("cuda")
    timing = dict(timing or space.TIMING_DEFAULTS)
    if copy_bw is None:
        copy_bw = bench.copy_bandwidth_gbps(device, **timing)
    if device.type == "cuda":
        timing["method"] = "cuda_graph"
    shape = Shape(dtype, head_dim, len(lengths), q_heads, kv_heads, q_len, summary["max"], False)
    scale = 1.0 / math.sqrt(head_dim)
    first = paged_batch.make_paged_batch(
        lengths, q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim, q_len=q_len, dtype=dtype,
        page_size=page_size, device=device, seed=seed)
    sets = [first] + [first.copy() for _ in range(bench.sets_for_bytes(first.live_kv_bytes, device) - 1)]
    num_sms = _num_sms(device)
    auto_knobs = _knob_columns(shape, num_sms)
    # (name, build, note, why it is skipped or None, knob columns)
    impls = [("ours", lambda: _ours(sets), "", None, auto_knobs)]
    if one_split is not None:
        impls.append(("ours_one_split", lambda: _ours(sets, min_blocks_per_split=1, max_splits=one_split),
                      f"min_blocks_per_split=1, max_splits={one_split}", None,
                      _knob_columns(shape, num_sms, min_blocks_per_split=1, max_splits=one_split)))
    for point in plans:
        knobs = plan_knobs(point)
        name = plan_row_name(knobs["min_blocks_per_split"], knobs["max_splits"], knobs["block_kv"], knobs["merge"],
                             knobs["split_plan"])
        impls.append((name, functools.partial(_ours, sets, **knobs),
                      ", ".join(f"{k}={v}" for k, v in knobs.items() if v not in ("auto", "fixed")), None,
                      _knob_columns(shape, num_sms, **knobs)))
    page_bytes = first.k_pool[0].numel() * first.k_pool.element_size()
    for mult in wider:
        pages = max(first.block_table.shape[1] * mult, first.k_pool.shape[0])
        impls.append((f"ours_wide{mult}", functools.partial(_ours_widened, sets, mult),
                      f"block table {mult}x wider, pools padded to its width",
                      _memory_problem(2 * len(sets) * pages * page_bytes, device, f"the {mult}x wider pools"),
                      auto_knobs))
    if layout_rows:
        impls.append(("ours_load_aware", lambda: _ours(sets, split_plan="load_aware"),
                      "split_plan='load_aware': min_blocks_per_split chosen per launch from the lengths", None,
                      _knob_columns(shape, num_sms, split_plan="load_aware")))
        # Every set is padded into a contiguous cache of its own.
        contiguous = _memory_problem(len(sets) * _padded_bytes(shape), device, "the padded contiguous caches")
        impls.append(("ours_contiguous", lambda: _ours_contiguous(sets),
                      "the same lengths in a contiguous cache (B, max_len, Hkv, D)", contiguous, auto_knobs))
        if len(set(lengths)) == 1 and device.type == "cuda":
            splits = _plan_splits(shape, device)
            impls.append(("ours_equal_length", lambda: _ours_contiguous(sets, splits, block_kv=64),
                          f"equal-length call, no cache_seqlens: num_splits={splits} (the plan's), block_kv=64",
                          contiguous, {}))
            impls.append(("ours_table", lambda: _ours_contiguous(sets, 0),
                          "equal-length call, no cache_seqlens, every tunable 'auto' (the table)", contiguous, {}))
    for name in peers:
        if name == "sdpa_cudnn":
            impls.append((name, lambda: _sdpa(shape, scale, sets, device), SDPA_NOTE,
                          _memory_problem(_sdpa_needs(shape, device), device, "the padded batch's copies"), {}))
        else:
            impls.append((name, functools.partial(_flashinfer, name, shape, scale, sets), "",
                          _peer_problem(name, shape), {}))
    results, outputs = {}, {}
    for name, build, note, reason, knobs in impls:
        if reason:
            results[name] = (bench.Timing.failure("skipped", reason), note, knobs, math.nan, math.nan)
            continue
        with compare.peer_backend(name):
            result, out, host_us, eager_us = _measure(build, device, timing, eager)
        results[name] = (result, note, knobs, host_us, eager_us)
        if name != "sdpa_cudnn":
            outputs[name] = out
        if device.type == "cuda":
            torch.cuda.empty_cache()
    expected, source = _yardstick(first, outputs)
    floor_us = first.live_kv_bytes / copy_bw / 1e3
    ours_us = results["ours"][0].median_us
    base = {"label": label, "batch": summary["batch"], "min_len": summary["min"],
            "max_len": summary["max"], "mean_len": summary["mean"], "total_len": summary["total"],
            "page_size": page_size, "q_heads": q_heads, "kv_heads": kv_heads,
            "head_dim": head_dim, "q_len": q_len, "dtype": dtype, "floor_us": floor_us,
            "live_kv_bytes": first.live_kv_bytes, "copy_bw_gbps": copy_bw}
    rows = []
    for name, (result, note, knobs, host_us, eager_us) in results.items():
        check, err, passed = _check(name, outputs.get(name), expected, source, TOLERANCE[dtype])
        if name == "sdpa_cudnn" and result.status == "ok":
            check = "not checked: padded, unmasked"
        rows.append({**base, "impl": name, "status": result.status if passed else "wrong",
                     "median_us": result.median_us, "p20_us": result.p20_us,
                     "p80_us": result.p80_us, "n": result.n, "method": result.method,
                     "input_sets": result.input_sets, "x_floor": result.median_us / floor_us,
                     "ours_speedup": result.median_us / ours_us, "max_abs_err": err,
                     "check": check, "note": note, "reason": result.reason, "host_us": host_us,
                     "eager_us": eager_us, **knobs})
    rows.append({**base, "impl": "copy_floor", "status": "ok", "median_us": floor_us,
                 "p20_us": math.nan, "p80_us": math.nan, "n": 0,
                 "method": "live_kv_bytes / copy bandwidth", "input_sets": 1, "x_floor": 1.0,
                 "ours_speedup": floor_us / ours_us, "max_abs_err": math.nan, "check": "",
                 "note": f"{first.live_kv_bytes / 1e6:.1f} MB at {copy_bw:.0f} GB/s", "reason": "",
                 "host_us": math.nan, "eager_us": math.nan})
    frame = pd.DataFrame(rows, columns=COLUMNS + (EAGER_COLUMNS if eager else []))
    # Nullable ints: a knob is written 64, not 64.0, beside the rows that have none.
    return frame.astype({c: "Int64" for c in KNOB_COLUMNS[:3]})


def run_compare_batches(texts, *, device=None, timing: dict | None = None, progress=None,
                        **kwargs) -> pd.DataFrame:
    """``run_compare_batch`` of each ``batches`` text, with one copy-bandwidth measurement."""
    device = torch.device(device) if device is not None else bench.default_device("cuda")
    timing = dict(timing or space.TIMING_DEFAULTS)
    copy_bw = bench.copy_bandwidth_gbps(device, **timing)
    frames = []
    for text in texts:
        if progress:
            progress(text)
        frames.append(run_compare_batch(text, device=device, timing=timing, copy_bw=copy_bw,
                                        **kwargs))
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return pd.concat(frames, ignore_index=True)


def _cell(value: float, digits: int = 1, suffix: str = "") -> str:
    return f"{value:.{digits}f}{suffix}" if math.isfinite(value) else "-"


def markdown_report(results: pd.DataFrame) -> str:
    """One table per batch: median µs, p20-p80, times the copy floor, ours' speed-up over each
    implementation (its µs / ours µs), the eager-loop and host µs per call when timed, the check
    and notes."""
    parts = []
    eager = "eager_us" in results.columns
    head = (["impl", "µs", "p20-p80 µs", "x floor", "ours speed-up"] + (["eager µs", "host µs"] if eager else [])
            + ["check", "note"])
    for label, group in results.groupby("label", sort=False):
        r = group.iloc[0]
        parts.append(
            f"### `{label}`\n\nB = {r['batch']}, lengths {r['min_len']}-{r['max_len']} (mean "
            f"{r['mean_len']:.0f}, {r['total_len']} keys), page {r['page_size']}, Hq {r['q_heads']}, "
            f"Hkv {r['kv_heads']}, D {r['head_dim']}, Sq {r['q_len']}, {r['dtype']}; live K/V "
            f"{r['live_kv_bytes'] / 1e6:.1f} MB, copy floor {r['floor_us']:.1f} µs "
            f"({r['copy_bw_gbps']:.0f} GB/s)\n")
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for _, row in group.iterrows():
            ok = row["status"] == "ok"
            spread = (f"{row['p20_us']:.1f}-{row['p80_us']:.1f}"
                      if math.isfinite(row["p20_us"]) else "-")
            note = "; ".join(x for x in (row["note"], row["reason"]) if x)
            lines.append("| " + " | ".join([
                row["impl"], _cell(row["median_us"]) if ok else row["status"], spread,
                _cell(row["x_floor"], 2, "x"), _cell(row["ours_speedup"], 2, "x"),
                *([_cell(row["eager_us"]), _cell(row["host_us"])] if eager else []),
                row["check"], note.replace("|", "/")]) + " |")
        parts.append("\n".join(lines) + "\n")
    return "\n".join(parts)
