// CPU implementation of kv_cache_write: one row copy per token (memcpy is already vectorized), or
// per (token, KV head) row a max, a scale and the quantized entries.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <c10/util/Float8_e4m3fn.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "kernels/cache/kv_cache_write.h"
#include "kernels/cache/kv_cache_write_checks.h"
#include "kernels/op_checks.h"

namespace kvserve::ops {
namespace {

using kv_cache_write_checks::kOp;

// Stores a row x[0, n) as q[0, n) and its scale (contract in kv_cache_write.h).
template <typename T>
void quantize_row(const T* x, int64_t n, cpu::KVCacheFormat format, void* q, float* scale) {
  float amax = 0.0f;
  for (int64_t i = 0; i < n; ++i) amax = std::max(amax, std::abs(static_cast<float>(x[i])));
  if (format == cpu::KVCacheFormat::kInt8) {
    const float s = amax / 127.0f;
    auto* out = static_cast<int8_t*>(q);
    for (int64_t i = 0; i < n; ++i) {
      const float v = s > 0.0f ? std::nearbyint(static_cast<float>(x[i]) / s) : 0.0f;
      out[i] = static_cast<int8_t>(std::clamp(v, -127.0f, 127.0f));
    }
    *scale = s;
  } else {
    const float s = amax / 448.0f;
    auto* out = static_cast<c10::Float8_e4m3fn*>(q);
    for (int64_t i = 0; i < n; ++i) {
      const float v = s > 0.0f ? static_cast<float>(x[i]) / s : 0.0f;
      out[i] = c10::Float8_e4m3fn(std::clamp(v, -448.0f, 448.0f));
    }
    *scale = s;
  }
}

void kv_cache_write_cpu(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                        at::Tensor& value_cache, const at::Tensor& slot_mapping,
                        const std::optional<at::Tensor>& key_scale,
                        const std::optional<at::Tensor>& value_scale) {
  const cpu::KVCacheFormat format =
      check_kv_cache_write(key, value, key_cache, value_cache, slot_mapping, key_scale,
                           value_scale);
  const int64_t num_tokens = slot_mapping.numel();

  const int64_t num_slots = key_cache.size(0) * key_cache.size(1);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < num_tokens; ++t) {
    TORCH_CHECK(slots[t] >= -1 && slots[t] < num_slots, kOp, ": slot ", slots[t],
                " is outside the cache of ", num_slots, " slots");
  }
  const int64_t elem = key.element_size();
  const int64_t heads = key_cache.size(2), head_dim = key_cache.size(3);
  const auto* k = static_cast<const char*>(key.data_ptr());
  const auto* v = static_cast<const char*>(value.data_ptr());
  auto* kc = static_cast<char*>(key_cache.data_ptr());
  auto* vc = static_cast<char*>(value_cache.data_ptr());
  const bool latent = vc == kc;  // one entry per token: the value lives inside the key
  if (format == cpu::KVCacheFormat::kPlain) {
    const int64_t row_bytes = heads * head_dim * elem;
    at::parallel_for(0, num_tokens, 64, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        if (slots[t] < 0) continue;
        std::memcpy(kc + slots[t] * row_bytes, k + t * key.stride(0) * elem, row_bytes);
        if (!latent) {
          std::memcpy(vc + slots[t] * row_bytes, v + t * value.stride(0) * elem, row_bytes);
        }
      }
    });
    return;
  }
  float* ks = key_scale->data_ptr<float>();
  float* vs = value_scale->data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, key.scalar_type(), kOp, [&] {
    const auto* kt = key.data_ptr<scalar_t>();
    const auto* vt = value.data_ptr<scalar_t>();
    at::parallel_for(0, num_tokens, 16, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        if (slots[t] < 0) continue;
        for (int64_t h = 0; h < heads; ++h) {
          const int64_t row = slots[t] * heads + h;  // the row's index in the cache and scales
          quantize_row(kt + t * key.stride(0) + h * head_dim, head_dim, format,
                       kc + row * head_dim, ks + row);
          if (!latent) {
            quantize_row(vt + t * value.stride(0) + h * head_dim, head_dim, format,
                         vc + row * head_dim, vs + row);
          }
        }
      }
    });
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(kvserve, CPU, m) { m.impl("kv_cache_write", &kv_cache_write_cpu); }

}  // namespace kvserve::ops
