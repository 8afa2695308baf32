// The persistent schedule of a paged / variable-length launch (seqlens != null).
//
// Why: the grid of such a launch is fixed when a graph is captured, and a grid of one CTA per
// (query tile, sequence x KV head, split up to max_splits) mostly retires CTAs for splits that
// short sequences do not have. Each of those still waits for a launch slot and for the previous
// grid before it exits: 6-13% of the time on equal lengths and a fifth of it on 128K + 255 x 512
// (docs/NOTES.md). Here the grid holds only as many CTAs as the GPU runs at once
// (rules::live_grid); each takes work items, one split of one query tile of one (sequence, KV
// head), from a counter until none is left, as FlashAttention-3's varlen scheduler does.
//
// Order: heaviest first (longest processing time first), so that the splits of long sequences
// start before the short sequences fill in behind them. Sequences are sorted by keys per split
// in classes a factor 2 apart (the leading zeros of the blocks per split), in batch order
// within a class, and each sequence's items follow one another. Every CTA builds the same
// order from the lengths, deterministically, in shared memory: no planning kernel, no host
// work. The order decides only which CTA runs an item, never an item's keys or the bits it
// writes, which are the plan's (rules.h, live_plan.h).
//
// CTA i starts with item i; only items past the first wave come off the counter, so a launch with
// no more items than CTAs (a small batch) touches no counter. The counters (items fetched, CTAs
// done) reset themselves: the last CTA to find no item left sets the item counter back to 0, and
// the done counter wraps to 0 in that CTA's increment, so they are zero again after every launch
// without a fill kernel (fused_merge.h does the same).
//
// Before the order, a launch whose min_blocks_per_split was "load_aware" (p.plan_choices > 1) chooses
// its knob from the lengths (live_plan.h, the load-aware plan): every CTA tallies the batch for every
// choice in one pass, and the estimates pick one, the same in every CTA; a launch whose items at the
// knob as given fit its CTAs keeps that knob and estimates nothing.
#pragma once

#include <cub/block/block_scan.cuh>
#include <cute/tensor.hpp>

#include "splitkv/block_range.h"
#include "splitkv/live_plan.h"
#include "splitkv/params.h"

namespace splitkv {

template <class Traits>
class LiveScheduler {
 public:
  static constexpr int kNWarps = Traits::kNWarps;
  static constexpr int kNThreads = Traits::kNThreads;
  static_assert(rules::kSizeClasses == 32, "one class per lane");
  static_assert(Traits::kSmemBytes % 16 == 0, "the schedule's tallies and estimates are 8-byte aligned");

  // schedule: the rules::live_schedule_bytes(p.batch, p.plan_choices) bytes of shared memory
  // after the split kernel's own (tallies_ and estimates_ only when p.plan_choices > 1).
  CUTE_DEVICE LiveScheduler(const SplitParams& p, char* schedule)
      : next_(reinterpret_cast<int*>(schedule)),
        blocks_(reinterpret_cast<long long*>(next_ + 2)),
        counts_(next_ + rules::kScheduleHeaderInts),
        order_(counts_ + kNWarps * rules::kSizeClasses),
        prefix_(order_ + p.batch),
        tallies_(reinterpret_cast<rules::LivePlanTally*>(next_ + rules::live_schedule_ints(p.batch))),
        estimates_(reinterpret_cast<int64_t*>(tallies_ + rules::kLivePlanChoices)) {}

  // Chooses the plan's knob, sorts the batch and takes this CTA's first item, item blockIdx.x,
  // into cta; false when there is none.
  template <int kBlockM, int kBlockKV>
  CUTE_DEVICE bool first(const SplitParams& p, SplitCta& cta) {
    choose_min_blocks<kBlockKV>(p);
    sort_by_class(p);
    prefix_splits(p);
    if (threadIdx.x == 0) *next_ = int(blockIdx.x);
    __syncthreads();
    return take<kBlockM, kBlockKV>(p, cta);
  }

