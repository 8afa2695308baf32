"""Sweeps over batches (``splitkv-tune sweep-batches``): every batch of a grid timed by
``compare_batch.run_compare_batch`` at the paged call's ``"auto"`` knobs (``ours``) and at every
point of a knob space (the plan rows), into one CSV in compare-batch's columns, which
``splitkv-tune batch-table`` reads unchanged. The oracle of a batch is its fastest row: an
exhaustive search of the space.

The grid (YAML)::

    heads:                      # head configurations; every field required
      - {dtype: bf16, head_dim: 128, q_heads: 32, kv_heads: 8, q_len: 1}
    page_size: [16, 64]         # plan.PAGE_SIZES
    lengths: [uniform:16:8192, skewed:16:65536:1024]   # batches.parse_lengths texts
    space: {block_kv: [64, 128], min_blocks_per_split: [1, 4], max_splits: [8, 32]}
                                # optional in space: merge: [fused, kernel] (default: auto),
                                # split_plan: [fixed, load_aware] (default: fixed)
    timing: {warmup_s: 0.05, min_reps: 20, max_time_s: 0.2}   # optional, as in sweep grids

Every (head configuration x page size x lengths) is one batch, identified in the CSV by its
``KEY_COLUMNS``. A space's block_kv that a head dim does not build is left out at that head
dim (``plan_points.expand_plan_space``).

Crash safety: after each batch the whole CSV (the rows already there and the new batch's) is
written to a temporary file in the same folder, fsynced and renamed over the CSV
(``table.atomic_write_text``), so a kill at any point leaves the CSV as it was after some
whole batch. Rewriting rather than appending costs a few hundred kilobytes per batch against
seconds of GPU time, needs no repair of a torn last line on resume, and lets a batch whose
rows lack points of the space be re-timed and replaced as one block. One sweep per CSV at a
time (``sole_writer``, a lock beside the CSV): two writers would each rename their own copy
over the other's.

Outputs are checked as compare-batch checks them: against the fp32 reference up to
``compare_batch.REFERENCE_MAX_KEYS`` keys; a larger batch is checked against a FlashInfer peer
when ``--peers`` names one, else timed unchecked (its rows' ``check`` says so).

Resume: a batch whose rows in the CSV hold every row the grid asks of it is skipped; one with
some of them (the space or the peers grew) is timed again, its old rows replaced.
"""
from __future__ import annotations

import contextlib
import csv
import dataclasses
import fcntl
import io
import math
from pathlib import Path

import yaml

from splitkv_tune import batches, bench, plan, plan_points, tunables
from splitkv_tune import compare_batch as cb
from splitkv_tune.batch_table import LABEL_RE, read_csv_rows, with_legacy_split_plan
from splitkv_tune.gpu_profiles import PROFILES
from splitkv_tune.space import GridError, _parse_timing
from splitkv_tune.table_schema import TableError
from splitkv_tune.tunables import Shape

# name and description are for the reader.
TOP_LEVEL_KEYS = ("name", "description", "heads", "page_size", "lengths", "space", "timing")
HEAD_FIELDS = ("dtype", "head_dim", "q_heads", "kv_heads", "q_len")
KEY_COLUMNS = list(HEAD_FIELDS) + ["page_size", "label"]
SPACE_FIELDS = tuple(cb.KNOB_COLUMNS[:3])  # block_kv, min_blocks_per_split, max_splits

# The dry run's cost model, per timed row: the warm-up, the samples (bench._time_cuda records 8
# graph replays of at least bench.MIN_LAUNCHES_PER_GRAPH calls per step until max_time_s has
# passed and min_reps are taken), and ROW_OVERHEAD_S for the graph capture, the checked first
# call and its check. A call reads the live K/V at an H200's copy bandwidth (the paged kernel
# runs at about 1x the copy floor); per batch, BATCH_OVERHEAD_S builds the shuffled pools and
# their rotated copies and runs the fp32 reference. Good to a small factor.
SAMPLES_PER_STEP = 8
ROW_OVERHEAD_S = 0.1
BATCH_OVERHEAD_S = 2.0
ESTIMATE_COPY_BW_GBPS = PROFILES["nvidia_h200"]["copy_bw_gbps"]


