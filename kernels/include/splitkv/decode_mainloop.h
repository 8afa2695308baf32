// The split kernel's main loop for decode tiles (16 packed rows) in which each warp owns keys:
// warp w loads and reads rows [w * kKeysPerWarp, (w + 1) * kKeysPerWarp) of every K/V stage,
// and keeps its own softmax state and a full 16 x D accumulator of O. A warp waits only on its
// own cp.async groups, so the loop has no CTA barrier, no cross-warp max/sum exchange and no
// P round trip through shared memory (the three cost ~230 ns per key block in the tile loop,
// docs/NOTES.md). After the loop the warps' states are merged once, through shared memory,
// with the same rule as the split partials (params.h).
#pragma once

#include <cute/tensor.hpp>

#include "splitkv/kernel_traits.h"
#include "splitkv/block_range.h"
#include "splitkv/epilogue.h"
#include "splitkv/kv_stage_loader.h"
#include "splitkv/mask.h"
#include "splitkv/softmax.h"
#include "splitkv/tiles.h"
#include "splitkv/utils.h"

namespace splitkv {

using namespace cute;

template <class Traits>
CUTE_DEVICE void decode_mainloop(const SplitParams& p, char* smem, const SplitCta& cta) {
  static_assert(Traits::kWarpsOwnKeys && Traits::kBlockM == 16, "one 16-row MMA tile per warp");
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kHeadDim = Traits::kHeadDim;
  constexpr int kStages = Traits::kStages;
  constexpr int kKeysPerWarp = Traits::kKeysPerWarp;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;

  // sQ: (kBlockM, kHeadDim); sK, sV: (kBlockKV, kHeadDim, kStages);
  // sVt, sVtNoSwizzle (the same, unswizzled): (kHeadDim, kBlockKV, kStages)
  auto [sQ, sK, sV, sVt, sVtNoSwizzle] = smem_q_kv<Traits>(smem);
  // This warp's rows of every stage.
  using WarpKV = Shape<Int<kKeysPerWarp>, Int<kHeadDim>, Int<kStages>>;
  using WarpVt = Shape<Int<kHeadDim>, Int<kKeysPerWarp>, Int<kStages>>;
  Tensor sKw = local_tile(sK, WarpKV{}, make_coord(warp, 0, 0));                 // (kKeysPerWarp, kHeadDim, kStages)
  Tensor sVw = local_tile(sV, WarpKV{}, make_coord(warp, 0, 0));                 // (kKeysPerWarp, kHeadDim, kStages)
  Tensor sVtw = local_tile(sVt, WarpVt{}, make_coord(0, warp, 0));               // (kHeadDim, kKeysPerWarp, kStages)
  Tensor sVtwNoSwizzle = local_tile(sVtNoSwizzle, WarpVt{}, make_coord(0, warp, 0));

  const int warp_key0 = cta.range.x + warp * kKeysPerWarp;  // the warp's first key of the split
  auto load_kv = kv_stage_loader<Traits, typename Traits::GmemCopyKVWarp>(p, cta, lane, sKw, sVw, warp_key0);

  typename Traits::WarpMma warp_mma;
  auto thr_mma = warp_mma.get_thread_slice(lane);
  Tensor tSrQ = thr_mma.partition_fragment_A(sQ);                         // (MMA, MMA_M, MMA_D)
  Tensor tSrK = thr_mma.partition_fragment_B(sKw(_, _, 0));               // (MMA, MMA_N, MMA_D)
  Tensor tOrVt = thr_mma.partition_fragment_B(sVtwNoSwizzle(_, _, 0));    // (MMA, MMA_D, MMA_N)
  Tensor acc_o = partition_fragment_C(warp_mma, Shape<Int<kBlockM>, Int<kHeadDim>>{});  // (MMA, MMA_M, MMA_D)
  clear(acc_o);

  auto smem_copy_q = make_tiled_copy_A(typename Traits::SmemCopyA{}, warp_mma);
  auto smem_thr_copy_q = smem_copy_q.get_thread_slice(lane);
  Tensor tSsQ = smem_thr_copy_q.partition_S(sQ);                          // (CPY, CPY_M, CPY_D)
  auto smem_copy_k = make_tiled_copy_B(typename Traits::SmemCopyB{}, warp_mma);
  auto smem_thr_copy_k = smem_copy_k.get_thread_slice(lane);
  Tensor tSsK = smem_thr_copy_k.partition_S(sKw);                         // (CPY, CPY_N, CPY_D, kStages)
  auto smem_copy_vt = make_tiled_copy_B(typename Traits::SmemCopyBt{}, warp_mma);
  auto smem_thr_copy_vt = smem_copy_vt.get_thread_slice(lane);
  Tensor tOsVt = smem_thr_copy_vt.partition_S(sVtw);                      // (CPY, CPY_D, CPY_N, kStages)

  // (row, key) coordinates of this lane's score accumulators within the warp's keys.
  Tensor tScS = thr_mma.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kKeysPerWarp>>{}));
  Tensor tScS_rc = make_tensor(tScS.data(), acc_rowcol(tScS.layout()));   // (ROWS, COLS)
  constexpr int kRows = decltype(size<0>(tScS_rc))::value;
  float row_max[kRows];  // running max of this warp's scores, base-2 units
  float row_sum[kRows];  // this lane's share of the warp's running sum
  int key_limit[kRows];  // keys visible to the row: < key_limit
  init_softmax(row_max, row_sum);
  key_limits(p, cta, tScS_rc, key_limit);

  start_pipeline<kStages, Traits::kNThreads, Element>(p, cta, load_kv, sQ);
  __syncthreads();  // Q is in shared memory; with kQInRegisters each warp keeps it in registers for the whole loop
  if constexpr (Traits::kQInRegisters) copy(smem_copy_q, tSsQ, smem_thr_copy_q.retile_D(tSrQ));

  Tensor o_rc = make_tensor(acc_o.data(), acc_rowcol(acc_o.layout()));    // (ROWS, D_COLS)
  for (int t = 0; t < cta.n_tiles; ++t) {
    const int stage = t % kStages;
    cp_async_wait<kStages - 1>();
    __syncwarp();  // the whole warp's copies of this stage have landed

    Tensor acc_s = partition_fragment_C(warp_mma, Shape<Int<kBlockM>, Int<kKeysPerWarp>>{});  // (MMA, MMA_M, MMA_N)
    clear(acc_s);
    if constexpr (Traits::kQInRegisters) {
      gemm_rs(warp_mma, acc_s, tSrQ, tSrK, tSsK(_, _, _, stage), smem_copy_k, smem_thr_copy_k);
    } else {
      gemm_smem(warp_mma, acc_s, tSrQ, tSrK, tSsQ, tSsK(_, _, _, stage), smem_copy_q, smem_copy_k, smem_thr_copy_q,
                smem_thr_copy_k);
    }

    Tensor s_rc = make_tensor(acc_s.data(), acc_rowcol(acc_s.layout()));  // (ROWS, COLS)
    float tile_max[kRows];
    scale_mask_max(s_rc, tScS_rc, key_limit, warp_key0 + t * Traits::kBlockKV, p.scale_log2, tile_max);
    CUTE_UNROLL
    for (int i = 0; i < kRows; ++i) tile_max[i] = lane_group_reduce<4, true>(tile_max[i]);  // the quad sharing a row
    online_softmax_step(s_rc, o_rc, row_max, row_sum, tile_max);

    Tensor rP = convert_fragment<Element>(acc_s);
    Tensor tOrP = make_tensor(rP.data(), acc_to_a_layout(rP.layout()));  // (MMA, MMA_M, MMA_N / 2)
    gemm_rs(warp_mma, acc_o, tOrP, tOrVt, tOsVt(_, _, _, stage), smem_copy_vt, smem_thr_copy_vt);

    __syncwarp();  // every lane is done reading this stage
    if (t + kStages < cta.n_tiles) load_kv(t + kStages, stage);
    cp_async_fence();
  }
  cp_async_wait<0>();

  // Merge the warps with the partials' rule (params.h) through shared memory, reused once
  // every warp is done with Q and K/V: the row max, each warp's sum and O rescaled to it, the
  // sums added, then the O fragments added.
  constexpr int kNWarps = Traits::kNWarps;
  constexpr int kFrag = decltype(size(acc_o))::value;  // kBlockM * kHeadDim / 32
  float* warp_m = reinterpret_cast<float*>(smem);      // [kNWarps][kBlockM]
  float* warp_l = warp_m + kNWarps * kBlockM;          // [kNWarps][kBlockM]
  float* warp_o = warp_l + kNWarps * kBlockM;          // [kNWarps][kFrag][32]
  static_assert(2 * kNWarps * kBlockM + kNWarps * kFrag * 32 == Traits::kWarpMergeFloats);
  __syncthreads();
  float cta_max[kRows];
  CUTE_UNROLL
  for (int i = 0; i < kRows; ++i) cta_max[i] = row_max[i];
  exchange_rows<true, kNWarps, kBlockM>(cta_max, warp_m, tScS_rc, warp);
  CUTE_UNROLL
  for (int i = 0; i < kRows; ++i) {
    // 0 for a warp that saw no key of the row; a row no warp saw keeps max -inf and sum 0.
    const float weight = exp2f(row_max[i] - (cta_max[i] == -INFINITY ? 0.f : cta_max[i]));
    row_sum[i] *= weight;
    CUTE_UNROLL
    for (int j = 0; j < size<1>(o_rc); ++j) o_rc(i, j) *= weight;
    row_max[i] = cta_max[i];
  }
  exchange_rows<false, kNWarps, kBlockM>(row_sum, warp_l, tScS_rc, warp);
  CUTE_UNROLL
  for (int k = 0; k < kFrag; ++k) warp_o[(warp * kFrag + k) * 32 + lane] = acc_o(k);
  __syncthreads();

  // Warp w sums and writes the fragment entries of columns [w * D / kNWarps, (w + 1) * D / kNWarps):
  // acc_o is (4, 1, D / 8) column-major, so those are a contiguous quarter of the fragment.
  constexpr int kColsPerWarp = kHeadDim / kNWarps;
  Tensor acc_out = make_tensor<float>(Shape<_4, _1, Int<kColsPerWarp / 8>>{});  // (MMA, MMA_M, MMA_D / kNWarps)
  static_assert(size(acc_out) * kNWarps == kFrag);
  CUTE_UNROLL
  for (int k = 0; k < size(acc_out); ++k) {
    float sum = 0.f;
    CUTE_UNROLL
    for (int w = 0; w < kNWarps; ++w) sum += warp_o[(w * kFrag + warp * size(acc_out) + k) * 32 + lane];
    acc_out(k) = sum;
  }
  Tensor cO = local_tile(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}),
                         Shape<Int<kBlockM>, Int<kColsPerWarp>>{}, make_coord(0, warp));  // (kBlockM, kColsPerWarp)
  Tensor tOcO = thr_mma.partition_C(cO);                                  // (MMA, MMA_M, MMA_D / kNWarps)
  Tensor out_rc = make_tensor(acc_out.data(), acc_rowcol(acc_out.layout()));
  Tensor tOcO_rc = make_tensor(tOcO.data(), acc_rowcol(tOcO.layout()));
  store_rows<kHeadDim, Element>(p, cta, out_rc, tOcO_rc, row_max, row_sum, warp == 0 && lane % 4 == 0);
}

}  // namespace splitkv
