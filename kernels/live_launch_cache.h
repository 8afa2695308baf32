// The eager paged / variable-length call's launch arguments by call signature (bindings.cpp's
// _C.live_attention). Included by bindings.cpp only: it needs torch's Python bindings and the
// Python side's ops._live_launch.
#pragma once

#include <torch/extension.h>
#include <pybind11/gil_safe_call_once.h>
#include <pybind11/pybind11.h>

#include <array>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <memory>
#include <unordered_map>

#include "plan_cache.h"

namespace splitkv::binding {

namespace py = pybind11;

// What a paged launch runs with besides the tensors (ops._live_launch's tuple): the launch
// arguments, the knob the plan starts from and its choices, the cache's capacity per sequence
// (for check_inputs), the softmax scale and causal.
struct LiveLaunch {
  LaunchArgs args;
  int min_blocks_per_split, plan_choices, capacity;
  double softmax_scale;
  bool causal;
};

// A call signature as integers: per tensor (q, k, v, cache_seqlens, block_table) its presence
// and rank, dtype, device, sizes and strides; per scalar argument its type and value, so that 1
// is not taken for True. Everything the checks and launch arguments of ops._live_launch depend
// on, as live.launch_args documents; not the data, which check_inputs reads on every call.
constexpr int kLiveMaxRank = 4;
constexpr int kLiveTensorWords = 3 + 2 * kLiveMaxRank;
constexpr int kLiveTensors = 5;
constexpr int kLiveScalars = 12;
using LiveKey = std::array<int64_t, kLiveTensors * kLiveTensorWords + 2 * kLiveScalars>;

// The strings a scalar argument of a cached call can be; any other string is refused by
// ops._live_launch, on every call.
inline constexpr const char* kLiveWords[] = {"auto", "blocks", "length", "fused", "kernel", "fixed", "load_aware"};

// One tensor's words: false for an object other than None or a plain torch.Tensor (a subclass
// may override anything), or of a rank no argument has.
inline bool live_tensor_words(py::handle obj, int64_t* w) {
  std::fill(w, w + kLiveTensorWords, 0);
  if (obj.is_none()) return true;
  if (!THPVariable_CheckExact(obj.ptr())) return false;
  const at::Tensor& t = THPVariable_Unpack(obj.ptr());
  if (t.dim() > kLiveMaxRank) return false;
  w[0] = 1 + t.dim();
  w[1] = int64_t(t.scalar_type());
  w[2] = int64_t(t.device().type()) * 65536 + t.device().index();
  for (int64_t i = 0; i < t.dim(); ++i) {
    w[3 + i] = t.size(i);
    w[3 + kLiveMaxRank + i] = t.stride(i);
  }
  return true;
}

// One scalar's words (type, value): None, a bool, an int in int64, a float (its bits) or one of
// kLiveWords; false for anything else (a numpy number, a 0-d tensor that could change in place).
inline bool live_scalar_words(py::handle obj, int64_t* w) {
  PyObject* o = obj.ptr();
  w[1] = 0;
  if (o == Py_None) {
    w[0] = 0;
  } else if (o == Py_True || o == Py_False) {
    w[0] = 1;
    w[1] = o == Py_True;
  } else if (PyLong_CheckExact(o)) {
    int overflow = 0;
    w[0] = 2;
    w[1] = PyLong_AsLongLongAndOverflow(o, &overflow);
    if (overflow || (w[1] == -1 && PyErr_Occurred())) {
      PyErr_Clear();
      return false;
    }
  } else if (PyFloat_CheckExact(o)) {
    const double value = PyFloat_AS_DOUBLE(o);
    w[0] = 3;
    std::memcpy(&w[1], &value, sizeof value);
  } else if (PyUnicode_CheckExact(o)) {
    w[0] = 4;
    for (int i = 0; i < int(std::size(kLiveWords)); ++i) {
      if (PyUnicode_CompareWithASCIIString(o, kLiveWords[i]) == 0) {
        w[1] = i;
        return true;
      }
    }
    return false;
  } else {
    return false;
  }
  return true;
}

inline bool live_key(py::handle const (&tensors)[kLiveTensors], py::handle const (&scalars)[kLiveScalars],
                     LiveKey& key) {
  int64_t* w = key.data();
  for (py::handle t : tensors) {
    if (!live_tensor_words(t, w)) return false;
    w += kLiveTensorWords;
  }
  for (py::handle s : scalars) {
    if (!live_scalar_words(s, w)) return false;
    w += 2;
  }
  return true;
}

struct LiveKeyHash {
  size_t operator()(const LiveKey& key) const {
    uint64_t h = 1469598103934665603ull;  // FNV-1a over the words
    for (int64_t word : key) h = (h ^ uint64_t(word)) * 1099511628211ull;
    return size_t(h);
  }
};

constexpr size_t kMaxLiveLaunches = 1024;

// The cached launches, guarded by the GIL as plan_cache() is; shared so that a launch stays
// alive while a miss runs Python.
inline std::unordered_map<LiveKey, std::shared_ptr<const LiveLaunch>, LiveKeyHash>* live_launch_cache() {
  static auto* launches = new std::unordered_map<LiveKey, std::shared_ptr<const LiveLaunch>, LiveKeyHash>();
  return launches;
}

// ops._live_launch's launch of the call (it checks everything but the data and raises naming a
// bad argument).
inline std::shared_ptr<const LiveLaunch> make_live_launch(py::handle const (&tensors)[kLiveTensors],
                                                          py::handle const (&scalars)[kLiveScalars]) {
  PYBIND11_CONSTINIT static py::gil_safe_call_once_and_store<py::object> storage;
  const py::object& live_launch =
      storage.call_once_and_store_result([] { return py::module_::import("splitkv_tune.ops").attr("_live_launch"); })
          .get_stored();
  py::tuple args(kLiveTensors + kLiveScalars);
  for (int i = 0; i < kLiveTensors; ++i) args[i] = tensors[i];
  for (int i = 0; i < kLiveScalars; ++i) args[kLiveTensors + i] = scalars[i];
  const auto t = py::reinterpret_steal<py::tuple>(PyObject_Call(live_launch.ptr(), args.ptr(), nullptr));
  if (!t) throw py::error_already_set();
  auto made = std::make_shared<LiveLaunch>();
  made->args = {t[0].cast<int>(), t[1].cast<int>(), t[2].cast<int>(), t[3].cast<int>(), t[4].cast<bool>()};
  made->min_blocks_per_split = t[5].cast<int>();
  made->plan_choices = t[6].cast<int>();
  made->capacity = t[7].cast<int>();
  made->softmax_scale = t[8].cast<double>();
  made->causal = t[9].cast<bool>();
  return made;
}

// The launch of a call signature: cached, or made (and cached when the arguments are of the
// types keyed here).
inline std::shared_ptr<const LiveLaunch> live_launch_for(py::handle const (&tensors)[kLiveTensors],
                                                         py::handle const (&scalars)[kLiveScalars]) {
  LiveKey key;
  if (!live_key(tensors, scalars, key)) return make_live_launch(tensors, scalars);
  auto* cache = live_launch_cache();
  const auto it = cache->find(key);
  if (it != cache->end()) return it->second;
  auto made = make_live_launch(tensors, scalars);
  if (cache->size() >= kMaxLiveLaunches) cache->clear();
  cache->emplace(key, made);
  return made;
}

}  // namespace splitkv::binding
