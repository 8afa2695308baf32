// Combine kernel: merges the S partials of each (batch, query head, query row) with the
// formula of params.h; kThreadsPerRow threads own one row, one float4 of O each.
#pragma once

#include <cute/tensor.hpp>

#include "splitkv/kernel_traits.h"
#include "splitkv/params.h"
#include "splitkv/utils.h"

namespace splitkv {

template <class Traits>
__global__ void __launch_bounds__(Traits::kThreads) combine_kernel(const __grid_constant__ CombineParams p) {
  using Element = typename Traits::Element;
  constexpr int kHeadDim = Traits::kHeadDim;
  constexpr int kLanes = Traits::kThreadsPerRow;
  constexpr int kRows = Traits::kRowsPerBlock;
  constexpr int kUnroll = 8;  // partial rows in flight per thread
  __shared__ float s_weight[kRows][kMaxSplits];  // exp(m_s - m) per split, 0 where l_s == 0

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // Launched programmatically after the split kernel: wait until its partials are visible.
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
  const int local_row = threadIdx.x / kLanes;
  const int lane = threadIdx.x % kLanes;
  const int64_t row = int64_t(blockIdx.x) * kRows + local_row;  // over (B, Hkv, packed rows)
  const bool valid = row < p.total_rows;
  const int64_t split_stride = p.total_rows;

  float m_max = -INFINITY;
  if (valid) {
    for (int s = lane; s < p.num_splits; s += kLanes) {
      if (p.ws_l[s * split_stride + row] > 0.f) m_max = fmaxf(m_max, p.ws_m[s * split_stride + row]);
    }
  }
  m_max = lane_group_reduce<kLanes, true>(m_max);
  float l_total = 0.f;
  if (valid) {
    for (int s = lane; s < p.num_splits; s += kLanes) {
      const float l = p.ws_l[s * split_stride + row];
      const float w = l > 0.f ? expf(p.ws_m[s * split_stride + row] - m_max) : 0.f;
      s_weight[local_row][s] = w;
      l_total += w * l;
    }
  }
  l_total = lane_group_reduce<kLanes, false>(l_total);
  const float inv = l_total > 0.f ? 1.f / l_total : 0.f;
  __syncwarp();
  if (!valid) return;

  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  const float* o_part = p.ws_o + row * kHeadDim + lane * 4;
  for (int s0 = 0; s0 < p.num_splits; s0 += kUnroll) {
    float w[kUnroll];
    float4 o[kUnroll];
    CUTE_UNROLL
    for (int u = 0; u < kUnroll; ++u) {
      const int s = s0 + u;
      w[u] = s < p.num_splits ? s_weight[local_row][s] : 0.f;
      o[u] = w[u] != 0.f ? *reinterpret_cast<const float4*>(o_part + s * split_stride * kHeadDim)
                         : make_float4(0.f, 0.f, 0.f, 0.f);
    }
    CUTE_UNROLL
    for (int u = 0; u < kUnroll; ++u) {
      acc.x += w[u] * o[u].x;
      acc.y += w[u] * o[u].y;
      acc.z += w[u] * o[u].z;
      acc.w += w[u] * o[u].w;
    }
  }

  const int64_t bh = row / p.packed_rows;
  const int r = int(row % p.packed_rows);
  const int b = int(bh / p.kv_heads);
  const int h_q = int(bh % p.kv_heads) * p.group + r % p.group;
  const int q_idx = r / p.group;
  Element* out = static_cast<Element*>(p.out) + b * p.o_batch_stride + q_idx * p.o_row_stride +
                 h_q * p.o_head_stride + lane * 4;
  Element packed[4] = {Element(acc.x * inv), Element(acc.y * inv), Element(acc.z * inv), Element(acc.w * inv)};
  *reinterpret_cast<uint2*>(out) = *reinterpret_cast<uint2*>(packed);
  if (p.lse != nullptr && lane == 0) {
    p.lse[(int64_t(b) * p.kv_heads * p.group + h_q) * p.q_len + q_idx] =
        l_total > 0.f ? m_max + logf(l_total) : -INFINITY;
  }
}

}  // namespace splitkv
