// The K/V stage loader of both main loops: the cp.async copies with which a group of threads
// fills its rows of each pipeline stage (the CTA all kBlockKV rows in tile_mainloop.h, each warp
// its own kKeysPerWarp rows in decode_mainloop.h), from a contiguous or a paged cache.
#pragma once

#include <cute/tensor.hpp>

#include "splitkv/block_range.h"
#include "splitkv/params.h"
#include "splitkv/tiles.h"

namespace splitkv {

using namespace cute;

// Returns load_kv(tile, stage), which copies the group's rows of key block `tile` of the split
// into `stage`: keys [key0 + tile * kBlockKV, key0 + tile * kBlockKV + kRows) of K and V into
// sK(_, _, stage) and sV(_, _, stage), zero-filled past the split (load_kv_tile). kRows: the rows
// of sK; thread_idx: the thread's index in GmemCopy, whose threads are the group.
template <class Traits, class GmemCopy, class SKTensor, class SVTensor>
CUTE_DEVICE auto kv_stage_loader(const SplitParams& p, const SplitCta& cta, int thread_idx, SKTensor const& sK,
                                 SVTensor const& sV, int key0) {
  static_assert(decltype(rank(sK))::value == 3 && decltype(size<1>(sK))::value == Traits::kHeadDim &&
                    decltype(size<2>(sK))::value == Traits::kStages,
                "sK and sV: (kRows, kHeadDim, kStages)");
  using Element = typename Traits::Element;
  constexpr int kRows = decltype(size<0>(sK))::value;
  constexpr int kHeadDim = Traits::kHeadDim;
  GmemCopy gmem_copy;
  auto gmem_thr_copy = gmem_copy.get_thread_slice(thread_idx);
  Tensor tKVcKV = gmem_thr_copy.partition_S(
      make_identity_tensor(Shape<Int<kRows>, Int<kHeadDim>>{}));  // (CPY, CPY_N, CPY_D) -> (n, d)
  auto mKV = kv_heads_of<kHeadDim, Element>(p, cta.b, cta.h_kv);
  Tensor mK = get<0>(mKV);                                        // (kv_len, kHeadDim)
  Tensor mV = get<1>(mKV);                                        // (kv_len, kHeadDim)
  // By reference, p stays the kernel's __grid_constant__ parameter, read in place rather than copied.
  return [=, &p, &cta](int tile, int stage) {
    load_kv_tile<kRows, kHeadDim, Element>(p, cta, gmem_copy, gmem_thr_copy, tKVcKV, mK, mV, sK(_, _, stage),
                                           sV(_, _, stage), key0 + tile * Traits::kBlockKV);
  };
}

}  // namespace splitkv
