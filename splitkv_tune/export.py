"""Export a heuristics table for inference servers: CSV, per-device JSON, or a C++ header.

Every export goes through ``table_schema.validate_heuristics`` first, and the writers check
again that each name they emit matches ``[A-Za-z0-9_.-]+``, so no table can put code into a
server's build. Rows are written in canonical order (sorted by shape), the order the C++
lookup and ``selector.HeuristicTable`` number them.

JSON: one file per (device, dtype, head_dim), named like vLLM's tuned configs,
``device_name=NVIDIA_H200,dtype=bf16,head_dim=128.json`` (device name = the table's GPU name
upper-cased). Keys ``"causal=0,batch=1,q_heads=32,kv_heads=8,q_len=1,kv_len=4096"`` map to the
winner config and its measurements; ``_metadata`` holds the schema version, GPU, run ids,
tool name and version. :func:`load_json` reads them back into the same table.

C++ header: see :func:`render_cpp_header`.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd

from splitkv_tune import __version__, tunables
from splitkv_tune.gpus import normalize_gpu_name
from splitkv_tune.selector import (MODEL, SK_DROP_BITS, CostModel, HeuristicTable, _profiles,
                                   log2_q16, sk_coord)
from splitkv_tune.table_schema import (HEURISTICS_COLUMNS, NAME_RE, SCHEMA_VERSION, SHAPE_COLUMNS,
                                       TableError, validate_heuristics)

KEY_COLUMNS = [c for c in SHAPE_COLUMNS if c not in ("dtype", "head_dim")]
_ENTRY_COLUMNS = [c for c in HEURISTICS_COLUMNS
                  if c not in ["schema_version", "gpu"] + SHAPE_COLUMNS]


def _safe(name: str) -> str:
    if not isinstance(name, str) or not NAME_RE.fullmatch(name):
        raise TableError("<export>", f"refusing to emit name {name!r}")
    return name


def _table(df: pd.DataFrame, gpu: str | None, source) -> HeuristicTable:
    return HeuristicTable(validate_heuristics(df, source), gpu=gpu, source=source)


def export_csv(df: pd.DataFrame, path, gpu: str | None = None, source="<table>") -> Path:
    """Write the validated table (schema columns, canonical order, ``schema_version`` column)."""
    table = _table(df, gpu, source)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    table.frame[HEURISTICS_COLUMNS].to_csv(path, index=False)
    return path


def device_name(gpu: str) -> str:
    """vLLM-style device name of a table GPU.

    >>> device_name("nvidia_h200")
    'NVIDIA_H200'
    """
    return _safe(gpu).upper()


def json_name(gpu: str, dtype: str, head_dim: int) -> str:
    """File name of one JSON export.

    >>> json_name("nvidia_h200", "bf16", 128)
    'device_name=NVIDIA_H200,dtype=bf16,head_dim=128.json'
    """
    return f"device_name={device_name(gpu)},dtype={_safe(dtype)},head_dim={int(head_dim)}.json"


def _plain(value):
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    if isinstance(value, str):
        return _safe(value)
    if hasattr(value, "item"):
        value = value.item()
    return value


def export_json(df: pd.DataFrame, out_dir, gpu: str | None = None, source="<table>") -> list[Path]:
    """One JSON file per (dtype, head_dim) of the table's GPU in ``out_dir``; returns the paths."""
    table = _table(df, gpu, source)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for (dtype, head_dim), part in table.frame.groupby(["dtype", "head_dim"], sort=True):
        doc = {"_metadata": {
            "schema_version": SCHEMA_VERSION, "gpu": _safe(table.gpu),
            "device_name": device_name(table.gpu), "dtype": _safe(dtype),
            "head_dim": int(head_dim), "run_ids": [_safe(r) for r in sorted(set(part["run_id"]))],
            "tool": "splitkv-tune", "tool_version": _safe(__version__),
            "key_format": ",".join(f"{c}={{{c}}}" for c in KEY_COLUMNS)}}
        for rec in part.to_dict("records"):
            key = ",".join(f"{c}={int(rec[c])}" for c in KEY_COLUMNS)
            doc[key] = {c: _plain(rec[c]) for c in _ENTRY_COLUMNS}
        path = out_dir / json_name(table.gpu, dtype, head_dim)
        path.write_text(json.dumps(doc, indent=1, allow_nan=False) + "\n")
        paths.append(path)
    return paths


