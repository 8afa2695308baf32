// What an eager call borrows per (device, stream): the default workspace and the counters of the
// fused merge and the schedule, and the checks of a caller's own workspace. Included by
// bindings.cpp only: it needs torch and pybind11, which the kernel headers never include.
#pragma once

#include <torch/extension.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "splitkv/counter_pool.h"
#include "splitkv/launch_utils.h"
#include "splitkv/tunables.h"

namespace splitkv::binding {

namespace py = pybind11;

inline bool capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  check_cuda(cudaStreamIsCapturing(stream, &status), "cudaStreamIsCapturing");
  return status != cudaStreamCaptureStatusNone;
}

using StreamKey = std::pair<int, cudaStream_t>;

// The default workspace: one per (device, stream), since calls on one stream run in order.
// A call under CUDA-graph capture takes its own from the graph's pool instead: a cached buffer
// must not be baked into a graph that may replay beside later eager calls.
inline at::Tensor default_workspace(const at::Tensor& q, int64_t nbytes, cudaStream_t stream, bool captured) {
  const auto options = at::TensorOptions().dtype(at::kByte).device(q.device());
  if (captured) return at::empty({std::max<int64_t>(nbytes, 1)}, options);
  static std::mutex mutex;
  static auto* cache = new std::map<StreamKey, at::Tensor>();  // never destroyed: outlives CUDA at exit
  std::lock_guard<std::mutex> lock(mutex);
  at::Tensor& ws = (*cache)[{int(q.device().index()), stream}];
  if (!ws.defined() || ws.numel() < nbytes) ws = at::empty({std::max<int64_t>(nbytes, 1)}, options);
  return ws;
}

inline at::Tensor checked_workspace(py::handle obj, const at::Tensor& q, int64_t nbytes) {
  if (!THPVariable_Check(obj.ptr()) || THPVariable_Unpack(obj.ptr()).scalar_type() != at::kByte) {
    throw py::type_error("workspace must be a torch.uint8 tensor");
  }
  const at::Tensor& ws = THPVariable_Unpack(obj.ptr());
  if (ws.device() != q.device() || !ws.is_contiguous()) {
    throw py::value_error("workspace must be a contiguous tensor on " + q.device().str());
  }
  if (ws.numel() < nbytes) {
    throw py::value_error("workspace must hold at least " + std::to_string(nbytes) + " bytes, got " +
                          std::to_string(ws.numel()));
  }
  if (reinterpret_cast<std::uintptr_t>(ws.data_ptr()) % kWorkspaceAlign) {
    throw py::value_error("workspace must be " + std::to_string(kWorkspaceAlign) + "-byte aligned");
  }
  return ws;
}

// The fused merge's and the schedule's counters (rules.h), from the counter pool, which never
// runs a kernel on the caller's stream. An eager call uses one buffer per (device, stream), which
// every launch leaves zero; calls under capture use the counters of the graph being captured, so
// a graph never shares them with eager calls or with other graphs replayed beside it.
inline std::mutex eager_counters_mutex;
inline auto* eager_counters = new std::map<StreamKey, std::pair<int*, int64_t>>();  // never destroyed

inline int* launch_counters(int device, cudaStream_t stream, int64_t count, bool captured) {
  if (captured) return graph_counters(device, stream, count);
  std::lock_guard<std::mutex> lock(eager_counters_mutex);
  auto& [counters, capacity] = (*eager_counters)[{device, stream}];
  if (capacity < count) counters = counter_pool(device).take(count, &capacity);
  return counters;
}

// The eager counters of (device, stream) as they are now (empty before a fused merge ran
// there): what the tests check every launch leaves at zero. Synchronises the device.
inline std::vector<int> read_eager_counters(int device, std::uintptr_t stream) {
  std::pair<int*, int64_t> entry{nullptr, 0};
  {
    std::lock_guard<std::mutex> lock(eager_counters_mutex);
    const auto it = eager_counters->find({device, reinterpret_cast<cudaStream_t>(stream)});
    if (it != eager_counters->end()) entry = it->second;
  }
  std::vector<int> values(size_t(entry.second));
  if (entry.first != nullptr) {
    const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
    check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    check_cuda(cudaMemcpy(values.data(), entry.first, values.size() * sizeof(int), cudaMemcpyDeviceToHost),
               "reading the counters");
  }
  return values;
}

}  // namespace splitkv::binding
