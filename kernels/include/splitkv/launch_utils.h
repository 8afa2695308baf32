// Error checking shared by the launch templates.
#pragma once

#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

namespace splitkv {

inline constexpr int kMaxDevices = 64;

inline void check_cuda(cudaError_t err, const char* what) {
  if (err != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(err));
}

// Compute-capability major of the current device, read once per device.
inline int device_major() {
  static int majors[kMaxDevices] = {};
  int device = 0;
  check_cuda(cudaGetDevice(&device), "cudaGetDevice");
  if (device >= kMaxDevices) device = kMaxDevices - 1;
  if (majors[device] == 0) {
    check_cuda(cudaDeviceGetAttribute(&majors[device], cudaDevAttrComputeCapabilityMajor, device),
               "compute capability");
  }
  return majors[device];
}

// Multiprocessors of `device`, read once per device.
inline int sm_count(int device) {
  static int counts[kMaxDevices] = {};
  const int slot = device < kMaxDevices ? device : kMaxDevices - 1;
  if (counts[slot] == 0) {
    check_cuda(cudaDeviceGetAttribute(&counts[slot], cudaDevAttrMultiProcessorCount, device), "multiprocessor count");
  }
  return counts[slot];
}

// Shared memory one CTA may opt in to on `device`, read once per device.
inline int smem_optin_limit(int device) {
  static int limits[kMaxDevices] = {};
  const int slot = device < kMaxDevices ? device : kMaxDevices - 1;
  if (limits[slot] == 0) {
    check_cuda(cudaDeviceGetAttribute(&limits[slot], cudaDevAttrMaxSharedMemoryPerBlockOptin, device),
               "shared-memory limit of the device");
  }
  return limits[slot];
}

// Launches `kernel(params)`; with `programmatic` (and sm_90+), as a programmatic dependent launch
// that may start while the previous kernel of `stream` still runs (dependent_launch.h).
template <class Params>
void launch_kernel(void (*kernel)(Params), const Params& params, dim3 grid, dim3 block, int smem_bytes,
                   cudaStream_t stream, bool programmatic, const char* what) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem_bytes;
  config.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attr;
  config.numAttrs = programmatic && device_major() >= 9 ? 1 : 0;
  check_cuda(cudaLaunchKernelEx(&config, kernel, params), what);
}

}  // namespace splitkv
