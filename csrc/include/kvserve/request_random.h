#pragma once
// A request's own random stream, so that a seeded request samples the same tokens whatever else
// is in its batch.

#include <cstdint>
#include <optional>
#include <random>

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

}  // namespace kvserve
