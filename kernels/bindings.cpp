// pybind11 module splitkv_tune._C: the eager call's whole host path (checks, allocations,
// launch) in C++, so that a call costs a few microseconds of host time. Torch headers are used
// here only; the kernel headers under kernels/include stay torch-free and take a params struct.
#include <torch/extension.h>
#include <pybind11/stl.h>

#include <ATen/cuda/EmptyTensor.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>

#include "splitkv/dispatch.h"
#include "splitkv/launch_utils.h"
#include "splitkv/live_check.h"
#include "splitkv/rules.h"
#include "splitkv/tunables.h"
#include "live_launch_cache.h"
#include "plan_cache.h"
#include "stream_buffers.h"

namespace py = pybind11;
using namespace splitkv;
using namespace splitkv::binding;

namespace {

using rules::kMaxGridY;

std::string shape_str(const at::Tensor& t) {
  std::string s = "(";
  for (int64_t i = 0; i < t.dim(); ++i) s += (i ? ", " : "") + std::to_string(t.size(i));
  return s + (t.dim() == 1 ? ",)" : ")");
}

std::string dtype_str(const at::Tensor& t) { return "torch." + std::string(c10::toString(t.scalar_type())); }

int dtype_code(at::ScalarType t) {
  return t == at::kHalf ? int(DType::kFp16) : t == at::kBFloat16 ? int(DType::kBf16) : -1;
}

const at::Tensor& tensor_arg(py::handle obj, const char* name) {
  if (!THPVariable_Check(obj.ptr())) {
    throw py::type_error(std::string(name) + " must be a torch.Tensor, got " +
                         std::string(py::str(py::type::handle_of(obj).attr("__name__"))));
  }
  const at::Tensor& t = THPVariable_Unpack(obj.ptr());
  if (dtype_code(t.scalar_type()) < 0) {
    throw py::type_error(std::string(name) + " must be float16 or bfloat16, got " + dtype_str(t));
  }
  if (!t.is_cuda()) throw py::value_error(std::string(name) + " must be on a CUDA device, got " + t.device().str());
  if (t.dim() != 4) {
    throw py::value_error(std::string(name) + " must have 4 dimensions (batch, seq, heads, head_dim), got shape " +
                          shape_str(t));
  }
  if (t.stride(3) != 1) {
    throw py::value_error(std::string(name) + " must have a contiguous last dim (stride 1), got stride " +
                          std::to_string(t.stride(3)));
  }
  return t;
}

Dims checked_dims(py::handle q_obj, py::handle k_obj, py::handle v_obj) {
  const at::Tensor& q = tensor_arg(q_obj, "q");
  const at::Tensor& k = tensor_arg(k_obj, "k");
  const at::Tensor& v = tensor_arg(v_obj, "v");
  if (k.scalar_type() != q.scalar_type() || v.scalar_type() != q.scalar_type()) {
    throw py::type_error("q, k and v must share one dtype, got " + dtype_str(q) + ", " + dtype_str(k) + ", " +
                         dtype_str(v));
  }
  if (k.device() != q.device() || v.device() != q.device()) {
    throw py::value_error("q, k and v must be on one device, got " + q.device().str() + ", " + k.device().str() +
                          ", " + v.device().str());
  }
  if (k.sizes() != v.sizes()) {
    throw py::value_error("k and v must have the same shape, got " + shape_str(k) + " and " + shape_str(v));
  }
  const Dims d{dtype_code(q.scalar_type()), int(q.device().index()), q.size(3), q.size(0), q.size(2), k.size(2),
               q.size(1), k.size(1)};
  if (k.size(0) != d.batch) {
    throw py::value_error("k batch (" + std::to_string(k.size(0)) + ") must equal q batch (" +
                          std::to_string(d.batch) + ")");
  }
  if (k.size(3) != d.head_dim) {
    throw py::value_error("k head_dim (" + std::to_string(k.size(3)) + ") must equal q head_dim (" +
                          std::to_string(d.head_dim) + ")");
  }
  if (!is_allowed(kHeadDims, int(d.head_dim))) {
    std::string allowed;
    for (int hd : kHeadDims) allowed += (allowed.empty() ? "" : ", ") + std::to_string(hd);
    throw py::value_error("head_dim must be one of (" + allowed + "), got " + std::to_string(d.head_dim));
  }
  const std::pair<const char*, int64_t> dims[] = {
      {"batch", d.batch}, {"q_heads", d.q_heads}, {"kv_heads", d.kv_heads}, {"q_len", d.q_len}, {"kv_len", d.kv_len}};
  for (const auto& [name, value] : dims) {
    if (value < 1) {
      throw py::value_error(std::string(name) + " must be a positive integer, got " + std::to_string(value));
    }
  }
  if (d.q_heads % d.kv_heads) {
    throw py::value_error("q_heads (" + std::to_string(d.q_heads) + ") must be a multiple of kv_heads (" +
                          std::to_string(d.kv_heads) + ")");
  }
  if (d.batch * d.kv_heads > kMaxGridY) {
    throw py::value_error("batch * kv_heads must be at most " + std::to_string(kMaxGridY) + ", got " +
                          std::to_string(d.batch * d.kv_heads));
  }
  if (std::max(d.kv_len, d.q_len * (d.q_heads / d.kv_heads)) > rules::kMaxKeys) {
    throw py::value_error("kv_len and q_len * (q_heads / kv_heads) must be at most " + std::to_string(rules::kMaxKeys));
  }
  return d;
}

// An uninitialised tensor on a CUDA device, from the caching allocator as at::empty's is, without
// the dispatcher's round trip: one of the few things an eager call does besides its launch.
at::Tensor empty_on_device(at::IntArrayRef sizes, at::ScalarType dtype, at::Device device) {
  return at::Tensor(at::detail::empty_cuda(sizes, dtype, device, std::nullopt));
}

// The tensor itself when its rows are 16-byte aligned (the kernels' vector loads), else a copy.
at::Tensor aligned(const at::Tensor& t) {
  bool ok = reinterpret_cast<std::uintptr_t>(t.data_ptr()) % 16 == 0;
  for (int64_t i = 0; i < t.dim() - 1; ++i) ok = ok && (t.stride(i) * t.element_size()) % 16 == 0;
  return ok ? t : t.clone(at::MemoryFormat::Contiguous);
}

void set_strides(const at::Tensor& t, int64_t& batch, int64_t& row, int64_t& head) {
  batch = t.stride(0);
  row = t.stride(1);
  head = t.stride(2);
}

// The combine kernel's params: partials of num_splits splits into out (B, Sq, Hkv * group, D)
// and lse (may be null).
CombineParams combine_params(const float* ws_o, const float* ws_m, const float* ws_l, const at::Tensor& out,
                             float* lse, int batch, int kv_heads, int group, int q_len, int num_splits,
                             const SplitParams* live = nullptr) {
  CombineParams c{};
  c.ws_o = ws_o;
  c.ws_m = ws_m;
  c.ws_l = ws_l;
  c.out = out.data_ptr();
  c.lse = lse;
  set_strides(out, c.o_batch_stride, c.o_row_stride, c.o_head_stride);
  c.batch = batch;
  c.kv_heads = kv_heads;
  c.group = group;
  c.q_len = q_len;
  c.packed_rows = q_len * group;
  c.num_splits = num_splits;
  c.total_rows = int64_t(batch) * kv_heads * c.packed_rows;
  if (live != nullptr) {
    c.seqlens = live->seqlens;
    c.block_kv = live->block_kv;
    c.min_blocks_per_split = live->min_blocks_per_split;
    c.plan_choices = live->plan_choices;
    c.ws_plan = live->ws_plan;
  }
  return c;
}

// Launches the split kernel (and the combine kernel when it merges) on torch's current stream
// of q's device. q, k, v passed checked_dims (or, for a paged / variable-length batch, the
// checks of ops.py) and the tunables were validated by ops.py; the workspace (None: the default
// one) is checked here. With cache_seqlens (int32 [B]) each sequence is split by its live length
// (params.h), num_splits is the bound max_splits and split_policy is "blocks"; with block_table
// (int32 [B, max_pages]) k and v are page pools (num_pages, page_size, Hkv, D). Returns
// (out, lse); lse is undefined unless return_lse.
std::pair<at::Tensor, at::Tensor> launch(py::handle q_obj, py::handle k_obj, py::handle v_obj,
                                         py::handle workspace_obj, bool causal, double softmax_scale,
                                         const LaunchArgs& a, bool return_lse, bool programmatic,
                                         py::handle seqlens_obj, py::handle block_table_obj, int min_blocks_per_split,
                                         int plan_choices) {
  const int num_splits = a.num_splits, block_kv = a.block_kv;
  const bool fused_merge = a.fused_merge;
  const at::Tensor q = aligned(THPVariable_Unpack(q_obj.ptr()));
  const at::Tensor k = aligned(THPVariable_Unpack(k_obj.ptr()));
  const at::Tensor v = aligned(THPVariable_Unpack(v_obj.ptr()));
  const bool live = !seqlens_obj.is_none();
  const bool paged = !block_table_obj.is_none();
  const at::Tensor seqlens = live ? THPVariable_Unpack(seqlens_obj.ptr()).contiguous() : at::Tensor();
  // The kernel indexes the table as [b * stride(0) + page]: its last dim must be dense (a traced
  // caller may hand over any layout).
  const at::Tensor block_table = paged ? THPVariable_Unpack(block_table_obj.ptr()).contiguous() : at::Tensor();
  const int device = q.device().index();
  const c10::cuda::CUDAGuard guard(q.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device).stream();

  SplitParams p{};
  p.batch = int(q.size(0));
  p.q_len = int(q.size(1));
  p.q_heads = int(q.size(2));
  const int head_dim = int(q.size(3));
  p.kv_len = int(paged ? block_table.size(1) * k.size(1) : k.size(1));
  p.kv_heads = int(k.size(2));
  p.group = p.q_heads / p.kv_heads;
  p.packed_rows = p.q_len * p.group;
  p.num_splits = num_splits;
  const int block_m = rules::block_m_for(p.packed_rows);
  p.num_m_blocks = rules::num_m_blocks(p.packed_rows);
  p.softmax_scale = float(softmax_scale);
  p.scale_log2 = float(softmax_scale * 1.4426950408889634);
  p.causal = causal;
  p.split_policy = static_cast<SplitPolicy>(live ? int(SplitPolicy::kBlocks) : a.split_policy);
  if (live) {
    p.seqlens = seqlens.data_ptr<int>();
    p.block_kv = block_kv;
    p.min_blocks_per_split = min_blocks_per_split;
    p.plan_choices = plan_choices;
  }
  if (paged) {
    p.block_table = block_table.data_ptr<int>();
    p.block_table_stride = block_table.stride(0);
    int shift = 0;
    while ((int64_t(1) << shift) < k.size(1)) ++shift;
    p.page_shift = shift;
  }
  const auto dtype = static_cast<DType>(dtype_code(q.scalar_type()));
  const int smem = rules::smem_bytes(int(q.element_size()), head_dim, block_m, block_kv);
  if (smem > smem_optin_limit(device)) {
    throw py::value_error("block_kv=" + std::to_string(block_kv) + " with head_dim=" + std::to_string(head_dim) +
                          " and a " + std::to_string(block_m) + "-row query tile needs " + std::to_string(smem) +
                          " bytes of shared memory; this device allows " + std::to_string(smem_optin_limit(device)));
  }
  // The item counter runs past the last item once per CTA, to at most twice the capacity.
  if (live && 2 * rules::live_work_capacity(p.batch, p.kv_heads, p.packed_rows, num_splits) > INT32_MAX) {
    throw py::value_error("batch * kv_heads * query tiles * max_splits must be below 2^30, got batch=" +
                          std::to_string(p.batch) + " kv_heads=" + std::to_string(p.kv_heads) +
                          " max_splits=" + std::to_string(num_splits));
  }

  at::Tensor out = empty_on_device(q.sizes(), q.scalar_type(), q.device());
  at::Tensor lse;
  if (return_lse) lse = empty_on_device({q.size(0), q.size(2), q.size(1)}, at::kFloat, q.device());
  const rules::WorkspaceSections sections =
      rules::workspace_sections(num_splits, p.batch, p.q_heads, p.q_len, head_dim, live);
  const bool captured = capturing(stream);
  const at::Tensor workspace = workspace_obj.is_none() ? default_workspace(q, sections.total, stream, captured)
                                                       : checked_workspace(workspace_obj, q, sections.total);
  char* base = static_cast<char*>(workspace.data_ptr());

  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.out = out.data_ptr();
  p.lse = return_lse ? lse.data_ptr<float>() : nullptr;
  p.ws_o = reinterpret_cast<float*>(base);
  p.ws_m = reinterpret_cast<float*>(base + sections.m_offset);
  p.ws_l = reinterpret_cast<float*>(base + sections.l_offset);
  p.ws_plan = live && num_splits > 1 ? reinterpret_cast<int*>(base + sections.plan_offset) : nullptr;
  // One zeroed buffer holds the fused merge's tile counters, then the schedule's work counters.
  const int64_t tile_count =
      fused_merge && num_splits > 1 ? rules::tile_counter_count(p.batch, p.kv_heads, p.packed_rows) : 0;
  const int64_t counter_count = tile_count + (live ? rules::kWorkCounters : 0);
  int* counters = counter_count > 0 ? launch_counters(device, stream, counter_count, captured) : nullptr;
  p.tile_counters = tile_count > 0 ? counters : nullptr;
  p.work_counters = live ? counters + tile_count : nullptr;
  set_strides(q, p.q_batch_stride, p.q_row_stride, p.q_head_stride);
  set_strides(k, p.k_batch_stride, p.k_row_stride, p.k_head_stride);
  set_strides(v, p.v_batch_stride, p.v_row_stride, p.v_head_stride);
  set_strides(out, p.o_batch_stride, p.o_row_stride, p.o_head_stride);
  run_split(p, dtype, head_dim, block_m, block_kv, stream, programmatic);

  if (num_splits > 1 && !fused_merge) {
    run_combine(combine_params(p.ws_o, p.ws_m, p.ws_l, out, p.lse, p.batch, p.kv_heads, p.group, p.q_len, num_splits,
                               live ? &p : nullptr),
                dtype, head_dim, a.reduce_threads, stream, programmatic);
  }
  return {out, lse};
}

// launch() for arguments ops.py already resolved: the paged / variable-length call and the op
// registered for torch.compile. Returns (out, lse); lse is None unless return_lse.
py::tuple forward(py::handle q_obj, py::handle k_obj, py::handle v_obj, py::handle workspace_obj, bool causal,
                  double softmax_scale, int num_splits, int block_kv, int reduce_threads, int split_policy,
                  bool return_lse, bool fused_merge, bool programmatic, py::handle seqlens_obj,
                  py::handle block_table_obj, int min_blocks_per_split, int plan_choices) {
  const LaunchArgs args{num_splits, block_kv, reduce_threads, split_policy, fused_merge};
  auto [out, lse] = launch(q_obj, k_obj, v_obj, workspace_obj, causal, softmax_scale, args, return_lse, programmatic,
                           seqlens_obj, block_table_obj, min_blocks_per_split, plan_choices);
  if (!return_lse) return py::make_tuple(out, py::none());
  return py::make_tuple(out, lse);
}

// splitkv_attention's eager equal-length call in one crossing: the checks of ops.problem_shape,
// the plan of the call signature, the allocations and the launch. Returns out, or (out, lse)
// with return_lse.
py::object attention(py::handle q, py::handle k, py::handle v, py::handle causal, py::handle softmax_scale,
                     py::handle num_splits, py::handle block_kv, py::handle reduce_threads, py::handle split_policy,
                     py::handle merge, py::handle workspace, py::handle return_lse, py::handle enable_pdl) {
  auto* plans = plan_cache();
  const Dims d = checked_dims(q, k, v);
  py::handle const tunables[4] = {num_splits, block_kv, reduce_threads, split_policy};
  PlanKey key;
  std::shared_ptr<Plan> plan;
  if (plan_key(d, causal, softmax_scale, tunables, merge, enable_pdl, key)) {
    const auto it = plans->find(key);
    if (it != plans->end()) {
      plan = it->second;
    } else {
      plan = make_plan(d, causal, softmax_scale, tunables, merge, enable_pdl);
      if (plans->size() >= kMaxPlans) plans->clear();
      plans->emplace(key, plan);
    }
  } else {
    plan = make_plan(d, causal, softmax_scale, tunables, merge, enable_pdl);
  }
  if (!plan->fixed && plan->kv_len != d.kv_len) {
    plan->args = launch_args_of(plan->plan.attr("launch_args")(d.kv_len));
    plan->kv_len = d.kv_len;
  }
  const LaunchArgs args = plan->args;
  const int with_lse = PyObject_IsTrue(return_lse.ptr());
  if (with_lse < 0) throw py::error_already_set();
  auto [out, lse] = launch(q, k, v, workspace, plan->causal, plan->softmax_scale, args, with_lse == 1,
                           enable_pdl.ptr() == Py_True, py::none(), py::none(), 1, 1);
  if (!with_lse) return py::cast(out);
  return py::make_tuple(out, lse);
}

// The value checks of check_inputs=True (live_check.h) on the current stream of the tensors'
// device, whose dtypes, ranks and shapes plan.check_live_args checked. Waits for the GPU:
// returns the first bad entry's key, or -1.
int64_t live_check(py::handle seqlens_obj, py::handle block_table_obj, int batch, int capacity, int page_size,
                   int num_pages) {
  const bool live = !seqlens_obj.is_none();
  const bool paged = !block_table_obj.is_none();
  if (!live && !paged) return -1;
  const at::Tensor seqlens = live ? THPVariable_Unpack(seqlens_obj.ptr()).contiguous() : at::Tensor();
  const at::Tensor block_table = paged ? THPVariable_Unpack(block_table_obj.ptr()) : at::Tensor();
  const at::Tensor& any = live ? seqlens : block_table;
  const c10::cuda::CUDAGuard guard(any.device());
  const int device = any.device().index();
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device).stream();
  const at::Tensor first_bad = at::empty({1}, any.options().dtype(at::kLong));
  check_cuda(cudaMemsetAsync(first_bad.data_ptr(), 0xff, sizeof(int64_t), stream), "live_check reset");
  LiveCheckParams p;
  p.seqlens = live ? seqlens.data_ptr<int>() : nullptr;
  if (paged) {
    p.block_table = block_table.data_ptr<int>();
    p.table_row_stride = block_table.stride(0);
    p.table_width = int(block_table.size(1));
  }
  p.batch = batch;
  p.capacity = capacity;
  p.page_size = page_size;
  p.num_pages = num_pages;
  p.first_bad = reinterpret_cast<unsigned long long*>(first_bad.data_ptr<int64_t>());
  run_live_check(p, sm_count(device), stream);
  return first_bad.item<int64_t>();
}

