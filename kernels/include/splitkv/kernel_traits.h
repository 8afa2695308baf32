// Every compile-time tunable of the split and combine kernels, in one struct each.
// The allowed values come from tunables.h, generated from splitkv_tune/tunables.py,
// which the host heuristics read too.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/numeric_types.h>

#include "splitkv/merge_state.h"
#include "splitkv/rules.h"
#include "splitkv/tunables.h"

namespace splitkv {

using namespace cute;

template <int kHeadDim_, int kBlockM_, int kBlockKV_, typename Element_>
struct SplitKernelTraits {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kBlockM_;    // packed query rows per CTA
  static constexpr int kBlockKV = kBlockKV_;  // keys per pipeline stage
  static constexpr int kStages = kKVStages;
  static constexpr int kNWarps = kNumWarps;
  static constexpr int kNThreads = kNWarps * 32;
  // The warp layout and whether warps own keys (decode_mainloop.h) or share each key block
  // (tile_mainloop.h): rules.h.
  static constexpr int kWarpsM = rules::warp_layout(kBlockM).m;
  static constexpr int kWarpsN = rules::warp_layout(kBlockM).n;
  static constexpr bool kWarpsOwnKeys = rules::warps_own_keys(kBlockM, kBlockKV);
  static constexpr int kKeysPerWarp = kBlockKV / kWarpsN;
  // The decode loop keeps a warp's 16 x D Q fragment in registers beside its 16 x D fp32 O
  // (D / 4 + D / 2 registers per thread); at D = 256 the two would take 192 and spill, so Q is
  // read from shared memory one k-slice ahead, as the tile loop does.
  static constexpr bool kQInRegisters = kHeadDim <= 128;

  static_assert(is_allowed(kHeadDims, kHeadDim), "head dim not in tunables.h");
  static_assert(is_allowed(kBlockMs, kBlockM), "block M not in tunables.h");
  static_assert(block_kv_allowed(kHeadDim, kBlockKV), "block KV not instantiated at this head dim in tunables.h");
  static_assert(kBlockM % (16 * kWarpsM) == 0, "every warp needs whole 16-row MMA tiles");
  static_assert(kBlockKV % (8 * kWarpsN) == 0 && kHeadDim % (8 * kWarpsN) == 0,
                "every warp needs whole 8-column MMA tiles in both GEMMs");
  static_assert(std::is_same_v<Element, cutlass::half_t> || std::is_same_v<Element, cutlass::bfloat16_t>);

  using MmaAtom = std::conditional_t<std::is_same_v<Element, cutlass::half_t>,
                                     SM80_16x8x16_F32F16F16F32_TN, SM80_16x8x16_F32BF16BF16F32_TN>;
  using TiledMma = TiledMMA<MMA_Atom<MmaAtom>, Layout<Shape<Int<kWarpsM>, Int<kWarpsN>, _1>>,
                            Tile<Int<16 * kWarpsM>, Int<8 * kWarpsN>, _16>>;
  // One warp's MMA, for the loop in which warps own keys.
  using WarpMma = TiledMMA<MMA_Atom<MmaAtom>, Layout<Shape<_1, _1, _1>>, Tile<_16, _8, _16>>;

