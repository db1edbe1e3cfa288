#include "kvserve/request_output.h"

namespace kvserve {

double RequestMetrics::time_to_first_token() const {
  return first_token_time > 0.0 ? first_token_time - arrival_time : 0.0;
}

double RequestMetrics::queue_time() const {
  return first_scheduled_time > 0.0 ? first_scheduled_time - arrival_time : 0.0;
}

double RequestMetrics::e2e_latency() const {
  return finished_time > 0.0 ? finished_time - arrival_time : 0.0;
}

double RequestMetrics::time_per_output_token() const {
  return num_generated_tokens > 1
             ? (last_token_time - first_token_time) / static_cast<double>(num_generated_tokens - 1)
             : 0.0;
}

}  // namespace kvserve