@dataclasses.dataclass(frozen=True)
class Batch:
    """One batch of a grid: a head configuration, a page size, lengths and the plan rows."""

    head: dict
    page_size: int
    label: str
    lengths: tuple[int, ...]
    # plan_points.plan_point: (min_blocks_per_split, max_splits, block_kv[, merge[, split_plan]])
    plans: tuple[tuple, ...]

    def key(self) -> tuple[str, ...]:
        """``KEY_COLUMNS`` as the CSV's cells read."""
        return tuple(str(v) for v in (*(self.head[f] for f in HEAD_FIELDS), self.page_size, self.label))

    def impls(self, peers=()) -> list[str]:
        """The ``impl`` of every row the batch writes: ours, the plans, the peers, the floor."""
        return ["ours", *(plan_points.plan_row_name(*p) for p in self.plans), *peers, "copy_floor"]

    def describe(self) -> str:
        h, s = self.head, batches.describe(self.lengths)
        return (f"{h['dtype']} D{h['head_dim']} Hq{h['q_heads']}/Hkv{h['kv_heads']} Sq{h['q_len']} "
                f"page {self.page_size} {self.label} (B {s['batch']}, max {s['max']}, mean {s['mean']:.0f})")


@dataclasses.dataclass(frozen=True)
class BatchGrid:
    """A parsed grid: its batches (repeats dropped, in the file's order), timing and file."""

    batches: tuple[Batch, ...]
    timing: dict
    source: str


def _int_list(raw, where: str) -> list:
    items = raw if isinstance(raw, list) else [raw]
    if not items or any(not isinstance(x, int) or isinstance(x, bool) for x in items):
        raise GridError(f"{where}: expected a non-empty list of integers, got {raw!r}")
    return list(dict.fromkeys(items))


def _head(entry, where: str) -> dict:
    if not isinstance(entry, dict):
        raise GridError(f"{where}: expected a mapping of {list(HEAD_FIELDS)}, got {entry!r}")
    unknown = sorted(set(entry) - set(HEAD_FIELDS))
    missing = [f for f in HEAD_FIELDS if f not in entry]
    if unknown or missing:
        raise GridError(f"{where}: unknown field(s) {unknown}, missing field(s) {missing}; "
                        f"expected {list(HEAD_FIELDS)}")
    try:
        Shape(entry["dtype"], entry["head_dim"], 1, entry["q_heads"], entry["kv_heads"], entry["q_len"], 1).validate()
    except (ValueError, TypeError) as err:
        raise GridError(f"{where}: {err}") from None
    return {f: entry[f] for f in HEAD_FIELDS}


def _check_batch_fits_the_call(head: dict, lengths: tuple[int, ...], where: str) -> None:
    """The bounds the paged call puts on a batch (``live.check_qkv``), checked before any timing."""
    from splitkv_tune.ops import _MAX_GRID_Y
    if len(lengths) * head["kv_heads"] > _MAX_GRID_Y:
        raise GridError(f"{where}: batch * kv_heads must be at most {_MAX_GRID_Y}, got "
                        f"{len(lengths)} * {head['kv_heads']}")


def _lengths(raw, where: str) -> list[tuple[str, tuple[int, ...]]]:
    if not isinstance(raw, list) or not raw:
        raise GridError(f"{where}: expected a non-empty list of lengths texts (uniform:16:8192, ...)")
    out = {}
    for i, text in enumerate(raw):
        if not isinstance(text, str) or not LABEL_RE.fullmatch(text.strip()):
            raise GridError(f"{where}[{i}]: expected a lengths text of the characters {LABEL_RE.pattern}, "
                            f"got {text!r}")
        try:
            out[text.strip()] = batches.parse_lengths(text)
        except ValueError as err:
            raise GridError(f"{where}[{i}]: {text!r}: {err}") from None
    return list(out.items())


