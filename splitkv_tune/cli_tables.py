"""``splitkv-tune select | evaluate | export | plot``: commands that read heuristic tables.

Each command delegates to ``selector``, ``evaluation``, ``export`` or ``plot``. A bad table
(or trials file, or shapes file) ends the command with exit code 2 and one line naming the
file and the problem.
"""
from __future__ import annotations

import functools
import os
import tempfile
from pathlib import Path

import click

from splitkv_tune import tunables
from splitkv_tune.cli_batch import CTAS_PER_SM, check_page_size, parse_lengths_option
from splitkv_tune.cli_errors import STDOUT, check_output, exit_2_on_bad_input, fail
from splitkv_tune.cli_tune import check_timing_option
from splitkv_tune.gpus import profile_for, resolve_gpu
from splitkv_tune.selector import (TABLES_ENV, HeuristicTable, load_table_for_gpu, select_shape, table_locations,
                                   table_path_for_gpu)
from splitkv_tune.table_schema import SHAPE_COLUMNS, TableError, read_trials, with_gpu
from splitkv_tune.tunables import Shape


_fail = fail
GPU_HELP = ("GPU whose table and profile to use (h200, 'NVIDIA H200', ...); auto: the GPU "
            "present, else the file's own")


def _exit_2_on_bad_input(fn):
    """``cli_errors.exit_2_on_bad_input``, and a bad shape or option as one line too."""
    checked = exit_2_on_bad_input(fn)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return checked(*args, **kwargs)
        except ValueError as exc:
            fail(f"bad shape or option: {exc}")
    return wrapper


def _gpu_name(gpu: str | None, frame=None) -> str | None:
    """``--gpu`` as a name: "auto" is the GPU present, else the one GPU named by ``frame``'s
    gpu column (a trials or heuristics table), else ``None``."""
    if gpu != "auto":
        return gpu
    import torch
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    if frame is not None and "gpu" in frame and frame["gpu"].nunique() == 1:
        return str(frame["gpu"].iloc[0])
    return None


def _present_gpu(gpu: str, backend: str, force: bool) -> str:
    """The device a measuring command's timings are labelled with: the CUDA device present (exits
    when ``--gpu`` names another one and ``--force`` was not given, since its timings would read
    as that GPU's), or on the reference backend ``cpu_reference`` (the name of a reference sweep's
    table unless ``--force`` names a GPU), whichever GPU's table and profile ``--gpu`` names."""
    from splitkv_tune import sweep as sweep_mod
    if backend == "reference":
        return sweep_mod.REFERENCE_BACKEND_DEVICE
    try:
        sweep_mod.resolve_table_gpu(gpu, backend, force)
    except sweep_mod.GpuMismatch as err:
        _fail(f"--gpu names {err.requested!r} but the device present is {err.present!r}; pass --force to "
              f"time {err.requested!r}'s table here anyway (its timings are labelled {err.present!r})")
    return sweep_mod.present_device_name(backend)


def _table_locations_text(gpu: str) -> str:
    return " or ".join(str(path) for path in table_locations(gpu))


def _load_table(table: str | None, gpu: str | None, frame=None):
    """(HeuristicTable or None, description of where it came from); ``frame``: ``table`` as
    already read, whose ``gpu`` rows are taken instead of reading the file again."""
    if table is not None:
        from splitkv_tune.export import read_table_file
        from splitkv_tune.table_schema import keep_gpu
        df = read_table_file(table, gpu=gpu) if frame is None else keep_gpu(frame, gpu, table)
        return HeuristicTable(df, gpu=gpu, source=table), table
    if gpu is None:
        _fail("name a GPU (--gpu) or a table (--table)")
    loaded = load_table_for_gpu(gpu)
    if loaded is None and profile_for(gpu) is None:
        _fail(f"unknown GPU {gpu!r}: no table at {_table_locations_text(gpu)} and no profile in "
              "configs/gpus.yaml")
    return loaded, loaded.source if loaded is not None else "none"


