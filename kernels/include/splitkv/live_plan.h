// The load-aware plan of a paged / variable-length launch, and the persistent schedule's shared
// memory that holds its tallies: the rule that the CTAs of a launch compute together
// (tile_scheduler.h), the host serially (kernels/rules_binding.cpp for the reference and the
// selector, the exported C++ header, which embeds this file after rules.h), and the selector's
// model builds on (live_model.h). Plain C++17, as rules.h.
#pragma once

#include <cstdint>

#include "splitkv/rules.h"

namespace splitkv {
namespace rules {

// The load-aware plan of a paged / variable-length launch whose min_blocks_per_split is
// "load_aware" (splitkv_tune/live.py).
//
// Why: a launch whose splits are small for its batch gives every CTA several work items, and
// each item costs about two blocks' time of its own (its pipeline fill, epilogue and merge):
// 16 x 8K keys at 1024 keys per split (3.9 items per CTA) take 8% longer than at 4096 (one
// each), while large splits starve a batch of few sequences (docs/PERFORMANCE.md). No knob
// that ignores the lengths serves both, so the launch chooses min_blocks_per_split itself,
// from the lengths it reads anyway: among the knob times 1, 2, 4, ... (kLivePlanChoices at
// most, splits of at most kLivePlanMaxKeysPerSplit keys), the one whose schedule the estimate
// below finishes first, and the knob itself unless another gains kLivePlanMarginPct or its items
// fit the launch's CTAs (live_plan_fits_one_wave). The choice depends on every length of the
// batch, so a sequence's bits do too. Choosing costs every CTA time before its first item
// (0.2-0.4 us when the knob's items fit the CTAs; estimating, 2-3 us at 16-32 sequences and
// 4.6-6.1 us at 256-300), which is why it is not the "auto" knob (docs/PERFORMANCE.md).
//
// The estimate is a list-scheduling bound on the CTAs' finishing time: an item of p blocks
// costs p * rate + kLivePlanItemKeys / block_kv blocks; the rate is 1 when the items fill the
// grid and falls to kLivePlanRateFloor16 / 16 as they leave CTAs idle (fewer CTAs share the
// bandwidth); and the finish is at least the mean load per CTA,
// the largest item, and, for each wave k the items spill into, k + 1 items of the size at rank
// k x CTAs (some CTA holds k + 1 of the first k x CTAs + 1 items; the largest item of that
// size class stands for it). The constants come from fitting that schedule to 409 H200 timings
// of 20 batches at up to 25 knob pairs each (tools/plan_model.py fit: 2.14 blocks of 64 keys per
// item, rate floor 11.4/16, 10% RMS error); on 44 batches timed at every choice, the choice's
// mean gap to the best knob was 3.8% where the knob alone's was 9.5% (docs/PERFORMANCE.md).
inline constexpr int kLivePlanChoices = 5;
inline constexpr int kLivePlanMaxKeysPerSplit = 4096;
inline constexpr int kLivePlanItemKeys = 128;
inline constexpr int kLivePlanRateFloor16 = 11;
inline constexpr int kLivePlanMarginPct = 5;
inline constexpr int kLivePlanMaxWaves = 16;

// How many knobs the plan chooses among: min_blocks_per_split << j for j < the count.
SPLITKV_HOST_DEVICE constexpr int live_plan_choices(int min_blocks_per_split, int block_kv) {
  int n = 1;
  while (n < kLivePlanChoices && (int64_t(min_blocks_per_split) << n) * block_kv <= kLivePlanMaxKeysPerSplit) ++n;
  return n;
}

// One choice's tally of the batch, per size class: its splits (per query tile and KV head) and
// the blocks of its largest split.
struct LivePlanTally {
  int splits[kSizeClasses];
  int max_blocks[kSizeClasses];
};

// What one sequence of live_len keys adds to the tally of knob min_blocks: its live_splits
// splits of blocks_per_split blocks (rounded up), in that size's class.
struct LivePlanShare {
  int size_class, splits, blocks_per_split;
};

SPLITKV_HOST_DEVICE constexpr LivePlanShare live_plan_share(int live_len, int block_kv, int min_blocks,
                                                             int max_splits) {
  const int splits = live_splits(live_len, block_kv, min_blocks, max_splits);
  const int per_split = ceil_div(ceil_div(live_len, block_kv), splits);
  return LivePlanShare{size_class(per_split), splits, per_split};
}

// The estimate's parts, in 1/16 of a block's streaming time. The rate of `items` items on `ctas`
// CTAs: 16 when they fill the grid, less (faster) when they leave CTAs idle: from idle16 (no
// items, extrapolated) to 16 in proportion to items / ctas, and never under floor16. The plan's
// (kLivePlanRate): idle16 0, the idle CTAs' bandwidth going to the busy ones, down to the floor
// of a CTA's own speed; the selector's model at one CTA per SM has its own (live_model.h live_model_rate).
struct LivePlanRate {
  int idle16, floor16;
};
inline constexpr LivePlanRate kLivePlanRate{0, kLivePlanRateFloor16};

SPLITKV_HOST_DEVICE constexpr int live_plan_rate(int64_t items, int64_t ctas, LivePlanRate rate_rule = kLivePlanRate) {
  if (items >= ctas) return 16;
  // items < ctas <= kMaxLiveCtas: 32-bit arithmetic
  const int rate = rate_rule.idle16 + (16 - rate_rule.idle16) * int(items) / int(ctas);
  return rate < rate_rule.floor16 ? rate_rule.floor16 : rate;
}

// An item's own cost, beside its keys.
SPLITKV_HOST_DEVICE constexpr int64_t live_plan_item_cost(int block_kv) {
  return 16 * int64_t(kLivePlanItemKeys) / block_kv;
}

// One item of `blocks` blocks at that rate, its own cost included.
SPLITKV_HOST_DEVICE constexpr int64_t live_plan_item_time(int64_t blocks, int64_t rate, int block_kv) {
  return blocks * rate + live_plan_item_cost(block_kv);
}

// The estimate's bounds that need no order of the items, times ctas: the mean load per CTA of
// `items` items over the batch's `blocks` blocks (per query tile and KV head; tiles of each), and
// the largest item's time.
SPLITKV_HOST_DEVICE constexpr int64_t live_plan_base(int64_t blocks, int64_t tiles, int64_t items, int largest,
                                                     int64_t rate, int64_t ctas, int block_kv) {
  const int64_t load = blocks * tiles * rate + items * live_plan_item_cost(block_kv);
  const int64_t longest = ctas * live_plan_item_time(largest, rate, block_kv);
  return load > longest ? load : longest;
}

// Wave k's bound, times ctas: k + 1 items of wave_blocks blocks on one CTA.
SPLITKV_HOST_DEVICE constexpr int64_t live_plan_wave_bound(int k, int wave_blocks, int64_t rate, int64_t ctas,
                                                           int block_kv) {
  return ctas * (k + 1) * live_plan_item_time(wave_blocks, rate, block_kv);
}

// The estimate of one choice, times ctas (so that it needs no division; the choices of a launch
// share ctas): the batch's `blocks` live blocks in all (sum of ceil(len / block_kv)); tiles =
// kv_heads * query tiles per sequence, ctas = the launch's grid. In int64: the launch has under
// 2^30 items (bindings.cpp) of at most 2^26 blocks, and at most kMaxLiveCtas (2^21) CTAs.
SPLITKV_HOST_DEVICE constexpr int64_t live_plan_estimate(const LivePlanTally& t, int64_t blocks, int64_t tiles,
                                                         int64_t ctas, int block_kv,
                                                         LivePlanRate rate_rule = kLivePlanRate) {
  int64_t items = 0;
  int largest = 0;
  for (int c = 0; c < kSizeClasses; ++c) {
    items += int64_t(t.splits[c]) * tiles;
    largest = largest > t.max_blocks[c] ? largest : t.max_blocks[c];
  }
  const int64_t rate = live_plan_rate(items, ctas, rate_rule);
  int64_t finish = live_plan_base(blocks, tiles, items, largest, rate, ctas, block_kv);
  // Wave k's rank k * ctas lies in the class where the running count of items passes it.
  int64_t before = 0;
  int c = 0;
  for (int k = 1; k <= kLivePlanMaxWaves && int64_t(k) * ctas < items; ++k) {
    while (before + int64_t(t.splits[c]) * tiles <= int64_t(k) * ctas) before += int64_t(t.splits[c++]) * tiles;
    const int64_t bound = live_plan_wave_bound(k, t.max_blocks[c], rate, ctas, block_kv);
    finish = finish > bound ? finish : bound;
  }
  return finish;
}

// The choice among estimates[0, n): the least (the first of equals), unless it gains under
// kLivePlanMarginPct on estimates[0], the knob itself.
SPLITKV_HOST_DEVICE constexpr int live_plan_pick(const int64_t* estimates, int n) {
  int best = 0;
  for (int j = 1; j < n; ++j) best = estimates[j] < estimates[best] ? j : best;
  return estimates[best] * 100 <= estimates[0] * (100 - kLivePlanMarginPct) ? best : 0;
}

// live_plan_estimate of the knobs (block_kv, min_blocks, max_splits) for a batch of `batch` live
// lengths, serially (their tally, then the estimate): what each CTA of a load-aware launch
// computes per choice (tile_scheduler.h), for the host.
template <class Length>
SPLITKV_HOST_DEVICE constexpr int64_t live_plan_knob_estimate(const Length* lengths, int batch, int64_t tiles,
                                                              int64_t ctas, int block_kv, int min_blocks,
                                                              int max_splits, LivePlanRate rate_rule = kLivePlanRate) {
  int64_t blocks = 0;
  LivePlanTally t{};
  for (int b = 0; b < batch; ++b) {
    const int len = int(lengths[b]);
    blocks += ceil_div(len, block_kv);
    const LivePlanShare s = live_plan_share(len, block_kv, min_blocks, max_splits);
    t.splits[s.size_class] += s.splits;
    t.max_blocks[s.size_class] =
        t.max_blocks[s.size_class] > s.blocks_per_split ? t.max_blocks[s.size_class] : s.blocks_per_split;
  }
  return live_plan_estimate(t, blocks, tiles, ctas, block_kv, rate_rule);
}

// Whether the knob's items (live_splits per sequence, times tiles) fit the launch's CTAs, one
// item each. Such a launch keeps the knob without estimating the others: a coarser knob only
// lengthens the longest item, and estimating costs every CTA about 2 us before its first
// item, the whole of a small batch's loss to the knob as given (docs/PERFORMANCE.md: 1 x 4K
// 15.5 against 13.4 us). The estimate did coarsen some such batches (1 x 32K at 8 KV heads, m4 to
// m16: 43.5 against 41.1 us), from the rate it gives items that leave CTAs idle.
SPLITKV_HOST_DEVICE constexpr bool live_plan_fits_one_wave(const int* lengths, int batch, int64_t tiles,
                                                           int64_t ctas, int block_kv, int min_blocks,
                                                           int max_splits) {
  int64_t splits = 0;
  for (int b = 0; b < batch; ++b) splits += live_splits(lengths[b], block_kv, min_blocks, max_splits);
  return splits * tiles <= ctas;
}

// The plan's min_blocks_per_split for a batch of `batch` live lengths, serially: what the CTAs
// of the launch compute together (tile_scheduler.h), for the host (the reference, the exported
// selector). choices: live_plan_choices(min_blocks, block_kv), or 1 for the knob as given.
SPLITKV_HOST_DEVICE constexpr int live_plan_min_blocks(const int* lengths, int batch, int64_t tiles, int64_t ctas,
                                                       int block_kv, int min_blocks, int max_splits, int choices) {
  if (choices <= 1) return min_blocks;
  if (live_plan_fits_one_wave(lengths, batch, tiles, ctas, block_kv, min_blocks, max_splits)) return min_blocks;
  int64_t estimates[kLivePlanChoices] = {};
  for (int j = 0; j < choices; ++j) {
    estimates[j] = live_plan_knob_estimate(lengths, batch, tiles, ctas, block_kv, min_blocks << j, max_splits);
  }
  return min_blocks << live_plan_pick(estimates, choices);
}

// The persistent schedule of a paged / variable-length launch (tile_scheduler.h). Its shared
// memory, after the split kernel's own: a header (the next work item, the one-wave check's split
// count, the batch's live blocks for the plan's estimates: 8-byte aligned), the sequences' size
// classes counted per warp, the batch in schedule order and that order's prefix of splits, then,
// when the launch chooses its knob, the plan's tallies and estimates (8-byte aligned).
inline constexpr int kScheduleHeaderInts = 4;
SPLITKV_HOST_DEVICE constexpr int live_schedule_ints(int batch) {
  return (kScheduleHeaderInts + kNumWarps * kSizeClasses + 2 * batch + 1 + 1) / 2 * 2;
}
SPLITKV_HOST_DEVICE constexpr int live_schedule_bytes(int batch, int plan_choices) {
  const int plan = plan_choices > 1 ? kLivePlanChoices * int(sizeof(LivePlanTally) + sizeof(int64_t)) : 0;
  return (4 * live_schedule_ints(batch) + plan + 15) / 16 * 16;
}

}  // namespace rules
}  // namespace splitkv
