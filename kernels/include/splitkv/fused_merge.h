// Fused merge: the last split CTA of a query tile to finish merges the tile's S partials
// (params.h), so no combine kernel is launched and the merge starts as soon as the tile's
// last partial is written rather than when the whole grid has drained.
#pragma once

#include <cuda/atomic>

#include <cute/tensor.hpp>

#include "splitkv/merge_state.h"
#include "splitkv/params.h"
#include "splitkv/utils.h"

namespace splitkv {

// Called by every thread of a split CTA after it wrote its partial to the workspace. Not inlined:
// its own register allocation keeps it from raising the main loop's.
template <class Traits>
__device__ __noinline__ void merge_if_last_split(const SplitParams& p, char* smem, int m_block, int row0, int b, int h_kv) {
  using Element = typename Traits::Element;
  constexpr int kVecs = Traits::kHeadDim / 4;  // float4 items per row
  __syncthreads();  // the whole CTA's partial is written
  int is_last = 0;
  if (threadIdx.x == 0) {
    // One release-acquire add by one thread (cumulative over the barrier above) publishes this
    // CTA's partial and, in the last CTA, makes the other splits' partials visible to the CTA.
    cuda::atomic_ref<int, cuda::thread_scope_device> counter(
        p.tile_counters[(int64_t(b) * p.kv_heads + h_kv) * p.num_m_blocks + m_block]);
    is_last = counter.fetch_add(1, cuda::memory_order_acq_rel) == p.num_splits - 1;
    if (is_last) counter.store(0, cuda::memory_order_relaxed);  // leave it zeroed for the next launch
  }
  if (!__syncthreads_or(is_last)) return;

  // The merge runs once per launch, cold in the instruction cache, so it is short rolled loops:
  // per group of rows (one float4 column per thread), chunks of splits staged in the main
  // loop's shared memory with one round trip each, then folded from there.
  constexpr int kHeadDim = Traits::kHeadDim;
  constexpr int kGroupRows = Traits::kNThreads / kVecs;
  static_assert(Traits::kNThreads % kVecs == 0 && kGroupRows * (kHeadDim + 2) * 4 <= Traits::kSmemBytes,
                "a row group's partial of one split fits in shared memory");
  const int rows = min(Traits::kBlockM, p.packed_rows - row0);
  const int64_t split_stride = int64_t(p.batch) * p.kv_heads * p.packed_rows;
  const int64_t tile_row0 = (int64_t(b) * p.kv_heads + h_kv) * p.packed_rows + row0;
#pragma unroll 1
  for (int g0 = 0; g0 < rows; g0 += kGroupRows) {
    const int group_rows = min(kGroupRows, rows - g0);
    const int chunk = min(p.num_splits, min(Traits::kNThreads / group_rows,
                                            Traits::kSmemBytes / (group_rows * (kHeadDim + 2) * 4)));
    float* sO = reinterpret_cast<float*>(smem);  // (chunk, group_rows, kHeadDim)
    float* sM = sO + chunk * group_rows * kHeadDim;  // (chunk, group_rows)
    float* sL = sM + chunk * group_rows;             // (chunk, group_rows)
    const int r = threadIdx.x / kVecs;               // this thread's row in the group, column
    const int col = threadIdx.x % kVecs * 4;
    MergeState state;
#pragma unroll 1
    for (int s0 = 0; s0 < p.num_splits; s0 += chunk) {
      const int n = min(chunk, p.num_splits - s0);
      for (int i = threadIdx.x; i < n * group_rows * kVecs; i += Traits::kNThreads) {
        const int s = i / (group_rows * kVecs);
        const int64_t ws_row = (s0 + s) * split_stride + tile_row0 + g0 + i / kVecs % group_rows;
        SM80_CP_ASYNC_CACHEGLOBAL<uint128_t>::copy(
            *reinterpret_cast<const uint128_t*>(p.ws_o + ws_row * kHeadDim + i % kVecs * 4),
            *reinterpret_cast<uint128_t*>(sO + i * 4));
      }
      cp_async_fence();
      if (threadIdx.x < n * group_rows) {  // through L2: other SMs wrote these during this launch
        const int64_t ws_row = (s0 + threadIdx.x / group_rows) * split_stride + tile_row0 + g0 + threadIdx.x % group_rows;
        const float m = __ldcg(p.ws_m + ws_row), l = __ldcg(p.ws_l + ws_row);
        sM[threadIdx.x] = l > 0.f ? m : -INFINITY;  // so an empty split never raises the max
        sL[threadIdx.x] = l;
      }
      cp_async_wait<0>();
      __syncthreads();
      if (r < group_rows) {
        // The chunk's max first, so each split's term is independent of the others.
        float chunk_max = state.m;
#pragma unroll 4
        for (int s = 0; s < n; ++s) chunk_max = fmaxf(chunk_max, sM[s * group_rows + r]);
        state.raise_max(chunk_max);
#pragma unroll 4
        for (int s = 0; s < n; ++s) {
          state.add(sM[s * group_rows + r], sL[s * group_rows + r],
                    *reinterpret_cast<const float4*>(sO + (s * group_rows + r) * kHeadDim + col));
        }
      }
      __syncthreads();  // the next chunk overwrites this one
    }
    if (r < group_rows) {
      const int row = row0 + g0 + r;
      store_merged<Element>(state, p.out, p.lse, p.o_batch_stride, p.o_row_stride, p.o_head_stride, p.q_heads,
                            p.q_len, b, h_kv * p.group + row % p.group, row / p.group, col);
    }
  }
}

}  // namespace splitkv
