// How a split CTA's finished rows leave: the final O (and lse) when its sequence has one split,
// otherwise the partial O, m and l of params.h's contract.
#pragma once

#include <cute/tensor.hpp>

#include "splitkv/block_range.h"
#include "splitkv/params.h"

namespace splitkv {

using namespace cute;

inline constexpr float kLn2 = 0.693147180559945309f;

// o_rc, c_rc: (ROWS, (2, COL_PAIRS)) fp32 values and their (row, col) tile coordinates;
// row_max in base-2 units, row_sum the full row sum.
template <int kHeadDim, class Element, int kRows, class OTensor, class CTensor>
CUTE_DEVICE void store_rows(const SplitParams& p, const SplitCta& cta, OTensor const& o_rc, CTensor const& c_rc,
                            const float (&row_max)[kRows], const float (&row_sum)[kRows], bool writes_stats) {
  constexpr int kColPairs = decltype(size<1>(o_rc))::value / 2;
  CUTE_UNROLL
  for (int i = 0; i < kRows; ++i) {
    const int row = cta.row0 + get<0>(c_rc(i, 0));
    if (row >= p.packed_rows) continue;
    const int q_idx = row / p.group;
    const int h_q = cta.h_kv * p.group + row % p.group;
    const bool empty = row_sum[i] == 0.f;
    if (cta.num_splits == 1) {
      const float inv = empty ? 0.f : 1.f / row_sum[i];
      Element* o_row = static_cast<Element*>(p.out) + cta.b * p.o_batch_stride + q_idx * p.o_row_stride +
                       h_q * p.o_head_stride;
      CUTE_UNROLL
      for (int j = 0; j < kColPairs; ++j) {
        const int col = get<1>(c_rc(i, make_coord(0, j)));
        Element pair[2] = {Element(o_rc(i, make_coord(0, j)) * inv), Element(o_rc(i, make_coord(1, j)) * inv)};
        *reinterpret_cast<uint32_t*>(o_row + col) = *reinterpret_cast<uint32_t*>(pair);
      }
      if (p.lse != nullptr && writes_stats) {
        p.lse[(int64_t(cta.b) * p.q_heads + h_q) * p.q_len + q_idx] =
            empty ? -INFINITY : row_max[i] * kLn2 + logf(row_sum[i]);
      }
    } else {
      const int64_t ws_row = ((int64_t(cta.split) * p.batch + cta.b) * p.kv_heads + cta.h_kv) * p.packed_rows + row;
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
