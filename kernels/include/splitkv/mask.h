// Which keys a query row may see: the split's end, and the causal diagonal aligned to the end
// of the row's own sequence (bottom-right: query i sees keys j <= i + kv_len - q_len).
#pragma once

#include <cute/tensor.hpp>

#include "splitkv/block_range.h"
#include "splitkv/params.h"

namespace splitkv {

using namespace cute;

// The first key each of the thread's rows may not see. rc: (ROWS, COLS) tile coordinates.
template <int kRows, class RowCoords>
CUTE_DEVICE void key_limits(const SplitParams& p, const SplitCta& cta, RowCoords const& rc, int (&key_limit)[kRows]) {
  CUTE_UNROLL
  for (int i = 0; i < kRows; ++i) {
    const int q_idx = (cta.row0 + get<0>(rc(i, 0))) / p.group;
    key_limit[i] = p.causal ? min(cta.range.y, q_idx + 1 + cta.kv_len - p.q_len) : cta.range.y;
  }
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

}  // namespace splitkv