// splitkv_attention's eager paged / variable-length call in one crossing: the launch of the call
// signature (ops._live_launch checks the arguments on a signature's first call), check_inputs'
// value checks on the device unless capturing, the allocations and the launch. Returns out, or
// (out, lse) with return_lse.
py::object live_attention(py::handle q, py::handle k, py::handle v, py::handle seqlens, py::handle block_table,
                          py::handle causal, py::handle softmax_scale, py::handle num_splits, py::handle block_kv,
                          py::handle reduce_threads, py::handle split_policy, py::handle merge, py::handle workspace,
                          py::handle return_lse, py::handle enable_pdl, py::handle max_splits,
                          py::handle min_blocks_per_split, py::handle split_plan, py::handle check_inputs) {
  py::handle const tensors[kLiveTensors] = {q, k, v, seqlens, block_table};
  py::handle const scalars[kLiveScalars] = {causal, softmax_scale, num_splits, block_kv, reduce_threads,
                                            split_policy, merge, enable_pdl, max_splits, min_blocks_per_split,
                                            split_plan, check_inputs};
  const std::shared_ptr<const LiveLaunch> launch_of = live_launch_for(tensors, scalars);
  const LiveLaunch& a = *launch_of;
  // ops._live_launch refused a check_inputs other than True or False.
  if (check_inputs.ptr() == Py_True) {
    const at::Tensor& pool = THPVariable_Unpack(k.ptr());
    const c10::cuda::CUDAGuard guard(pool.device());
    if (!capturing(c10::cuda::getCurrentCUDAStream(pool.device().index()).stream())) {
      const int64_t batch = block_table.is_none() ? pool.size(0) : THPVariable_Unpack(block_table.ptr()).size(0);
      const int64_t bad = live_check(seqlens, block_table, int(batch), a.capacity, int(pool.size(1)),
                                     int(pool.size(0)));
      if (bad >= 0) {
        py::module_::import("splitkv_tune.plan").attr("raise_live_value_error")(bad, k, seqlens, block_table,
                                                                                 a.capacity);
      }
    }
  }
  const int with_lse = PyObject_IsTrue(return_lse.ptr());
  if (with_lse < 0) throw py::error_already_set();
  auto [out, lse] = launch(q, k, v, workspace, a.causal, a.softmax_scale, a.args, with_lse == 1,
                           enable_pdl.ptr() == Py_True, seqlens, block_table, a.min_blocks_per_split, a.plan_choices);
  if (!with_lse) return py::cast(out);
  return py::make_tuple(out, lse);
}

