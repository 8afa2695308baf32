// Split kernel: one CTA per (query tile, batch x KV head, split) streams its key range
// through a cp.async pipeline, keeps the online-softmax state and writes the partials
// of params.h's contract to the workspace (merging them itself in the last CTA of the tile
// when the merge is fused), or, with one split, writes the final output.
#pragma once

#include <cute/tensor.hpp>

#include "splitkv/fused_merge.h"
#include "splitkv/kernel_traits.h"
#include "splitkv/params.h"
#include "splitkv/utils.h"

namespace splitkv {

using namespace cute;

// One past the last key any row of query tile m_block may attend (tunables.tile_kv_end).
CUTE_DEVICE int tile_kv_end(const SplitParams& p, int m_block, int block_m) {
  if (!p.causal) return p.kv_len;
  const int last_row = min((m_block + 1) * block_m, p.packed_rows) - 1;
  const int last_q = last_row / p.group;
  return max(0, min(p.kv_len, last_q + 1 + p.kv_len - p.q_len));
}

// Keys [start, end) of one split (tunables.split_range); end <= start means empty.
CUTE_DEVICE int2 split_range(const SplitParams& p, int split, int kv_end, int block_kv) {
  if (p.split_policy == SplitPolicy::kLength) {
    const int start = int(int64_t(split) * p.kv_len / p.num_splits);
    const int end = int(int64_t(split + 1) * p.kv_len / p.num_splits);
    return make_int2(start, min(end, kv_end));
  }
  const int n_blocks = (kv_end + block_kv - 1) / block_kv;
  const int start = int(int64_t(split) * n_blocks / p.num_splits) * block_kv;
  const int end = min(int(int64_t(split + 1) * n_blocks / p.num_splits) * block_kv, kv_end);
  return make_int2(start, end);
}

// Combines per-thread row values (max or sum) across the quad and the warps that share a row.
template <bool kMax, int kWarpsN, int kBlockM, int kRows, class RowCoords>
CUTE_DEVICE void exchange_rows(float (&vals)[kRows], float* slots, RowCoords const& rc, int warp_n) {
  CUTE_UNROLL
  for (int i = 0; i < kRows; ++i) vals[i] = lane_group_reduce<4, kMax>(vals[i]);  // the quad sharing a row
  if constexpr (kWarpsN > 1) {
    if (threadIdx.x % 4 == 0) {
      CUTE_UNROLL
      for (int i = 0; i < kRows; ++i) slots[warp_n * kBlockM + get<0>(rc(i, 0))] = vals[i];
    }
    __syncthreads();
    CUTE_UNROLL
    for (int i = 0; i < kRows; ++i) {
      float acc = kMax ? -INFINITY : 0.f;
      CUTE_UNROLL
      for (int w = 0; w < kWarpsN; ++w) {
        const float x = slots[w * kBlockM + get<0>(rc(i, 0))];
        acc = kMax ? fmaxf(acc, x) : acc + x;
      }
      vals[i] = acc;
    }
  }
}

template <class Traits>
__global__ void __launch_bounds__(Traits::kNThreads) split_kv_kernel(const __grid_constant__ SplitParams p) {
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kBlockKV = Traits::kBlockKV;
  constexpr int kHeadDim = Traits::kHeadDim;
  constexpr int kStages = Traits::kStages;
  constexpr int kWarpsN = Traits::kWarpsN;
  constexpr float kLn2 = 0.693147180559945309f;

  extern __shared__ __align__(128) char smem[];
  const int tid = threadIdx.x;
  const int m_block = blockIdx.x;
  const int b = blockIdx.y / p.kv_heads;
  const int h_kv = blockIdx.y % p.kv_heads;
  const int split = blockIdx.z;
  const int row0 = m_block * kBlockM;
  const int warp_n = (tid / 32) / Traits::kWarpsM;

  const int2 range = split_range(p, split, tile_kv_end(p, m_block, kBlockM), kBlockKV);
  const int n_tiles = range.y > range.x ? (range.y - range.x + kBlockKV - 1) / kBlockKV : 0;

  Tensor sQ = make_tensor(make_smem_ptr(reinterpret_cast<Element*>(smem)),
                          typename Traits::SmemLayoutQ{});                       // (kBlockM, kHeadDim)
  Tensor sK = make_tensor(sQ.data() + int(Traits::kQElems),
                          typename Traits::SmemLayoutKV{});                      // (kBlockKV, kHeadDim, kStages)
  Tensor sV = make_tensor(sK.data() + int(Traits::kKVElems),
                          typename Traits::SmemLayoutKV{});                      // (kBlockKV, kHeadDim, kStages)
  Tensor sVt = make_tensor(sV.data(), typename Traits::SmemLayoutVt{});          // (kHeadDim, kBlockKV, kStages)
  Tensor sVtNoSwizzle = make_tensor(sV.data().get(), typename Traits::SmemLayoutVtNoSwizzle{});
  Tensor sP = make_tensor(sV.data() + int(Traits::kKVElems),
                          typename Traits::SmemLayoutP{});                       // (kBlockM, kBlockKV)
  float* exchange = reinterpret_cast<float*>(smem + Traits::kSmemBytes - 4 * Traits::kExchangeFloats);

  const Element* k_base = static_cast<const Element*>(p.k) + b * p.k_batch_stride + h_kv * p.k_head_stride;
  const Element* v_base = static_cast<const Element*>(p.v) + b * p.v_batch_stride + h_kv * p.v_head_stride;
  typename Traits::GmemCopyKV gmem_copy;
  auto gmem_thr_copy = gmem_copy.get_thread_slice(tid);
  Tensor cKV = make_identity_tensor(Shape<Int<kBlockKV>, Int<kHeadDim>>{});  // (kBlockKV, kHeadDim) -> (n, d)
  Tensor tKVcKV = gmem_thr_copy.partition_S(cKV);                            // (CPY, CPY_N, CPY_D)

  // Copies keys [n0, n0 + kBlockKV) of K and V into `stage`, zero-filling rows past the split.
  auto load_kv = [&](int tile, int stage) {
    const int n0 = range.x + tile * kBlockKV;
    const int valid = range.y - n0;
    Tensor gK = make_tensor(make_gmem_ptr(k_base + int64_t(n0) * p.k_row_stride),
                            Shape<Int<kBlockKV>, Int<kHeadDim>>{}, make_stride(p.k_row_stride, _1{}));
    Tensor gV = make_tensor(make_gmem_ptr(v_base + int64_t(n0) * p.v_row_stride),
                            Shape<Int<kBlockKV>, Int<kHeadDim>>{}, make_stride(p.v_row_stride, _1{}));
    Tensor tKgK = gmem_thr_copy.partition_S(gK);                // (CPY, CPY_N, CPY_D)
    Tensor tVgV = gmem_thr_copy.partition_S(gV);
    Tensor tKsK = gmem_thr_copy.partition_D(sK(_, _, stage));
    Tensor tVsV = gmem_thr_copy.partition_D(sV(_, _, stage));
    CUTE_UNROLL
    for (int m = 0; m < size<1>(tKgK); ++m) {
      if (get<0>(tKVcKV(0, m, 0)) < valid) {
        CUTE_UNROLL
        for (int d = 0; d < size<2>(tKgK); ++d) {
          copy(gmem_copy, tKgK(_, m, d), tKsK(_, m, d));
          copy(gmem_copy, tVgV(_, m, d), tVsV(_, m, d));
        }
      } else {
        clear(tKsK(_, m, _));
        clear(tVsV(_, m, _));
      }
    }
  };

  typename Traits::TiledMma tiled_mma;
  auto thr_mma = tiled_mma.get_thread_slice(tid);
  Tensor tSrQ = thr_mma.partition_fragment_A(sQ);                         // (MMA, MMA_M, MMA_D)
  Tensor tSrK = thr_mma.partition_fragment_B(sK(_, _, 0));                // (MMA, MMA_N, MMA_D)
  Tensor tOrP = thr_mma.partition_fragment_A(sP);                         // (MMA, MMA_M, MMA_N)
  Tensor tOrVt = thr_mma.partition_fragment_B(sVtNoSwizzle(_, _, 0));     // (MMA, MMA_D, MMA_N)
  Tensor acc_o = partition_fragment_C(tiled_mma, Shape<Int<kBlockM>, Int<kHeadDim>>{});  // (MMA, MMA_M, MMA_D)
  clear(acc_o);

  auto smem_copy_q = make_tiled_copy_A(typename Traits::SmemCopyA{}, tiled_mma);
  auto smem_thr_copy_q = smem_copy_q.get_thread_slice(tid);
  Tensor tSsQ = smem_thr_copy_q.partition_S(sQ);
  auto smem_copy_k = make_tiled_copy_B(typename Traits::SmemCopyB{}, tiled_mma);
  auto smem_thr_copy_k = smem_copy_k.get_thread_slice(tid);
  Tensor tSsK = smem_thr_copy_k.partition_S(sK);                          // (CPY, CPY_N, CPY_D, kStages)
  auto smem_copy_p = make_tiled_copy_A(typename Traits::SmemCopyA{}, tiled_mma);
  auto smem_thr_copy_p = smem_copy_p.get_thread_slice(tid);
  Tensor tOsP = smem_thr_copy_p.partition_S(sP);
  auto smem_copy_vt = make_tiled_copy_B(typename Traits::SmemCopyBt{}, tiled_mma);
  auto smem_thr_copy_vt = smem_copy_vt.get_thread_slice(tid);
  Tensor tOsVt = smem_thr_copy_vt.partition_S(sVt);                       // (CPY, CPY_D, CPY_N, kStages)
  auto smem_copy_c = make_tiled_copy_C(typename Traits::SmemCopyC{}, tiled_mma);
  auto smem_thr_copy_c = smem_copy_c.get_thread_slice(tid);
  Tensor tPsP = smem_thr_copy_c.partition_D(sP);

  // (row, col) coordinates of this thread's score accumulators, in rows x cols form.
  Tensor tScS = thr_mma.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockKV>>{}));
  Tensor tScS_rc = make_tensor(tScS.data(), acc_rowcol(tScS.layout()));   // (ROWS, COLS)
  constexpr int kRows = decltype(size<0>(tScS_rc))::value;
  float row_max[kRows];  // running max of the scores, base-2 units
  float row_sum[kRows];  // this thread's share of the running sum
  CUTE_UNROLL
  for (int i = 0; i < kRows; ++i) {
    row_max[i] = -INFINITY;
    row_sum[i] = 0.f;
  }
  // Keys visible to each row: < key_limit[i] (split end and the causal diagonal).
  int key_limit[kRows];
  CUTE_UNROLL
  for (int i = 0; i < kRows; ++i) {
    const int q_idx = (row0 + get<0>(tScS_rc(i, 0))) / p.group;
    key_limit[i] = p.causal ? min(range.y, q_idx + 1 + p.kv_len - p.q_len) : range.y;
  }

  if (n_tiles > 0) {
    load_kv(0, 0);
    cp_async_fence();
  }
  CUTE_UNROLL
  for (int s = 1; s < kStages; ++s) {
    if (s < n_tiles) load_kv(s, s);
    cp_async_fence();
  }

  // Q, gathered while the first K/V stages are in flight: packed row r is query r / G of query head h_kv * G + r % G, so rows are gathered.
  const Element* q_base = static_cast<const Element*>(p.q) + b * p.q_batch_stride +
                          int64_t(h_kv) * p.group * p.q_head_stride;
  constexpr int kChunksPerRow = kHeadDim / 8;
  for (int idx = tid; idx < kBlockM * kChunksPerRow; idx += Traits::kNThreads) {
    const int r = idx / kChunksPerRow;
    const int c = (idx % kChunksPerRow) * 8;
    const int row = row0 + r;
    uint4 chunk = make_uint4(0, 0, 0, 0);
    if (row < p.packed_rows) {
      const int q_idx = row / p.group;
      const int g = row % p.group;
      chunk = *reinterpret_cast<const uint4*>(q_base + q_idx * p.q_row_stride + g * p.q_head_stride + c);
    }
    *reinterpret_cast<uint4*>(&sQ(r, c)) = chunk;
  }

  Tensor o_rc = make_tensor(acc_o.data(), acc_rowcol(acc_o.layout()));    // (ROWS, D_COLS)
  for (int t = 0; t < n_tiles; ++t) {
    const int stage = t % kStages;
    cp_async_wait<kStages - 1>();
    __syncthreads();

    Tensor acc_s = partition_fragment_C(tiled_mma, Shape<Int<kBlockM>, Int<kBlockKV>>{});  // (MMA, MMA_M, MMA_N)
    clear(acc_s);
    gemm_smem(tiled_mma, acc_s, tSrQ, tSrK, tSsQ, tSsK(_, _, _, stage), smem_copy_q, smem_copy_k,
              smem_thr_copy_q, smem_thr_copy_k);

    Tensor s_rc = make_tensor(acc_s.data(), acc_rowcol(acc_s.layout()));  // (ROWS, COLS)
    const int n0 = range.x + t * kBlockKV;
    float tile_max[kRows];
    CUTE_UNROLL
    for (int i = 0; i < kRows; ++i) {
      tile_max[i] = -INFINITY;
      CUTE_UNROLL
      for (int j = 0; j < size<1>(s_rc); ++j) {
        const bool visible = n0 + get<1>(tScS_rc(i, j)) < key_limit[i];
        s_rc(i, j) = visible ? s_rc(i, j) * p.scale_log2 : -INFINITY;
        tile_max[i] = fmaxf(tile_max[i], s_rc(i, j));
      }
    }
    exchange_rows<true, kWarpsN, kBlockM>(tile_max, exchange, tScS_rc, warp_n);

    CUTE_UNROLL
    for (int i = 0; i < kRows; ++i) {
      const float m_next = fmaxf(row_max[i], tile_max[i]);
      const float m_use = m_next == -INFINITY ? 0.f : m_next;  // a row with no key yet stays at 0
      const float correction = exp2f(row_max[i] - m_use);
      row_max[i] = m_next;
      float sum = 0.f;
      CUTE_UNROLL
      for (int j = 0; j < size<1>(s_rc); ++j) {
        s_rc(i, j) = exp2f(s_rc(i, j) - m_use);
        sum += s_rc(i, j);
      }
      row_sum[i] = row_sum[i] * correction + sum;
      CUTE_UNROLL
      for (int j = 0; j < size<1>(o_rc); ++j) o_rc(i, j) *= correction;
    }

    Tensor rP = convert_fragment<Element>(acc_s);
    if constexpr (kWarpsN == 1) {
      // Each warp owns whole rows: P stays in registers as the A operand of P V.
      Tensor tOrP_regs = make_tensor(rP.data(), acc_to_a_layout(rP.layout()));
      gemm_rs(tiled_mma, acc_o, tOrP_regs, tOrVt, tOsVt(_, _, _, stage), smem_copy_vt, smem_thr_copy_vt);
    } else {
      // Warps split the key columns: P goes through shared memory to the warps that own V's columns.
      copy(smem_copy_c, smem_thr_copy_c.retile_S(rP), tPsP);
      __syncthreads();
      gemm_smem(tiled_mma, acc_o, tOrP, tOrVt, tOsP, tOsVt(_, _, _, stage), smem_copy_p, smem_copy_vt,
                smem_thr_copy_p, smem_thr_copy_vt);
    }
    __syncthreads();  // every warp is done with this stage and with sP
    if (t + kStages < n_tiles) load_kv(t + kStages, stage);
    cp_async_fence();
  }

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // Let the combine kernel launch while the last CTAs write their partials.
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
  exchange_rows<false, kWarpsN, kBlockM>(row_sum, exchange + Traits::kExchangeFloats / 2, tScS_rc, warp_n);

  Tensor tOcO = thr_mma.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  Tensor tOcO_rc = make_tensor(tOcO.data(), acc_rowcol(tOcO.layout()));  // (ROWS, D_COLS)
  constexpr int kColPairs = decltype(size<1>(o_rc))::value / 2;
  const bool writes_stats = warp_n == 0 && tid % 4 == 0;
  CUTE_UNROLL
  for (int i = 0; i < kRows; ++i) {
    const int row = row0 + get<0>(tOcO_rc(i, 0));
    if (row >= p.packed_rows) continue;
    const int q_idx = row / p.group;
    const int h_q = h_kv * p.group + row % p.group;
    const bool empty = row_sum[i] == 0.f;
    if (p.num_splits == 1) {
      const float inv = empty ? 0.f : 1.f / row_sum[i];
      Element* o_row = static_cast<Element*>(p.out) + b * p.o_batch_stride + q_idx * p.o_row_stride +
                       h_q * p.o_head_stride;
      CUTE_UNROLL
      for (int j = 0; j < kColPairs; ++j) {
        const int col = get<1>(tOcO_rc(i, make_coord(0, j)));
        Element pair[2] = {Element(o_rc(i, make_coord(0, j)) * inv), Element(o_rc(i, make_coord(1, j)) * inv)};
        *reinterpret_cast<uint32_t*>(o_row + col) = *reinterpret_cast<uint32_t*>(pair);
      }
      if (p.lse != nullptr && writes_stats) {
        p.lse[(int64_t(b) * p.q_heads + h_q) * p.q_len + q_idx] =
            empty ? -INFINITY : row_max[i] * kLn2 + logf(row_sum[i]);
      }
    } else {
      const int64_t ws_row = ((int64_t(split) * p.batch + b) * p.kv_heads + h_kv) * p.packed_rows + row;
      float* o_ws = p.ws_o + ws_row * kHeadDim;
      CUTE_UNROLL
      for (int j = 0; j < kColPairs; ++j) {
        const int col = get<1>(tOcO_rc(i, make_coord(0, j)));
        *reinterpret_cast<float2*>(o_ws + col) = make_float2(o_rc(i, make_coord(0, j)), o_rc(i, make_coord(1, j)));
      }
      if (writes_stats) {
        p.ws_m[ws_row] = empty ? -INFINITY : row_max[i] * kLn2;
        p.ws_l[ws_row] = row_sum[i];
      }
    }
  }
  if (p.num_splits > 1 && p.tile_counters != nullptr) merge_if_last_split<Traits>(p, m_block, row0, b, h_kv);
}

}  // namespace splitkv
