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
// its live length gives (rules::live_splits) under the launch's plan knob min_blocks. kv_len:
// its live length.
CUTE_DEVICE int sequence_splits(const int* seqlens, int num_splits, int block_kv, int min_blocks, int kv_len) {
  return seqlens == nullptr ? num_splits : rules::live_splits(kv_len, block_kv, min_blocks, num_splits);
}

// Split `split` of query tile m_block of (b, h_kv), for a sequence of kv_len keys; min_blocks:
// the plan's knob (paged / variable-length launches).
template <int kBlockM, int kBlockKV>
CUTE_DEVICE SplitCta make_cta(const SplitParams& p, int m_block, int b, int h_kv, int split, int kv_len,
                              int min_blocks) {
  SplitCta cta;
  cta.m_block = m_block;
  cta.b = b;
  cta.h_kv = h_kv;
  cta.split = split;
  cta.row0 = m_block * kBlockM;
  cta.kv_len = kv_len;
  cta.num_splits = sequence_splits(p.seqlens, p.num_splits, kBlockKV, min_blocks, kv_len);
  const int kv_end = rules::tile_kv_end(p.causal, kv_len, p.q_len, p.group, p.packed_rows, m_block);
  const rules::KeyRange r = rules::split_range(p.seqlens == nullptr ? p.split_policy : SplitPolicy::kBlocks, split,
                                               cta.num_splits, kv_len, kv_end, kBlockKV);
  cta.range = make_int2(r.start, r.end);
  cta.n_tiles = r.end > r.start ? (r.end - r.start + kBlockKV - 1) / kBlockKV : 0;
  return cta;
}

// The CTA at (blockIdx.x, blockIdx.y, blockIdx.z) = (query tile, batch x KV head, split) of an
// equal-length launch. Paged / variable-length launches take their work from tile_scheduler.h.
template <int kBlockM, int kBlockKV>
CUTE_DEVICE SplitCta grid_cta(const SplitParams& p) {
  return make_cta<kBlockM, kBlockKV>(p, blockIdx.x, blockIdx.y / p.kv_heads, blockIdx.y % p.kv_heads, blockIdx.z,
                                     p.kv_len, p.min_blocks_per_split);
}

}  // namespace splitkv
