#pragma once
// A CPU tensor's elements as a std::vector, for EXPECT_EQ against expected values in tests.

#include <ATen/core/Tensor.h>

#include <vector>

namespace kvserve::test_util {

template <typename T>
std::vector<T> values(const at::Tensor& t) {
  const at::Tensor c = t.contiguous();
  return std::vector<T>(c.data_ptr<T>(), c.data_ptr<T>() + c.numel());
}

}  // namespace kvserve::test_util
