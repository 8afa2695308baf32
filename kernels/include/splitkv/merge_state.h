// The softmax state of one row while split partials are merged (params.h's contract,
// natural-log units), and the fold over a row's S partials that the combine kernel and the
// fused merge share. Merging is associative, so partials can be folded in any order and
// each round of loads waits on no arithmetic.
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

namespace splitkv {

// Splits whose loads one thread issues together: enough to cover the usual S in one round
// trip, few enough that 16 float4 stay in registers.
inline constexpr int kSplitsPerLoadRound = 16;

struct MergeState {
  float m = -INFINITY;                     // max of the m_s merged so far
  float l = 0.f;                           // sum of exp(m_s - m) * l_s
  float4 o = make_float4(0.f, 0.f, 0.f, 0.f);  // sum of exp(m_s - m) * O_s over this thread's 4 columns

  // Folds in one split. An empty split (l_s == 0, or m_s == -inf) changes nothing, whatever
  // its O_s holds.
  __device__ __forceinline__ void merge(float m_s, float l_s, float4 o_s) {
    if (!(l_s > 0.f) || m_s == -INFINITY) return;
    const float m_new = fmaxf(m, m_s);
    const float keep = expf(m - m_new);  // 0 while nothing was merged (m == -inf)
    const float take = expf(m_s - m_new);
    l = l * keep + l_s * take;
    o.x = o.x * keep + o_s.x * take;
    o.y = o.y * keep + o_s.y * take;
    o.z = o.z * keep + o_s.z * take;
    o.w = o.w * keep + o_s.w * take;
    m = m_new;
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

// Folds columns [col, col + 4) of workspace row `row` over its `num_splits` partials
// (rows of one split are `split_stride` apart). Loads go through L2 only: in the fused merge
// they read what other SMs wrote during this launch.
template <int kHeadDim>
__device__ __forceinline__ MergeState fold_partials(const float* ws_o, const float* ws_m, const float* ws_l,
                                                    int num_splits, int64_t split_stride, int64_t row, int col) {
  MergeState state;
  const float* o_part = ws_o + row * kHeadDim + col;
  for (int s0 = 0; s0 < num_splits; s0 += kSplitsPerLoadRound) {
    float m_s[kSplitsPerLoadRound], l_s[kSplitsPerLoadRound];
    float4 o_s[kSplitsPerLoadRound];
#pragma unroll
    for (int u = 0; u < kSplitsPerLoadRound; ++u) {
      const int64_t s = s0 + u;
      const bool in_range = s < num_splits;
      m_s[u] = in_range ? __ldcg(ws_m + s * split_stride + row) : -INFINITY;
      l_s[u] = in_range ? __ldcg(ws_l + s * split_stride + row) : 0.f;
      o_s[u] = in_range ? __ldcg(reinterpret_cast<const float4*>(o_part + s * split_stride * kHeadDim))
                        : make_float4(0.f, 0.f, 0.f, 0.f);
    }
#pragma unroll
    for (int u = 0; u < kSplitsPerLoadRound; ++u) state.merge(m_s[u], l_s[u], o_s[u]);
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
