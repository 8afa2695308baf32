// How a split CTA's tiles arrive in shared memory: the Q tile (packed GQA rows) and the K/V
// stages, from a contiguous cache or through a paged cache's block table.
#pragma once

#include <cute/tensor.hpp>

#include "splitkv/block_range.h"
#include "splitkv/kernel_traits.h"
#include "splitkv/params.h"

namespace splitkv {

using namespace cute;

// The Q tile and the K/V stages in shared memory, in the layouts of Traits, plus V read
// transposed (the B operand of P V) with and without its swizzle (the latter only shapes
// register fragments).
template <class Traits>
CUTE_DEVICE auto smem_q_kv(char* smem) {
  using Element = typename Traits::Element;
  Tensor sQ = make_tensor(make_smem_ptr(reinterpret_cast<Element*>(smem)),
                          typename Traits::SmemLayoutQ{});                   // (kBlockM, kHeadDim)
  Tensor sK = make_tensor(sQ.data() + int(Traits::kQElems),
                          typename Traits::SmemLayoutKV{});                  // (kBlockKV, kHeadDim, kStages)
  Tensor sV = make_tensor(sK.data() + int(Traits::kKVElems),
                          typename Traits::SmemLayoutKV{});                  // (kBlockKV, kHeadDim, kStages)
  Tensor sVt = make_tensor(sV.data(), typename Traits::SmemLayoutVt{});      // (kHeadDim, kBlockKV, kStages)
  Tensor sVtNoSwizzle = make_tensor(sV.data().get(), typename Traits::SmemLayoutVtNoSwizzle{});
  return make_tuple(sQ, sK, sV, sVt, sVtNoSwizzle);
}

// K and V of one (sequence, KV head) of a contiguous cache as (kv_len, kHeadDim) gmem tensors,
// which load_kv_tile cuts into (kRows, kHeadDim) tiles with local_tile. With a block table the
// pointers are the pools' (its rows are found per page).
template <int kHeadDim, class Element>
CUTE_DEVICE auto kv_heads_of(const SplitParams& p, int b, int h_kv) {
  const Element* k = static_cast<const Element*>(p.k) + b * p.k_batch_stride + h_kv * p.k_head_stride;
  const Element* v = static_cast<const Element*>(p.v) + b * p.v_batch_stride + h_kv * p.v_head_stride;
  auto shape = make_shape(p.kv_len, Int<kHeadDim>{});
  return make_tuple(make_tensor(make_gmem_ptr(k), shape, make_stride(p.k_row_stride, _1{})),   // (kv_len, kHeadDim)
                    make_tensor(make_gmem_ptr(v), shape, make_stride(p.v_row_stride, _1{})));  // (kv_len, kHeadDim)
}

// Copies `valid` leading rows [n0, n0 + valid) of the K and V tiles starting at key n0 (gmem ->
// smem, cp.async) and zero-fills the rest. tKVcKV: the thread's (row, col) coordinates in the
// tile, partitioned like the copies. Contiguous caches read the rows through local_tile of
// mK/mV; paged caches look each row's page up in the block table (any page size, down to 1).
template <int kRows, int kHeadDim, class Element, class GmemCopy, class ThrCopy, class CoordTensor, class MTensor,
          class SKTensor, class SVTensor>
CUTE_DEVICE void load_kv_tile(const SplitParams& p, const SplitCta& cta, GmemCopy const& gmem_copy,
                              ThrCopy const& thr_copy, CoordTensor const& tKVcKV, MTensor const& mK,
                              MTensor const& mV, SKTensor&& sK, SVTensor&& sV, int n0) {
  const int valid = cta.range.y - n0;
  Tensor tKsK = thr_copy.partition_D(sK);  // (CPY, CPY_N, CPY_D)
  Tensor tVsV = thr_copy.partition_D(sV);
  if (p.block_table == nullptr) {
    // Tiles start at any key ("length" splits are not block-aligned): offset, then tile.
    Tensor gK = local_tile(domain_offset(make_coord(n0, _0{}), mK), Shape<Int<kRows>, Int<kHeadDim>>{},
                           make_coord(_0{}, _0{}));  // (kRows, kHeadDim)
    Tensor gV = local_tile(domain_offset(make_coord(n0, _0{}), mV), Shape<Int<kRows>, Int<kHeadDim>>{},
                           make_coord(_0{}, _0{}));  // (kRows, kHeadDim)
    Tensor tKgK = thr_copy.partition_S(gK);  // (CPY, CPY_N, CPY_D)
    Tensor tVgV = thr_copy.partition_S(gV);
    CUTE_UNROLL
    for (int m = 0; m < size<1>(tKgK); ++m) {
      if (get<0>(tKVcKV(0, m, 0)) < valid) {
        CUTE_UNROLL
        for (int d = 0; d < size<2>(tKgK); ++d) {
          copy(gmem_copy, tKgK(_, m, d), tKsK(_, m, d));
          copy(gmem_copy, tVgV(_, m, d), tVsV(_, m, d));
        }
      } else {
        clear(tKsK(_, m, _));
        clear(tVsV(_, m, _));
      }
    }
    return;
  }
  const int* pages = p.block_table + cta.b * p.block_table_stride;
  const int page_mask = (1 << p.page_shift) - 1;
  CUTE_UNROLL
  for (int m = 0; m < size<1>(tKsK); ++m) {
    const int row = get<0>(tKVcKV(0, m, 0));
    if (row < valid) {
      const int n = n0 + row;
      const int64_t page = __ldg(pages + (n >> p.page_shift));
      const int slot = n & page_mask;
      const Element* k_row = static_cast<const Element*>(p.k) + page * p.k_batch_stride + slot * p.k_row_stride +
                             cta.h_kv * p.k_head_stride;
      const Element* v_row = static_cast<const Element*>(p.v) + page * p.v_batch_stride + slot * p.v_row_stride +
                             cta.h_kv * p.v_head_stride;
      CUTE_UNROLL
      for (int d = 0; d < size<2>(tKsK); ++d) {
        // A thread's chunk is 16 contiguous bytes in shared memory too (the swizzle permutes
        // whole 16-byte chunks), so one cp.async per chunk, as the tiled copy issues.
        const int col = get<1>(tKVcKV(0, m, d));
        SM80_CP_ASYNC_CACHEGLOBAL<uint128_t>::copy(*reinterpret_cast<const uint128_t*>(k_row + col),
                                                   *reinterpret_cast<uint128_t*>(&tKsK(0, m, d)));
        SM80_CP_ASYNC_CACHEGLOBAL<uint128_t>::copy(*reinterpret_cast<const uint128_t*>(v_row + col),
                                                   *reinterpret_cast<uint128_t*>(&tVsV(0, m, d)));
      }
    } else {
      clear(tKsK(_, m, _));
      clear(tVsV(_, m, _));
    }
  }
}

// Gathers the tile's packed Q rows into sQ (zeros past packed_rows): packed row r is query
// r / G of query head h_kv * G + r % G.
template <int kThreads, class Element, class SQTensor>
CUTE_DEVICE void gather_q(const SplitParams& p, SQTensor& sQ, int row0, int b, int h_kv) {
  constexpr int kBlockM = decltype(size<0>(sQ))::value;
  constexpr int kChunksPerRow = decltype(size<1>(sQ))::value / 8;
  const Element* q_base = static_cast<const Element*>(p.q) + b * p.q_batch_stride +
                          int64_t(h_kv) * p.group * p.q_head_stride;
  for (int idx = threadIdx.x; idx < kBlockM * kChunksPerRow; idx += kThreads) {
    const int r = idx / kChunksPerRow;
    const int c = (idx % kChunksPerRow) * 8;
    const int row = row0 + r;
    uint4 chunk = make_uint4(0, 0, 0, 0);
    if (row < p.packed_rows) {
      chunk = *reinterpret_cast<const uint4*>(q_base + (row / p.group) * p.q_row_stride +
                                              (row % p.group) * p.q_head_stride + c);
    }
    *reinterpret_cast<uint4*>(&sQ(r, c)) = chunk;
  }
}

// Issues the first kStages K/V tiles (one cp.async group each, empty past the split's tiles),
// then gathers Q while they are in flight.
template <int kStages, int kThreads, class Element, class LoadKV, class SQTensor>
CUTE_DEVICE void start_pipeline(const SplitParams& p, const SplitCta& cta, LoadKV&& load_kv, SQTensor& sQ) {
  CUTE_UNROLL
  for (int s = 0; s < kStages; ++s) {
    if (s < cta.n_tiles) load_kv(s, s);
    cp_async_fence();
  }
  gather_q<kThreads, Element>(p, sQ, cta.row0, cta.b, cta.h_kv);
}

}  // namespace splitkv