  // The next item, once every thread is done with the current one and with shared memory.
  template <int kBlockM, int kBlockKV>
  CUTE_DEVICE bool next(const SplitParams& p, SplitCta& cta) {
    __syncthreads();
    if (threadIdx.x == 0) *next_ = prefetched_;
    __syncthreads();
    return take<kBlockM, kBlockKV>(p, cta);
  }

 private:
  // The item in *next_ (set for all threads) into cta, or false and this CTA's share of the
  // counters' reset. Items past the first wave come off the counter (item gridDim.x + n is its
  // n-th fetch); with no more items than CTAs the counters are not touched.
  template <int kBlockM, int kBlockKV>
  CUTE_DEVICE bool take(const SplitParams& p, SplitCta& cta) {
    const int item = *next_;
    const int per_unit = p.kv_heads * p.num_m_blocks;
    const int total = prefix_[p.batch] * per_unit;
    const bool counted = total > int(gridDim.x);
    if (item >= total) {
      if (threadIdx.x == 0 && counted) finish(p);
      return false;
    }
    // Thread 0 asks for the item after this one now, so the atomic's round trip overlaps it.
    if (threadIdx.x == 0) prefetched_ = counted ? int(gridDim.x) + atomicAdd(p.work_counters, 1) : total;
    const int unit = item / per_unit, rest = item % per_unit;
    // The last position whose prefix is <= unit; the prefix rises strictly (every sequence has
    // at least one split).
    int lo = 0, hi = p.batch - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (prefix_[mid] <= unit) {
        lo = mid;
      } else {
        hi = mid - 1;
      }
    }
    const int b = order_[lo];
    cta = make_cta<kBlockM, kBlockKV>(p, rest % p.num_m_blocks, b, rest / p.num_m_blocks, unit - prefix_[lo],
                                      __ldg(p.seqlens + b), min_blocks_);
    return true;
  }

  // This CTA will take no more items. The last one to get here resets the item counter; its
  // increment wraps the done counter to 0. Release-acquire: every CTA's last fetch comes before
  // the reset.
  CUTE_DEVICE void finish(const SplitParams& p) {
    unsigned done;
    asm volatile("atom.acq_rel.gpu.global.inc.u32 %0, [%1], %2;"
                 : "=r"(done)
                 : "l"(p.work_counters + 1), "r"(gridDim.x - 1)
                 : "memory");
    if (done == gridDim.x - 1) atomicExch(p.work_counters, 0);
  }

  // min_blocks_: p.min_blocks_per_split, or with p.plan_choices > 1 the choice of
  // rules::live_plan_min_blocks for this batch and grid: the knob as given when its items fit
  // the CTAs (fits_one_wave), else the estimates' pick. CTA 0 leaves the choice in the workspace
  // for the combine kernel.
  //
  // Why it is laid out so: choosing is latency before a CTA's first item. With each choice's own
  // pass over the batch it cost 7-10 us at 256-300 sequences, with one pass for all 4.6-6.1 (H100,
  // docs/PERFORMANCE.md). The one-wave check stays a pass of its own: folded into the tally, it
  // made every launch pay the tallies (1.0-1.4 us where the items fit one wave).
  template <int kBlockKV>
  CUTE_DEVICE void choose_min_blocks(const SplitParams& p) {
    min_blocks_ = p.min_blocks_per_split;
    if (p.plan_choices <= 1) return;
    if (!fits_one_wave<kBlockKV>(p)) {
      tally_choices<kBlockKV>(p);
      const int j = threadIdx.x / 32, lane = threadIdx.x % 32;
      if (j < p.plan_choices) {
        static_assert(rules::kLivePlanChoices <= 2 * kNWarps, "a warp estimates at most two choices");
        const bool second = j + kNWarps < p.plan_choices;
        int64_t estimate[2];
        warp_estimates<kBlockKV>(tallies_ + j, second ? kNWarps : 0, *blocks_, p.kv_heads * p.num_m_blocks,
                                 int(gridDim.x), lane, estimate);
        if (lane == 0) {
          estimates_[j] = estimate[0];
          if (second) estimates_[j + kNWarps] = estimate[1];
        }
      }
      __syncthreads();
      min_blocks_ = p.min_blocks_per_split << rules::live_plan_pick(estimates_, p.plan_choices);
    }
    if (threadIdx.x == 0 && blockIdx.x == 0 && p.ws_plan != nullptr) *p.ws_plan = min_blocks_;
  }

