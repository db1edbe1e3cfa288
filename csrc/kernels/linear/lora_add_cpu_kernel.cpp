// Vectorized lora_add body (contract: lora_add.h); compiled once per CPU capability. Per token:
// the rank shrink (one dot product per row of A_s over the fp32 input row), then the expand
// (rank scaled rows of B_s^T added to the fp32 output row), one rounding at the end; runs of
// tokens of one slot convert each row of A_s and B_s once (punica's SGMV, in small blocks).
#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

#include "kernels/cpu_kernels.h"
#include "kernels/cpu_vec.h"

namespace kvserve::cpu {
inline namespace CPU_CAPABILITY {
namespace {

// Consecutive tokens of one slot (a prompt's) share each row of A_s and B_s converted to fp32:
// up to this many at a time. A token's arithmetic is the same in any block (bit for bit).
constexpr int64_t kBlock = 8;

void lora_add_impl(const LoraAddArgs& a) {
  KVSERVE_DISPATCH_FLOATING(a.dtype, [&] {
    auto* out = static_cast<scalar_t*>(a.out);
    const auto* x = static_cast<const scalar_t*>(a.x);
    const auto* lora_a = static_cast<const scalar_t*>(a.lora_a);
    const auto* lora_b = static_cast<const scalar_t*>(a.lora_b);
    const int64_t in = a.in_features, width = a.out_features, rank = a.rank;
    at::parallel_for(0, a.num_tokens, kBlock, [&](int64_t begin, int64_t end) {
      std::vector<float> rows(kBlock * in), acc(kBlock * width), weights(std::max(in, width)),
          shrunk(kBlock * rank);
      for (int64_t first = begin; first < end;) {
        const int32_t s = a.slots[first];
        if (s < 0) {
          ++first;
          continue;
        }
        int64_t n = 1;  // tokens [first, first + n) of slot s
        while (first + n < end && n < kBlock && a.slots[first + n] == s) ++n;
        const scalar_t* a_s = lora_a + static_cast<int64_t>(s) * rank * in;
        const scalar_t* b_s = lora_b + static_cast<int64_t>(s) * rank * width;
        for (int64_t i = 0; i < n; ++i) {
          convert_to_float(x + (first + i) * a.x_stride, rows.data() + i * in, in);
          convert_to_float(out + (first + i) * a.out_stride, acc.data() + i * width, width);
        }
        for (int64_t r = 0; r < rank; ++r) {  // shrink
          convert_to_float(a_s + r * in, weights.data(), in);
          for (int64_t i = 0; i < n; ++i) {
            shrunk[i * rank + r] = a.scales[s] * dot(weights.data(), rows.data() + i * in, in);
          }
        }
        for (int64_t r = 0; r < rank; ++r) {  // expand
          convert_to_float(b_s + r * width, weights.data(), width);
          for (int64_t i = 0; i < n; ++i) {
            axpy(acc.data() + i * width, shrunk[i * rank + r], weights.data(), width);
          }
        }
        for (int64_t i = 0; i < n; ++i) {
          convert_from_float(acc.data() + i * width, out + (first + i) * a.out_stride, width);
        }
        first += n;
      }
    });
  });
}

}  // namespace

KVSERVE_REGISTER_CPU_KERNEL(lora_add_stub, &lora_add_impl);

}  // namespace CPU_CAPABILITY
}  // namespace kvserve::cpu
