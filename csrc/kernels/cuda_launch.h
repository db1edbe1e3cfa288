#pragma once
// What the CUDA launchers (*_cuda.cu) take from torch: the current stream, a device guard, the
// launch check, and dispatch from a tensor dtype to the kernel bodies' element types. The bodies
// (*_kernel.cuh) see none of it.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <map>
#include <mutex>
#include <utility>
#include <vector>

namespace kvserve::cuda {

/// The stream torch runs on now (a captured graph's stream while capturing).
inline cudaStream_t current_stream() { return c10::cuda::getCurrentCUDAStream().stream(); }

/// A type carried as a value, for the generic lambdas of the dispatchers below.
template <typename T>
struct Type {
  using type = T;
};

/// Calls f(Type<T>{}) with T the CUDA element type of `dtype` (float, __nv_bfloat16, __half).
template <typename F>
void dispatch_float(at::ScalarType dtype, const char* op, F&& f) {
  switch (dtype) {
    case at::kFloat: f(Type<float>{}); break;
    case at::kBFloat16: f(Type<__nv_bfloat16>{}); break;
    case at::kHalf: f(Type<__half>{}); break;
    default: TORCH_CHECK(false, op, ": unsupported dtype ", dtype);
  }
}

/// `addresses` (null allowed) as an int64 tensor on `device`, for kernels that take a table of
/// pointers (one per expert, layer or cache). Tables are kept per (device, addresses): a table
/// holds nothing but its key, so it stays right whatever is later allocated at those addresses,
/// and a call that finds its table does no host-to-device copy, which lets a CUDA graph capture
/// it (the engine's first step of a size runs eagerly and fills the table in). A new table is
/// written to pinned memory and copied without synchronising; the caching host allocator keeps
/// the buffer until the copy has run. Tables are never dropped (a captured graph may read one);
/// a model's tables are a few KiB.
inline at::Tensor pointer_table(const std::vector<const void*>& addresses, at::Device device) {
  static std::mutex mutex;
  static std::map<std::pair<int, std::vector<const void*>>, at::Tensor> tables;
  const std::lock_guard<std::mutex> lock(mutex);
  auto key = std::make_pair(static_cast<int>(device.index()), addresses);
  auto found = tables.find(key);
  if (found != tables.end()) return found->second;
  at::Tensor host = at::empty({static_cast<int64_t>(addresses.size())},
                              at::TensorOptions().dtype(at::kLong).pinned_memory(true));
  int64_t* table = host.data_ptr<int64_t>();
  for (size_t i = 0; i < addresses.size(); ++i) {
    table[i] = reinterpret_cast<int64_t>(addresses[i]);
  }
  return tables.emplace(std::move(key), host.to(device, /*non_blocking=*/true)).first->second;
}

/// A device attribute (the multiprocessor count, the compute capability), read once per device
/// and attribute: a call inside CUDA-graph capture must not query the driver.
template <cudaDeviceAttr ATTRIBUTE>
int device_attribute(int device) {
  static std::array<std::atomic<int>, 64> values{};
  std::atomic<int>& value = values.at(static_cast<size_t>(device));
  if (value.load(std::memory_order_relaxed) == 0) {
    int read = 0;
    cudaDeviceGetAttribute(&read, ATTRIBUTE, device);
    value.store(std::max(read, 1), std::memory_order_relaxed);
  }
  return value.load(std::memory_order_relaxed);
}

/// The device's multiprocessors.
inline int multiprocessors(int device) {
  return device_attribute<cudaDevAttrMultiProcessorCount>(device);
}

/// Whether the device runs mma.sync / ldmatrix / cp.async (compute capability 8.0 or later).
inline bool tensor_cores(int device) {
  return device_attribute<cudaDevAttrComputeCapabilityMajor>(device) >= 8;
}

/// Lets `kernel` start with `shared_bytes` of dynamic shared memory: beyond 48 KiB a kernel must
/// opt in (a function attribute: no stream work, allowed while a graph is captured).
inline void allow_shared_bytes(const void* kernel, size_t shared_bytes) {
  if (shared_bytes > 48 * 1024) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(shared_bytes)));
  }
}

/// Blocks of `kernel` (`threads` threads, `shared_bytes` of dynamic shared memory) one
/// multiprocessor of `device` holds at once: asked once per device and kernel (a query of the
/// function's attributes, no stream work), outside graph capture on `stream` (the engine's first
/// step of a size runs eagerly before its capture; a capture that comes first assumes one block
/// and asks next time).
inline int resident_blocks(const void* kernel, int device, cudaStream_t stream, int threads,
                           size_t shared_bytes) {
  static std::mutex mutex;
  static std::map<std::pair<int, const void*>, int> known;
  const std::lock_guard<std::mutex> lock(mutex);
  const auto key = std::make_pair(device, kernel);
  auto it = known.find(key);
  if (it == known.end()) {
    cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
    C10_CUDA_CHECK(cudaStreamIsCapturing(stream, &capturing));
    if (capturing != cudaStreamCaptureStatusNone) return 1;
    allow_shared_bytes(kernel, shared_bytes);
    int blocks = 0;
    C10_CUDA_CHECK(
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, threads, shared_bytes));
    it = known.emplace(key, std::max(blocks, 1)).first;
  }
  return it->second;
}

/// Blocks of `threads` threads that cover n items.
inline unsigned int blocks_for(int64_t n, int threads) {
  return static_cast<unsigned int>((n + threads - 1) / threads);
}

}  // namespace kvserve::cuda

/// After every launch: a launch error is a c10::Error naming the op.
#define KVSERVE_CUDA_CHECK_LAUNCH() C10_CUDA_KERNEL_LAUNCH_CHECK()
