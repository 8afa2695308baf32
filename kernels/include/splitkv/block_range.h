// Which work one split CTA does: its (query tile, batch, KV head, split), its sequence's live
// length and split count, and its key range (params.h's contract; the rules are rules.h's).
#pragma once

#include <cute/tensor.hpp>

#include "splitkv/params.h"

namespace splitkv {

// Query tile m_block of (batch b, KV head h_kv); split `split` of its sequence's num_splits,
// over keys [range.x, range.y) of the sequence's kv_len live keys, in n_tiles tiles of block_kv.
struct SplitCta {
  int m_block, b, h_kv, split, row0;
  int kv_len, num_splits;
  int2 range;
  int n_tiles;
};

// Splits of sequence b: the launch's count, or for a paged / variable-length batch the count
// its live length gives (rules::live_splits). kv_len: its live length.
CUTE_DEVICE int sequence_splits(const int* seqlens, int num_splits, int block_kv, int min_blocks_per_split,
                                int kv_len) {
  return seqlens == nullptr ? num_splits : rules::live_splits(kv_len, block_kv, min_blocks_per_split, num_splits);
}

// The CTA at (blockIdx.x, blockIdx.y, z) for a sequence of kv_len keys. With live lengths the
// grid's z runs from the highest split down, so the splits that only long sequences have are
// scheduled first and the short sequences' single CTAs fill in behind them.
template <int kBlockM, int kBlockKV>
CUTE_DEVICE SplitCta plan_cta(const SplitParams& p, int kv_len) {
  SplitCta cta;
  cta.m_block = blockIdx.x;
  cta.b = blockIdx.y / p.kv_heads;
  cta.h_kv = blockIdx.y % p.kv_heads;
  cta.row0 = cta.m_block * kBlockM;
  cta.kv_len = kv_len;
  cta.num_splits = sequence_splits(p.seqlens, p.num_splits, kBlockKV, p.min_blocks_per_split, kv_len);
  cta.split = p.seqlens == nullptr ? int(blockIdx.z) : int(gridDim.z - 1 - blockIdx.z);
  const int kv_end = rules::tile_kv_end(p.causal, kv_len, p.q_len, p.group, p.packed_rows, cta.m_block);
  const rules::KeyRange r = rules::split_range(p.seqlens == nullptr ? p.split_policy : SplitPolicy::kBlocks,
                                               cta.split, cta.num_splits, kv_len, kv_end, kBlockKV);
  cta.range = make_int2(r.start, r.end);
  cta.n_tiles = r.end > r.start ? (r.end - r.start + kBlockKV - 1) / kBlockKV : 0;
  return cta;
}

}  // namespace splitkv
