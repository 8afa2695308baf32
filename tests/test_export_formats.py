"""What servers load: JSON files with vLLM device names and a published JSON Schema that the
project reads back, and one C++ header covering several GPUs with a dispatch by device name
and SM count (checked against the Python selector)."""
import json
import shutil
import subprocess
from pathlib import Path

import jsonschema
import pandas as pd
import pytest
from click.testing import CliRunner

from splitkv_tune import export as ex
from splitkv_tune import tunables
from splitkv_tune.cli_tables import export, select
from splitkv_tune.export import (JSON_SCHEMA_VERSION, SCHEMA_PATH, export_csv, export_json, load_json,
                                 read_table_file)
from splitkv_tune.export_cpp import export_cpp_header
from splitkv_tune.selector import HeuristicTable, select_shape
from splitkv_tune.table_schema import TableError, read_heuristics
from splitkv_tune.tunables import DTYPES, SPLIT_POLICIES

ROOT = Path(__file__).resolve().parents[1]
HEURISTICS = ROOT / "tests" / "fixtures" / "heuristics.csv"
SHIPPED_JSON = sorted((ROOT / "results" / "nvidia_h200" / "export" / "json").glob("*.json"))
SHAPE_ARGS = ["--q-heads", "32", "--kv-heads", "8", "--q-len", "1"]


def _validator():
    return jsonschema.Draft202012Validator(json.loads(SCHEMA_PATH.read_text()))


