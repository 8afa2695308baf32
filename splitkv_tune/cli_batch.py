"""``splitkv-tune compare-batch``, ``sweep-batches`` and ``batch-table``: thin click layers over
:mod:`splitkv_tune.compare_batch`, :mod:`splitkv_tune.batch_sweep` and :mod:`splitkv_tune.batch_table`.

Every option is checked (lengths parsed, page size, shape, peers, grid, output paths) before
CUDA is touched, so bad input costs nothing and needs no GPU.
"""
from __future__ import annotations

import json
import os

import click

from splitkv_tune import _rules, tunables
from splitkv_tune.cli_errors import STDOUT, check_output, exit_2_on_bad_input


# The paged kernel's CTAs per SM, as the selector's model takes them (rules.h kMaxCtasPerSm).
CTAS_PER_SM = click.IntRange(1, _rules.LIVE_MODEL["max_ctas_per_sm"])


class ResidencyByHeadDim:
    """The selector's ``ctas_per_sm`` for a batch (``batch_evaluation.rule_knobs`` takes a function
    of the batch): one count for every head dim, or one per head dim."""

    def __init__(self, default: int | None, by_head_dim: dict[int, int]):
        self.default, self.by_head_dim = default, by_head_dim

    def __call__(self, batch):
        return self.by_head_dim.get(batch.head["head_dim"], self.default)

    def __str__(self) -> str:
        parts = ([] if self.default is None else [f"{self.default} CTAs per SM"]) + \
            [f"{n} at head dim {d}" for d, n in sorted(self.by_head_dim.items())]
        return ", ".join(parts)


def _residency_option(ctx, param, values):
    """``--ctas-per-sm N`` (every head dim) and ``--ctas-per-sm HEAD_DIM:N``, repeatable: None, an
    int, or a ``ResidencyByHeadDim``."""
    default, by_head_dim = None, {}
    for value in values:
        head_dim, _, count = value.rpartition(":")
        try:
            count = CTAS_PER_SM.convert(count, param, ctx)
            key = int(head_dim) if head_dim else None
            if key is not None and key not in tunables.HEAD_DIMS:
                raise ValueError
        except (ValueError, click.BadParameter):
            raise click.BadParameter(f"expected N or HEAD_DIM:N (HEAD_DIM one of {tunables.HEAD_DIMS}, N in "
                                     f"[1, {CTAS_PER_SM.max}]), got {value!r}") from None
        if (default if key is None else by_head_dim.get(key)) is not None:
            raise click.BadParameter(f"{'every head dim' if key is None else f'head dim {key}'} is given twice "
                                     f"(at {value!r})")
        if key is None:
            default = count
        else:
            by_head_dim[key] = count
    return ResidencyByHeadDim(default, by_head_dim) if by_head_dim else default


RESIDENCY_HELP = ("CTAs of the paged kernel per SM on the GPU that timed the rows (H200: 2 at head dims 64 to 128, "
                  "1 at 256), for the selector's model beyond the table's classes: N for every head dim, "
                  "HEAD_DIM:N for one (repeatable); without it the selector takes the auto knobs there.")


def parse_lengths_option(text: str) -> tuple[int, ...]:
    """One ``--lengths`` value as lengths; a click error naming the option and the value."""
    from splitkv_tune import batches
    try:
        return batches.parse_lengths(text)
    except ValueError as err:
        raise click.BadParameter(f"{text!r}: {err}", param_hint="--lengths") from None


def _lengths(ctx, param, values):
    return [(text, parse_lengths_option(text)) for text in values]


def check_page_size(ctx, param, value):
    """A ``--page-size`` callback: one of ``plan.PAGE_SIZES`` (or None, the option not given)."""
    from splitkv_tune.plan import PAGE_SIZES
    if value is not None and value not in PAGE_SIZES:
        raise click.BadParameter(f"must be one of {PAGE_SIZES}, got {value}", param_hint="--page-size")
    return value


def _peer_list(peers: str) -> list[str]:
    """A ``--peers`` comma list; a click error naming the peers not known."""
    from splitkv_tune.compare_batch import check_peers
    peer_list = [p.strip() for p in peers.split(",") if p.strip()]
    try:
        check_peers(peer_list)
    except ValueError as err:
        raise click.BadParameter(str(err), param_hint="--peers") from None
    return peer_list