def shape_options(fn):
    """The shape given on the command line (all optional here; checked by the command)."""
    opts = [
        click.option("--dtype", type=click.Choice(tunables.DTYPES), default="bf16", show_default=True),
        click.option("--head-dim", type=int, default=128, show_default=True),
        click.option("--batch", type=int, default=1, show_default=True),
        click.option("--q-heads", type=int, default=None, help="query heads [default: --kv-heads]"),
        click.option("--kv-heads", type=int, default=None, help="KV heads [default: --q-heads]"),
        click.option("--q-len", type=int, default=1, show_default=True, help="query length Sq"),
        click.option("--kv-len", type=int, default=None, help="KV length Sk"),
        click.option("--causal/--no-causal", default=False, show_default=True),
    ]
    for opt in reversed(opts):
        fn = opt(fn)
    return fn


def _shape_from(dtype, head_dim, batch, q_heads, kv_heads, q_len, kv_len, causal) -> Shape:
    if kv_len is None or (q_heads is None and kv_heads is None):
        raise click.UsageError("give at least --kv-len and --q-heads or --kv-heads")
    q_heads = q_heads if q_heads is not None else kv_heads
    kv_heads = kv_heads if kv_heads is not None else q_heads
    return Shape(dtype, head_dim, batch, q_heads, kv_heads, q_len, kv_len, causal).validate()


def _paged_lengths(ctx, param, value):
    return None if value is None else parse_lengths_option(value)


@click.command()
@click.option("--gpu", default="auto", show_default=True, help=GPU_HELP)
@click.option("--table", type=click.Path(dir_okay=False), default=None,
              help=f"heuristics.csv or an exported .json [default: ${TABLES_ENV}/<gpu>/ then "
                   "the package's results/<gpu>/]")
@click.option("--json", "as_json", is_flag=True, help="Print the choice as JSON.")
@click.option("--paged", is_flag=True,
              help="The knobs of a paged / variable-length call of this batch instead (--kv-len: the "
                   "cache's capacity per sequence), and the workspace to preallocate.")
@click.option("--lengths", callback=_paged_lengths, metavar="SPEC",
              help="With --paged: the batch's live lengths, as compare-batch takes them (65536,1024x15, "
                   "skewed:16:65536:1024, ...); they set --batch, and --kv-len defaults to the longest.")
@click.option("--page-size", type=int, default=None, callback=check_page_size,
              help="With --paged: tokens per page, for the batch table's classes [default: 64].")
@click.option("--batch-table", type=click.Path(dir_okay=False), default=None,
              help="With --paged and --lengths: take the knobs from this batch-class table (splitkv-tune "
                   "batch-table; CSV or .json) instead of the live defaults.")
@click.option("--ctas-per-sm", type=CTAS_PER_SM, default=None,
              help="With --paged and --lengths: CTAs of the paged kernel per SM on that GPU (H200, bf16 D 128: 2), "
                   "for the selector's model of the launch, which chooses the knobs of a batch that no class of "
                   "the batch table is near (or without --batch-table); without it, the live defaults.")
