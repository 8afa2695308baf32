// The online softmax of a split CTA's rows: their running max and sum, the step over one score
// tile, and the exchange of row values between the threads and warps that share a row.
#pragma once

#include <cute/tensor.hpp>

#include "splitkv/utils.h"

namespace splitkv {

using namespace cute;

// A row's state before its first key: max -inf, sum 0.
template <int kRows>
CUTE_DEVICE void init_softmax(float (&row_max)[kRows], float (&row_sum)[kRows]) {
  CUTE_UNROLL
  for (int i = 0; i < kRows; ++i) {
    row_max[i] = -INFINITY;
    row_sum[i] = 0.f;
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

}  // namespace splitkv
