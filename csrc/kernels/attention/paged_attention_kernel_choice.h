#pragma once
// Which CUDA body runs paged_attention, chosen per process: the fastest that applies by default;
// KVSERVE_ATTENTION_KERNEL (read at the first call) or set_attention_kernel narrows it, for
// benchmarks that compare the kernels in one run and for bisecting a wrong result on a GPU.

#include <string>

namespace kvserve::ops {

/// auto: tensor cores where they apply, else the row kernel, else the general one; mma: the
/// same; rows: the row kernel where it applies, else the general one; general: always that;
/// mma64: tensor cores with prefill tiles of 64 query rows (16 a warp) instead of 128, the
/// earlier shape, for comparing the two.
enum class AttentionKernel { kAuto, kMma, kRows, kGeneral, kMma64 };

/// The current choice (KVSERVE_ATTENTION_KERNEL at first use, then the last set_attention_kernel).
AttentionKernel attention_kernel();

/// Sets the choice by name (auto, mma, rows, general, mma64); throws std::invalid_argument otherwise.
void set_attention_kernel(const std::string& name);

/// The current choice's name.
std::string attention_kernel_name();

}  // namespace kvserve::ops
