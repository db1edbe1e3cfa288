#pragma once
// How one request turns logits into tokens and when it stops. Bound to Python as
// kvserve.SamplingParams (same names).

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace kvserve {

/// Sampling and stopping parameters of one request; temperature 0 means greedy.
struct SamplingParams {
  double temperature = 1.0;
  int64_t top_k = -1;   ///< -1: off
  double top_p = 1.0;   ///< in (0, 1]; 1: off
  double min_p = 0.0;   ///< in [0, 1]; 0: off
  std::optional<uint64_t> seed;  ///< fixes this request's random stream, whatever else is batched
  int64_t max_tokens = 16;
  bool ignore_eos = false;
  std::vector<int64_t> stop_token_ids;

  /// Throws std::invalid_argument (Python ValueError) naming the first invalid field.
  void validate() const;

  /// "SamplingParams(temperature=..., ...)"
  std::string repr() const;
};

}  // namespace kvserve