  // rules::live_plan_fits_one_wave of the knob as given, the same in every thread: each thread
  // sums the splits of its share of the batch into next_[1].
  template <int kBlockKV>
  CUTE_DEVICE bool fits_one_wave(const SplitParams& p) {
    if (threadIdx.x == 0) next_[1] = 0;
    __syncthreads();
    int splits = 0;
    for (int i = threadIdx.x; i < p.batch; i += kNThreads) {
      splits += rules::live_splits(__ldg(p.seqlens + i), kBlockKV, p.min_blocks_per_split, p.num_splits);
    }
    // Counts of items are below 2^30 (bindings.cpp): 32-bit sums.
    splits = int(__reduce_add_sync(0xffffffffu, unsigned(splits)));
    if (threadIdx.x % 32 == 0) atomicAdd(next_ + 1, splits);
    __syncthreads();
    return int64_t(next_[1]) * p.kv_heads * p.num_m_blocks <= int64_t(gridDim.x);
  }

  // tallies_[j] for every choice j < p.plan_choices and *blocks_ (the batch's live blocks), in
  // one pass over the batch: each thread takes a sequence and adds it to every choice's tally.
  // Per choice, the sequences of lane 0's size class go in as one warp sum (a uniform batch's
  // whole warp), the others with shared atomics of their own. Sums and maxima of integers: the
  // tallies are the serial ones (rules::live_plan_knob_estimate) whatever the order. Each step
  // is done for every choice before the next step, with no branch between, so that the
  // compiler may overlap the choices' latencies.
  template <int kBlockKV>
  CUTE_DEVICE void tally_choices(const SplitParams& p) {
    constexpr int kChoices = rules::kLivePlanChoices;
    const int lane = threadIdx.x % 32;
    for (int i = threadIdx.x; i < p.plan_choices * rules::kSizeClasses; i += kNThreads) {
      tallies_[i / rules::kSizeClasses].splits[i % rules::kSizeClasses] = 0;
      tallies_[i / rules::kSizeClasses].max_blocks[i % rules::kSizeClasses] = 0;
    }
    if (threadIdx.x == 0) *blocks_ = 0;
    __syncthreads();
    unsigned long long blocks = 0;  // the warp's sequences' blocks
    for (int i0 = 0; i0 < p.batch; i0 += kNThreads) {
      const int i = i0 + int(threadIdx.x);
      const bool valid = i < p.batch;  // the valid lanes of a warp come first
      const int len = valid ? __ldg(p.seqlens + i) : 0;
      // Under 2^26 blocks a sequence: a 32-bit sum over the warp.
      blocks += __reduce_add_sync(0xffffffffu, unsigned(rules::ceil_div(len, kBlockKV)));
      rules::LivePlanShare share[kChoices];  // choices past p.plan_choices are computed, not tallied
      int c0[kChoices], splits[kChoices], largest[kChoices];
      CUTE_UNROLL
      for (int j = 0; j < kChoices; ++j) {
        share[j] = rules::live_plan_share(len, kBlockKV, p.min_blocks_per_split << j, p.num_splits);
        if (!valid) share[j].size_class = rules::kSizeClasses;
      }
      CUTE_UNROLL
      for (int j = 0; j < kChoices; ++j) c0[j] = __shfl_sync(0xffffffffu, share[j].size_class, 0);
      CUTE_UNROLL
      for (int j = 0; j < kChoices; ++j) {
        const bool in_c0 = share[j].size_class == c0[j];
        splits[j] = int(__reduce_add_sync(0xffffffffu, in_c0 ? unsigned(share[j].splits) : 0u));
        largest[j] = int(__reduce_max_sync(0xffffffffu, in_c0 ? unsigned(share[j].blocks_per_split) : 0u));
      }
      CUTE_UNROLL
      for (int j = 0; j < kChoices; ++j) {
        rules::LivePlanTally& t = tallies_[j];
        const bool tallied = j < p.plan_choices;
        if (tallied && lane == 0 && c0[j] < rules::kSizeClasses) {
          atomicAdd(&t.splits[c0[j]], splits[j]);
          atomicMax(&t.max_blocks[c0[j]], largest[j]);
        }
        if (tallied && valid && share[j].size_class != c0[j]) {
          atomicAdd(&t.splits[share[j].size_class], share[j].splits);
          atomicMax(&t.max_blocks[share[j].size_class], share[j].blocks_per_split);
        }
      }
    }
    if (lane == 0) atomicAdd(reinterpret_cast<unsigned long long*>(blocks_), blocks);
    __syncthreads();
  }

