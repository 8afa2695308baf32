// pybind11 module splitkv_tune._rules: the shared rules of rules.h for the host side, compiled
// with the host compiler alone (no CUDA), so every install has it and CPU-only CI tests the very
// functions the kernels run.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "splitkv/live_model.h"
#include "splitkv/live_plan.h"
#include "splitkv/rules.h"

namespace py = pybind11;
using namespace splitkv;

namespace {

SplitPolicy policy_of(int code) {
  if (code != int(SplitPolicy::kLength) && code != int(SplitPolicy::kBlocks)) {
    throw py::value_error("split policy code must be 0 (length) or 1 (blocks), got " + std::to_string(code));
  }
  return static_cast<SplitPolicy>(code);
}

// The "auto" knob rules' arguments, taken as int64 so that any count is checked, not refused
// by pybind11 as another type.
void check_live_knob_args(const char* name, int64_t batch, int64_t kv_heads, int64_t packed_rows,
                          int64_t num_sms) {
  if (!rules::live_knob_args_ok(batch, kv_heads, packed_rows, num_sms)) {
    throw py::value_error(std::string(name) + " needs batch, kv_heads >= 1 with batch * kv_heads <= " +
                          std::to_string(rules::kMaxGridY) + ", packed_rows in [1, " +
                          std::to_string(rules::kMaxKeys) + "] and num_sms in [1, " +
                          std::to_string(rules::kMaxLiveSms) + "], got " + std::to_string(batch) + ", " +
                          std::to_string(kv_heads) + ", " + std::to_string(packed_rows) + ", " +
                          std::to_string(num_sms));
  }
}

template <int N>
py::tuple as_tuple(const int (&values)[N]) {
  py::tuple t(N);
  for (int i = 0; i < N; ++i) t[i] = values[i];
  return t;
}

// Live lengths in [0, kMaxKeys]; ValueError naming the function otherwise.
void check_lengths(const char* name, const std::vector<int>& lengths) {
  for (int n : lengths) {
    if (n < 0 || n > rules::kMaxKeys) throw py::value_error(std::string(name) + ": a length outside [0, MAX_KEYS]");
  }
}

// A knob of min_blocks_per_split blocks of block_kv keys within [1, max_min_blocks_per_split].
bool min_blocks_ok(int min_blocks_per_split, int block_kv) {
  return block_kv >= 1 && min_blocks_per_split >= 1 &&
         min_blocks_per_split <= rules::max_min_blocks_per_split(block_kv);
}

// The arguments of the load-aware plan's host functions: lengths in [0, kMaxKeys], the rest
// positive (min_blocks_per_split within min_blocks_ok), ctas within the live grid's bound;
// ValueError naming the function otherwise.
void check_live_plan_args(const char* name, const std::vector<int>& lengths, int64_t tiles, int64_t ctas,
                          int block_kv, int min_blocks_per_split, int max_splits) {
  check_lengths(name, lengths);
  if (lengths.empty() || tiles < 1 || ctas < 1 || ctas > rules::kMaxLiveCtas ||
      !min_blocks_ok(min_blocks_per_split, block_kv) || max_splits < 1) {
    throw py::value_error(std::string(name) + " needs lengths, tiles, block_kv, max_splits >= 1, "
                          "min_blocks_per_split in [1, MAX_KEYS // block_kv] and ctas in [1, " +
                          std::to_string(rules::kMaxLiveCtas) + "]");
  }
}

// The model's arguments (rules::live_model_args_ok): ValueError naming the function and the
// condition that fails otherwise.
void check_live_model_args(const char* name, const std::vector<int>& lengths, int64_t kv_heads, int64_t packed_rows,
                           int64_t num_sms, int64_t ctas_per_sm) {
  check_lengths(name, lengths);
  const int64_t blocks = rules::live_blocks(lengths.data(), int(lengths.size()), rules::kLiveDefaultBlockKV);
  check_live_knob_args(name, int64_t(lengths.size()), kv_heads, packed_rows, num_sms);
  if (ctas_per_sm < 1 || ctas_per_sm > rules::kMaxCtasPerSm) {
    throw py::value_error(std::string(name) + " needs ctas_per_sm in [1, " + std::to_string(rules::kMaxCtasPerSm) +
                          "], got " + std::to_string(ctas_per_sm));
  }
  if (!rules::live_model_args_ok(int64_t(lengths.size()), kv_heads, packed_rows, num_sms, ctas_per_sm, blocks)) {
    throw py::value_error(std::string(name) + " needs the batch's blocks of " +
                          std::to_string(rules::kLiveDefaultBlockKV) + " keys (" + std::to_string(blocks) +
                          ") times its KV heads and query tiles (" +
                          std::to_string(kv_heads * rules::num_m_blocks(int(packed_rows))) + ") at most 2^40");
  }
}

// Binds one of the model's split counts of a batch, fn(lengths, batch, kv_heads, packed_rows,
// num_sms, ctas_per_sm), under `name`, with its arguments checked as check_live_model_args does.
void def_live_model_count(py::module_& m, const char* name, int (*fn)(const int*, int, int, int, int, int)) {
  m.def(name, [name, fn](const std::vector<int>& lengths, int64_t kv_heads, int64_t packed_rows, int64_t num_sms,
                         int64_t ctas_per_sm) {
    check_live_model_args(name, lengths, kv_heads, packed_rows, num_sms, ctas_per_sm);
    return fn(lengths.data(), int(lengths.size()), int(kv_heads), int(packed_rows), int(num_sms), int(ctas_per_sm));
  }, py::arg("lengths"), py::arg("kv_heads"), py::arg("packed_rows"), py::arg("num_sms"), py::arg("ctas_per_sm"));
}

}  // namespace

