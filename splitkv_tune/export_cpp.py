"""The C++ header export: a self-contained C++17 header (only ``<cstdint>``) with the
selector's rule over one or several GPUs' tables and a dispatch by device name.

Layout: generated-file banner; include guard ``SPLITKV_TUNE_TABLE_<GPU>_H_`` (one GPU) or
``SPLITKV_TUNE_TABLES_<GPU>_<GPU>..._H_``; the shared types (``splitkv_tune::Config``, the
dtype/policy/kind codes) under their own guard; per GPU a namespace
``splitkv_tune::gpu_<gpu>`` with ``constexpr Row kRows[]`` in canonical order and the derived
interpolation values, the GPU profile and cost-model constants, ``matches_device()`` and
``select_config()``; then ``splitkv_tune::select_config_for_device()``.
"""
from __future__ import annotations

from pathlib import Path

from splitkv_tune import __version__, tunables
from splitkv_tune.analytic import MODEL, CostModel, cta_stream_rate
from splitkv_tune.export import _safe
from splitkv_tune.gpus import aliases_of, normalize_gpu_name
from splitkv_tune.paths import kernel_include_dir
from splitkv_tune.interpolation import Q, WAVE_ROUNDING_FROM, log2_q16
from splitkv_tune.selector import NEIGHBOURS, SK_DROP_BITS, HeuristicTable, _profiles
from splitkv_tune.table_schema import MAX_DIM, SCHEMA_VERSION, TableError

# The header's C++ text, with @NAME@ placeholders that _fill replaces.
TEMPLATES = Path(__file__).resolve().parent / "templates"


def _template(name: str) -> str:
    return (TEMPLATES / f"{name}.h.in").read_text()


def _fill(text: str, subs: dict) -> str:
    """``text`` with every ``@KEY@`` of ``subs`` replaced by its value."""
    for key, value in subs.items():
        text = text.replace(f"@{key}@", value)
    return text


def embedded_rules() -> str:
    """tunables.h, rules.h and live_plan.h, the kernel's own rule definitions and its load-aware
    plan, and live_model.h, the selector's model on them, as the header embeds them: without
    their include lines, under a guard of their own (several exported headers may embed them)."""
    parts = []
    for name in ("tunables.h", "rules.h", "live_plan.h", "live_model.h"):
        text = (kernel_include_dir() / "splitkv" / name).read_text()
        if name == "tunables.h":  # the constants; not the lists of kernel instantiations
            head, _, _ = text.partition("// X(")
            text = head.rstrip() + "\n\n}  // namespace splitkv\n"
        parts.append("\n".join(line for line in text.splitlines()
                               if not line.startswith(("#pragma once", "#include"))))
    return ("#ifndef SPLITKV_RULES_EMBEDDED_\n#define SPLITKV_RULES_EMBEDDED_\n"
            + "\n".join(parts) + "\n#endif  // SPLITKV_RULES_EMBEDDED_\n")


def _bucket_mantissas() -> list[int]:
    """Per fraction ``j << SK_DROP_BITS`` of an Sk coordinate, the smallest 31-bit mantissa
    ``y`` (``2**30 <= y < 2**31``) whose ``log2_q16`` reaches it (the header's
    ``kBucketMantissa``)."""
    out = []
    for j in range(1 << (Q - SK_DROP_BITS)):
        want = (30 << Q) + (j << SK_DROP_BITS)
        lo, hi = 1 << 30, (1 << 31) - 1
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (mid + 1, hi) if log2_q16(mid) < want else (lo, mid)
        out.append(lo)
    return out