@shape_options
@_exit_2_on_bad_input
def select(gpu, table, as_json, paged, lengths, page_size, batch_table, ctas_per_sm, **shape_kw):
    """Print the config the selector chooses for one shape, and why."""
    if not paged and (lengths is not None or page_size is not None or batch_table is not None
                      or ctas_per_sm is not None):
        raise click.UsageError("--lengths, --page-size, --batch-table and --ctas-per-sm apply to --paged")
    if paged and table is not None:
        raise click.UsageError("--table is the equal-length call's table; a paged call's knobs come from "
                               "--batch-table")
    if lengths is not None:
        shape_kw = _with_lengths(shape_kw, lengths)
    shape = _shape_from(**shape_kw)
    gpu = _gpu_name(gpu)
    if paged:
        return _select_paged(shape, gpu, as_json, lengths, page_size or 64, batch_table, ctas_per_sm)
    loaded, where = _load_table(table, gpu)
    sel = select_shape(loaded, shape, gpu)
    c = sel.config
    if as_json:
        import json
        click.echo(json.dumps({"num_splits": c.num_splits, "block_kv": c.block_kv,
                               "reduce_threads": c.reduce_threads, "split_policy": c.split_policy,
                               "why": sel.reason, "table": where,
                               "workspace_bytes": tunables.workspace_bytes(shape, c.num_splits)},
                              indent=2))
        return
    click.echo(f"config: num_splits={c.num_splits} block_kv={c.block_kv} "
               f"reduce_threads={c.reduce_threads} split_policy={c.split_policy}")
    click.echo(f"why: {sel.reason}")
    click.echo(f"table: {where}")
    click.echo(f"workspace: {tunables.workspace_bytes(shape, c.num_splits)} bytes")


def _with_lengths(shape_kw: dict, lengths) -> dict:
    """The shape options with ``--lengths``: the batch is their count, the capacity (``--kv-len``)
    their longest unless given, and then at least that."""
    from click.core import ParameterSource
    if (click.get_current_context().get_parameter_source("batch") is not ParameterSource.DEFAULT
            and shape_kw["batch"] != len(lengths)):
        raise click.BadParameter(f"{shape_kw['batch']} disagrees with --lengths ({len(lengths)} sequences)",
                                 param_hint="--batch")
    kv_len = max(lengths) if shape_kw["kv_len"] is None else shape_kw["kv_len"]
    if kv_len < max(lengths):
        raise click.BadParameter(f"the capacity {kv_len} is below the longest of --lengths ({max(lengths)})",
                                 param_hint="--kv-len")
    return {**shape_kw, "batch": len(lengths), "kv_len": kv_len}


def _select_paged(shape: Shape, gpu, as_json: bool, lengths, page_size: int, batch_table, ctas_per_sm) -> None:
    """``select --paged``: the plan knobs for this batch on this GPU's SM count (``live``'s
    ``"auto"`` rules, or with ``batch_table`` or ``ctas_per_sm`` ``batch_select``'s: the nearest
    class's, else the model's), the splits a sequence filling the capacity gets, and the workspace."""
    from splitkv_tune import _rules, live
    if gpu is None:
        _fail("--paged needs the GPU's SM count: name the GPU with --gpu (no CUDA device here)")
    profile = profile_for(gpu)
    if profile is None:
        _fail(f"--paged needs the GPU's SM count: no profile for {gpu!r} in configs/gpus.yaml")
    if batch_table is None and ctas_per_sm is None:
        bkv, min_blocks, bound = live.resolve_knobs(shape.batch, shape.head_dim, shape.kv_heads, shape.packed_rows,
                                                    profile.sms)
        why = live.explain_knobs(shape.batch, shape.head_dim, shape.kv_heads, shape.packed_rows, profile.sms)
        extra = {}
    else:
        if lengths is None:
            _fail("--batch-table and --ctas-per-sm need --lengths: the table's classes and the model read the "
                  "batch's lengths")
        from splitkv_tune.batch_select import select_live_knobs
        from splitkv_tune.batch_table_json import read_batch_table_file
        table = [] if batch_table is None else read_batch_table_file(batch_table, gpu=gpu)
        knobs = select_live_knobs(table, dtype=shape.dtype, head_dim=shape.head_dim,
                                  q_heads=shape.q_heads, kv_heads=shape.kv_heads, q_len=shape.q_len,
                                  page_size=page_size, lengths=lengths, num_sms=profile.sms, ctas_per_sm=ctas_per_sm)
        bkv, min_blocks, bound, why = knobs.block_kv, knobs.min_blocks_per_split, knobs.max_splits, knobs.reason
        extra = {"merge": knobs.merge, "split_plan": knobs.split_plan, "batch_table": batch_table}
    choice = {"block_kv": bkv, "min_blocks_per_split": min_blocks, "max_splits": bound, **extra,
              "splits_at_capacity": _rules.live_splits(shape.kv_len, bkv, min_blocks, bound),
              "why": why,
              "sms": profile.sms,
              "workspace_bytes": _rules.workspace_sections(bound, shape.batch, shape.q_heads, shape.q_len,
                                                           shape.head_dim, live=True)[2]}
    if as_json:
        import json
        click.echo(json.dumps(choice, indent=2))
        return
    merge = f" merge={extra['merge']} split_plan={extra['split_plan']}" if extra else ""
    click.echo(f"paged knobs: block_kv={bkv} min_blocks_per_split={min_blocks} max_splits={bound}{merge}")
    click.echo(f"why: {why}")
    if extra:
        click.echo(f"batch table: {batch_table if batch_table is not None else 'none (the model of --ctas-per-sm)'}")
    click.echo(f"a sequence of {shape.kv_len} keys (the capacity) gets {choice['splits_at_capacity']} splits "
               f"at min_blocks_per_split={min_blocks}")
    click.echo(f"workspace: {choice['workspace_bytes']} bytes")


