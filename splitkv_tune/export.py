"""Export a heuristics table for inference servers: CSV or per-device JSON (the C++ header
is ``export_cpp``).

Every export goes through ``table_schema.validate_heuristics`` first, and the writers check
again that each name they emit matches ``[A-Za-z0-9_.-]+``, so no table can put code into a
server's build. Rows are written in canonical order (sorted by shape), the order the C++
lookup and ``selector.HeuristicTable`` number them.

JSON: one file per (device name, dtype, head_dim), named like vLLM's tuned configs,
``device_name=NVIDIA_H100_80GB_HBM3,dtype=bf16,head_dim=128.json``. The device name follows
vLLM: ``torch.cuda.get_device_name().replace(" ", "_")``, one file for each device name of
the GPU's profile (``gpus.device_names``; the table's GPU name upper-cased when it has none).
Keys ``"causal=0,batch=1,q_heads=32,kv_heads=8,q_len=1,kv_len=4096"`` map to the winner
config and its measurements; ``_metadata`` holds the JSON's schema version
(``JSON_SCHEMA_VERSION``), the normalised GPU name, the device names, run ids, tool name and
version and the lookup's constants. The format is ``schemas/heuristics.schema.json`` (JSON
Schema); :func:`load_json` reads files back into the same table and :func:`read_table_file`
reads either format.
"""
from __future__ import annotations

import functools
import json
import math
import re
from pathlib import Path

import pandas as pd

from splitkv_tune import __version__, tunables
from splitkv_tune.gpus import device_names as profile_device_names
from splitkv_tune.gpus import GpuProfile
from splitkv_tune.interpolation import Q, WAVE_ROUNDING_FROM, fits_block_kv, wave_slots
from splitkv_tune.selector import NEIGHBOURS, SK_DROP_BITS, HeuristicTable, _profiles
from splitkv_tune.table_schema import (HEURISTICS_COLUMNS, NAME_RE, PER_BLOCK_KV_COLUMNS, SCHEMA_VERSION,
                                       SHAPE_COLUMNS, TableError, check_export_metadata, check_keys, json_cell,
                                       keep_gpu, read_heuristics, read_json, refuse_other_json_table, rows_named,
                                       validate_heuristics)

SCHEMA_PATH = Path(__file__).resolve().parent / "schemas" / "heuristics.schema.json"
# The JSON's own version (``_metadata.schema_version``), apart from the CSV table's: 2 added
# ``lookup.sms`` and ``lookup.sm_balance_pct``, a step of the lookup rule (the interpolated S
# raised until the SMs share its CTAs evenly) that a reader of version 1 would not apply. The
# entries are the same in both, and both are read back.
JSON_SCHEMA_VERSION = 2
# The versions read back, each with the lookup keys it must have.
LOOKUP_KEYS_OF_VERSION = {1: (), 2: ("sms", "sm_balance_pct")}

KEY_COLUMNS = [c for c in SHAPE_COLUMNS if c not in ("dtype", "head_dim")]
KEY_FORMAT = ",".join(f"{c}={{{c}}}" for c in KEY_COLUMNS)
_KEY_RE = re.compile(",".join(f"{c}=({'[01]' if c == 'causal' else '[1-9][0-9]*'})" for c in KEY_COLUMNS))
_ENTRY_COLUMNS = [c for c in HEURISTICS_COLUMNS
                  if c not in ["schema_version", "gpu"] + SHAPE_COLUMNS]
_REQUIRED_ENTRY_COLUMNS = [c for c in _ENTRY_COLUMNS if c not in {c for pair in PER_BLOCK_KV_COLUMNS for c in pair}]


@functools.cache
def _schema_keys() -> tuple[list[str], list[str]]:
    """The keys the schema requires of ``_metadata`` and of every version's ``lookup`` (the
    schema is their one definition; LOOKUP_KEYS_OF_VERSION adds the later versions' own)."""
    meta = json.loads(SCHEMA_PATH.read_text())["properties"]["_metadata"]
    return meta["required"], meta["properties"]["lookup"]["required"]


def _safe(name: str) -> str:
    if not isinstance(name, str) or not NAME_RE.fullmatch(name):
        raise TableError("<export>", f"refusing to emit name {name!r}")
    return name


def _table(df: pd.DataFrame, gpu: str | None, source) -> HeuristicTable:
    return HeuristicTable(validate_heuristics(df, source), gpu=gpu, source=source)


def csv_text(df: pd.DataFrame, gpu: str | None = None, source="<table>") -> str:
    """The validated table as CSV text (schema columns, canonical order, ``schema_version`` column)."""
    return _table(df, gpu, source).frame[HEURISTICS_COLUMNS].to_csv(index=False)


