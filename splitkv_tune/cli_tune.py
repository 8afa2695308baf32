"""``splitkv-tune bench | sweep | table | compare | env``: thin click layers over the modules."""
from __future__ import annotations

import itertools
import json
import re
from pathlib import Path

import click

from splitkv_tune import space, tunables
from splitkv_tune.cli_errors import STDOUT, check_output, exit_2_on_bad_input
from splitkv_tune.tunables import Config, Shape

BACKEND_OPTION = click.option("--backend", type=click.Choice(["cuda", "reference"]),
                              default="cuda", show_default=True,
                              help="cuda: the kernel; reference: the PyTorch reference "
                                   "(runs on the CPU, for testing the pipeline).")


def check_timing_option(ctx, param, value):
    if value is None:
        return value
    problem = space.timing_problem(param.name, value)
    if problem:
        raise click.BadParameter(problem)
    return value


def grid_options(fn):
    """``--grid`` and the filters of its shapes, one meaning in every command that takes a grid."""
    for opt in reversed([
        click.option("--grid", default="quick", show_default=True, help="quick, full or a YAML path."),
        click.option("--dtype", "dtypes", multiple=True, type=click.Choice(tunables.DTYPES),
                     help="Only these dtypes of the grid."),
        click.option("--head-dim", "head_dims", multiple=True, type=int, help="Only these head dims."),
        click.option("--shapes", "patterns", multiple=True,
                     help="Only shapes whose key matches this glob, e.g. '*_b1_*'."),
    ]):
        fn = opt(fn)
    return fn


def _timing_options(fn):
    for opt in reversed([
        click.option("--warmup-s", type=float, default=None, callback=check_timing_option,
                     help="Warm-up seconds per config (default: the grid's, else 0.05)."),
        click.option("--min-reps", type=int, default=None, callback=check_timing_option,
                     help="Fewest samples per config, at least 1 "
                          "(default: the grid's, else 20)."),
        click.option("--max-time-s", type=float, default=None, callback=check_timing_option,
                     help="Sampling time per config once --min-reps is met "
                          "(default: the grid's, else 0.2)."),
    ]):
        fn = opt(fn)
    return fn


def _timing(base: dict, warmup_s, min_reps, max_time_s) -> dict:
    timing = dict(base)
    for key, value in (("warmup_s", warmup_s), ("min_reps", min_reps), ("max_time_s", max_time_s)):
        if value is not None:
            timing[key] = value
    return timing


def _parse_list(values, name: str, cast):
    """Comma lists from repeated options, e.g. ``--splits 1,8 --splits 16``; ``auto`` kept."""
    out = []
    for value in values:
        for item in str(value).split(","):
            item = item.strip()
            if not item:
                continue
            if item == "auto":
                out.append("auto")
                continue
            try:
                out.append(cast(item))
            except ValueError:
                raise click.BadParameter(f"{item!r} is not a valid value", param_hint=name)
    return list(dict.fromkeys(out)) or ["auto"]


def _on_off(text: str) -> bool:
    """``True`` for ``on``, ``False`` for ``off``, else ``ValueError``.

    >>> _on_off("off")
    False
    """
    if text not in ("on", "off"):
        raise ValueError(text)
    return text == "on"


def parse_duration(text: str | None) -> float | None:
    """Seconds from ``90``, ``90s``, ``30m``, ``8h`` or ``1h30m``.

    >>> parse_duration("1h30m"), parse_duration("45"), parse_duration(None)
    (5400.0, 45.0, None)
    """
    if text is None:
        return None
    if re.fullmatch(r"\d+(\.\d+)?", text):
        seconds = float(text)
    else:
        parts = re.findall(r"(\d+(?:\.\d+)?)([hms])", text)
        if not parts or "".join(a + b for a, b in parts) != text.replace(" ", ""):
            raise click.BadParameter(f"{text!r} is not a duration like 90s, 30m or 8h",
                                     param_hint="--time-budget")
        seconds = sum(float(n) * {"h": 3600, "m": 60, "s": 1}[unit] for n, unit in parts)
    if seconds <= 0:
        raise click.BadParameter(f"{text!r} leaves no time to sweep: give a duration above 0",
                                 param_hint="--time-budget")
    return seconds


