// In-cluster merge (sm_90): the S split CTAs of one (query tile, batch x KV head) run as one
// thread-block cluster along z. Each leaves its partial (params.h's contract) in its own shared
// memory; then every CTA merges a 1/S share of the tile's (row, 4-column) items by reading all
// S partials through distributed shared memory, and writes the final O and lse. This replaces
// the combine kernel's launch and its round trip through the workspace.
#pragma once

#include <cooperative_groups.h>
#include <cute/tensor.hpp>

#include "splitkv/kernel_traits.h"
#include "splitkv/merge_state.h"
#include "splitkv/params.h"

namespace splitkv {

// Where one CTA's partial lives inside its shared memory (Traits::kMergeBytes from `base`).
template <class Traits>
struct ClusterPartial {
  float* base;
  CUTE_DEVICE float* o(int row) const { return base + row * Traits::kMergeRowStride; }  // [kHeadDim]
  CUTE_DEVICE float* m() const { return base + Traits::kBlockM * Traits::kMergeRowStride; }  // [kBlockM]
  CUTE_DEVICE float* l() const { return m() + Traits::kBlockM; }                           // [kBlockM]
};

// Called by every thread of every CTA of the cluster once its partial is in shared memory.
template <class Traits>
CUTE_DEVICE void cluster_merge(const SplitParams& p, ClusterPartial<Traits> own, int row0, int b, int h_kv) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using Element = typename Traits::Element;
  constexpr int kVecs = Traits::kHeadDim / 4;  // float4 items per row
  constexpr int kMaxS = kMaxClusterSplits;
  namespace cg = cooperative_groups;
  cg::cluster_group cluster = cg::this_cluster();
  cluster.sync();  // release/acquire: every partial of the cluster is visible

  const int splits = p.num_splits;
  const int rows = min(Traits::kBlockM, p.packed_rows - row0);
  ClusterPartial<Traits> peer[kMaxS];
  CUTE_UNROLL
  for (int s = 0; s < kMaxS; ++s) peer[s].base = s < splits ? cluster.map_shared_rank(own.base, s) : own.base;

  const int first = int(cluster.block_rank()) * Traits::kNThreads + threadIdx.x;
  for (int item = first; item < rows * kVecs; item += splits * Traits::kNThreads) {
    const int r = item / kVecs;
    const int col = (item % kVecs) * 4;
    // All loads first, so the S remote reads are in flight together.
    float m_s[kMaxS], l_s[kMaxS];
    float4 o_s[kMaxS];
    CUTE_UNROLL
    for (int s = 0; s < kMaxS; ++s) {
      const bool in_range = s < splits;
      m_s[s] = in_range ? peer[s].m()[r] : -INFINITY;
      l_s[s] = in_range ? peer[s].l()[r] : 0.f;
      o_s[s] = in_range ? *reinterpret_cast<const float4*>(peer[s].o(r) + col) : make_float4(0.f, 0.f, 0.f, 0.f);
    }
    MergeState state;
    CUTE_UNROLL
    for (int s = 0; s < kMaxS; ++s) state.merge(m_s[s], l_s[s], o_s[s]);

    const int row = row0 + r;
    const int q_idx = row / p.group;
    const int h_q = h_kv * p.group + row % p.group;
    Element* out = static_cast<Element*>(p.out) + b * p.o_batch_stride + q_idx * p.o_row_stride +
                   h_q * p.o_head_stride + col;
    store4(out, state.normalized());
    if (p.lse != nullptr && col == 0) p.lse[(int64_t(b) * p.q_heads + h_q) * p.q_len + q_idx] = state.lse();
  }
  cluster.sync();  // no CTA leaves while a peer still reads its shared memory
#endif
}

}  // namespace splitkv
