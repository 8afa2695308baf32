// pybind11 module splitkv_tune._C: takes data pointers, strides and a stream as integers.
// Validation of shapes and dtypes happens in splitkv_tune/ops.py before anything reaches here.
#include <pybind11/pybind11.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "splitkv/dispatch.h"
#include "splitkv/launch_utils.h"
#include "splitkv/tunables.h"

namespace py = pybind11;
using namespace splitkv;

namespace {

template <typename T>
T get(const py::dict& d, const char* key) {
  if (!d.contains(key)) throw py::key_error(std::string("missing launch argument '") + key + "'");
  return d[key].cast<T>();
}

template <typename T>
T* ptr(const py::dict& d, const char* key) {
  return reinterpret_cast<T*>(get<std::uintptr_t>(d, key));
}

// Reads "<prefix>_batch_stride", "<prefix>_row_stride" and "<prefix>_head_stride" (elements).
void read_strides(const py::dict& d, const std::string& prefix, int64_t& batch, int64_t& row, int64_t& head) {
  batch = get<int64_t>(d, (prefix + "_batch_stride").c_str());
  row = get<int64_t>(d, (prefix + "_row_stride").c_str());
  head = get<int64_t>(d, (prefix + "_head_stride").c_str());
}

cudaStream_t stream_of(const py::dict& d) { return reinterpret_cast<cudaStream_t>(get<std::uintptr_t>(d, "stream")); }

void check_smem(DType dtype, int head_dim, int block_m, int block_kv, int device) {
  const int need = split_smem_bytes(dtype, head_dim, block_m, block_kv);
  static int limits[kMaxDevices] = {};
  int limit = device >= 0 && device < kMaxDevices ? limits[device] : 0;
  if (limit == 0) {
    if (cudaDeviceGetAttribute(&limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) != cudaSuccess) {
      throw std::runtime_error("cannot read the shared-memory limit of the device");
    }
    if (device >= 0 && device < kMaxDevices) limits[device] = limit;
  }
  if (need > limit) {
    throw py::value_error("block_kv=" + std::to_string(block_kv) + " with head_dim=" + std::to_string(head_dim) +
                          " and a " + std::to_string(block_m) + "-row query tile needs " + std::to_string(need) +
                          " bytes of shared memory; this device allows " + std::to_string(limit));
  }
}

void split_forward(const py::dict& d) {
  SplitParams p{};
  p.q = ptr<const void>(d, "q");
  p.k = ptr<const void>(d, "k");
  p.v = ptr<const void>(d, "v");
  p.out = ptr<void>(d, "out");
  p.lse = ptr<float>(d, "lse");
  p.ws_o = ptr<float>(d, "ws_o");
  p.ws_m = ptr<float>(d, "ws_m");
  p.ws_l = ptr<float>(d, "ws_l");
  p.tile_counters = ptr<int>(d, "tile_counters");
  read_strides(d, "q", p.q_batch_stride, p.q_row_stride, p.q_head_stride);
  read_strides(d, "k", p.k_batch_stride, p.k_row_stride, p.k_head_stride);
  read_strides(d, "v", p.v_batch_stride, p.v_row_stride, p.v_head_stride);
  read_strides(d, "o", p.o_batch_stride, p.o_row_stride, p.o_head_stride);
  p.batch = get<int>(d, "batch");
  p.q_heads = get<int>(d, "q_heads");
  p.kv_heads = get<int>(d, "kv_heads");
  p.group = p.q_heads / p.kv_heads;
  p.q_len = get<int>(d, "q_len");
  p.kv_len = get<int>(d, "kv_len");
  p.packed_rows = p.q_len * p.group;
  p.num_splits = get<int>(d, "num_splits");
  const int block_m = get<int>(d, "block_m");
  p.num_m_blocks = (p.packed_rows + block_m - 1) / block_m;
  p.softmax_scale = get<float>(d, "softmax_scale");
  p.scale_log2 = p.softmax_scale * 1.4426950408889634f;
  p.causal = get<bool>(d, "causal");
  p.split_policy = static_cast<SplitPolicy>(get<int>(d, "split_policy"));
  const auto dtype = static_cast<DType>(get<int>(d, "dtype"));
  const int head_dim = get<int>(d, "head_dim");
  const int block_kv = get<int>(d, "block_kv");
  check_smem(dtype, head_dim, block_m, block_kv, get<int>(d, "device"));
  run_split(p, dtype, head_dim, block_m, block_kv, stream_of(d), get<bool>(d, "pdl"));
}

void combine_forward(const py::dict& d) {
  CombineParams p{};
  p.ws_o = ptr<const float>(d, "ws_o");
  p.ws_m = ptr<const float>(d, "ws_m");
  p.ws_l = ptr<const float>(d, "ws_l");
  p.out = ptr<void>(d, "out");
  p.lse = ptr<float>(d, "lse");
  read_strides(d, "o", p.o_batch_stride, p.o_row_stride, p.o_head_stride);
  p.batch = get<int>(d, "batch");
  p.kv_heads = get<int>(d, "kv_heads");
  p.group = get<int>(d, "group");
  p.q_len = get<int>(d, "q_len");
  p.packed_rows = p.q_len * p.group;
  p.num_splits = get<int>(d, "num_splits");
  p.total_rows = int64_t(p.batch) * p.kv_heads * p.packed_rows;
  run_combine(p, static_cast<DType>(get<int>(d, "dtype")), get<int>(d, "head_dim"), get<int>(d, "reduce_threads"),
              stream_of(d), get<bool>(d, "pdl"));
}

py::dict compiled_tunables() {
  py::dict d;
  auto as_tuple = [](const auto& values) {
    py::list l;
    for (int v : values) l.append(v);
    return py::tuple(l);
  };
  d["head_dims"] = as_tuple(kHeadDims);
  d["block_kv"] = as_tuple(kBlockKVs);
  d["block_m"] = as_tuple(kBlockMs);
  d["reduce_threads"] = as_tuple(kReduceThreads);
  d["max_splits"] = kMaxSplits;
  d["kv_stages"] = kKVStages;
  d["num_warps"] = kNumWarps;
  d["workspace_align"] = kWorkspaceAlign;
  return d;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "split-KV FlashAttention forward kernels (CUTLASS/CuTe)";
  m.def("split_forward", &split_forward, "Launch the split kernel; arguments as a dict of integers");
  m.def("combine_forward", &combine_forward, "Launch the combine kernel; arguments as a dict of integers");
  m.def("split_smem_bytes", [](int dtype, int head_dim, int block_m, int block_kv) {
    return split_smem_bytes(static_cast<DType>(dtype), head_dim, block_m, block_kv);
  });
  m.def("compiled_tunables", &compiled_tunables, "The tunables this module was generated from");
}
