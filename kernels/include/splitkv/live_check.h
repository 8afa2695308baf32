// The value checks of a paged / variable-length call (check_inputs=True): every live length in
// [0, capacity] and every page that a sequence's live keys use inside the pool. One launch over
// the table and one 8-byte read back, in place of reading the lengths and the table to the host.
// No torch: the binding fills LiveCheckParams.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace splitkv {

// The first bad entry, in this order: lengths by sequence, then the table row by row. Its key is
// b for cache_seqlens[b] outside [0, capacity], batch + b * table_width + p for block_table[b, p]
// a live page outside [0, num_pages); kLiveCheckPassed (-1 as a signed int64) when none is bad.
// plan.py decodes the key and computes the same one on the CPU.
inline constexpr unsigned long long kLiveCheckPassed = ~0ull;

struct LiveCheckParams {
  const int* seqlens = nullptr;      // [batch]; null: every sequence holds `capacity` keys
  const int* block_table = nullptr;  // [batch, table_width], row stride table_row_stride; null: contiguous
  int64_t table_row_stride = 0;
  int table_width = 0;
  int batch = 0;
  int capacity = 0;                  // keys a sequence can hold
  int page_size = 1;
  int num_pages = 0;
  unsigned long long* first_bad = nullptr;  // set to kLiveCheckPassed before the launch
};

#ifdef __CUDACC__
inline constexpr int kLiveCheckThreads = 256;

__global__ void __launch_bounds__(kLiveCheckThreads) live_check_kernel(LiveCheckParams p) {
  unsigned long long first = kLiveCheckPassed;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const int64_t start = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  for (int64_t b = start; b < p.batch; b += stride) {
    const int n = p.seqlens != nullptr ? p.seqlens[b] : p.capacity;
    if ((n < 0 || n > p.capacity) && static_cast<unsigned long long>(b) < first) first = b;
  }
  if (p.block_table != nullptr) {
    const int64_t entries = int64_t(p.batch) * p.table_width;
    for (int64_t e = start; e < entries; e += stride) {
      const int b = int(e / p.table_width), page = int(e % p.table_width);
      const int n = p.seqlens != nullptr ? min(max(p.seqlens[b], 0), p.capacity) : p.capacity;
      if (int64_t(page) * p.page_size >= n) continue;
      const int index = p.block_table[b * p.table_row_stride + page];
      const auto key = static_cast<unsigned long long>(p.batch + e);
      if ((index < 0 || index >= p.num_pages) && key < first) first = key;
    }
  }
  for (int offset = 16; offset > 0; offset /= 2) {
    const unsigned long long other = __shfl_xor_sync(0xffffffffu, first, offset);
    first = other < first ? other : first;
  }
  if (threadIdx.x % 32 == 0 && first != kLiveCheckPassed) atomicMin(p.first_bad, first);
}
#endif

// Launches the check on `stream`: p.first_bad becomes the first bad entry's key, or stays
// kLiveCheckPassed. `sm_count`: the device's multiprocessors (the grid is at most two waves).
void run_live_check(const LiveCheckParams& p, int sm_count, cudaStream_t stream);

}  // namespace splitkv
