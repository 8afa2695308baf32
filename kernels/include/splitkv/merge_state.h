// The softmax state of one row while split partials are merged (params.h's contract,
// natural-log units), and the fold over a row's S partials that the combine kernel and the
// fused merge share, so both produce the same bits.
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "splitkv/rules.h"
#include "splitkv/utils.h"

namespace splitkv {

// Lanes that fold one row together (fold_partials), each owning one float4 of its O: the
// combine kernel and the fused merge lay their threads out by it, so both fold alike.
template <int kHeadDim>
inline constexpr int kLanesPerRow = rules::lanes_per_row(kHeadDim);

// Splits folded per round: lane u < 16 of a row's lanes loads split u's m and l, and every lane
// keeps its float4 of the 16 partial O rows in registers.
inline constexpr int kSplitsPerLoadRound = 16;

struct MergeState {
  float m = -INFINITY;                     // max of the m_s merged so far
  float l = 0.f;                           // sum of exp(m_s - m) * l_s
  float4 o = make_float4(0.f, 0.f, 0.f, 0.f);  // sum of exp(m_s - m) * O_s over this thread's 4 columns

  // Moves the running max up to m_new if it is higher, rescaling what was merged so far.
  __device__ __forceinline__ void raise_max(float m_new) {
    if (!(m_new > m)) return;
    const float keep = expf(m - m_new);  // 0 while nothing was merged (m == -inf)
    l *= keep;
    o.x *= keep;
    o.y *= keep;
    o.z *= keep;
    o.w *= keep;
    m = m_new;
  }

  // Adds weight * O_s, with weight = exp(m_s - m) for a split whose m_s is at most m.
  __device__ __forceinline__ void add_o(float weight, float4 o_s) {
    o.x = fmaf(o_s.x, weight, o.x);
    o.y = fmaf(o_s.y, weight, o.y);
    o.z = fmaf(o_s.z, weight, o.z);
    o.w = fmaf(o_s.w, weight, o.w);
  }

  __device__ __forceinline__ bool empty() const { return !(l > 0.f); }
  // lse = m + log(l); -inf for a row with no key.
  __device__ __forceinline__ float lse() const { return empty() ? -INFINITY : m + logf(l); }
  // O / l; 0 for a row with no key.
  __device__ __forceinline__ float4 normalized() const {
    const float inv = empty() ? 0.f : 1.f / l;
    return make_float4(o.x * inv, o.y * inv, o.z * inv, o.w * inv);
  }
};

// Folds workspace row `row` over its `num_splits` partials (rows of one split are
// `split_stride` apart). The kLanesPerRow lanes of a row (aligned inside a warp) each fold the
// float4 at column 4 * lane; every lane of the warp must call this together (the shuffles
// use the full mask), a lane without a row of its own with any valid row.
// Per round of 16 splits: each lane issues its 16 O loads, lane u loads split u's m and l,
// the lanes agree on the round's max with shuffles (one rescale per round), lane u computes
// split u's weight and every lane reads it back with one shuffle. The merging CTA runs this
// once, cold, with one warp per scheduler, so its time is its instruction count (docs/NOTES.md,
// session 5). Loads go through L2 only: in the fused merge they read what other SMs wrote
// during this launch. An empty split (l_s == 0) adds nothing, whatever its m_s and O_s hold.
template <int kHeadDim>
__device__ __forceinline__ MergeState fold_partials(const float* ws_o, const float* ws_m, const float* ws_l,
                                                    int num_splits, int64_t split_stride, int64_t row, int lane) {
  constexpr int kLanes = kLanesPerRow<kHeadDim>;
  static_assert(32 % kLanes == 0 && kSplitsPerLoadRound <= kLanes, "a row's lanes: inside one warp, one per split");
  MergeState state;
  const int64_t o_split_stride = split_stride * kHeadDim;
  const float* o_part = ws_o + row * kHeadDim + lane * 4;  // split s0's, then the next round's
  const float* m_part = ws_m + lane * split_stride + row;  // split s0 + lane's
  const float* l_part = ws_l + lane * split_stride + row;
  for (int s0 = 0; s0 < num_splits; s0 += kSplitsPerLoadRound) {
    const int n = min(num_splits - s0, kSplitsPerLoadRound);
    float4 o_s[kSplitsPerLoadRound];
#pragma unroll
    for (int u = 0; u < kSplitsPerLoadRound; ++u) {
      if (u < n) o_s[u] = __ldcg(reinterpret_cast<const float4*>(o_part));
      o_part += o_split_stride;
    }
    float m_u = -INFINITY, l_u = 0.f;  // split s0 + lane's statistics
    if (lane < n) {
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

// Writes columns [col, col + 4) of query q_idx of head h_q (out: (B, Sq, Hq, D) with the given
// strides) and, from the thread that owns column 0, its lse ((B, Hq, Sq) contiguous, may be null).
template <typename Element>
__device__ __forceinline__ void store_merged(const MergeState& state, void* out, float* lse, int64_t o_batch_stride,
                                             int64_t o_row_stride, int64_t o_head_stride, int q_heads, int q_len,
                                             int b, int h_q, int q_idx, int col) {
  Element* dst = static_cast<Element*>(out) + b * o_batch_stride + q_idx * o_row_stride + h_q * o_head_stride + col;
  const float4 o = state.normalized();
  Element packed[4] = {Element(o.x), Element(o.y), Element(o.z), Element(o.w)};
  *reinterpret_cast<uint2*>(dst) = *reinterpret_cast<uint2*>(packed);
  if (lse != nullptr && col == 0) lse[(int64_t(b) * q_heads + h_q) * q_len + q_idx] = state.lse();
}

}  // namespace splitkv