def load_json(paths) -> pd.DataFrame:
    """Read exported JSON files back into a validated heuristics table."""
    rows = []
    for path in paths:
        try:
            doc = json.loads(Path(path).read_text())
            meta = doc.pop("_metadata")
            for key, entry in doc.items():
                shape = dict(part.split("=", 1) for part in key.split(","))
                rows.append({"schema_version": meta["schema_version"], "gpu": meta["gpu"],
                             "dtype": meta["dtype"], "head_dim": meta["head_dim"], **shape,
                             **entry})
        except (ValueError, KeyError, AttributeError, TypeError) as exc:
            raise TableError(path, f"not an exported splitkv-tune JSON table ({exc})") from None
    df = pd.DataFrame(rows, columns=HEURISTICS_COLUMNS).astype(object)
    df = df.where(df.notna(), "")
    return validate_heuristics(df.astype(str), ", ".join(map(str, paths)))


_CPP = r"""// Generated by splitkv-tune @VERSION@ (splitkv_tune/export.py) -- DO NOT EDIT.
// GPU: @GPU@; heuristics schema version @SCHEMA@; sweep runs: @RUNS@
//
// select_config() implements the rule of splitkv_tune.selector.select_config with the same
// integer arithmetic (so both choose identically): exact table hit; else interpolation among
// rows of the same dtype/head_dim/causal/query-tile height (K=@K@ nearest in fixed-point log2
// space over B*Hkv, Sk, Sq*G, Sk's log2 rounded down to 1/64 octave; split count from the
// inverse-distance weighted log2 of the split kernel's CTA count); else the analytic
// wave-quantisation + combine cost model over this GPU's profile, at the first Sk of the
// shape's 1/64-octave bucket. Returns false for shapes the kernel does not take.
#ifndef @GUARD@
#define @GUARD@

#include <cstdint>

namespace splitkv_tune {
namespace @NS@ {

enum : int { kFp16 = 0, kBf16 = 1 };           // dtype codes
enum : int { kLength = 0, kBlocks = 1 };        // split_policy codes
enum : int { kHit = 0, kInterpolated = 1, kFallback = 2 };

struct Config { int num_splits; int block_kv; int reduce_threads; int split_policy; };

struct Row {
  int dtype, head_dim, causal;
  std::int64_t batch, q_heads, kv_heads, q_len, kv_len;
  Config config;
  int block_m;                        // derived: query-tile height of the shape
  std::int64_t x_bh, x_sk, x_rows;    // derived: log2_q16 of B*Hkv, Sk (1/64 octave), Sq*G
  std::int64_t log_ctas;              // derived: log2_q16(S * B*Hkv * m_blocks)
};

constexpr char kGpu[] = "@GPU@";
constexpr int kSchemaVersion = @SCHEMA@;
constexpr int kNumRows = @NROWS@;
constexpr Row kRows[kNumRows] = {
@ROWS@
};

constexpr bool kProfileKnown = @KNOWN@;  // known: block_kv is lowered to fit kSmemPerBlock
constexpr std::int64_t kSmemPerBlock = @SMEM@;
// Profile of the analytic fallback (@FBNAME@).
constexpr std::int64_t kSms = @SMS@, kCopyBwMBps = @BW@, kL2Bytes = @L2@, kFbSmemPerSm = @FBSMEM@,
                     kFbSmemPerBlock = @FBSMEMBLOCK@;
constexpr std::int64_t kLaunchNs = @launch_ns@, kTileNs = @tile_ns@, kMemLatencyNs = @mem_latency_ns@,
    kCtasPerSm = @ctas_per_sm@, kMmaFlopPerNsPerSm = @mma_flop_per_ns_per_sm@,
    kL2SpeedupPct = @l2_speedup_pct@, kCombineSplitNs = @combine_split_ns@,
    kBlockNs = @block_ns@, kCtaStreamMBps = @cta_stream_mbps@, kTiePct = @tie_pct@;
constexpr int kBlockKv[] = {@BLOCK_KV@};
constexpr int kNumBlockKv = @NBKV@;
constexpr std::int64_t kMaxSplits = @MAXS@, kKvStages = @STAGES@, kMaxDim = @MAXDIM@;
constexpr int kSkDropBits = @SKDROP@;  // Sk's log2 is rounded down to 2^(kSkDropBits-16) octave
// log2_q16(S) for S = 0..kMaxSplits (entry 0 unused): the interpolation's split search.
constexpr std::int64_t kLogSplits[kMaxSplits + 1] = {@LOGSPLITS@};

namespace detail {

inline std::int64_t ceil_div(std::int64_t a, std::int64_t b) { return (a + b - 1) / b; }
inline std::int64_t min64(std::int64_t a, std::int64_t b) { return a < b ? a : b; }
inline std::int64_t max64(std::int64_t a, std::int64_t b) { return a > b ? a : b; }
inline std::int64_t abs64(std::int64_t a) { return a < 0 ? -a : a; }

inline std::int64_t log2_q16(std::uint64_t x) {
  int n = 63;
  while (!((x >> n) & 1u)) --n;
  std::uint64_t y = n <= 30 ? x << (30 - n) : x >> (n - 30);
  std::int64_t r = static_cast<std::int64_t>(n) << 16;
  for (int i = 15; i >= 0; --i) {
    y = (y * y) >> 30;
    if (y >= (std::uint64_t{1} << 31)) { y >>= 1; r |= std::int64_t{1} << i; }
  }
  return r;
}

inline std::int64_t sk_coord(std::int64_t sk) {
  return log2_q16(static_cast<std::uint64_t>(sk)) >> kSkDropBits << kSkDropBits;
}

// The smallest Sk with sk's coordinate: where the fallback evaluates its model.
inline std::int64_t sk_bucket_start(std::int64_t sk) {
  const std::int64_t want = sk_coord(sk);
  std::int64_t lo = std::int64_t{1} << (want >> 16), hi = sk;
  while (lo < hi) {
    std::int64_t mid = (lo + hi) / 2;
    if (log2_q16(static_cast<std::uint64_t>(mid)) < want) lo = mid + 1; else hi = mid;
  }
  return lo;
}

inline int block_m_for(std::int64_t rows) { @BLOCK_M_FOR@ }
inline std::int64_t warps_n(int bm) { @WARPS_N@ }

inline std::int64_t smem_bytes(std::int64_t d, std::int64_t bkv, int bm) {
  std::int64_t elems = bm * d + kKvStages * 2 * bkv * d;
  std::int64_t wn = warps_n(bm);
  if (wn == 1 || bkv % (16 * wn) == 0) return elems * 2;  // no P tile, no row exchange
  return (elems + bm * bkv) * 2 + 2 * wn * bm * 4;
}

inline std::int64_t align_up(std::int64_t n) { return ceil_div(n, @ALIGN@) * @ALIGN@; }

struct Shape { std::int64_t d, b, hq, hkv, sq, sk; };

inline std::int64_t cost_ns(const Shape& s, std::int64_t splits, std::int64_t bkv) {
  std::int64_t rows_all = s.sq * (s.hq / s.hkv);
  int bm = block_m_for(rows_all);
  std::int64_t ctas = s.b * s.hkv * ceil_div(rows_all, bm) * splits;
  std::int64_t keys = min64(ceil_div(ceil_div(s.sk, bkv), splits) * bkv, s.sk);
  std::int64_t rows = min64(bm, rows_all);
  std::int64_t out = splits > 1 ? rows * (s.d + 2) * 4 : rows * s.d * 2;
  std::int64_t cta_bytes = keys * s.d * 4 + rows * s.d * 2 + out;
  std::int64_t cta_flops = 4 * bm * keys * s.d;
  std::int64_t slots = kSms * max64(1, min64(kCtasPerSm, kFbSmemPerSm / smem_bytes(s.d, bkv, bm)));
  std::int64_t tile_bytes = bkv * s.d * 4;
  std::int64_t cta_bw = tile_bytes * 1000 / (kBlockNs + tile_bytes * 1000 / kCtaStreamMBps);
  auto wave = [&](std::int64_t active) {
    std::int64_t rate = min64(cta_bw / ceil_div(active, kSms), kCopyBwMBps / active);
    std::int64_t mem = cta_bytes * 1000 / max64(1, rate);
    std::int64_t comp = cta_flops * ceil_div(active, kSms) / kMmaFlopPerNsPerSm;
    return kTileNs + max64(mem, comp);
  };
  std::int64_t full = ctas / slots, tail = ctas % slots;
  std::int64_t t = kLaunchNs + full * wave(slots) + (tail ? wave(tail) : 0);
  if (splits > 1) {
    std::int64_t r = splits * s.b * s.hq * s.sq;
    std::int64_t ws = align_up(r * s.d * 4) + 2 * align_up(r * 4);
    std::int64_t comb_bw = 2 * ws <= kL2Bytes ? kCopyBwMBps * kL2SpeedupPct / 100 : kCopyBwMBps;
    std::int64_t moved = ws + s.b * s.hq * s.sq * s.d * 2;
    t += kLaunchNs + kMemLatencyNs + moved * 1000 / comb_bw + splits * kCombineSplitNs;
  }
  return t;
}

inline Config finalize(Config c, const Shape& s, bool check_smem, std::int64_t smem_limit) {
  int bm = block_m_for(s.sq * (s.hq / s.hkv));
  if (check_smem) {
    int i = 0;
    while (kBlockKv[i] != c.block_kv) ++i;
    while (i > 0 && smem_bytes(s.d, kBlockKv[i], bm) > smem_limit) --i;
    c.block_kv = kBlockKv[i];
  }
  std::int64_t cap = min64(kMaxSplits, ceil_div(s.sk, c.block_kv));
  c.num_splits = static_cast<int>(max64(1, min64(c.num_splits, cap)));
  return c;
}

inline Config analytic(const Shape& s) {
  int bm = block_m_for(s.sq * (s.hq / s.hkv));
  std::int64_t cost[kNumBlockKv][kMaxSplits + 1] = {};  // 0: block too large, or S past its blocks
  std::int64_t least = -1;
  for (int i = 0; i < kNumBlockKv; ++i) {
    if (i != 0 && smem_bytes(s.d, kBlockKv[i], bm) > kFbSmemPerBlock) continue;
    std::int64_t top = min64(kMaxSplits, ceil_div(s.sk, kBlockKv[i]));
    for (std::int64_t sp = 1; sp <= top; ++sp) {
      cost[i][sp] = cost_ns(s, sp, kBlockKv[i]);
      if (least < 0 || cost[i][sp] < least) least = cost[i][sp];
    }
  }
  // The fewest splits, then the largest block, within kTiePct of the least.
  for (std::int64_t sp = 1; sp <= kMaxSplits; ++sp) {
    for (int i = kNumBlockKv - 1; i >= 0; --i) {
      if (cost[i][sp] > 0 && cost[i][sp] * 100 <= least * (100 + kTiePct)) {
        return Config{static_cast<int>(sp), kBlockKv[i], 128, kBlocks};
      }
    }
  }
  return Config{1, kBlockKv[0], 128, kBlocks};
}

inline int compare_key(const Row& r, int dtype, int d, int causal, const Shape& s) {
  const std::int64_t a[8] = {r.dtype, r.head_dim, r.causal, r.batch, r.q_heads, r.kv_heads, r.q_len, r.kv_len};
  const std::int64_t b[8] = {dtype, d, causal, s.b, s.hq, s.hkv, s.sq, s.sk};
  for (int i = 0; i < 8; ++i) if (a[i] != b[i]) return a[i] < b[i] ? -1 : 1;
  return 0;
}

}  // namespace detail

// Chooses the launch config of one shape; false when the shape is invalid or too large
// (each dim <= kMaxDim, B*Hq*Sq <= 2^32, B*Hkv*Sk <= 2^40). kind: kHit/kInterpolated/kFallback.
inline bool select_config(int dtype, int head_dim, std::int64_t batch, std::int64_t q_heads,
                          std::int64_t kv_heads, std::int64_t q_len, std::int64_t kv_len,
                          bool causal, Config* out, int* kind = nullptr) {
  using namespace detail;
  if (dtype != kFp16 && dtype != kBf16) return false;
  if (@HEADDIM_CHECK@) return false;
  const std::int64_t dims[5] = {batch, q_heads, kv_heads, q_len, kv_len};
  for (std::int64_t v : dims) if (v < 1 || v > kMaxDim) return false;
  if (q_heads % kv_heads) return false;
  const std::int64_t lim32 = std::int64_t{1} << 32, lim40 = std::int64_t{1} << 40;
  if (batch * q_heads > lim32 || q_len > lim32 / (batch * q_heads)) return false;
  if (batch * kv_heads > lim40 || kv_len > lim40 / (batch * kv_heads)) return false;
  const Shape s{head_dim, batch, q_heads, kv_heads, q_len, kv_len};
  const int c = causal ? 1 : 0;
  int lo = 0, hi = kNumRows;
  while (lo < hi) {
    int mid = (lo + hi) / 2;
    if (compare_key(kRows[mid], dtype, head_dim, c, s) < 0) lo = mid + 1; else hi = mid;
  }
  if (lo < kNumRows && compare_key(kRows[lo], dtype, head_dim, c, s) == 0) {
    *out = finalize(kRows[lo].config, s, kProfileKnown, kSmemPerBlock);
    if (kind) *kind = kHit;
    return true;
  }
  const std::int64_t rows_all = q_len * (q_heads / kv_heads);
  const int bm = block_m_for(rows_all);
  const std::int64_t bh = batch * kv_heads, w = bh * ceil_div(rows_all, bm);
  const std::int64_t x0 = log2_q16(bh), x1 = sk_coord(kv_len), x2 = log2_q16(rows_all);
  std::int64_t nd[@K@];
  int ni[@K@];
  int n = 0;
  for (int i = 0; i < kNumRows; ++i) {
    const Row& r = kRows[i];
    if (r.dtype != dtype || r.head_dim != head_dim || r.causal != c || r.block_m != bm) continue;
    std::int64_t d = abs64(x0 - r.x_bh) + abs64(x1 - r.x_sk) + abs64(x2 - r.x_rows);
    int j = n < @K@ ? n++ : @K@;
    while (j > 0 && nd[j - 1] > d) {
      if (j < @K@) { nd[j] = nd[j - 1]; ni[j] = ni[j - 1]; }
      --j;
    }
    if (j < @K@) { nd[j] = d; ni[j] = i; }
  }
  if (n == 0) {
    const Shape start{head_dim, batch, q_heads, kv_heads, q_len, sk_bucket_start(kv_len)};
    *out = finalize(analytic(start), s, true, kFbSmemPerBlock);
    if (kind) *kind = kFallback;
    return true;
  }
  Config base = finalize(kRows[ni[0]].config, s, kProfileKnown, kSmemPerBlock);
  if (kind) *kind = kInterpolated;
  if (nd[0] == 0) { *out = base; return true; }
  std::int64_t num = 0, den = 0;
  for (int j = 0; j < n; ++j) {
    std::int64_t wt = (std::int64_t{1} << 32) / nd[j];
    num += wt * kRows[ni[j]].log_ctas;
    den += wt;
  }
  const std::int64_t target = num / den - log2_q16(static_cast<std::uint64_t>(w));
  const std::int64_t cap = max64(1, min64(kMaxSplits, ceil_div(kv_len, base.block_kv)));
  // kLogSplits rises with S: the first S in [1, cap] from which the distance stops falling.
  std::int64_t best = 1;
  while (best < cap && abs64(kLogSplits[best + 1] - target) < abs64(kLogSplits[best] - target)) ++best;
  base.num_splits = static_cast<int>(best);
  *out = base;
  return true;
}

}  // namespace @NS@
}  // namespace splitkv_tune

#endif  // @GUARD@
"""