def _backend_or_exit(backend: str) -> None:
    from splitkv_tune import bench
    problem = bench.backend_problem(backend)
    if problem:
        raise click.UsageError(f"--backend {backend}: {problem}")


def _num_sms(backend: str, gpu: str | None) -> int:
    import torch
    from splitkv_tune import gpus
    if backend == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    profile = gpus.profile_for(gpu) if gpu else None
    return profile.sms if profile else 132


def _smem_limit(backend: str, profile) -> int | None:
    """Opt-in shared memory per block of the device (or of the named GPU's profile)."""
    import torch
    if backend == "cuda" and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        limit = getattr(props, "shared_memory_per_block_optin", None)
        if limit:
            return int(limit)
    return profile.smem_per_block if profile else None


def _grid_shapes(grid, dtypes, head_dims, patterns):
    """Load ``--grid`` and apply the shape filters; usage errors name the option."""
    try:
        grid_obj = space.load_grid(grid)
    except space.GridError as err:
        raise click.BadParameter(str(err), param_hint="--grid")
    shapes = space.filter_shapes(grid_obj.shapes, dtypes=dtypes, head_dims=head_dims,
                                 patterns=patterns)
    if not shapes:
        raise click.UsageError(f"no shape of grid {grid!r} matches --dtype/--head-dim/--shapes")
    return grid_obj, shapes


def _check_fits(shape: Shape, backend: str) -> None:
    """A usage error for a shape whose sizes overflow or whose tensors cannot fit."""
    from splitkv_tune import estimate
    from splitkv_tune.table_schema import MAX_DIM
    for name in ("batch", "q_heads", "kv_heads", "q_len", "kv_len"):
        if getattr(shape, name) > MAX_DIM:
            raise click.BadParameter(f"at most {MAX_DIM}, got {getattr(shape, name)}",
                                     param_hint="--" + name.replace("_", "-"))
    needs, available = estimate.shape_bytes(shape, backend), estimate.available_bytes(backend)
    if available is not None and needs > available:
        raise click.UsageError(f"bad shape: it needs about {estimate.human_bytes(needs)} on the "
                               f"{backend} backend, which has {estimate.human_bytes(available)}")


@click.command()
@click.option("--batch", type=int, default=1, show_default=True)
@click.option("--q-heads", type=int, default=32, show_default=True)
@click.option("--kv-heads", type=int, default=8, show_default=True)
@click.option("--q-len", type=int, default=1, show_default=True)
@click.option("--kv-len", type=int, default=4096, show_default=True)
@click.option("--head-dim", type=int, default=128, show_default=True)
@click.option("--dtype", type=click.Choice(tunables.DTYPES), default="bf16", show_default=True)
@click.option("--causal/--no-causal", default=False, show_default=True)
@click.option("--splits", multiple=True,
              help="num_splits values, comma separated or repeated; auto.")
@click.option("--block-kv", multiple=True, help="BLOCK_KV values (32, 64, 128) or auto.")
@click.option("--reduce-threads", multiple=True, help="Combine block sizes (64, 128, 256) or auto.")
@click.option("--policy", multiple=True, help="Split policies (length, blocks) or auto.")
@click.option("--merge", multiple=True,
              help="How partials are merged: auto, fused (the last split CTA of each query "
                   "tile), kernel (the combine kernel); comma separated or repeated. Default auto.")
@click.option("--pdl", multiple=True,
              help="Programmatic dependent launch (the kernel's enable_pdl): on, off or on,off "
                   "to time both side by side. Default on.")
@BACKEND_OPTION
@click.option("--no-check", is_flag=True, help="Skip the check against the reference.")
@click.option("--csv", "csv_path", type=click.Path(dir_okay=False, allow_dash=True),
              help="Also write the rows here; - prints them as CSV instead of the table.")
