// Launch parameters of the split and combine kernels. Plain C++: no torch, no CuTe.
//
// Numeric contract of the partials (tested in tests/test_reference.py and tests/test_kernel_gpu.py):
//   x_j = softmax_scale * <q, k_j>, natural-log units.
//   For split s over keys [start, end) of packed row r:
//     m_s = max_j x_j            (-inf when the split has no unmasked key)
//     l_s = sum_j exp(x_j - m_s) (0 when empty)
//     O_s = sum_j exp(x_j - m_s) v_j, fp32, NOT divided by l_s (0 when empty)
//   Merge: m = max m_s; l = sum exp(m_s - m) l_s; O = sum exp(m_s - m) O_s / l; lse = m + log(l).
//   Splits with l_s == 0 are skipped; a row with no key writes O = 0 and lse = -inf.
//   Packed rows: r = q_idx * G + g is query q_idx of query head h_kv * G + g (G = Hq / Hkv).
//   Workspace (fp32, sections 128-byte aligned): O[S][B][Hkv][Sq*G][D], m[S][B][Hkv][Sq*G], l[same].
//   With num_splits == 1 the split kernel writes the final O (and lse) itself.
//   Fused merge (tile_counters != null): after writing its partial, each split CTA increments
//   tile_counters[(b * kv_heads + h_kv) * num_m_blocks + m_block] modulo num_splits; the CTA
//   that sees num_splits - 1 merges that tile's partials from the workspace and writes O and
//   lse. The increment wraps to 0 there, so counters zeroed once when allocated are zero again
//   after every launch.
#pragma once

#include <cstdint>

#include "splitkv/rules.h"

namespace splitkv {

struct SplitParams {
  const void* __restrict__ q;  // (B, Sq, Hq, D)
  const void* __restrict__ k;  // (B, Sk, Hkv, D)
  const void* __restrict__ v;  // (B, Sk, Hkv, D)
  void* __restrict__ out;      // (B, Sq, Hq, D), written when num_splits == 1
  float* __restrict__ lse;     // (B, Hq, Sq) contiguous, may be null; written when num_splits == 1
  float* __restrict__ ws_o;    // partial O, see the contract above
  float* __restrict__ ws_m;
  float* __restrict__ ws_l;
  int* __restrict__ tile_counters;  // fused merge, see above; null: the combine kernel merges

  int64_t q_batch_stride, q_row_stride, q_head_stride;
  int64_t k_batch_stride, k_row_stride, k_head_stride;
  int64_t v_batch_stride, v_row_stride, v_head_stride;
  int64_t o_batch_stride, o_row_stride, o_head_stride;

  int batch, q_heads, kv_heads, group;  // group = q_heads / kv_heads
  int q_len, kv_len, packed_rows;       // packed_rows = q_len * group
  int num_splits, num_m_blocks;
  float softmax_scale;                  // natural units
  float scale_log2;                     // softmax_scale * log2(e)
  bool causal;                          // bottom-right aligned: query i sees keys j <= i + kv_len - q_len
  SplitPolicy split_policy;
};

struct CombineParams {
  const float* __restrict__ ws_o;
  const float* __restrict__ ws_m;
  const float* __restrict__ ws_l;
  void* __restrict__ out;  // (B, Sq, Hq, D)
  float* __restrict__ lse; // (B, Hq, Sq) contiguous, may be null
  int64_t o_batch_stride, o_row_stride, o_head_stride;
  int batch, kv_heads, group, q_len, packed_rows, num_splits;
  int64_t total_rows;  // batch * kv_heads * packed_rows
};

}  // namespace splitkv