def _measurement_plan(shapes_file, shape_kw, max_time_s):
    """Shapes, search space and timing for a measured evaluate; a grid YAML brings its own."""
    from splitkv_tune import space
    override = {} if max_time_s is None else {"max_time_s": max_time_s}
    if shapes_file and shapes_file.endswith((".yaml", ".yml")):
        grid = space.load_grid(shapes_file)
        return list(grid.shapes), grid.space, {**grid.timing, **override}
    shapes = _shapes_csv(shapes_file) if shapes_file else [_shape_from(**shape_kw)]
    return shapes, space.SearchSpace(), {"max_time_s": 0.2, **override}


def _shapes_csv(path: str) -> list[Shape]:
    from splitkv_tune.table_schema import _read_csv
    raw = _read_csv(path)
    missing = [c for c in SHAPE_COLUMNS if c not in raw.columns]
    if missing:
        raise TableError(path, "missing columns: " + ", ".join(missing))
    shapes = []
    for i, r in enumerate(raw[SHAPE_COLUMNS].to_dict("records")):
        try:
            shapes.append(Shape(r["dtype"], int(r["head_dim"]), int(r["batch"]), int(r["q_heads"]),
                                int(r["kv_heads"]), int(r["q_len"]), int(r["kv_len"]),
                                r["causal"].lower() in ("1", "true")).validate())
        except ValueError as exc:
            raise TableError(path, str(exc), row=i) from None
    if not shapes:
        raise TableError(path, "empty table (no rows)")
    return shapes


def _write_reports(df, out_csv, out_md, header: str) -> None:
    from splitkv_tune.evaluation import to_markdown
    text = header + "\n" + to_markdown(df)
    click.echo(text)
    if out_csv:
        Path(out_csv).parent.mkdir(parents=True, exist_ok=True)
        df.to_csv(out_csv, index=False)
    if out_md:
        Path(out_md).parent.mkdir(parents=True, exist_ok=True)
        Path(out_md).write_text(text)


@click.command()
@click.option("--gpu", default="auto", show_default=True, help=GPU_HELP)
@click.option("--table", type=click.Path(dir_okay=False), default=None, help="heuristics.csv")
@click.option("--from-trials", "trials", type=click.Path(dir_okay=False), multiple=True,
              help="offline: leave-one-out regret against this trials.csv (no GPU); repeat it for "
                   "the parts of one measurement set, as `table` takes them")
@click.option("--shapes-file", "shapes_file", type=click.Path(dir_okay=False), default=None,
              help="shapes to measure: a CSV with the shape columns or a grid YAML")
@click.option("--max-time-s", type=float, default=None, callback=check_timing_option,
              help="timing budget per config [default: the grid's, else 0.2]")