@click.option("--json", "as_json", is_flag=True, help="Print the rows as JSON.")
@click.option("--breakdown", is_flag=True,
              help="Also trace each config's kernels: time each adds per call, and launch gaps "
                   "(cuda backend).")
@click.option("--eager", is_flag=True,
              help="Also time each config uncaptured: host µs per call and eager µs per call "
                   "of back-to-back calls, beside SDPA flash and cuDNN timed the same way "
                   "(cuda backend).")
@click.option("--workspace", type=click.Choice(["default", "preallocated"]), default="default",
              show_default=True,
              help="Our calls pass no workspace (the default call) or share one preallocated.")
@_timing_options
@exit_2_on_bad_input
def bench(batch, q_heads, kv_heads, q_len, kv_len, head_dim, dtype, causal, splits, block_kv,
          reduce_threads, policy, merge, pdl, backend, no_check, csv_path, as_json, breakdown, eager,
          workspace, warmup_s, min_reps, max_time_s):
    """Time one shape with one or several configs (the product of the lists)."""
    from splitkv_tune import bench as bench_mod
    from splitkv_tune import table

    try:
        shape = Shape(dtype, head_dim, batch, q_heads, kv_heads, q_len, kv_len, causal).validate()
    except ValueError as err:
        raise click.UsageError(f"bad shape: {err}")
    _check_fits(shape, backend)
    check_output(csv_path, "--csv", allow_stdout=True)
    configs = [Config(*values) for values in itertools.product(
        _parse_list(splits, "--splits", int), _parse_list(block_kv, "--block-kv", int),
        _parse_list(reduce_threads, "--reduce-threads", int), _parse_list(policy, "--policy", str))]
    if breakdown and backend != "cuda":
        raise click.UsageError("--breakdown traces CUDA kernels: it needs --backend cuda")
    if eager and backend != "cuda":
        raise click.UsageError("--eager times CUDA launches: it needs --backend cuda")
    _backend_or_exit(backend)
    timing = _timing(space.TIMING_DEFAULTS, warmup_s, min_reps, max_time_s)
    shape_bench = bench_mod.ShapeBench(shape, backend=backend, check=not no_check,
                                       num_sms=_num_sms(backend, None), workspace=workspace,
                                       **timing)
    try:
        merges = [tunables.check_merge(m) for m in _parse_list(merge, "--merge", str)]
    except ValueError as err:
        raise click.BadParameter(str(err), param_hint="--merge")
    pdls = [p if p != "auto" else True for p in _parse_list(pdl, "--pdl", _on_off)]
    benches = [shape_bench.with_launch(merge=m, pdl=p) for m, p in itertools.product(merges, pdls)]
    copy_bw = bench_mod.copy_bandwidth_gbps(shape_bench.device, **timing)
    rows = []
    try:
        configs = list(dict.fromkeys(shape_bench.resolve(c) for c in configs))
    except ValueError as err:
        raise click.UsageError(f"bad config: {err}")
    runs = {}  # (config, how it merges, programmatic launch) -> the bench that launches it
    for config, launch_bench in itertools.product(configs, benches):
        # Programmatic launch is a CUDA launch setting: the reference backend has none.
        key = (config, launch_bench.resolve_merge(config), launch_bench.pdl if backend == "cuda" else None)
        if key in runs:
            continue
        runs[key] = launch_bench
        result = launch_bench.measure(config)
        row = {"impl": "ours", "num_splits": config.num_splits, "block_kv": config.block_kv,
               "reduce_threads": config.reduce_threads, "split_policy": config.split_policy,
               "merge": key[1], "pdl": {True: "on", False: "off", None: "-"}[key[2]]}
        rows.append({**row, **_timing_row(result, shape, copy_bw)})
        if eager and result.status == "ok":
            rows[-1].update(_eager_row(*launch_bench.measure_eager(config)))
    if eager:
        from splitkv_tune import compare as compare_mod
        for peer in ("sdpa_flash", "sdpa_cudnn"):
            with compare_mod.peer_backend(peer):
                make = compare_mod.peer_factory(peer, shape, shape_bench.scale)
                result = shape_bench.measure_launcher(make)
                rows.append({"impl": peer, **_timing_row(result, shape, copy_bw)})
                if result.status == "ok":
                    rows[-1].update(_eager_row(*shape_bench.measure_launcher_eager(make)))
    import pandas as pd
    frame = pd.DataFrame(rows)
    if as_json:
        click.echo(json.dumps({"shape": space.shape_key(shape), "backend": backend,
                               "device": str(shape_bench.device), "copy_bw_gbps": copy_bw,
                               "bytes_moved": shape.bytes_moved(),
                               "rows": json.loads(frame.to_json(orient="records"))}, indent=2))
    elif csv_path == STDOUT:
        click.echo(frame.to_csv(index=False), nl=False)
    else:
        click.echo(f"{space.shape_key(shape)}  backend={backend}  device={shape_bench.device}  "
                   f"copy bandwidth {copy_bw:.1f} GB/s  bytes moved {shape.bytes_moved()}")
        shown = frame.rename(columns={"median_us": "µs", "gbps": "GB/s",
                                      "pct_copy_bw": "% copy bw"})
        click.echo(shown.to_string(index=False, float_format=lambda x: f"{x:.2f}", na_rep="-"))
    if csv_path and csv_path != STDOUT:
        table.atomic_write_csv(csv_path, frame)
    if breakdown:
        _print_breakdowns(runs, frame)


