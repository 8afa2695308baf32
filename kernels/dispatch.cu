// Switches over the instantiations listed in the generated tunables.h.
#include <stdexcept>
#include <string>
#include <type_traits>

#include "splitkv/dispatch.h"
#include "splitkv/kernel_traits.h"

namespace splitkv {

template <typename Element, int kHeadDim, int kBlockM, int kBlockKV>
void run_split_kernel(const SplitParams& p, cudaStream_t stream, bool programmatic);
template <typename Element, int kHeadDim, int kBlockM, int kBlockKV>
int live_grid(const SplitParams& p);
template <typename Element, int kHeadDim, int kThreads>
void run_combine_kernel(const CombineParams& p, cudaStream_t stream, bool programmatic);

template <typename Element>
constexpr DType dtype_of() {
  return std::is_same_v<Element, cutlass::half_t> ? DType::kFp16 : DType::kBf16;
}

void run_split(const SplitParams& p, DType dtype, int head_dim, int block_m, int block_kv, cudaStream_t stream,
               bool programmatic) {
#define SPLITKV_CASE(E, D, BM, BKV)                                                        \
  if (dtype == dtype_of<E>() && head_dim == D && block_m == BM && block_kv == BKV) {       \
    return run_split_kernel<E, D, BM, BKV>(p, stream, programmatic);                           \
  }
  SPLITKV_FOR_EACH_SPLIT_KERNEL(SPLITKV_CASE)
#undef SPLITKV_CASE
  throw std::invalid_argument("no split kernel for head_dim=" + std::to_string(head_dim) +
                              " block_m=" + std::to_string(block_m) + " block_kv=" + std::to_string(block_kv));
}

void run_combine(const CombineParams& p, DType dtype, int head_dim, int threads, cudaStream_t stream,
                 bool programmatic) {
#define SPLITKV_CASE(E, D, T)                                                   \
  if (dtype == dtype_of<E>() && head_dim == D && threads == T) {               \
    return run_combine_kernel<E, D, T>(p, stream, programmatic);                      \
  }
  SPLITKV_FOR_EACH_COMBINE_KERNEL(SPLITKV_CASE)
#undef SPLITKV_CASE
  throw std::invalid_argument("no combine kernel for head_dim=" + std::to_string(head_dim) +
                              " reduce_threads=" + std::to_string(threads));
}

int live_grid_ctas(const SplitParams& p, DType dtype, int head_dim, int block_m, int block_kv) {
#define SPLITKV_CASE(E, D, BM, BKV)                                                   \
  if (dtype == dtype_of<E>() && head_dim == D && block_m == BM && block_kv == BKV) {  \
    return live_grid<E, D, BM, BKV>(p);                                              \
  }
  SPLITKV_FOR_EACH_SPLIT_KERNEL(SPLITKV_CASE)
#undef SPLITKV_CASE
  throw std::invalid_argument("no split kernel for head_dim=" + std::to_string(head_dim) +
                              " block_m=" + std::to_string(block_m) + " block_kv=" + std::to_string(block_kv));
}

int split_smem_bytes(DType dtype, int head_dim, int block_m, int block_kv) {
#define SPLITKV_CASE(E, D, BM, BKV)                                                   \
  if (dtype == dtype_of<E>() && head_dim == D && block_m == BM && block_kv == BKV) {  \
    return SplitKernelTraits<D, BM, BKV, E>::kSmemBytes;                             \
  }
  SPLITKV_FOR_EACH_SPLIT_KERNEL(SPLITKV_CASE)
#undef SPLITKV_CASE
  return -1;
}

}  // namespace splitkv