@click.option("--backend", type=click.Choice(["cuda", "reference"]), default="cuda",
              show_default=True, help="what is timed: the kernel, or the PyTorch reference on the CPU")
@click.option("--out-csv", type=click.Path(dir_okay=False), default=None)
@click.option("--out-md", type=click.Path(dir_okay=False), default=None)
@click.option("--out-trials", type=click.Path(dir_okay=False), default=None,
              help="measured: every timed config as a trials.csv, for --from-trials --table later")
@click.option("--force", is_flag=True,
              help="measured: use --gpu's table on another GPU (timings are labelled with the GPU present)")
@shape_options
@_exit_2_on_bad_input
def evaluate(gpu, table, trials, shapes_file, max_time_s, backend, out_csv, out_md, out_trials, force, **shape_kw):
    """Regret (time / best - 1) of the selector, the FA2, FA3 and SGLang rules and S=1 per shape.

    With --from-trials: every measured shape is held out of the table and selected from the
    rest (regret on shapes not in the table), plus the analytic fallback alone; with --table
    too, the selector reads that table instead (held-out shapes timed with --out-trials,
    replayed against a new table without a GPU). Otherwise each shape (--shapes-file or the
    shape options) is timed on this GPU: the selected config, the baselines', S=1 and every
    config of the search space (a grid YAML's own space and timing).
    """
    from splitkv_tune import evaluation
    check_output(out_csv, "--out-csv")
    check_output(out_md, "--out-md")
    check_output(out_trials, "--out-trials")
    if trials:
        ctx = click.get_current_context()
        measuring = {"out_trials", "shapes_file", "max_time_s", "backend", "force", *shape_kw}
        given = ["/".join(param.opts + param.secondary_opts) for param in ctx.command.params
                 if param.name in measuring and ctx.params[param.name] != param.default]
        if given:
            _fail(f"{', '.join(given)} {'goes' if len(given) == 1 else 'go'} with a measured evaluate; "
                  "--from-trials times nothing")
        import pandas as pd
        trial_rows = pd.concat([read_trials(path) for path in trials], ignore_index=True)
        trials = " + ".join(trials)
        gpu = _gpu_name(gpu, trial_rows)
        if gpu is None:
            _fail(f"{trials} holds trials of several GPUs: name one with --gpu")
        trial_rows = with_gpu(trial_rows, gpu, trials)
        if table is not None:
            loaded, where = _load_table(table, gpu)
            df = evaluation.evaluate_trials(trial_rows, gpu, leave_one_out=False, table=loaded)
            _write_reports(df, out_csv, out_md, f"# Selector regret of {where} on the shapes of {trials} "
                                                f"(GPU {resolve_gpu(gpu)})\n")
            return
        df = evaluation.evaluate_trials(trial_rows, gpu, leave_one_out=True)
        cmp = {n: evaluation.summarize(df[f"{n}_regret"]) for n in ("fallback", "fa2")}
        verdict = "better" if cmp["fallback"]["geomean"] < cmp["fa2"]["geomean"] else "NOT better"
        header = (f"# Selector regret, leave-one-out over {trials} (GPU {resolve_gpu(gpu)})\n\n"
                  f"Analytic fallback vs FlashAttention-2 heuristic: {verdict} "
                  f"(geomean {cmp['fallback']['geomean'] * 100:.2f}% vs "
                  f"{cmp['fa2']['geomean'] * 100:.2f}%).\n")
        _write_reports(df, out_csv, out_md, header)
        return
    from splitkv_tune.bench import backend_problem
    shapes, search_space, timing = _measurement_plan(shapes_file, shape_kw, max_time_s)
    problem = backend_problem(backend)
    if problem:
        _fail(problem)
    measured_on = _present_gpu(gpu, backend, force)
    name, frame = _gpu_name(gpu), None
    if name is None and table is not None:  # "auto" with no CUDA device: the table's one GPU, if it has one
        from splitkv_tune.export import read_table_file
        frame = read_table_file(table)
        name = _gpu_name(gpu, frame)
    if name is None:
        _fail("--gpu auto finds no GPU here: name the GPU whose table and profile to use, e.g. --gpu h200")
    gpu = name
    loaded, where = _load_table(table, gpu, frame)
    import pandas as pd

    from splitkv_tune import meta
    timed = [] if out_trials else None
    run_id = meta.make_run_id()
    rows = [evaluation.measure_shape(s, gpu, {"backend": backend, **timing}, loaded, search_space, timed, run_id,
                                     measured_on=measured_on)
            for s in shapes]
    if out_trials:
        from splitkv_tune.table import atomic_write_csv
        atomic_write_csv(Path(out_trials), pd.DataFrame(timed))
    _write_reports(pd.DataFrame(rows), out_csv, out_md,
                   f"# Selector regret measured on {measured_on} (table: {where}, "
                   f"rows of {resolve_gpu(gpu)})\n")


