// Launch template of the split kernel; one explicit instantiation per generated .cu file.
#pragma once

#include <atomic>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "splitkv/launch_utils.h"
#include "splitkv/live_plan.h"
#include "splitkv/split_kernel.h"

namespace splitkv {

// Lets `kernel` (split_kv_live_kernel<Traits> when live, else split_kv_kernel<Traits>) take smem
// bytes of dynamic shared memory on `device`, the current one. The attribute belongs to the
// device's context: raised once per device and kernel, always to that kernel's one limit on the
// device (live_smem_limit, equal_smem_limit), so that threads raising it at once agree. Needed
// before a launch of more than 48 KB, and before an occupancy query of that much, which would
// find no CTA otherwise.
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

// Static shared memory of Kernel, beside its dynamic shared memory; read once.
template <auto Kernel>
int static_smem_bytes() {
  static const int bytes = [] {
    cudaFuncAttributes attributes{};
    check_cuda(cudaFuncGetAttributes(&attributes, Kernel), "split kernel attributes");
    return int(attributes.sharedSizeBytes);
  }();
  return bytes;
}

// The dynamic shared memory that launches of split_kv_live_kernel<Traits> may take on `device`:
// all that the opt-in limit leaves beside its static shared memory (CUB's scan storage). One size
// per device, whatever the batch, so that threads raising the limit at once raise it alike.
template <class Traits>
int live_smem_limit(int device) {
  return smem_optin_limit(device) - static_smem_bytes<&split_kv_live_kernel<Traits>>();
}

// CTAs of split_kv_live_kernel<Traits> one SM holds at once with smem_bytes of dynamic shared
// memory on `device` (the current one), asked once per device and size (a server's batch size
// rarely changes). Size and count are cached as one word, so that threads asking for two sizes
// at once never pair one's size with the other's count.
template <class Traits>
int live_ctas_per_sm(int device, int smem_bytes) {
  static std::atomic<uint64_t> cached[kMaxDevices];  // (size << 32) | count; zero: not asked
  if (device < kMaxDevices) {
    const uint64_t word = cached[device].load(std::memory_order_relaxed);
    if (word != 0 && int(word >> 32) == smem_bytes) return int(word & 0xffffffffu);
  }
  allow_dynamic_smem<Traits>(true, device, live_smem_limit<Traits>(device));
  int count = 0;
  check_cuda(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&count, &split_kv_live_kernel<Traits>, Traits::kNThreads,
                                                           smem_bytes),
             "split kernel occupancy");
  if (device < kMaxDevices) cached[device].store(uint64_t(uint32_t(smem_bytes)) << 32 | uint32_t(count));
  return count;
}

// Dynamic shared memory of a split_kv_kernel<Traits> CTA that holds a SM of `device` to per_sm
// CTAs (rules::smem_for_ctas_per_sm; 0 when per_sm do not fit).
template <class Traits>
int equal_spread_smem(int device, int per_sm) {
  return rules::smem_for_ctas_per_sm(per_sm, device_attribute<cudaDevAttrMaxSharedMemoryPerMultiprocessor>(device),
                                     device_attribute<cudaDevAttrReservedSharedMemoryPerBlock>(device) +
                                         static_smem_bytes<&split_kv_kernel<Traits>>(),
                                     Traits::kSmemBytes);
}

// The dynamic shared memory that launches of split_kv_kernel<Traits> may take on `device`: its
// own, and where launches are programmatic (sm_90+) the most that equal_residency asks, the size
// that holds a SM to two CTAs. One size per device and kernel, so that threads raising the limit
// at once raise it alike.
template <class Traits>
int equal_smem_limit(int device) {
  if (device_attribute<cudaDevAttrComputeCapabilityMajor>(device) < 9) return Traits::kSmemBytes;
  const int spread = equal_spread_smem<Traits>(device, 2);
  const int allowed = smem_optin_limit(device) - static_smem_bytes<&split_kv_kernel<Traits>>();
  return spread > Traits::kSmemBytes && spread <= allowed ? spread : Traits::kSmemBytes;
}

// CTAs of split_kv_kernel<Traits> that one SM of the current device holds with smem_bytes of
// dynamic shared memory (within equal_smem_limit).
template <class Traits>
int equal_ctas_per_sm(int smem_bytes) {
  int count = 0;
  check_cuda(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&count, &split_kv_kernel<Traits>, Traits::kNThreads,
                                                           smem_bytes),
             "split kernel occupancy");
  return count;
}

