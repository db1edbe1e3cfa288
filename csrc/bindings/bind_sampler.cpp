// Python bindings of SamplingParams and the Sampler.
#include <torch/csrc/utils/pybind.h>
#include <pybind11/stl.h>

#include "bindings/bindings.h"
#include "kvserve/sampler.h"

namespace py = pybind11;

namespace kvserve::bindings {

void bind_sampler(py::module_& m) {
  py::class_<SamplingParams>(m, "SamplingParams",
                             "How a request samples and when it stops; temperature=0 is greedy.")
      .def(py::init([](double temperature, int64_t top_k, double top_p, double min_p,
                       std::optional<uint64_t> seed, int64_t max_tokens, bool ignore_eos,
                       std::optional<std::vector<int64_t>> stop_token_ids) {
             SamplingParams p;
             p.temperature = temperature;
             p.top_k = top_k;
             p.top_p = top_p;
             p.min_p = min_p;
             p.seed = seed;
             p.max_tokens = max_tokens;
             p.ignore_eos = ignore_eos;
             p.stop_token_ids = stop_token_ids.value_or(std::vector<int64_t>{});
             p.validate();
             return p;
           }),
           py::kw_only(), py::arg("temperature") = 1.0, py::arg("top_k") = -1,
           py::arg("top_p") = 1.0, py::arg("min_p") = 0.0, py::arg("seed") = py::none(),
           py::arg("max_tokens") = 16, py::arg("ignore_eos") = false,
           py::arg("stop_token_ids") = py::none())
      .def_readwrite("temperature", &SamplingParams::temperature)
      .def_readwrite("top_k", &SamplingParams::top_k)
      .def_readwrite("top_p", &SamplingParams::top_p)
      .def_readwrite("min_p", &SamplingParams::min_p)
      .def_readwrite("seed", &SamplingParams::seed)
      .def_readwrite("max_tokens", &SamplingParams::max_tokens)
      .def_readwrite("ignore_eos", &SamplingParams::ignore_eos)
      .def_readwrite("stop_token_ids", &SamplingParams::stop_token_ids)
      .def("validate", &SamplingParams::validate)
      .def("__repr__", &SamplingParams::repr);

  py::class_<RequestRandom>(m, "RequestRandom", "The random stream of one request.")
      .def(py::init<std::optional<uint64_t>>(), py::arg("seed") = py::none())
      .def("next_uniform", &RequestRandom::next_uniform);

  py::class_<Sampler>(m, "Sampler")
      .def(py::init<>())
      .def(
          "sample",
          [](const Sampler& sampler, at::Tensor logits, const std::vector<SamplingParams>& params,
             std::vector<RequestRandom*> randoms) {
            std::vector<const SamplingParams*> ptrs;
            for (const auto& p : params) ptrs.push_back(&p);
            return sampler.sample(logits, ptrs, randoms);
          },
          py::arg("logits"), py::arg("params"), py::arg("randoms"),
          "Next tokens int64 [rows] for fp32 logits [rows, vocab] (filtered in place).");
}

}  // namespace kvserve::bindings