def test_schema_ships_inside_the_package_and_matches_the_kernel_ranges():
    assert SCHEMA_PATH.parent.parent.name == "splitkv_tune"
    schema = json.loads(SCHEMA_PATH.read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    entry = schema["$defs"]["entry"]["properties"]
    meta = schema["properties"]["_metadata"]["properties"]
    assert entry["block_kv"]["enum"] == list(tunables.BLOCK_KV)
    assert entry["reduce_threads"]["enum"] == list(tunables.REDUCE_THREADS)
    assert entry["split_policy"]["enum"] == list(tunables.SPLIT_POLICIES)
    assert entry["num_splits"]["maximum"] == tunables.MAX_SPLITS
    assert meta["dtype"]["enum"] == list(tunables.DTYPES)
    assert meta["head_dim"]["enum"] == list(tunables.HEAD_DIMS)


@pytest.mark.parametrize("gpu,names", [("nvidia_h200", ["NVIDIA_H200"]),
                                       ("nvidia_h100", ["NVIDIA_H100_80GB_HBM3", "NVIDIA_H100"]),
                                       ("my_gpu_9000", ["MY_GPU_9000"])])
def test_json_files_per_vllm_device_name_validate(tmp_path, gpu, names):
    df = read_heuristics(HEURISTICS).assign(gpu=gpu)
    paths = export_json(df, tmp_path)
    combos = {(r.dtype, r.head_dim) for r in df.itertuples()}
    assert sorted(p.name for p in paths) == sorted(
        f"device_name={n},dtype={d},head_dim={h}.json" for n in names for d, h in combos)
    validator = _validator()
    for path in paths:
        doc = json.loads(path.read_text())
        assert not list(validator.iter_errors(doc)), path
        meta = doc["_metadata"]
        assert meta["gpu"] == gpu and meta["device_names"] == names
        assert path.name.startswith(f"device_name={meta['device_name']},")


def test_shipped_json_export_validates():
    assert SHIPPED_JSON
    for path in SHIPPED_JSON:
        assert not list(_validator().iter_errors(json.loads(path.read_text()))), path
        assert read_table_file(path) is not None  # and reads back


def test_exports_with_empty_integer_cells_read_back_and_select_alike(tmp_path, random_shapes):
    """Empty runner-up and per-block_kv cells must not turn the integers around them into
    floats ("16.0"), which the reader rejects."""
    from splitkv_tune.export import export_csv
    df = read_heuristics(HEURISTICS)
    blank = df.index % 3 == 0
    df.loc[blank, ["runner_up_num_splits", "runner_up_block_kv", "runner_up_reduce_threads",
                   "runner_up_split_policy", "runner_up_us"]] = None
    df.loc[blank & (df["block_kv"] != 64), ["best_us_kv64", "best_splits_kv64"]] = None
    table = HeuristicTable(df)
    csv_path = export_csv(table.frame, tmp_path / "again.csv")
    back = [HeuristicTable(read_heuristics(csv_path)),
            HeuristicTable(load_json(export_json(table.frame, tmp_path / "json")))]
    for shape in random_shapes(300, seed=11):
        want = select_shape(table, shape, "h200").config
        assert all(select_shape(t, shape, "h200").config == want for t in back), shape


def without_balance(doc: dict) -> dict:
    return {k: v for k, v in doc["_metadata"]["lookup"].items() if k not in ("sms", "sm_balance_pct")}


def _bad_docs(good: dict):
    """(name, document, the reader's problem) of exports that the schema refuses."""
    key = next(k for k in good if k != "_metadata")
    entry, meta = good[key], good["_metadata"]
    yield "no splits", {**good, key: {**entry, "num_splits": 0}}, "num_splits must be in [1, 128]"
    yield "code in a name", {**good, key: {**entry, "split_policy": 'x";system("x")'}}, "split_policy must be one of"
    yield "bad key", {**good, "causal=2,batch=1": entry}, "keys must be 'causal={causal},batch={batch}"
    yield "key overriding the metadata", {**good, key + ",dtype=fp16": entry}, "keys must be"
    yield "version 3", {**good, "_metadata": {**meta, "schema_version": 3}}, "schema_version is 3"
    yield "no SM balance", {**good, "_metadata": {**meta, "lookup": without_balance(good)}}, \
        "_metadata.lookup has no sms, sm_balance_pct"
    yield "splits as text", {**good, key: {**entry, "num_splits": "16"}}, 'num_splits must be an integer, got "16"'
    yield "time as text", {**good, key: {**entry, "median_us": "9.5"}}, 'median_us must be a number, got "9.5"'
    yield "no p80", {**good, key: {k: v for k, v in entry.items() if k != "p80_us"}}, "missing keys: p80_us"
    yield "unknown entry key", {**good, key: {**entry, "speed": 1}}, "unknown keys: speed"
    yield "unknown metadata key", {**good, "_metadata": {**meta, "note": "x"}}, "_metadata: unknown keys: note"
    yield "zero time", {**good, key: {**entry, "median_us": 0, "p20_us": 0}}, "median_us must be > 0"
    yield "null time", {**good, key: {**entry, "median_us": None}}, "median_us is null"
    yield "a batch table", {"_metadata": meta, "classes": []}, "this is a batch-class table"
    yield "metadata dtype", {**good, "_metadata": {**meta, "dtype": "fp32"}}, \
        "_metadata.dtype must be one of ('fp16', 'bf16'), got \"fp32\""
    yield "metadata head_dim", {**good, "_metadata": {**meta, "head_dim": 100}}, \
        "_metadata.head_dim must be one of (64, 96, 128, 256), got 100"
    yield "device names", {**good, "_metadata": {**meta, "device_names": "x"}}, "_metadata.device_names must be a list"
    yield "device name", {**good, "_metadata": {**meta, "device_name": "NVIDIA H200"}}, "_metadata.device_name must"
    yield "tool", {**good, "_metadata": {**meta, "tool": "other"}}, "_metadata.tool must be 'splitkv-tune'"
    lookup = meta["lookup"]
    yield "lookup key missing", {**good, "_metadata": {**meta, "lookup": {k: v for k, v in lookup.items()
                                                                       if k != "neighbours"}}}, \
        "_metadata.lookup has no neighbours"
    yield "lookup key unknown", {**good, "_metadata": {**meta, "lookup": {**lookup, "extra": 1}}}, \
        "_metadata.lookup: unknown keys: extra"


def test_the_reader_takes_the_schemas_keys():
    schema = json.loads(SCHEMA_PATH.read_text())
    entry = schema["$defs"]["entry"]
    assert entry["required"] == ex._REQUIRED_ENTRY_COLUMNS and list(entry["properties"]) == ex._ENTRY_COLUMNS
    meta = schema["properties"]["_metadata"]
    assert ex._schema_keys() == (meta["required"], meta["properties"]["lookup"]["required"])
    assert meta["then"]["properties"]["lookup"]["required"] == list(ex.LOOKUP_KEYS_OF_VERSION[2])


def test_schema_rejects_what_the_reader_rejects(tmp_path):
    """Each bad export gives a TableError naming the file and the problem, and the schema refuses it too."""
    path, = [p for p in export_json(read_heuristics(HEURISTICS), tmp_path)
             if "bf16,head_dim=128" in p.name]
    for name, doc, problem in _bad_docs(json.loads(path.read_text())):
        assert list(_validator().iter_errors(doc)), name
        bad = tmp_path / "bad.json"
        bad.write_text(json.dumps(doc))
        with pytest.raises(TableError) as err:
            load_json([bad])
        assert str(err.value).startswith(f"{bad}: ") and problem in str(err.value), (name, str(err.value))


def test_what_json_itself_allows_and_the_writer_never_emits_is_refused(tmp_path):
    """NaN and nesting too deep for the parser: a named error, not a traceback."""
    path, = [p for p in export_json(read_heuristics(HEURISTICS), tmp_path)
             if "bf16,head_dim=128" in p.name]
    nan = tmp_path / "nan.json"
    nan.write_text(path.read_text().replace('"p20_us": ', '"p20_us": NaN, "x": ', 1))
    with pytest.raises(TableError, match="NaN is not a number JSON has"):
        load_json([nan])
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000)
    with pytest.raises(TableError, match="nested too deeply"):
        load_json([deep])