def _space(raw, where: str) -> tuple[list, list, list, list, list]:
    optional = {"merge": ("auto", tunables.MERGES), "split_plan": ("fixed", plan.SPLIT_PLANS)}
    if not isinstance(raw, dict) or not set(SPACE_FIELDS) <= set(raw) <= {*SPACE_FIELDS, *optional}:
        raise GridError(f"{where}: expected a mapping of {list(SPACE_FIELDS)} and optionally {list(optional)}, "
                        f"got {raw!r}")
    lists = [_int_list(raw[f], f"{where}.{f}") for f in SPACE_FIELDS]
    for field, (default, choices) in optional.items():
        values = raw.get(field, [default])
        if not isinstance(values, list) or not values or any(not isinstance(m, str) for m in values):
            raise GridError(f"{where}.{field}: expected a non-empty list of {field}s {list(choices)}, got {values!r}")
        lists.append(values)
    try:
        plan_points.check_plan_space(*lists)
    except ValueError as err:
        raise GridError(f"{where}: {err}") from None
    return lists


def parse_batch_grid(raw, source: str = "<grid>") -> BatchGrid:
    """Validate a loaded grid document and expand its batches; ``GridError`` naming the field."""
    if not isinstance(raw, dict):
        raise GridError(f"{source}: expected a mapping at the top level")
    unknown = sorted(set(raw) - set(TOP_LEVEL_KEYS))
    if unknown:
        raise GridError(f"{source}: unknown key(s) {unknown}; allowed: {list(TOP_LEVEL_KEYS)}")
    missing = [k for k in ("heads", "page_size", "lengths", "space") if k not in raw]
    if missing:
        raise GridError(f"{source}: missing key(s) {missing}")
    if not isinstance(raw["heads"], list) or not raw["heads"]:
        raise GridError(f"{source}: heads: expected a non-empty list of head configurations")
    heads = [_head(entry, f"{source}: heads[{i}]") for i, entry in enumerate(raw["heads"])]
    page_sizes = _int_list(raw["page_size"], f"{source}: page_size")
    bad = [p for p in page_sizes if p not in plan.PAGE_SIZES]
    if bad:
        raise GridError(f"{source}: page_size: expected values in {plan.PAGE_SIZES}, got {bad}")
    lengths = _lengths(raw["lengths"], f"{source}: lengths")
    space = _space(raw["space"], f"{source}: space")
    out: dict[tuple, Batch] = {}
    for i, head in enumerate(heads):
        block_kvs, min_blocks, max_splits, merges, split_plans = space
        plans, dropped = plan_points.expand_plan_space(block_kvs, min_blocks, max_splits, head["head_dim"],
                                                       merges=merges, split_plans=split_plans)
        if not plans:
            raise GridError(f"{source}: space.block_kv: none of {dropped} is built at head_dim {head['head_dim']} "
                            f"(heads[{i}])")
        for label, values in lengths:
            _check_batch_fits_the_call(head, values, f"{source}: heads[{i}] with lengths {label}")
        for page_size in page_sizes:
            for label, values in lengths:
                batch = Batch(head, page_size, label, values, tuple(plans))
                out.setdefault(batch.key(), batch)
    return BatchGrid(batches=tuple(out.values()), timing=_parse_timing(raw.get("timing"), f"{source}: timing"),
                     source=source)


def load_batch_grid(path) -> BatchGrid:
    """A grid file: ``GridError`` when it is missing, not YAML or not a valid grid."""
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text())
    except OSError as err:
        raise GridError(f"{path}: cannot read the grid ({err.strerror})") from None
    except yaml.YAMLError as err:
        raise GridError(f"{path}: not valid YAML: {err}") from None
    return parse_batch_grid(raw, str(path))


