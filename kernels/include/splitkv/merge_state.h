// The softmax state of one row while split partials are merged (params.h's contract,
// natural-log units). Merging is associative, so partials can be folded in any order and
// the combine kernel needs one pass whose loads do not wait on any arithmetic.
#pragma once

#include <cuda_runtime.h>

#include <cmath>

namespace splitkv {

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

// Stores four merged columns as Element (one 8-byte store).
template <typename Element>
__device__ __forceinline__ void store4(Element* dst, float4 v) {
  Element packed[4] = {Element(v.x), Element(v.y), Element(v.z), Element(v.w)};
  *reinterpret_cast<uint2*>(dst) = *reinterpret_cast<uint2*>(packed);
}

}  // namespace splitkv