def test_duplicate_keys_are_refused(tmp_path):
    path, = [p for p in export_json(read_heuristics(HEURISTICS), tmp_path)
             if "bf16,head_dim=128" in p.name]
    text = path.read_text()
    key = next(k for k in json.loads(text) if k != "_metadata")
    entry = json.dumps(json.loads(text)[key])
    bad = tmp_path / "dup.json"
    bad.write_text(text.rstrip().rstrip("}") + f', "{key}": {entry}}}')
    with pytest.raises(TableError, match=f"duplicate keys: {key}"):
        load_json([bad])


def test_version_1_json_still_reads_and_an_unknown_version_is_named(tmp_path):
    """Version 2 added the SM balance's constants to ``lookup``; a file of version 1, with or
    without them, reads back into the same table, and another version's error names both."""
    path, = [p for p in export_json(read_heuristics(HEURISTICS), tmp_path)
             if "bf16,head_dim=128" in p.name]
    doc = json.loads(path.read_text())
    assert doc["_metadata"]["schema_version"] == JSON_SCHEMA_VERSION == 2
    assert {"sms", "sm_balance_pct"} <= set(doc["_metadata"]["lookup"])
    expected = load_json([path])
    for i, lookup in enumerate([without_balance(doc), doc["_metadata"]["lookup"]]):
        old = tmp_path / f"v1_{i}.json"
        old.write_text(json.dumps({**doc, "_metadata": {**doc["_metadata"], "schema_version": 1,
                                                        "lookup": lookup}}))
        assert not list(_validator().iter_errors(json.loads(old.read_text())))
        pd.testing.assert_frame_equal(load_json([old]), expected)
    newer = tmp_path / "v9.json"
    newer.write_text(json.dumps({**doc, "_metadata": {**doc["_metadata"], "schema_version": 9}}))
    with pytest.raises(TableError, match="schema_version is 9, this tool reads exported JSON of "
                                         "version 1 or 2"):
        load_json([newer])


def test_select_reads_the_json_export(tmp_path):
    paths = export_json(read_heuristics(HEURISTICS), tmp_path)
    json_path, = [p for p in paths if "bf16,head_dim=128" in p.name]
    for kv_len in ("4096", "5000", "100000"):
        args = SHAPE_ARGS + ["--kv-len", kv_len]
        from_csv = CliRunner().invoke(select, ["--table", str(HEURISTICS)] + args)
        from_json = CliRunner().invoke(select, ["--table", str(json_path)] + args)
        assert from_json.exit_code == 0, from_json.output
        assert from_json.output.splitlines()[0] == from_csv.output.splitlines()[0]
    assert len(read_table_file(json_path, gpu="h200")) == sum(
        1 for r in read_heuristics(HEURISTICS).itertuples() if (r.dtype, r.head_dim) == ("bf16", 128))
    result = CliRunner().invoke(select, ["--table", str(tmp_path / "none.json")] + SHAPE_ARGS
                                + ["--kv-len", "64"])
    assert result.exit_code == 2 and "no such file" in result.output