def _render_namespace(table: HeuristicTable, model: CostModel) -> str:
    """The ``splitkv_tune::gpu_<gpu>`` namespace of one GPU's table."""
    if not len(table):
        raise TableError(table.source, "empty table (no rows)")
    gpu = _safe(table.gpu)
    profile, fb = _profiles(None, table)
    rows = []
    pol = tunables.policy_codes()
    for idx, (key, cfg) in enumerate(table.rows):
        _safe(cfg.split_policy)
        conf = f"{{{cfg.num_splits}, {cfg.block_kv}, {cfg.reduce_threads}, {pol[cfg.split_policy]}}}"
        votes = ["{" + ", ".join(str(-1 if v is None else int(v[part])) for v in table.votes[idx]) + "}"
                 for part in (0, 1, 2)]
        rows.append("  {" + ", ".join(str(int(v)) for v in key) + f", {conf}, " + ", ".join(votes)
                    + f"}},  // #{idx + 1}")
    classes, class_rows, class_coords = [], [], []
    for (dcode, hd, causal, bm), members in sorted(table.buckets.items()):
        begin = len(class_rows)
        for i, coords in sorted(members):
            class_rows.append(str(i))
            class_coords.append("  {" + ", ".join(str(int(v)) for v in coords) + "},")
        classes.append("{" + ", ".join(map(str, (dcode, hd, causal, bm, begin, len(class_rows)))) + "}")
    names = sorted({normalize_gpu_name(gpu), *aliases_of(gpu)})
    subs = {
        "NCLASSROWS": str(len(classes)), "CLASSRANGES": ", ".join(classes),
        "CLASSROWS": ", ".join(class_rows), "CLASSCOORDS": "\n".join(class_coords),
        "GPU": gpu, "NS": "gpu_" + normalize_gpu_name(gpu), "K": str(NEIGHBOURS),
        "DEVICE_NAMES": ", ".join(f'"{_safe(n)}"' for n in names),
        "NROWS": str(len(rows)), "ROWS": "\n".join(rows), "SCHEMA": str(SCHEMA_VERSION),
        "KNOWN": "true" if profile is not None else "false",
        "SMEM": str(int((profile or fb).smem_per_block)), "FBNAME": _safe(fb.name),
        "SMS": str(int(fb.sms)), "BW": str(int(round(fb.copy_bw_gbps * 1000))),
        "L2": str(int(fb.l2_bytes)), "FBSMEM": str(int(fb.smem_per_sm)),
        "FBSMEMBLOCK": str(int(fb.smem_per_block)), "SMBALANCE": str(int(fb.sm_balance_pct)),
        "BLOCK_KV": ", ".join(map(str, tunables.BLOCK_KV)), "NBKV": str(len(tunables.BLOCK_KV)),
        "MAXS": str(tunables.MAX_SPLITS),
        "SPLITCOUNTS": ", ".join(map(str, tunables.SPLIT_COUNTS)), "NSPLITCOUNTS": str(len(tunables.SPLIT_COUNTS)),
        "SKDROP": str(SK_DROP_BITS),
        "BUCKETS": ", ".join(map(str, _bucket_mantissas())),
        "LOGSPLITS": "0, " + ", ".join(str(log2_q16(s)) for s in range(1, tunables.MAX_SPLITS + 1)),
        "WAVEROUND": str(WAVE_ROUNDING_FROM),
        "MAXDIM": str(MAX_DIM),
        "HEADDIM_CHECK": " && ".join(f"head_dim != {h}" for h in tunables.HEAD_DIMS),
    }
    subs.update({k: str(int(v)) for k, v in vars(model).items()})
    subs["cta_stream_mbps"] = str(cta_stream_rate(fb, model))
    return _fill(_template("gpu_namespace"), subs)


def _render_batch_classes(gpu: str, records: list[dict]) -> str:
    """The ``splitkv_tune::gpu_<gpu>`` batch classes, in ``batch_select.class_order`` (so that
    the first nearest class is the one Python picks), and ``select_live_knobs()``; ``records``:
    one GPU's batch-table records, none for the "auto" knobs alone."""
    from splitkv_tune.batch_select import PAGE_SCALE, class_order, max_class_distance_q
    from splitkv_tune.batch_table import CLASS_COLUMNS, LABEL_RE
    from splitkv_tune.plan import SPLIT_PLANS
    merges = {name: i for i, name in enumerate(tunables.MERGES)}
    split_plans = {name: i for i, name in enumerate(SPLIT_PLANS)}
    dtypes = tunables.dtype_codes()
    rows = []
    for rec in sorted(records, key=class_order):
        values = [dtypes[rec["dtype"]]] + [rec[c] for c in CLASS_COLUMNS[1:]]
        values += [rec["block_kv"], rec["min_blocks_per_split"], rec["max_splits"], merges[rec["merge"]],
                   split_plans[rec["split_plan"]]]
        values += [log2_q16(rec[c]) for c in ("batch", "len_max", "len_mean", "page_size")]
        if not LABEL_RE.fullmatch(rec["lengths"]):  # the reader checked it; a comment must not end early
            raise TableError("<export>", f"refusing to emit lengths {rec['lengths']!r}")
        rows.append("  {" + ", ".join(str(int(v)) for v in values) + f"}},  // {rec['lengths']}")
    sources = sorted({_safe(r["source"]) for r in records}) or ["no batch table"]
    return _fill(_template("batch_classes"), {
        "NS": "gpu_" + normalize_gpu_name(gpu), "NCLASSES": str(len(rows)), "NARRAY": str(max(1, len(rows))),
        "CLASSES": "\n".join(rows) or "  {}", "SOURCES": ", ".join(sources), "PAGESCALE": str(PAGE_SCALE),
        "MAXDISTANCE": str(max_class_distance_q()),
        "HEADDIM_CHECK": " && ".join(f"head_dim != {h}" for h in tunables.HEAD_DIMS)})


