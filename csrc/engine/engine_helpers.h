#pragma once
// Small helpers shared by the engine's runners (ModelRunner, ContinuousBatchingEngine).

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <vector>

namespace kvserve::engine_helpers {

/// Seconds on the monotonic clock: the same clock as Python's time.monotonic() on Linux.
inline double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

inline bool contains(const std::vector<int64_t>& ids, int64_t id) {
  return std::find(ids.begin(), ids.end(), id) != ids.end();
}

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace kvserve::engine_helpers