// The combine kernel alone on fp32 partials O [S, B, Hkv, Sq*G, D], m and l [S, B, Hkv, Sq*G]
// (contiguous, checked by ops.combine_partials) into out (B, Sq, Hkv*G, D) and lse (B, Hkv*G, Sq).
void combine(const at::Tensor& o_part, const at::Tensor& m, const at::Tensor& l, const at::Tensor& out,
             const at::Tensor& lse, int q_len, int group, int reduce_threads) {
  const c10::cuda::CUDAGuard guard(o_part.device());
  const CombineParams c = combine_params(o_part.data_ptr<float>(), m.data_ptr<float>(), l.data_ptr<float>(), out,
                                         lse.data_ptr<float>(), int(o_part.size(1)), int(o_part.size(2)), group,
                                         q_len, int(o_part.size(0)));
  run_combine(c, static_cast<DType>(dtype_code(out.scalar_type())), int(o_part.size(4)), reduce_threads,
              c10::cuda::getCurrentCUDAStream(o_part.device().index()).stream(), false);
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "split-KV FlashAttention forward kernels (CUTLASS/CuTe)";
  m.def("attention", &attention, "splitkv_attention's eager equal-length call: checks, plan, allocations, launch");
  m.def("clear_plans", [] {
    plan_cache()->clear();
    live_launch_cache()->clear();
  }, "Forget the eager calls' plans (selector.clear_lookup_caches calls it after the tables change)");
  m.def("live_attention", &live_attention,
        "splitkv_attention's eager paged / variable-length call: launch of the signature, checks, allocations, launch");
  m.def("forward", &forward, "Launch the split kernel (and the combine kernel) for checked inputs");
  m.def("read_eager_counters", &read_eager_counters, "The fused merge's eager counters of (device, stream)");
  m.def("live_check", &live_check, "check_inputs' value checks of a paged / variable-length call on the device");
  m.def("combine", &combine, "Launch the combine kernel alone on fp32 partials");
  m.def("live_grid", [](int device, int dtype, int head_dim, int batch, int kv_heads, int packed_rows,
                        int block_kv, int max_splits, int plan_choices) {
    const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
    SplitParams p{};
    p.batch = batch;
    p.kv_heads = kv_heads;
    p.packed_rows = packed_rows;
    p.num_splits = max_splits;
    p.plan_choices = plan_choices;
    return live_grid_ctas(p, static_cast<DType>(dtype), head_dim, rules::block_m_for(packed_rows), block_kv);
  }, "CTAs of a paged / variable-length launch on that device (the load-aware plan's grid)");
  m.def("equal_launch_residency", [](int device, int dtype, int head_dim, int block_m, int block_kv, int64_t ctas,
                                     bool programmatic) {
    const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
    const Residency r = equal_launch_residency(static_cast<DType>(dtype), head_dim, block_m, block_kv, ctas,
                                               programmatic);
    return py::make_tuple(r.ctas_per_sm, r.smem_bytes, r.resident_per_sm);
  }, "(CTAs a SM may hold, dynamic shared memory of each, CTAs a SM holds at the kernel's own size) of an "
     "equal-length launch of that many CTAs on that device (0 CTAs a SM: no limit; 0 resident: not asked)");
  m.def("split_smem_bytes", [](int dtype, int head_dim, int block_m, int block_kv) {
    return split_smem_bytes(static_cast<DType>(dtype), head_dim, block_m, block_kv);
  });
}