def _block_m_cpp(limit: int = 2**40) -> str:
    """C++ body of ``tunables.block_m_for`` (a step function of the packed rows), derived by
    searching its breakpoints so the header follows any change to the Python rule."""
    parts, lo = [], 1
    while True:
        bm = tunables.block_m_for(lo)
        if tunables.block_m_for(limit) == bm:
            parts.append(f"return {bm};")
            return " ".join(parts)
        a, b = lo, limit  # block_m_for(a) == bm != block_m_for(b)
        while b - a > 1:
            mid = (a + b) // 2
            a, b = (mid, b) if tunables.block_m_for(mid) == bm else (a, mid)
        parts.append(f"if (rows <= {a}) return {bm};")
        lo = b


def render_cpp_header(table: HeuristicTable, model: CostModel = MODEL) -> str:
    """Text of a self-contained C++17 header (only ``<cstdint>``) for one GPU's table.

    Contents: generated-file banner, include guard ``SPLITKV_TUNE_TABLE_<GPU>_H_``,
    namespace ``splitkv_tune::gpu_<gpu>``, ``constexpr Row kRows[]`` in canonical order
    with the derived interpolation values, the GPU profile and cost-model constants, and
    ``select_config()`` - the selector's rule, hits, interpolation and analytic fallback.
    """
    if not len(table):
        raise TableError(table.source, "empty table (no rows)")
    gpu = _safe(table.gpu)
    ns = "gpu_" + normalize_gpu_name(gpu)
    profile, fb = _profiles(None, table)
    rows = []
    codes = {d: i for i, d in enumerate(tunables.DTYPES)}
    pol = {p: i for i, p in enumerate(tunables.SPLIT_POLICIES)}
    for idx, (key, cfg) in enumerate(table.rows):
        d, hd, causal, b, hq, hkv, sq, sk = key
        rows_all = sq * (hq // hkv)
        bm = tunables.block_m_for(rows_all)
        w = b * hkv * tunables.ceil_div(rows_all, bm)
        vals = [d, hd, causal, b, hq, hkv, sq, sk]
        assert vals[0] in codes.values() and _safe(cfg.split_policy)
        conf = f"{{{cfg.num_splits}, {cfg.block_kv}, {cfg.reduce_threads}, {pol[cfg.split_policy]}}}"
        derived = [bm, log2_q16(b * hkv), sk_coord(sk), log2_q16(rows_all),
                   log2_q16(cfg.num_splits * w)]
        rows.append("  {" + ", ".join(str(int(v)) for v in vals) + f", {conf}, "
                    + ", ".join(str(int(v)) for v in derived) + f"}},  // #{idx + 1}")
    warps = " ".join(f"if (bm == {bm}) return {wn};" for bm, (_, wn) in tunables.BLOCK_M.items())
    subs = {
        "VERSION": _safe(__version__), "GPU": gpu, "SCHEMA": str(SCHEMA_VERSION),
        "RUNS": " ".join(_safe(r) for r in table.run_ids), "K": "4",
        "GUARD": f"SPLITKV_TUNE_TABLE_{normalize_gpu_name(gpu).upper()}_H_", "NS": ns,
        "NROWS": str(len(rows)), "ROWS": "\n".join(rows),
        "KNOWN": "true" if profile is not None else "false",
        "SMEM": str(int((profile or fb).smem_per_block)), "FBNAME": _safe(fb.name),
        "SMS": str(int(fb.sms)), "BW": str(int(round(fb.copy_bw_gbps * 1000))),
        "L2": str(int(fb.l2_bytes)), "FBSMEM": str(int(fb.smem_per_sm)),
        "FBSMEMBLOCK": str(int(fb.smem_per_block)),
        "BLOCK_KV": ", ".join(map(str, tunables.BLOCK_KV)), "NBKV": str(len(tunables.BLOCK_KV)),
        "MAXS": str(tunables.MAX_SPLITS), "STAGES": str(tunables.KV_STAGES),
        "SKDROP": str(SK_DROP_BITS),
        "LOGSPLITS": "0, " + ", ".join(str(log2_q16(s)) for s in range(1, tunables.MAX_SPLITS + 1)),
        "MAXDIM": "2147483647", "ALIGN": str(tunables.WORKSPACE_ALIGN),
        "WARPS_N": warps + " return 1;", "BLOCK_M_FOR": _block_m_cpp(),
        "HEADDIM_CHECK": " && ".join(f"head_dim != {h}" for h in tunables.HEAD_DIMS),
    }
    subs.update({k: str(int(v)) for k, v in vars(model).items()})
    text = _CPP
    for key, value in subs.items():
        text = text.replace(f"@{key}@", value)
    return text


def export_cpp_header(df: pd.DataFrame, path, gpu: str | None = None, source="<table>",
                      model: CostModel = MODEL) -> Path:
    """Write the C++ header of the table's (one) GPU to ``path``."""
    path = Path(path)
    text = render_cpp_header(_table(df, gpu, source), model)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path