def read_rows(path) -> list[dict]:
    """The rows of a sweep's CSV (dicts of strings); none when it does not exist or is empty.
    ``TableError`` when its columns are not compare-batch's or a line has another cell count. A
    CSV written before the ``split_plan`` column reads with it (``fixed`` where the row has
    knobs); the sweep's next write adds it to the file."""
    path = Path(path)
    if not path.exists() or path.stat().st_size == 0:
        return []
    header, rows = read_csv_rows(path)
    if header == [c for c in cb.COLUMNS if c != "split_plan"]:
        rows = with_legacy_split_plan(rows)
        header = cb.COLUMNS
    if header != cb.COLUMNS:
        have = header
        missing = [c for c in cb.COLUMNS if c not in have]
        unexpected = [c for c in have if c not in cb.COLUMNS]
        what = (f"missing {missing}, unexpected {unexpected}" if missing or unexpected
                else "the same columns in another order")
        raise TableError(path, f"not in compare-batch's columns ({what}); give --csv a new file")
    for i, row in enumerate(rows):
        if None in row or None in row.values():
            raise TableError(path, f"line {i + 2}: not {len(cb.COLUMNS)} cells as the header has")
    return rows


@dataclasses.dataclass
class SweepPlan:
    """What a run of the grid against the CSV does: which batches it times."""

    grid: BatchGrid
    peers: tuple[str, ...]
    rows: list[dict]  # the CSV's
    todo: list[Batch]  # the stale ones last
    complete: list[Batch]
    stale: list[Batch]  # in the CSV without every row the grid asks: timed again, replaced

    def timed_rows(self) -> int:
        return sum(len(b.impls(self.peers)) - 1 for b in self.todo)  # the floor is not timed

    def estimate_s(self) -> float:
        return sum(batch_seconds(b, self.grid.timing, len(self.peers)) for b in self.todo)


def plan_sweep(grid: BatchGrid, csv_path, peers=()) -> SweepPlan:
    """Compare the grid's batches with the CSV's rows (``read_rows``)."""
    cb.check_peers(peers)
    rows = read_rows(csv_path)
    # A row that failed or was wrong (an out-of-memory launch, say) is no measurement: its batch
    # is timed again.
    present: dict[tuple, set] = {}
    for row in rows:
        impls = present.setdefault(tuple(row[c] for c in KEY_COLUMNS), set())
        if row["status"] not in ("failed", "wrong"):
            impls.add(row["impl"])
    todo, complete, stale = [], [], []
    for batch in grid.batches:
        have = present.get(batch.key())
        if have is not None and set(batch.impls(peers)) <= have:
            complete.append(batch)
            continue
        (stale if have is not None else todo).append(batch)
    return SweepPlan(grid, tuple(peers), rows, todo + stale, complete, stale)


def batch_seconds(batch: Batch, timing: dict, peers: int = 0) -> float:
    """The dry run's estimate of one batch (the cost model above ``SAMPLES_PER_STEP``)."""
    live_bytes = 2 * sum(batch.lengths) * batch.head["kv_heads"] * batch.head["head_dim"] * 2
    replay_s = bench.MIN_LAUNCHES_PER_GRAPH * live_bytes / (ESTIMATE_COPY_BW_GBPS * 1e9)
    steps = math.ceil(timing["min_reps"] / SAMPLES_PER_STEP)
    row_s = (max(timing["warmup_s"], replay_s) + max(timing["max_time_s"], steps * SAMPLES_PER_STEP * replay_s)
             + ROW_OVERHEAD_S)
    return BATCH_OVERHEAD_S + row_s * (1 + len(batch.plans) + peers)