def _plan_option(text: str) -> tuple:
    """One ``--plan`` value as a ``plan_points.plan_point``; a usage error naming the option."""
    from splitkv_tune.plan_points import PLAN_BLOCK_KV, plan_point
    from splitkv_tune.plan import SPLIT_PLANS, check_plan_knobs, check_split_plan
    fields = text.split(":")
    try:
        if not 2 <= len(fields) <= 5:
            raise ValueError
        min_blocks, max_splits, block_kv = (int(x) for x in (fields + [str(PLAN_BLOCK_KV)])[:3])
        merge = fields[3] if len(fields) > 3 else "auto"
        split_plan = fields[4] if len(fields) > 4 else "fixed"
        tunables.check_merge(merge)
        check_split_plan(split_plan)
        check_plan_knobs(block_kv, min_blocks, max_splits)
    except ValueError:
        raise click.BadParameter(f"expected MIN_BLOCKS:MAX_SPLITS[:BLOCK_KV[:MERGE[:SPLIT_PLAN]]] with "
                                 f"MIN_BLOCKS >= 1, MAX_SPLITS in [1, {tunables.MAX_SPLITS}], BLOCK_KV one of "
                                 f"{tunables.BLOCK_KV}, MERGE one of {tunables.MERGES} and SPLIT_PLAN one of "
                                 f"{SPLIT_PLANS}, got {text!r}",
                                 param_hint="--plan") from None
    return plan_point(min_blocks, max_splits, block_kv, merge, split_plan)


def _plan_space(ctx, param, value):
    """A ``--plan-space`` callback: ``(block_kvs, min_blocks, max_splits, merges, split_plans)``
    lists, or None."""
    if value is None:
        return None
    from splitkv_tune.plan_points import check_plan_space
    try:
        parts = value.split(":")
        if len(parts) not in (3, 4, 5):
            raise ValueError(f"expected 3 to 5 lists separated by ':', got {len(parts)}")
        lists = [[int(x) for x in part.split(",")] for part in parts[:3]]
        lists.append(parts[3].split(",") if len(parts) > 3 else ["auto"])
        lists.append(parts[4].split(",") if len(parts) > 4 else ["fixed"])
        check_plan_space(*lists)
    except ValueError as err:
        raise click.BadParameter(f"expected BLOCK_KVS:MIN_BLOCKS:MAX_SPLITS[:MERGES[:SPLIT_PLANS]], comma lists "
                                 f"such as 64,128:1,2,4,8,16:8,16,32,64:fused,kernel:fixed,load_aware, got "
                                 f"{value!r} ({err})",
                                 param_hint="--plan-space") from None
    return lists


@click.command("compare-batch")
@click.option("--lengths", "batches", multiple=True, required=True, callback=_lengths,
              help="One batch's live lengths; repeat for more. A list with repeats "
                   "(65536,1024x15) or uniform:N:LEN, skewed:N:LONG:SHORT, geometric:N:MAX:MIN, "
                   "lognormal:N:MEAN:SIGMA[:SEED].")
@click.option("--page-size", type=int, default=64, show_default=True, callback=check_page_size,
              help="Tokens per page of the K/V pools.")
@click.option("--q-heads", type=int, default=32, show_default=True)
@click.option("--kv-heads", type=int, default=8, show_default=True)
@click.option("--head-dim", type=int, default=128, show_default=True)
@click.option("--q-len", type=int, default=1, show_default=True, help="Queries per sequence.")
@click.option("--dtype", type=click.Choice(tunables.DTYPES), default="bf16", show_default=True)
@click.option("--peers", default="flashinfer_decode,flashinfer_decode_tc,flashinfer_xqa,sdpa_cudnn",
              show_default=True, help="Comma list; flashinfer_prefill also runs Sq > 1.")
@click.option("--one-split", type=click.IntRange(1, tunables.MAX_SPLITS), default=16,
              show_default=True,
              help="S of ours_one_split (min_blocks_per_split=1, max_splits=S).")
@click.option("--plan", "plans", multiple=True, metavar="MIN_BLOCKS:MAX_SPLITS[:BLOCK_KV[:MERGE[:SPLIT_PLAN]]]",
              help="Also time ours with these plan knobs (block_kv 64, merge auto and split plan fixed unless "
                   "given), one row each (ours_m<MIN>_s<MAX>, or ours_kv<BLOCK_KV>_m<MIN>_s<MAX>, then _fused or "
                   "_kernel, then _load_aware).")