@click.command()
@click.option("--format", "fmt", type=click.Choice(["csv", "json", "cpp-header"]), required=True)
@click.option("--gpu", "gpus", multiple=True,
              help="GPU whose rows to export [default: the table's]; repeat for a C++ header "
                   "covering several GPUs")
@click.option("--table", "tables", multiple=True, type=click.Path(dir_okay=False),
              help="heuristics.csv or an exported .json [default: each --gpu's table found like select "
                   "does]; repeat for a C++ header covering several GPUs")
@click.option("--batch-table", "batch_tables", multiple=True, type=click.Path(dir_okay=False),
              help="cpp-header: a batch table (CSV or .json) of one of the header's GPUs, whose classes "
                   "select_live_knobs() reads; repeat for several GPUs")
@click.option("-o", "--output", required=True, type=click.Path(),
              help="file (csv, cpp-header; - for stdout) or directory (json)")
@_exit_2_on_bad_input
def export(fmt, gpus, tables, batch_tables, output):
    """Export heuristics as CSV, per-device JSON files or a C++ header (one or several GPUs,
    dispatched by device name, with the paged call's knobs per batch class)."""
    if fmt == "json" and output == STDOUT:
        raise click.BadParameter("--format json writes one file per device name, dtype and head_dim: give a "
                                 "directory", param_hint="-o")
    check_output(output, "-o", directory=(fmt == "json"), allow_stdout=True)
    from splitkv_tune import export as ex
    sources = _export_sources(gpus, tables)
    if fmt != "cpp-header" and len(sources) != 1:
        _fail(f"--format {fmt} exports one GPU's table: give one --table or --gpu")
    if fmt != "cpp-header" and batch_tables:
        raise click.BadParameter("only --format cpp-header carries batch tables (batch-table -o FILE.json writes "
                                 "their JSON)", param_hint="--batch-table")
    if fmt == "cpp-header":
        from splitkv_tune.batch_table_json import read_batch_table_file
        from splitkv_tune.export_cpp import export_cpp_header, render_cpp_header
        parts = []
        for table, gpu in sources:
            df = ex.read_table_file(table, gpu=gpu)
            for name in ([gpu] if gpu else sorted(set(df["gpu"]))):
                parts.append(HeuristicTable(df, gpu=name, source=table))
        classes = [rec for path in batch_tables for rec in read_batch_table_file(path)]
        if output == STDOUT:
            click.echo(render_cpp_header(parts, batch_classes=classes), nl=False)
            return
        paths = [export_cpp_header(parts, output, batch_classes=classes)]
    else:
        (table, gpu), = sources
        df = ex.read_table_file(table, gpu=gpu)
        if output == STDOUT:
            click.echo(ex.csv_text(df, gpu, table), nl=False)
            return
        writer = ex.export_csv if fmt == "csv" else ex.export_json
        written = writer(df, output, gpu, table)
        paths = written if isinstance(written, list) else [written]
    for p in paths:
        click.echo(f"wrote {p}")