def export_csv(df: pd.DataFrame, path, gpu: str | None = None, source="<table>") -> Path:
    """Write :func:`csv_text` to ``path``."""
    text = csv_text(df, gpu, source)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def device_names(gpu: str) -> list[str]:
    """vLLM-style device names of a table GPU (``torch.cuda.get_device_name()`` with ``_``
    for spaces); the GPU name upper-cased for a GPU without a profile.

    >>> device_names("nvidia_h200"), device_names("my_gpu_9000")
    (['NVIDIA_H200'], ['MY_GPU_9000'])
    """
    return [_safe(n) for n in profile_device_names(gpu)] or [_safe(gpu).upper()]


def json_name(device: str, dtype: str, head_dim: int) -> str:
    """File name of one JSON export.

    >>> json_name("NVIDIA_H200", "bf16", 128)
    'device_name=NVIDIA_H200,dtype=bf16,head_dim=128.json'
    """
    return f"device_name={_safe(device)},dtype={_safe(dtype)},head_dim={int(head_dim)}.json"


def _plain(value):
    if value is None or value is pd.NA or (isinstance(value, float) and math.isnan(value)):
        return None
    if isinstance(value, str):
        return _safe(value)
    if hasattr(value, "item"):
        value = value.item()
    return value


def lookup_constants(profile: GpuProfile | None, fallback: GpuProfile, head_dim: int) -> dict:
    """The constants of the selector's rule a reader of the JSON needs (README: "How the
    selector decides"), for one GPU (``profile``: None when unknown; ``fallback``: the profile
    the waves use) and head dim."""
    tiles = sorted({tunables.block_m_for(16), tunables.block_m_for(17)})
    return {"neighbours": NEIGHBOURS, "log2_fraction_bits": Q, "sk_drop_bits": SK_DROP_BITS,
            "max_splits": tunables.MAX_SPLITS, "block_kv": list(tunables.BLOCK_KV),
            "block_m": {"rows_le_16": tunables.block_m_for(16), "otherwise": tunables.block_m_for(17)},
            "wave_rounding_from": WAVE_ROUNDING_FROM, "finest_split_cap": True,
            "sms": fallback.sms, "sm_balance_pct": fallback.sm_balance_pct,
            "wave_slots": {str(bm): dict(zip(map(str, tunables.BLOCK_KV), wave_slots(head_dim, bm, fallback)))
                           for bm in tiles},
            "block_kv_fits": {str(bm): dict(zip(map(str, tunables.BLOCK_KV), fits_block_kv(head_dim, bm, profile)))
                              for bm in tiles}}


def export_json(df: pd.DataFrame, out_dir, gpu: str | None = None, source="<table>") -> list[Path]:
    """One JSON file per (device name, dtype, head_dim) of the table's GPU in ``out_dir``;
    returns the paths."""
    table = _table(df, gpu, source)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    names = device_names(table.gpu)
    profile, fallback = _profiles(None, table)  # the smem check's (None: unknown) and the waves'

    paths = []
    for (dtype, head_dim), part in table.frame.groupby(["dtype", "head_dim"], sort=True):
        entries = {}
        for rec in part.to_dict("records"):
            key = ",".join(f"{c}={int(rec[c])}" for c in KEY_COLUMNS)
            entries[key] = {c: _plain(rec[c]) for c in _ENTRY_COLUMNS}
        for name in names:
            meta = {"schema_version": JSON_SCHEMA_VERSION, "gpu": _safe(table.gpu),
                    "device_name": name, "device_names": names, "dtype": _safe(dtype),
                    "head_dim": int(head_dim),
                    "run_ids": [_safe(r) for r in sorted(set(part["run_id"]))],
                    "tool": "splitkv-tune", "tool_version": _safe(__version__),
                    "key_format": KEY_FORMAT,
                    "lookup": lookup_constants(profile, fallback, int(head_dim))}
            path = out_dir / json_name(name, dtype, head_dim)
            path.write_text(json.dumps({"_metadata": meta, **entries}, indent=1,
                                       allow_nan=False) + "\n")
            paths.append(path)
    return paths