@click.option("--plan-space", callback=_plan_space, metavar="BLOCK_KVS:MIN_BLOCKS:MAX_SPLITS[:MERGES[:SPLIT_PLANS]]",
              help="Also time ours at every combination of these comma lists "
                   "(64,128:1,2,4,8,16:8,16,32,64, or with :fused,kernel and :fixed,load_aware), one row each "
                   "named as --plan rows are; block_kvs not built at --head-dim and points already given by --plan "
                   "are left out.")
@click.option("--wider", multiple=True, type=click.IntRange(2, 1024),
              help="Also time ours behind a block table this many times wider (ours_wide<N>).")
@click.option("--eager", is_flag=True,
              help="Also time each implementation's eager loop and host cost per call (ours as called by "
                   "default, check_inputs=True): columns eager_us and host_us.")
@click.option("--csv", "csv_path", type=click.Path(dir_okay=False, allow_dash=True),
              help="Also write the rows here; - prints them as CSV instead of the report.")
@click.option("--json", "as_json", is_flag=True, help="Print the rows as JSON instead of the report.")
@click.option("--out-md", "md_path", type=click.Path(dir_okay=False),
              help="Also write the markdown report here.")
@exit_2_on_bad_input
def compare_batch(batches, page_size, q_heads, kv_heads, head_dim, q_len, dtype, peers, one_split,
                  plans, plan_space, wider, eager, csv_path, as_json, md_path):
    """Ours vs FlashInfer and padded cuDNN SDPA on paged, variable-length batches."""
    from splitkv_tune import compare_batch as compare_batch_mod
    from splitkv_tune.tunables import Shape

    for text, lengths in batches:
        try:
            Shape(dtype, head_dim, len(lengths), q_heads, kv_heads, q_len, max(lengths)).validate()
        except ValueError as err:
            raise click.UsageError(f"bad shape for --lengths {text!r}: {err}")
    peer_list = _peer_list(peers)
    plan_knobs = [_plan_option(text) for text in plans]
    if plan_space:
        plan_knobs += _expand_plan_space(plan_space, head_dim, plan_knobs)
    check_output(csv_path, "--csv", allow_stdout=True)
    check_output(md_path, "--out-md")
    from splitkv_tune import bench
    problem = bench.backend_problem("cuda")
    if problem:
        raise click.UsageError(problem)
    results = compare_batch_mod.run_compare_batches(
        [text for text, _ in batches], q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim,
        q_len=q_len, dtype=dtype, page_size=page_size, peers=peer_list, one_split=one_split,
        plans=plan_knobs, wider=wider, eager=eager, progress=lambda text: click.echo(f"batch {text} ...", err=True))
    markdown = compare_batch_mod.markdown_report(results)
    from splitkv_tune import table
    if csv_path and csv_path != STDOUT:
        table.atomic_write_csv(csv_path, results)
    if md_path:
        table.atomic_write_text(md_path, markdown)
    if as_json:
        click.echo(json.dumps(json.loads(results.to_json(orient="records")), indent=2))
    elif csv_path == STDOUT:
        click.echo(results.to_csv(index=False), nl=False)
    else:
        click.echo(markdown)


def _expand_plan_space(plan_space, head_dim: int, plans) -> list[tuple]:
    """The ``--plan-space`` points to time besides ``plans``; a usage error when none of its
    block_kvs is built at ``head_dim``, a note on stderr when some are not."""
    from splitkv_tune.plan_points import expand_plan_space
    block_kvs, min_blocks, max_splits, merges, split_plans = plan_space
    added, dropped = expand_plan_space(block_kvs, min_blocks, max_splits, head_dim, plans, merges, split_plans)
    allowed = tunables.BLOCK_KV_BY_HEAD_DIM[head_dim]
    if len(dropped) == len(set(block_kvs)):
        raise click.BadParameter(f"no block_kv of {dropped} is built at --head-dim {head_dim} (choose from "
                                 f"{allowed})", param_hint="--plan-space")
    if dropped:
        click.echo(f"--plan-space: leaving out block_kv {dropped}, not built at head_dim {head_dim}", err=True)
    return added


@click.command("sweep-batches")
@click.option("--grid", "grid_path", required=True, type=click.Path(dir_okay=False),
              help="A batch grid (YAML: heads, page_size, lengths, space), e.g. configs/batches.yaml.")
@click.option("--csv", "csv_path", required=True, type=click.Path(dir_okay=False),
              help="The rows, in compare-batch's columns; an existing one is resumed (its complete batches skipped).")
