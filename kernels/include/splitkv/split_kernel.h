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
#include "splitkv/split_rows.h"
#include "splitkv/tile_mainloop.h"

namespace splitkv {

template <class Traits>
__global__ void __launch_bounds__(Traits::kNThreads) split_kv_kernel(const __grid_constant__ SplitParams p) {
  extern __shared__ __align__(128) char smem[];
  SplitCta cta;
  cta.m_block = blockIdx.x;
  cta.b = blockIdx.y / p.kv_heads;
  cta.h_kv = blockIdx.y % p.kv_heads;
  cta.split = blockIdx.z;
  cta.row0 = cta.m_block * Traits::kBlockM;
  cta.range = split_range(p, cta.split, tile_kv_end(p, cta.m_block), Traits::kBlockKV);
  cta.n_tiles = cta.range.y > cta.range.x ? (cta.range.y - cta.range.x + Traits::kBlockKV - 1) / Traits::kBlockKV : 0;
  // Everything above reads only the parameters: under programmatic launch it overlaps the
  // previous kernel's tail. Q, K, V, the workspace and the counters come after the wait.
  wait_for_previous_grid();
  allow_dependent_launch();

  if constexpr (Traits::kWarpsOwnKeys) {
    decode_mainloop<Traits>(p, smem, cta);
  } else {
    tile_mainloop<Traits>(p, smem, cta);
  }
  if (p.num_splits > 1 && p.tile_counters != nullptr) merge_if_last_split<Traits>(p, cta.m_block, cta.row0, cta.b, cta.h_kv);
}

}  // namespace splitkv
