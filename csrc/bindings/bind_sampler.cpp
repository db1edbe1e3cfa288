// Python bindings of SamplingParams and the Sampler.
#include <torch/csrc/utils/pybind.h>
#include <pybind11/stl.h>

#include <map>
#include <sstream>
#include <string>
#include <variant>

#include "bindings/bindings.h"
#include "kvserve/sampler.h"

namespace py = pybind11;

namespace kvserve::bindings {
namespace {

/// A seed from Python: None, or an int in [0, 2**64). Anything else is a ValueError / TypeError
/// naming the field (pybind's own conversion error would print the whole signature).
std::optional<uint64_t> seed_from_python(const py::handle& seed) {
  if (seed.is_none()) return std::nullopt;
  if (!PyLong_Check(seed.ptr()) || PyBool_Check(seed.ptr())) {
    throw py::type_error("seed must be None or an integer, got " +
                         std::string(py::str(py::type::of(seed).attr("__name__"))));
  }
  const unsigned long long value = PyLong_AsUnsignedLongLong(seed.ptr());
  if (PyErr_Occurred()) {
    PyErr_Clear();
    throw py::value_error("seed must be in [0, 2**64), got " + std::string(py::str(seed)));
  }
  return static_cast<uint64_t>(value);
}

}  // namespace

void bind_sampler(py::module_& m) {
  py::class_<SamplingParams>(m, "SamplingParams",
                             "How a request samples and when it stops; temperature=0 is greedy.")
      .def(py::init([](int64_t n, double temperature, int64_t top_k, double top_p, double min_p,
                       double repetition_penalty, double presence_penalty,
                       double frequency_penalty, const py::object& seed, int64_t max_tokens,
                       int64_t min_tokens, bool ignore_eos,
                       std::optional<std::vector<int64_t>> stop_token_ids,
                       std::optional<std::variant<std::string, std::vector<std::string>>> stop,
                       bool include_stop_str_in_output, std::optional<int64_t> logprobs,
                       std::optional<int64_t> prompt_logprobs,
                       std::optional<std::map<int64_t, double>> logit_bias,
                       std::optional<std::vector<int64_t>> allowed_token_ids,
                       std::optional<int64_t> truncate_prompt_tokens,
                       std::optional<std::vector<std::string>> bad_words) {
             SamplingParams p;
             p.n = n;
             p.temperature = temperature;
             p.top_k = top_k;
             p.top_p = top_p;
             p.min_p = min_p;
             p.repetition_penalty = repetition_penalty;
             p.presence_penalty = presence_penalty;
             p.frequency_penalty = frequency_penalty;
             p.seed = seed_from_python(seed);
             p.max_tokens = max_tokens;
             p.min_tokens = min_tokens;
             p.ignore_eos = ignore_eos;
             p.stop_token_ids = stop_token_ids.value_or(std::vector<int64_t>{});
             if (stop && std::holds_alternative<std::string>(*stop)) {
               p.stop = {std::get<std::string>(*stop)};  // one string, as the OpenAI API allows
             } else if (stop) {
               p.stop = std::get<std::vector<std::string>>(*stop);
             }
             p.include_stop_str_in_output = include_stop_str_in_output;
             p.logprobs = logprobs;
             p.prompt_logprobs = prompt_logprobs;
             p.logit_bias = logit_bias.value_or(std::map<int64_t, double>{});
             p.allowed_token_ids = std::move(allowed_token_ids);
             p.truncate_prompt_tokens = truncate_prompt_tokens;
             p.bad_words = bad_words.value_or(std::vector<std::string>{});
             p.validate();
             return p;
           }),
           py::kw_only(), py::arg("n") = 1, py::arg("temperature") = 1.0, py::arg("top_k") = -1,
           py::arg("top_p") = 1.0, py::arg("min_p") = 0.0, py::arg("repetition_penalty") = 1.0,
           py::arg("presence_penalty") = 0.0, py::arg("frequency_penalty") = 0.0,
           py::arg("seed") = py::none(), py::arg("max_tokens") = 16, py::arg("min_tokens") = 0,
           py::arg("ignore_eos") = false, py::arg("stop_token_ids") = py::none(),
           py::arg("stop") = py::none(), py::arg("include_stop_str_in_output") = false,
           py::arg("logprobs") = py::none(), py::arg("prompt_logprobs") = py::none(),
           py::arg("logit_bias") = py::none(), py::arg("allowed_token_ids") = py::none(),
           py::arg("truncate_prompt_tokens") = py::none(), py::arg("bad_words") = py::none())
      .def_readwrite("n", &SamplingParams::n)
      .def_readwrite("temperature", &SamplingParams::temperature)
      .def_readwrite("top_k", &SamplingParams::top_k)
      .def_readwrite("top_p", &SamplingParams::top_p)
      .def_readwrite("min_p", &SamplingParams::min_p)
      .def_readwrite("repetition_penalty", &SamplingParams::repetition_penalty)
      .def_readwrite("presence_penalty", &SamplingParams::presence_penalty)
      .def_readwrite("frequency_penalty", &SamplingParams::frequency_penalty)
      .def_property(
          "seed", [](const SamplingParams& p) { return p.seed; },
          [](SamplingParams& p, const py::object& seed) { p.seed = seed_from_python(seed); })
      .def_readwrite("max_tokens", &SamplingParams::max_tokens)
      .def_readwrite("min_tokens", &SamplingParams::min_tokens)
      .def_readwrite("ignore_eos", &SamplingParams::ignore_eos)
      .def_readwrite("stop_token_ids", &SamplingParams::stop_token_ids)
      .def_readwrite("stop", &SamplingParams::stop)
      .def_readwrite("include_stop_str_in_output", &SamplingParams::include_stop_str_in_output)
      .def_readwrite("logprobs", &SamplingParams::logprobs)
      .def_readwrite("prompt_logprobs", &SamplingParams::prompt_logprobs)
      .def_readwrite("logit_bias", &SamplingParams::logit_bias)
      .def_readwrite("allowed_token_ids", &SamplingParams::allowed_token_ids)
      .def_readwrite("truncate_prompt_tokens", &SamplingParams::truncate_prompt_tokens)
      .def_readwrite("bad_words", &SamplingParams::bad_words)
      .def_readwrite("bad_words_token_ids", &SamplingParams::bad_words_token_ids,
                     "the token sequences banned; LLMEngine.add_request fills them from bad_words")
      .def("__copy__", [](const SamplingParams& p) { return p; })
      .def("__deepcopy__", [](const SamplingParams& p, const py::dict&) { return p; })
      .def("validate", &SamplingParams::validate);  // __repr__: kvserve/sampling_params.py

  py::class_<TokenLogprobs>(m, "TokenLogprobs",
                            "Log-probabilities of one sampled token, from the raw logits.")
      .def(py::init<>())
      .def_readwrite("token_id", &TokenLogprobs::token_id)
      .def_readwrite("logprob", &TokenLogprobs::logprob)
      .def_readwrite("rank", &TokenLogprobs::rank, "1-based; tokens at least as likely")
      .def_readwrite("top", &TokenLogprobs::top, "[(token_id, logprob)], most likely first")
      .def("__repr__", [](const TokenLogprobs& t) {
        std::ostringstream out;
        out << "TokenLogprobs(token_id=" << t.token_id << ", logprob=" << t.logprob
            << ", rank=" << t.rank << ", top=[";
        for (size_t i = 0; i < t.top.size(); ++i) {
          out << (i ? ", " : "") << '(' << t.top[i].first << ", " << t.top[i].second << ')';
        }
        out << "])";
        return out.str();
      });

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
          "Next tokens int64 [rows] for fp32 logits [rows, vocab] (filtered in place); "
          "temperature, top-k, top-p and min-p only.")
      .def(
          "sample_rows",
          [](const Sampler& sampler, at::Tensor logits, const std::vector<SamplingParams>& params,
             std::vector<RequestRandom*> randoms,
             std::optional<std::vector<std::vector<int64_t>>> prompt_token_ids,
             std::optional<std::vector<std::vector<int64_t>>> output_token_ids,
             std::vector<int64_t> eos_token_ids) {
            const size_t num_rows = params.size();
            const std::vector<std::vector<int64_t>> none(num_rows);
            const auto& prompts = prompt_token_ids ? *prompt_token_ids : none;
            const auto& outputs = output_token_ids ? *output_token_ids : none;
            TORCH_CHECK(randoms.size() == num_rows && prompts.size() == num_rows &&
                            outputs.size() == num_rows,
                        "Sampler: need one SamplingParams, random stream, prompt and output "
                        "token list per row");
            std::vector<SamplingRow> rows(num_rows);
            for (size_t r = 0; r < num_rows; ++r) {
              rows[r] = SamplingRow{&params[r], randoms[r], &prompts[r], &outputs[r],
                                    &eos_token_ids};
            }
            SamplerOutput out = sampler.sample(logits, rows);
            return std::make_pair(out.token_ids, std::move(out.logprobs));
          },
          py::arg("logits"), py::arg("params"), py::arg("randoms"),
          py::arg("prompt_token_ids") = py::none(), py::arg("output_token_ids") = py::none(),
          py::arg("eos_token_ids") = std::vector<int64_t>{},
          "(tokens int64 [rows], [TokenLogprobs or None per row]) for fp32 logits [rows, vocab] "
          "(changed in place): logprobs from the raw logits, then min_tokens, penalties and "
          "filters. Token id lists: one per row (None: all empty).");
}

}  // namespace kvserve::bindings
