#pragma once
// A CPU tensor's elements as a std::vector, for EXPECT_EQ against expected values in tests; the
// worst relative difference of two tensors, for EXPECT_LE against a tolerance.

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace kvserve::test_util {

template <typename T>
std::vector<T> values(const at::Tensor& t) {
  const at::Tensor c = t.contiguous();
  return std::vector<T>(c.data_ptr<T>(), c.data_ptr<T>() + c.numel());
}

/// max |e - a| / (1 + |e|) over the elements of two tensors of one shape (any float dtype); a
/// NaN on either side counts as infinite.
inline double worst_relative_error(const at::Tensor& expected, const at::Tensor& actual) {
  const std::vector<float> e = values<float>(expected.to(at::kFloat));
  const std::vector<float> a = values<float>(actual.to(at::kFloat));
  double worst = 0.0;
  for (size_t i = 0; i < e.size(); ++i) {
    const double error = std::abs(double{e[i]} - a[i]) / (1.0 + std::abs(double{e[i]}));
    worst = std::isnan(error) ? INFINITY : std::max(worst, error);
  }
  return worst;
}

}  // namespace kvserve::test_util