def _timing_row(result, shape, copy_bw: float) -> dict:
    gbps = result.gbps(shape.bytes_moved())
    return {"status": result.status, "median_us": result.median_us, "p20_us": result.p20_us,
            "p80_us": result.p80_us, "n": result.n, "gbps": gbps,
            "pct_copy_bw": 100 * gbps / copy_bw, "method": result.method, "reason": result.reason}


def _eager_row(host, eager) -> dict:
    return {"host_us": host.median_us, "eager_us": eager.median_us,
            "eager_p20_us": eager.p20_us, "eager_p80_us": eager.p80_us}


def _print_breakdowns(runs, frame) -> None:
    """One kernel-time table per (config, merge, pdl) that ran correctly."""
    from splitkv_tune import breakdown as breakdown_mod
    import pandas as pd

    for ((config, merged_by, pdl), launch_bench), status, per_call_us in zip(
            runs.items(), frame["status"], frame["median_us"]):
        if status != "ok":
            continue
        rows = pd.DataFrame(breakdown_mod.config_breakdown(launch_bench, config, per_call_us))
        rows["share"] = (100 * rows["share"]).map(lambda x: f"{x:.1f}%")
        click.echo(f"\nkernels of {config} (merge: {merged_by}, pdl: {'on' if pdl else 'off'}):")
        click.echo(rows.to_string(index=False, float_format=lambda x: f"{x:.2f}", na_rep="-"))


def _config_option(text: str) -> Config:
    """--config SPLITS,BLOCK_KV,REDUCE_THREADS,POLICY as a validated Config."""
    parts = [p.strip() for p in text.split(",")]
    if len(parts) != 4:
        raise click.BadParameter(f"{text!r}: expected four comma-separated fields "
                                 "SPLITS,BLOCK_KV,REDUCE_THREADS,POLICY, e.g. 16,64,128,blocks",
                                 param_hint="--config")
    try:
        splits, block_kv, threads = (int(p) for p in parts[:3])
    except ValueError:
        raise click.BadParameter(f"{text!r}: SPLITS, BLOCK_KV and REDUCE_THREADS must be integers",
                                 param_hint="--config") from None
    try:
        return Config(splits, block_kv, threads, parts[3]).validate()
    except ValueError as err:
        raise click.BadParameter(f"{text!r}: {err}", param_hint="--config") from None


@click.command()
@grid_options
@click.option("--table", "table_path", type=click.Path(exists=True, dir_okay=False), default=None,
              help="heuristics.csv whose winners we run (default: the selector, num_splits=auto).")
@click.option("--config", "config_text", default=None,
              help="Run this config everywhere: SPLITS,BLOCK_KV,REDUCE_THREADS,POLICY.")
