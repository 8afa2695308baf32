// The selector's model of a paged / variable-length launch: the knobs it takes for a batch that
// its table has no class near. Host-side only (the selector, the exported C++ header, through
// kernels/rules_binding.cpp for Python); the kernels never call it. Built on the load-aware
// plan's estimate in live_plan.h, so the model and the plan share one schedule arithmetic.
#pragma once

#include <cstdint>

#include "splitkv/live_plan.h"
#include "splitkv/rules.h"

namespace splitkv {
namespace rules {

// The selector's knobs for a batch that its table has no class near (batch_select.py, the
// exported header): the fixed-plan point that a model of the launch finishes first, for the
// host, not the kernel. Candidates: block_kv kLiveDefaultBlockKV, min_blocks_per_split in
// kLiveModelMinBlocks x max_splits in kLiveModelMaxSplits (the batch sweeps' space) and, at one
// CTA per SM, the one-wave split count (live_model_wave_splits), and the "auto" knobs. A
// candidate's score, in 1/16 of a block's streaming time: the load-aware plan's estimate on the
// GPU's resident CTAs (num_sms x ctas_per_sm, whatever the candidate's grid: the rate's
// reference, as in the fit of its constants) at the rate of live_model_rate,
// per CTA, plus kLiveModelMergeCost16 per split of the batch's most-split sequence (the merge
// that ends its tile reads every split; the plan's estimate leaves it out, as the plan's choices
// share one bound). The least score wins; equal scores go to fewer max_splits, then fewer
// min_blocks_per_split. Why a model rather than "auto": replayed on the H200 batch sweeps' timed
// points (tools/plan_model.py rank), its choice had 2.3% geometric-mean regret on the 50 batches
// of batches.csv, batches_dense.csv and batches_split_plan.csv, which the merge cost was chosen
// on, and 2.2% (max 6.6%) on the 12 held-out batches of holdout.csv, where "auto" had 10.7% and
// 8.5% (docs/PERFORMANCE.md).
inline constexpr int kLiveModelMinBlocks[] = {1, 2, 4, 8, 16};
inline constexpr int kLiveModelMaxSplits[] = {8, 16, 32, 64};
inline constexpr int kLiveModelMergeCost16 = 1;

// The model's rate. With two or more CTAs per SM, a CTA that the items leave idle hands its
// share of the SM's bandwidth to the CTAs beside it, and the plan's rate (fitted there) holds.
// With one CTA per SM an idle CTA is an idle SM, and the busy SMs gain far less, the less the
// more of them there are: the rate runs from kLiveModelRateIdleOneCta16 (a lone item) to 16 (a
// full grid) in proportion to the items. On the H200 at head dim 256 (one CTA per SM), 4 x 24000
// keys with one KV head ran 96 items of 1000 keys in 47.3 us and 128 of 750 in 40.3 (1.33x the
// keys per item in 1.17x the time); 12 x 8000 keys with 8 KV heads ran 96 items of 8000 keys in
// 284 us (96 of 132 SMs busy) and 384 of 2000 in 225 (at most 3 per SM: 8000 keys per busy SM
// against 6000, in 1.26x the time).
// Fitted on the 46 head-dim-256 batches of the head-dim sweep and the held-out sets up to the
// fourth (docs/PERFORMANCE.md). Its floor is its idle value: the line never falls under it, and a
// lower floor would only matter for the plan's rate, whose line starts at 0.
inline constexpr int kLiveModelRateIdleOneCta16 = 13;
SPLITKV_HOST_DEVICE constexpr LivePlanRate live_model_rate(int ctas_per_sm) {
  return ctas_per_sm > 1 ? kLivePlanRate : LivePlanRate{kLiveModelRateIdleOneCta16, kLiveModelRateIdleOneCta16};
}

struct LiveModelKnobs {
  int min_blocks_per_split, max_splits;
  int64_t score;
};

// Whether the model takes a batch: live_knob_args_ok's counts, ctas_per_sm in [1, kMaxCtasPerSm]
// and the batch's blocks of kLiveDefaultBlockKV keys times its tiles within kLiveModelMaxWork,
// where every estimate fits in int64 (a batch far beyond any GPU's memory fails only this).
inline constexpr int64_t kLiveModelMaxWork = int64_t(1) << 40;
SPLITKV_HOST_DEVICE constexpr bool live_model_args_ok(int64_t batch, int64_t kv_heads, int64_t packed_rows,
                                                      int64_t num_sms, int64_t ctas_per_sm, int64_t total_blocks) {
  return live_knob_args_ok(batch, kv_heads, packed_rows, num_sms) && ctas_per_sm >= 1 &&
         ctas_per_sm <= kMaxCtasPerSm && total_blocks >= 0 &&
         total_blocks <= kLiveModelMaxWork / (kv_heads * num_m_blocks(int(packed_rows)));
}

// The score of one candidate (above), for arguments that live_model_args_ok takes and
// min_blocks, max_splits >= 1.
template <class Length>
SPLITKV_HOST_DEVICE constexpr int64_t live_model_score(const Length* lengths, int batch, int kv_heads,
                                                       int packed_rows, int num_sms, int ctas_per_sm,
                                                       int min_blocks, int max_splits) {
  const int block_kv = kLiveDefaultBlockKV;
  const int64_t tiles = int64_t(kv_heads) * num_m_blocks(packed_rows);
  const int64_t ctas = int64_t(num_sms) * ctas_per_sm;
  // The most-split sequence is the longest: live_splits grows with the length.
  int longest = 0;
  for (int b = 0; b < batch; ++b) longest = longest > int(lengths[b]) ? longest : int(lengths[b]);
  return live_plan_knob_estimate(lengths, batch, tiles, ctas, block_kv, min_blocks, max_splits,
                                 live_model_rate(ctas_per_sm)) / ctas +
         int64_t(kLiveModelMergeCost16) * live_splits(longest, block_kv, min_blocks, max_splits);
}

// The one-wave split count: the resident CTAs (num_sms x ctas_per_sm) over the query tiles of
// the batch's live sequences, at most the space's largest max_splits and at least 1 (one split
// per tile when the tiles fill a wave alone: more splits only add items and merges behind a full
// wave); 0 when there are none.
// Why, at one CTA per SM only: there a launch whose items leave SMs idle gains little speed for
// it (live_model_rate), so the split count whose items fill one wave exactly can beat every
// power of two (on the H200, 5 x 20000 keys at head dim 256, Hq/Hkv 8/4: 6 splits, 120 items on
// 132 CTAs, in 121.9 us; the space's best point, 32 splits, took 142.3; 24 x 5000 keys, Hq/Hkv
// 16/16, 4 queries: 384 tiles, one split each, 0.2% from the best point where the space's
// choice was 10.3%). With two CTAs per SM the candidate made the held-out regret worse
// (docs/PERFORMANCE.md).
template <class Length>
SPLITKV_HOST_DEVICE constexpr int live_model_wave_splits(const Length* lengths, int batch, int kv_heads,
                                                         int packed_rows, int num_sms, int ctas_per_sm) {
  int64_t live = 0;
  for (int b = 0; b < batch; ++b) live += int(lengths[b]) > 0;
  const int64_t tiles = live * kv_heads * num_m_blocks(packed_rows);
  if (tiles == 0) return 0;
  const int64_t splits = int64_t(num_sms) * ctas_per_sm / tiles;
  constexpr int most = kLiveModelMaxSplits[sizeof(kLiveModelMaxSplits) / sizeof(int) - 1];
  return splits > most ? most : splits < 1 ? 1 : int(splits);
}

// The one-wave candidate of live_model_knobs: the one-wave split count at one CTA per SM, else 0
// (none).
template <class Length>
SPLITKV_HOST_DEVICE constexpr int live_model_wave_candidate(const Length* lengths, int batch, int kv_heads,
                                                            int packed_rows, int num_sms, int ctas_per_sm) {
  return ctas_per_sm == 1 ? live_model_wave_splits(lengths, batch, kv_heads, packed_rows, num_sms, ctas_per_sm) : 0;
}

// The least-score candidate (above), with its score.
template <class Length>
SPLITKV_HOST_DEVICE constexpr LiveModelKnobs live_model_knobs(const Length* lengths, int batch, int kv_heads,
                                                              int packed_rows, int num_sms, int ctas_per_sm) {
  const int auto_min_blocks = live_min_keys_per_split(batch, kv_heads, packed_rows, num_sms) / kLiveDefaultBlockKV;
  LiveModelKnobs best{auto_min_blocks > 1 ? auto_min_blocks : 1,
                      live_max_splits(batch, kv_heads, packed_rows, num_sms), 0};
  best.score = live_model_score(lengths, batch, kv_heads, packed_rows, num_sms, ctas_per_sm,
                                best.min_blocks_per_split, best.max_splits);
  const int wave = live_model_wave_candidate(lengths, batch, kv_heads, packed_rows, num_sms, ctas_per_sm);
  constexpr int space = sizeof(kLiveModelMaxSplits) / sizeof(int);
  for (int i = wave > 0 ? -1 : 0; i < space; ++i) {
    const int max_splits = i < 0 ? wave : kLiveModelMaxSplits[i];
    for (int min_blocks : kLiveModelMinBlocks) {
      const int64_t score =
          live_model_score(lengths, batch, kv_heads, packed_rows, num_sms, ctas_per_sm, min_blocks, max_splits);
      const bool better = score != best.score ? score < best.score
                          : max_splits != best.max_splits ? max_splits < best.max_splits
                                                          : min_blocks < best.min_blocks_per_split;
      if (better) best = LiveModelKnobs{min_blocks, max_splits, score};
    }
  }
  return best;
}

}  // namespace rules
}  // namespace splitkv
