// Error checking and the kernel launch shared by the launch templates.
#pragma once

#include <cuda.h>  // the driver's launch types only: its entry points come through the runtime
#include <cuda_runtime.h>

#include <atomic>
#include <stdexcept>
#include <string>
#include <type_traits>

namespace splitkv {

inline constexpr int kMaxDevices = 64;

inline void check_cuda(cudaError_t err, const char* what) {
  if (err != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(err));
}

// Attribute `kAttribute` of `device`, read once per device below kMaxDevices (a benign race:
// every thread that reads it stores the same value) and on every call past them.
template <cudaDeviceAttr kAttribute>
int device_attribute(int device) {
  static int values[kMaxDevices] = {};
  int value = device < kMaxDevices ? values[device] : 0;
  if (value == 0) {
    check_cuda(cudaDeviceGetAttribute(&value, kAttribute, device), "device attribute");
    if (device < kMaxDevices) values[device] = value;
  }
  return value;
}

// Compute-capability major of the current device.
inline int device_major() {
  int device = 0;
  check_cuda(cudaGetDevice(&device), "cudaGetDevice");
  return device_attribute<cudaDevAttrComputeCapabilityMajor>(device);
}

// Multiprocessors of `device`.
inline int sm_count(int device) { return device_attribute<cudaDevAttrMultiProcessorCount>(device); }

// Shared memory one CTA may opt in to on `device`.
inline int smem_optin_limit(int device) { return device_attribute<cudaDevAttrMaxSharedMemoryPerBlockOptin>(device); }

// A driver entry point, found once through the runtime: the extension does not link libcuda.
template <class Fn>
Fn driver_entry(const char* name) {
  void* entry = nullptr;
  cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
#if CUDART_VERSION >= 12050
  check_cuda(cudaGetDriverEntryPointByVersion(name, &entry, 12000, cudaEnableDefault, &found), name);
#else  // CUDA 13 removed the unversioned query that 12.0-12.4 have
  check_cuda(cudaGetDriverEntryPoint(name, &entry, cudaEnableDefault, &found), name);
#endif
  if (found != cudaDriverEntryPointSuccess || entry == nullptr) {
    throw std::runtime_error(std::string("the CUDA driver has no ") + name);
  }
  return reinterpret_cast<Fn>(entry);
}

inline void check_driver(CUresult result, const char* what) {
  if (result == CUDA_SUCCESS) return;
  static const auto error_string = driver_entry<CUresult (*)(CUresult, const char**)>("cuGetErrorString");
  const char* text = nullptr;
  error_string(result, &text);
  throw std::runtime_error(std::string(what) + ": " + (text ? text : "CUDA driver error " + std::to_string(result)));
}

// The driver's cuLaunchKernelEx, found once per process.
inline auto driver_launch() {
  static const auto launch = driver_entry<decltype(&cuLaunchKernelEx)>("cuLaunchKernelEx");
  return launch;
}

// Kernel's driver handle in the current device's primary context, found once per device.
// Launching through the driver with it skips the lookup that cudaLaunchKernelEx makes on every
// launch: on an H200 host, 3.2 against 3.7 us a launch (tools/launch_floor.cu).
template <auto Kernel>
CUfunction driver_function(int device) {
  static std::atomic<CUfunction> functions[kMaxDevices];  // zero-initialised: none found yet
  CUfunction function = device < kMaxDevices ? functions[device].load(std::memory_order_acquire) : nullptr;
  if (function == nullptr) {
    cudaFunction_t found = nullptr;
    check_cuda(cudaGetFuncBySymbol(&found, reinterpret_cast<const void*>(Kernel)), "cudaGetFuncBySymbol");
    function = reinterpret_cast<CUfunction>(found);
    if (device < kMaxDevices) functions[device].store(function, std::memory_order_release);
  }
  return function;
}

// Launches `Kernel(params)` on the current device; with `programmatic` (and sm_90+), as a
// programmatic dependent launch that may start while the previous kernel of `stream` still runs
// (dependent_launch.h).
template <auto Kernel, class Params>
void launch_kernel(const Params& params, dim3 grid, dim3 block, int smem_bytes, cudaStream_t stream,
                   bool programmatic, const char* what) {
  static_assert(std::is_same_v<decltype(Kernel), void (*)(Params)>, "Kernel must take Params by value");
  int device = 0;
  check_cuda(cudaGetDevice(&device), "cudaGetDevice");
  CUlaunchAttribute attr[1];
  attr[0].id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
  attr[0].value.programmaticStreamSerializationAllowed = 1;
  CUlaunchConfig config = {};
  config.gridDimX = grid.x;
  config.gridDimY = grid.y;
  config.gridDimZ = grid.z;
  config.blockDimX = block.x;
  config.blockDimY = block.y;
  config.blockDimZ = block.z;
  config.sharedMemBytes = unsigned(smem_bytes);
  config.hStream = stream;
  config.attrs = attr;
  config.numAttrs = programmatic && device_major() >= 9 ? 1 : 0;
  void* args[] = {const_cast<Params*>(&params)};
  check_driver(driver_launch()(&config, driver_function<Kernel>(device), args, nullptr), what);
}

}  // namespace splitkv
