// Launch template of the split kernel; one explicit instantiation per generated .cu file.
#pragma once

#include <stdexcept>
#include <string>

#include "splitkv/launch_utils.h"
#include "splitkv/split_kernel.h"

namespace splitkv {

// Lets `kernel` (split_kv_live_kernel<Traits> when live, else split_kv_kernel<Traits>) take smem
// bytes of dynamic shared memory on `device`, the current one. The attribute belongs to the
// device's context: raised once per device, kernel and size. Needed before a launch of more than
// 48 KB, and before an occupancy query of that much, which would find no CTA otherwise.
template <class Traits>
void allow_dynamic_smem(bool live, int device, int smem) {
  if (smem <= 48 * 1024) return;
  static int configured[2][kMaxDevices] = {};
  int* limit = device < kMaxDevices ? &configured[live][device] : nullptr;
  if (limit == nullptr || *limit < smem) {
    auto kernel = live ? &split_kv_live_kernel<Traits> : &split_kv_kernel<Traits>;
    check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem),
               "split kernel shared-memory limit");
    if (limit != nullptr) *limit = smem;
  }
}

// CTAs of split_kv_live_kernel<Traits> one SM holds at once with smem_bytes of dynamic shared
// memory on `device` (the current one), asked once per device and size (a server's batch size
// rarely changes).
template <class Traits>
int live_ctas_per_sm(int device, int smem_bytes) {
  static int sizes[kMaxDevices] = {}, counts[kMaxDevices] = {};
  const int slot = device < kMaxDevices ? device : kMaxDevices - 1;
  if (sizes[slot] != smem_bytes || counts[slot] == 0) {
    allow_dynamic_smem<Traits>(true, device, smem_bytes);
    check_cuda(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&counts[slot], &split_kv_live_kernel<Traits>,
                                                             Traits::kNThreads, smem_bytes),
               "split kernel occupancy");
    sizes[slot] = smem_bytes;
  }
  return counts[slot];
}

// Static shared memory of split_kv_live_kernel<Traits>, beside its dynamic shared memory.
template <class Traits>
int live_static_smem_bytes() {
  cudaFuncAttributes attributes{};
  check_cuda(cudaFuncGetAttributes(&attributes, &split_kv_live_kernel<Traits>), "split kernel attributes");
  return int(attributes.sharedSizeBytes);
}

// Dynamic shared memory of a paged / variable-length launch: the kernel's own, then the schedule.
template <class Traits>
int live_smem_bytes(const SplitParams& p) {
  return Traits::kSmemBytes + rules::live_schedule_bytes(p.batch, p.plan_choices);
}

// CTAs of a paged / variable-length launch on `device` (rules::live_grid): the persistent grid
// that the load-aware plan divides the batch's work among.
template <class Traits>
int64_t live_grid_on(const SplitParams& p, int device) {
  const int64_t capacity = rules::live_work_capacity(p.batch, p.kv_heads, p.packed_rows, p.num_splits);
  return rules::live_grid(capacity, sm_count(device), live_ctas_per_sm<Traits>(device, live_smem_bytes<Traits>(p)));
}

// The same on the current device.
template <typename Element, int kHeadDim, int kBlockM, int kBlockKV>
int live_grid(const SplitParams& p) {
  int device = 0;
  check_cuda(cudaGetDevice(&device), "cudaGetDevice");
  return int(live_grid_on<SplitKernelTraits<kHeadDim, kBlockM, kBlockKV, Element>>(p, device));
}

template <typename Element, int kHeadDim, int kBlockM, int kBlockKV>
void run_split_kernel(const SplitParams& p, cudaStream_t stream, bool programmatic) {
  using Traits = SplitKernelTraits<kHeadDim, kBlockM, kBlockKV, Element>;
  const bool live = p.seqlens != nullptr;
  const int smem = live ? live_smem_bytes<Traits>(p) : Traits::kSmemBytes;
  int device = 0;
  check_cuda(cudaGetDevice(&device), "cudaGetDevice");
  if (live) {
    // The schedule grows with the batch; the live kernel's static shared memory (CUB's scan
    // storage) counts against the same limit.
    static const int static_smem = live_static_smem_bytes<Traits>();
    if (smem + static_smem > smem_optin_limit(device)) {
      throw std::invalid_argument("cache_seqlens: a batch of " + std::to_string(p.batch) + " sequences needs " +
                                  std::to_string(rules::live_schedule_bytes(p.batch, p.plan_choices)) +
                                  " bytes of shared memory for its schedule beside the kernel's " +
                                  std::to_string(Traits::kSmemBytes + static_smem) + "; this device allows " +
                                  std::to_string(smem_optin_limit(device)) + " in all");
    }
  }
  allow_dynamic_smem<Traits>(live, device, smem);
  const dim3 grid = live ? dim3(unsigned(live_grid_on<Traits>(p, device)))
                         : dim3(p.num_m_blocks, p.batch * p.kv_heads, p.num_splits);
  if (live) {
    launch_kernel<&split_kv_live_kernel<Traits>>(p, grid, dim3(Traits::kNThreads), smem, stream, programmatic,
                                                 "split kernel launch");
  } else {
    launch_kernel<&split_kv_kernel<Traits>>(p, grid, dim3(Traits::kNThreads), smem, stream, programmatic,
                                            "split kernel launch");
  }
}

template <typename Element, int kHeadDim, int kBlockM, int kBlockKV>
constexpr int split_smem_bytes() {
  return SplitKernelTraits<kHeadDim, kBlockM, kBlockKV, Element>::kSmemBytes;
}

}  // namespace splitkv
