// The softmax state of one row while split partials are merged (params.h's contract,
// natural-log units), and the fold over a row's S partials that the combine kernel and the
// fused merge share, so both produce the same bits.
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "splitkv/rules.h"
#include "splitkv/utils.h"

namespace splitkv {

// How the lanes that fold one row together (fold_partials) share its kHeadDim columns: the
// combine kernel and the fused merge lay their threads out by kLanesPerRow, so both fold alike.
// Each lane owns kVecsPerLane vectors of kVecWidth floats; vector v of lane u starts at column
// v * kLanesPerRow * kVecWidth + u * kVecWidth, so one vector's loads by a row's lanes are
// contiguous. 64 and 128: one float4 per lane; 256: two float4 per lane (a row has at most a
// warp's 32 lanes); 96: three floats per lane on 32 lanes (96 / 4 = 24 lanes do not tile a warp,
// and 16 lanes of three float2 hold 96 floats per 16-split round, which raised the split kernel
// at bm16 kv32 to 190 registers, against 128 at D = 128).
template <int kHeadDim>
inline constexpr int kVecWidth = kHeadDim % 64 == 0 ? 4 : 1;
template <int kHeadDim>
inline constexpr int kLanesPerRow = rules::lanes_per_row(kHeadDim);
template <int kHeadDim>
inline constexpr int kVecsPerLane = kHeadDim / (kLanesPerRow<kHeadDim> * kVecWidth<kHeadDim>);
static_assert(kLanesPerRow<64> == 16 && kVecsPerLane<64> == 1 && kLanesPerRow<128> == 32 && kVecsPerLane<128> == 1,
              "64 and 128 keep one float4 per lane");

// Splits folded per round: lane u < 16 of a row's lanes loads split u's m and l, and every lane
// keeps its vectors of the 16 partial O rows in registers.
inline constexpr int kSplitsPerLoadRound = 16;

template <int kWidth>
struct FloatVec;
template <>
struct FloatVec<4> {
  using type = float4;
};
template <>
struct FloatVec<1> {
  using type = float;
};

__device__ __forceinline__ void scale_vec(float4& a, float s) {
  a.x *= s;
  a.y *= s;
  a.z *= s;
  a.w *= s;
}
__device__ __forceinline__ void scale_vec(float& a, float s) { a *= s; }
// a += b * w, one fma per float.
__device__ __forceinline__ void fma_vec(float4& a, float4 b, float w) {
  a.x = fmaf(b.x, w, a.x);
  a.y = fmaf(b.y, w, a.y);
  a.z = fmaf(b.z, w, a.z);
  a.w = fmaf(b.w, w, a.w);
}
__device__ __forceinline__ void fma_vec(float& a, float b, float w) { a = fmaf(b, w, a); }

template <int kHeadDim>
struct MergeState {
  using Vec = typename FloatVec<kVecWidth<kHeadDim>>::type;
  static constexpr int kVecs = kVecsPerLane<kHeadDim>;
  float m = -INFINITY;  // max of the m_s merged so far
  float l = 0.f;        // sum of exp(m_s - m) * l_s
  Vec o[kVecs] = {};    // sum of exp(m_s - m) * O_s over this lane's columns

  // Moves the running max up to m_new if it is higher, rescaling what was merged so far.
  __device__ __forceinline__ void raise_max(float m_new) {
    if (!(m_new > m)) return;
    const float keep = expf(m - m_new);  // 0 while nothing was merged (m == -inf)
    l *= keep;
#pragma unroll
    for (int v = 0; v < kVecs; ++v) scale_vec(o[v], keep);
    m = m_new;
  }

  // Adds weight * O_s, with weight = exp(m_s - m) for a split whose m_s is at most m.
  __device__ __forceinline__ void add_o(float weight, const Vec (&o_s)[kVecs]) {
#pragma unroll
    for (int v = 0; v < kVecs; ++v) fma_vec(o[v], o_s[v], weight);
  }