@click.option("--peers", default="", help="Comma list of peers to time beside ours (none by default).")
@click.option("--dry-run", is_flag=True,
              help="Print the batches, the rows to time and the time it takes; time nothing.")
@exit_2_on_bad_input
def sweep_batches(grid_path, csv_path, peers, dry_run):
    """Time every batch of a grid at the auto knobs and at every point of its knob space (one
    CSV block per batch, written atomically, so a killed sweep resumes where it stopped)."""
    from splitkv_tune import batch_sweep
    grid = batch_sweep.load_batch_grid(grid_path)
    peer_list = _peer_list(peers)
    check_output(csv_path, "--csv")
    sweep = batch_sweep.plan_sweep(grid, csv_path, peer_list)  # checks the CSV before any GPU work
    if dry_run:
        click.echo(batch_sweep.describe_plan(sweep, csv_path))
        return
    _check_cuda()
    _run_batch_sweep(grid, csv_path, peer_list)
    click.echo(f"next: splitkv-tune batch-table {csv_path} --gpu GPU -o FILE")


def _check_cuda() -> None:
    from splitkv_tune import bench
    problem = bench.backend_problem("cuda")
    if problem:
        raise click.UsageError(problem)


def _run_batch_sweep(grid, csv_path, peers=()) -> None:
    """Time the grid's batches not complete in the CSV, holding its lock; one summary line."""
    import contextlib

    from splitkv_tune import batch_sweep
    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(batch_sweep.sole_writer(csv_path))
        except ValueError as err:  # another sweep holds the CSV
            raise click.UsageError(str(err)) from None
        sweep = batch_sweep.plan_sweep(grid, csv_path, peers)  # as the CSV is once no one else writes it
        if sweep.complete:
            click.echo(f"resuming {csv_path}: skipping {len(sweep.complete)} of {len(grid.batches)} batches "
                       "already complete", err=True)
        skipped = batch_sweep.run_sweep(sweep, csv_path, progress=lambda line: click.echo(line, err=True))
    timed = len(sweep.todo) - len(skipped)
    click.echo(f"{csv_path}: {timed} batches timed, {len(sweep.complete)} complete before, {len(skipped)} skipped "
               "(inputs too large for the device)")


def _gpu(ctx, param, value):
    from splitkv_tune.gpus import resolve_gpu
    if not resolve_gpu(value):
        raise click.BadParameter(f"must name a GPU (h200, 'NVIDIA H200', ...), got {value!r}", param_hint="--gpu")
    return value


@click.command("batch-table")
@click.argument("csvs", nargs=-1, required=True, type=click.Path(dir_okay=False))
@click.option("--gpu", required=True, callback=_gpu, help="The GPU that measured the CSVs (h200, 'NVIDIA H200', ...).")
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False),
              help="The batch table to write: CSV, or JSON (schemas/batch_table.schema.json) when it ends in .json; "
                   "- for the CSV on stdout.")
@exit_2_on_bad_input
def batch_table(csvs, gpu, output):
    """The batch-class table (schema v3): per batch class of the compare-batch CSVs, the knobs of
    the fastest of our rows (ours, ours_one_split, ours_load_aware, --plan rows); ties go to the
    fixed split plan, then the smaller max_splits; a class in several CSVs takes the last one's rows."""
    from splitkv_tune import batch_table as bt
    from splitkv_tune.batch_table_json import write_batch_table_json
    check_output(output, "-o", allow_stdout=True)
    rows = [row for path in csvs for row in bt.read_compare_batch_csv(path)]
    table = bt.build_batch_table(rows, gpu)
    to_stdout = output == STDOUT
    if to_stdout:
        click.echo(bt.format_batch_table(table), nl=False)
    else:
        (write_batch_table_json if output.endswith(".json") else bt.write_batch_table)(output, table)
    click.echo(f"wrote {'stdout' if to_stdout else output}: {len(table)} batch classes from {len(rows)} rows of "
               f"{len(csvs)} CSV files", err=to_stdout)


@click.command("cross-validate-batches")
@click.option("--grid", "grid_paths", multiple=True, required=True, type=click.Path(dir_okay=False),
              help="A batch grid the CSVs were swept from; repeat for several (configs/batches.yaml, ...).")
@click.option("--csv", "csv_paths", multiple=True, required=True, type=click.Path(dir_okay=False),
              help="A sweep-batches CSV of those grids; repeat for several.")
