// The rules that the kernels and the host side both need, defined once. Plain C++17 constexpr:
// no CUDA, no CuTe, no torch. The kernels call them on the device; the binding
// (kernels/rules_binding.cpp, compiled with the host compiler alone) exposes them to Python as
// splitkv_tune._rules, which tunables.py, the reference, the selector and the launch path call
// instead of copies of their own; the exported C++ selector embeds this file.
#pragma once

#include <cstdint>

#include "splitkv/tunables.h"

#if defined(__CUDACC__)
#define SPLITKV_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define SPLITKV_HOST_DEVICE inline
#endif

namespace splitkv {

// Codes of the element types and split policies, as the launch arguments carry them.
enum class DType : int { kFp16 = 0, kBf16 = 1 };
enum class SplitPolicy : int { kLength = 0, kBlocks = 1 };
// The split policies' names in the Python API, by code.
inline constexpr const char* kSplitPolicyNames[] = {"length", "blocks"};

namespace rules {

struct WarpLayout {
  int m, n;  // warps along the query rows and along the keys of a tile
};

struct KeyRange {
  int start, end;  // keys [start, end); end <= start is an empty split
};

SPLITKV_HOST_DEVICE constexpr int ceil_div(int a, int b) { return (a + b - 1) / b; }

// Keys one sequence may hold: the block and split arithmetic below (a length plus a block, a
// tile's first key plus a block) is int32 and must not overflow.
inline constexpr int kMaxKeys = int((int64_t(1) << 31) - 256);

// Packed query rows per CTA. A 128-row tile would hold 256 fp32 accumulators per thread with
// 4 warps and spill.
SPLITKV_HOST_DEVICE constexpr int block_m_for(int packed_rows) { return packed_rows <= 16 ? 16 : 64; }

SPLITKV_HOST_DEVICE constexpr int num_m_blocks(int packed_rows) {
  return ceil_div(packed_rows, block_m_for(packed_rows));
}

// Decode tiles (16 rows) put all warps along the keys so every warp streams keys; taller tiles
// put them along the rows, as FlashAttention-2 does.
SPLITKV_HOST_DEVICE constexpr WarpLayout warp_layout(int block_m) {
  return block_m == 16 ? WarpLayout{1, kNumWarps} : WarpLayout{kNumWarps, 1};
}

// Whether each warp owns its own keys of every K/V stage (decode_mainloop.h): it needs warps
// along the keys and at least 16 keys per warp (the k of the P V MMA). Otherwise the warps
// share each key block and exchange row statistics and P through shared memory (tile_mainloop.h).
SPLITKV_HOST_DEVICE constexpr bool warps_own_keys(int block_m, int block_kv) {
  return warp_layout(block_m).n > 1 && block_kv % (16 * warp_layout(block_m).n) == 0;
}

// Shared memory of one split-kernel CTA: the Q tile and kKVStages stages of K and V, plus the
// P tile and the row exchange (max and sum per warp along the keys) when the warps share keys.
SPLITKV_HOST_DEVICE constexpr int smem_bytes(int element_bytes, int head_dim, int block_m, int block_kv) {
  const int warps_n = warp_layout(block_m).n;
  const bool exchanges = warps_n > 1 && !warps_own_keys(block_m, block_kv);
  const int elems = block_m * head_dim + 2 * kKVStages * block_kv * head_dim + (exchanges ? block_m * block_kv : 0);
  return element_bytes * elems + (exchanges ? 4 * 2 * warps_n * block_m : 0);
}

// Registers per thread of the equal-length split kernel on sm_90 (ptxas of nvcc 13.0, the build's
// flags; fp16 and bf16 alike), by head dim, query-tile height and block_kv: what the register
// file lets an SM hold of it (register_residency) is the analytic model's residency besides
// shared memory, on every GPU profile (sm_80 builds allocate differently; not measured).
// tools/kernel_registers.py prints these counts from every instantiation, and
// tests/test_build.py checks them against the ptxas report of the instantiations it compiles.
// Arguments are those of an instantiation (codegen.split_instances): D = 256 at block_kv 128
// (255, a placeholder) has none, as its shared memory fits no GPU.
SPLITKV_HOST_DEVICE constexpr int split_kernel_registers(int head_dim, int block_m, int block_kv) {
  const int kv = block_kv == 32 ? 0 : block_kv == 64 ? 1 : 2;
  const int m = block_m == 16 ? 0 : 1;
  constexpr int k64[2][3] = {{128, 126, 128}, {126, 168, 255}};
  constexpr int k96[2][3] = {{89, 154, 154}, {159, 168, 255}};
  constexpr int k128[2][3] = {{128, 167, 194}, {168, 224, 255}};
  constexpr int k256[2][3] = {{186, 211, 255}, {252, 254, 255}};
  return head_dim == 64 ? k64[m][kv] : head_dim == 96 ? k96[m][kv] : head_dim == 128 ? k128[m][kv] : k256[m][kv];
}

// CTAs of one kernel an SM holds, at most, on any GPU.
inline constexpr int kMaxCtasPerSm = 32;
inline constexpr int kRegistersPerSm = 65536;
inline constexpr int kRegisterAllocationUnit = 8;  // registers per thread are allocated in steps of 8

// CTAs of the equal-length split kernel that one SM's registers hold, in [1, kMaxCtasPerSm].
SPLITKV_HOST_DEVICE constexpr int register_residency(int head_dim, int block_m, int block_kv) {
  const int regs = ceil_div(split_kernel_registers(head_dim, block_m, block_kv), kRegisterAllocationUnit) *
                   kRegisterAllocationUnit;
  const int ctas = kRegistersPerSm / (regs * kNumWarps * 32);
  return ctas < 1 ? 1 : ctas > kMaxCtasPerSm ? kMaxCtasPerSm : ctas;
}

// One past the last key any row of query tile m_block may attend. Causal masks are aligned
// bottom-right: query i sees keys j <= i + kv_len - q_len.
SPLITKV_HOST_DEVICE constexpr int tile_kv_end(bool causal, int kv_len, int q_len, int group, int packed_rows,
                                              int m_block) {
  if (!causal) return kv_len;
  const int block_m = block_m_for(packed_rows);
  const int last_row = ((m_block + 1) * block_m < packed_rows ? (m_block + 1) * block_m : packed_rows) - 1;
  const int end = last_row / group + 1 + kv_len - q_len;
  return end < 0 ? 0 : (end < kv_len ? end : kv_len);
}

// Keys of split `split` of `num_splits` for a query tile whose keys end at kv_end.
// kLength cuts [0, kv_len) into equal lengths, clipped to kv_end (trailing splits of early
// causal tiles are empty); kBlocks gives every split the same count, within one, of block_kv
// blocks of [0, kv_end).
SPLITKV_HOST_DEVICE constexpr KeyRange split_range(SplitPolicy policy, int split, int num_splits, int kv_len,
                                                   int kv_end, int block_kv) {
  if (policy == SplitPolicy::kLength) {
    const int start = int(int64_t(split) * kv_len / num_splits);
    const int end = int(int64_t(split + 1) * kv_len / num_splits);
    return KeyRange{start, end < kv_end ? end : kv_end};
  }
  const int n_blocks = ceil_div(kv_end, block_kv);
  const int start = int(int64_t(split) * n_blocks / num_splits) * block_kv;
  const int end = int(int64_t(split + 1) * n_blocks / num_splits) * block_kv;
  return KeyRange{start, end < kv_end ? end : kv_end};
}

// Splits of one sequence of a paged or variable-length batch, from its live length alone: one
// per min_blocks_per_split blocks of block_kv keys, at least 1 (a sequence of length 0 gets one
// empty split, which writes O = 0 and lse = -inf) and at most max_splits, the bound that sizes
// the launch. Nothing else enters: not the cache's capacity, not the block table's width, not
// the other sequences, so a sequence's output bits depend only on its own keys and these knobs.
SPLITKV_HOST_DEVICE constexpr int live_splits(int live_len, int block_kv, int min_blocks_per_split, int max_splits) {
  const int splits = ceil_div(ceil_div(live_len, block_kv), min_blocks_per_split);
  return splits < 1 ? 1 : (splits > max_splits ? max_splits : splits);
}

// The largest min_blocks_per_split at block_kv: a split of the longest sequence (kMaxKeys keys),
// so that live_splits' rounding stays in int.
SPLITKV_HOST_DEVICE constexpr int max_min_blocks_per_split(int block_kv) { return kMaxKeys / block_kv; }

// A batch's blocks of block_kv keys: the sum of ceil(len / block_kv) over its live lengths (each
// in [0, kMaxKeys]).
template <class Length>
SPLITKV_HOST_DEVICE constexpr int64_t live_blocks(const Length* lengths, int batch, int block_kv) {
  int64_t blocks = 0;
  for (int b = 0; b < batch; ++b) blocks += ceil_div(int(lengths[b]), block_kv);
  return blocks;
}

// The paged call's "auto" knobs (splitkv_tune/live.py says why each is what it is; the exported
// C++ selector falls back to them for a batch its table has no class for). block_kv: the
// default tile. Keys per split: what splitting `batch` sequences of kLiveTypicalLen keys over
// kLiveWavesPerSequence waves of num_sms CTAs would give each CTA, rounded up to a power of two
// within [kLiveMinKeysPerSplitLow, kLiveMinKeysPerSplitHigh]. max_splits: those waves for one
// sequence on its own, lowered for a large batch to kLiveCapacityItemsPerSm work items per SM
// (the plan's capacity sizes the workspace), but not below the floor: kLiveMinMaxSplits, or,
// when more, the largest power of two within half a wave of one sequence's CTAs, so that a long
// sequence of a large batch with few KV heads still spreads over the GPU (H200 batch sweep,
// Hq/Hkv 8/1, 128K + 255 x 512: 130% over the best at 16 splits, 9% at 64).
inline constexpr int kLiveDefaultBlockKV = 64;
inline constexpr int kLiveWavesPerSequence = 2;
inline constexpr int kLiveTypicalLen = 2048;
inline constexpr int kLiveMinKeysPerSplitLow = 256;
inline constexpr int kLiveMinKeysPerSplitHigh = 1024;
inline constexpr int kLiveCapacityItemsPerSm = 32;
inline constexpr int kLiveMinMaxSplits = 16;
static_assert((kLiveMinKeysPerSplitHigh & (kLiveMinKeysPerSplitHigh - 1)) == 0,
              "live_min_keys_per_split rounds up to a power of two, within the bounds");
// CUDA's grid.y limit, which bounds batch * kv_heads of a launch. With it, packed_rows <=
// kMaxKeys and num_sms <= kMaxLiveSms, the "auto" rules' products fit in int64_t.
inline constexpr int kMaxGridY = 65535;
inline constexpr int kMaxLiveSms = 1 << 16;
// The most CTAs a paged / variable-length launch's grid has (SMs x CTAs per SM, at most
// kMaxCtasPerSm on any GPU); within it the load-aware plan's rate is a 32-bit division.
inline constexpr int kMaxLiveCtas = kMaxLiveSms * kMaxCtasPerSm;

// Whether the "auto" rules below take these counts.
SPLITKV_HOST_DEVICE constexpr bool live_knob_args_ok(int64_t batch, int64_t kv_heads, int64_t packed_rows,
                                                     int64_t num_sms) {
  return batch >= 1 && kv_heads >= 1 && batch * kv_heads <= kMaxGridY && packed_rows >= 1 &&
         packed_rows <= kMaxKeys && num_sms >= 1 && num_sms <= kMaxLiveSms;
}

SPLITKV_HOST_DEVICE constexpr int live_min_keys_per_split(int batch, int kv_heads, int packed_rows, int num_sms) {
  const int64_t tiles = int64_t(batch) * kv_heads * num_m_blocks(packed_rows);
  const int64_t per_wave = int64_t(kLiveWavesPerSequence) * num_sms;
  const int64_t keys = (tiles * kLiveTypicalLen + per_wave - 1) / per_wave;
  int64_t power = 1;
  while (power < keys && power < kLiveMinKeysPerSplitHigh) power <<= 1;
  return power < kLiveMinKeysPerSplitLow ? kLiveMinKeysPerSplitLow : int(power);
}

// {splits that give one sequence kLiveWavesPerSequence waves, the capacity cap (its floor
// applied), the floor}. Within live_knob_args_ok's domain each fits an int (num_sms <= 2^16).
struct LiveSplitBounds {
  int one_sequence, capacity, floor;
};

SPLITKV_HOST_DEVICE constexpr LiveSplitBounds live_max_splits_bounds(int batch, int kv_heads, int packed_rows,
                                                                      int num_sms) {
  const int64_t tiles = int64_t(kv_heads) * num_m_blocks(packed_rows);
  const int64_t one_sequence = (int64_t(kLiveWavesPerSequence) * num_sms + tiles - 1) / tiles;
  const int64_t half_wave = (int64_t(num_sms) + 2 * tiles - 1) / (2 * tiles);
  int64_t floor = 1;
  while (floor * 2 <= half_wave) floor *= 2;
  floor = floor > kLiveMinMaxSplits ? floor : kLiveMinMaxSplits;
  const int64_t capacity = int64_t(kLiveCapacityItemsPerSm) * num_sms / (int64_t(batch) * tiles);
  return LiveSplitBounds{int(one_sequence), int(capacity > floor ? capacity : floor), int(floor)};
}

// The least of the two bounds and kMaxSplits; at least 1, as one_sequence is.
SPLITKV_HOST_DEVICE constexpr int live_max_splits(int batch, int kv_heads, int packed_rows, int num_sms) {
  const LiveSplitBounds b = live_max_splits_bounds(batch, kv_heads, packed_rows, num_sms);
  const int splits = b.one_sequence < b.capacity ? b.one_sequence : b.capacity;
  return splits < kMaxSplits ? splits : kMaxSplits;
}

// Size classes of the schedule's order and of the load-aware plan's tallies: class c holds
// splits of [2^(31-c), 2^(32-c)) blocks, so lower is heavier; an empty split shares class 31.
inline constexpr int kSizeClasses = 32;

SPLITKV_HOST_DEVICE constexpr int size_class(int blocks_per_split) {
  if (blocks_per_split <= 1) return kSizeClasses - 1;
#if defined(__CUDA_ARCH__)
  return __clz(blocks_per_split);
#else
  int c = 0;
  while (!(unsigned(blocks_per_split) & (0x80000000u >> c))) ++c;
  return c;
#endif
}

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
// batch, so a sequence's bits do too. Choosing costs every CTA about 2 us before its first item,
// which is why it is not the "auto" knob (docs/PERFORMANCE.md).
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
// lengthens the longest item, and the choosing costs every CTA about 2 us before its first
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
// memory, after the split kernel's own: a header (the next work item, the plan's knob), the
// sequences' size classes counted per warp, the batch in schedule order and that order's prefix
// of splits, then, when the launch chooses its knob, the plan's tallies and estimates (8-byte
// aligned).
inline constexpr int kScheduleHeaderInts = 4;
SPLITKV_HOST_DEVICE constexpr int live_schedule_ints(int batch) {
  return (kScheduleHeaderInts + kNumWarps * kSizeClasses + 2 * batch + 1 + 1) / 2 * 2;
}
SPLITKV_HOST_DEVICE constexpr int live_schedule_bytes(int batch, int plan_choices) {
  const int plan = plan_choices > 1 ? kLivePlanChoices * int(sizeof(LivePlanTally) + sizeof(int64_t)) : 0;
  return (4 * live_schedule_ints(batch) + plan + 15) / 16 * 16;
}

// Its two self-resetting counters: the next work item and the CTAs that found none left.
inline constexpr int kWorkCounters = 2;

// Work items (one split of one query tile of one (sequence, KV head)) when every sequence has
// max_splits splits: the most a launch can have.
SPLITKV_HOST_DEVICE constexpr int64_t live_work_capacity(int batch, int kv_heads, int packed_rows, int max_splits) {
  return int64_t(batch) * kv_heads * num_m_blocks(packed_rows) * max_splits;
}

// CTAs of a paged / variable-length launch: as many as the GPU holds at once, or the capacity
// when that is fewer. More would only queue behind the first wave for items that are gone.
SPLITKV_HOST_DEVICE constexpr int64_t live_grid(int64_t capacity_items, int num_sms, int ctas_per_sm) {
  const int64_t resident = int64_t(num_sms) * (ctas_per_sm < 1 ? 1 : ctas_per_sm);
  return capacity_items < resident ? capacity_items : resident;
}

// The CTAs a SM may hold of an equal-length launch of `ctas` CTAs that starts while the previous
// kernel of its stream still runs (programmatic dependent launch), when each SM could hold
// resident_per_sm: ceil(ctas / num_sms) when the grid is one wave that needs more than one CTA a
// SM and leaves fewer slots free than it has CTAs, else 0 (no limit). Why: a call of the same
// grid after it takes the free slots early, and the rest of its CTAs then land on the SMs that
// free first, up to resident_per_sm each, while others run one: on an H200, 256 CTAs of block_kv
// 64 (B 8, Hkv 32, Sk 8K, one split) took 318 us back to back against 243 without the early
// launch, and 384 of block_kv 32 434 against 351. Where the free slots hold the whole next grid
// it lands balanced, and holding the SMs back would only cost its early launch: 192 CTAs of
// block_kv 64 (B 1, Hkv 8, Sk 16K, 24 splits) 22.8 us as they are, 25.3 held to two a SM
// (docs/PERFORMANCE.md, "Back to back").
SPLITKV_HOST_DEVICE constexpr int spread_ctas_per_sm(int64_t ctas, int num_sms, int resident_per_sm) {
  const int64_t slots = int64_t(num_sms) * resident_per_sm;
  if (num_sms < 1 || ctas > slots || slots - ctas >= ctas) return 0;
  const int per_sm = int((ctas + num_sms - 1) / num_sms);
  return per_sm > 1 && per_sm < resident_per_sm ? per_sm : 0;
}

// The dynamic shared memory per CTA that holds a SM of sm_bytes of shared memory to per_sm CTAs
// (each also taking reserved_bytes): past a (per_sm + 1)-th share, and at least the kernel's own
// kernel_bytes. 0 when per_sm CTAs of the kernel's own size do not fit.
SPLITKV_HOST_DEVICE constexpr int smem_for_ctas_per_sm(int per_sm, int sm_bytes, int reserved_bytes,
                                                       int kernel_bytes) {
  if (per_sm < 1) return 0;
  const int share = sm_bytes / (per_sm + 1) + 1 - reserved_bytes;
  const int bytes = share > kernel_bytes ? share : kernel_bytes;
  return int64_t(per_sm) * (bytes + reserved_bytes) <= sm_bytes ? bytes : 0;
}

// Lanes that fold one row of the partials together (merge_state.h; the combine kernel and the
// fused merge lay their threads out by it, so both fold alike): one float4 each at head dims
// 64 and 128, a warp's 32 lanes with wider shares at 96 and 256.
SPLITKV_HOST_DEVICE constexpr int lanes_per_row(int head_dim) {
  return head_dim % 64 == 0 && head_dim < 128 ? head_dim / 4 : 32;
}

// Whether the fused merge of one query tile is one row fold per thread of the last CTA. Past
// that the last CTA merges rows one after another, and the combine kernel, spread over many
// CTAs, is faster (docs/PERFORMANCE.md).
SPLITKV_HOST_DEVICE constexpr bool fused_merge_fits(int packed_rows, int head_dim) {
  const int block_m = block_m_for(packed_rows);
  const int rows = block_m < packed_rows ? block_m : packed_rows;
  return rows * lanes_per_row(head_dim) <= kNumWarps * 32;
}

SPLITKV_HOST_DEVICE constexpr int64_t align_up(int64_t n) { return (n + kWorkspaceAlign - 1) / kWorkspaceAlign * kWorkspaceAlign; }

// Byte offsets of the workspace's sections (params.h): O at 0, then m, then l, then for a paged /
// variable-length launch (`live`) the plan's knob (one int32: the min_blocks_per_split a
// load-aware launch chose, for its combine kernel); `total` is the size. No workspace with one
// split.
struct WorkspaceSections {
  int64_t m_offset, l_offset, plan_offset, total;
};

SPLITKV_HOST_DEVICE constexpr WorkspaceSections workspace_sections(int num_splits, int batch, int q_heads, int q_len,
                                                                   int head_dim, bool live = false) {
  if (num_splits == 1) return WorkspaceSections{0, 0, 0, 0};
  const int64_t rows = int64_t(num_splits) * batch * q_heads * q_len;
  const int64_t o_bytes = align_up(rows * head_dim * 4);
  const int64_t ml_bytes = align_up(rows * 4);
  const int64_t plan_offset = o_bytes + 2 * ml_bytes;
  return WorkspaceSections{o_bytes, o_bytes + ml_bytes, plan_offset, plan_offset + (live ? kWorkspaceAlign : 0)};
}

// The fused merge's counters: one int32 per query tile of each (batch, KV head).
SPLITKV_HOST_DEVICE constexpr int64_t tile_counter_count(int batch, int kv_heads, int packed_rows) {
  return int64_t(batch) * kv_heads * num_m_blocks(packed_rows);
}

}  // namespace rules
}  // namespace splitkv
