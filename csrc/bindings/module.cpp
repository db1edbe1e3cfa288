// kvserve._C: the C++ engine bound to Python. Ops are reached as torch.ops.kvserve.* once this
// module is imported (their registrations live in the runtime library it links).
#include "bindings/bindings.h"
#include "kernels/attention/paged_attention_kernel_choice.h"
#include "kernels/cpu_dispatch.h"
#include "kernels/linear/quantized_linear_kernel_choice.h"

#include <algorithm>
#include <cctype>
#include <string>
#include <vector>

PYBIND11_MODULE(_C, m) {
  m.doc() = "kvserve C++ runtime";
  m.def(
      "cpu_capability",
      [] { return kvserve::cpu::capability_name(kvserve::cpu::cpu_capability()); },
      "Vector instruction set the CPU kernels use: default, avx2, avx2_vnni, avx512, "
      "avx512_vnni or avx512_amx (a kernel without a variant for it runs the best one below).");
  m.def(
      "cpu_prefetch",
      [] { return kvserve::cpu::stream_prefetch_name(kvserve::cpu::stream_prefetch()); },
      "How the CPU kernels ask for a weight's lines ahead of their reads: nta (non-temporal, "
      "AMD CPUs) or t1 (into L2, the others); KVSERVE_CPU_PREFETCH may name either.");
  m.def(
      "supported_cpu_capabilities",
      [] {
        std::vector<std::string> names;
        for (int c = 0; c < kvserve::cpu::kNumCapabilities; ++c) {
          const auto capability = static_cast<kvserve::cpu::Capability>(c);
          if (kvserve::cpu::supports(capability)) {
            names.emplace_back(kvserve::cpu::capability_name(capability));
          }
        }
        return names;
      },
      "The CPU kernel variants this CPU runs (KVSERVE_CPU_CAPABILITY may name any of them).");
  m.def(
      "built_cpu_capabilities",
      [] {
        std::vector<std::string> names;
        std::string list = KVSERVE_BUILT_CPU_CAPABILITIES;  // "DEFAULT,AVX2,..." from CMake
        for (size_t begin = 0; begin < list.size();) {
          const size_t end = std::min(list.find(',', begin), list.size());
          std::string name = list.substr(begin, end - begin);
          for (char& c : name) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
          names.push_back(name);
          begin = end + 1;
        }
        return names;
      },
      "CPU kernel variants this build holds (KVSERVE_CPU_CAPABILITIES at build time).");
  m.def(
      "built_with_cuda", [] { return KVSERVE_WITH_CUDA != 0; },
      "Whether this build holds the CUDA kernels (a CUDA torch and nvcc at build time).");
  m.def(
      "set_cuda_attention_kernel", &kvserve::ops::set_attention_kernel, pybind11::arg("name"),
      "Which CUDA body runs paged_attention from now on: auto (the fastest that applies), mma "
      "(tensor cores), rows, general, or mma64 (tensor cores with the 64-row prefill tiles) "
      "(KVSERVE_ATTENTION_KERNEL sets it at start-up).");
  m.def("cuda_attention_kernel", &kvserve::ops::attention_kernel_name,
        "The CUDA attention kernel choice: auto, mma, rows, general or mma64.");
  m.def("set_cuda_quantized_linear_kernel", &kvserve::ops::set_quantized_linear_kernel,
        pybind11::arg("name"),
        "Which CUDA body runs quantized_linear from now on: auto (the fastest that applies), mma "
        "(tensor cores), wide (tensor cores in wide blocks of rows sharing staged inputs), gemv "
        "(the GEMV up to 8 tokens, then the dequantizing GEMM) or dequantize "
        "(KVSERVE_QUANTIZED_LINEAR_KERNEL sets it at start-up).");
  m.def("cuda_quantized_linear_kernel", &kvserve::ops::quantized_linear_kernel_name,
        "The CUDA quantized linear kernel choice: auto, mma, gemv, dequantize or wide.");
  kvserve::bindings::bind_kv_cache(m);
  kvserve::bindings::bind_model(m);
  kvserve::bindings::bind_continuous_batching_engine(m);
  kvserve::bindings::bind_paged_block_manager(m);
  kvserve::bindings::bind_sampler(m);
  kvserve::bindings::bind_tensor_parallel_worker(m);
}
