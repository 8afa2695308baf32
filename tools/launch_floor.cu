// Host µs per call of the CUDA calls under an eager splitkv_attention, without torch or Python:
// what a launch costs on this host by itself, to read the binding's figures against
// (tools/host_breakdown.py prints both). Each row: the median of 200 samples of 64 calls queued
// behind a GPU spin, so the stream never drains.
//
//   nvcc -O2 -std=c++17 -arch=sm_90 -Ikernels/include tools/launch_floor.cu -o /tmp/launch_floor
//   /tmp/launch_floor
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "splitkv/launch_utils.h"
#include "splitkv/params.h"

namespace {

void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(err));
    std::exit(1);
  }
}

__global__ void spin(long long cycles) {
  const long long start = clock64();
  while (clock64() - start < cycles) {
  }
}

// The split kernel's argument: the same struct, so that the launch copies as many bytes.
__global__ void empty_split(splitkv::SplitParams p) {
  if (p.batch < 0) p.out = nullptr;
}

// The combine kernel's argument, for a call that launches both kernels.
__global__ void empty_combine(splitkv::CombineParams p) {
  if (p.num_splits < 0) p.out = nullptr;
}

template <class Fn>
void row(const char* name, cudaStream_t stream, Fn&& fn) {
  constexpr int kCalls = 64, kReps = 200;
  for (int i = 0; i < 20; ++i) fn();
  check(cudaStreamSynchronize(stream), "sync");
  std::vector<double> samples;
  for (int r = 0; r < kReps; ++r) {
    spin<<<1, 1, 0, stream>>>(2'000'000);  // ~1 ms at 2 GHz: longer than 64 calls take
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < kCalls; ++i) fn();
    const auto t1 = std::chrono::steady_clock::now();
    samples.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count() / kCalls);
    check(cudaStreamSynchronize(stream), "sync");
  }
  std::sort(samples.begin(), samples.end());
  std::printf("  %-52s median %6.2f  p20 %6.2f  p80 %6.2f us\n", name, samples[kReps / 2], samples[kReps / 5],
              samples[4 * kReps / 5]);
}

}  // namespace

int main() {
  check(cudaSetDevice(0), "cudaSetDevice");
  cudaStream_t stream;
  check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
  splitkv::SplitParams p{};
  p.batch = 1;
  std::printf("launch floor (sizeof(SplitParams) = %zu bytes)\n", sizeof(p));

  row("cudaGetDevice", stream, [&] {
    int d;
    check(cudaGetDevice(&d), "cudaGetDevice");
  });
  row("cudaStreamIsCapturing", stream, [&] {
    cudaStreamCaptureStatus s;
    check(cudaStreamIsCapturing(stream, &s), "cudaStreamIsCapturing");
  });
  row("<<<1, 128>>> empty kernel, SplitParams argument", stream, [&] { empty_split<<<1, 128, 0, stream>>>(p); });
  auto launch_ex = [&](bool programmatic, dim3 grid) {
    cudaLaunchConfig_t config = {};
    config.gridDim = grid;
    config.blockDim = dim3(128);
    config.stream = stream;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    config.attrs = attr;
    config.numAttrs = programmatic ? 1 : 0;
    check(cudaLaunchKernelEx(&config, empty_split, p), "cudaLaunchKernelEx");
  };
  row("cudaLaunchKernelEx, grid (1, 8, 16)", stream, [&] { launch_ex(false, dim3(1, 8, 16)); });
  row("cudaLaunchKernelEx, grid (1, 8, 16), programmatic", stream, [&] { launch_ex(true, dim3(1, 8, 16)); });

  // The extension's own launch (launch_utils.h): the driver's entry, the kernel's handle found
  // once per device.
  row("splitkv::launch_kernel, grid (1, 8, 16), programmatic", stream, [&] {
    splitkv::launch_kernel<&empty_split>(p, dim3(1, 8, 16), dim3(128), 0, stream, true, "launch_kernel");
  });
  // What a call that merges with the combine kernel launches: two kernels, both programmatic.
  const splitkv::CombineParams c{};
  row("two launch_kernel, split then combine argument", stream, [&] {
    splitkv::launch_kernel<&empty_split>(p, dim3(1, 8, 16), dim3(128), 0, stream, true, "launch_kernel");
    splitkv::launch_kernel<&empty_combine>(c, dim3(4), dim3(128), 0, stream, true, "launch_kernel");
  });
  check(cudaStreamSynchronize(stream), "sync");
  return 0;
}
