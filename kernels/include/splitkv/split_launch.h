// Launch template of the split kernel; one explicit instantiation per generated .cu file.
#pragma once

#include "splitkv/launch_utils.h"
#include "splitkv/split_kernel.h"

namespace splitkv {

template <typename Element, int kHeadDim, int kBlockM, int kBlockKV>
void run_split_kernel(const SplitParams& p, cudaStream_t stream, bool programmatic) {
  using Traits = SplitKernelTraits<kHeadDim, kBlockM, kBlockKV, Element>;
  constexpr int kSmem = Traits::kSmemBytes;
  auto kernel = &split_kv_kernel<Traits>;
  if (kSmem > 48 * 1024) {
    // The attribute belongs to the current device's context: set it once per device.
    static bool configured[kMaxDevices] = {};
    int device = 0;
    check_cuda(cudaGetDevice(&device), "cudaGetDevice");
    if (device >= kMaxDevices || !configured[device]) {
      check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem),
                 "split kernel shared-memory limit");
      if (device < kMaxDevices) configured[device] = true;
    }
  }
  const dim3 grid(p.num_m_blocks, p.batch * p.kv_heads, p.num_splits);
  launch_kernel(kernel, p, grid, dim3(Traits::kNThreads), kSmem, stream, programmatic, "split kernel launch");
}

template <typename Element, int kHeadDim, int kBlockM, int kBlockKV>
constexpr int split_smem_bytes() {
  return SplitKernelTraits<kHeadDim, kBlockM, kBlockKV, Element>::kSmemBytes;
}

}  // namespace splitkv
