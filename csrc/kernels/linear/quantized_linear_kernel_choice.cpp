// The process's choice of quantized_linear's CUDA body (quantized_linear_kernel_choice.h).
#include "kernels/linear/quantized_linear_kernel_choice.h"

#include <array>
#include <atomic>
#include <cstdlib>
#include <stdexcept>

namespace kvserve::ops {
namespace {

constexpr std::array<const char*, 5> kNames = {"auto", "mma", "gemv", "dequantize", "wide"};

QuantizedLinearKernel parse(const std::string& name) {
  for (size_t i = 0; i < kNames.size(); ++i) {
    if (name == kNames[i]) return static_cast<QuantizedLinearKernel>(i);
  }
  throw std::invalid_argument(
      "quantized linear kernel must be auto, mma, gemv, dequantize or wide, got '" + name + "'");
}

std::atomic<int>& choice() {
  static std::atomic<int> value = [] {
    const char* name = std::getenv("KVSERVE_QUANTIZED_LINEAR_KERNEL");
    return static_cast<int>(name == nullptr || name[0] == '\0' ? QuantizedLinearKernel::kAuto
                                                               : parse(name));
  }();
  return value;
}

}  // namespace

QuantizedLinearKernel quantized_linear_kernel() {
  return static_cast<QuantizedLinearKernel>(choice().load(std::memory_order_relaxed));
}

void set_quantized_linear_kernel(const std::string& name) {
  choice().store(static_cast<int>(parse(name)), std::memory_order_relaxed);
}

std::string quantized_linear_kernel_name() {
  return kNames[static_cast<size_t>(quantized_linear_kernel())];
}

}  // namespace kvserve::ops
