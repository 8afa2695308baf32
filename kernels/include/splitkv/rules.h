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