@click.option("--gpu", required=True, callback=_gpu, help="The GPU that timed the rows (h200, 'NVIDIA H200', ...).")
@click.option("--num-sms", type=click.IntRange(1, 1024), default=None,
              help="The SM count the rules plan for; default: the GPU's profile.")
@click.option("--ctas-per-sm", multiple=True, callback=_residency_option, metavar="[HEAD_DIM:]N",
              help=RESIDENCY_HELP)
@click.option("--out-md", type=click.Path(dir_okay=False), default=None, help="Also write the report here.")
@exit_2_on_bad_input
def cross_validate_batches(grid_paths, csv_paths, gpu, num_sms, ctas_per_sm, out_md):
    """Leave-one-batch-out regret of the batch selector beside the auto knobs and the FA2, FA3 and
    SGLang rules, from swept rows alone (no GPU): each batch is held out in turn, the table built
    from the others, and every rule timed by the batch's own rows."""
    import dataclasses
    from splitkv_tune import batch_evaluation, batch_sweep
    from splitkv_tune.gpus import resolve_gpu
    check_output(out_md, "--out-md")
    num_sms = num_sms or _profile_sms(gpu)
    grids = [batch_sweep.load_batch_grid(p) for p in grid_paths]
    by_key = {b.key(): b for g in grids for b in g.batches}  # a batch in several grids: the last one's
    grid = dataclasses.replace(grids[0], batches=tuple(by_key.values()), source=", ".join(g.source for g in grids))
    rows = batch_evaluation.last_run_rows(csv_paths)
    records = batch_evaluation.leave_one_out_records(grid, rows, resolve_gpu(gpu), num_sms, ctas_per_sm)
    if not records:
        raise click.UsageError(f"no batch of {grid.source} has timed rows in {', '.join(csv_paths)}")
    _report(records, f"Batch selector regret, each batch held out in turn: {grid.source} on {resolve_gpu(gpu)} "
                     f"({num_sms} SMs, {_residency_text(ctas_per_sm)}), rows of {', '.join(csv_paths)}", out_md)


def _residency_text(ctas_per_sm) -> str:
    if ctas_per_sm is None:
        return "no CTAs per SM: the selector's model off"
    return f"{ctas_per_sm} CTAs per SM" if isinstance(ctas_per_sm, int) else str(ctas_per_sm)


class DeviceResidency:
    """The selector's ``ctas_per_sm`` for each batch on the current device
    (``live.launch_ctas_per_sm``), asked once per head configuration and batch size."""

    def __init__(self):
        self.known: dict[tuple, int] = {}

    def __call__(self, batch) -> int:
        from splitkv_tune import live
        h = batch.head
        key = (*(h[c] for c in ("dtype", "head_dim", "q_heads", "kv_heads", "q_len")), len(batch.lengths))
        if key not in self.known:
            self.known[key] = live.launch_ctas_per_sm(h["dtype"], h["head_dim"], len(batch.lengths), h["q_heads"],
                                                      h["kv_heads"], h["q_len"])
        return self.known[key]

    def __str__(self) -> str:
        return "the device's CTAs per SM for each batch"


def _profile_sms(gpu) -> int:
    """The SM count of ``gpu``'s profile (configs/gpus.yaml); a usage error without one."""
    from splitkv_tune.gpu_profiles import PROFILES
    from splitkv_tune.gpus import resolve_gpu
    profile = PROFILES.get(resolve_gpu(gpu))
    if profile is None:
        raise click.UsageError(f"no profile for GPU {gpu!r} (configs/gpus.yaml): give --num-sms")
    return profile["sms"]


def _report(records: list[dict], title: str, out_md) -> None:
    """The regret report of ``records`` on stdout, and in ``out_md`` when given."""
    from splitkv_tune.batch_evaluation import markdown_report
    from splitkv_tune.table import atomic_write_text
    report = markdown_report(records, title)
    click.echo(report)
    if out_md:
        atomic_write_text(out_md, report)


@click.command("evaluate-batches")
@click.option("--grid", "grid_path", required=True, type=click.Path(dir_okay=False),
              help="A batch grid of held-out batches (as sweep-batches reads), e.g. configs/batches_holdout.yaml.")
@click.option("--batch-table", "table_path", default=None, type=click.Path(dir_okay=False),
              help="The batch table the selector reads (CSV or .json). Without it the selector has no "
                   "classes and takes what it takes beyond them for every batch (the model's knobs, "
                   "or with --report-only and no --ctas-per-sm the auto rules): what a GPU without a "
                   "batch table gets.")