  // rules::live_plan_estimate of tallies t[0] and, when second is non-zero, t[second], by the
  // warp: lane c holds size class c, lane k - 1 wave k's bound. Counts of items are below 2^30
  // (bindings.cpp): 32-bit shuffles.
  template <int kBlockKV>
  CUTE_DEVICE static void warp_estimates(const rules::LivePlanTally* t, int second, int64_t blocks, int tiles,
                                         int ctas, int lane, int64_t (&finish)[2]) {
    const rules::LivePlanTally* tally[2] = {t, t + second};
    int upto[2], items[2], largest[2];
    int64_t rate[2];
    CUTE_UNROLL
    for (int n = 0; n < 2; ++n) upto[n] = tally[n]->splits[lane] * tiles;  // items of classes <= lane
    CUTE_UNROLL
    for (int d = 1; d < 32; d *= 2) {
      CUTE_UNROLL
      for (int n = 0; n < 2; ++n) {
        const int below = __shfl_up_sync(0xffffffffu, upto[n], d);
        if (lane >= d) upto[n] += below;
      }
    }
    CUTE_UNROLL
    for (int n = 0; n < 2; ++n) {
      items[n] = __shfl_sync(0xffffffffu, upto[n], 31);
      largest[n] = int(__reduce_max_sync(0xffffffffu, unsigned(tally[n]->max_blocks[lane])));
      rate[n] = rules::live_plan_rate(items[n], ctas);
      finish[n] = rules::live_plan_base(blocks, tiles, items[n], largest[n], rate[n], ctas, kBlockKV);
    }
    // Wave k's class: the first whose running count exceeds k * ctas (a binary search over the
    // lanes' counts, each lane its own k).
    const int k = lane + 1;
    const int64_t rank = int64_t(k) * ctas;
    int lo[2] = {0, 0}, hi[2] = {rules::kSizeClasses - 1, rules::kSizeClasses - 1};
    CUTE_UNROLL
    for (int step = 0; step < 5; ++step) {
      CUTE_UNROLL
      for (int n = 0; n < 2; ++n) {
        const int mid = (lo[n] + hi[n]) / 2;
        if (__shfl_sync(0xffffffffu, upto[n], mid) > rank) {
          hi[n] = mid;
        } else {
          lo[n] = mid + 1 < hi[n] ? mid + 1 : hi[n];
        }
      }
    }
    CUTE_UNROLL
    for (int n = 0; n < 2; ++n) {
      const int wave_blocks = __shfl_sync(0xffffffffu, tally[n]->max_blocks[lane], lo[n]);
      if (k <= rules::kLivePlanMaxWaves && rank < items[n]) {
        const int64_t bound = rules::live_plan_wave_bound(k, wave_blocks, rate[n], ctas, kBlockKV);
        finish[n] = finish[n] > bound ? finish[n] : bound;
      }
      // The warp's largest (non-negative) value: high words first, then the low words among them.
      const unsigned high = __reduce_max_sync(0xffffffffu, unsigned(uint64_t(finish[n]) >> 32));
      const unsigned low =
          __reduce_max_sync(0xffffffffu, unsigned(uint64_t(finish[n]) >> 32) == high ? unsigned(finish[n]) : 0u);
      finish[n] = int64_t((uint64_t(high) << 32) | low);
    }
  }

