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

}  // namespace splitkv