@click.option("--peers", default=",".join(["sdpa_flash", "sdpa_cudnn", "flex"]), show_default=True)
@click.option("--with-no-pdl", is_flag=True,
              help="Also time ours launched without programmatic dependent launch "
                   "(column ours_no_pdl; not a peer).")
@click.option("--with-preallocated", is_flag=True,
              help="Also time ours with one preallocated workspace, as a tuned harness passes "
                   "it (column ours_preallocated; not a peer). 'ours' passes none.")
@click.option("--eager", is_flag=True,
              help="Also time every implementation uncaptured: host µs per call and µs per "
                   "call in an eager loop, beside the graph-replay times.")
@BACKEND_OPTION
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default="results/compare",
              show_default=True)
@click.option("--progress/--no-progress", default=None)
@_timing_options
@exit_2_on_bad_input
def compare(grid, dtypes, head_dims, patterns, table_path, config_text, peers, with_no_pdl,
            with_preallocated, eager, backend, out_dir, progress, warmup_s, min_reps, max_time_s):
    """Ours vs SDPA flash, SDPA cuDNN and FlexAttention; writes compare.csv and compare.md."""
    from splitkv_tune import compare as compare_mod
    from splitkv_tune import meta
    from splitkv_tune import table as table_mod
    from splitkv_tune.table_schema import read_heuristics

    grid_obj, shapes = _grid_shapes(grid, dtypes, head_dims, patterns)
    check_output(out_dir, "--out", directory=True)
    peer_list = [p.strip() for p in peers.split(",") if p.strip()]
    unknown = sorted(set(peer_list) - set(compare_mod.PEERS))
    if unknown:
        raise click.BadParameter(f"unknown peer(s) {unknown}; choose from {compare_mod.PEERS}",
                                 param_hint="--peers")
    missing = compare_mod.peers_flashinfer.available()
    if missing and set(peer_list) & set(compare_mod.peers_flashinfer.NAMES):
        click.echo(f"skipping the FlashInfer peers: {missing}", err=True)
        peer_list = [p for p in peer_list if p not in compare_mod.peers_flashinfer.NAMES]
    fixed = None if config_text is None else _config_option(config_text)
    _backend_or_exit(backend)
    heuristics = read_heuristics(table_path) if table_path else None
    run_id = meta.make_run_id()
    results = compare_mod.run_compare(
        shapes, backend=backend, peers=peer_list, heuristics=heuristics, fixed=fixed,
        timing=_timing(grid_obj.timing, warmup_s, min_reps, max_time_s), run_id=run_id,
        progress=progress, with_no_pdl=with_no_pdl, with_preallocated=with_preallocated,
        eager=eager)
    out = Path(out_dir)
    table_mod.atomic_write_csv(out / "compare.csv", results)
    markdown = compare_mod.markdown_report(results)
    table_mod.atomic_write_text(out / "compare.md", markdown)
    run_meta = meta.collect_meta(backend=backend, run_id=run_id,
                                 extra={"command": "compare", "grid": grid_obj.source})
    meta.write_run_meta(out, run_meta)
    click.echo(markdown)


def extension_status() -> dict:
    """Whether the CUDA extension is built and imports, and why not."""
    try:
        import splitkv_tune._C  # noqa: F401
    except Exception as err:  # ImportError, or an undefined symbol from a stale build
        return {"built": False, "error": f"{type(err).__name__}: {err}"}
    return {"built": True, "error": None}


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def env(as_json):
    """Print the machine metadata recorded with every run."""
    from splitkv_tune import meta

    info = meta.collect_meta()
    for run_only in ("run_id", "timestamp", "argv", "backend", "timing_method"):
        info.pop(run_only)
    info["cuda_extension"] = extension_status()
    if as_json:
        click.echo(json.dumps(info, indent=2, sort_keys=True, default=str))
        return

    def emit(prefix, value):
        if isinstance(value, dict):
            for key, sub in value.items():
                emit(f"{prefix}.{key}" if prefix else key, sub)
        else:
            click.echo(f"{prefix}: {value}")
    emit("", info)
