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
template <typename Element, int kHeadDim, int kBlockM, int kBlockKV>
Residency equal_launch_residency(int64_t ctas, bool programmatic);
template <typename Element, int kHeadDim, int kThreads>
void run_combine_kernel(const CombineParams& p, cudaStream_t stream, bool programmatic);

template <typename Element>
constexpr DType dtype_of() {
  return std::is_same_v<Element, cutlass::half_t> ? DType::kFp16 : DType::kBf16;
}

// One split-kernel instantiation, as a type: fn(SplitInstance<...>{}) reads its parameters.
template <typename E, int D, int BM, int BKV>
struct SplitInstance {
  using Element = E;
  static constexpr int kHeadDim = D, kBlockM = BM, kBlockKV = BKV;
};

// fn(SplitInstance<...>{}) of the instantiation that serves (dtype, head_dim, block_m, block_kv);
// std::invalid_argument when none does.
template <class Fn>
decltype(auto) with_split_instance(DType dtype, int head_dim, int block_m, int block_kv, Fn&& fn) {
#define SPLITKV_CASE(E, D, BM, BKV)                                                   \
  if (dtype == dtype_of<E>() && head_dim == D && block_m == BM && block_kv == BKV) {  \
    return fn(SplitInstance<E, D, BM, BKV>{});                                        \
  }
  SPLITKV_FOR_EACH_SPLIT_KERNEL(SPLITKV_CASE)
#undef SPLITKV_CASE
  throw std::invalid_argument("no split kernel for head_dim=" + std::to_string(head_dim) +
                              " block_m=" + std::to_string(block_m) + " block_kv=" + std::to_string(block_kv));
}

void run_split(const SplitParams& p, DType dtype, int head_dim, int block_m, int block_kv, cudaStream_t stream,
               bool programmatic) {
  with_split_instance(dtype, head_dim, block_m, block_kv, [&](auto k) {
    using K = decltype(k);
    run_split_kernel<typename K::Element, K::kHeadDim, K::kBlockM, K::kBlockKV>(p, stream, programmatic);
  });
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
  return with_split_instance(dtype, head_dim, block_m, block_kv, [&](auto k) {
    using K = decltype(k);
    return live_grid<typename K::Element, K::kHeadDim, K::kBlockM, K::kBlockKV>(p);
  });
}

Residency equal_launch_residency(DType dtype, int head_dim, int block_m, int block_kv, int64_t ctas,
                                 bool programmatic) {
  return with_split_instance(dtype, head_dim, block_m, block_kv, [&](auto k) {
    using K = decltype(k);
    return equal_launch_residency<typename K::Element, K::kHeadDim, K::kBlockM, K::kBlockKV>(ctas, programmatic);
  });
}

int split_smem_bytes(DType dtype, int head_dim, int block_m, int block_kv) {
  try {
    return with_split_instance(dtype, head_dim, block_m, block_kv, [](auto k) {
      using K = decltype(k);
      return SplitKernelTraits<K::kHeadDim, K::kBlockM, K::kBlockKV, typename K::Element>::kSmemBytes;
    });
  } catch (const std::invalid_argument&) {
    return -1;
  }
}

}  // namespace splitkv
