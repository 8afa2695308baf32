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
//   Workspace (fp32, sections 128-byte aligned): O[S][B][Hkv][Sq*G][D], m[S][B][Hkv][Sq*G], l[same],
//   then one int32, the plan's knob (below).
//   With num_splits == 1 the split kernel writes the final O (and lse) itself.
//   Fused merge (tile_counters != null): after writing its partial, each split CTA increments
//   tile_counters[(b * kv_heads + h_kv) * num_m_blocks + m_block] modulo num_splits; the CTA
//   that sees num_splits - 1 merges that tile's partials from the workspace and writes O and
//   lse. The increment wraps to 0 there, so counters zeroed once when allocated are zero again
//   after every launch.
// Paged / variable-length batches (seqlens != null): sequence b has seqlens[b] live keys and
//   its own split count S_b = rules::live_splits(seqlens[b], block_kv, M, num_splits) (num_splits
//   is then the bound that sizes the workspace), where M = rules::live_plan_min_blocks(seqlens,
//   batch, kv_heads * num_m_blocks, the grid's CTAs, block_kv, min_blocks_per_split, num_splits,
//   plan_choices): min_blocks_per_split itself when plan_choices is 1, otherwise the load-aware
//   choice, which CTA 0 also stores in the workspace's plan slot for the combine kernel. Ranges are kBlocks
//   over its live keys and causal masks aligned to its own end. Everything above holds per
//   sequence with S_b for num_splits: a sequence with S_b == 1 gets its final O from the split
//   kernel, and the merges fold S_b partials. The grid is persistent (rules::live_grid CTAs,
//   tile_scheduler.h); its work counters, like the tile counters, are zero again after every
//   launch.
//   With block_table, key n of sequence b is row n % page_size of page
//   block_table[b * block_table_stride + n / page_size] of the pools k and v
//   (num_pages, page_size, Hkv, D), whose page stride is k_batch_stride / v_batch_stride.
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
  int* __restrict__ work_counters;  // with seqlens: rules::kWorkCounters zeroed counters (tile_scheduler.h)

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

  const int* __restrict__ seqlens;      // [B] live lengths; null: every sequence has kv_len keys
  const int* __restrict__ block_table;  // [B, block_table_stride] page indices; null: contiguous k/v
  int64_t block_table_stride;
  int page_shift;                       // log2(page_size)
  int block_kv;                         // with seqlens: the plan's block size (the kernel's kBlockKV)
  int min_blocks_per_split;             // with seqlens: the plan's knob (rules::live_splits)
  int plan_choices;                     // with seqlens: 1, or the load-aware plan's choices (live_plan.h)
  int* __restrict__ ws_plan;            // with seqlens and num_splits > 1: the workspace's plan slot
};

// How an equal-length launch sits on the SMs (split_launch.h equal_residency): each CTA takes
// smem_bytes of dynamic shared memory, which holds a SM to ctas_per_sm CTAs (0: the kernel's own
// size, as many as fit: resident_per_sm, or 0 where the launch did not need to ask).
struct Residency {
  int ctas_per_sm, smem_bytes, resident_per_sm;
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
  // Paged / variable-length batches, as in SplitParams: sequence b has S_b partials, and rows of
  // sequences with S_b == 1 were written by the split kernel.
  const int* __restrict__ seqlens;
  int block_kv, min_blocks_per_split, plan_choices;
  const int* __restrict__ ws_plan;  // the split kernel's choice of min_blocks_per_split when plan_choices > 1
};

}  // namespace splitkv