def _csv_text(rows: list[dict]) -> str:
    out = io.StringIO()
    writer = csv.DictWriter(out, cb.COLUMNS, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return out.getvalue()


@contextlib.contextmanager
def sole_writer(csv_path):
    """Holds an exclusive lock on ``CSV.lock`` while the block runs; ``ValueError`` naming the CSV
    when another sweep holds it. The lock dies with its process, so a killed sweep leaves none."""
    lock_path = Path(f"{csv_path}.lock")
    with open(lock_path, "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ValueError(f"{csv_path}: another sweep-batches or evaluate-batches is writing it "
                             f"(it holds {lock_path}); "
                             "wait for it, or give this one another --csv") from None
        yield


def run_sweep(sweep: SweepPlan, csv_path, *, device=None, copy_bw: float | None = None,
              progress=None) -> list[tuple[Batch, str]]:
    """Time every batch of ``sweep.todo`` and write the CSV after each (see the module); the
    batches skipped as their inputs do not fit in the device's memory, with the reason."""
    import torch

    from splitkv_tune.table import atomic_write_text
    device = torch.device(device) if device is not None else bench.default_device("cuda")
    timing = dict(sweep.grid.timing)
    # A stale batch's old rows stay until its new ones replace them in the same write.
    replaced: set[tuple] = set()
    blocks: list[str] = []
    skipped = []
    for i, batch in enumerate(sweep.todo):
        h = batch.head
        problem = cb.input_memory_problem(batch.lengths, kv_heads=h["kv_heads"], head_dim=h["head_dim"],
                                          page_size=batch.page_size, device=device)
        if progress:
            progress(f"batch {i + 1}/{len(sweep.todo)} {batch.describe()}" + (f": skipped, {problem}" if problem
                                                                                else " ..."))
        if problem:
            skipped.append((batch, problem))
            continue
        if copy_bw is None:  # measured once, after the first batch that fits
            copy_bw = bench.copy_bandwidth_gbps(device, **timing)
        frame = cb.run_compare_batch(batch.label, **h, page_size=batch.page_size, peers=sweep.peers, one_split=None,
                                     device=device, timing=timing, copy_bw=copy_bw, plans=batch.plans,
                                     layout_rows=False)
        blocks.append(frame.to_csv(header=False, index=False, lineterminator="\n"))
        replaced.add(batch.key())
        kept = [r for r in sweep.rows if tuple(r[c] for c in KEY_COLUMNS) not in replaced]
        atomic_write_text(csv_path, _csv_text(kept) + "".join(blocks))
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return skipped


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:.1f} min"


def describe_plan(sweep: SweepPlan, csv_path) -> str:
    """The dry run: every batch with what a run does to it, the rows to time and the estimate."""
    state = {b.key(): "to time" for b in sweep.todo}
    state.update({b.key(): "complete" for b in sweep.complete})
    state.update({b.key(): "re-time" for b in sweep.stale})
    peers = len(sweep.peers)
    lines = [f"grid {sweep.grid.source}: {len(sweep.grid.batches)} batches; peers: "
             f"{', '.join(sweep.peers) or 'none'}"]
    for batch in sweep.grid.batches:
        rows = len(batch.impls(sweep.peers)) - 1
        lines.append(f"  [{state[batch.key()]}] {batch.describe()}: {rows} timed rows, "
                     f"~{batch_seconds(batch, sweep.grid.timing, peers):.0f} s")
    t = sweep.grid.timing
    lines.append(f"to time: {len(sweep.todo)} batches ({len(sweep.stale)} to re-time), {sweep.timed_rows()} rows, "
                 f"about {_minutes(sweep.estimate_s())} of GPU time (a row: warm-up {t['warmup_s']:g} s, samples "
                 f"for at least {t['max_time_s']:g} s, {ROW_OVERHEAD_S:g} s capture and check; "
                 f"{BATCH_OVERHEAD_S:g} s a batch); {len(sweep.complete)} already complete in {csv_path}: skipped")
    return "\n".join(lines)
