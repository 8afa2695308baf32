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

// One work item: the main loop, then the fused merge when this split is the tile's last.
template <class Traits>
CUTE_DEVICE void run_split_item(const SplitParams& p, char* smem, const SplitCta& cta) {
  if constexpr (Traits::kWarpsOwnKeys) {
    decode_mainloop<Traits>(p, smem, cta);
  } else {
    tile_mainloop<Traits>(p, smem, cta);
  }
  if (cta.num_splits > 1 && p.tile_counters != nullptr) merge_if_last_split<Traits>(p, cta);
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
template <class Traits>
__global__ void __launch_bounds__(Traits::kNThreads) split_kv_live_kernel(const __grid_constant__ SplitParams p) {
  extern __shared__ __align__(128) char smem[];
  // The lengths, the block table and everything else in memory come after the wait.
  wait_for_previous_grid();
  allow_dependent_launch();
  LiveScheduler<Traits> scheduler(p, smem + Traits::kSmemBytes);
  SplitCta cta;
  for (bool more = scheduler.template first<Traits::kBlockM, Traits::kBlockKV>(p, cta); more;
       more = scheduler.template next<Traits::kBlockM, Traits::kBlockKV>(p, cta)) {
    run_split_item<Traits>(p, smem, cta);
  }
}

}  // namespace splitkv
