// Device memory that is zero when handed out, for the fused merge's counters. Plain CUDA
// runtime, host only.
//
// The counters must be zero before a launch's first CTA counts in, and every launch leaves them
// zero (fused_merge.h), so they are zeroed once, when allocated. That allocation may come during
// a CUDA-graph capture (the first call of a server is often a captured one): the pool then
// switches this thread to relaxed capture mode for the cudaMalloc, as PyTorch's allocator does,
// and zeroes the memory on a private stream that it waits for, so nothing is recorded into the
// graph and no kernel runs on the caller's stream.
//
// Counters handed to a captured graph belong to it until CUDA destroys the graph and every
// executable made from it, after their last launch has finished (a CUDA user object retained
// by the graph). Then they are zero again and return to the pool, so a process that captures
// and drops graphs all night (the tuner) does not grow.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <map>
#include <mutex>
#include <stdexcept>
#include <vector>

#include "splitkv/launch_utils.h"

namespace splitkv {

class CounterPool {
 public:
  // At least `count` zeroed int32 values, 128-byte aligned; their capacity (a power of two, at
  // least 32) in *capacity. The current device must be this pool's.
  int* take(int64_t count, int64_t* capacity) {
    int64_t cap = 32;
    while (cap < count) cap *= 2;
    *capacity = cap;
    std::lock_guard<std::mutex> lock(mutex_);
    std::vector<int*>& free = free_[cap];
    if (!free.empty()) {
      int* p = free.back();
      free.pop_back();
      return p;
    }
    const int64_t bytes = cap * int64_t(sizeof(int));
    if (chunk_ == nullptr || used_ + bytes > capacity_) {
      capacity_ = bytes > kChunkBytes ? bytes : kChunkBytes;
      chunk_ = allocate_zeroed(capacity_);
      used_ = 0;
    }
    int* p = reinterpret_cast<int*>(chunk_ + used_);
    used_ += bytes;
    return p;
  }

  // Counters that are zero again (every launch that used them has finished).
  void give_back(int* p, int64_t capacity) {
    std::lock_guard<std::mutex> lock(mutex_);
    free_[capacity].push_back(p);
  }

 private:
  static constexpr int64_t kChunkBytes = 1 << 20;

  char* allocate_zeroed(int64_t bytes) {
    cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
    check_cuda(cudaThreadExchangeStreamCaptureMode(&mode), "cudaThreadExchangeStreamCaptureMode");
    void* p = nullptr;
    cudaError_t err = cudaMalloc(&p, size_t(bytes));
    if (err == cudaSuccess && stream_ == nullptr) err = cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking);
    if (err == cudaSuccess) err = cudaMemsetAsync(p, 0, size_t(bytes), stream_);
    if (err == cudaSuccess) err = cudaStreamSynchronize(stream_);
    cudaThreadExchangeStreamCaptureMode(&mode);  // back to the caller's mode, whatever happened
    check_cuda(err, "zeroed counter memory");
    return static_cast<char*>(p);
  }

  std::mutex mutex_;
  cudaStream_t stream_ = nullptr;
  char* chunk_ = nullptr;
  int64_t used_ = 0, capacity_ = 0;
  std::map<int64_t, std::vector<int*>> free_;  // by capacity
};

// The pool of `device` (never destroyed: graphs may hold its memory until the process exits).
inline CounterPool& counter_pool(int device) {
  static std::mutex mutex;
  static CounterPool* pools[kMaxDevices] = {};
  if (device < 0 || device >= kMaxDevices) throw std::runtime_error("device index out of range for the counter pool");
  std::lock_guard<std::mutex> lock(mutex);
  if (pools[device] == nullptr) pools[device] = new CounterPool();
  return *pools[device];
}

namespace detail {

struct GraphCounters {
  CounterPool* pool;
  int* counters;
  int64_t capacity;
};

// Runs on a CUDA thread once the graph and its executables are gone and idle: no CUDA calls.
inline void release_graph_counters(void* data) {
  auto* held = static_cast<GraphCounters*>(data);
  held->pool->give_back(held->counters, held->capacity);
  delete held;
}

}  // namespace detail

// Counters for a call being captured on `stream`: shared by the calls of one capture on that
// stream (they run in stream order), owned by the graph being captured.
inline int* graph_counters(int device, cudaStream_t stream, int64_t count) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  unsigned long long capture_id = 0;
  cudaGraph_t graph = nullptr;
  check_cuda(cudaStreamGetCaptureInfo(stream, &status, &capture_id, &graph), "cudaStreamGetCaptureInfo");
  if (status != cudaStreamCaptureStatusActive || graph == nullptr) {
    throw std::runtime_error("the stream's capture is not active (invalidated by an earlier error?)");
  }
  struct Current {
    unsigned long long capture_id;
    int* counters;
    int64_t capacity;
  };
  static std::mutex mutex;
  static auto* current = new std::map<std::pair<int, cudaStream_t>, Current>();
  std::lock_guard<std::mutex> lock(mutex);
  Current& entry = (*current)[{device, stream}];
  if (entry.capture_id == capture_id && entry.counters != nullptr && entry.capacity >= count) return entry.counters;
  CounterPool& pool = counter_pool(device);
  auto* held = new detail::GraphCounters{&pool, nullptr, 0};
  held->counters = pool.take(count, &held->capacity);
  cudaUserObject_t object = nullptr;
  const cudaError_t created = cudaUserObjectCreate(&object, held, detail::release_graph_counters, 1,
                                                   cudaUserObjectNoDestructorSync);
  if (created != cudaSuccess) {
    pool.give_back(held->counters, held->capacity);
    delete held;
    check_cuda(created, "the fused merge's counters for the graph");
  }
  const cudaError_t retained = cudaGraphRetainUserObject(graph, object, 1, cudaGraphUserObjectMove);
  if (retained != cudaSuccess) {
    cudaUserObjectRelease(object, 1);  // its destructor gives the counters back
    check_cuda(retained, "attaching the fused merge's counters to the graph");
  }
  entry = Current{capture_id, held->counters, held->capacity};
  return entry.counters;
}

}  // namespace splitkv