  // Size class of sequence b under the plan's knob (rules::size_class of its blocks per split).
  CUTE_DEVICE int size_class(const SplitParams& p, int b) const {
    return rules::live_plan_share(__ldg(p.seqlens + b), p.block_kv, min_blocks_, p.num_splits).size_class;
  }

  // order_: the batch by size class, then batch index; a stable counting sort. Warp w sorts a
  // contiguous share of the batch: counts its classes, then, after one warp turned the counts
  // into starting positions (class-major, warp-minor), places its sequences.
  CUTE_DEVICE void sort_by_class(const SplitParams& p) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int share = rules::ceil_div(p.batch, kNWarps);
    const int begin = warp * share, end = min(p.batch, begin + share);
    int* counts = counts_ + warp * rules::kSizeClasses;  // this warp's count, later position, per class
    counts[lane] = 0;
    __syncwarp();
    for (int pass = 0; pass < 2; ++pass) {
      for (int i0 = begin; i0 < end; i0 += 32) {
        const int i = i0 + lane;
        const bool valid = i < end;
        const int c = valid ? size_class(p, i) : rules::kSizeClasses;
        const unsigned peers = __match_any_sync(0xffffffffu, c);
        const bool leader = valid && lane == __ffs(peers) - 1;
        if (pass == 1 && valid) order_[counts[c] + __popc(peers & ((1u << lane) - 1))] = i;
        __syncwarp();
        if (leader) counts[c] += __popc(peers);
        __syncwarp();
      }
      __syncthreads();
      if (pass == 0 && warp == 0) {
        // Lane c: the first position of class c, then of each warp's share of it.
        int mine[kNWarps], total = 0;
        CUTE_UNROLL
        for (int w = 0; w < kNWarps; ++w) {
          mine[w] = counts_[w * rules::kSizeClasses + lane];
          total += mine[w];
        }
        int start = total;
        CUTE_UNROLL
        for (int d = 1; d < 32; d *= 2) {
          const int below = __shfl_up_sync(0xffffffffu, start, d);
          if (lane >= d) start += below;
        }
        start -= total;
        CUTE_UNROLL
        for (int w = 0; w < kNWarps; ++w) {
          counts_[w * rules::kSizeClasses + lane] = start;
          start += mine[w];
        }
      }
      __syncthreads();
    }
  }

  // prefix_[i]: the splits of the sequences before position i of order_; prefix_[batch] is the
  // launch's (sequence, split) count.
  CUTE_DEVICE void prefix_splits(const SplitParams& p) {
    using BlockScan = cub::BlockScan<int, kNThreads>;
    __shared__ typename BlockScan::TempStorage scan;
    int running = 0;
    for (int i0 = 0; i0 < p.batch; i0 += kNThreads) {
      const int i = i0 + threadIdx.x;
      int splits = 0;
      if (i < p.batch) {
        splits = rules::live_splits(__ldg(p.seqlens + order_[i]), p.block_kv, min_blocks_, p.num_splits);
      }
      int before = 0, total = 0;
      BlockScan(scan).ExclusiveSum(splits, before, total);
      if (i < p.batch) prefix_[i] = running + before;
      running += total;
      __syncthreads();  // the scan's storage is reused
    }
    if (threadIdx.x == 0) prefix_[p.batch] = running;
    __syncthreads();
  }

  int* next_;    // the header's ints: [0] the item every thread takes next, [1] the one-wave split count
  long long* blocks_;  // [1] the batch's live blocks, for the plan's estimates (header ints 2-3)
  int* counts_;  // [kNWarps][kSizeClasses]
  int* order_;   // [batch]
  int* prefix_;  // [batch + 1]
  rules::LivePlanTally* tallies_;  // [kLivePlanChoices]
  int64_t* estimates_;             // [kLivePlanChoices]
  int min_blocks_ = 0;             // the plan's knob for this launch
  int prefetched_ = 0;             // thread 0's
};

}  // namespace splitkv
