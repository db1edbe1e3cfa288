// CPU launcher for lora_add: the shared checks, the slots' values, then the vectorized body.
#include <torch/library.h>

#include "kernels/cpu_kernels.h"
#include "kernels/linear/lora_add.h"
#include "kernels/linear/lora_add_checks.h"

namespace kvserve::ops {
namespace {

void lora_add_cpu(at::Tensor& out, const at::Tensor& x, const at::Tensor& lora_a,
                  const at::Tensor& lora_b, const at::Tensor& slots, const at::Tensor& scales) {
  check_lora_add(out, x, lora_a, lora_b, slots, scales);
  const int64_t num_slots = lora_a.size(0);
  const int32_t* slot = slots.data_ptr<int32_t>();
  for (int64_t t = 0; t < slots.size(0); ++t) {
    TORCH_CHECK(slot[t] >= -1 && slot[t] < num_slots, "lora_add: token ", t, " has slot ",
                slot[t], ", outside [-1, ", num_slots, ")");
  }
  if (x.size(0) == 0 || lora_a.size(1) == 0) return;
  cpu::lora_add_stub.get()(cpu::LoraAddArgs{
      x.scalar_type(), out.data_ptr(), out.stride(0), x.data_ptr(), x.stride(0),
      lora_a.data_ptr(), lora_b.data_ptr(), slot, scales.data_ptr<float>(), x.size(0),
      x.size(1), out.size(1), lora_a.size(1)});
}

}  // namespace

TORCH_LIBRARY_IMPL(kvserve, CPU, m) { m.impl("lora_add", &lora_add_cpu); }

}  // namespace kvserve::ops
