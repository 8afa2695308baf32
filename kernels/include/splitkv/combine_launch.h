// Launch template of the combine kernel; instantiated in the generated combine_*.cu files.
#pragma once

#include "splitkv/combine_kernel.h"
#include "splitkv/launch_utils.h"

namespace splitkv {

template <typename Element, int kHeadDim, int kThreads>
void run_combine_kernel(const CombineParams& p, cudaStream_t stream, bool programmatic) {
  using Traits = CombineKernelTraits<kHeadDim, kThreads, Element>;
  const int64_t blocks = (p.total_rows + Traits::kRowsPerBlock - 1) / Traits::kRowsPerBlock;
  launch_kernel<&combine_kernel<Traits>>(p, dim3(unsigned(blocks)), dim3(Traits::kThreads), 0, stream, programmatic,
                                         "combine kernel launch");
}

}  // namespace splitkv
