#include "kvserve/engine_stats.h"

#include <algorithm>

namespace kvserve {

void LatencyHistogram::observe(double seconds) {
  const size_t bucket =
      std::lower_bound(kBounds.begin(), kBounds.end(), seconds) - kBounds.begin();
  ++counts[bucket];
  ++count;
  sum += seconds;
}

}  // namespace kvserve
