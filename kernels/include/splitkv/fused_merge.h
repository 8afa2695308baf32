// Fused merge: one split CTA of each query tile merges the tile's S partials (params.h), so
// no combine kernel is launched. The merging CTA is the last of the tile to start: it counts
// itself in before its main loop, so the count's round trip hides behind the loop, and at the
// end it waits only for the other splits' "published" flags. A CTA that has counted itself in
// is running and finishes without waiting on anyone, so the wait always ends.
#pragma once

#include <cuda/atomic>

#include <cute/tensor.hpp>

#include "splitkv/merge_state.h"
#include "splitkv/params.h"
#include "splitkv/split_rows.h"

namespace splitkv {

using DeviceAtomic = cuda::atomic_ref<int, cuda::thread_scope_device>;

// The tile's slots in tile_counters: [0] CTAs started, [1 + s] split s's partial is published.
CUTE_DEVICE int* tile_slots(const SplitParams& p, const SplitCta& cta) {
  const int64_t tile = (int64_t(cta.b) * p.kv_heads + cta.h_kv) * p.num_m_blocks + cta.m_block;
  return p.tile_counters + tile * (p.num_splits + 1);
}

// Thread 0 counts the CTA in; returns how many of the tile's CTAs started before it (0 in the
// other threads). Relaxed: the count orders nothing, the flags below do.
CUTE_DEVICE int count_in(int* slots) {
  return threadIdx.x == 0 ? DeviceAtomic(slots[0]).fetch_add(1, cuda::memory_order_relaxed) : 0;
}

// Called by every thread of a split CTA after it wrote its partial to the workspace.
template <class Traits>
CUTE_DEVICE void merge_if_last_split(const SplitParams& p, const SplitCta& cta, int* slots, int started_before) {
  using Element = typename Traits::Element;
  constexpr int kVecs = Traits::kHeadDim / 4;  // float4 items per row
  // The barrier also puts the whole CTA's partial before thread 0's release store (cumulativity).
  const bool merges = __syncthreads_or(threadIdx.x == 0 && started_before == p.num_splits - 1);
  if (!merges) {
    if (threadIdx.x == 0) DeviceAtomic(slots[1 + cta.split]).store(1, cuda::memory_order_release);
    return;
  }
  // Wait for the other partials, and leave every slot zero for the next launch (all S CTAs
  // have counted in and each flag is set once, so nothing writes them after this).
  for (int s = threadIdx.x; s < p.num_splits; s += Traits::kNThreads) {
    if (s == cta.split) continue;
    DeviceAtomic published(slots[1 + s]);
    while (published.load(cuda::memory_order_acquire) == 0) {
    }
    published.store(0, cuda::memory_order_relaxed);
  }
  if (threadIdx.x == 0) DeviceAtomic(slots[0]).store(0, cuda::memory_order_relaxed);
  __syncthreads();  // the acquires above, made visible to the whole CTA

  const int rows = min(Traits::kBlockM, p.packed_rows - cta.row0);
  const int64_t split_stride = int64_t(p.batch) * p.kv_heads * p.packed_rows;
  const int64_t tile_row0 = (int64_t(cta.b) * p.kv_heads + cta.h_kv) * p.packed_rows + cta.row0;
  for (int item = threadIdx.x; item < rows * kVecs; item += Traits::kNThreads) {
    const int r = item / kVecs;
    const int col = (item % kVecs) * 4;
    const MergeState state = fold_partials<Traits::kHeadDim>(p.ws_o, p.ws_m, p.ws_l, p.num_splits, split_stride,
                                                             tile_row0 + r, col);
    const int row = cta.row0 + r;
    store_merged<Element>(state, p.out, p.lse, p.o_batch_stride, p.o_row_stride, p.o_head_stride, p.q_heads,
                          p.q_len, cta.b, cta.h_kv * p.group + row % p.group, row / p.group, col);
  }
}

}  // namespace splitkv
