// The eager equal-length call's plan cache (bindings.cpp's _C.attention), and the two plain
// structs it shares with the binding. Included by bindings.cpp only: it needs pybind11 and the
// Python side's ops._plan_for.
#pragma once

#include <pybind11/gil_safe_call_once.h>
#include <pybind11/pybind11.h>

#include <array>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <memory>
#include <unordered_map>

#include "splitkv/rules.h"
#include "splitkv/tunables.h"

namespace splitkv::binding {

namespace py = pybind11;

// A call's problem dims, checked as ops.problem_shape checks them.
struct Dims {
  int dtype, device;
  int64_t head_dim, batch, q_heads, kv_heads, q_len, kv_len;
};

// What a launch runs with besides the tensors: ops.py resolved and validated it.
struct LaunchArgs {
  int num_splits, block_kv, reduce_threads, split_policy;
  bool fused_merge;
};

// The eager equal-length call's plans, by call signature: everything but the tensors' data and
// the KV length. A miss asks ops._plan_for, which validates the scalar arguments and resolves the
// tunables once (ops._Plan); a hit costs a hash of a few integers, so that the whole call is one
// crossing into C++. The cache is guarded by the GIL, which every call into this module holds.
// Arguments of other types than the plain ones keyed here (numpy integers, say) still work: they
// go to ops._plan_for on every call, uncached.
constexpr int64_t kAutoArg = INT64_MIN;
using PlanKey = std::array<int64_t, 16>;

struct PlanKeyHash {
  size_t operator()(const PlanKey& key) const {
    uint64_t h = 1469598103934665603ull;  // FNV-1a over the words
    for (int64_t word : key) h = (h ^ uint64_t(word)) * 1099511628211ull;
    return size_t(h);
  }
};

struct Plan {
  py::object plan;  // the ops._Plan, asked per KV length when a tunable is "auto"
  bool causal;
  double softmax_scale;
  bool fixed;       // no tunable is "auto": args holds every KV length's
  int64_t kv_len;   // otherwise args is this KV length's (-1: none yet)
  LaunchArgs args;
};

constexpr size_t kMaxPlans = 4096;

// A tunable as a key word: kAutoArg for "auto", else an int's value (num_splits, block_kv,
// reduce_threads) or a policy's code (split_policy); false for an object of any other type.
inline bool tunable_word(py::handle obj, bool policy, int64_t& word) {
  if (PyLong_CheckExact(obj.ptr()) && !policy) {
    int overflow = 0;
    word = PyLong_AsLongLongAndOverflow(obj.ptr(), &overflow);
    return !overflow && word != kAutoArg && !(word == -1 && PyErr_Occurred());
  }
  if (!PyUnicode_Check(obj.ptr())) return false;
  word = kAutoArg;
  if (PyUnicode_CompareWithASCIIString(obj.ptr(), "auto") == 0) return true;
  for (int code = 0; policy && code < int(std::size(kSplitPolicyNames)); ++code) {
    if (PyUnicode_CompareWithASCIIString(obj.ptr(), kSplitPolicyNames[code]) == 0) {
      word = code;
      return true;
    }
  }
  return false;
}

// A merge as a key word: its index in tunables.MERGES (kMerges); -1 for anything else.
inline int merge_word(py::handle obj) {
  if (!PyUnicode_Check(obj.ptr())) return -1;
  for (int i = 0; i < int(std::size(kMerges)); ++i) {
    if (PyUnicode_CompareWithASCIIString(obj.ptr(), kMerges[i]) == 0) return i;
  }
  return -1;
}

// The key of a call signature; false when an argument is not of a type keyed here.
inline bool plan_key(const Dims& d, py::handle causal, py::handle softmax_scale, py::handle const (&tunables)[4],
                     py::handle merge, py::handle enable_pdl, PlanKey& key) {
  const auto is_bool = [](py::handle obj) { return obj.ptr() == Py_True || obj.ptr() == Py_False; };
  const int merge_code = merge_word(merge);
  if (!is_bool(causal) || !is_bool(enable_pdl) || merge_code < 0) return false;
  int64_t scale_bits = 0;
  if (PyFloat_CheckExact(softmax_scale.ptr())) {
    const double scale = PyFloat_AS_DOUBLE(softmax_scale.ptr());
    std::memcpy(&scale_bits, &scale, sizeof scale);
  } else if (!softmax_scale.is_none()) {
    return false;
  }
  key = {d.dtype, d.device, d.head_dim, d.batch, d.q_heads, d.kv_heads, d.q_len, causal.ptr() == Py_True,
         enable_pdl.ptr() == Py_True, merge_code, softmax_scale.is_none(), scale_bits};
  for (int i = 0; i < 4; ++i) {
    if (!tunable_word(tunables[i], i == 3, key[12 + i])) {
      PyErr_Clear();
      return false;
    }
  }
  return true;
}

// The cached plans. Never destroyed: they hold Python objects. Entries are shared so that a
// plan stays alive while a call runs Python (which may let another thread clear the cache).
inline std::unordered_map<PlanKey, std::shared_ptr<Plan>, PlanKeyHash>* plan_cache() {
  static auto* plans = new std::unordered_map<PlanKey, std::shared_ptr<Plan>, PlanKeyHash>();
  return plans;
}

// ops._Plan.launch_args's tuple (num_splits, block_kv, reduce_threads, split_policy code, fused).
inline LaunchArgs launch_args_of(py::handle obj) {
  const auto t = py::reinterpret_borrow<py::tuple>(obj);
  return {t[0].cast<int>(), t[1].cast<int>(), t[2].cast<int>(), t[3].cast<int>(), t[4].cast<bool>()};
}

// ops._plan_for's plan of a call signature, as the cache keeps it.
inline std::shared_ptr<Plan> make_plan(const Dims& d, py::handle causal, py::handle softmax_scale,
                                       py::handle const (&tunables)[4], py::handle merge, py::handle enable_pdl) {
  // Imported once under pybind11's GIL-safe guard (a plain function-local static that runs
  // Python can deadlock against a thread waiting on its guard).
  PYBIND11_CONSTINIT static py::gil_safe_call_once_and_store<py::object> storage;
  const py::object& plan_for =
      storage.call_once_and_store_result([] { return py::module_::import("splitkv_tune.ops").attr("_plan_for"); })
          .get_stored();
  const py::tuple dims = py::make_tuple(d.dtype, d.head_dim, d.batch, d.q_heads, d.kv_heads, d.q_len, d.kv_len,
                                        d.device);
  auto made = std::make_shared<Plan>();
  Plan& plan = *made;
  plan.plan = plan_for(dims, causal, softmax_scale, tunables[0], tunables[1], tunables[2], tunables[3], merge,
                       enable_pdl);
  plan.causal = plan.plan.attr("shape").attr("causal").cast<bool>();
  plan.softmax_scale = plan.plan.attr("scale").cast<double>();
  const py::object fixed = plan.plan.attr("fixed");
  plan.fixed = !fixed.is_none();
  plan.kv_len = -1;
  if (plan.fixed) plan.args = launch_args_of(fixed);
  return made;
}

}  // namespace splitkv::binding
