// Split kernels: a CTA streams the key range of one (query tile, batch x KV head, split)
// through a cp.async pipeline, keeps the online-softmax state and writes the partials of
// params.h's contract to the workspace (merging them itself in the last CTA of the tile when
// the merge is fused), or, with one split, writes the final output. An equal-length launch has
// one CTA per such item (split_kv_kernel); a paged / variable-length launch is persistent and
// its CTAs take items one after another (split_kv_live_kernel, tile_scheduler.h).
#pragma once

#include <cute/tensor.hpp>

#include "splitkv/block_range.h"
#include "splitkv/decode_mainloop.h"
#include "splitkv/dependent_launch.h"
#include "splitkv/fused_merge.h"
#include "splitkv/kernel_traits.h"
#include "splitkv/params.h"
#include "splitkv/tile_mainloop.h"
#include "splitkv/tile_scheduler.h"

namespace splitkv {

// The fused merge when this split is its tile's last.
template <class Traits>
CUTE_DEVICE void merge_if_last(const SplitParams& p, const SplitCta& cta) {
  if (cta.num_splits > 1 && p.tile_counters != nullptr) merge_if_last_split<Traits>(p, cta);
}

// One work item: the main loop, then the fused merge.
template <class Traits>
CUTE_DEVICE void run_split_item(const SplitParams& p, char* smem, const SplitCta& cta) {
  if constexpr (Traits::kWarpsOwnKeys) {
    decode_prologue<Traits>(p, smem, cta);
    decode_mainloop<Traits>(p, smem, cta, smem, [] {});
  } else {
    tile_mainloop<Traits>(p, smem, cta);
  }
  merge_if_last<Traits>(p, cta);
}

template <class Traits>
__global__ void __launch_bounds__(Traits::kNThreads) split_kv_kernel(const __grid_constant__ SplitParams p) {
  extern __shared__ __align__(128) char smem[];
  // Everything up to the wait reads only the parameters: under programmatic launch it overlaps
  // the previous kernel's tail. Q, K, V, the workspace and the counters come after the wait.
  const SplitCta cta = grid_cta<Traits::kBlockM, Traits::kBlockKV>(p);
  wait_for_previous_grid();
  allow_dependent_launch();
  run_split_item<Traits>(p, smem, cta);
}

// Its own kernel rather than a loop in split_kv_kernel: a main loop inside an item loop takes
// up to 70 more registers (ptxas holds values across the outer loop), and the equal-length
// launch, one item per CTA, keeps its registers.
//
// With decode tiles the next item's prologue (its first K/V tiles and its Q) is issued as soon
// as the current item's keys are read, before the current item's merge and store: without it
// every item paid its epilogue, the scheduler's round trip and the first tiles' memory latency
// one after another with nothing in flight, about 2.4 us per item on the H200 (a 16 x 8K batch
// took 141 us in 4 items per CTA against 130 us in 1, docs/PERFORMANCE.md).
template <class Traits>
__global__ void __launch_bounds__(Traits::kNThreads) split_kv_live_kernel(const __grid_constant__ SplitParams p) {
  extern __shared__ __align__(128) char smem[];
  // The lengths, the block table and everything else in memory come after the wait.
  wait_for_previous_grid();
  allow_dependent_launch();
  LiveScheduler<Traits> scheduler(p, smem + Traits::kLiveSmemBytes);
  SplitCta cta;
  bool more = scheduler.template first<Traits::kBlockM, Traits::kBlockKV>(p, cta);
  if constexpr (Traits::kWarpsOwnKeys) {
    // The warps merge in their own shared memory, after the K/V stages: the stages already
    // hold the next item's first tiles by then.
    char* merge_smem = smem + Traits::kSmemBytes;
    if (more) decode_prologue<Traits>(p, smem, cta);
    while (more) {
      SplitCta next_cta;
      bool has_next = false;
      decode_mainloop<Traits>(p, smem, cta, merge_smem, [&] {
        has_next = scheduler.template next<Traits::kBlockM, Traits::kBlockKV>(p, next_cta);
        if (has_next) decode_prologue<Traits>(p, smem, next_cta);
      });
      merge_if_last<Traits>(p, cta);
      cta = next_cta;
      more = has_next;
    }
  } else {
    for (; more; more = scheduler.template next<Traits::kBlockM, Traits::kBlockKV>(p, cta)) {
      run_split_item<Traits>(p, smem, cta);
    }
  }
}

}  // namespace splitkv
