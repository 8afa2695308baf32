// Split kernel: one CTA per (query tile, batch x KV head, split) streams its key range
// through a cp.async pipeline, keeps the online-softmax state and writes the partials
// of params.h's contract to the workspace (merging them itself in the last CTA of the tile
// when the merge is fused), or, with one split, writes the final output.
#pragma once

#include <cute/tensor.hpp>

#include "splitkv/decode_mainloop.h"
#include "splitkv/dependent_launch.h"
#include "splitkv/fused_merge.h"
#include "splitkv/kernel_traits.h"
#include "splitkv/params.h"
#include "splitkv/block_range.h"
#include "splitkv/tile_mainloop.h"

namespace splitkv {

template <class Traits>
__global__ void __launch_bounds__(Traits::kNThreads) split_kv_kernel(const __grid_constant__ SplitParams p) {
  extern __shared__ __align__(128) char smem[];
  // Without live lengths everything up to the wait reads only the parameters: under programmatic
  // launch it overlaps the previous kernel's tail. Q, K, V, the lengths, the block table, the
  // workspace and the counters come after the wait.
  SplitCta cta;
  if (p.seqlens == nullptr) cta = plan_cta<Traits::kBlockM, Traits::kBlockKV>(p, p.kv_len);
  wait_for_previous_grid();
  allow_dependent_launch();
  if (p.seqlens != nullptr) {
    cta = plan_cta<Traits::kBlockM, Traits::kBlockKV>(p, __ldg(p.seqlens + blockIdx.y / p.kv_heads));
    if (cta.split >= cta.num_splits) return;  // beyond this sequence's splits
  }

  if constexpr (Traits::kWarpsOwnKeys) {
    decode_mainloop<Traits>(p, smem, cta);
  } else {
    tile_mainloop<Traits>(p, smem, cta);
  }
  if (cta.num_splits > 1 && p.tile_counters != nullptr) merge_if_last_split<Traits>(p, cta);
}

}  // namespace splitkv
