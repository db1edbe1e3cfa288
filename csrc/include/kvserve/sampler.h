#pragma once
// Turns the last-position logits of a batch into next tokens, each row with its own parameters
// and its own random stream, so a seeded request samples the same tokens in any batch.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <random>
#include <vector>

#include "kvserve/sampling_params.h"

namespace kvserve {

/// The random stream of one request: one uniform number in [0, 1) per sampled token.
class RequestRandom {
 public:
  /// Seeded from `seed` when given, otherwise from std::random_device.
  explicit RequestRandom(std::optional<uint64_t> seed);
  float next_uniform();

 private:
  std::mt19937_64 engine_;
};

/// Sampler for a batch of rows.
class Sampler {
 public:
  /// logits: fp32 [rows, vocab] (modified in place by the filters); one params and one random
  /// stream per row. Returns int64 [rows] on the CPU. Greedy rows draw no random number.
  at::Tensor sample(at::Tensor& logits, const std::vector<const SamplingParams*>& params,
                    const std::vector<RequestRandom*>& randoms) const;
};

}  // namespace kvserve
