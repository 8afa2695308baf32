// Small CuTe helpers shared by the split kernel's stages.
#pragma once

#include <cute/tensor.hpp>

namespace splitkv {

using namespace cute;

// Accumulator layout ((2, 2), MMA_M, MMA_N) of an SM80 16x8 MMA viewed as
// (rows = (2, MMA_M), cols = (2, MMA_N)), so row-wise softmax loops read naturally.
template <class Layout>
CUTE_HOST_DEVICE constexpr auto acc_rowcol(Layout acc) {
  static_assert(decltype(rank(acc))::value == 3);
  static_assert(decltype(size<0>(acc))::value == 4);
  auto l = logical_divide(acc, Shape<_2>{});
  return make_layout(make_layout(get<0, 1>(l), get<1>(l)), make_layout(get<0, 0>(l), get<2>(l)));
}

// acc += A * B with both operands streamed from shared memory one k-slice ahead.
template <class TiledMma, class TensorAcc, class TensorRA, class TensorRB, class TensorSA, class TensorSB,
          class CopyA, class CopyB, class ThrCopyA, class ThrCopyB>
CUTE_DEVICE void gemm_smem(TiledMma& tiled_mma, TensorAcc& acc, TensorRA& tCrA, TensorRB& tCrB,
                           TensorSA const& tCsA, TensorSB const& tCsB, CopyA const& copy_a,
                           CopyB const& copy_b, ThrCopyA const& thr_copy_a, ThrCopyB const& thr_copy_b) {
  Tensor tCrA_view = thr_copy_a.retile_D(tCrA);
  Tensor tCrB_view = thr_copy_b.retile_D(tCrB);
  copy(copy_a, tCsA(_, _, _0{}), tCrA_view(_, _, _0{}));
  copy(copy_b, tCsB(_, _, _0{}), tCrB_view(_, _, _0{}));
  CUTE_UNROLL
  for (int k = 0; k < size<2>(tCrA); ++k) {
    if (k < size<2>(tCrA) - 1) {
      copy(copy_a, tCsA(_, _, k + 1), tCrA_view(_, _, k + 1));
      copy(copy_b, tCsB(_, _, k + 1), tCrB_view(_, _, k + 1));
    }
    cute::gemm(tiled_mma, tCrA(_, _, k), tCrB(_, _, k), acc);
  }
}

// acc += A * B with A already in registers and B streamed from shared memory.
template <class TiledMma, class TensorAcc, class TensorRA, class TensorRB, class TensorSB, class CopyB, class ThrCopyB>
CUTE_DEVICE void gemm_rs(TiledMma& tiled_mma, TensorAcc& acc, TensorRA const& tCrA, TensorRB& tCrB,
                         TensorSB const& tCsB, CopyB const& copy_b, ThrCopyB const& thr_copy_b) {
  Tensor tCrB_view = thr_copy_b.retile_D(tCrB);
  copy(copy_b, tCsB(_, _, _0{}), tCrB_view(_, _, _0{}));
  CUTE_UNROLL
  for (int k = 0; k < size<2>(tCrA); ++k) {
    if (k < size<2>(tCrA) - 1) copy(copy_b, tCsB(_, _, k + 1), tCrB_view(_, _, k + 1));
    cute::gemm(tiled_mma, tCrA(_, _, k), tCrB(_, _, k), acc);
  }
}

// Accumulator layout (4, MMA_M, MMA_N) of 16x8 tiles read as the A operand of a 16x8x16 MMA:
// two neighbouring 8-column tiles form one 16-wide k-slice ((4, 2), MMA_M, MMA_N / 2).
template <class Layout>
CUTE_HOST_DEVICE constexpr auto acc_to_a_layout(Layout acc) {
  static_assert(decltype(size<0>(acc))::value == 4);
  static_assert(decltype(rank(acc))::value == 3);
  auto l = logical_divide(acc, Shape<Underscore, Underscore, _2>{});
  return make_layout(make_layout(get<0>(l), get<2, 0>(l)), get<1>(l), get<2, 1>(l));
}

// Converts a float fragment to the element type, keeping its layout.
template <class Element, class Tensor_>
CUTE_DEVICE auto convert_fragment(Tensor_ const& src) {
  Tensor dst = make_tensor<Element>(src.layout());
  CUTE_UNROLL
  for (int i = 0; i < size(src); ++i) dst(i) = static_cast<Element>(src(i));
  return dst;
}

// Max or sum over groups of kLanes neighbouring lanes (kLanes a power of two, at most 32).
template <int kLanes, bool kMax>
CUTE_DEVICE float lane_group_reduce(float x) {
  CUTE_UNROLL
  for (int offset = 1; offset < kLanes; offset <<= 1) {
    const float other = __shfl_xor_sync(0xffffffff, x, offset);
    x = kMax ? fmaxf(x, other) : x + other;
  }
  return x;
}

}  // namespace splitkv
