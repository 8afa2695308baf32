"""The batch-class table (schema v3, :mod:`splitkv_tune.batch_table`) as one JSON file per GPU,
the v1 JSON export's counterpart (:mod:`splitkv_tune.export`).

``{"_metadata": {...}, "classes": [...]}``: ``_metadata`` holds the schema version (3), the
normalised GPU name, the vLLM-style device name (``torch.cuda.get_device_name().replace(" ",
"_")``, the first of the GPU's profile, the name upper-cased without one) and all of them, and
the tool and its version; ``classes`` holds the table's rows without ``schema_version`` and
``gpu``, integers as integers, the runner-up ``null`` when there is none. The format is
``schemas/batch_table.schema.json`` (JSON Schema). The reader checks the JSON types and keys,
then turns the classes back into the CSV's cells and checks them as ``read_batch_table`` does,
so it returns the same records (a version-2 file, without the split plan, as ``fixed``). It
imports no pandas.
"""
from __future__ import annotations

import json
from pathlib import Path

from splitkv_tune import __version__
from splitkv_tune.batch_table import (_CHOICES, _FLOATS, _NAMES, BATCH_SCHEMA_VERSION, BATCH_TABLE_COLUMNS,
                                      RUNNER_UP_COLUMNS, SPLIT_PLAN_COLUMNS, keep_batch_gpu, read_batch_table,
                                      validate_batch_records)
from splitkv_tune.gpus import device_names as profile_device_names
from splitkv_tune.table_schema import (TableError, check_export_metadata, check_keys, json_cell, read_json,
                                       refuse_other_json_table, rows_named)

SCHEMA_PATH = Path(__file__).resolve().parent / "schemas" / "batch_table.schema.json"
CLASS_KEYS = BATCH_TABLE_COLUMNS[2:]  # less schema_version and gpu, which _metadata holds
META_KEYS = ["schema_version", "gpu", "device_name", "device_names", "tool", "tool_version"]


def device_names(gpu: str) -> list[str]:
    """vLLM-style device names of a table GPU, as ``export.device_names`` gives them.

    >>> device_names("nvidia_h200"), device_names("my_gpu_9000")
    (['NVIDIA_H200'], ['MY_GPU_9000'])
    """
    return profile_device_names(gpu) or [gpu.upper()]


def batch_table_json(records) -> dict:
    """The JSON document of one GPU's batch-table records (``TableError`` for several GPUs)."""
    records = validate_batch_records(BATCH_TABLE_COLUMNS, [{c: _cell_text(r.get(c)) for c in BATCH_TABLE_COLUMNS}
                                                          for r in records], "<export>")
    gpus = sorted({r["gpu"] for r in records})
    if len(gpus) != 1:
        raise TableError("<export>", f"one JSON file holds one GPU's classes, the table has {', '.join(gpus)}")
    names = device_names(gpus[0])
    meta = {"schema_version": BATCH_SCHEMA_VERSION, "gpu": gpus[0], "device_name": names[0],
            "device_names": names, "tool": "splitkv-tune", "tool_version": __version__}
    return {"_metadata": meta, "classes": [{c: r[c] for c in CLASS_KEYS} for r in records]}


def _cell_text(value) -> str:
    return "" if value is None else str(value)


def write_batch_table_json(path, records) -> Path:
    """Write the JSON document atomically (``table.atomic_write_text``, which brings pandas)."""
    from splitkv_tune.table import atomic_write_text
    return atomic_write_text(path, json.dumps(batch_table_json(records), indent=1, allow_nan=False) + "\n")


def _json_cell(col: str, value) -> str:
    """One class value as the CSV cell it stands for (``table_schema.json_cell`` with the batch
    table's columns)."""
    return json_cell(col, value, optional=frozenset(RUNNER_UP_COLUMNS), text=frozenset({*_NAMES, *_CHOICES}),
                     floats=frozenset(_FLOATS))


def _check_metadata(meta) -> dict:
    if not isinstance(meta, dict):
        raise ValueError("_metadata must be an object")
    check_keys("_metadata", meta, META_KEYS, META_KEYS)
    if type(meta["schema_version"]) is not int:
        raise ValueError(f"_metadata: schema_version must be an integer, got {json.dumps(meta['schema_version'])}")
    check_export_metadata(meta)
    return meta


def _raw_rows(doc) -> tuple[list[str], list[dict]]:
    """The document's classes as a CSV's header and rows (dicts of strings); ``ValueError``
    naming the problem."""
    if not isinstance(doc, dict):
        raise ValueError("the document must be an object")
    refuse_other_json_table(doc, "batch")
    check_keys("the document", doc, ["_metadata", "classes"], ["_metadata", "classes"])
    meta = _check_metadata(doc["_metadata"])
    classes = doc["classes"]
    if not isinstance(classes, list):
        raise ValueError("classes must be a list")
    # Version 2 had no split plan: its classes read as "fixed" (batch_table.validate_batch_records).
    keys = [c for c in CLASS_KEYS if meta["schema_version"] != 2 or c not in SPLIT_PLAN_COLUMNS]
    rows = []
    for i, entry in enumerate(classes):
        if not isinstance(entry, dict):
            raise ValueError(f"classes[{i}] must be an object")
        required = [c for c in keys if c not in RUNNER_UP_COLUMNS]
        check_keys(f"classes[{i}]", entry, required, keys)
        try:
            row = {c: _json_cell(c, entry.get(c)) for c in keys}
        except ValueError as exc:
            raise ValueError(f"classes[{i}]: {exc}") from None
        rows.append({**row, "schema_version": str(meta["schema_version"]), "gpu": _json_cell("gpu", meta["gpu"])})
    return ["schema_version", "gpu", *keys], rows


def read_batch_table_json(path, gpu: str | None = None) -> list[dict]:
    """Read and validate a batch table's JSON file: the records ``read_batch_table`` gives for
    its CSV (with ``gpu``, that GPU's only); ``TableError`` naming the file and the problem."""
    doc = read_json(path, "a splitkv-tune batch table JSON")
    try:
        header, rows = _raw_rows(doc)
    except ValueError as exc:
        raise TableError(path, f"not a splitkv-tune batch table JSON: {exc}") from None
    with rows_named(lambda row: (path, f"classes[{row}]")):
        records = validate_batch_records(header, rows, path)
    return keep_batch_gpu(records, gpu, path)


def read_batch_table_file(path, gpu: str | None = None) -> list[dict]:
    """A batch table's records from its CSV or its ``.json`` file."""
    reader = read_batch_table_json if str(path).endswith(".json") else read_batch_table
    return reader(path, gpu=gpu)
