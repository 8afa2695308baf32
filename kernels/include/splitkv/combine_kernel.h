// Combine kernel: merges the S partials of each (batch, query head, query row) with the
// formula of params.h; kThreadsPerRow threads own one row, one float4 of O each.
#pragma once

#include <cute/tensor.hpp>

#include "splitkv/kernel_traits.h"
#include "splitkv/merge_state.h"
#include "splitkv/params.h"

namespace splitkv {

template <class Traits>
__global__ void __launch_bounds__(Traits::kThreads) combine_kernel(const __grid_constant__ CombineParams p) {
  using Element = typename Traits::Element;
  constexpr int kHeadDim = Traits::kHeadDim;
  constexpr int kLanes = Traits::kThreadsPerRow;
  constexpr int kRows = Traits::kRowsPerBlock;
  constexpr int kBatch = Traits::kSplitsPerBatch;

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // Launched programmatically after the split kernel: wait until its partials are visible.
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
  const int lane = threadIdx.x % kLanes;
  const int64_t row = int64_t(blockIdx.x) * kRows + threadIdx.x / kLanes;  // over (B, Hkv, packed rows)
  if (row >= p.total_rows) return;
  const int64_t split_stride = p.total_rows;

  // Every lane of a row tracks the row's m and l itself, so no lane waits on another and
  // each batch of splits is one round of independent loads.
  MergeState state;
  const float* o_part = p.ws_o + row * kHeadDim + lane * 4;
  for (int s0 = 0; s0 < p.num_splits; s0 += kBatch) {
    float m_s[kBatch], l_s[kBatch];
    float4 o_s[kBatch];
    CUTE_UNROLL
    for (int u = 0; u < kBatch; ++u) {
      const int64_t s = s0 + u;
      const bool in_range = s < p.num_splits;
      m_s[u] = in_range ? p.ws_m[s * split_stride + row] : -INFINITY;
      l_s[u] = in_range ? p.ws_l[s * split_stride + row] : 0.f;
      o_s[u] = in_range ? *reinterpret_cast<const float4*>(o_part + s * split_stride * kHeadDim)
                        : make_float4(0.f, 0.f, 0.f, 0.f);
    }
    CUTE_UNROLL
    for (int u = 0; u < kBatch; ++u) state.merge(m_s[u], l_s[u], o_s[u]);
  }

  const int64_t bh = row / p.packed_rows;
  const int r = int(row % p.packed_rows);
  const int b = int(bh / p.kv_heads);
  const int h_q = int(bh % p.kv_heads) * p.group + r % p.group;
  const int q_idx = r / p.group;
  Element* out = static_cast<Element*>(p.out) + b * p.o_batch_stride + q_idx * p.o_row_stride +
                 h_q * p.o_head_stride + lane * 4;
  store4(out, state.normalized());
  if (p.lse != nullptr && lane == 0) {
    p.lse[(int64_t(b) * p.kv_heads * p.group + h_q) * p.q_len + q_idx] = state.lse();
  }
}

}  // namespace splitkv
