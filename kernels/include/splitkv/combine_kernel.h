// Combine kernel: merges the S partials of each (batch, query head, query row) with the
// formula of params.h; kThreadsPerRow threads own one row (merge_state.h's column layout).
#pragma once

#include <cute/tensor.hpp>

#include "splitkv/dependent_launch.h"
#include "splitkv/kernel_traits.h"
#include "splitkv/merge_state.h"
#include "splitkv/params.h"

namespace splitkv {

template <class Traits>
__global__ void __launch_bounds__(Traits::kThreads) combine_kernel(const __grid_constant__ CombineParams p) {
  using Element = typename Traits::Element;
  constexpr int kLanes = Traits::kThreadsPerRow;
  constexpr int kRows = Traits::kRowsPerBlock;

  // Launched programmatically after the split kernel: wait until its partials are visible.
  wait_for_previous_grid();
  allow_dependent_launch();
  const int lane = threadIdx.x % kLanes;
  const int64_t row = int64_t(blockIdx.x) * kRows + threadIdx.x / kLanes;  // over (B, Hkv, packed rows)
  const int64_t folded = min(row, p.total_rows - 1);
  const int64_t bh = folded / p.packed_rows;
  // The row's partials. With live lengths a sequence has its own count, and one with a single
  // split has its output from the split kernel already: none to fold.
  int row_splits = p.num_splits;
  if (p.seqlens != nullptr) {
    const int b = int(bh / p.kv_heads);
    const int min_blocks = p.plan_choices > 1 ? *p.ws_plan : p.min_blocks_per_split;
    row_splits = rules::live_splits(__ldg(p.seqlens + b), p.block_kv, min_blocks, p.num_splits);
    if (row_splits == 1) row_splits = 0;
  }
  // Every lane folds (fold_partials shuffles across the warp) as many rounds as the warp's
  // longest row needs; lanes past the last row fold the last row again and store nothing.
  const int warp_splits = __reduce_max_sync(0xffffffff, row_splits);
  const auto state = fold_partials<Traits::kHeadDim>(p.ws_o, p.ws_m, p.ws_l, warp_splits, row_splits, p.total_rows,
                                                     folded, lane);
  if (row >= p.total_rows || row_splits == 0) return;

  const int r = int(row % p.packed_rows);
  const int h_q = int(bh % p.kv_heads) * p.group + r % p.group;
  store_merged<Element>(state, p.out, p.lse, p.o_batch_stride, p.o_row_stride, p.o_head_stride,
                        p.kv_heads * p.group, p.q_len, int(bh / p.kv_heads), h_q, r / p.group, lane);
}

}  // namespace splitkv
