// Launch template of the combine kernel; instantiated in the generated combine_*.cu files.
#pragma once

#include "splitkv/combine_kernel.h"
#include "splitkv/launch_utils.h"

namespace splitkv {

template <typename Element, int kHeadDim, int kThreads>
void run_combine_kernel(const CombineParams& p, cudaStream_t stream) {
  using Traits = CombineKernelTraits<kHeadDim, kThreads, Element>;
  const int64_t blocks = (p.total_rows + Traits::kRowsPerBlock - 1) / Traits::kRowsPerBlock;
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(unsigned(blocks));
  config.blockDim = dim3(Traits::kThreads);
  config.stream = stream;
  // Programmatic dependent launch (sm_90+): the launch overlaps the split kernel's tail.
  cudaLaunchAttribute pdl[1];
  pdl[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  pdl[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = pdl;
  config.numAttrs = device_major() >= 9 ? 1 : 0;
  check_cuda(cudaLaunchKernelEx(&config, combine_kernel<Traits>, p), "combine kernel launch");
}

}  // namespace splitkv
