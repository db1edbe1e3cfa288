// The process's choice of paged_attention's CUDA body (paged_attention_kernel_choice.h).
#include "kernels/attention/paged_attention_kernel_choice.h"

#include <array>
#include <atomic>
#include <cstdlib>
#include <stdexcept>

namespace kvserve::ops {
namespace {

constexpr std::array<const char*, 5> kNames = {"auto", "mma", "rows", "general", "mma64"};

AttentionKernel parse(const std::string& name) {
  for (size_t i = 0; i < kNames.size(); ++i) {
    if (name == kNames[i]) return static_cast<AttentionKernel>(i);
  }
  throw std::invalid_argument("attention kernel must be auto, mma, rows, general or mma64, got '" +
                              name + "'");
}

std::atomic<int>& choice() {
  static std::atomic<int> value = [] {
    const char* name = std::getenv("KVSERVE_ATTENTION_KERNEL");
    return static_cast<int>(name == nullptr || name[0] == '\0' ? AttentionKernel::kAuto
                                                                : parse(name));
  }();
  return value;
}

}  // namespace

AttentionKernel attention_kernel() {
  return static_cast<AttentionKernel>(choice().load(std::memory_order_relaxed));
}

void set_attention_kernel(const std::string& name) {
  choice().store(static_cast<int>(parse(name)), std::memory_order_relaxed);
}

std::string attention_kernel_name() { return kNames[static_cast<size_t>(attention_kernel())]; }

}  // namespace kvserve::ops
