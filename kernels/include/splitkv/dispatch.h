// Run-time values -> the compile-time instantiation that serves them. No CuTe, no torch:
// the binding includes only this header.
#pragma once

#include <cuda_runtime_api.h>

#include "splitkv/params.h"

namespace splitkv {

// Throws std::invalid_argument when no instantiation matches, std::runtime_error on CUDA errors.
// `programmatic`: programmatic dependent launch on sm_90+ (dependent_launch.h).
void run_split(const SplitParams& p, DType dtype, int head_dim, int block_m, int block_kv, cudaStream_t stream,
               bool programmatic);
void run_combine(const CombineParams& p, DType dtype, int head_dim, int threads, cudaStream_t stream,
                 bool programmatic);
// CTAs of the paged / variable-length launch of p (batch, kv_heads, packed_rows, num_splits) on
// the current device.
int live_grid_ctas(const SplitParams& p, DType dtype, int head_dim, int block_m, int block_kv);
// How an equal-length launch of `ctas` CTAs of that instantiation sits on the SMs of the current
// device (split_launch.h equal_residency).
Residency equal_launch_residency(DType dtype, int head_dim, int block_m, int block_kv, int64_t ctas,
                                 bool programmatic);
// Shared memory of one split-kernel CTA; -1 when that combination is not instantiated.
int split_smem_bytes(DType dtype, int head_dim, int block_m, int block_kv);

}  // namespace splitkv