def _check_metadata(meta: dict) -> dict:
    """The CSV cells ``_metadata`` gives every row; ``ValueError`` naming ``_metadata`` and what the
    schema refuses in it (the lookup's constants are the reader's of the file, not this tool's: only
    their keys are checked)."""
    meta_keys, lookup_keys = _schema_keys()
    check_keys("_metadata", meta, meta_keys, meta_keys)
    version = meta["schema_version"]
    if type(version) is not int or version not in LOOKUP_KEYS_OF_VERSION:
        raise ValueError(f"schema_version is {version!r}, this tool reads exported "
                         f"JSON of version {' or '.join(map(str, LOOKUP_KEYS_OF_VERSION))}")
    if meta["key_format"] != KEY_FORMAT:
        raise ValueError(f"_metadata.key_format must be {KEY_FORMAT!r}")
    check_export_metadata(meta)
    runs = meta["run_ids"]
    if not isinstance(runs, list) or not runs or not all(isinstance(r, str) and NAME_RE.fullmatch(r) for r in runs):
        raise ValueError(f"_metadata.run_ids must be a list of names matching {NAME_RE.pattern}")
    if not isinstance(meta["gpu"], str) or not NAME_RE.fullmatch(meta["gpu"]):
        raise ValueError(f"_metadata.gpu must be a name matching {NAME_RE.pattern}")
    for key, allowed in (("dtype", tunables.DTYPES), ("head_dim", tunables.HEAD_DIMS)):
        if type(meta[key]) is not type(allowed[0]) or meta[key] not in allowed:
            raise ValueError(f"_metadata.{key} must be one of {allowed}, got {json.dumps(meta[key])[:40]}")
    lookup = meta["lookup"]
    if not isinstance(lookup, dict):
        raise ValueError("_metadata.lookup must be an object")
    missing = [k for k in lookup_keys + list(LOOKUP_KEYS_OF_VERSION[version]) if k not in lookup]
    if missing:
        raise ValueError(f"_metadata.lookup has no {', '.join(missing)}, which version {version} requires")
    check_keys("_metadata.lookup", lookup, (), lookup_keys + list(LOOKUP_KEYS_OF_VERSION[JSON_SCHEMA_VERSION]))
    return {"schema_version": str(SCHEMA_VERSION), "gpu": meta["gpu"], "dtype": meta["dtype"],
            "head_dim": str(meta["head_dim"])}


def _json_rows(doc) -> list[tuple[str, dict]]:
    """(key, row of CSV cells) of each entry of an export; ``ValueError`` naming what the schema
    (schemas/heuristics.schema.json) refuses: keys, types and the shape key's format."""
    if not isinstance(doc, dict) or not isinstance(doc.get("_metadata"), dict):
        raise ValueError("the top level must be an object with a _metadata object and one entry per shape")
    refuse_other_json_table(doc, "heuristics")
    context = _check_metadata(doc["_metadata"])
    rows = []
    for key, entry in doc.items():
        if key == "_metadata":
            continue
        shape = _KEY_RE.fullmatch(key)
        if shape is None:
            raise ValueError(f"entry {key[:60]!r}: keys must be {KEY_FORMAT!r} with integers, causal 0 or 1")
        if not isinstance(entry, dict):
            raise ValueError(f"entry {key!r} must be an object")
        check_keys(f"entry {key!r}", entry, _REQUIRED_ENTRY_COLUMNS, _ENTRY_COLUMNS)
        try:
            cells = {c: json_cell(c, entry.get(c)) for c in _ENTRY_COLUMNS}
        except ValueError as exc:
            raise ValueError(f"entry {key!r}: {exc}") from None
        rows.append((key, {**context, **dict(zip(KEY_COLUMNS, shape.groups())), **cells}))
    return rows


def load_json(paths) -> pd.DataFrame:
    """Read exported JSON files back into a validated heuristics table."""
    rows, entries = [], []  # entries: (file, key) of each row
    for path in paths:
        doc = read_json(path, "an exported splitkv-tune JSON table")
        try:
            for key, row in _json_rows(doc):
                entries.append((path, key))
                rows.append(row)
        except ValueError as exc:
            raise TableError(path, f"not an exported splitkv-tune JSON table: {exc}") from None
    df = pd.DataFrame(rows, columns=HEURISTICS_COLUMNS, dtype=object)
    with rows_named(lambda row: (entries[row][0], f"entry {entries[row][1]!r}")):
        return validate_heuristics(df.astype(str), ", ".join(map(str, paths)))


def read_table_file(path, gpu: str | None = None) -> pd.DataFrame:
    """A validated heuristics table from a ``heuristics.csv`` or an exported ``.json`` file;
    with ``gpu``, that GPU's rows (an error naming the GPUs the file has when there are none)."""
    if str(path).endswith(".json"):
        if not Path(path).is_file():
            raise TableError(path, "no such file")
        df = load_json([path])
        return df if gpu is None else keep_gpu(df, gpu, path)
    return read_heuristics(path, gpu=gpu)