def _export_sources(gpus, tables) -> list[tuple[str, str | None]]:
    """(table path, GPU or None) pairs: each --table with the --gpu at its position (or the
    one --gpu for all), or each --gpu's table found like select does."""
    if tables:
        if len(gpus) not in (0, 1, len(tables)):
            _fail("give one --gpu, or one --gpu per --table")
        names = list(gpus) * len(tables) if len(gpus) == 1 else list(gpus) or [None] * len(tables)
        return list(zip(tables, names))
    if not gpus:
        _fail("name a GPU (--gpu) or a table (--table)")
    sources = []
    for gpu in gpus:
        path = table_path_for_gpu(gpu)
        if path is None:
            _fail(f"unknown GPU {gpu!r}: no table at {_table_locations_text(gpu)}")
        sources.append((str(path), gpu))
    return sources


@click.command()
@click.argument("path", required=False, type=click.Path(dir_okay=False))
@click.option("-o", "--output", default="best_splits.png", show_default=True,
              help="output directory or base name (PNG and SVG are written)")
@click.option("--gpu", default="auto", show_default=True,
              help=GPU_HELP + " (the SM count of FA2's heuristic for a trials.csv)")
@click.option("--regret", "regret_csv", type=click.Path(dir_okay=False), default=None,
              help="also plot each rule's regret per shape from an `evaluate --out-csv` file")
@click.option("--batch-regret", "batch_regret_csv", type=click.Path(dir_okay=False), default=None,
              help="also plot each rule's regret per held-out batch from an `evaluate-batches --out-csv` file")
@click.option("--batches", "batch_csvs", multiple=True, type=click.Path(dir_okay=False),
              help="also plot, per batch of a `compare-batch` CSV (repeatable), our speed-up "
                   "over one S for the whole batch and over each peer")
@_exit_2_on_bad_input
def plot(path, output, gpu, regret_csv, batch_regret_csv, batch_csvs):
    """Heatmaps (best S, speed-ups, noise) and bandwidth curves of a heuristics or trials CSV;
    with --regret, the selector's and the baselines' regret per shape (--batch-regret: per
    held-out paged batch); with --batches, our speed-ups per paged batch."""
    from splitkv_tune.plot import plot_all, plot_regret
    from splitkv_tune.plot_batches import plot_batch_regret, plot_batches
    if path is None and regret_csv is None and batch_regret_csv is None and not batch_csvs:
        _fail("give a heuristics or trials CSV (PATH), --regret EVAL.csv, --batch-regret EVAL.csv "
              "or --batches BATCH.csv")
    check_output(Path(output).parent if Path(output).suffix else output, "-o", directory=True)
    # Every figure is drawn into a scratch folder in the output's nearest existing folder and moved
    # in only when all inputs were read, so that a bad input leaves no figure (and no new folder).
    into_folder = Path(output).is_dir() or str(output).endswith(("/", "\\"))
    folder = Path(output) if into_folder else Path(output).parent
    existing = next(p for p in [folder.absolute(), *folder.absolute().parents] if p.is_dir())
    with tempfile.TemporaryDirectory(dir=existing, prefix=".plot-") as scratch:
        staged = scratch + os.sep if into_folder else str(Path(scratch) / Path(output).name)
        drawn = plot_all(path, staged, _gpu_name(gpu)) if path is not None else []
        if regret_csv is not None:
            drawn += plot_regret(regret_csv, staged)
        if batch_regret_csv is not None:
            drawn += plot_batch_regret(batch_regret_csv, staged, _gpu_name(gpu))
        if batch_csvs:
            drawn += plot_batches(batch_csvs, staged, _gpu_name(gpu))
        folder.mkdir(parents=True, exist_ok=True)
        written = [folder / Path(p).name for p in drawn]
        for staged_file, target in zip(drawn, written):
            os.replace(staged_file, target)
    for target in written:
        click.echo(f"wrote {target}")
