// Fused merge: the last split CTA of a query tile to finish merges the tile's S partials
// (params.h), so no combine kernel is launched and the merge starts as soon as the tile's
// last partial is written rather than when the whole grid has drained.
#pragma once

#include <cute/tensor.hpp>

#include "splitkv/block_range.h"
#include "splitkv/merge_state.h"
#include "splitkv/params.h"

namespace splitkv {

// Called by every thread of a split CTA after it wrote its partial to the workspace.
template <class Traits>
CUTE_DEVICE void merge_if_last_split(const SplitParams& p, const SplitCta& cta) {
  using Element = typename Traits::Element;
  constexpr int kLanes = kLanesPerRow<Traits::kHeadDim>;  // items per row, one per lane (merge_state.h)
  __syncthreads();  // the whole CTA's partial is written
  int is_last = 0;
  if (threadIdx.x == 0) {
    // One release-acquire wrapping increment by one thread (cumulative over the barrier above)
    // publishes this CTA's partial and, in the last CTA, makes the other splits' partials
    // visible to the CTA. It counts 0, 1, ..., num_splits - 1 and wraps back to 0 in the last
    // CTA, so the counter is zero again after every launch without a store or a fill kernel
    // (TensorRT-LLM XQA's semaphores work the same way).
    unsigned* counter = reinterpret_cast<unsigned*>(
        p.tile_counters + (int64_t(cta.b) * p.kv_heads + cta.h_kv) * p.num_m_blocks + cta.m_block);
    unsigned before;
    asm volatile("atom.acq_rel.gpu.global.inc.u32 %0, [%1], %2;"
                 : "=r"(before)
                 : "l"(counter), "r"(unsigned(cta.num_splits - 1))
                 : "memory");
    is_last = before == unsigned(cta.num_splits - 1);
  }
  if (!__syncthreads_or(is_last)) return;

  const int rows = min(Traits::kBlockM, p.packed_rows - cta.row0);
  const int64_t split_stride = int64_t(p.batch) * p.kv_heads * p.packed_rows;
  const int64_t tile_row0 = (int64_t(cta.b) * p.kv_heads + cta.h_kv) * p.packed_rows + cta.row0;
  // Whole warps fold (fold_partials shuffles across the warp); lanes past the last item fold
  // row 0 again and store nothing.
  const int items = rows * kLanes;
  for (int item = threadIdx.x; item < (items + 31) / 32 * 32; item += Traits::kNThreads) {
    const int r = item < items ? item / kLanes : 0;
    const int lane = item % kLanes;
    const auto state = fold_partials<Traits::kHeadDim>(p.ws_o, p.ws_m, p.ws_l, cta.num_splits, cta.num_splits,
                                                       split_stride, tile_row0 + r, lane);
    if (item >= items) continue;
    const int row = cta.row0 + r;
    store_merged<Element>(state, p.out, p.lse, p.o_batch_stride, p.o_row_stride, p.o_head_stride, p.q_heads,
                          p.q_len, cta.b, cta.h_kv * p.group + row % p.group, row / p.group, lane);
  }
}

}  // namespace splitkv