  __device__ __forceinline__ bool empty() const { return !(l > 0.f); }
  // lse = m + log(l); -inf for a row with no key.
  __device__ __forceinline__ float lse() const { return empty() ? -INFINITY : m + logf(l); }
  // O / l (vector v of this lane); 0 for a row with no key.
  __device__ __forceinline__ Vec normalized(int v) const {
    Vec out = o[v];
    scale_vec(out, empty() ? 0.f : 1.f / l);
    return out;
  }
};

// Folds workspace row `row` over its first `row_splits` partials (rows of one split are
// `split_stride` apart); `num_splits`, at least every row_splits of the warp, is the same for
// the whole warp and bounds its rounds. Partials at or past row_splits are never read. The kLanesPerRow lanes of a row (aligned inside a warp) each fold
// their kVecsPerLane vectors (columns as above); every lane of the warp must call this
// together (the shuffles use the full mask), a lane without a row of its own with any valid row.
// Per round of 16 splits: each lane issues its 16 x kVecsPerLane O loads, lane u loads split
// u's m and l, the lanes agree on the round's max with shuffles (one rescale per round), lane u
// computes split u's weight and every lane reads it back with one shuffle. The merging CTA runs
// this once, cold, with one warp per scheduler, so its time is its instruction count
// (docs/NOTES.md, session 5). Loads go through L2 only: in the fused merge they read what other
// SMs wrote during this launch. An empty split (l_s == 0) adds nothing, whatever its m_s and O_s hold.
template <int kHeadDim>
__device__ __forceinline__ MergeState<kHeadDim> fold_partials(const float* ws_o, const float* ws_m, const float* ws_l,
                                                              int num_splits, int row_splits, int64_t split_stride,
                                                              int64_t row, int lane) {
  using State = MergeState<kHeadDim>;
  using Vec = typename State::Vec;
  constexpr int kLanes = kLanesPerRow<kHeadDim>;
  constexpr int kVecs = State::kVecs;
  constexpr int kVecStride = kLanes * kVecWidth<kHeadDim>;  // columns between a lane's vectors
  static_assert(32 % kLanes == 0 && kSplitsPerLoadRound <= kLanes, "a row's lanes: inside one warp, one per split");
  static_assert(kVecs * kVecStride == kHeadDim, "a row's lanes cover its columns once");
  State state;
  const int64_t o_split_stride = split_stride * kHeadDim;
  const float* o_part = ws_o + row * kHeadDim + lane * kVecWidth<kHeadDim>;  // split s0's, then the next round's
  const float* m_part = ws_m + lane * split_stride + row;  // split s0 + lane's
  const float* l_part = ws_l + lane * split_stride + row;
  for (int s0 = 0; s0 < num_splits; s0 += kSplitsPerLoadRound) {
    const int n = min(num_splits - s0, kSplitsPerLoadRound);  // the warp's splits this round
    const int n_row = min(row_splits - s0, n);                 // the row's own
    Vec o_s[kSplitsPerLoadRound][kVecs];
#pragma unroll
    for (int u = 0; u < kSplitsPerLoadRound; ++u) {
      if (u < n_row) {
#pragma unroll
        for (int v = 0; v < kVecs; ++v) o_s[u][v] = __ldcg(reinterpret_cast<const Vec*>(o_part + v * kVecStride));
      }
      o_part += o_split_stride;
    }
    float m_u = -INFINITY, l_u = 0.f;  // split s0 + lane's statistics
    if (lane < n_row) {
      l_u = __ldcg(l_part);
      m_u = __ldcg(m_part);
      if (!(l_u > 0.f)) {  // empty: skipped whatever m_s holds
        m_u = -INFINITY;
        l_u = 0.f;
      }
    }
    m_part += kSplitsPerLoadRound * split_stride;
    l_part += kSplitsPerLoadRound * split_stride;
    state.raise_max(lane_group_reduce<kLanes, true>(m_u));
    const float w_u = l_u > 0.f ? expf(m_u - state.m) : 0.f;
    state.l += lane_group_reduce<kLanes, false>(w_u * l_u);
#pragma unroll
    for (int u = 0; u < kSplitsPerLoadRound; ++u) {
      if (u >= n) break;
      const float w = __shfl_sync(0xffffffff, w_u, u, kLanes);
      if (w > 0.f) state.add_o(w, o_s[u]);
    }
  }
  return state;
}

// Writes lane `lane`'s columns of query q_idx of head h_q (out: (B, Sq, Hq, D) with the given
// strides) and, from lane 0 (which owns column 0), its lse ((B, Hq, Sq) contiguous, may be null).
template <typename Element, int kHeadDim>
__device__ __forceinline__ void store_merged(const MergeState<kHeadDim>& state, void* out, float* lse,
                                             int64_t o_batch_stride, int64_t o_row_stride, int64_t o_head_stride,
                                             int q_heads, int q_len, int b, int h_q, int q_idx, int lane) {
  constexpr int kWidth = kVecWidth<kHeadDim>;
  using Packed = std::conditional_t<kWidth == 4, uint2, uint16_t>;  // kWidth elements of 16 bits
  Element* dst = static_cast<Element*>(out) + b * o_batch_stride + q_idx * o_row_stride + h_q * o_head_stride +
                 lane * kWidth;
#pragma unroll
  for (int v = 0; v < MergeState<kHeadDim>::kVecs; ++v) {
    const auto o = state.normalized(v);
    const float* f = reinterpret_cast<const float*>(&o);
    Element packed[kWidth];
#pragma unroll
    for (int i = 0; i < kWidth; ++i) packed[i] = Element(f[i]);
    *reinterpret_cast<Packed*>(dst + v * kLanesPerRow<kHeadDim> * kWidth) = *reinterpret_cast<Packed*>(packed);
  }
  if (lse != nullptr && lane == 0) lse[(int64_t(b) * q_heads + h_q) * q_len + q_idx] = state.lse();
}

}  // namespace splitkv
