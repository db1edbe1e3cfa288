#include "kvserve/request_random.h"

namespace kvserve {

RequestRandom::RequestRandom(std::optional<uint64_t> seed)
    : engine_(seed ? *seed : (static_cast<uint64_t>(std::random_device{}()) << 32) ^
                                 std::random_device{}()) {}

float RequestRandom::next_uniform() {
  // 24 random bits: every value is exact in fp32 and strictly below 1.
  return static_cast<float>(engine_() >> 40) * (1.0f / 16777216.0f);
}

}  // namespace kvserve