DISPATCH_DRIVER = r"""
#include "tables.h"
#include <cstdio>
int main() {
  char name[64]; long long sms; int dtype, d, causal; long long b, hq, hkv, sq, sk;
  while (std::scanf("%63s %lld %d %d %lld %lld %lld %lld %lld %d", name, &sms, &dtype, &d, &b,
                    &hq, &hkv, &sq, &sk, &causal) == 10) {
    splitkv_tune::Config c{0, 0, 0, 0}; int kind = -1;
    if (splitkv_tune::select_config_for_device(name, sms, dtype, d, b, hq, hkv, sq, sk,
                                               causal != 0, &c, &kind))
      std::printf("%d %d %d %d %d\n", c.num_splits, c.block_kv, c.reduce_threads,
                  c.split_policy, kind);
    else std::printf("none\n");
  }
}
"""
KINDS = {"hit": 0, "interpolated": 1, "fallback": 2}


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
def test_one_header_for_several_gpus_dispatches_by_name_and_sms(tmp_path, random_shapes):
    base = read_heuristics(HEURISTICS)
    frames = {"nvidia_h200": base, "nvidia_l40s": base.assign(gpu="nvidia_l40s",
                                                             num_splits=base["num_splits"] // 2 + 1)}
    tables = {g: HeuristicTable(df) for g, df in frames.items()}
    header = export_cpp_header(list(tables.values()), tmp_path / "tables.h")
    assert "#ifndef SPLITKV_TUNE_TABLES_NVIDIA_H200_NVIDIA_L40S_H_" in header.read_text()
    (tmp_path / "driver.cpp").write_text(DISPATCH_DRIVER)
    exe = tmp_path / "driver"
    subprocess.run(["g++", "-std=c++17", "-O1", "-Wall", "-Wextra", "-Werror", "-pedantic",
                    str(tmp_path / "driver.cpp"), "-o", str(exe)], check=True, capture_output=True)
    devices = [("NVIDIA_H200", "nvidia_h200"), ("NVIDIA_L40S", "nvidia_l40s"),
               ("h200", "nvidia_h200"), ("NVIDIA_A100-SXM4-80GB", None)]
    cases, want, raised = [], [], 0
    for i, shape in enumerate(random_shapes(600, seed=9)):
        name, gpu = devices[i % len(devices)]
        sms = (132, 60, 142)[i % 3]
        cases.append(f"{name} {sms} {DTYPES.index(shape.dtype)} {shape.head_dim} {shape.batch} "
                     f"{shape.q_heads} {shape.kv_heads} {shape.q_len} {shape.kv_len} "
                     f"{int(shape.causal)}\n")
        if gpu is None:
            want.append("none")
            continue
        try:
            sel = select_shape(tables[gpu], shape, gpu, sms=sms)
        except ValueError:
            want.append("none")
            continue
        c = sel.config
        raised += "raised to" in sel.reason
        want.append(f"{c.num_splits} {c.block_kv} {c.reduce_threads} "
                    f"{SPLIT_POLICIES.index(c.split_policy)} {KINDS[sel.kind]}")
    out = subprocess.run([str(exe)], input="".join(cases), capture_output=True, text=True,
                         check=True).stdout.splitlines()
    mismatches = [(c, g, w) for c, g, w in zip(cases, out, want) if g != w]
    assert len(out) == len(cases) and not mismatches, mismatches[:5]
    assert {w.split()[-1] for w in want if w != "none"} == {"0", "1", "2"}
    assert raised > 0  # the H200 profile's SM balance (balance_splits) is among the choices compared


def test_cli_exports_csv_and_the_header_to_stdout(tmp_path):
    """-o - writes the CSV or the header to stdout, as the file would hold it; JSON needs a directory."""
    for fmt, writer in (("csv", lambda out: export_csv(read_heuristics(HEURISTICS), out)),
                        ("cpp-header", lambda out: export_cpp_header([HeuristicTable(read_heuristics(HEURISTICS))],
                                                                     out))):
        result = CliRunner().invoke(export, ["--format", fmt, "--table", str(HEURISTICS), "-o", "-"])
        assert result.exit_code == 0, result.output
        assert result.output == writer(tmp_path / fmt).read_text()
    result = CliRunner().invoke(export, ["--format", "json", "--table", str(HEURISTICS), "-o", "-"])
    assert result.exit_code == 2 and "give a directory" in result.output and not Path("-").exists()
    # An exported JSON file is a --table too: its CSV is the CSV of its dtype and head dim.
    path, = [p for p in export_json(read_heuristics(HEURISTICS), tmp_path / "json") if "bf16,head_dim=128" in p.name]
    result = CliRunner().invoke(export, ["--format", "csv", "--table", str(path), "-o", "-"])
    assert result.exit_code == 0, result.output
    assert result.output == ex.csv_text(read_heuristics(HEURISTICS).query("dtype == 'bf16' and head_dim == 128"))


def test_cli_exports_one_header_for_several_gpus(tmp_path):
    other = tmp_path / "l40s.csv"
    read_heuristics(HEURISTICS).assign(gpu="nvidia_l40s").to_csv(other, index=False)
    out = tmp_path / "t.h"
    result = CliRunner().invoke(export, ["--format", "cpp-header", "--table", str(HEURISTICS),
                                         "--table", str(other), "-o", str(out)])
    assert result.exit_code == 0, result.output
    text = out.read_text()
    assert "namespace gpu_nvidia_h200 {" in text and "namespace gpu_nvidia_l40s {" in text
    result = CliRunner().invoke(export, ["--format", "json", "--table", str(HEURISTICS),
                                         "--table", str(other), "-o", str(tmp_path / "j")])
    assert result.exit_code == 2 and "exports one GPU's table" in result.output
