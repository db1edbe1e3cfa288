#pragma once
// Small helpers shared by the engine's runners (ModelRunner, ContinuousBatchingEngine, Sampler,
// SpeculativeDecoder and its proposers).

#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <exception>
#include <string>
#include <type_traits>
#include <vector>

#include "kvserve/causal_lm.h"
#include "kvserve/paged_kv_cache.h"

namespace kvserve::engine_helpers {

/// Seconds on the monotonic clock: the same clock as Python's time.monotonic() on Linux.
inline double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

inline bool contains(const std::vector<int64_t>& ids, int64_t id) {
  return std::find(ids.begin(), ids.end(), id) != ids.end();
}

/// What an exception says, without a c10::Error's C++ backtrace.
inline std::string message_of(std::exception_ptr error) {
  try {
    std::rethrow_exception(error);
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "an unknown exception";
  }
}

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

/// A copy of host values as a 1-D tensor on `device` (int64 -> kLong, int32 -> kInt,
/// float -> kFloat, double -> kDouble). Always a copy: the result never aliases the vector, on any device. On a GPU
/// the values are staged in pinned memory and copied without waiting for the device (a copy
/// from pageable memory would synchronise the stream: each one a round trip in the middle of a
/// step); torch's host allocator keeps the staging buffer until the copy has run. Not for use
/// while a CUDA graph is being captured.
template <typename T>
at::Tensor to_tensor(const std::vector<T>& values, at::Device device) {
  static_assert(std::is_same_v<T, int64_t> || std::is_same_v<T, int32_t> ||
                std::is_same_v<T, float> || std::is_same_v<T, double>);
  const at::ScalarType dtype = std::is_same_v<T, int64_t>   ? at::kLong
                               : std::is_same_v<T, int32_t> ? at::kInt
                               : std::is_same_v<T, float>   ? at::kFloat
                                                            : at::kDouble;
  const int64_t n = static_cast<int64_t>(values.size());
  if (!device.is_cuda()) {
    return at::from_blob(const_cast<T*>(values.data()), {n}, at::TensorOptions().dtype(dtype))
        .to(device, dtype, /*non_blocking=*/false, /*copy=*/true);
  }
  at::Tensor staged = at::empty({n}, at::TensorOptions().dtype(dtype).pinned_memory(true));
  if (n > 0) std::memcpy(staged.data_ptr(), values.data(), n * sizeof(T));
  return staged.to(device, dtype, /*non_blocking=*/true, /*copy=*/false);
}

/// A paged KV pool laid out for `model` (its KV heads or MLA latents, dtype and device; its
/// layers grouped by sliding window when group_sliding_windows), its entries of `dtype` when
/// given (int8 / fp8: quantized); with num_state_slots state slots for its state layers (SSM
/// states fp32 unless ssm_state_dtype says otherwise).
inline PagedKVCache make_kv_cache(const CausalLM& model, int64_t num_blocks, int64_t block_size,
                                  bool group_sliding_windows = false,
                                  std::optional<at::ScalarType> dtype = std::nullopt,
                                  int64_t num_state_slots = 0,
                                  std::optional<at::ScalarType> ssm_state_dtype = std::nullopt) {
  return PagedKVCache(KVCacheLayout::for_model(model.config(), group_sliding_windows), num_blocks,
                      block_size, dtype.value_or(model.dtype()), model.device(),
                      {num_state_slots, model.dtype(), ssm_state_dtype.value_or(at::kFloat)});
}

}  // namespace kvserve::engine_helpers