PYBIND11_MODULE(_rules, m) {
  m.doc() = "The rules that the split-KV kernels and the host share (kernels/include/splitkv/rules.h) and the "
            "selector's model built on them (live_model.h)";
  m.def("block_m_for", &rules::block_m_for, py::arg("packed_rows"));
  m.def("num_m_blocks", &rules::num_m_blocks, py::arg("packed_rows"));
  m.def("warp_layout", [](int block_m) {
    const rules::WarpLayout w = rules::warp_layout(block_m);
    return py::make_tuple(w.m, w.n);
  }, py::arg("block_m"));
  m.def("warps_own_keys", &rules::warps_own_keys, py::arg("block_m"), py::arg("block_kv"));
  m.def("split_kernel_registers", &rules::split_kernel_registers, py::arg("head_dim"), py::arg("block_m"),
        py::arg("block_kv"));
  m.def("register_residency", &rules::register_residency, py::arg("head_dim"), py::arg("block_m"),
        py::arg("block_kv"));
  m.def("smem_bytes", &rules::smem_bytes, py::arg("element_bytes"), py::arg("head_dim"), py::arg("block_m"),
        py::arg("block_kv"));
  m.def("tile_kv_end", &rules::tile_kv_end, py::arg("causal"), py::arg("kv_len"), py::arg("q_len"),
        py::arg("group"), py::arg("packed_rows"), py::arg("m_block"));
  m.def("split_range", [](int policy, int split, int num_splits, int kv_len, int kv_end, int block_kv) {
    if (num_splits < 1 || split < 0 || split >= num_splits || block_kv < 1) {
      throw py::value_error("split_range needs 0 <= split < num_splits and block_kv >= 1");
    }
    const rules::KeyRange r = rules::split_range(policy_of(policy), split, num_splits, kv_len, kv_end, block_kv);
    return py::make_tuple(r.start, r.end);
  }, py::arg("policy"), py::arg("split"), py::arg("num_splits"), py::arg("kv_len"), py::arg("kv_end"),
        py::arg("block_kv"));
  m.def("lanes_per_row", &rules::lanes_per_row, py::arg("head_dim"));
  m.attr("MAX_KEYS") = rules::kMaxKeys;
  m.attr("MAX_GRID_Y") = rules::kMaxGridY;
  m.attr("MAX_LIVE_CTAS") = rules::kMaxLiveCtas;
  m.def("live_splits", [](int live_len, int block_kv, int min_blocks_per_split, int max_splits) {
    if (live_len < 0 || live_len > rules::kMaxKeys || !min_blocks_ok(min_blocks_per_split, block_kv) ||
        max_splits < 1) {
      throw py::value_error("live_splits needs live_len in [0, MAX_KEYS], block_kv, max_splits >= 1 and "
                            "min_blocks_per_split in [1, MAX_KEYS // block_kv]");
    }
    return rules::live_splits(live_len, block_kv, min_blocks_per_split, max_splits);
  }, py::arg("live_len"), py::arg("block_kv"), py::arg("min_blocks_per_split"), py::arg("max_splits"));
  m.def("check_live_knob_args", [](int64_t batch, int64_t kv_heads, int64_t packed_rows, int64_t num_sms) {
    check_live_knob_args("the paged call's knobs", batch, kv_heads, packed_rows, num_sms);
  }, py::arg("batch"), py::arg("kv_heads"), py::arg("packed_rows"), py::arg("num_sms"));
  m.def("live_min_keys_per_split", [](int64_t batch, int64_t kv_heads, int64_t packed_rows, int64_t num_sms) {
    check_live_knob_args("live_min_keys_per_split", batch, kv_heads, packed_rows, num_sms);
    return rules::live_min_keys_per_split(int(batch), int(kv_heads), int(packed_rows), int(num_sms));
  }, py::arg("batch"), py::arg("kv_heads"), py::arg("packed_rows"), py::arg("num_sms"));
  m.def("live_max_splits_bounds", [](int64_t batch, int64_t kv_heads, int64_t packed_rows, int64_t num_sms) {
    check_live_knob_args("live_max_splits_bounds", batch, kv_heads, packed_rows, num_sms);
    const rules::LiveSplitBounds b =
        rules::live_max_splits_bounds(int(batch), int(kv_heads), int(packed_rows), int(num_sms));
    return py::make_tuple(b.one_sequence, b.capacity, b.floor);
  }, py::arg("batch"), py::arg("kv_heads"), py::arg("packed_rows"), py::arg("num_sms"));
  m.def("live_max_splits", [](int64_t batch, int64_t kv_heads, int64_t packed_rows, int64_t num_sms) {
    check_live_knob_args("live_max_splits", batch, kv_heads, packed_rows, num_sms);
    return rules::live_max_splits(int(batch), int(kv_heads), int(packed_rows), int(num_sms));
  }, py::arg("batch"), py::arg("kv_heads"), py::arg("packed_rows"), py::arg("num_sms"));
  py::dict live_defaults;
  live_defaults["block_kv"] = rules::kLiveDefaultBlockKV;
  live_defaults["waves_per_sequence"] = rules::kLiveWavesPerSequence;
  live_defaults["typical_len"] = rules::kLiveTypicalLen;
  live_defaults["min_keys_per_split"] = py::make_tuple(rules::kLiveMinKeysPerSplitLow, rules::kLiveMinKeysPerSplitHigh);
  live_defaults["capacity_items_per_sm"] = rules::kLiveCapacityItemsPerSm;
  live_defaults["min_max_splits"] = rules::kLiveMinMaxSplits;
  m.attr("LIVE_DEFAULTS") = live_defaults;
  m.def("size_class", [](int blocks_per_split) {
    if (blocks_per_split < 0) throw py::value_error("size_class needs blocks_per_split >= 0");
    return rules::size_class(blocks_per_split);
  }, py::arg("blocks_per_split"));
  m.def("live_plan_choices", [](int min_blocks_per_split, int block_kv) {
    if (min_blocks_per_split < 1 || block_kv < 1) {
      throw py::value_error("live_plan_choices needs min_blocks_per_split, block_kv >= 1");
    }
    return rules::live_plan_choices(min_blocks_per_split, block_kv);
  }, py::arg("min_blocks_per_split"), py::arg("block_kv"));
  m.def("live_plan_knob_estimate", [](const std::vector<int>& lengths, int64_t tiles, int64_t ctas, int block_kv,
                                      int min_blocks_per_split, int max_splits, int rate_idle16, int rate_floor16) {
    check_live_plan_args("live_plan_knob_estimate", lengths, tiles, ctas, block_kv, min_blocks_per_split, max_splits);
    if (rate_idle16 < 0 || rate_idle16 > 16 || rate_floor16 < 1 || rate_floor16 > 16) {
      throw py::value_error("live_plan_knob_estimate needs rate_idle16 in [0, 16] and rate_floor16 in [1, 16], got " +
                            std::to_string(rate_idle16) + " and " + std::to_string(rate_floor16));
    }
    return rules::live_plan_knob_estimate(lengths.data(), int(lengths.size()), tiles, ctas, block_kv,
                                          min_blocks_per_split, max_splits,
                                          rules::LivePlanRate{rate_idle16, rate_floor16});
  }, py::arg("lengths"), py::arg("tiles"), py::arg("ctas"), py::arg("block_kv"), py::arg("min_blocks_per_split"),
        py::arg("max_splits"), py::arg("rate_idle16") = rules::kLivePlanRate.idle16,
        py::arg("rate_floor16") = rules::kLivePlanRate.floor16);
  m.def("live_plan_min_blocks", [](const std::vector<int>& lengths, int64_t tiles, int64_t ctas, int block_kv,
                                   int min_blocks_per_split, int max_splits, int choices) {
    check_live_plan_args("live_plan_min_blocks", lengths, tiles, ctas, block_kv, min_blocks_per_split, max_splits);
    if (choices < 1 || choices > rules::kLivePlanChoices ||
        (int64_t(min_blocks_per_split) << (choices - 1)) > rules::kMaxKeys) {
      throw py::value_error("live_plan_min_blocks needs choices in [1, " + std::to_string(rules::kLivePlanChoices) +
                            "] and min_blocks_per_split << (choices - 1) at most MAX_KEYS");
    }
    return rules::live_plan_min_blocks(lengths.data(), int(lengths.size()), tiles, ctas, block_kv,
                                       min_blocks_per_split, max_splits, choices);
  }, py::arg("lengths"), py::arg("tiles"), py::arg("ctas"), py::arg("block_kv"), py::arg("min_blocks_per_split"),
        py::arg("max_splits"), py::arg("choices"));
  m.def("live_model_score", [](const std::vector<int>& lengths, int64_t kv_heads, int64_t packed_rows, int64_t num_sms,
                               int64_t ctas_per_sm, int min_blocks_per_split, int max_splits) {
    check_live_model_args("live_model_score", lengths, kv_heads, packed_rows, num_sms, ctas_per_sm);
    if (!min_blocks_ok(min_blocks_per_split, rules::kLiveDefaultBlockKV) || max_splits < 1 || max_splits > kMaxSplits) {
      throw py::value_error("live_model_score needs min_blocks_per_split in [1, MAX_KEYS // " +
                            std::to_string(rules::kLiveDefaultBlockKV) + "] and max_splits in [1, " +
                            std::to_string(kMaxSplits) + "]");
    }
    return rules::live_model_score(lengths.data(), int(lengths.size()), int(kv_heads), int(packed_rows),
                                   int(num_sms), int(ctas_per_sm), min_blocks_per_split, max_splits);
  }, py::arg("lengths"), py::arg("kv_heads"), py::arg("packed_rows"), py::arg("num_sms"), py::arg("ctas_per_sm"),
        py::arg("min_blocks_per_split"), py::arg("max_splits"));
  m.def("live_model_knobs", [](const std::vector<int>& lengths, int64_t kv_heads, int64_t packed_rows, int64_t num_sms,
                               int64_t ctas_per_sm) {
    check_live_model_args("live_model_knobs", lengths, kv_heads, packed_rows, num_sms, ctas_per_sm);
    const rules::LiveModelKnobs k = rules::live_model_knobs(lengths.data(), int(lengths.size()), int(kv_heads),
                                                            int(packed_rows), int(num_sms), int(ctas_per_sm));
    return py::make_tuple(k.min_blocks_per_split, k.max_splits, k.score);
  }, py::arg("lengths"), py::arg("kv_heads"), py::arg("packed_rows"), py::arg("num_sms"), py::arg("ctas_per_sm"));
  m.def("live_model_rate", [](int ctas_per_sm) {
    if (ctas_per_sm < 1 || ctas_per_sm > rules::kMaxCtasPerSm) {
      throw py::value_error("live_model_rate needs ctas_per_sm in [1, " + std::to_string(rules::kMaxCtasPerSm) +
                            "], got " + std::to_string(ctas_per_sm));
    }
    const rules::LivePlanRate rate = rules::live_model_rate(ctas_per_sm);
    return py::make_tuple(rate.idle16, rate.floor16);
  }, py::arg("ctas_per_sm"));
  def_live_model_count(m, "live_model_wave_splits", &rules::live_model_wave_splits<int>);
  def_live_model_count(m, "live_model_wave_candidate", &rules::live_model_wave_candidate<int>);
  py::dict live_model;
  live_model["min_blocks_per_split"] = as_tuple(rules::kLiveModelMinBlocks);
  live_model["max_splits"] = as_tuple(rules::kLiveModelMaxSplits);
  live_model["merge_cost16"] = rules::kLiveModelMergeCost16;
  live_model["max_ctas_per_sm"] = rules::kMaxCtasPerSm;
  m.def("max_min_blocks_per_split", [](int block_kv) {
    if (block_kv < 1) throw py::value_error("max_min_blocks_per_split needs block_kv >= 1");
    return rules::max_min_blocks_per_split(block_kv);
  }, py::arg("block_kv"));
  m.attr("LIVE_MODEL") = live_model;
  m.def("fused_merge_fits", &rules::fused_merge_fits, py::arg("packed_rows"), py::arg("head_dim"));
  m.def("workspace_sections", [](int num_splits, int batch, int q_heads, int q_len, int head_dim, bool live) {
    const rules::WorkspaceSections w = rules::workspace_sections(num_splits, batch, q_heads, q_len, head_dim, live);
    return py::make_tuple(w.m_offset, w.l_offset, w.total);
  }, py::arg("num_splits"), py::arg("batch"), py::arg("q_heads"), py::arg("q_len"), py::arg("head_dim"),
        py::arg("live") = false);
  m.def("workspace_plan_offset", [](int num_splits, int batch, int q_heads, int q_len, int head_dim) {
    return rules::workspace_sections(num_splits, batch, q_heads, q_len, head_dim, true).plan_offset;
  }, py::arg("num_splits"), py::arg("batch"), py::arg("q_heads"), py::arg("q_len"), py::arg("head_dim"));
  m.def("tile_counter_count", &rules::tile_counter_count, py::arg("batch"), py::arg("kv_heads"),
        py::arg("packed_rows"));
  m.def("spread_ctas_per_sm", &rules::spread_ctas_per_sm, py::arg("ctas"), py::arg("num_sms"),
        py::arg("resident_per_sm"));
  m.def("smem_for_ctas_per_sm", &rules::smem_for_ctas_per_sm, py::arg("per_sm"), py::arg("sm_bytes"),
        py::arg("reserved_bytes"), py::arg("kernel_bytes"));

  py::dict codes;
  codes["fp16"] = int(DType::kFp16);
  codes["bf16"] = int(DType::kBf16);
  m.attr("DTYPE_CODES") = codes;
  py::dict policies;
  for (int code = 0; code < int(std::size(kSplitPolicyNames)); ++code) policies[kSplitPolicyNames[code]] = code;
  m.attr("POLICY_CODES") = policies;

  // What tunables.h (generated from tunables.py) held when this module was built.
  py::dict compiled;
  compiled["head_dims"] = as_tuple(kHeadDims);
  compiled["block_kv"] = as_tuple(kBlockKVs);
  compiled["block_m"] = as_tuple(kBlockMs);
  compiled["reduce_threads"] = as_tuple(kReduceThreads);
  compiled["max_splits"] = kMaxSplits;
  compiled["kv_stages"] = kKVStages;
  compiled["num_warps"] = kNumWarps;
  compiled["workspace_align"] = kWorkspaceAlign;
  m.attr("COMPILED_TUNABLES") = compiled;
}
