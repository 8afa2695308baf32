// The split kernel's main loop for tiles whose warps share every key block: 64-row tiles
// (warps along M, P kept in registers, as FlashAttention-2) and 16-row tiles with too few keys
// per warp to own them (warps along N exchanging row statistics and P through shared memory).
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
CUTE_DEVICE void tile_mainloop(const SplitParams& p, char* smem, const SplitCta& cta) {
  static_assert(!Traits::kWarpsOwnKeys);
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kBlockKV = Traits::kBlockKV;
  constexpr int kHeadDim = Traits::kHeadDim;
  constexpr int kStages = Traits::kStages;
  constexpr int kWarpsN = Traits::kWarpsN;
  const int tid = threadIdx.x;
  const int warp_n = (tid / 32) / Traits::kWarpsM;

  // sQ: (kBlockM, kHeadDim); sK, sV: (kBlockKV, kHeadDim, kStages);
  // sVt, sVtNoSwizzle (the same, unswizzled): (kHeadDim, kBlockKV, kStages)
  auto [sQ, sK, sV, sVt, sVtNoSwizzle] = smem_q_kv<Traits>(smem);
  Tensor sP = make_tensor(sV.data() + int(Traits::kKVElems),
                          typename Traits::SmemLayoutP{});                       // (kBlockM, kBlockKV)
  float* exchange = reinterpret_cast<float*>(smem + Traits::kSmemBytes - 4 * Traits::kExchangeFloats);

  auto load_kv = kv_stage_loader<Traits, typename Traits::GmemCopyKV>(p, cta, tid, sK, sV, cta.range.x);

  typename Traits::TiledMma tiled_mma;
  auto thr_mma = tiled_mma.get_thread_slice(tid);
  Tensor tSrQ = thr_mma.partition_fragment_A(sQ);                         // (MMA, MMA_M, MMA_D)
  Tensor tSrK = thr_mma.partition_fragment_B(sK(_, _, 0));                // (MMA, MMA_N, MMA_D)
  Tensor tOrP = thr_mma.partition_fragment_A(sP);                         // (MMA, MMA_M, MMA_N)
  Tensor tOrVt = thr_mma.partition_fragment_B(sVtNoSwizzle(_, _, 0));     // (MMA, MMA_D, MMA_N)
  Tensor acc_o = partition_fragment_C(tiled_mma, Shape<Int<kBlockM>, Int<kHeadDim>>{});  // (MMA, MMA_M, MMA_D)
  clear(acc_o);

  auto smem_copy_q = make_tiled_copy_A(typename Traits::SmemCopyA{}, tiled_mma);
  auto smem_thr_copy_q = smem_copy_q.get_thread_slice(tid);
  Tensor tSsQ = smem_thr_copy_q.partition_S(sQ);
  auto smem_copy_k = make_tiled_copy_B(typename Traits::SmemCopyB{}, tiled_mma);
  auto smem_thr_copy_k = smem_copy_k.get_thread_slice(tid);
  Tensor tSsK = smem_thr_copy_k.partition_S(sK);                          // (CPY, CPY_N, CPY_D, kStages)
  auto smem_copy_p = make_tiled_copy_A(typename Traits::SmemCopyA{}, tiled_mma);
  auto smem_thr_copy_p = smem_copy_p.get_thread_slice(tid);
  Tensor tOsP = smem_thr_copy_p.partition_S(sP);
  auto smem_copy_vt = make_tiled_copy_B(typename Traits::SmemCopyBt{}, tiled_mma);
  auto smem_thr_copy_vt = smem_copy_vt.get_thread_slice(tid);
  Tensor tOsVt = smem_thr_copy_vt.partition_S(sVt);                       // (CPY, CPY_D, CPY_N, kStages)
  auto smem_copy_c = make_tiled_copy_C(typename Traits::SmemCopyC{}, tiled_mma);
  auto smem_thr_copy_c = smem_copy_c.get_thread_slice(tid);
  Tensor tPsP = smem_thr_copy_c.partition_D(sP);

  // (row, col) coordinates of this thread's score accumulators, in rows x cols form.
  Tensor tScS = thr_mma.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockKV>>{}));
  Tensor tScS_rc = make_tensor(tScS.data(), acc_rowcol(tScS.layout()));   // (ROWS, COLS)
  constexpr int kRows = decltype(size<0>(tScS_rc))::value;
  float row_max[kRows];  // running max of the scores, base-2 units
  float row_sum[kRows];  // this thread's share of the running sum
  int key_limit[kRows];  // keys visible to the row: < key_limit
  init_softmax(row_max, row_sum);
  key_limits(p, cta, tScS_rc, key_limit);

  start_pipeline<kStages, Traits::kNThreads, Element>(p, cta, load_kv, sQ);

  Tensor o_rc = make_tensor(acc_o.data(), acc_rowcol(acc_o.layout()));    // (ROWS, D_COLS)
  for (int t = 0; t < cta.n_tiles; ++t) {
    const int stage = t % kStages;
    cp_async_wait<kStages - 1>();
    __syncthreads();

    Tensor acc_s = partition_fragment_C(tiled_mma, Shape<Int<kBlockM>, Int<kBlockKV>>{});  // (MMA, MMA_M, MMA_N)
    clear(acc_s);
    gemm_smem(tiled_mma, acc_s, tSrQ, tSrK, tSsQ, tSsK(_, _, _, stage), smem_copy_q, smem_copy_k,
              smem_thr_copy_q, smem_thr_copy_k);

    Tensor s_rc = make_tensor(acc_s.data(), acc_rowcol(acc_s.layout()));  // (ROWS, COLS)
    float tile_max[kRows];
    scale_mask_max(s_rc, tScS_rc, key_limit, cta.range.x + t * kBlockKV, p.scale_log2, tile_max);
    exchange_rows<true, kWarpsN, kBlockM>(tile_max, exchange, tScS_rc, warp_n);
    online_softmax_step(s_rc, o_rc, row_max, row_sum, tile_max);

    Tensor rP = convert_fragment<Element>(acc_s);
    if constexpr (kWarpsN == 1) {
      // Each warp owns whole rows: P stays in registers as the A operand of P V.
      Tensor tOrP_regs = make_tensor(rP.data(), acc_to_a_layout(rP.layout()));
      gemm_rs(tiled_mma, acc_o, tOrP_regs, tOrVt, tOsVt(_, _, _, stage), smem_copy_vt, smem_thr_copy_vt);
    } else {
      // Warps split the key columns: P goes through shared memory to the warps that own V's columns.
      copy(smem_copy_c, smem_thr_copy_c.retile_S(rP), tPsP);
      __syncthreads();
      gemm_smem(tiled_mma, acc_o, tOrP, tOrVt, tOsP, tOsVt(_, _, _, stage), smem_copy_p, smem_copy_vt,
                smem_thr_copy_p, smem_thr_copy_vt);
    }
    __syncthreads();  // every warp is done with this stage and with sP
    if (t + kStages < cta.n_tiles) load_kv(t + kStages, stage);
    cp_async_fence();
  }

  exchange_rows<false, kWarpsN, kBlockM>(row_sum, exchange + Traits::kExchangeFloats / 2, tScS_rc, warp_n);
  Tensor tOcO = thr_mma.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  Tensor tOcO_rc = make_tensor(tOcO.data(), acc_rowcol(tOcO.layout()));  // (ROWS, D_COLS)
  store_rows<kHeadDim, Element>(p, cta, o_rc, tOcO_rc, row_max, row_sum, warp_n == 0 && tid % 4 == 0);
}

}  // namespace splitkv