@click.option("--gpu", required=True, callback=_gpu, help="The GPU of the table's rows (h200, 'NVIDIA H200', ...).")
@click.option("--csv", "csv_path", required=True, type=click.Path(dir_okay=False),
              help="The timed rows, in compare-batch's columns; an existing one is resumed.")
@click.option("--num-sms", type=click.IntRange(1, 1024), default=None,
              help="The SM count the rules plan for; default: the GPU's profile, else the device's.")
@click.option("--report-only", is_flag=True, help="Time nothing: the report from the rows already in --csv.")
@click.option("--ctas-per-sm", multiple=True, callback=_residency_option, metavar="[HEAD_DIM:]N",
              help="With --report-only: " + RESIDENCY_HELP + " When timing, the device's for each batch.")
@click.option("--out-md", type=click.Path(dir_okay=False), default=None, help="Also write the report here.")
@click.option("--out-csv", type=click.Path(dir_okay=False), default=None, help="The per-batch regrets as CSV.")
@exit_2_on_bad_input
def evaluate_batches(grid_path, table_path, gpu, csv_path, num_sms, report_only, ctas_per_sm, out_md, out_csv):
    """Regret of the batch selector, the auto knobs and the FA2, FA3 and SGLang rules on held-out
    batches, each against the batch's oracle (the fastest point of an exhaustive search)."""
    from splitkv_tune import batch_evaluation, batch_sweep
    from splitkv_tune.batch_table_json import read_batch_table_file
    from splitkv_tune.gpus import resolve_gpu
    from splitkv_tune.table import atomic_write_csv
    for path, hint in ((out_md, "--out-md"), (out_csv, "--out-csv"), (csv_path, "--csv")):
        check_output(path, hint)
    grid = batch_sweep.load_batch_grid(grid_path)
    table = read_batch_table_file(table_path, gpu=gpu) if table_path else []
    if not report_only:
        _check_cuda()
        from splitkv_tune.sweep import GpuMismatch, resolve_table_gpu
        try:
            resolve_table_gpu(gpu, "cuda")
        except GpuMismatch as err:
            raise click.BadParameter(f"names {err.requested!r} but the device present is {err.present!r}, whose "
                                     f"timings would be labelled {err.requested!r}; time on that GPU, or use "
                                     "--report-only", param_hint="--gpu") from None
        import torch
        device_sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
        if num_sms is not None and num_sms != device_sms:
            raise click.BadParameter(f"the device has {device_sms} SMs; the rules must plan for the SMs they run on, "
                                     f"got {num_sms}", param_hint="--num-sms")
        num_sms = device_sms
        if ctas_per_sm is not None:
            raise click.BadParameter("applies to --report-only: when timing, the device's is taken for each batch",
                                     param_hint="--ctas-per-sm")
        ctas_per_sm = DeviceResidency()
    elif num_sms is None:
        num_sms = _profile_sms(gpu)
    if report_only and not os.path.isfile(csv_path):
        raise click.BadParameter(f"{csv_path} does not exist: --report-only reads the CSV that evaluate-batches "
                                 "wrote for this grid", param_hint="--csv")
    batch_sweep.read_rows(csv_path)  # a CSV in other columns is refused before any timing
    try:
        timed_grid = batch_evaluation.with_rule_plans(grid, table, num_sms, ctas_per_sm)
    except ValueError as err:  # knobs of the table that the call refuses, a batch out of range
        raise click.UsageError(f"{table_path or grid_path}: {err}") from None
    if not report_only:
        _run_batch_sweep(timed_grid, csv_path)
    records = batch_evaluation.regret_records(grid, batch_sweep.read_rows(csv_path), table, num_sms, ctas_per_sm)
    if all(r["oracle_us"] is None for r in records):
        raise click.UsageError(f"{csv_path} has no timed rows of any batch of {grid.source}: time them first "
                               "(without --report-only), or give the CSV that evaluate-batches wrote for this grid")
    records = [{"gpu": resolve_gpu(gpu), "num_sms": num_sms, **r} for r in records]
    _report(records, f"Batch selector regret: {grid.source} on {resolve_gpu(gpu)} ({num_sms} SMs, "
                     f"{_residency_text(ctas_per_sm)}), "
                     + (f"table {table_path}" if table_path else "no batch table"), out_md)
    if out_csv:
        import pandas as pd
        atomic_write_csv(out_csv, pd.DataFrame(records))
