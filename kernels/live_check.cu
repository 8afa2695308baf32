// The launch of live_check.h's kernel.
#include <algorithm>

#include "splitkv/launch_utils.h"
#include "splitkv/live_check.h"

namespace splitkv {

void run_live_check(const LiveCheckParams& p, int sm_count, cudaStream_t stream) {
  const int64_t entries = p.block_table != nullptr ? int64_t(p.batch) * p.table_width : p.batch;
  const int64_t needed = (entries + kLiveCheckThreads - 1) / kLiveCheckThreads;
  const int ctas = int(std::max<int64_t>(1, std::min<int64_t>(needed, 2 * int64_t(sm_count))));
  live_check_kernel<<<ctas, kLiveCheckThreads, 0, stream>>>(p);
  check_cuda(cudaGetLastError(), "live_check launch");
}

}  // namespace splitkv