// How an equal-length launch of `ctas` CTAs sits on the SMs of `device`, the current one
// (params.h Residency), with the kernel's shared-memory limit raised for it. A programmatic launch on sm_90+ whose grid is one wave that leaves slots
// free takes the shared memory that holds each SM to rules::spread_ctas_per_sm CTAs; every other
// launch, and one whose spread the occupancy calculator does not confirm, takes its own size.
// The occupancy is asked once per device and CTA count a SM.
template <class Traits>
Residency equal_residency(int device, int64_t ctas, bool programmatic) {
  const int limit = equal_smem_limit<Traits>(device);
  allow_dynamic_smem<Traits>(false, device, limit);
  if (!programmatic || limit == Traits::kSmemBytes || device >= kMaxDevices) {
    return Residency{0, Traits::kSmemBytes, 0};
  }
  static int resident[kMaxDevices] = {};
  static int confirmed[kMaxDevices][rules::kMaxCtasPerSm + 1] = {};  // bytes; 0: not asked, -1: refused
  if (resident[device] == 0) resident[device] = equal_ctas_per_sm<Traits>(Traits::kSmemBytes);
  const Residency own{0, Traits::kSmemBytes, resident[device]};
  const int per_sm = rules::spread_ctas_per_sm(ctas, sm_count(device), own.resident_per_sm);
  if (per_sm == 0 || per_sm > rules::kMaxCtasPerSm) return own;
  if (confirmed[device][per_sm] == 0) {
    const int bytes = equal_spread_smem<Traits>(device, per_sm);
    confirmed[device][per_sm] = bytes > 0 && bytes <= limit && equal_ctas_per_sm<Traits>(bytes) == per_sm ? bytes : -1;
  }
  const int bytes = confirmed[device][per_sm];
  return bytes > 0 ? Residency{per_sm, bytes, own.resident_per_sm} : own;
}

// The same for split_kv_kernel<SplitKernelTraits<...>> on the current device.
template <typename Element, int kHeadDim, int kBlockM, int kBlockKV>
Residency equal_launch_residency(int64_t ctas, bool programmatic) {
  int device = 0;
  check_cuda(cudaGetDevice(&device), "cudaGetDevice");
  return equal_residency<SplitKernelTraits<kHeadDim, kBlockM, kBlockKV, Element>>(device, ctas, programmatic);
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
  int device = 0;
  check_cuda(cudaGetDevice(&device), "cudaGetDevice");
  if (live) {
    const int smem = live_smem_bytes<Traits>(p);
    // The schedule grows with the batch; the live kernel's static shared memory (CUB's scan
    // storage) counts against the same limit.
    if (smem > live_smem_limit<Traits>(device)) {
      const int own = Traits::kSmemBytes + static_smem_bytes<&split_kv_live_kernel<Traits>>();
      throw std::invalid_argument("cache_seqlens: a batch of " + std::to_string(p.batch) + " sequences needs " +
                                  std::to_string(rules::live_schedule_bytes(p.batch, p.plan_choices)) +
                                  " bytes of shared memory for its schedule beside the kernel's " +
                                  std::to_string(own) + "; this device allows " +
                                  std::to_string(smem_optin_limit(device)) + " in all");
    }
    allow_dynamic_smem<Traits>(true, device, live_smem_limit<Traits>(device));
    const dim3 grid(unsigned(live_grid_on<Traits>(p, device)));
    launch_kernel<&split_kv_live_kernel<Traits>>(p, grid, dim3(Traits::kNThreads), smem, stream, programmatic,
                                                 "split kernel launch");
  } else {
    const dim3 grid(p.num_m_blocks, p.batch * p.kv_heads, p.num_splits);
    const int64_t ctas = int64_t(grid.x) * grid.y * grid.z;
    const Residency residency = equal_residency<Traits>(device, ctas, programmatic);
    launch_kernel<&split_kv_kernel<Traits>>(p, grid, dim3(Traits::kNThreads), residency.smem_bytes, stream,
                                            programmatic, "split kernel launch");
  }
}

template <typename Element, int kHeadDim, int kBlockM, int kBlockKV>
constexpr int split_smem_bytes() {
  return SplitKernelTraits<kHeadDim, kBlockM, kBlockKV, Element>::kSmemBytes;
}

}  // namespace splitkv
