// What both split-kernel main loops share: which keys a CTA covers, how its Q rows and K/V
// tiles arrive in shared memory, the online-softmax step over one score tile, and how the
// finished rows leave (final O or the partials of params.h's contract).
#pragma once

#include <cute/tensor.hpp>

#include "splitkv/kernel_traits.h"
#include "splitkv/params.h"
#include "splitkv/utils.h"

namespace splitkv {

using namespace cute;

inline constexpr float kLn2 = 0.693147180559945309f;

// Which work one split CTA does: query tile m_block of (batch b, KV head h_kv), keys
// [range.x, range.y) in n_tiles tiles of the traits' block_kv.
struct SplitCta {
  int m_block, b, h_kv, split, row0;
  int2 range;
  int n_tiles;
};

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

// One past the last key any row of query tile m_block may attend (rules.h).
CUTE_DEVICE int tile_kv_end(const SplitParams& p, int m_block) {
  return rules::tile_kv_end(p.causal, p.kv_len, p.q_len, p.group, p.packed_rows, m_block);
}

// Keys [x, y) of one split (rules.h); y <= x means empty.
CUTE_DEVICE int2 split_range(const SplitParams& p, int split, int kv_end, int block_kv) {
  const rules::KeyRange r = rules::split_range(p.split_policy, split, p.num_splits, p.kv_len, kv_end, block_kv);
  return make_int2(r.start, r.end);
}

// Copies `valid` leading rows of a K tile and a V tile (gmem -> smem, cp.async) and zero-fills
// the rest. tKVcKV: the thread's (row, col) coordinates in the tile, partitioned like the copies.
template <class GmemCopy, class ThrCopy, class CoordTensor, class GTensor, class SKTensor, class SVTensor>
CUTE_DEVICE void copy_kv_rows(GmemCopy const& gmem_copy, ThrCopy const& thr_copy, CoordTensor const& tKVcKV,
                              GTensor const& gK, GTensor const& gV, SKTensor&& sK, SVTensor&& sV, int valid) {
  Tensor tKgK = thr_copy.partition_S(gK);  // (CPY, CPY_N, CPY_D)
  Tensor tVgV = thr_copy.partition_S(gV);
  Tensor tKsK = thr_copy.partition_D(sK);
  Tensor tVsV = thr_copy.partition_D(sV);
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
}

// K and V rows [n0, n0 + kRows) of one (batch, KV head) as (kRows, kHeadDim) gmem tensors.
template <int kRows, int kHeadDim, class Element>
CUTE_DEVICE auto kv_tiles(const SplitParams& p, int b, int h_kv, int n0) {
  const Element* k = static_cast<const Element*>(p.k) + b * p.k_batch_stride + h_kv * p.k_head_stride;
  const Element* v = static_cast<const Element*>(p.v) + b * p.v_batch_stride + h_kv * p.v_head_stride;
  auto shape = Shape<Int<kRows>, Int<kHeadDim>>{};
  return make_tuple(make_tensor(make_gmem_ptr(k + int64_t(n0) * p.k_row_stride), shape, make_stride(p.k_row_stride, _1{})),
                   make_tensor(make_gmem_ptr(v + int64_t(n0) * p.v_row_stride), shape, make_stride(p.v_row_stride, _1{})));
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

// A row's softmax state before its first key (max -inf, sum 0) and the first key it may not
// see: the split's end, or earlier on the causal diagonal. rc: (ROWS, COLS) tile coordinates.
template <int kRows, class RowCoords>
CUTE_DEVICE void init_rows(const SplitParams& p, const SplitCta& cta, RowCoords const& rc, float (&row_max)[kRows],
                           float (&row_sum)[kRows], int (&key_limit)[kRows]) {
  CUTE_UNROLL
  for (int i = 0; i < kRows; ++i) {
    row_max[i] = -INFINITY;
    row_sum[i] = 0.f;
    const int q_idx = (cta.row0 + get<0>(rc(i, 0))) / p.group;
    key_limit[i] = p.causal ? min(cta.range.y, q_idx + 1 + p.kv_len - p.q_len) : cta.range.y;
  }
}

// Combines per-thread row values (max or sum) across the quad and the warps that share a row.
template <bool kMax, int kWarpsN, int kBlockM, int kRows, class RowCoords>
CUTE_DEVICE void exchange_rows(float (&vals)[kRows], float* slots, RowCoords const& rc, int warp_n) {
  CUTE_UNROLL
  for (int i = 0; i < kRows; ++i) vals[i] = lane_group_reduce<4, kMax>(vals[i]);  // the quad sharing a row
  if constexpr (kWarpsN > 1) {
    if (threadIdx.x % 4 == 0) {
      CUTE_UNROLL
      for (int i = 0; i < kRows; ++i) slots[warp_n * kBlockM + get<0>(rc(i, 0))] = vals[i];
    }
    __syncthreads();
    CUTE_UNROLL
    for (int i = 0; i < kRows; ++i) {
      float acc = kMax ? -INFINITY : 0.f;
      CUTE_UNROLL
      for (int w = 0; w < kWarpsN; ++w) {
        const float x = slots[w * kBlockM + get<0>(rc(i, 0))];
        acc = kMax ? fmaxf(acc, x) : acc + x;
      }
      vals[i] = acc;
    }
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

// Scales one score tile to base-2 units, masks keys at or past each row's key_limit to -inf
// and returns this thread's per-row maximum. s_rc, c_rc: (ROWS, COLS) scores and their
// (row, key - n0) coordinates.
template <int kRows, class STensor, class CTensor>
CUTE_DEVICE void scale_mask_max(STensor& s_rc, CTensor const& c_rc, const int (&key_limit)[kRows], int n0,
                                float scale_log2, float (&tile_max)[kRows]) {
  CUTE_UNROLL
  for (int i = 0; i < kRows; ++i) {
    tile_max[i] = -INFINITY;
    CUTE_UNROLL
    for (int j = 0; j < size<1>(s_rc); ++j) {
      const bool visible = n0 + get<1>(c_rc(i, j)) < key_limit[i];
      s_rc(i, j) = visible ? s_rc(i, j) * scale_log2 : -INFINITY;
      tile_max[i] = fmaxf(tile_max[i], s_rc(i, j));
    }
  }
}

// The online-softmax step: moves each row's running max to include tile_max, turns the scores
// into exp2(s - max), and rescales the running sum and the O accumulator rows.
template <int kRows, class STensor, class OTensor>
CUTE_DEVICE void online_softmax_step(STensor& s_rc, OTensor& o_rc, float (&row_max)[kRows], float (&row_sum)[kRows],
                                     const float (&tile_max)[kRows]) {
  CUTE_UNROLL
  for (int i = 0; i < kRows; ++i) {
    const float m_next = fmaxf(row_max[i], tile_max[i]);
    const float m_use = m_next == -INFINITY ? 0.f : m_next;  // a row with no key yet stays at 0
    const float correction = exp2f(row_max[i] - m_use);
    row_max[i] = m_next;
    float sum = 0.f;
    CUTE_UNROLL
    for (int j = 0; j < size<1>(s_rc); ++j) {
      s_rc(i, j) = exp2f(s_rc(i, j) - m_use);
      sum += s_rc(i, j);
    }
    row_sum[i] = row_sum[i] * correction + sum;
    CUTE_UNROLL
    for (int j = 0; j < size<1>(o_rc); ++j) o_rc(i, j) *= correction;
  }
}

// Writes a CTA's finished rows: with one split the normalised O (and lse), otherwise the
// partial O, m and l of params.h's contract. o_rc, c_rc: (ROWS, (2, COL_PAIRS)) fp32 values
// and their (row, col) tile coordinates; row_max in base-2 units, row_sum the full row sum.
template <int kHeadDim, class Element, int kRows, class OTensor, class CTensor>
CUTE_DEVICE void store_rows(const SplitParams& p, OTensor const& o_rc, CTensor const& c_rc,
                            const float (&row_max)[kRows], const float (&row_sum)[kRows], int row0, int b, int h_kv,
                            int split, bool writes_stats) {
  constexpr int kColPairs = decltype(size<1>(o_rc))::value / 2;
  CUTE_UNROLL
  for (int i = 0; i < kRows; ++i) {
    const int row = row0 + get<0>(c_rc(i, 0));
    if (row >= p.packed_rows) continue;
    const int q_idx = row / p.group;
    const int h_q = h_kv * p.group + row % p.group;
    const bool empty = row_sum[i] == 0.f;
    if (p.num_splits == 1) {
      const float inv = empty ? 0.f : 1.f / row_sum[i];
      Element* o_row = static_cast<Element*>(p.out) + b * p.o_batch_stride + q_idx * p.o_row_stride +
                       h_q * p.o_head_stride;
      CUTE_UNROLL
      for (int j = 0; j < kColPairs; ++j) {
        const int col = get<1>(c_rc(i, make_coord(0, j)));
        Element pair[2] = {Element(o_rc(i, make_coord(0, j)) * inv), Element(o_rc(i, make_coord(1, j)) * inv)};
        *reinterpret_cast<uint32_t*>(o_row + col) = *reinterpret_cast<uint32_t*>(pair);
      }
      if (p.lse != nullptr && writes_stats) {
        p.lse[(int64_t(b) * p.q_heads + h_q) * p.q_len + q_idx] =
            empty ? -INFINITY : row_max[i] * kLn2 + logf(row_sum[i]);
      }
    } else {
      const int64_t ws_row = ((int64_t(split) * p.batch + b) * p.kv_heads + h_kv) * p.packed_rows + row;
      float* o_ws = p.ws_o + ws_row * kHeadDim;
      CUTE_UNROLL
      for (int j = 0; j < kColPairs; ++j) {
        const int col = get<1>(c_rc(i, make_coord(0, j)));
        *reinterpret_cast<float2*>(o_ws + col) = make_float2(o_rc(i, make_coord(0, j)), o_rc(i, make_coord(1, j)));
      }
      if (writes_stats) {
        p.ws_m[ws_row] = empty ? -INFINITY : row_max[i] * kLn2;
        p.ws_l[ws_row] = row_sum[i];
      }
    }
  }
}

}  // namespace splitkv