  // 8 rows of one slab of columns, swizzled in 16-byte chunks: conflict-free ldmatrix and
  // cp.async. Widths that are multiples of 64 use 128-byte slab rows; others (32 and 96) use
  // 64-byte slab rows, whose 2-bit swizzle still spreads 8 rows over the 8 chunk positions.
  template <int kCols>
  static constexpr int kSlabCols = kCols % 64 == 0 ? 64 : 32;
  template <int kCols>
  using SmemAtom = decltype(composition(
      Swizzle<(kSlabCols<kCols> == 64 ? 3 : 2), 3, 3>{},
      Layout<Shape<_8, Int<kSlabCols<kCols>>>, Stride<Int<kSlabCols<kCols>>, _1>>{}));
  using SmemLayoutQ = decltype(tile_to_shape(SmemAtom<kHeadDim>{}, Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  // (kBlockKV, kHeadDim, kStages)
  using SmemLayoutKV =
      decltype(tile_to_shape(SmemAtom<kHeadDim>{}, Shape<Int<kBlockKV>, Int<kHeadDim>, Int<kStages>>{}));
  // V seen as (kHeadDim, kBlockKV, kStages): the B operand of P V, read with ldmatrix.trans.
  using SmemLayoutVt = decltype(composition(
      SmemLayoutKV{}, make_layout(Shape<Int<kHeadDim>, Int<kBlockKV>, Int<kStages>>{},
                                  Stride<Int<kBlockKV>, _1, Int<kBlockKV * kHeadDim>>{})));
  using SmemLayoutVtNoSwizzle = decltype(get_nonswizzle_portion(SmemLayoutVt{}));
  // (kBlockM, kBlockKV): probabilities, shared by the warps that split the key columns.
  using SmemLayoutP = decltype(tile_to_shape(SmemAtom<kBlockKV>{}, Shape<Int<kBlockM>, Int<kBlockKV>>{}));

  using SmemCopyA = Copy_Atom<SM75_U32x4_LDSM_N, Element>;   // 16x16 A tile per warp
  using SmemCopyB = Copy_Atom<SM75_U32x2_LDSM_N, Element>;   // 8x16 B tile per warp (K)
  using SmemCopyBt = Copy_Atom<SM75_U16x4_LDSM_T, Element>;  // 8x16 B tile per warp (V^T)
  using SmemCopyC = Copy_Atom<AutoVectorizingCopy, Element>;

  // K/V tile copies move one smem slab of columns per row of threads (16 bytes each), so a
  // thread's chunks never straddle a swizzle atom.
  static constexpr int kGmemElemsPerLoad = sizeof(uint128_t) / sizeof(Element);
  static constexpr int kGmemThreadsPerRow = kSlabCols<kHeadDim> / kGmemElemsPerLoad;
  static_assert(kHeadDim % kSlabCols<kHeadDim> == 0, "K/V tile copies move whole column slabs");
  using GmemCopyKV = decltype(make_tiled_copy(
      Copy_Atom<SM80_CP_ASYNC_CACHEGLOBAL<uint128_t>, Element>{},
      Layout<Shape<Int<kNThreads / kGmemThreadsPerRow>, Int<kGmemThreadsPerRow>>,
             Stride<Int<kGmemThreadsPerRow>, _1>>{},
      Layout<Shape<_1, Int<kGmemElemsPerLoad>>>{}));
  static_assert(kBlockKV % (kNThreads / kGmemThreadsPerRow) == 0, "K/V rows split evenly over threads");
  // One warp copying its own K/V rows (decode_mainloop.h).
  using GmemCopyKVWarp = decltype(make_tiled_copy(
      Copy_Atom<SM80_CP_ASYNC_CACHEGLOBAL<uint128_t>, Element>{},
      Layout<Shape<Int<32 / kGmemThreadsPerRow>, Int<kGmemThreadsPerRow>>, Stride<Int<kGmemThreadsPerRow>, _1>>{},
      Layout<Shape<_1, Int<kGmemElemsPerLoad>>>{}));
  static_assert(!kWarpsOwnKeys || kKeysPerWarp % (32 / kGmemThreadsPerRow) == 0, "a warp's K/V rows split evenly");

  static constexpr int kQElems = kBlockM * kHeadDim;
  static constexpr int kKVElems = kBlockKV * kHeadDim * kStages;  // K or V, all stages
  static_assert(decltype(cosize(SmemLayoutQ{}))::value == kQElems);
  static_assert(decltype(cosize(SmemLayoutKV{}))::value == kKVElems);
  static_assert(decltype(cosize(SmemLayoutP{}))::value == kBlockM * kBlockKV);
  // The P tile and the per-row partial max and sum, when warps that split a tile's keys
  // exchange them (tile_mainloop.h).
  static constexpr bool kExchanges = kWarpsN > 1 && !kWarpsOwnKeys;
  static constexpr int kPElems = kExchanges ? kBlockM * kBlockKV : 0;
  static constexpr int kExchangeFloats = kExchanges ? 2 * kWarpsN * kBlockM : 0;
  static constexpr int kSmemBytes =
      int(sizeof(Element)) * (kQElems + 2 * kKVElems + kPElems) + 4 * kExchangeFloats;
  static_assert(kSmemBytes == rules::smem_bytes(int(sizeof(Element)), kHeadDim, kBlockM, kBlockKV),
                "the CuTe layouts take the shared memory that rules.h (and so the host) counts");
  static_assert(kWarpsM * kWarpsN == kNWarps);
  // After the loop of decode_mainloop.h, each warp's row max and sum, then its O fragment,
  // overwrite the Q and K/V stages.
  static constexpr int kWarpMergeFloats = kWarpsOwnKeys ? kNWarps * kBlockM * (2 + kHeadDim) : 0;
  static_assert(4 * kWarpMergeFloats <= kSmemBytes, "the warps' merge fits the K/V stages");
};

template <int kHeadDim_, int kThreads_, typename Element_>
struct CombineKernelTraits {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kThreads = kThreads_;
  static_assert(is_allowed(kReduceThreads, kThreads), "reduce threads not in tunables.h");
  static constexpr int kThreadsPerRow = kLanesPerRow<kHeadDim>;  // merge_state.h's lanes per row
  static constexpr int kRowsPerBlock = kThreads / kThreadsPerRow;
};

}  // namespace splitkv