def _batch_classes_by_gpu(records) -> dict[str, list[dict]]:
    """Batch-table records by normalised GPU name; ``TableError`` for a class given twice (two
    files of one GPU that overlap would give it two sets of knobs)."""
    from splitkv_tune.batch_table import CLASS_COLUMNS
    out: dict[str, list[dict]] = {}
    seen = set()
    for rec in records:
        name = normalize_gpu_name(rec["gpu"])
        key = (name, *(rec[c] for c in CLASS_COLUMNS))
        if key in seen:
            raise TableError("<export>", f"the batch class {dict(zip(CLASS_COLUMNS, key[1:]))} of {name} is given "
                             "twice: give each GPU's batch table once")
        seen.add(key)
        out.setdefault(name, []).append(rec)
    return out


def _merge_codes() -> str:
    return ", ".join(f"kMerge{name.capitalize()} = {i}" for i, name in enumerate(tunables.MERGES))


def _camel(name: str) -> str:
    return "".join(part.capitalize() for part in name.split("_"))


def _split_plan_codes() -> dict[str, str]:
    from splitkv_tune.plan import SPLIT_PLANS
    return {"SPLITPLANCODES": ", ".join(f"kSplitPlan{_camel(name)} = {i}" for i, name in enumerate(SPLIT_PLANS)),
            "SPLITPLANNAMES": ", ".join(f'"{name}"' for name in SPLIT_PLANS)}


def render_cpp_header(tables, model: CostModel = MODEL, batch_classes=()) -> str:
    """Text of the header for one :class:`HeuristicTable` or a list of them (one per GPU);
    ``batch_classes``: batch-table records (``batch_table_json.read_batch_table_file``) of some
    of those GPUs, by their ``gpu`` (the others get the "auto" knobs alone)."""
    tables = [tables] if isinstance(tables, HeuristicTable) else list(tables)
    if not tables:
        raise TableError("<export>", "no tables to export")
    gpus = [_safe(t.gpu) for t in tables]
    if len(set(gpus)) != len(gpus):
        raise TableError("<export>", f"several tables for one GPU: {', '.join(gpus)}")
    batch_tables = _batch_classes_by_gpu(batch_classes)
    stray = sorted(set(batch_tables) - {normalize_gpu_name(g) for g in gpus})
    if stray:
        raise TableError("<export>", f"a batch table of {', '.join(stray)}, but no heuristics table of it "
                         f"among {', '.join(gpus)}")
    norm = [normalize_gpu_name(g).upper() for g in gpus]
    guard = (f"SPLITKV_TUNE_TABLE_{norm[0]}_H_" if len(norm) == 1
             else "SPLITKV_TUNE_TABLES_" + "_".join(norm) + "_H_")
    dispatch = "\n".join(
        f"  if (gpu_{normalize_gpu_name(g)}::matches_device(device_name))\n"
        f"    return gpu_{normalize_gpu_name(g)}::select_config(dtype, head_dim, batch, q_heads, "
        "kv_heads, q_len, kv_len, causal, out, kind, num_sms);" for g in gpus)
    live_dispatch = "\n".join(
        f"  if (gpu_{normalize_gpu_name(g)}::matches_device(device_name))\n"
        f"    return gpu_{normalize_gpu_name(g)}::select_live_knobs(dtype, head_dim, q_heads, kv_heads, q_len, "
        "page_size, lengths, batch, out, num_sms, ctas_per_sm);" for g in gpus)
    runs = sorted({_safe(r) for t in tables for r in t.run_ids})
    head = _fill(_template("banner"), {"VERSION": _safe(__version__), "GPUS": ", ".join(gpus),
                                       "SCHEMA": str(SCHEMA_VERSION), "RUNS": " ".join(runs),
                                       "RULES": embedded_rules(), "GUARD": guard, "MERGECODES": _merge_codes(),
                                       **_split_plan_codes()})
    body = "".join(_render_namespace(t, model) + "\n"
                   + _render_batch_classes(t.gpu, batch_tables.get(normalize_gpu_name(t.gpu), [])) + "\n"
                   for t in tables)
    return head + body + _fill(_template("dispatch"), {"DISPATCH": dispatch, "LIVEDISPATCH": live_dispatch,
                                                        "GUARD": guard})


def export_cpp_header(tables, path, model: CostModel = MODEL, batch_classes=()) -> Path:
    """Write the header of ``tables`` (a :class:`HeuristicTable` or a list) to ``path``."""
    path = Path(path)
    text = render_cpp_header(tables, model, batch_classes)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path
