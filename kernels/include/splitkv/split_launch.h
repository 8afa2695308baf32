// Launch template of the split kernel; one explicit instantiation per generated .cu file.
#pragma once

#include "splitkv/launch_utils.h"
#include "splitkv/split_kernel.h"

namespace splitkv {

// Sets the kernel's per-device attributes (shared-memory limit, clusters of up to 16 CTAs) once.
template <class Traits>
void configure_split_kernel() {
  static bool configured[kMaxDevices] = {};
  int device = 0;
  check_cuda(cudaGetDevice(&device), "cudaGetDevice");
  if (device < kMaxDevices && configured[device]) return;
  auto kernel = &split_kv_kernel<Traits>;
  if (Traits::kSmemBytes > 48 * 1024) {
    check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Traits::kSmemBytes),
               "split kernel shared-memory limit");
  }
  if (device_major() >= 9) {
    check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1),
               "split kernel cluster size");
  }
  if (device < kMaxDevices) configured[device] = true;
}

template <class Traits>
cudaLaunchConfig_t split_launch_config(const SplitParams& p, cudaStream_t stream, cudaLaunchAttribute* cluster) {
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(p.num_m_blocks, p.batch * p.kv_heads, p.num_splits);
  config.blockDim = dim3(Traits::kNThreads);
  config.dynamicSmemBytes = Traits::kSmemBytes;
  config.stream = stream;
  cluster->id = cudaLaunchAttributeClusterDimension;
  cluster->val.clusterDim.x = 1;
  cluster->val.clusterDim.y = 1;
  cluster->val.clusterDim.z = p.num_splits;
  config.attrs = cluster;
  config.numAttrs = p.cluster_merge ? 1 : 0;
  return config;
}

template <typename Element, int kHeadDim, int kBlockM, int kBlockKV>
void run_split_kernel(const SplitParams& p, cudaStream_t stream) {
  using Traits = SplitKernelTraits<kHeadDim, kBlockM, kBlockKV, Element>;
  configure_split_kernel<Traits>();
  cudaLaunchAttribute cluster;
  const cudaLaunchConfig_t config = split_launch_config<Traits>(p, stream, &cluster);
  check_cuda(cudaLaunchKernelEx(&config, split_kv_kernel<Traits>, p), "split kernel launch");
}

// Whether clusters of `num_splits` split CTAs can be resident on the current device.
template <typename Element, int kHeadDim, int kBlockM, int kBlockKV>
bool split_cluster_fits(int num_splits) {
  using Traits = SplitKernelTraits<kHeadDim, kBlockM, kBlockKV, Element>;
  if (device_major() < 9 || num_splits < 2 || num_splits > kMaxClusterSplits) return false;
  configure_split_kernel<Traits>();
  SplitParams p{};
  p.num_m_blocks = 1;
  p.batch = 1;
  p.kv_heads = 1;
  p.num_splits = num_splits;
  p.cluster_merge = true;
  cudaLaunchAttribute cluster;
  const cudaLaunchConfig_t config = split_launch_config<Traits>(p, nullptr, &cluster);
  int clusters = 0;
  check_cuda(cudaOccupancyMaxActiveClusters(&clusters, split_kv_kernel<Traits>, &config), "cluster occupancy");
  return clusters > 0;
}

template <typename Element, int kHeadDim, int kBlockM, int kBlockKV>
constexpr int split_smem_bytes() {
  return SplitKernelTraits<kHeadDim, kBlockM, kBlockKV, Element>::kSmemBytes;
}

}  // namespace splitkv
